"""Fused SwiGLU: silu(x @ w_gate) * (x @ w_up) in one pass over x.

One program computes a [block_m, block_n] tile of the output: it walks K once, multiplying each
x tile into both the gate and the up accumulators (float32), and applies SiLU and the product in
the epilogue, so neither intermediate [M, N] matrix touches HBM. Any M, N, K: edge tiles use
masked loads and stores.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (check_array, check_same_dtype, check_tiles, dot_f32,
                                     multiple_of, ref_precision)


@dataclasses.dataclass(frozen=True)
class SwigluBlockSizes:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_tiles(self, "block_m", "block_n", "block_k")


def default_block_sizes(m: int, itemsize: int = 2) -> SwigluBlockSizes:
    """Small M (decode) streams the weights: thin tiles, many programs. Large M is matmul-bound.
    Fastest of benchmarks/kernels.py's sweep on the H200 at K4096 N14336 bf16: M1/M16 3.7 TB/s,
    M64 3.5 TB/s, M4096 590 TFLOP/s (XLA: 2.5 / 3.3 / 3.0 TB/s, 605 TFLOP/s).
    float32 gets half-depth tiles and 2 stages so two weight tiles per stage fit in shared
    memory (float32 failed to compile on the H200 with the 16-bit tiles; not yet rerun)."""
    if itemsize >= 4:
        return SwigluBlockSizes(block_m=16 if m <= 16 else 64, block_n=64,
                                block_k=64, num_warps=4, num_stages=2)
    if m <= 16:
        return SwigluBlockSizes(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=4)
    if m <= 64:
        return SwigluBlockSizes(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)
    return SwigluBlockSizes(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


def swiglu_kernel(x_ref, wg_ref, wu_ref, o_ref, *, m: int, n: int, k: int, block_m: int,
                  block_n: int, block_k: int):
    # x_ref [block_m, K]; wg_ref, wu_ref [K, block_n]; o_ref [block_m, block_n]
    rows = pl.program_id(0) * block_m + jnp.arange(block_m)
    cols = pl.program_id(1) * block_n + jnp.arange(block_n)
    row_ok = (rows < m)[:, None] if m % block_m else None  # [block_m, 1]
    col_ok = (cols < n)[None, :] if n % block_n else None  # [1, block_n]

    def load(ref, mask):
        return ref[...] if mask is None else plgpu.load(ref, mask=mask, other=0)

    def both(a, b):
        return b if a is None else (a if b is None else a & b)

    def step(j, carry, masked_k: bool):
        gate, up = carry  # [block_m, block_n] float32 each
        start = multiple_of(j * block_k, block_k)
        k_ok = (start + jnp.arange(block_k)) < k if masked_k else None  # [block_k]
        x = load(x_ref.at[:, pl.ds(start, block_k)],
                 both(row_ok, None if k_ok is None else k_ok[None, :]))  # [block_m, block_k]
        w_mask = both(None if k_ok is None else k_ok[:, None], col_ok)
        wg = load(wg_ref.at[pl.ds(start, block_k), :], w_mask)  # [block_k, block_n]
        wu = load(wu_ref.at[pl.ds(start, block_k), :], w_mask)
        return gate + dot_f32(x, wg), up + dot_f32(x, wu)

    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    carry = lax.fori_loop(0, k // block_k, functools.partial(step, masked_k=False), (zeros, zeros))
    if k % block_k:
        carry = step(k // block_k, carry, masked_k=True)
    gate, up = carry
    out = (gate * jax.nn.sigmoid(gate) * up).astype(o_ref.dtype)
    mask = both(row_ok, col_ok)
    if mask is None:
        o_ref[...] = out
    else:
        plgpu.store(o_ref, out, mask=mask)


def _validate(x, w_gate, w_up):
    op = "swiglu"
    check_array(op, "x", x, 2)
    check_array(op, "w_gate", w_gate, 2)
    check_array(op, "w_up", w_up, 2)
    check_same_dtype(op, x=x, w_gate=w_gate, w_up=w_up)
    if w_gate.shape != w_up.shape:
        raise ValueError(f"{op}: w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} "
                         f"must have one shape")
    if w_gate.shape[0] != x.shape[1]:
        raise ValueError(f"{op}: x has K={x.shape[1]} features but the weights have "
                         f"{w_gate.shape[0]} rows (weights are [K, N], [in, out])")


def swiglu(x, w_gate, w_up, *, interpret: bool = False,
           block_sizes: SwigluBlockSizes | None = None):
    """silu(x @ w_gate) * (x @ w_up); x [M, K], w_* [K, N] -> [M, N] in x's dtype."""
    _validate(x, w_gate, w_up)
    blocks = block_sizes or default_block_sizes(x.shape[0], x.dtype.itemsize)
    return _swiglu_triton(x, w_gate, w_up, blocks=blocks, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def _swiglu_triton(x, w_gate, w_up, *, blocks, interpret):
    m, k = x.shape
    n = w_gate.shape[1]
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    # Pad the K extent of the blocks to a multiple of block_k: the masked tail tile then indexes
    # inside the block (interpret mode pads the arrays to the block shape).
    kp = pl.cdiv(k, bk) * bk
    kernel = functools.partial(swiglu_kernel, m=m, n=n, k=k, block_m=bm, block_n=bn, block_k=bk)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, bm), pl.cdiv(n, bn)),
        in_specs=[pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
                  pl.BlockSpec((kp, bn), lambda i, j: (0, j)),
                  pl.BlockSpec((kp, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret,
        name="swiglu",
    )(x, w_gate, w_up)


def swiglu_reference(x, w_gate, w_up, *, interpret: bool = False):
    """silu(x @ w_gate) * (x @ w_up) with float32 accumulation, in plain jnp."""
    del interpret
    _validate(x, w_gate, w_up)
    hp = ref_precision(x.dtype)
    gate = jnp.dot(x, w_gate, preferred_element_type=jnp.float32, precision=hp)
    up = jnp.dot(x, w_up, preferred_element_type=jnp.float32, precision=hp)
    return (jax.nn.silu(gate) * up).astype(x.dtype)
