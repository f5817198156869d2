"""HF-layout checkpoint directories: config.json + *.safetensors (+ index) + tokenizer files.

`load_hf_dir(path)` returns (Config, params, Tokenizer | None) with params in the model's own
layout (its family's `param_specs`): matmul weights transposed to [in, out], one dict per
layer. Tensor names come from the family's table (jaxinfer/models/registry.py).
"""

from __future__ import annotations

import json
import logging
import pathlib
import types
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from jaxinfer.configs import Config, MoEConfig, RopeScaling
from jaxinfer.models import registry

log = logging.getLogger(__name__)

# HF architecture name -> the Llama-family variant whose config.json switches it reads.
LLAMA_VARIANTS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# Buffers some exporters write that carry no weights.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# The metadata format of a draft head saved beside a model's weights (jaxinfer/draft_head.py):
# such a file is not one of the weights' shards.
DRAFT_HEAD_FORMAT = "jaxinfer-eagle-head-1"


def _require(cfg: dict, key: str, path: pathlib.Path):
    if cfg.get(key) is None:
        raise ValueError(f"{path}: config.json has no {key!r}, which the model needs; "
                         f"is this a complete HF config?")
    return cfg[key]


def _rope_from_hf(cfg: dict) -> tuple[float, RopeScaling]:
    """(rope_theta, RopeScaling) from either config.json generation:
    transformers >= 5 writes `rope_parameters`, older ones `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind not in ("default", "linear", "dynamic", "llama3", "yarn"):
        raise ValueError(f"config.json: unsupported rope scaling type {kind!r}; "
                         "supported: default, linear, dynamic, llama3, yarn")
    factor = merged.get("factor")
    if factor is None and kind == "yarn" and merged.get("original_max_position_embeddings"):
        factor = cfg["max_position_embeddings"] / merged["original_max_position_embeddings"]
    rs = RopeScaling(
        kind=kind,
        factor=float(factor if factor is not None else 1.0),
        original_max_position_embeddings=merged.get("original_max_position_embeddings"),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        mscale=merged.get("mscale"),
        mscale_all_dim=merged.get("mscale_all_dim"),
        attention_factor=merged.get("attention_factor"),
        truncate=bool(merged.get("truncate", True)),
    )
    if kind == "llama3" and rs.original_max_position_embeddings is None:
        raise ValueError("config.json: llama3 rope scaling needs original_max_position_embeddings")
    # partial_rotary_factor is not read: transformers' Llama/Mistral/Qwen2/Qwen3 rotate the whole
    # head whatever the config says, and we match them.
    return theta, rs


def _layer_windows(cfg: dict, family: str, num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if family in ("mistral", "mixtral"):
        return (window,) * num_layers if window else ()
    if family == "qwen3_moe":  # one window for every layer, when switched on
        return (window,) * num_layers if cfg.get("use_sliding_window") and window else ()
    if family in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window") or not window:
            return ()
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= cfg.get("max_window_layers", num_layers) else "full_attention"
            for i in range(num_layers)]
        return tuple(window if t == "sliding_attention" else None for t in types)
    return ()


# Router settings of other MoE architectures: present with another value in a Mixtral or
# Qwen3-MoE config.json, they ask for routing these architectures do not have.
FOREIGN_ROUTER_KEYS = (
    ("n_shared_experts", (None, 0)), ("shared_expert_intermediate_size", (None, 0)),
    ("scoring_func", (None, "softmax")), ("topk_method", (None, "greedy")),
    ("n_group", (None, 1)), ("topk_group", (None, 1)), ("routed_scaling_factor", (None, 1, 1.0)))


def _moe_from_hf(cfg: dict, family: str, arch: str, path: pathlib.Path) -> MoEConfig | None:
    """The MoE config of a Mixtral / Qwen3-MoE config.json (router_jitter_noise and
    output_router_logits are training switches: ignored)."""
    if family not in ("mixtral", "qwen3_moe"):
        return None
    for key, defaults in FOREIGN_ROUTER_KEYS:
        if cfg.get(key) not in defaults:
            raise ValueError(f"{path}: {key}={cfg[key]!r} is a router setting {arch} does not "
                             f"implement; not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act={cfg['hidden_act']!r}: the experts are SwiGLU "
                         f"(silu) only")
    if family == "mixtral":
        fields = {"num_local_experts": _require(cfg, "num_local_experts", path),
                  "num_experts_per_tok": _require(cfg, "num_experts_per_tok", path),
                  "intermediate_size": _require(cfg, "intermediate_size", path)}
        extra = {"norm_topk_prob": True}  # Mixtral always renormalises its top-k
    else:
        # transformers 5 writes num_experts as num_local_experts (its attribute_map)
        key = "num_experts" if "num_experts" in cfg else "num_local_experts"
        if not cfg.get(key):
            return None  # transformers: every layer a dense MLP
        fields = {key: cfg[key],
                  "num_experts_per_tok": _require(cfg, "num_experts_per_tok", path),
                  "moe_intermediate_size": _require(cfg, "moe_intermediate_size", path)}
        extra = {"norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
                 "sparse_step": cfg.get("decoder_sparse_step") or 1,
                 "dense_layers": tuple(sorted(set(cfg.get("mlp_only_layers") or ())))}
    try:
        return MoEConfig(*fields.values(), **extra)
    except ValueError as e:
        given = ", ".join(f"{k}={v!r}" for k, v in {**fields, **extra}.items())
        raise ValueError(f"{path}: {e} (from config.json {given})") from None


def config_from_hf(cfg: dict, path: pathlib.Path = pathlib.Path("config.json")) -> Config:
    """HF config.json (as a dict) -> Config. Raises ValueError on unknown architectures."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if registry.for_hf_architecture(a) is not None), None)
    if arch is None:
        raise ValueError(f"{path}: unsupported architecture {archs or cfg.get('model_type')!r}; "
                         f"supported: {', '.join(registry.hf_architectures())}")
    if registry.for_hf_architecture(arch).name == "deepseek":  # MLA + MoE: its own fields
        from checkpoints import deepseek

        return deepseek.config_from_hf(cfg, arch, path)
    if registry.for_hf_architecture(arch).name == "gemma":
        return gemma_config_from_hf(cfg, arch, path)
    family = LLAMA_VARIANTS[arch]
    heads = int(_require(cfg, "num_attention_heads", path))
    hidden = int(_require(cfg, "hidden_size", path))
    layers = int(_require(cfg, "num_hidden_layers", path))
    theta, rope_scaling = _rope_from_hf(cfg)
    eos = cfg.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    attention_bias = bool(cfg.get("attention_bias", False))
    return Config(
        vocab_size=int(_require(cfg, "vocab_size", path)),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size", path)),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias={"qwen2": True, "mistral": False, "mixtral": False}.get(family, attention_bias),
        o_bias=attention_bias if family in ("llama", "qwen3", "qwen3_moe") else False,
        mlp_bias=bool(cfg.get("mlp_bias", False)) if family == "llama" else False,
        qk_norm=family in ("qwen3", "qwen3_moe"),
        layer_windows=_layer_windows(cfg, family, layers),
        family=registry.for_hf_architecture(arch).name,
        architecture=arch,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
        moe=_moe_from_hf(cfg, family, arch, path),
    )


# ---------------------------------------------------------------------------------------------
# Gemma 2 / Gemma 3 (jaxinfer/models/gemma.py)
# ---------------------------------------------------------------------------------------------

# transformers 5.24's Gemma2Config / Gemma3TextConfig defaults for the fields we read (hub
# configs, Gemma 3's text_config above all, leave many of them out).
GEMMA_DEFAULTS = types.MappingProxyType({
    "gemma2": types.MappingProxyType({
        "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0, "eos_token_id": 1, "bos_token_id": 2,
        "tie_word_embeddings": True, "rope_theta": 10000.0, "sliding_window_pattern": 2}),
    "gemma3_text": types.MappingProxyType({
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "eos_token_id": 1, "bos_token_id": 2,
        "tie_word_embeddings": True, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6}),
})
GEMMA_LAYER_TYPES = ("sliding_attention", "full_attention")


def gemma_config_from_hf(cfg: dict, arch: str, path: pathlib.Path) -> Config:
    """Gemma2ForCausalLM / Gemma3ForCausalLM config.json, or the text_config of a
    Gemma3ForConditionalGeneration one -> Config (transformers 5.24's defaults fill gaps)."""
    top = cfg
    if arch == "Gemma3ForConditionalGeneration":
        if not isinstance(cfg.get("text_config"), dict):
            raise ValueError(f"{path}: a Gemma3ForConditionalGeneration config needs a "
                             f"text_config (the language model's)")
        cfg = cfg["text_config"]
    kind = "gemma2" if arch == "Gemma2ForCausalLM" else "gemma3_text"
    merged = {**GEMMA_DEFAULTS[kind], **{k: v for k, v in cfg.items() if v is not None}}
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if cfg.get(key) is None and top.get(key) is not None:
            merged[key] = top[key]  # a multimodal config keeps these at its top level
    act = merged.get("hidden_activation") or merged.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{path}: hidden_activation {act!r} is not supported for {arch}; "
                         f"Gemma's MLP gate is gelu_pytorch_tanh")
    if merged.get("use_bidirectional_attention"):
        raise ValueError(f"{path}: use_bidirectional_attention=true (an encoder) is not "
                         f"supported; only causal {arch}")
    if merged.get("attention_bias"):
        raise ValueError(f"{path}: attention_bias=true is not supported for {arch}")
    layers = int(merged["num_hidden_layers"])
    layer_types = merged.get("layer_types")
    if layer_types is None:
        every = int(merged["sliding_window_pattern"])
        layer_types = ["sliding_attention" if (i + 1) % every else "full_attention"
                       for i in range(layers)]
    if len(layer_types) != layers or any(t not in GEMMA_LAYER_TYPES for t in layer_types):
        raise ValueError(f"{path}: layer_types must list {layers} entries (num_hidden_layers) "
                         f"of {GEMMA_LAYER_TYPES}, got {layer_types!r}")
    window = cfg["sliding_window"] if "sliding_window" in cfg else merged["sliding_window"]
    if "sliding_attention" in layer_types and not window:
        raise ValueError(f"{path}: layer_types has sliding_attention layers but "
                         f"sliding_window is {window!r}")
    scalar = merged["query_pre_attn_scalar"]
    if not isinstance(scalar, (int, float)) or scalar <= 0:
        raise ValueError(f"{path}: query_pre_attn_scalar must be a positive number, got "
                         f"{scalar!r}")
    theta, rope_scaling, local_theta = _gemma_rope(merged, kind, path)
    eos = merged.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    heads, hidden = int(merged["num_attention_heads"]), int(merged["hidden_size"])
    return Config(
        vocab_size=int(merged["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(merged["intermediate_size"]), num_layers=layers,
        num_heads=heads, num_kv_heads=int(merged.get("num_key_value_heads") or heads),
        head_dim=int(merged.get("head_dim") or hidden // heads),
        rms_norm_eps=float(merged["rms_norm_eps"]), rope_theta=theta,
        rope_scaling=rope_scaling, rope_local_theta=local_theta,
        max_position_embeddings=int(merged["max_position_embeddings"]),
        tie_word_embeddings=bool(merged["tie_word_embeddings"]),
        qk_norm=kind == "gemma3_text",
        layer_windows=tuple(int(window) if t == "sliding_attention" else None
                            for t in layer_types),
        mlp_activation="gelu_tanh", norm_offset=1.0,
        attn_scale=float(merged["query_pre_attn_scalar"]) ** -0.5,
        # transformers' Gemma 3 attention never passes attn_logit_softcapping on: unused there.
        attn_softcap=(None if kind == "gemma3_text" or merged["attn_logit_softcapping"] is None
                      else float(merged["attn_logit_softcapping"])),
        final_softcap=(None if merged["final_logit_softcapping"] is None
                       else float(merged["final_logit_softcapping"])),
        embed_scale=hidden ** 0.5,
        family="gemma", architecture=arch,
        bos_token_id=merged.get("bos_token_id"), eos_token_ids=eos)


def _gemma_rope(cfg: dict, kind: str, path: pathlib.Path):
    """(global theta, its RopeScaling, the sliding layers' theta or None) from either
    config.json generation: rope_parameters per layer type (transformers 5), or rope_theta /
    rope_scaling / rope_local_base_freq."""
    params = cfg.get("rope_parameters") or {}
    per_type = any(t in params for t in GEMMA_LAYER_TYPES)
    if kind == "gemma2":
        if per_type:
            raise ValueError(f"{path}: Gemma 2 has one RoPE for every layer; rope_parameters "
                             f"per layer type are not supported")
        return (*_rope_from_hf(cfg), None)
    full = dict(params.get("full_attention") or {}) if per_type else dict(params)
    full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    theta, scaling = _rope_from_hf({"rope_parameters": full, "rope_scaling": cfg.get(
        "rope_scaling"), "max_position_embeddings": cfg["max_position_embeddings"]})
    local = dict(params.get("sliding_attention") or {}) if per_type else {}
    if (local.get("rope_type") or "default") != "default":
        raise ValueError(f"{path}: rope_parameters.sliding_attention.rope_type "
                         f"{local['rope_type']!r} is not supported (only default)")
    local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0)))
    return theta, scaling, local_theta


# A Gemma3ForConditionalGeneration checkpoint's language model: transformers 5 saves it
# under "model.language_model.", older exports under "language_model.model."; the vision
# tower and projector are not ours to load.
_TEXT_TOWER_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                        ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                    "multi_modal_projector.")


class _TextTower(Mapping):
    """The language-model tensors of a multimodal checkpoint under Gemma3ForCausalLM's names."""

    def __init__(self, tensors, source: str):
        self._tensors, self._names = tensors, {}
        for name in tensors:
            if name.startswith(_VISION_PREFIXES):
                continue
            ours = next((new + name[len(old):] for old, new in _TEXT_TOWER_PREFIXES
                         if name.startswith(old)), name)
            self._names[ours] = name
        if not any(n.startswith("model.layers.") for n in self._names):
            raise ValueError(f"{source}: a Gemma3ForConditionalGeneration checkpoint without "
                             f"language-model weights (no model.language_model.layers.*)")

    def __getitem__(self, name: str):
        return self._tensors[self._names[name]]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _safetensors_files(path: pathlib.Path) -> list[pathlib.Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are not in {path}: "
                                    f"{', '.join(missing)}; download the missing shards")
        return files
    files = sorted(f for f in path.glob("*.safetensors") if not _is_draft_head(f))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights found")
    return files


def _is_draft_head(file: pathlib.Path) -> bool:
    """Whether a safetensors file is a draft head `jaxinfer train-draft` wrote beside the
    weights (jaxinfer/draft_head.py), not a shard of them (its header only is read)."""
    from safetensors import safe_open

    try:
        with safe_open(file, framework="numpy") as f:
            return (f.metadata() or {}).get("format") == DRAFT_HEAD_FORMAT
    except Exception:  # a bad shard: the reader reports it, naming the file
        return False


def read_safetensors(files: list[pathlib.Path]) -> dict[str, jnp.ndarray]:
    """All tensors of the given files by name; a truncated or corrupt file raises ValueError."""
    from safetensors import SafetensorError, safe_open
    from tqdm.auto import tqdm

    tensors = {}
    # A bar on a terminal only (disable=None), as for every progress bar here.
    with tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True,
              unit_divisor=1024, desc="loading weights", disable=None, leave=False) as bar:
        for f in files:
            try:
                # The flax framework keeps bfloat16 as is (numpy has no bfloat16).
                with safe_open(f, framework="flax") as st:
                    for name in st.keys():
                        tensors[name] = st.get_tensor(name)
            except (SafetensorError, OSError, ValueError) as e:
                raise ValueError(f"{f}: cannot read safetensors weights ({e}); the file is "
                                 "truncated or corrupt, download it again") from e
            bar.update(f.stat().st_size)
    return tensors


# safetensors dtype names -> numpy (bfloat16 and float8 through ml_dtypes, which jax ships)
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
           "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


class TensorSlices:
    """One tensor of a safetensors file that reads only what is indexed (`view[rows, cols]`
    reads those bytes: a device's shard of a sharded load), on the host as numpy; `.T` is
    the transposed view (an [out, in] matmul weight read as our [in, out])."""

    def __init__(self, handle, name: str, file: pathlib.Path, transposed: bool = False):
        import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 with numpy for safetensors)

        self._handle, self.name, self.file, self.transposed = handle, name, file, transposed
        info = handle.get_slice(name)
        stored = tuple(info.get_shape())
        self.shape = stored[::-1] if transposed else stored
        self.dtype = np.dtype(_DTYPES[info.get_dtype()])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def T(self) -> TensorSlices:  # numpy's name for the transposed view
        if self.ndim != 2:
            raise ValueError(f"{self.name}: only a 2-D tensor is read transposed")
        return TensorSlices(self._handle, self.name, self.file, not self.transposed)

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (self.ndim - len(index))
        try:
            if self.transposed:
                return np.ascontiguousarray(self._handle.get_slice(self.name)[index[::-1]].T)
            return self._handle.get_slice(self.name)[index]
        except Exception as e:
            raise ValueError(f"{self.file}: cannot read tensor {self.name!r} ({e}); the file "
                             "is truncated or corrupt, download it again") from e

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        a = self[()]
        return a if dtype is None else a.astype(dtype)


class LazyTensors(Mapping):
    """The tensors of safetensors files by name, each read when first asked for and not kept
    (a load that transforms layer by layer never holds the whole checkpoint). host=True: as
    `TensorSlices` on the host (nothing reaches a device before the transform places it),
    else as jax arrays on the default device."""

    def __init__(self, files: list[pathlib.Path], host: bool = False):
        from safetensors import safe_open

        if host:
            import ml_dtypes  # noqa: F401  (numpy then reads bfloat16 / float8 tensors)
        self._open, self._where, self._host = {}, {}, host
        for f in files:
            try:
                # flax keeps bfloat16 as is on the device; numpy with ml_dtypes on the host
                st = safe_open(f, framework="numpy" if host else "flax")
            except Exception as e:
                raise ValueError(f"{f}: cannot read safetensors weights ({e}); the file is "
                                 "truncated or corrupt, download it again") from e
            self._open[f] = st
            self._where.update(dict.fromkeys(st.keys(), f))

    def __getitem__(self, name: str):
        f = self._where[name]
        if self._host:
            return TensorSlices(self._open[f], name, f)
        try:
            return self._open[f].get_tensor(name)
        except Exception as e:
            raise ValueError(f"{f}: cannot read tensor {name!r} ({e}); the file is truncated "
                             "or corrupt, download it again") from e

    def __contains__(self, name) -> bool:  # without reading the tensor (Mapping's reads it)
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _whole(value):
    """A TensorSlices read whole (numpy); anything else as it is."""
    return np.asarray(value) if isinstance(value, TensorSlices) else value


def params_from_hf_tensors(tensors, config: Config, source: str, transform=None) -> dict:
    """HF tensors (a mapping) -> our params layout (shape checks are the caller's, against
    param_specs). transform(name, value), when given, maps each of our params as it is made
    ("layers.3.wqkv", "embed"): quantize on load, one tensor at a time. A param that is one
    checkpoint tensor (the embedding, the LM head) reaches transform as it comes from
    `tensors` (a TensorSlices: read by the shards it is placed on); a layer's tensors are read
    whole first, one layer at a time, as the family assembles them (q, k, v fused)."""
    family = registry.family(config)
    names = family.hf_tensors
    if config.architecture == "Gemma3ForConditionalGeneration":
        tensors = _TextTower(tensors, source)
    used = set()
    transform = transform or (lambda name, value: value)

    def take(name: str, transpose: bool):
        used.add(name)
        t = tensors[name]
        return t.T if transpose else t

    def present(name: str) -> bool:
        return name in tensors

    params = {}
    for ours, (hf, tr) in names.top.items():
        if present(hf) and not (ours == "lm_head" and config.tie_word_embeddings):
            params[ours] = transform(ours, take(hf, tr))
    params["layers"] = []
    for i in range(config.num_layers):
        layer = {}
        for ours, (hf, tr) in names.layer.items():
            name = f"model.layers.{i}.{hf}"
            if present(name):
                layer[ours] = _whole(take(name, tr))
        if config.is_moe_layer(i):
            layer.update(_read_experts(tensors, f"model.layers.{i}.", names.experts, config,
                                       take, f"{source}: model.layers.{i}"))
        layer = family.assemble_layer(layer, config, f"{source}: model.layers.{i}")
        params["layers"].append({k: transform(f"layers.{i}.{k}", v) for k, v in layer.items()})
    from checkpoints.deepseek import is_mtp_tensor

    unused = sorted(n for n in tensors if n not in used and not n.endswith(IGNORED_SUFFIXES)
                    and not (n == "lm_head.weight" and config.tie_word_embeddings)
                    and not is_mtp_tensor(n, config))
    if unused:
        raise ValueError(f"{source}: tensors the model config does not account for: "
                         f"{', '.join(unused[:8])}{' ...' if len(unused) > 8 else ''}; "
                         "does config.json (num_hidden_layers, biases) match the weights?")
    return params


def _read_experts(tensors, prefix: str, layouts, config: Config, take, where: str) -> dict:
    """A MoE layer's router and stacked experts in our layout (router [D, E], experts_gate /
    experts_up [E, D, F], experts_down [E, F, D]) from the first of the family's layouts
    whose tensors the checkpoint has; per-expert tensors are stacked as they are read
    (block-scaled fp8 ones, checkpoints/fp8_blocks.py, kept fp8: one QuantizedWeight whose
    arrays are [E, ...])."""
    from checkpoints.fp8_blocks import Fp8Weight
    from pallas_kernels.quantized import stack_experts

    moe, d = config.moe, config.hidden_size
    e, f = moe.num_experts, moe.expert_intermediate_size
    torch_shape = {"experts_gate": (f, d), "experts_up": (f, d), "experts_down": (d, f),
                   "experts_gate_up": (2 * f, d)}  # [out, in] per expert

    def read(name: str, shape: tuple, fp8: bool = False):
        if prefix + name not in tensors:
            raise ValueError(f"{where}: missing {prefix + name} (the config has {e} experts)")
        t = take(prefix + name, False)
        if isinstance(t, Fp8Weight) and not fp8:
            raise ValueError(f"{where}: {prefix + name} is block-scaled fp8, which is kept "
                             f"for per-expert tensors only")
        t = t if isinstance(t, Fp8Weight) else np.asarray(t)
        if t.shape != shape:
            raise ValueError(f"{where}: {prefix + name} has shape {t.shape}, expected {shape} "
                             f"from the config (hidden {d}, {e} experts of {f})")
        return t

    for lay in layouts:
        first = [n.format(j=0) for n in lay.per_expert.values()] + list(lay.fused.values())
        if prefix + lay.router not in tensors or not all(prefix + n in tensors for n in first):
            continue
        out = {"router": read(lay.router, (e, d)).T}
        if moe.score_bias:
            if lay.router_bias is None or prefix + lay.router_bias not in tensors:
                raise ValueError(f"{where}: the config routes with a score bias, but there is "
                                 f"no {prefix}{lay.router_bias or 'router bias'}")
            out["router_bias"] = read(lay.router_bias, (e,))
        for ours, pattern in lay.per_expert.items():
            stacked, fp8 = None, []
            for j in range(e):
                t = read(pattern.format(j=j), torch_shape[ours], fp8=True)
                if j and isinstance(t, Fp8Weight) != bool(fp8):
                    raise ValueError(f"{where}: {prefix + pattern.format(j=j)}: some of the "
                                     f"experts' {ours} tensors are fp8 and some are not")
                if isinstance(t, Fp8Weight):
                    fp8.append(t.host_T)  # [in, out], kept fp8
                    continue
                if stacked is None:
                    stacked = np.empty((e, *t.shape[::-1]), t.dtype)  # [E, in, out]
                stacked[j] = t.T
            out[ours] = stack_experts(fp8) if fp8 else stacked
        for ours, name in lay.fused.items():
            t = read(name, (e, *torch_shape[ours])).transpose(0, 2, 1)  # [E, in, out]
            if ours == "experts_gate_up":  # gate then up along out, as torch chunks them
                out["experts_gate"], out["experts_up"] = t[..., :f], t[..., f:]
            else:
                out[ours] = t
        return out
    raise ValueError(f"{where}: the config puts experts in this layer, but the checkpoint has "
                     f"none of the known MoE layouts (routers: "
                     f"{', '.join(sorted({prefix + lay.router for lay in layouts}))})")


def load_hf_dir(path: str | pathlib.Path, before_tensors=None, transform=None,
                host: bool = False):
    """(Config, params, Tokenizer | None) from an HF-layout directory. before_tensors(config),
    when given, runs before any tensor is read (a memory check that may refuse the load);
    transform(name, value), when given, maps each param as it is read (the tensors are then
    read one at a time, not all first). host=True (with transform): tensors reach transform
    on the host, numpy or TensorSlices, never on a device (a sharded load places them)."""
    path = pathlib.Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path}: no config.json; an HF checkpoint directory needs "
                                "config.json next to its *.safetensors files")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e})") from e
    config = config_from_hf(cfg, cfg_file)
    files = _safetensors_files(path)
    if before_tensors is not None:
        before_tensors(config)
    from checkpoints import quantized

    if (quantized.saved_format(files) or "").startswith("jaxinfer"):  # `jaxinfer quantize`
        params = quantized.load_quantized(path, config, transform)
    else:
        from checkpoints import fp8_blocks

        block = fp8_blocks.block_size(cfg, cfg_file)  # DeepSeek-V3's fp8 release: kept in fp8
        if block is not None:
            tensors = fp8_blocks.Fp8BlockTensors(files, block)
        else:
            tensors = (read_safetensors(files) if transform is None
                       else LazyTensors(files, host=host))
        if quantized.looks_quantized(tensors):
            raise ValueError(f"{path}: holds a jaxinfer quantized checkpoint's tensors but "
                             f"not its metadata; write it again with `jaxinfer quantize`")
        params = params_from_hf_tensors(tensors, config, str(path), transform)
    tokenizer = None
    if (path / "tokenizer.json").exists():
        from checkpoints.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_hf_dir(path)
    else:
        log.warning("%s: no tokenizer.json; the model loads without a tokenizer", path)
    return config, params, tokenizer

