"""The static plan: every kernel choice is a field of a frozen, hashable `KernelPolicy`.

`Plan(config, policy, sharding)` is the one static argument of the model's jitted functions (`forward`,
`prefill`, `decode_step`, `decode_loop`): it is part of their compile key, so two plans that
differ in any field compile to two executables, and nothing else read at trace time changes
what is compiled. Each default is today's measured best (benchmarks/DECISIONS.md says how it
was measured); `KernelPolicy.reference()` is pure jnp everywhere, `KernelPolicy(interpret=True)`
runs the Pallas kernels in interpret mode (CPU tests), `KernelPolicy.deterministic()` decodes
bitwise repeatably and batch-invariantly (see its docstring for what that covers). `sharding` (jaxinfer/sharding.py: the mesh and the
rules resolved for the config) is None on one device.
"""

from __future__ import annotations

import dataclasses
import enum

from jaxinfer.configs import Config
from jaxinfer.sharding import Sharding
from pallas_kernels import DecodeBlockSizes, MatmulBlockSizes, MLABlockSizes, MoEBlockSizes


class Kernels(enum.Enum):
    """Which implementation the ops take."""
    AUTO = "auto"  # Pallas on an NVIDIA GPU (or under interpret=True) for 16-bit activations
    PALLAS = "pallas"  # Pallas wherever a kernel takes the inputs (lowering for a GPU on a CPU)
    REFERENCE = "reference"  # the pure-jnp references everywhere


class Boundary(enum.Enum):
    """Where a pre-norm sublayer boundary (residual add + RMSNorm) runs on the fused decode path."""
    XLA = "xla"  # XLA sums the split-K chunks into the residual, then the RMSNorm kernel
    KERNEL = "kernel"  # add_rms_norm: the chunks' sum, the add and the norm in one kernel
    CONSUMER = "consumer"  # inside the main loop of the matmul that reads the normed stream


class At(enum.Enum):
    """When a producer kernel's programs prefetch their consumer's first weight rows."""
    START = "start"
    END = "end"


class Impl(enum.Enum):
    """A matmul that has both: XLA's dot or our fused Pallas kernel."""
    XLA = "xla"
    PALLAS = "pallas"


class Flash(enum.Enum):
    """The prefill flash-attention backend."""
    AUTO = "auto"  # Mosaic GPU on Hopper where the shapes need no padding, else Triton
    TRITON = "triton"
    MOSAIC = "mosaic"


class MoEImpl(enum.Enum):
    """How a MoE layer runs its routed experts (jaxinfer/ops/moe.py)."""
    # PALLAS where the kernels run (a GPU or interpret=True) for 16-bit activations, else
    # GATHER at most moe_decode_rows token rows and RAGGED_DOT above
    AUTO = "auto"
    # pallas_kernels/moe.py: the decode kernel at most moe_decode_rows token rows, the grouped
    # GEMM above (float32 activations too); without a GPU or interpret, as AUTO
    PALLAS = "pallas"
    RAGGED_DOT = "ragged_dot"  # tokens sorted by expert, one grouped matmul (jax.lax.ragged_dot)
    GATHER = "gather"  # each token's k chosen experts' weights taken and applied (decode)
    DENSE = "dense"  # every expert on every token, unchosen weights zero (the reference)


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """A producer kernel asks the L2 for the first `rows` rows of each of its consumer's K
    chunks, at the start or the end of its own weight stream."""
    rows: int
    at: At = At.END

    def __post_init__(self):
        if not isinstance(self.rows, int) or isinstance(self.rows, bool) or self.rows < 1:
            raise ValueError(f"Prefetch.rows={self.rows!r}: must be an integer >= 1")
        if not isinstance(self.at, At):
            raise ValueError(f"Prefetch.at={self.at!r}: must be an At (At.START or At.END)")


def _check_int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"KernelPolicy.{name}={value!r}: must be an integer >= {low}")


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    """Every kernel choice of the model's ops (see the module docstring)."""

    kernels: Kernels = Kernels.AUTO
    interpret: bool = False  # run the Pallas kernels in interpret mode (CPU)
    # Decode batches of at most this many rows (B * T) run the fused small-M matmuls
    # (norm in the prologue, split-K partials); larger ones XLA's GEMMs. Not read under
    # batch_invariant, where every matmul runs the fused kernels (MoE's experts aside: moe.py).
    fused_rows: int = 16
    # The three sublayer boundaries of the fused decode path: before a norm_linear (the
    # MLP -> next attention one), before a gated_mlp (attention -> MLP) and before the LM head.
    norm_linear_boundary: Boundary = Boundary.CONSUMER
    gated_mlp_boundary: Boundary = Boundary.CONSUMER
    lm_head_boundary: Boundary = Boundary.KERNEL
    # Decode batches of at most this many rows run the MLP as one kernel (swiglu_down: the
    # down projection summed by float32 atomics, whose order varies run to run); 0: never.
    one_kernel_mlp_rows: int = 1
    # L2 prefetch of a consumer's first weight rows by the kernel before it (None: off).
    prefetch_norm_linear: Prefetch | None = Prefetch(64, At.END)  # the down projection: q/k/v's
    prefetch_down: Prefetch | None = Prefetch(128, At.START)  # SwiGLU: the down projection's
    prefetch_gated_mlp: Prefetch | None = None  # the o projection: SwiGLU's
    lm_head: Impl = Impl.XLA
    flash: Flash = Flash.AUTO
    # Kernels and tiles picked from the weight shapes, never from the rows M = B * T: every
    # matmul (q/k/v, o, gate/up, down, the LM head), decode or prefill, through the fused
    # Pallas kernels at one set of tiles per weight shape (block_m 16, K split by K and N
    # only, the chunks summed in order), every norm through the Pallas RMSNorm kernels,
    # decode attention split into `attention_chunk`-key chunks merged in a fixed order, no
    # one-row fast path. A row's matmul, norm and MLP results then do not depend on the batch
    # size, the other rows or how a prompt is chunked (KernelPolicy.deterministic says what
    # else does).
    batch_invariant: bool = False
    # Quantized weights the Mosaic GPU kernel takes (int4 / int8 / fp8 and GGUF's Q4_0 ... Q6_K,
    # groups of 16 to 128: pallas_kernels/quantized_mgpu.nk_unfit) at decode rows (<= 64):
    # "mosaic" repacks them K-contiguous per output column for that kernel, "triton" keeps the
    # fused Triton kernels' tiles; "auto": mosaic on Hopper GPUs (kernels on, not
    # batch_invariant, not sharded), else triton.
    quant_matmul: str = "auto"
    # The most rows (B * T) an nk weight's matmul takes through the Mosaic GPU kernel (at most
    # its 64); more dequantize the weight and take XLA's dot (prefill).
    mosaic_int_rows: int = 64
    # The most rows (B * T, at most 8) whose pre-norm boundary before q/k/v (residual add,
    # RMSNorm) runs in the Mosaic kernel's main loop (formats without offsets), as the bf16
    # path's fused kernels do; more rows, or 0, take the add_rms_norm kernel before it. Each
    # of the launch's programs redoes the boundary for its K range: at 3 stages a step measured
    # 1.1-2.1% faster than with add_rms_norm (H100, benchmarks/DECISIONS.md, sessions 20-22;
    # before gate / up, 1792 programs, it was 7% slower and is not offered).
    mosaic_norm_rows: int = 8
    # 4-bit codes repacked for the Mosaic kernel in fragment order (pallas_kernels/quantized
    # .to_frag): loaded straight into the MMA's registers, converted in place, no shuffles
    # (21% fewer instructions; 4.5% faster end to end at Llama-3-8B B=1 on the H100:
    # benchmarks/DECISIONS.md, sessions 17-18).
    int4_fragment_order: bool = True
    attention_chunk: int = 512
    # Tile overrides for sweeps: ((K, N, weights), MatmulBlockSizes) pairs for the fused
    # matmuls, and the decode attention kernels' block sizes.
    matmul_tiles: tuple = ()
    attention_blocks: DecodeBlockSizes | None = None
    mla_blocks: MLABlockSizes | None = None  # the absorbed MLA decode kernel's (None: its own)
    # T > 1 queries per row against a cache: up to this many take the split-K
    # verify_attention kernels (a speculative verification at a long context), more the
    # chunk kernels (a prefill chunk). Not measured on the H200 yet.
    verify_queries: int = 16
    # Decode steps per host check of the device loop, with stop tokens and without.
    steps_per_sync: int = 1
    steps_per_sync_no_stop: int = 8
    # Prompts longer than this prefill in chunks of this many tokens, each attending to the
    # cache (one executable for every chunk, a progress tick per chunk). None: 1024 on CPU,
    # where the reference attention's [T, S] scores of a one-shot 8k prefill take GBs;
    # one shot elsewhere (flash attention). 0: always one shot.
    prefill_chunk: int | None = None
    # Off the kernels' path (the CPU), a quantized weight's matmul dequantizes it one column
    # tile of about this many float32 bytes at a time, inside the step (jaxinfer/ops/
    # blocked.py): the model then holds its codes, not every layer's float32 copy. None: on
    # CPU half the last-level cache within 8-32 MiB (blocked.cpu_block_bytes), 0 elsewhere;
    # 0: the whole model dequantized once per request (run_params).
    dequant_block_bytes: int | None = None
    # On the CPU, at most this many rows (B * T) of a quantized weight's matmul run
    # pallas_kernels/cpu_quantized.cc (built on first use) where it takes the format: 1.7-5x
    # the tiles above at one row, even with them at 16-32 (benchmarks/DECISIONS.md). More
    # rows, 0, or where it cannot be built: the tiles.
    cpu_quantized_rows: int = 16
    # On the CPU, a quantized weight's matmul takes x rounded to int8 per 16 values, as
    # llama.cpp rounds its activations: the C++ kernel's products are then integer dots
    # (1.2-1.6x faster at one row with AVX2) and the tiles and prefills take the same rounded
    # x. Off by default: outputs are then those of the dequantized weights, as transformers
    # gives them (the rounding moves logprobs ~1% and flips near-ties: the embedded model's
    # first answer token to llama.cpp's). `jaxinfer ... --int8-activations` turns it on.
    cpu_int8_activations: bool = False
    # MoE experts: the implementation, and the most token rows (B * T) that take the decode
    # path (one kernel row per token-expert assignment: experts that tokens share are read
    # once per token) rather than the grouped GEMM (rows sorted by expert: each expert read
    # once, after a sort). None: E // (4 k), at least 1, where shared experts cost at most
    # ~1/8 more bytes (Mixtral 1, Qwen3-30B-A3B 4; benchmarks/moe.py measures both).
    moe: MoEImpl = MoEImpl.AUTO
    moe_decode_rows: int | None = None
    # The most token rows (B * T) whose router (logits, scores, top-k, weights) runs as
    # pallas_kernels/moe_route.py's kernels (with the boundary before it where that is
    # add_rms_norm's) where the kernels are on, for routers without groups or a score bias;
    # more rows, or 0, take XLA's ops (~7 launches a layer at decode). Under batch_invariant
    # any value but 0 means every row count. A row's float32 router [D, E] is split into at
    # least moe_route_blocks blocks of D rows, each of at most moe_route_block_bytes, one
    # program each, and a second launch sums their logits and picks (1 block: one program a
    # row, one launch). 16 blocks were the fastest or within 0.2% of it for Mixtral's,
    # DeepSeek-V2-Lite's and Qwen3-30B-A3B's routers (benchmarks/DECISIONS.md).
    moe_route_rows: int = 16
    moe_route_blocks: int = 16
    moe_route_block_bytes: int = 64 * 1024
    # The MoE kernels' tiles (None: pallas_kernels.moe's defaults for the shapes).
    moe_decode_blocks: MoEBlockSizes | None = None
    moe_grouped_blocks: MoEBlockSizes | None = None

    def __post_init__(self):
        for name, kind in (("kernels", Kernels), ("norm_linear_boundary", Boundary),
                           ("gated_mlp_boundary", Boundary), ("lm_head_boundary", Boundary),
                           ("lm_head", Impl), ("flash", Flash), ("moe", MoEImpl)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"KernelPolicy.{name}={getattr(self, name)!r}: must be a "
                                 f"{kind.__name__} ({', '.join(k.name for k in kind)})")
        for name in ("interpret", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"KernelPolicy.{name}={getattr(self, name)!r}: must be a bool")
        for name in ("prefetch_norm_linear", "prefetch_down", "prefetch_gated_mlp"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Prefetch):
                raise ValueError(f"KernelPolicy.{name}={value!r}: must be a Prefetch or None")
        if self.quant_matmul not in ("auto", "mosaic", "triton"):
            raise ValueError(f"KernelPolicy.quant_matmul={self.quant_matmul!r}: one of 'auto', "
                             f"'mosaic', 'triton'")
        _check_int("fused_rows", self.fused_rows, 0)
        _check_int("mosaic_int_rows", self.mosaic_int_rows, 0)
        _check_int("mosaic_norm_rows", self.mosaic_norm_rows, 0)
        _check_int("moe_route_rows", self.moe_route_rows, 0)
        _check_int("moe_route_blocks", self.moe_route_blocks, 1)
        _check_int("moe_route_block_bytes", self.moe_route_block_bytes, 1)
        if self.mosaic_norm_rows > 8:
            raise ValueError(f"KernelPolicy.mosaic_norm_rows={self.mosaic_norm_rows}: the "
                             f"Mosaic kernel's boundary takes at most 8 rows")
        if self.mosaic_int_rows > 64:
            raise ValueError(f"KernelPolicy.mosaic_int_rows={self.mosaic_int_rows}: the Mosaic "
                             f"GPU kernel takes at most 64 rows")
        _check_int("one_kernel_mlp_rows", self.one_kernel_mlp_rows, 0)
        _check_int("attention_chunk", self.attention_chunk, 16)
        _check_int("steps_per_sync", self.steps_per_sync, 1)
        _check_int("steps_per_sync_no_stop", self.steps_per_sync_no_stop, 1)
        if self.moe_decode_rows is not None:
            _check_int("moe_decode_rows", self.moe_decode_rows, 0)
        if self.prefill_chunk is not None:
            _check_int("prefill_chunk", self.prefill_chunk, 0)
        if self.dequant_block_bytes is not None:
            _check_int("dequant_block_bytes", self.dequant_block_bytes, 0)
        _check_int("cpu_quantized_rows", self.cpu_quantized_rows, 0)
        if self.attention_chunk & (self.attention_chunk - 1):
            raise ValueError(f"KernelPolicy.attention_chunk={self.attention_chunk}: must be a "
                             f"power of two (whole key tiles)")
        if self.attention_blocks is not None and not isinstance(self.attention_blocks,
                                                                DecodeBlockSizes):
            raise ValueError("KernelPolicy.attention_blocks must be a DecodeBlockSizes or None")
        if self.mla_blocks is not None and not isinstance(self.mla_blocks, MLABlockSizes):
            raise ValueError("KernelPolicy.mla_blocks must be an MLABlockSizes or None")
        for name in ("moe_decode_blocks", "moe_grouped_blocks"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, MoEBlockSizes):
                raise ValueError(f"KernelPolicy.{name} must be a MoEBlockSizes or None, got "
                                 f"{value!r}")
        for pair in self.matmul_tiles:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1],
                                                                            MatmulBlockSizes)
                    and isinstance(pair[0], tuple) and len(pair[0]) == 3):
                raise ValueError(f"KernelPolicy.matmul_tiles takes ((K, N, weights), "
                                 f"MatmulBlockSizes) pairs, got {pair!r}")
        if self.batch_invariant:
            wrong = []
            if self.one_kernel_mlp_rows:
                wrong.append("one_kernel_mlp_rows=0 (the one-kernel MLP runs at some batches, "
                             "not others, and adds in a varying order)")
            if self.lm_head is not Impl.PALLAS:
                wrong.append("lm_head=Impl.PALLAS (XLA picks its GEMM by the batch)")
            if self.flash is Flash.AUTO:
                wrong.append("flash=Flash.TRITON or MOSAIC (AUTO picks by the prompt length)")
            if self.kernels is Kernels.REFERENCE:
                wrong.append("kernels=Kernels.AUTO or PALLAS (the references are XLA's dots, "
                             "whose GEMM XLA picks by the batch)")
            if wrong:
                raise ValueError("KernelPolicy(batch_invariant=True) needs " + "; ".join(wrong)
                                 + "; KernelPolicy.deterministic() sets them")

    def replace(self, **changes) -> KernelPolicy:
        return dataclasses.replace(self, **changes)

    def with_text(self, setting: str) -> KernelPolicy:
        """The policy with one field set from "FIELD=VALUE" (`jaxinfer bench --policy-field`):
        a bool (true / false), an int, a string, an enum member's name or value, or
        "none" where the field may be None. Fields holding tiles or tuples are set in Python."""
        name, sep, text = setting.partition("=")
        name, text = name.strip(), text.strip()
        fields = {f.name: f for f in dataclasses.fields(self)}
        if not sep or name not in fields:
            raise ValueError(f"policy setting {setting!r}: expected FIELD=VALUE with FIELD one "
                             f"of KernelPolicy's: {', '.join(fields)}")
        current, kind = getattr(self, name), str(fields[name].type)
        if text.lower() == "none" and "None" in kind:
            return self.replace(**{name: None})
        try:
            if isinstance(current, enum.Enum):
                cls = type(current)
                value = next((m for m in cls if text in (m.name, m.name.lower(), m.value)),
                             None)
                if value is None:
                    raise ValueError(f"one of {', '.join(m.name.lower() for m in cls)}")
            elif isinstance(current, bool) or kind == "bool":
                if text.lower() not in ("true", "false"):
                    raise ValueError("true or false")
                value = text.lower() == "true"
            elif isinstance(current, int) or kind.startswith("int"):
                if not text.lstrip("-").isdigit():
                    raise ValueError(f"an integer, not {text!r}")
                value = int(text)
            elif isinstance(current, str):
                value = text
            else:
                raise ValueError(f"a {kind} (set it in Python: KernelPolicy(...))")
        except ValueError as e:
            raise ValueError(f"policy setting {setting!r}: {name} takes {e}") from None
        return self.replace(**{name: value})

    @classmethod
    def reference(cls) -> KernelPolicy:
        """Pure jnp everywhere (the references the kernels are tested against)."""
        return cls(kernels=Kernels.REFERENCE)

    @classmethod
    def deterministic(cls, **changes) -> KernelPolicy:
        """Bitwise repeatable run to run (no float atomics) and batch-invariant at any batch
        size: a row's logits (so its tokens and logprobs) do not depend on the batch size B,
        the other rows' contents or its index in the batch; and every matmul, norm and MLP
        result of a prefill token is the same bits whatever the number of tokens T
        processed with it (a prompt in one call or in chunks). Attention of every T runs
        the paged chunk kernel, a contiguous cache read as pages of 64 (so generate() and
        the engine at its default page size give a request the same bits); not covered: a
        contiguous cache not a multiple of 64 slots (a max_seq_len such), MoE experts
        above fused_rows rows or at T > 1 (the grouped kernel), MLA attention (its kernel's
        split-K count follows the batch), norm_offset (Gemma) norms (jnp), and sharded
        plans (XLA's GEMMs). Costs: benchmarks/DECISIONS.md."""
        return cls(**{"one_kernel_mlp_rows": 0, "lm_head": Impl.PALLAS,
                      "flash": Flash.TRITON, "batch_invariant": True, **changes})

    def decode_rows(self, num_experts: int, experts_per_token: int) -> int:
        """moe_decode_rows, or its default for this many experts."""
        if self.moe_decode_rows is not None:
            return self.moe_decode_rows
        return max(1, num_experts // (4 * experts_per_token))

    def tiles(self, k: int, n: int, weights: int) -> MatmulBlockSizes | None:
        """The override for a fused matmul of K x N (1 or 2 weights), or None."""
        for key, blocks in self.matmul_tiles:
            if key == (k, n, weights):
                return blocks
        return None


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a compiled model function is specialised on: the model's shapes, the kernels and
    the devices (None: one device)."""

    config: Config
    policy: KernelPolicy = KernelPolicy()
    sharding: Sharding | None = None

    def __post_init__(self):
        if not isinstance(self.config, Config):
            raise ValueError(f"Plan.config must be a Config, got {type(self.config).__name__}")
        if not isinstance(self.policy, KernelPolicy):
            raise ValueError(f"Plan.policy must be a KernelPolicy, got "
                             f"{type(self.policy).__name__}")
        if self.sharding is not None and not isinstance(self.sharding, Sharding):
            raise ValueError(f"Plan.sharding must be a jaxinfer.sharding.Sharding or None, got "
                             f"{type(self.sharding).__name__}")

    @property
    def sharded(self) -> bool:
        """Whether the plan spans more than one device."""
        return self.sharding is not None and self.sharding.devices > 1

    def local(self) -> Plan:
        """The plan of one device's shard (inside shard_map: no sharding)."""
        return dataclasses.replace(self, sharding=None)

    def loop_free(self) -> Plan:
        """The plan with the device loop's host-sync fields at their defaults: the programs that
        run no decode loop (a prefill, one step) do not read them, so a plan that changes only
        those fields reuses their executables (the plan is their jit key)."""
        default = KernelPolicy()
        return dataclasses.replace(self, policy=self.policy.replace(
            steps_per_sync=default.steps_per_sync,
            steps_per_sync_no_stop=default.steps_per_sync_no_stop))
