"""RMSNorm with HF semantics: statistics in float32, `weight * normed.astype(x.dtype)`.

x [..., D] is viewed as rows [M, D]; one program normalises `block_m` rows. The feature axis is
padded to a power of two inside the kernel (masked loads), so any D works (576, 896, 3584...).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import check_array, next_pow2


def _normed(xf, inv_rms, w, offset: float, dtype, out_dtype):
    """HF's RMSNorm output from float32 rows [block_m, Dp] and their inv_rms [block_m, 1]:
    times (offset + w) in float32, then rounded to dtype (offset != 0, Gemma); or rounded to
    dtype (the input's), then times w in out_dtype."""
    if offset:
        return (xf * inv_rms * (offset + w.astype(jnp.float32))[None, :]).astype(dtype)
    return w[None, :].astype(out_dtype) * (xf * inv_rms).astype(dtype).astype(out_dtype)


def rms_norm_kernel(x_ref, w_ref, o_ref, *, eps: float, rows: int, dim: int, block_m: int,
                    offset: float = 0.0):
    # x_ref, o_ref [block_m, Dp]; w_ref [Dp] (Dp = next power of two >= dim; columns >= dim are padding)
    r = pl.program_id(0) * block_m + jnp.arange(block_m)  # [block_m]
    dp = x_ref.shape[-1]
    col_ok = jnp.arange(dp) < dim  # [Dp]
    mask = (r < rows)[:, None] & col_ok[None, :]
    x = plgpu.load(x_ref, mask=mask, other=0).astype(jnp.float32)  # [block_m, Dp]
    w = plgpu.load(w_ref, mask=col_ok, other=0)  # [Dp]
    inv_rms = jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) / dim + eps)  # [block_m, 1]
    plgpu.store(o_ref, _normed(x, inv_rms, w, offset, x_ref.dtype, o_ref.dtype), mask=mask)


def _validate(x, weight, op: str = "rms_norm"):
    if not hasattr(x, "ndim") or x.ndim < 1:
        raise ValueError(f"{op}: x must be an array of rank >= 1")
    check_array(op, "x", x, x.ndim)
    check_array(op, "weight", weight, 1)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{op}: weight has {weight.shape[0]} entries, x's last axis has "
                         f"{x.shape[-1]}")


def rms_norm(x, weight, *, eps: float, offset: float = 0.0, interpret: bool = False,
             block_m: int | None = None):
    """HF LlamaRMSNorm over the last axis of x [..., D]; returns result_type(weight, x).
    offset != 0: HF's Gemma RMSNorm, normed * (offset + weight) in float32, in x's dtype."""
    _validate(x, weight)
    d = x.shape[-1]
    if block_m is None:
        block_m = max(1, min(16, 8192 // next_pow2(d)))
    return _rms_norm_triton(x, weight, eps=float(eps), offset=float(offset), block_m=block_m,
                            interpret=interpret)


@functools.partial(jax.jit, static_argnames=("eps", "offset", "block_m", "interpret"))
def _rms_norm_triton(x, weight, *, eps, offset, block_m, interpret):
    d = x.shape[-1]
    x2 = x.reshape(-1, d)  # [M, D]
    m = x2.shape[0]
    dp = next_pow2(d)
    out_dtype = x.dtype if offset else jnp.result_type(weight.dtype, x.dtype)
    kernel = functools.partial(rms_norm_kernel, eps=eps, rows=m, dim=d, block_m=block_m,
                               offset=offset)
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, block_m),),
        in_specs=[pl.BlockSpec((block_m, dp), lambda i: (i, 0)),
                  pl.BlockSpec((dp,), lambda i: (0,))],
        out_specs=pl.BlockSpec((block_m, dp), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((m, d), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4 if dp <= 2048 else 8, num_stages=1),
        interpret=interpret,
        name="rms_norm",
    )(x2, weight)
    return out.reshape(x.shape)


def rms_norm_reference(x, weight, *, eps: float, offset: float = 0.0,
                       interpret: bool = False):
    """HF LlamaRMSNorm in plain jnp (interpret is ignored); offset != 0: HF's Gemma RMSNorm,
    normed * (offset + weight) in float32, rounded once to x's dtype."""
    del interpret
    _validate(x, weight)
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if offset:
        return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# Residual add + RMSNorm (the decoder's sublayer boundary)
# ---------------------------------------------------------------------------------------------


def add_rms_norm_kernel(*refs, eps: float, rows: int, dim: int, block_m: int, splits: int,
                        offset: float = 0.0, post: tuple | None = None):
    # refs: `splits` delta refs [block_m, Dp] (the sublayer's output as partial sums: a split-K
    # matmul's float32 chunks, the same array passed once per chunk so that every ref is 2-D),
    # x_ref [block_m, Dp] the residual stream, w_ref [Dp], pw_ref [Dp] if post (eps, offset):
    # the sum's own RMSNorm before the add; outputs xo_ref, h_ref [block_m, Dp]:
    # x + sum(deltas) in x's dtype, and its RMSNorm.
    d_refs, (x_ref, w_ref, *pw_ref, xo_ref, h_ref) = refs[:splits], refs[splits:]
    r = pl.program_id(0) * block_m + jnp.arange(block_m)  # [block_m]
    dp = x_ref.shape[-1]
    col_ok = jnp.arange(dp) < dim  # [Dp]
    mask = (r < rows)[:, None] & col_ok[None, :]
    # Every load is issued before the first use: the weight would otherwise wait for the
    # reduction (one more memory round trip in a latency-bound kernel).
    w = plgpu.load(w_ref, mask=col_ok, other=0)  # [Dp]
    pw = plgpu.load(pw_ref[0], mask=col_ok, other=0) if post is not None else None
    acc = plgpu.load(d_refs[0], mask=mask, other=0).astype(jnp.float32)  # [block_m, Dp]
    for d_ref in d_refs[1:]:  # the chunks in order, then the residual, as XLA sums them
        acc += plgpu.load(d_ref, mask=mask, other=0).astype(jnp.float32)
    xin = plgpu.load(x_ref, mask=mask, other=0).astype(jnp.float32)
    if post is not None:
        # The sublayer's output rounded as the unfused path rounds it, normed, rounded.
        d = acc.astype(xo_ref.dtype).astype(jnp.float32)
        inv_post = jax.lax.rsqrt(jnp.sum(d * d, axis=-1, keepdims=True) / dim + post[0])
        acc = _normed(d, inv_post, pw, post[1], xo_ref.dtype, xo_ref.dtype).astype(jnp.float32)
    acc += xin
    x_new = acc.astype(xo_ref.dtype)  # the residual stream keeps x's dtype (one rounding)
    plgpu.store(xo_ref, x_new, mask=mask)
    xf = x_new.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) / dim + eps)  # [block_m, 1]
    plgpu.store(h_ref, _normed(xf, inv_rms, w, offset, xo_ref.dtype, h_ref.dtype), mask=mask)


def check_deltas(op: str, x, deltas, *, float32_only: bool = False) -> None:
    """deltas must be [S, *x.shape] (S partial sums added to x: a split-K producer's chunks,
    float32 where the kernel takes only those)."""
    if not hasattr(deltas, "ndim") or deltas.ndim != x.ndim + 1:
        raise ValueError(f"{op}: deltas must have rank {x.ndim + 1} ([S, *x.shape]: S partial "
                         f"sums), got {getattr(deltas, 'shape', type(deltas).__name__)}")
    check_array(op, "deltas", deltas, deltas.ndim)
    if tuple(deltas.shape[1:]) != tuple(x.shape):
        raise ValueError(f"{op}: deltas {tuple(deltas.shape)} must be [S, *x.shape] with x "
                         f"{tuple(x.shape)}")
    if float32_only and deltas.dtype != jnp.float32:
        raise ValueError(f"{op}: deltas must be float32 partial sums, got {deltas.dtype}")


def check_post_norm(op: str, x, deltas, post_norm) -> tuple:
    """post_norm (weight [K], eps, offset) of the deltas' sum -> (weight, (eps, offset)), the
    kernels' operand and static; (None, None) for None."""
    if post_norm is None:
        return None, None
    if not (isinstance(post_norm, tuple) and len(post_norm) == 3):
        raise ValueError(f"{op}: post_norm takes (weight [K], eps, offset), got {post_norm!r}")
    if deltas is None:
        raise ValueError(f"{op}: post_norm norms the deltas' sum; pass deltas= with it")
    weight, eps, offset = post_norm
    check_array(op, "post_norm weight", weight, 1)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{op}: the post_norm weight has {weight.shape[0]} entries, x has "
                         f"{x.shape[-1]} features")
    return weight, (float(eps), float(offset))


def add_deltas_reference(x, deltas, post_norm: tuple | None = None):
    """x + sum(deltas): the chunks summed in float32 with x, rounded once to x's dtype. With
    post_norm (weight, eps, offset): x + rms_norm(sum(deltas) rounded to x's dtype), the
    norm's output rounded too (the sandwich norm's unfused path)."""
    total = jnp.sum(deltas.astype(jnp.float32), axis=0)
    if post_norm is not None:
        weight, eps, offset = post_norm
        total = rms_norm_reference(total.astype(x.dtype), weight, eps=eps,
                                   offset=offset).astype(x.dtype).astype(jnp.float32)
    return (total + x.astype(jnp.float32)).astype(x.dtype)


def _validate_add(x, deltas, weight, post_norm=None):
    _validate(x, weight, "add_rms_norm")
    check_deltas("add_rms_norm", x, deltas)
    return check_post_norm("add_rms_norm", x, deltas, post_norm)


def add_rms_norm(x, deltas, weight, *, eps: float, offset: float = 0.0,
                 post_norm: tuple | None = None, interpret: bool = False,
                 block_m: int | None = None):
    """x + sum(deltas) and its HF RMSNorm, in one pass: x [..., D] (the residual stream),
    deltas [S, ..., D] (a sublayer's output, e.g. a split-K matmul's float32 partial sums),
    weight [D]. Returns (x_new in x's dtype, rms_norm(x_new, weight)). offset: the norm
    scales by (offset + weight) in float32 (Gemma: 1.0). post_norm (weight [D], eps, offset):
    x + rms_norm(sum(deltas)) instead, the sum rounded to x's dtype first (Gemma's sandwich
    norm of the sublayer's output)."""
    post_weight, post = _validate_add(x, deltas, weight, post_norm)
    d = x.shape[-1]
    if block_m is None:
        block_m = max(1, min(16, 4096 // next_pow2(d)))
    return _add_rms_norm_triton(x, deltas, weight, post_weight, eps=float(eps), block_m=block_m,
                                offset=float(offset), post=post, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("eps", "block_m", "offset", "post", "interpret"))
def _add_rms_norm_triton(x, deltas, weight, post_weight, *, eps, block_m, offset, post,
                         interpret):
    d = x.shape[-1]
    x2 = x.reshape(-1, d)  # [M, D]
    m = x2.shape[0]
    s = deltas.shape[0]
    d2 = deltas.reshape(s, m, d)  # [S, M, D]
    dp = next_pow2(d)
    h_dtype = jnp.result_type(weight.dtype, x.dtype)
    kernel = functools.partial(add_rms_norm_kernel, eps=eps, rows=m, dim=d, block_m=block_m,
                               splits=s, offset=offset, post=post)
    row = pl.BlockSpec((block_m, dp), lambda i: (i, 0))
    vector = pl.BlockSpec((dp,), lambda i: (0,))
    chunks = [pl.BlockSpec((None, block_m, dp), lambda i, c=c: (c, i, 0)) for c in range(s)]
    posts = [] if post is None else [post_weight]
    x_new, h = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, block_m),),
        in_specs=[*chunks, row, vector, *[vector] * len(posts)],
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct((m, d), x.dtype), jax.ShapeDtypeStruct((m, d), h_dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=4 if dp <= 2048 else 8, num_stages=1),
        interpret=interpret,
        name="add_rms_norm",
    )(*([d2] * s), x2, weight, *posts)
    return x_new.reshape(x.shape), h.reshape(x.shape)


def add_rms_norm_reference(x, deltas, weight, *, eps: float, offset: float = 0.0,
                           post_norm: tuple | None = None, interpret: bool = False):
    """x + sum(deltas) (float32 sum, one rounding to x's dtype) and its RMSNorm, in plain jnp
    (offset, post_norm as in add_rms_norm)."""
    del interpret
    _validate_add(x, deltas, weight, post_norm)
    x_new = add_deltas_reference(x, deltas, post_norm)
    return x_new, rms_norm_reference(x_new, weight, eps=eps, offset=offset)
