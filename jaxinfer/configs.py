"""One frozen, hashable `Config` for every model family, and presets for benchmarks.

`Config` is static under `jax.jit` (it is hashable), so model code can branch on its fields
at trace time. Converters from HF `config.json` and GGUF metadata live in `checkpoints/`.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from typing import Literal

RopeKind = Literal["default", "linear", "dynamic", "llama3", "yarn"]
DTYPES = ("float32", "bfloat16", "float16")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """HF `rope_scaling` / `rope_parameters`, one field per knob any variant reads."""

    kind: RopeKind = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A Mixture-of-Experts MLP: how tokens are routed and which layers have experts.

    Routers (ops/moe.py `route`): "softmax" over all experts (Mixtral, Qwen3-MoE, DeepSeek-V2)
    or "sigmoid" per expert (DeepSeek-V3, whose `score_bias` shifts the scores for choosing
    experts only). With n_group > 1 a token first keeps the topk_group best groups of
    num_experts / n_group experts, a group scored by its best expert ("max": DeepSeek-V2's
    group_limited_greedy) or the sum of its best two ("top2_sum": DeepSeek-V3's noaux_tc).
    """

    num_experts: int
    experts_per_token: int  # top-k
    expert_intermediate_size: int
    router: str = "softmax"  # "softmax" | "sigmoid"
    norm_topk_prob: bool = False  # renormalise the k chosen weights to sum to 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    group_scoring: str = "max"  # "max" | "top2_sum"
    score_bias: bool = False  # a float32 [E] bias added to the scores for the choice only
    num_shared_experts: int = 0
    shared_intermediate_size: int | None = None  # None: num_shared_experts * expert size
    first_dense_layers: int = 0  # DeepSeek first_k_dense_replace
    sparse_step: int = 1  # Qwen3-MoE decoder_sparse_step: layer i has experts iff (i+1) % step == 0
    dense_layers: tuple[int, ...] = ()  # Qwen3-MoE mlp_only_layers

    def __post_init__(self):
        problems = []
        for name in ("num_experts", "experts_per_token", "expert_intermediate_size", "n_group",
                     "topk_group", "sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("num_shared_experts", "first_dense_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                problems.append(f"{name} must be an integer >= 0, got {value!r}")
        if problems:  # the checks below need these to be integers
            raise ValueError("invalid MoE config: " + "; ".join(problems))
        e, k, g = self.num_experts, self.experts_per_token, self.n_group
        if self.router not in ("softmax", "sigmoid"):
            problems.append(f"router must be 'softmax' or 'sigmoid', got {self.router!r}")
        if self.group_scoring not in ("max", "top2_sum"):
            problems.append(f"group_scoring must be 'max' or 'top2_sum', got "
                            f"{self.group_scoring!r}")
        if k > e:
            problems.append(f"experts_per_token ({k}) must be at most num_experts ({e})")
        if e % g:
            problems.append(f"n_group ({g}) must divide num_experts ({e})")
        elif self.topk_group > g:
            problems.append(f"topk_group ({self.topk_group}) must be at most n_group ({g})")
        elif k > self.topk_group * (e // g):
            problems.append(f"experts_per_token ({k}) does not fit in the topk_group "
                            f"({self.topk_group}) groups of {e // g} experts kept")
        elif g > 1 and self.group_scoring == "top2_sum" and e // g < 2:
            problems.append(f"group_scoring 'top2_sum' needs at least 2 experts per group, "
                            f"got {e // g} ({e} experts in {g} groups)")
        if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            problems.append(f"routed_scaling_factor must be finite and positive, got "
                            f"{self.routed_scaling_factor!r}")
        if self.shared_intermediate_size is not None and (
                not isinstance(self.shared_intermediate_size, int)
                or self.shared_intermediate_size < 1):
            problems.append(f"shared_intermediate_size must be an integer >= 1 or None, got "
                            f"{self.shared_intermediate_size!r}")
        if not isinstance(self.dense_layers, tuple) or not all(
                isinstance(i, int) and i >= 0 for i in self.dense_layers):
            problems.append(f"dense_layers must be a tuple of layer indices >= 0, got "
                            f"{self.dense_layers!r}")
        for name in ("norm_topk_prob", "score_bias"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be a bool, got {getattr(self, name)!r}")
        if problems:
            raise ValueError("invalid MoE config: " + "; ".join(problems))

    @property
    def shared_size(self) -> int:
        """The shared experts' intermediate size (0 without shared experts)."""
        if not self.num_shared_experts:
            return 0
        return (self.shared_intermediate_size
                or self.num_shared_experts * self.expert_intermediate_size)

    def is_moe_layer(self, i: int) -> bool:
        return (i >= self.first_dense_layers and i not in self.dense_layers
                and (i + 1) % self.sparse_step == 0)

    def replace(self, **changes) -> MoEConfig:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention (DeepSeek-V2 / V3): keys and values come from one latent
    per token, c_kv [kv_lora_rank] (RMS-normed) and a RoPE key k_pe [qk_rope_head_dim] shared by
    every head; kv_b_proj expands c_kv to per-head k_nope [qk_nope_head_dim] and v [v_head_dim].
    Queries: q_proj, or with q_lora_rank q_a_proj -> RMSNorm -> q_b_proj. The cache holds only
    the latent (kv_lora_rank + qk_rope_head_dim values per token and layer).

    rope_interleave: RoPE rotates the pairs (x0, x1), (x2, x3), ... of q_pe / k_pe (DeepSeek's
    layout: V2 always, V3 unless its config says otherwise); False: the rotate-half pairs."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True

    def __post_init__(self):
        problems = []
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be an integer >= 1, got {value!r}")
        q = self.q_lora_rank
        if q is not None and (not isinstance(q, int) or isinstance(q, bool) or q < 1):
            problems.append(f"q_lora_rank must be None or an integer >= 1, got {q!r}")
        if not problems and self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
        if not isinstance(self.rope_interleave, bool):
            problems.append(f"rope_interleave must be a bool, got {self.rope_interleave!r}")
        if problems:
            raise ValueError("invalid MLA config: " + "; ".join(problems))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values the cache holds per token and layer: c_kv and the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def attention_params(self, hidden: int, heads: int) -> int:
        """One layer's attention weights (norms included)."""
        q = (hidden * heads * self.qk_head_dim if self.q_lora_rank is None else
             hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads
             * self.qk_head_dim)
        kv = (hidden * self.latent_dim + self.kv_lora_rank
              + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim))
        return q + kv + heads * self.v_head_dim * hidden


@dataclasses.dataclass(frozen=True)
class Config:
    """Shapes and switches of a decoder-only transformer."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    # Per-frequency divisors of the RoPE inverse frequencies ([rotary_dim / 2], () for none):
    # llama.cpp's `rope_freqs.weight`, through which GGUF files carry Llama 3.x scaling.
    rope_freq_factors: tuple[float, ...] = ()
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's `attention_bias` sets this and o_bias
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    # Per-layer sliding window (None = full attention). A query at position p sees keys at
    # positions p - window < k <= p, as HF's sliding-window mask does.
    layer_windows: tuple[int | None, ...] = ()
    dtype: str = "float32"  # params and activations; logits and softmax statistics stay float32
    family: str = "llama"  # the model family (jaxinfer/models/registry.py)
    architecture: str = "LlamaForCausalLM"  # the HF architecture name, for messages
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None  # experts in the layers moe.is_moe_layer(i) says
    # Multi-head latent attention (DeepSeek): then num_kv_heads == num_heads and head_dim is
    # the query/key head dim (qk_nope_head_dim + qk_rope_head_dim); None: GQA attention.
    mla: MLAConfig | None = None
    # --- Gemma 2 / 3 switches (jaxinfer/models/gemma.py); the defaults are Llama's ---------
    mlp_activation: str = "silu"  # the gated MLP's gate: "silu" (SwiGLU) | "gelu_tanh" (GeGLU)
    # RMSNorms scale by (norm_offset + weight), in float32 when nonzero (Gemma: 1 + w)
    norm_offset: float = 0.0
    attn_scale: float | None = None  # softmax scale (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # scores = c * tanh(scores / c) before the mask
    final_softcap: float | None = None  # logits = c * tanh(logits / c)
    embed_scale: float | None = None  # embeddings times this, rounded to the dtype first
    # RoPE base of the sliding-window layers (unscaled); None: every layer uses rope_theta
    rope_local_theta: float | None = None

    def __post_init__(self):
        problems = []
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads ({self.num_heads}) must be a multiple of "
                            f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            problems.append(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            problems.append(f"layer_windows has {len(self.layer_windows)} entries for "
                            f"{self.num_layers} layers")
        if self.rope_freq_factors:
            problems += self._rope_freq_factor_problems()
        if self.moe is not None:
            problems += self._moe_problems()
        if self.mla is not None:
            problems += self._mla_problems()
        problems += self._gemma_problems()
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))

    def _rope_freq_factor_problems(self) -> list[str]:
        factors, half = self.rope_freq_factors, self.rotary_dim // 2
        problems = []
        if len(factors) != half:
            problems.append(f"rope_freq_factors has {len(factors)} entries, expected "
                            f"rotary_dim / 2 = {half}")
        if not all(math.isfinite(f) and f > 0 for f in factors):
            problems.append("rope_freq_factors must be finite and positive")
        # The factors are how GGUF spells llama3 scaling, and dynamic NTK recomputes the
        # frequencies per call: no checkpoint combines them, and the result would be neither.
        if self.rope_scaling.kind in ("llama3", "dynamic"):
            problems.append(f"rope_freq_factors cannot be combined with "
                            f"{self.rope_scaling.kind!r} rope scaling")
        return problems

    def _moe_problems(self) -> list[str]:
        if not isinstance(self.moe, MoEConfig):
            return [f"moe must be a MoEConfig or None, got {type(self.moe).__name__}"]
        outside = [i for i in self.moe.dense_layers if i >= self.num_layers]
        problems = []
        if outside:
            problems.append(f"moe.dense_layers {outside} outside the {self.num_layers} layers")
        if not any(self.moe.is_moe_layer(i) for i in range(self.num_layers)):
            problems.append(f"moe is set but none of the {self.num_layers} layers has experts "
                            f"(first_dense_layers {self.moe.first_dense_layers}, sparse_step "
                            f"{self.moe.sparse_step}, dense_layers {self.moe.dense_layers})")
        return problems

    def _mla_problems(self) -> list[str]:
        mla = self.mla
        if not isinstance(mla, MLAConfig):
            return [f"mla must be an MLAConfig or None, got {type(mla).__name__}"]
        problems = []
        if self.num_kv_heads != self.num_heads:
            problems.append(f"MLA expands its latent to every head: num_kv_heads "
                            f"({self.num_kv_heads}) must equal num_heads ({self.num_heads})")
        if self.head_dim != mla.qk_head_dim:
            problems.append(f"with MLA head_dim ({self.head_dim}) must be qk_nope_head_dim + "
                            f"qk_rope_head_dim ({mla.qk_nope_head_dim} + "
                            f"{mla.qk_rope_head_dim} = {mla.qk_head_dim})")
        if self.partial_rotary_factor != 1.0 or self.rope_freq_factors:
            problems.append("MLA rotates qk_rope_head_dim dims: partial_rotary_factor and "
                            "rope_freq_factors do not apply")
        return problems

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(i)

    def _gemma_problems(self) -> list[str]:
        problems = []
        if self.mlp_activation not in MLP_ACTIVATIONS:
            problems.append(f"mlp_activation must be one of {MLP_ACTIVATIONS}, got "
                            f"{self.mlp_activation!r}")
        for name in ("attn_scale", "attn_softcap", "final_softcap", "embed_scale",
                     "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                problems.append(f"{name} must be a positive number or None, got {value!r}")
        return problems

    @property
    def rotary_dim(self) -> int:
        if self.mla is not None:  # only the decoupled RoPE part of q and k rotates
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)

    def num_params(self, active: bool = False) -> int:
        """Parameter count (embedding and head counted once when tied); active: with only
        the experts one token uses (experts_per_token of each MoE layer's routed experts)."""
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.mla is not None:
            attn = self.mla.attention_params(d, self.num_heads)
        total = 0
        for i in range(self.num_layers):
            total += attn + 2 * d
            if self.is_moe_layer(i):
                m = self.moe
                experts = m.experts_per_token if active else m.num_experts
                total += (d * m.num_experts + (m.num_experts if m.score_bias else 0)
                          + experts * 3 * d * m.expert_intermediate_size + 3 * d * m.shared_size)
            else:
                total += 3 * d * f
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return total + self.vocab_size * d + head + d


# Real shapes for benchmarks with random weights (`jaxinfer bench --preset NAME --random-weights`).
PRESETS: Mapping[str, Config] = types.MappingProxyType({
    "llama3-8b": Config(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", factor=8.0, original_max_position_embeddings=8192),
        max_position_embeddings=131072, dtype="bfloat16", bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009)),
    "llama3-70b": Config(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", factor=8.0, original_max_position_embeddings=8192),
        max_position_embeddings=131072, dtype="bfloat16", bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009)),
    "qwen3-8b": Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, qk_norm=True, dtype="bfloat16",
        architecture="Qwen3ForCausalLM", eos_token_ids=(151645,)),
    # mistralai/Mixtral-8x7B-v0.1 config.json
    "mixtral-8x7b": Config(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=32768, dtype="bfloat16", architecture="MixtralForCausalLM",
        bos_token_id=1, eos_token_ids=(2,),
        moe=MoEConfig(num_experts=8, experts_per_token=2, expert_intermediate_size=14336,
                      norm_topk_prob=True)),
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-30b-a3b": Config(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, qk_norm=True, dtype="bfloat16",
        architecture="Qwen3MoeForCausalLM", bos_token_id=151643, eos_token_ids=(151645,),
        moe=MoEConfig(num_experts=128, experts_per_token=8, expert_intermediate_size=768,
                      norm_topk_prob=True)),
    # deepseek-ai/DeepSeek-V2-Lite config.json (MLA without q_lora_rank, 64 experts top-6)
    "deepseek-v2-lite": Config(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_layers=27,
        num_heads=16, num_kv_heads=16, head_dim=192, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=RopeScaling("yarn", factor=40.0, original_max_position_embeddings=4096,
                                 mscale=0.707, mscale_all_dim=0.707),
        max_position_embeddings=163840, dtype="bfloat16", family="deepseek",
        architecture="DeepseekV2ForCausalLM", bos_token_id=100000, eos_token_ids=(100001,),
        mla=MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                      v_head_dim=128),
        moe=MoEConfig(num_experts=64, experts_per_token=6, expert_intermediate_size=1408,
                      num_shared_experts=2, first_dense_layers=1)),
    # deepseek-ai/DeepSeek-V3 config.json (671B; the MTP layer is not part of the model)
    "deepseek-v3": Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_layers=61,
        num_heads=128, num_kv_heads=128, head_dim=192, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=RopeScaling("yarn", factor=40.0, original_max_position_embeddings=4096,
                                 mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=163840, dtype="bfloat16", family="deepseek",
        architecture="DeepseekV3ForCausalLM", bos_token_id=0, eos_token_ids=(1,),
        mla=MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                      v_head_dim=128, q_lora_rank=1536),
        moe=MoEConfig(num_experts=256, experts_per_token=8, expert_intermediate_size=2048,
                      router="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                      n_group=8, topk_group=4, group_scoring="top2_sum", score_bias=True,
                      num_shared_experts=1, first_dense_layers=3)),
    "smollm2-135m": Config(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, dtype="bfloat16",
        bos_token_id=1, eos_token_ids=(2,)),
})


# Gemma 3 (jaxinfer/models/gemma.py): google/gemma-3-1b-it's config.json and gemma-3-27b-it's
# text_config, with transformers 5.24's Gemma3TextConfig defaults for what they leave out.
_GEMMA3 = dict(rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_theta=10_000.0,
               tie_word_embeddings=True, qk_norm=True, mlp_activation="gelu_tanh",
               norm_offset=1.0, dtype="bfloat16", family="gemma",
               architecture="Gemma3ForCausalLM", bos_token_id=2, eos_token_ids=(1, 106))
PRESETS = types.MappingProxyType({**PRESETS, **{
    "gemma3-1b": Config(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_layers=26,
        num_heads=4, num_kv_heads=1, head_dim=256, max_position_embeddings=32768,
        layer_windows=tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26)),
        attn_scale=256 ** -0.5, embed_scale=1152 ** 0.5, **_GEMMA3),
    "gemma3-27b": Config(
        vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_layers=62,
        num_heads=32, num_kv_heads=16, head_dim=128, max_position_embeddings=131072,
        rope_scaling=RopeScaling("linear", factor=8.0),
        layer_windows=tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(62)),
        attn_scale=168 ** -0.5, embed_scale=5376 ** 0.5, **_GEMMA3),
}})
