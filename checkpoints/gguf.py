"""GGUF checkpoints (llama.cpp's single-file format): metadata, tensors, tokenizer.

`load_gguf(path)` returns (Config, params, Tokenizer) with params as numpy arrays in the model's
own layout (its family's `param_specs`): matmul weights [in, out], one dict per layer, tensor
names from the family's table (jaxinfer/models/registry.py). Matmul weights and the token
embedding of the block types in `checkpoints.gguf_blocks` (Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K) stay
quantized: repacked into `QuantizedWeight`s whose values are bit for bit what the `gguf` package
(`gguf.quants`, the code transformers' GGUF loader uses) dequantizes; the embedding comes back
in the LM-head orientation [D, V]; a MoE layer's stacked experts become one QuantizedWeight per
projection with a leading expert axis on every array (gguf_moe). Everything else, and every
tensor with keep_quantized=False, is dequantized on load by gguf.quants to float32.

Architectures: "llama" (Mixtral too), "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3",
"deepseek2" (`ARCHITECTURES`; the mixture-of-experts and MLA specifics are in
checkpoints/gguf_moe.py). Layout facts the loader undoes (Gemma's norm weights stored as 1 + w:
see GGUFArchitecture.norm_plus_one):
- GGUF lists dimensions fastest-first (ne0 = the input features), so `GGUFReader` gives a
  matmul weight as numpy [out, in], HF's layout; we transpose to [in, out].
- For "llama" only, llama.cpp's converter permutes the rows of attn_q / attn_k (weights and
  biases) within each head so that its RoPE can rotate adjacent pairs (x0, x1), (x2, x3), ...;
  HF (and our model) rotate halves (x_i, x_{i+D/2}). We apply the inverse permutation per head.
  Qwen2/Qwen3 are stored unpermuted: llama.cpp runs them with rotate-half ("NEOX") RoPE.
Llama 3.x files carry their RoPE scaling not as metadata but as a tensor, `rope_freqs.weight`
(one divisor per frequency); it becomes Config.rope_freq_factors rather than a param.

All reading goes through `gguf.GGUFReader`; a truncated or corrupt file raises ValueError naming
the file and where it ends, never a raw numpy/memmap error, and nothing is returned half-built.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import pathlib
from collections.abc import Collection
from typing import Any

import numpy as np

from checkpoints import gguf_blocks, gguf_moe, gguf_reader
from jaxinfer.configs import Config, RopeScaling
from jaxinfer.models import registry
from jaxinfer.weights import Parts, QuantizedWeight

log = logging.getLogger(__name__)

# Tensor types we read: what llama.cpp's common presets (Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0 ...)
# are made of. All but Q2_K / Q3_K can stay quantized (gguf_blocks.BLOCK_TYPES); gguf.quants can
# also dequantize the IQ*, TQ* and FP4 types; those stay refused until a model of ours is
# checked against them.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_FLOAT_TYPES = ("F32", "F16", "BF16")
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency RoPE divisors (see GGUFArchitecture)
TOKEN_EMBD = "token_embd.weight"  # kept quantized like the matmul weights (the engine gathers
                                  # its columns, or uses it as the tied LM head)


@dataclasses.dataclass(frozen=True)
class GGUFArchitecture:
    """What a GGUF `general.architecture` means for our (llama-family) Config and tensors."""

    hf_architecture: str  # Config.architecture
    # llama.cpp's convert_hf_to_gguf.py permutes q_proj / k_proj rows (weights and biases) per
    # head for LlamaModel (`undo_permute = True`, llama.cpp's adjacent-pair RoPE) and leaves
    # Qwen2Model / Qwen3Model as HF has them (llama.cpp rotates halves for those).
    permuted_qk: bool
    qk_norm: bool  # attn_q_norm / attn_k_norm are part of the architecture (llama.cpp needs them)
    # An optional `rope_freqs.weight` [rot / 2] divides each RoPE frequency (llama.cpp's LlamaModel
    # writes it for HF rope_type "llama3" instead of any rope scaling metadata).
    rope_freqs: bool = False
    # llama.cpp's converter stores Gemma's norm weights with the 1 of (1 + weight) added
    # (every tensor ending in "norm.weight"); the loader takes it off once, as transformers'
    # GGUF loader does, and the model adds it back in float32.
    norm_plus_one: bool = False
    experts: bool = False  # llama.cpp reads `{arch}.expert_count` and expert tensors for it


# Biases are optional everywhere (llama.cpp loads whichever the file has), so the Config takes
# them from the tensors present.
ARCHITECTURES = {
    "llama": GGUFArchitecture("LlamaForCausalLM", permuted_qk=True, qk_norm=False,
                              rope_freqs=True, experts=True),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", permuted_qk=False, qk_norm=False),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", permuted_qk=False, qk_norm=True),
    "qwen3moe": GGUFArchitecture("Qwen3MoeForCausalLM", permuted_qk=False, qk_norm=True,
                                 experts=True),
    # MLA + MoE (checkpoints/gguf_moe.py); its RoPE rotates adjacent pairs as DeepSeek's does.
    "deepseek2": GGUFArchitecture("DeepseekV2ForCausalLM", permuted_qk=False, qk_norm=False,
                                  experts=True),
    # Gemma: rotate-half RoPE in llama.cpp too (no permutation).
    "gemma2": GGUFArchitecture("Gemma2ForCausalLM", permuted_qk=False, qk_norm=False,
                               norm_plus_one=True),
    "gemma3": GGUFArchitecture("Gemma3ForCausalLM", permuted_qk=False, qk_norm=True,
                               norm_plus_one=True),
}

# ---------------------------------------------------------------------------------------------
# Reading the file
# ---------------------------------------------------------------------------------------------


def _open(path: str | os.PathLike):
    """Open `path` with the gguf package's reader; errors name the file and the problem."""
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise ValueError(f"{path}: not a file; expected a .gguf checkpoint file")
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{path}: the file is empty (0 bytes); expected a GGUF checkpoint")
    try:
        return gguf_reader.checked_reader_class(SUPPORTED_TYPES)(path, "r")
    except gguf_reader.Truncated as e:
        raise ValueError(f"{path}: truncated GGUF file: {e}; download it again") from None
    except ValueError as e:
        if "magic" in str(e).lower():
            raise ValueError(f"{path}: not a GGUF file (bad magic bytes)") from None
        raise ValueError(f"{path}: cannot read GGUF file: {e}") from e
    except (IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError, MemoryError) as e:
        raise ValueError(f"{path}: corrupt GGUF file ({type(e).__name__}: {e}); "
                         "download it again") from e


def _field_value(field) -> Any:
    """A reader field as a plain Python value (arrays as lists; numpy scalars unwrapped)."""
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _metadata(reader) -> dict[str, object]:
    # "GGUF.*" entries are the reader's own bookkeeping (version, counts), not file metadata.
    return {name: _field_value(f) for name, f in reader.fields.items()
            if not name.startswith("GGUF.")}


def read_metadata(path: str | os.PathLike) -> dict[str, object]:
    """All key/value metadata of a GGUF file as plain Python values (arrays as lists)."""
    return _metadata(_open(path))


# ---------------------------------------------------------------------------------------------
# Metadata -> Config
# ---------------------------------------------------------------------------------------------


def _get(meta: dict, key: str, path, kind=int, default=None, required=False):
    """meta[key] converted with `kind`; a missing required key names the file and the key."""
    if key not in meta:
        if required:
            raise ValueError(f"{path}: GGUF metadata key {key!r} is missing; it is required to "
                             "build the model config (is this a complete llama.cpp export?)")
        return default
    value = meta[key]
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{path}: GGUF metadata key {key!r} has value {value!r}, "
                         f"expected {kind.__name__}") from None


def _rope_scaling(meta: dict, arch: str, path, context_length: int) -> RopeScaling:
    p = f"{arch}.rope.scaling."
    kind = _get(meta, p + "type", path, str, default="none")
    factor = _get(meta, p + "factor", path, float, default=None)
    # Older exports wrote linear scaling as `rope.scale_linear`.
    if kind == "none" and meta.get(f"{arch}.rope.scale_linear") not in (None, 1.0):
        kind, factor = "linear", float(meta[f"{arch}.rope.scale_linear"])
    if kind == "none":
        return RopeScaling()
    if factor is None:
        raise ValueError(f"{path}: rope scaling type {kind!r} is set but "
                         f"{p + 'factor'!r} is missing")
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    if kind == "yarn":
        # llama.cpp's extra YaRN knobs have no counterpart in HF's llama yarn; refuse rather
        # than silently compute something else. deepseek2 alone writes yarn_log_multiplier,
        # 0.1 * DeepSeek's mscale_all_dim, and llama.cpp then takes mscale = mscale_all_dim
        # (no cos/sin factor; the softmax scale times mscale(factor, mscale_all_dim)^2).
        mla = arch == "deepseek2"
        log_mul = _get(meta, p + "yarn_log_multiplier", path, float, default=0.0) if mla else 0.0
        for extra, neutral in (("attn_factor", 1.0), ("yarn_attn_factor", 1.0),
                               ("yarn_ext_factor", None), ("yarn_log_multiplier", None)):
            v = None if mla and extra == "yarn_log_multiplier" else meta.get(p + extra)
            if v is not None and not (neutral is not None and float(v) == neutral) \
                    and not (extra == "yarn_ext_factor" and float(v) < 0):
                raise ValueError(f"{path}: GGUF metadata {p + extra!r} = {v} is not supported "
                                 "(only factor, original_context_length, yarn_beta_fast and "
                                 "yarn_beta_slow are)")
        return RopeScaling(
            "yarn", factor=factor,
            original_max_position_embeddings=_get(meta, p + "original_context_length", path,
                                                  int, default=context_length),
            beta_fast=_get(meta, p + "yarn_beta_fast", path, float, default=32.0),
            beta_slow=_get(meta, p + "yarn_beta_slow", path, float, default=1.0),
            mscale=log_mul / 0.1 if log_mul else None,
            mscale_all_dim=log_mul / 0.1 if log_mul else None,
            attention_factor=1.0 if mla and not log_mul else None)
    raise ValueError(f"{path}: unsupported rope scaling type {kind!r} in {p + 'type'!r}; "
                     "supported: none, linear, yarn")


def _architecture(meta: dict, path) -> tuple[str, GGUFArchitecture]:
    arch = meta.get("general.architecture")
    if arch is None:
        raise ValueError(f"{path}: GGUF metadata key 'general.architecture' is missing")
    if registry.for_gguf_architecture(arch) is None or arch not in ARCHITECTURES:
        supported = [a for a in registry.gguf_architectures() if a in ARCHITECTURES]
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r} (general.architecture);"
                         f" supported: {', '.join(supported)}")
    return arch, ARCHITECTURES[arch]


def config_from_metadata(meta: dict, path="<gguf>", token_embd_shape=None,
                         has_output: bool = True,
                         tensor_names: Collection[str] | None = None,
                         rope_freqs: np.ndarray | None = None) -> Config:
    """GGUF metadata -> Config.

    token_embd_shape: numpy shape [V, D] of token_embd.weight, used for the vocab size when the
    metadata has neither `{arch}.vocab_size` nor a token list. has_output: whether the file has
    an `output.weight` tensor (absent means the head is tied to the embedding). tensor_names:
    the file's tensor names; the biases it has switch on qkv_bias / o_bias / mlp_bias (None:
    no biases). rope_freqs: the values of the file's `rope_freqs.weight` (None: it has none),
    which become Config.rope_freq_factors.
    """
    arch, spec = _architecture(meta, path)
    family = registry.for_gguf_architecture(arch)
    # Our layer param name -> whether some layer of the file has that tensor.
    in_layers = {n.split(".", 2)[2] for n in tensor_names or () if n.startswith("blk.")}
    has = {ours: name in in_layers for ours, (name, _) in family.gguf_tensors.layer.items()}

    def get(key, kind=int, default=None, required=False):  # `{arch}.key`
        return _get(meta, f"{arch}.{key}", path, kind, default=default, required=required)

    def req(key, kind=int):
        return get(key, kind, required=True)

    def opt(key, kind, default):
        return get(key, kind, default)

    experts = opt("expert_count", int, 0)
    if experts and not spec.experts:
        moe_archs = ", ".join(a for a, s in ARCHITECTURES.items() if s.experts)
        raise ValueError(f"{path}: {arch}.expert_count = {experts}, but llama.cpp's {arch!r} has "
                         f"no experts; mixture-of-experts GGUFs are supported as: {moe_archs}")
    hidden = req("embedding_length")
    heads = req("attention.head_count")
    context = req("context_length")
    layers = req("block_count")
    if arch == "deepseek2":  # MLA: the per-head sizes are not key/value_length (gguf_moe)
        fields = gguf_moe.deepseek2_fields(meta, get, path, heads, tensor_names)
        rot = fields["mla"].qk_rope_head_dim
    else:
        head_dim = opt("attention.key_length", int, None) \
            or opt("rope.dimension_count", int, None) or hidden // heads
        rot = opt("rope.dimension_count", int, head_dim)
        if rot != head_dim:
            raise ValueError(f"{path}: {arch}.rope.dimension_count = {rot} differs from the head "
                             f"dimension {head_dim}; partial rotary GGUFs are not supported")
        value_len = opt("attention.value_length", int, head_dim)
        if value_len != head_dim:
            raise ValueError(f"{path}: {arch}.attention.value_length = {value_len} differs from "
                             f"key_length {head_dim}; not supported")
        fields = {"head_dim": head_dim,
                  "num_kv_heads": opt("attention.head_count_kv", int, heads),
                  "intermediate_size": req("feed_forward_length"),
                  "moe": gguf_moe.llama_moe(meta, arch, get, path, layers, tensor_names)}
        if fields["moe"] is not None and arch == "llama":
            fields["architecture"] = "MixtralForCausalLM"
    freq_factors = () if rope_freqs is None else _rope_freq_factors(rope_freqs, arch, spec, rot,
                                                                     path)

    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = opt("vocab_size", int, None)
    if vocab is None:
        if isinstance(tokens, list):
            vocab = len(tokens)
        elif token_embd_shape is not None:
            vocab = int(token_embd_shape[0])
        else:
            raise ValueError(f"{path}: cannot tell the vocabulary size: no {arch}.vocab_size, "
                             "no tokenizer.ggml.tokens and no token_embd.weight")

    eos_ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id"):
        v = _get(meta, key, path, int)
        if v is not None and v not in eos_ids:
            eos_ids.append(v)

    config = Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        rms_norm_eps=req("attention.layer_norm_rms_epsilon", float),
        rope_theta=opt("rope.freq_base", float, 10000.0),
        rope_scaling=_rope_scaling(meta, arch, path, context),
        rope_freq_factors=freq_factors,
        max_position_embeddings=context,
        tie_word_embeddings=not has_output,
        qkv_bias=any(has.get(n, False) for n in ("bq", "bk", "bv")),
        o_bias=has.get("bo", False),
        mlp_bias=any(has.get(n, False) for n in ("b_gate", "b_up", "b_down")),
        qk_norm=spec.qk_norm,
        family=family.name,
        bos_token_id=_get(meta, "tokenizer.ggml.bos_token_id", path, int),
        eos_token_ids=tuple(eos_ids),
        **{"architecture": spec.hf_architecture, **fields},
    )
    if arch in ("gemma2", "gemma3"):
        config = config.replace(**_gemma_fields(meta, arch, config, path))
    return config


# ---------------------------------------------------------------------------------------------
# Gemma 2 / Gemma 3: what llama.cpp reads for them beside the llama keys
# ---------------------------------------------------------------------------------------------

# llama.cpp scales the 27B models' queries by 1 / sqrt(hidden / heads) (their
# query_pre_attn_scalar, 168, is not head_dim), the others by 1 / sqrt(head_dim); it tells
# the 27B by its layer count.
_GEMMA_27B_LAYERS = (("gemma2", 46), ("gemma3", 62))
_GEMMA_SWA_EVERY = (("gemma2", 2), ("gemma3", 6))  # llama.cpp's default sliding-layer pattern


def _gemma_fields(meta: dict, arch: str, config: Config, path) -> dict:
    """The Gemma switches of a GGUF's Config (see jaxinfer/models/gemma.py)."""
    layers = config.num_layers
    window = _get(meta, f"{arch}.attention.sliding_window", path, int, required=True)
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one bool per layer: True slides
        if len(pattern) != layers:
            raise ValueError(f"{path}: {arch}.attention.sliding_window_pattern has "
                             f"{len(pattern)} entries for {layers} layers")
        sliding = [bool(p) for p in pattern]
    else:
        every = int(pattern) if pattern is not None else dict(_GEMMA_SWA_EVERY)[arch]
        sliding = [i % every < every - 1 for i in range(layers)]
    if (arch, layers) in _GEMMA_27B_LAYERS:
        scale = (config.hidden_size / config.num_heads) ** -0.5
    else:
        scale = config.head_dim ** -0.5

    def cap(key):
        value = _get(meta, f"{arch}.{key}", path, float)
        return None if value is None or value == 0 else value

    fields = dict(
        mlp_activation="gelu_tanh", norm_offset=1.0, attn_scale=scale,
        embed_scale=config.hidden_size ** 0.5,
        layer_windows=tuple(window if s else None for s in sliding),
        final_softcap=cap("final_logit_softcapping"))
    if arch == "gemma2":
        fields["attn_softcap"] = cap("attn_logit_softcapping")
    else:  # llama.cpp's Gemma 3 runs its sliding layers on an unscaled base of 10000
        fields["rope_local_theta"] = _get(meta, f"{arch}.rope.freq_base_swa", path, float,
                                          default=10_000.0)
        if f"{arch}.rope.freq_base" not in meta:
            fields["rope_theta"] = 1_000_000.0
    return fields


def _rope_freq_factors(values: np.ndarray, arch: str, spec: GGUFArchitecture, rot: int,
                       path) -> tuple[float, ...]:
    """`rope_freqs.weight` -> Config.rope_freq_factors, checked against the rotary dimension."""
    if not spec.rope_freqs:
        raise ValueError(f"{path}: tensor {ROPE_FREQS!r} is not part of the {arch!r} "
                         "architecture (llama.cpp would not use it); refusing to ignore it")
    values = np.asarray(values, dtype=np.float32)
    if values.shape != (rot // 2,):
        raise ValueError(f"{path}: tensor {ROPE_FREQS!r} has shape {list(values.shape)} but the "
                         f"rope dimension {rot} implies [{rot // 2}] (one factor per frequency)")
    if not np.all(values > 0):
        raise ValueError(f"{path}: tensor {ROPE_FREQS!r} has factors <= 0 (smallest "
                         f"{float(values.min())}); each RoPE frequency is divided by its factor, "
                         "so the file is corrupt")
    return tuple(float(v) for v in values)  # float32 values, exactly; hashable for the Config


# ---------------------------------------------------------------------------------------------
# Tensors -> params
# ---------------------------------------------------------------------------------------------


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of attn_q / attn_k.

    w: [n_heads * hd, in] or a bias [n_heads * hd] (rows = output features, as the reader
    returns them). llama.cpp stores, within each head, row order (0, hd/2, 1, hd/2+1, ...), i.e.
    a [hd/2, 2] grid of the HF rows [2, hd/2]; swapping those two axes back restores HF's
    rotate-half order.
    """
    rows = w.shape[0]
    hd = rows // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute_rope_columns(a: np.ndarray, n_heads: int) -> np.ndarray:
    """unpermute_rope_rows on the columns of a [R, n_heads * hd] (a quantized weight's codes
    or scales, whose columns are the GGUF rows); a new C-ordered array."""
    r, cols = a.shape
    hd = cols // n_heads
    return a.reshape(r, n_heads, hd // 2, 2).swapaxes(2, 3).reshape(r, cols)


def _layer_slots(config: Config, i: int, tensors) -> tuple[dict, Any]:
    """Layer i's tensors read one to one: our name -> (GGUF name, transpose to [in, out]), and
    for a MoE layer the expert layout (gguf_moe.expert_layout) its experts come in, else None.
    A MoE layer has no dense MLP, a dense one no shared experts; a deepseek2 file with the
    split attn_k_b / attn_v_b has no attn_kv_b (gguf_moe.kv_b_shapes)."""
    family = registry.family(config)
    names, shapes = family.gguf_tensors, family.checkpoint_shapes(config)["layer"]
    prefix = f"blk.{i}."
    moe = config.moe is not None and config.is_moe_layer(i)
    skip = ({"w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"} if moe
            else {"shared_gate", "shared_up", "shared_down"})
    if config.mla is not None and prefix + gguf_moe.K_B in tensors:
        skip.add("wkv_b")
    slots = {n: (prefix + names.layer[n][0], names.layer[n][1]) for n in shapes if n not in skip}
    layout = gguf_moe.expert_layout(names.experts, prefix, tensors) if moe else None
    return slots, layout


def _expected_shapes(config: Config, tensors) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape as the reader gives it ([out, in] for matmuls)."""
    family = registry.family(config)
    names, shapes = family.gguf_tensors, family.checkpoint_shapes(config)

    def stored(shape: tuple, transpose: bool) -> tuple:  # its [out, in] shape
        return tuple(reversed(shape)) if transpose else shape

    out = {names.top[n][0]: stored(s, names.top[n][1]) for n, s in shapes["top"].items()}
    if config.rope_freq_factors:  # read into the Config, not the params
        out[ROPE_FREQS] = (len(config.rope_freq_factors),)
    for i in range(config.num_layers):
        slots, layout = _layer_slots(config, i, tensors)
        out.update({g: stored(shapes["layer"][n], t) for n, (g, t) in slots.items()})
        if config.mla is not None and "wkv_b" not in slots:
            out.update(gguf_moe.kv_b_shapes(f"blk.{i}.", config))
        if layout is not None:
            out.update(gguf_moe.expert_shapes(layout, f"blk.{i}.", config))
    return out


def _logical_shape(tensor) -> tuple[int, ...]:
    """numpy-order shape of a reader tensor in elements (GGUF lists ne0 first, numpy last)."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


# gguf.quants dequantizes 16 rows per numpy call, so for short rows (576 elements in SmolLM2)
# Python overhead dominates. Blocks are independent, so handing it rows of about this many
# elements (whole rows joined) gives the same values with far fewer calls. This holds for any
# block size (32, or 256 for K-quants) because every row is whole blocks (the reader checks).
_DEQUANT_ROW_ELEMENTS = 16384


def _regrouped_rows(tensor) -> np.ndarray:
    """The tensor's bytes as [rows / m, m * row_bytes]: m of its rows per dequantization row."""
    import gguf

    data = tensor.data
    rows = data.size // data.shape[-1]
    row_elems = int(tensor.shape[0])  # ne0: elements per row
    m = max(1, min(rows, _DEQUANT_ROW_ELEMENTS // max(row_elems, 1)))
    while rows % m:
        m -= 1
    block, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    return data.reshape(rows // m, m * (row_elems // block) * type_size)


def _dequantize(tensor, path) -> np.ndarray:
    """A reader tensor -> float32 numpy array in numpy order ([out, in] for matmuls).

    F32 tensors come back as read-only views of the file mapping; the caller copies."""
    import gguf
    from gguf.quants import dequantize

    kind = tensor.tensor_type
    plain = kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    data = tensor.data if plain else _regrouped_rows(tensor)
    with np.errstate(over="ignore", invalid="ignore"):  # reported below, naming the tensor
        out = np.asarray(dequantize(data, kind), dtype=np.float32).reshape(_logical_shape(tensor))
    if not np.all(np.isfinite(out)):
        raise ValueError(f"{path}: tensor {tensor.name!r} ({kind.name}) contains "
                         "non-finite values after dequantization; the file is corrupt")
    return out


def _repack(tensor, path, data=None) -> QuantizedWeight:
    """A reader tensor of a gguf_blocks type -> QuantizedWeight [ne0, rows] (our [in, out]);
    data: the blocks of one expert (tensor.data[j] of a stacked [E, rows, ne0] tensor) in place
    of the whole tensor's, giving that expert's QuantizedWeight."""
    kind, shape = tensor.tensor_type.name, _logical_shape(tensor)
    k = shape[-1]
    rows = int(np.prod(shape[:-1] if data is None else shape[1:-1]))
    try:
        qw = gguf_blocks.repack(tensor.data if data is None else data, kind, k, rows)
    except ValueError as e:
        raise ValueError(f"{path}: tensor {tensor.name!r} ({kind}, shape {list(shape)}): "
                         f"{e}") from None
    # Its values are finite exactly when its fp16 scales and mins are (codes and 6-bit / int8
    # sub-scales are bounded): the same refusal as _dequantize's.
    floats = [a for a in (qw.scale, qw.offset, qw.super_scale, qw.super_offset)
              if a is not None and a.dtype.kind == "f"]
    if not all(np.isfinite(a).all() for a in floats):
        raise ValueError(f"{path}: tensor {tensor.name!r} ({kind}) contains non-finite values "
                         "(its fp16 scales); the file is corrupt")
    return qw


def _check_tensors(tensors: dict, config: Config, path) -> None:
    """Every expected tensor present with a supported type and its shape; none unknown."""
    expected = _expected_shapes(config, tensors)
    problems = []
    for name, shape in expected.items():
        t = tensors.get(name)
        if t is None:
            why = (f" (the metadata has {config.moe.num_experts} experts and their router in "
                   f"this layer)" if "_exps." in name or "ffn_gate_inp." in name else "")
            problems.append(f"tensor {name!r} is missing{why}")
        elif t.tensor_type.name not in SUPPORTED_TYPES:
            problems.append(f"tensor {name!r} has type {t.tensor_type.name}, which is not "
                            f"supported (supported: {', '.join(SUPPORTED_TYPES)})")
        elif _logical_shape(t) != shape:
            problems.append(f"tensor {name!r} has shape {list(_logical_shape(t))} (numpy order) "
                            f"but the metadata implies {list(shape)}")
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        problems.append(f"unexpected tensors the {config.family} loader does not know: "
                        f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}")
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise ValueError(f"{path}: " + "; ".join(problems[:10]) + more)


def _owned(a):
    """C-contiguous and writable (not a view of the file): one copy to the device later.
    QuantizedWeights are repacked into new arrays already."""
    if isinstance(a, QuantizedWeight | Parts):
        return a
    return a if a.flags.c_contiguous and a.flags.writeable else np.array(a, order="C")


# numpy releases the GIL in dequantization's array math and in copies, so a few threads
# overlap layers; more than a handful mostly adds memory in flight.
_MAX_WORKERS = 4


def params_from_reader(reader, config: Config, path, keep_quantized: bool = True,
                       transform=None) -> dict:
    """Check every tensor's presence, type and shape, then read them into our params layout:
    with keep_quantized, matmul weights and the token embedding of gguf_blocks' types as
    QuantizedWeights, the rest (and all without it) dequantized to float32. transform(name,
    value), when given, maps each param as its worker makes it ("embed", "layers.3.wqkv": a
    sharded load places it), so at most a few layers are on the host at once."""
    tensors = {t.name: t for t in reader.tensors}
    _check_tensors(tensors, config, path)
    field = reader.fields.get("general.architecture")
    _, arch = _architecture({} if field is None else {"general.architecture": field.contents()},
                            path)
    family = registry.family(config)
    names, shapes = family.gguf_tensors, family.checkpoint_shapes(config)
    # Rows of these were interleaved per head by the converter (llama only); undo it.
    heads = {"wq": config.num_heads, "bq": config.num_heads,
             "wk": config.num_kv_heads, "bk": config.num_kv_heads} if arch.permuted_qk else {}

    def kept(gguf_name: str, transpose: bool) -> bool:  # read as a QuantizedWeight?
        return keep_quantized and (transpose or gguf_name == TOKEN_EMBD) \
            and tensors[gguf_name].tensor_type.name in gguf_blocks.BLOCK_TYPES

    layer_slots = [_layer_slots(config, i, tensors) for i in range(config.num_layers)]
    if keep_quantized:
        experts = [(g, True) for i, (_, lay) in enumerate(layer_slots) if lay is not None
                   for g in gguf_moe.expert_shapes(lay, f"blk.{i}.", config)
                   if "ffn_gate_inp" not in g and "exp_probs_b" not in g]
        slots = [names.top[n] for n in shapes["top"]] + [
            s for slot, _ in layer_slots for s in slot.values()] + experts
        dequantized = sorted({tensors[g].tensor_type.name for g, transpose in slots
                              if (transpose or g == TOKEN_EMBD) and not kept(g, transpose)
                              and tensors[g].tensor_type.name not in _FLOAT_TYPES})
        if dequantized:
            log.warning("%s: %s weights are dequantized to float32 on load (about 10x their "
                        "file size): they have no kept-quantized layout yet (types that do: "
                        "%s)", path, ", ".join(dequantized), ", ".join(gguf_blocks.BLOCK_TYPES))

    def ours(name: str, gguf_name: str, transpose: bool):
        tensor = tensors[gguf_name]
        if kept(gguf_name, transpose):
            qw = _repack(tensor, path)  # already [in, out]: GGUF rows are its columns
            gguf_reader.release_pages(tensor.data)  # repacked into new arrays
            if name in heads:
                qw = qw.map_columns(functools.partial(_unpermute_rope_columns,
                                                      n_heads=heads[name]))
            return qw
        w = _dequantize(tensor, path)
        if arch.norm_plus_one and gguf_name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # Gemma: the file holds 1 + weight (see GGUFArchitecture)
        if name in heads:
            w = unpermute_rope_rows(w, heads[name])
        # [out, in] -> [in, out] as a view: the copy that makes it contiguous is either the
        # family's own (q, k, v fused into one weight) or _owned's below, never both.
        return w.T if transpose else w

    def top(name: str):
        value = _owned(ours(name, *names.top[name]))
        return value if transform is None else transform(name, value)

    def layer(i: int) -> dict:
        slots, layout = layer_slots[i]
        prefix = f"blk.{i}."
        lp = {n: ours(n, g, transpose) for n, (g, transpose) in slots.items()}
        if config.mla is not None and "wkv_b" not in slots:  # llama.cpp's split kv_b
            lp["wkv_b"] = gguf_moe.join_kv_b(_dequantize(tensors[prefix + gguf_moe.K_B], path),
                                             _dequantize(tensors[prefix + gguf_moe.V_B], path))
        if layout is not None:
            lp.update(gguf_moe.read_experts(
                tensors, prefix, layout, config, keep_quantized,
                functools.partial(_dequantize, path=path), functools.partial(_repack, path=path)))
        lp = family.assemble_layer(lp, config, f"{path}: blk.{i}")
        if transform is None:
            return {n: _owned(a) for n, a in lp.items()}
        return {n: transform(f"layers.{i}.{n}", _owned(a)) for n, a in lp.items()}

    workers = min(_MAX_WORKERS, os.cpu_count() or 1)
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="gguf-dequant")
    try:
        top_jobs = {n: pool.submit(top, n) for n in shapes["top"]}
        layer_jobs = [pool.submit(layer, i) for i in range(config.num_layers)]
        # Collected in load order, so a bad tensor raises the error a sequential load would.
        params: dict = {n: job.result() for n, job in top_jobs.items()}
        from tqdm.auto import tqdm

        # On a terminal only (disable=None), as every progress bar here.
        with tqdm(total=config.num_layers, desc="loading layers", disable=None,
                  leave=False) as bar:
            params["layers"] = []
            for job in layer_jobs:
                params["layers"].append(job.result())
                bar.update()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return params


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def load_gguf_params(path: str | os.PathLike, before_tensors=None, keep_quantized: bool = True,
                     transform=None) -> tuple[Config, dict, dict[str, object]]:
    """(Config, params as numpy float32 arrays and QuantizedWeights, metadata) of a GGUF file;
    no tokenizer. keep_quantized=False: every tensor dequantized to float32. transform: as
    for params_from_reader.

    before_tensors(config), when given, runs once the config is known and before any tensor is
    read (a memory check that may refuse the load)."""
    reader = _open(path)
    meta = _metadata(reader)
    names = {t.name: t for t in reader.tensors}
    embd = names.get("token_embd.weight")
    freqs = names.get(ROPE_FREQS)
    if freqs is not None:
        # Part of the Config (RoPE is static under jit), so read before the others.
        if freqs.tensor_type.name not in SUPPORTED_TYPES:
            raise ValueError(f"{path}: tensor {ROPE_FREQS!r} has type {freqs.tensor_type.name}, "
                             f"which is not supported (supported: {', '.join(SUPPORTED_TYPES)})")
        freqs = _dequantize(freqs, path)
    config = config_from_metadata(
        meta, path, token_embd_shape=None if embd is None else _logical_shape(embd),
        has_output="output.weight" in names, tensor_names=names, rope_freqs=freqs)
    if before_tensors is not None:
        before_tensors(config)
    params = params_from_reader(reader, config, path, keep_quantized, transform)
    return config, params, meta


def load_gguf(path: str | os.PathLike, before_tensors=None, keep_quantized: bool = True,
              transform=None):
    """(Config, params, Tokenizer) from a GGUF file (before_tensors, keep_quantized, transform:
    as for load_gguf_params).

    params are numpy arrays in our layout ([in, out] matmul weights, one dict per layer), float32
    or QuantizedWeights of numpy arrays; the caller converts/casts them (e.g.
    `jax.tree.map(jnp.asarray, params)`).
    """
    from checkpoints.tokenizer import Tokenizer  # lazily: another module, heavier imports

    config, params, meta = load_gguf_params(path, before_tensors, keep_quantized, transform)
    try:
        tokenizer = Tokenizer.from_gguf_metadata(meta)
    except (KeyError, ValueError) as e:
        raise ValueError(f"{path}: cannot build the tokenizer from the GGUF metadata: {e}") from e
    log.info("loaded %s: %d layers, hidden %d, vocab %d", path, config.num_layers,
             config.hidden_size, config.vocab_size)
    return config, params, tokenizer
