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


def rms_norm_kernel(x_ref, w_ref, o_ref, *, eps: float, rows: int, dim: int, block_m: int):
    # x_ref, o_ref [block_m, Dp]; w_ref [Dp] (Dp = next power of two >= dim; columns >= dim are padding)
    r = pl.program_id(0) * block_m + jnp.arange(block_m)  # [block_m]
    dp = x_ref.shape[-1]
    col_ok = jnp.arange(dp) < dim  # [Dp]
    mask = (r < rows)[:, None] & col_ok[None, :]
    x = plgpu.load(x_ref, mask=mask, other=0).astype(jnp.float32)  # [block_m, Dp]
    w = plgpu.load(w_ref, mask=col_ok, other=0)  # [Dp]
    inv_rms = jax.lax.rsqrt(jnp.sum(x * x, axis=-1) / dim + eps)  # [block_m]
    normed = (x * inv_rms[:, None]).astype(x_ref.dtype)
    out = w[None, :].astype(o_ref.dtype) * normed.astype(o_ref.dtype)
    plgpu.store(o_ref, out, mask=mask)


def _validate(x, weight, op: str = "rms_norm"):
    if not hasattr(x, "ndim") or x.ndim < 1:
        raise ValueError(f"{op}: x must be an array of rank >= 1")
    check_array(op, "x", x, x.ndim)
    check_array(op, "weight", weight, 1)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{op}: weight has {weight.shape[0]} entries, x's last axis has "
                         f"{x.shape[-1]}")


def rms_norm(x, weight, *, eps: float, interpret: bool = False, block_m: int | None = None):
    """HF LlamaRMSNorm over the last axis of x [..., D]; returns result_type(weight, x)."""
    _validate(x, weight)
    d = x.shape[-1]
    if block_m is None:
        block_m = max(1, min(16, 8192 // next_pow2(d)))
    return _rms_norm_triton(x, weight, eps=float(eps), block_m=block_m, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("eps", "block_m", "interpret"))
def _rms_norm_triton(x, weight, *, eps, block_m, interpret):
    d = x.shape[-1]
    x2 = x.reshape(-1, d)  # [M, D]
    m = x2.shape[0]
    dp = next_pow2(d)
    out_dtype = jnp.result_type(weight.dtype, x.dtype)
    kernel = functools.partial(rms_norm_kernel, eps=eps, rows=m, dim=d, block_m=block_m)
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


def rms_norm_reference(x, weight, *, eps: float, interpret: bool = False):
    """HF LlamaRMSNorm in plain jnp (interpret is ignored)."""
    del interpret
    _validate(x, weight)
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# Residual add + RMSNorm (the decoder's sublayer boundary)
# ---------------------------------------------------------------------------------------------


def add_rms_norm_kernel(*refs, eps: float, rows: int, dim: int, block_m: int, splits: int):
    # refs: `splits` delta refs [block_m, Dp] (the sublayer's output as partial sums: a split-K
    # matmul's float32 chunks, the same array passed once per chunk so that every ref is 2-D),
    # x_ref [block_m, Dp] the residual stream, w_ref [Dp]; outputs xo_ref, h_ref [block_m, Dp]:
    # x + sum(deltas) in x's dtype, and its RMSNorm.
    d_refs, (x_ref, w_ref, xo_ref, h_ref) = refs[:splits], refs[splits:]
    r = pl.program_id(0) * block_m + jnp.arange(block_m)  # [block_m]
    dp = x_ref.shape[-1]
    col_ok = jnp.arange(dp) < dim  # [Dp]
    add_and_norm(d_refs, x_ref, w_ref, xo_ref, h_ref, (r < rows)[:, None] & col_ok[None, :],
                 col_ok, dim=dim, eps=eps)


def add_and_norm(d_refs, x_ref, w_ref, xo_ref, h_ref, mask, col_ok, *, dim: int, eps: float,
                 store=None):
    """A kernel's boundary over its rows: xo = x + sum(deltas) (float32, one rounding to x's
    dtype), h = its RMSNorm. x_ref, xo_ref, h_ref and each delta ref [..., Dp] (one row [Dp]
    or a block [block_m, Dp]) under mask; w_ref [Dp] under col_ok; store (None: all): a mask
    [..., Dp] of the columns this program stores."""
    # Every load is issued before the first use: the weight would otherwise wait for the
    # reduction (one more memory round trip in a latency-bound kernel).
    w = plgpu.load(w_ref, mask=col_ok, other=0)  # [Dp]
    acc = plgpu.load(d_refs[0], mask=mask, other=0).astype(jnp.float32)  # [..., Dp]
    for d_ref in d_refs[1:]:  # the chunks in order, then the residual, as XLA sums them
        acc += plgpu.load(d_ref, mask=mask, other=0).astype(jnp.float32)
    acc += plgpu.load(x_ref, mask=mask, other=0).astype(jnp.float32)
    x_new = acc.astype(xo_ref.dtype)  # the residual stream keeps x's dtype (one rounding)
    smask = mask if store is None else mask & store
    plgpu.store(xo_ref, x_new, mask=smask)
    xf = x_new.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1) / dim + eps)[..., None]  # [..., 1]
    normed = (xf * inv_rms).astype(xo_ref.dtype)
    plgpu.store(h_ref, w.astype(h_ref.dtype) * normed.astype(h_ref.dtype), mask=smask)


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


def add_deltas_reference(x, deltas):
    """x + sum(deltas): the chunks summed in float32 with x, rounded once to x's dtype."""
    return (jnp.sum(deltas.astype(jnp.float32), axis=0) + x.astype(jnp.float32)).astype(x.dtype)


def check_add(op: str, x, deltas, weight) -> None:
    """x [..., D], deltas [S, ..., D] and a norm weight [D] for op's boundary."""
    _validate(x, weight, op)
    check_deltas(op, x, deltas)


def add_rms_norm(x, deltas, weight, *, eps: float, interpret: bool = False,
                 block_m: int | None = None):
    """x + sum(deltas) and its HF RMSNorm, in one pass: x [..., D] (the residual stream),
    deltas [S, ..., D] (a sublayer's output, e.g. a split-K matmul's float32 partial sums),
    weight [D]. Returns (x_new in x's dtype, rms_norm(x_new, weight))."""
    check_add("add_rms_norm", x, deltas, weight)
    d = x.shape[-1]
    if block_m is None:
        block_m = max(1, min(16, 4096 // next_pow2(d)))
    return _add_rms_norm_triton(x, deltas, weight, eps=float(eps), block_m=block_m,
                                interpret=interpret)


@functools.partial(jax.jit, static_argnames=("eps", "block_m", "interpret"))
def _add_rms_norm_triton(x, deltas, weight, *, eps, block_m, interpret):
    d = x.shape[-1]
    x2 = x.reshape(-1, d)  # [M, D]
    m = x2.shape[0]
    s = deltas.shape[0]
    d2 = deltas.reshape(s, m, d)  # [S, M, D]
    dp = next_pow2(d)
    h_dtype = jnp.result_type(weight.dtype, x.dtype)
    kernel = functools.partial(add_rms_norm_kernel, eps=eps, rows=m, dim=d, block_m=block_m,
                               splits=s)
    row = pl.BlockSpec((block_m, dp), lambda i: (i, 0))
    chunks = [pl.BlockSpec((None, block_m, dp), lambda i, c=c: (c, i, 0)) for c in range(s)]
    x_new, h = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, block_m),),
        in_specs=[*chunks, row, pl.BlockSpec((dp,), lambda i: (0,))],
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct((m, d), x.dtype), jax.ShapeDtypeStruct((m, d), h_dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=4 if dp <= 2048 else 8, num_stages=1),
        interpret=interpret,
        name="add_rms_norm",
    )(*([d2] * s), x2, weight)
    return x_new.reshape(x.shape), h.reshape(x.shape)


def add_rms_norm_reference(x, deltas, weight, *, eps: float, interpret: bool = False):
    """x + sum(deltas) (float32 sum, one rounding to x's dtype) and its RMSNorm, in plain jnp."""
    del interpret
    check_add("add_rms_norm", x, deltas, weight)
    x_new = add_deltas_reference(x, deltas)
    return x_new, rms_norm_reference(x_new, weight, eps=eps)
