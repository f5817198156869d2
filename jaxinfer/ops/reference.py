"""The pure-jnp math every op falls back to, and the references the kernels are tested against.

HF semantics throughout: RMSNorm statistics in float32 with the weight multiplying the result
in the activation dtype, RoPE in the rotate-half convention with transformers' scaling
variants, attention scores and softmax in float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.configs import Config


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """HF LlamaRMSNorm: statistics in float32, the weight multiplies the result in x's dtype.
    offset != 0: HF's Gemma RMSNorm, normed * (offset + weight) in float32, rounded once."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if offset:
        return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma's logit soft-capping); x itself for cap None."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *, transposed: bool = False,
           out_dtype=None) -> jax.Array:
    """x [..., K] @ w [K, *N] (w [N, K] when transposed) (+ b [*N]) -> [..., *N]; float32
    accumulation, out_dtype (default x's dtype) out."""
    contract = (w.ndim - 1,) if transposed else (0,)
    y = jax.lax.dot_general(x, w, (((x.ndim - 1,), contract), ((), ())),
                            preferred_element_type=jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(out_dtype or x.dtype)


def gate_activation(gate: jax.Array, activation: str = "silu") -> jax.Array:
    """The gated MLP's gate: silu (SwiGLU) or tanh-approximated GELU (GeGLU, HF's
    gelu_pytorch_tanh)."""
    if activation == "silu":
        return jax.nn.silu(gate)
    if activation == "gelu_tanh":
        return jax.nn.gelu(gate, approximate=True)
    raise ValueError(f"unknown gate activation {activation!r}; known: silu, gelu_tanh")


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, b_gate=None, b_up=None, *,
           activation: str = "silu") -> jax.Array:
    """act(x @ w_gate + b) * (x @ w_up + b); x [..., D], w_* [D, F] -> [..., F] (act: silu, or
    gelu_tanh for GeGLU)."""
    return gate_activation(linear(x, w_gate, b_gate), activation) * linear(x, w_up, b_up)


# ---------------------------------------------------------------------------------------------
# RoPE (HF rotate-half convention) and its scaling variants
# ---------------------------------------------------------------------------------------------


def rope_frequencies(config: Config) -> tuple[np.ndarray, float]:
    """Static inverse frequencies [rotary_dim / 2] (float32) and the cos/sin attention factor.

    Mirrors transformers' `ROPE_INIT_FUNCTIONS`; "dynamic" returns the unscaled base here and
    is rescaled per call in `rope_tables` from the longest position it sees. With
    `config.rope_freq_factors` (GGUF `rope_freqs.weight`) each frequency is then divided by its
    factor in float32, as llama.cpp's RoPE does.
    """
    inv_freq, attention_factor = _scaled_frequencies(config)
    if config.rope_freq_factors:
        inv_freq = inv_freq / np.asarray(config.rope_freq_factors, dtype=np.float32)
    return inv_freq, attention_factor


def _scaled_frequencies(config: Config) -> tuple[np.ndarray, float]:
    rs = config.rope_scaling
    dim = config.rotary_dim
    base = config.rope_theta
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    inv_freq = (1.0 / (base ** exponents)).astype(np.float32)
    if rs.kind in ("default", "dynamic"):
        return inv_freq, 1.0
    if rs.kind == "linear":
        return (inv_freq / rs.factor).astype(np.float32), 1.0
    if rs.kind == "llama3":
        old_ctx = rs.original_max_position_embeddings
        low_wavelen = old_ctx / rs.low_freq_factor
        high_wavelen = old_ctx / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (old_ctx / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if rs.kind == "yarn":
        return _yarn_frequencies(config)
    raise ValueError(f"unsupported rope scaling {rs.kind!r}")


def _yarn_frequencies(config: Config) -> tuple[np.ndarray, float]:
    rs = config.rope_scaling
    dim, base, factor = config.rotary_dim, config.rope_theta, rs.factor
    orig = rs.original_max_position_embeddings or config.max_position_embeddings

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rs.attention_factor
    if attention_factor is None:
        if rs.mscale and rs.mscale_all_dim:
            attention_factor = get_mscale(factor, rs.mscale) / get_mscale(factor, rs.mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (np.arange(0, dim, 2).astype(np.float32) / dim)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation_factor) + inv_extra * extrapolation_factor
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_tables(config: Config, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, rotary_dim] (float32) for integer positions [B, T]."""
    inv_freq, attention_factor = rope_frequencies(config)
    inv_freq = jnp.asarray(inv_freq)
    rs = config.rope_scaling
    if rs.kind == "dynamic":
        # NTK-aware: once the sequence outgrows the original context, raise the base.
        dim = config.rotary_dim
        orig = config.max_position_embeddings  # HF's dynamic NTK measures against this, not original_*
        seq_len = (jnp.max(positions) + 1).astype(jnp.float32)
        new_base = config.rope_theta * ((rs.factor * seq_len / orig) - (rs.factor - 1)) ** (dim / (dim - 2))
        exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
        inv_freq = jnp.where(seq_len > orig, 1.0 / (new_base ** exponents), inv_freq)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rotary_dim/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, rotary_dim]
    return jnp.cos(emb) * attention_factor, jnp.sin(emb) * attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, H, D]; cos/sin [B, T, R] with R <= D (partial rotary leaves the tail as is)."""
    rot = cos.shape[-1]
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    xr, tail = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    out = xr * cos + rotated * sin
    return jnp.concatenate([out, tail], axis=-1) if tail.shape[-1] else out


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


def attention_reference(q, k, v, q_pos, kv_pos, *, window=None, sm_scale=None, softcap=None):
    """Masked GQA attention in plain jnp.

    q [B, T, Hq, D]; k, v [B, S, Hkv, D]; q_pos [B, T], kv_pos [B, S] int32 positions.
    A key is visible when kv_pos <= q_pos (and q_pos - kv_pos < window). Scores and softmax in
    float32; probabilities are cast to v's dtype before the second matmul, as HF's eager path does.
    softcap: scores = softcap * tanh(scores / softcap) before the mask (Gemma 2).
    Returns [B, T, Hq, D] in q's dtype.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    qg = q.reshape(b, t, hkv, hq // hkv, d)  # [B, T, Hkv, G, D]
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    visible = kv_pos[:, None, :] <= q_pos[:, :, None]  # [B, T, S]
    if window is not None:
        visible &= (q_pos[:, :, None] - kv_pos[:, None, :]) < window
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    # Rows with no visible key (padding queries) would be NaN; give them zeros instead.
    s_max = jnp.max(s, axis=-1, keepdims=True)
    s_max = jnp.where(jnp.isfinite(s_max), s_max, 0.0)
    p = jnp.exp(s - s_max)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, hq, d).astype(q.dtype)
