"""Quantized KV cache values: int8 or fp8 (e4m3) codes with one float scale per (token, head).

    quantize_kv(x [..., D], dtype, scale_dtype)  -> (codes [..., D], scale [...])
    dequantize_kv(codes [..., D], scale [...])    -> float32 [..., D]
    quantize_latent / dequantize_latent              an MLA latent [..., R + Dr]: the same with
                                                     one scale per part (c_kv, k_rope): [..., 2]

Symmetric absmax scaling, scale = max|x| / qmax (127 for int8, 448 for e4m3) per (token, head),
so one token's outlier channel costs only that row's precision and nothing saturates; a row of
zeros gets scale 0 and codes 0. `kv_scale` and `kv_codes` are plain jnp that also lower inside
a Triton kernel (no round-to-nearest-even there: int8 rounds half up, floor(y + 0.5)), so the
fused decode kernel writes the new token's codes and scale bit for bit as the XLA append does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CODE_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
SCALE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16))


def code_max(dtype) -> float:
    """The largest code magnitude: 127 for int8, 448 for float8_e4m3fn."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:
        return 127.0
    if dtype == jnp.float8_e4m3fn:
        return float(jnp.finfo(dtype).max)
    raise ValueError(f"no KV cache codes of dtype {dtype}; expected int8 or float8_e4m3fn")


def kv_scale(absmax: jax.Array, dtype, scale_dtype) -> jax.Array:
    """The scale [...] of rows whose largest |value| is absmax [...] (float32)."""
    return (absmax / code_max(dtype)).astype(scale_dtype)


def kv_codes(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """x [..., D] / scale (broadcast against x, in scale's stored precision) as codes of
    `dtype`, clipped to +-qmax (a 16-bit scale may round below absmax / qmax)."""
    qmax = code_max(dtype)
    s = scale.astype(jnp.float32)
    y = x.astype(jnp.float32) / jnp.where(s > 0, s, 1.0)
    y = jnp.minimum(jnp.maximum(y, -qmax), qmax)
    if jnp.dtype(dtype) == jnp.int8:
        y = jnp.floor(y + 0.5)
    return y.astype(dtype)


def quantize_kv(x: jax.Array, dtype, scale_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (codes [..., D] of `dtype`, scale [...] of `scale_dtype`)."""
    absmax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    scale = kv_scale(absmax, dtype, scale_dtype)
    return kv_codes(x, scale[..., None], dtype), scale


def dequantize_kv(codes: jax.Array, scale: jax.Array) -> jax.Array:
    """codes [..., D] * scale [...] in float32."""
    return codes.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]


def quantize_latent(latent: jax.Array, rank: int, dtype, scale_dtype=jnp.float32
                    ) -> tuple[jax.Array, jax.Array]:
    """An MLA latent [..., R + Dr] (c_kv, then k_rope) -> (codes [..., R + Dr] of `dtype`,
    scale [..., 2] of `scale_dtype`: c_kv's, then k_rope's), each part scaled by its own absmax."""
    (c, cs), (r, rs) = (quantize_kv(x, dtype, scale_dtype)
                        for x in (latent[..., :rank], latent[..., rank:]))
    return jnp.concatenate([c, r], axis=-1), jnp.stack([cs, rs], axis=-1)


def dequantize_latent(codes: jax.Array, scale: jax.Array, rank: int) -> jax.Array:
    """codes [..., R + Dr] with scale [..., 2] (quantize_latent's) -> float32 [..., R + Dr]."""
    return jnp.concatenate([dequantize_kv(codes[..., :rank], scale[..., 0]),
                            dequantize_kv(codes[..., rank:], scale[..., 1])], axis=-1)


def reference_operands(k_cache, v_cache, k_scale, v_scale, q_dtype):
    """(k, v, precision) for a reference attention: a quantized cache dequantized to float32
    (IEEE float32 dots then), else as stored at the query dtype's precision."""
    from pallas_kernels._common import ref_precision

    if k_scale is None:
        return k_cache, v_cache, ref_precision(q_dtype)
    return (dequantize_kv(k_cache, k_scale), dequantize_kv(v_cache, v_scale),
            ref_precision(jnp.float32))


def codes_as(x: jax.Array, dtype) -> jax.Array:
    """A tile of codes as `dtype` (the query's), exactly: |int8| <= 127 and e4m3's 3 mantissa
    bits fit bf16/fp16. int8 goes through float32 (Triton's int -> bf16 cast is not portable)."""
    if jnp.dtype(x.dtype) == jnp.int8:
        return x.astype(jnp.float32).astype(dtype)
    return x.astype(dtype)


def check_quantized_cache(op: str, k_cache, v_cache, k_scale, v_scale) -> None:
    """k/v codes [B, S, Hkv, D] of one code dtype and their scales [B, S, Hkv] of one scale
    dtype (both or neither given; shapes of the caches are the caller's to check)."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError(f"{op}: give both k_scale and v_scale (a quantized cache) or neither")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if jnp.dtype(c.dtype) not in CODE_DTYPES:
            raise ValueError(f"{op}: with scales, {name} holds int8 or float8_e4m3fn codes, "
                             f"got {c.dtype}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{op}: k_cache {k_cache.dtype} and v_cache {v_cache.dtype} codes "
                         f"must share one dtype")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not hasattr(s, "shape") or tuple(s.shape) != tuple(k_cache.shape[:3]):
            raise ValueError(f"{op}: {name} must be [B, S, Hkv] = {tuple(k_cache.shape[:3])}, "
                             f"got {tuple(getattr(s, 'shape', ()))}")
        if jnp.dtype(s.dtype) not in SCALE_DTYPES:
            raise ValueError(f"{op}: {name} has dtype {s.dtype}, expected float32 or float16")
    if k_scale.dtype != v_scale.dtype:
        raise ValueError(f"{op}: k_scale and v_scale must share one dtype")
