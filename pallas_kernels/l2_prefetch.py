"""Read a prefix of each row of x [S, L] with a bounded grid, to leave it in the GPU's L2.

The decode step's attention kernel runs on B * Hkv programs (8 at batch 1) for ~6 us and moves
little data, so the HBM idles; this kernel, on a second CUDA stream beside it
(`jaxinfer.models.layers.l2_prefetch`), reads the start of the next matmul's weight so that the
matmul finds it in L2. What it computes (the max of each program's span) only keeps the loads
alive. An XLA reduction did the same reads, but its blocks filled the SMs and the attention's
programs waited ~4 us for a slot (measured on the H200); these programs have 4 warps, no shared
memory (one stage) and ~40 registers, so the attention's fit beside them. Each has one 16 KB
load in flight (~1 us from HBM), so the bandwidth comes from their number: ~4 per SM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import check_array

BLOCK = 8192  # elements per load: 16 KB of bf16, 64 per thread of 4 warps


def l2_prefetch_kernel(*refs, span: int, block: int):
    # refs: x_ref [S, L] (all of x), [after_ref (never read)], o_ref [S, P] float32. Program
    # (s, p) reads x[s, p * span : (p + 1) * span] in `block`-element loads, one at a time.
    x_ref, o_ref = refs[0], refs[-1]
    s, p = pl.program_id(0), pl.program_id(1)
    base = p * span

    def body(i, acc):
        tile = plgpu.load(x_ref.at[s, pl.ds(base + i * block, block)],
                          eviction_policy="evict_last")  # [block]
        return jnp.maximum(acc, jnp.max(tile.astype(jnp.float32)))

    acc = jax.lax.fori_loop(0, span // block, body, jnp.float32(-jnp.inf))
    o_ref[s, p] = acc


def _validate(x, length: int, programs: int, block: int, op: str = "l2_prefetch"):
    check_array(op, "x", x, 2)
    if programs < 1 or block < 1:
        raise ValueError(f"{op}: programs ({programs}) and block ({block}) must be >= 1")
    if not 0 < length <= x.shape[1]:
        raise ValueError(f"{op}: length {length} must be in [1, {x.shape[1]}] (x's row length)")
    if length % (programs * block):
        raise ValueError(f"{op}: length {length} must be a multiple of programs * block = "
                         f"{programs} * {block}; round it down")


def l2_prefetch(x, *, length: int, programs: int, block: int = BLOCK, after=None,
                interpret: bool = False):
    """Read x[:, :length] (x [S, L]) with S * programs programs; returns float32 [S, programs],
    the max of each program's contiguous span of length // programs elements. after: an array
    the kernel never reads, passed only so that XLA runs it after the array's producer."""
    _validate(x, length, programs, block)
    return _l2_prefetch_triton(x, after, length=length, programs=programs, block=block,
                               interpret=interpret)


def _l2_prefetch_triton(x, after, *, length, programs, block, interpret):
    # Not jitted: the model calls it inside `compute_on("gpu_stream:1")`, where a nested jit
    # becomes a nested stream-annotated call that XLA (jax 0.11.2) finds no stream for.
    s = x.shape[0]
    args = (x,) if after is None else (x, after)
    return pl.pallas_call(
        functools.partial(l2_prefetch_kernel, span=length // programs, block=block),
        grid=(s, programs),
        out_shape=jax.ShapeDtypeStruct((s, programs), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="l2_prefetch",
    )(*args)


def l2_prefetch_reference(x, *, length: int, programs: int, block: int = BLOCK, after=None,
                          interpret: bool = False):
    """The same result in plain jnp (after and interpret are ignored)."""
    del after, interpret
    _validate(x, length, programs, block)
    spans = x[:, :length].reshape(x.shape[0], programs, -1)  # [S, P, span]
    return jnp.max(spans.astype(jnp.float32), axis=-1)
