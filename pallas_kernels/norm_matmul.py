"""RMSNorm fused into the prologue of the matmul that follows it: rms_norm(x) @ w (+ residual).

Built for decode (M = batch, 1..64), where the op streams the weight and the separate norm's
reduce + scale kernels cost more than the bytes they move. One program owns a [block_m, block_n]
output tile: it first walks its x rows along K for the float32 sum of squares (x is tiny, and
every program re-reading it hits L2), then walks K again, normalising each x tile on the fly
(HF semantics: float32 statistics, `weight * normed.astype(x.dtype)`) and multiplying it into
its [K, block_n] weight slab with float32 accumulation. The residual, when given, is added in
float32 in the epilogue. Any M, K, N: edge tiles use masked loads and stores.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (check_array, check_same_dtype, check_tiles, dot_f32,
                                     multiple_of, ref_precision)


@dataclasses.dataclass(frozen=True)
class NormMatmulBlockSizes:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        check_tiles(self, "block_m", "block_n", "block_k")


def default_block_sizes(m: int, n: int, itemsize: int = 2) -> NormMatmulBlockSizes:
    """Small M streams the weight: thin N tiles so that N = 6144 (Llama-3-8B's q/k/v) still gives
    more programs than the H200's 132 SMs, deep K tiles for many bytes in flight. Unmeasured
    guesses (no GPU when written): sweep them as benchmarks/kernels.py does for SwiGLU.
    float32 gets half-depth tiles and 2 stages to fit shared memory, as in swiglu.py."""
    if itemsize >= 4:
        return NormMatmulBlockSizes(block_m=16 if m <= 16 else 64, block_n=32 if m <= 64 else 64,
                                    block_k=64, num_warps=4, num_stages=2)
    if m <= 16:
        return NormMatmulBlockSizes(block_m=16, block_n=32 if n < 16384 else 64, block_k=256,
                                    num_warps=4, num_stages=4)
    if m <= 64:
        return NormMatmulBlockSizes(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)
    return NormMatmulBlockSizes(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


def norm_matmul_kernel(x_ref, nw_ref, w_ref, *refs, m: int, n: int, k: int, eps: float,
                       block_m: int, block_n: int, block_k: int):
    # x_ref [block_m, Kp]; nw_ref [Kp]; w_ref [Kp, block_n]; refs = ([r_ref,] o_ref), each
    # [block_m, block_n]. Kp = K rounded up to block_k; the tail past K is masked.
    *r_ref, o_ref = refs
    rows = pl.program_id(0) * block_m + jnp.arange(block_m)
    cols = pl.program_id(1) * block_n + jnp.arange(block_n)
    row_ok = (rows < m)[:, None] if m % block_m else None  # [block_m, 1]
    col_ok = (cols < n)[None, :] if n % block_n else None  # [1, block_n]

    def load(ref, mask):
        return ref[...] if mask is None else plgpu.load(ref, mask=mask, other=0)

    def both(a, b):
        return b if a is None else (a if b is None else a & b)

    def x_tile(j, masked_k: bool):
        start = multiple_of(j * block_k, block_k)
        k_ok = (start + jnp.arange(block_k)) < k if masked_k else None  # [block_k]
        x = load(x_ref.at[:, pl.ds(start, block_k)],
                 both(row_ok, None if k_ok is None else k_ok[None, :]))  # [block_m, block_k]
        return start, k_ok, x

    def sumsq_step(j, acc, masked_k: bool):
        x = x_tile(j, masked_k)[2].astype(jnp.float32)
        return acc + jnp.sum(x * x, axis=1)

    def matmul_step(j, carry, masked_k: bool):
        acc, inv_rms = carry  # [block_m, block_n], [block_m] float32
        start, k_ok, x = x_tile(j, masked_k)
        nw = load(nw_ref.at[pl.ds(start, block_k)], k_ok)  # [block_k]
        normed = (x.astype(jnp.float32) * inv_rms[:, None]).astype(x.dtype)
        # weight * normed in x's dtype: the product of two 16-bit floats is exact in float32,
        # so one rounding here equals the reference's 16-bit multiply.
        h = (nw.astype(jnp.float32)[None, :] * normed.astype(jnp.float32)).astype(x.dtype)
        w = load(w_ref.at[pl.ds(start, block_k), :],
                 both(None if k_ok is None else k_ok[:, None], col_ok))  # [block_k, block_n]
        return acc + dot_f32(h, w), inv_rms

    full = k // block_k
    ss = lax.fori_loop(0, full, functools.partial(sumsq_step, masked_k=False),
                       jnp.zeros((block_m,), jnp.float32))
    if k % block_k:
        ss = sumsq_step(full, ss, masked_k=True)
    inv_rms = lax.rsqrt(ss / k + eps)  # [block_m]
    carry = (jnp.zeros((block_m, block_n), jnp.float32), inv_rms)
    carry = lax.fori_loop(0, full, functools.partial(matmul_step, masked_k=False), carry)
    if k % block_k:
        carry = matmul_step(full, carry, masked_k=True)
    acc = carry[0]
    mask = both(row_ok, col_ok)
    if r_ref:
        acc = acc + load(r_ref[0], mask).astype(jnp.float32)
    out = acc.astype(o_ref.dtype)
    if mask is None:
        o_ref[...] = out
    else:
        plgpu.store(o_ref, out, mask=mask)


def _validate(x, norm_weight, w, residual):
    op = "norm_matmul"
    check_array(op, "x", x, 2)
    check_array(op, "norm_weight", norm_weight, 1)
    if not hasattr(w, "ndim") or w.ndim < 2:
        raise ValueError(f"{op}: w must be an array of rank >= 2 ([K, *N], [in, out]), got "
                         f"{getattr(w, 'shape', type(w).__name__)}")
    check_array(op, "w", w, w.ndim)
    arrays = dict(x=x, norm_weight=norm_weight, w=w)
    if residual is not None:
        check_array(op, "residual", residual, getattr(residual, "ndim", 0))
        arrays["residual"] = residual
    check_same_dtype(op, **arrays)
    k = x.shape[1]
    if norm_weight.shape[0] != k:
        raise ValueError(f"{op}: norm_weight has {norm_weight.shape[0]} entries, x has K={k} features")
    if w.shape[0] != k:
        raise ValueError(f"{op}: x has K={k} features but w {tuple(w.shape)} has {w.shape[0]} rows "
                         f"(w is [K, *N], [in, out])")
    want = (x.shape[0], *w.shape[1:])
    if residual is not None and tuple(residual.shape) != want:
        raise ValueError(f"{op}: residual has shape {tuple(residual.shape)}, expected {want} "
                         f"([M, *N] of the output)")


def norm_matmul(x, norm_weight, w, *, eps: float, residual=None, interpret: bool = False,
                block_sizes: NormMatmulBlockSizes | None = None):
    """rms_norm(x, norm_weight) @ w (+ residual); x [M, K], norm_weight [K], w [K, *N],
    residual [M, *N] -> [M, *N] in x's dtype (float32 statistics and accumulation)."""
    _validate(x, norm_weight, w, residual)
    n = math.prod(w.shape[1:])
    blocks = block_sizes or default_block_sizes(x.shape[0], n, x.dtype.itemsize)
    return _norm_matmul_triton(x, norm_weight, w, residual, eps=float(eps), blocks=blocks,
                               interpret=interpret)


@functools.partial(jax.jit, static_argnames=("eps", "blocks", "interpret"))
def _norm_matmul_triton(x, norm_weight, w, residual, *, eps, blocks, interpret):
    m, k = x.shape
    out_dims = w.shape[1:]
    n = math.prod(out_dims)
    w2 = w.reshape(k, n)  # [K, N], free: trailing dims are contiguous
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    # Pad the K extent of the blocks to a multiple of block_k: the masked tail tile then indexes
    # inside the block (interpret mode pads the arrays to the block shape).
    kp = pl.cdiv(k, bk) * bk
    tile = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
    in_specs = [pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
                pl.BlockSpec((kp,), lambda i, j: (0,)),
                pl.BlockSpec((kp, bn), lambda i, j: (0, j))]
    args = [x, norm_weight, w2]
    if residual is not None:
        in_specs.append(tile)
        args.append(residual.reshape(m, n))
    kernel = functools.partial(norm_matmul_kernel, m=m, n=n, k=k, eps=eps, block_m=bm,
                               block_n=bn, block_k=bk)
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, bm), pl.cdiv(n, bn)),
        in_specs=in_specs,
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret,
        name="norm_matmul",
    )(*args)
    return out.reshape(m, *out_dims)


def norm_matmul_reference(x, norm_weight, w, *, eps: float, residual=None,
                          interpret: bool = False):
    """rms_norm(x) @ w (+ residual) in plain jnp: HF RMSNorm, float32 accumulation, the residual
    added in float32 before the cast to x's dtype (interpret is ignored)."""
    del interpret
    _validate(x, norm_weight, w, residual)
    xf = x.astype(jnp.float32)
    normed = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)  # [M, K]
    h = norm_weight * normed.astype(x.dtype)  # [M, K] in x's dtype
    y = lax.dot_general(h, w, (((1,), (0,)), ((), ())), precision=ref_precision(x.dtype),
                        preferred_element_type=jnp.float32)  # [M, *N]
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y.astype(x.dtype)
