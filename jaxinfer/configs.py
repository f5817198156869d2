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
        return int(self.head_dim * self.partial_rotary_factor)

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count (embedding and head counted once when tied)."""
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.num_layers * per_layer + self.vocab_size * d + head + d


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
