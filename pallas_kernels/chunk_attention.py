"""Chunk attention: T new queries at their own cache positions against a (quantized) KV cache.

The T > 1 counterpart of decode_attention.py (a chunked prefill, a speculative verification):
query t of sequence b sits at position positions[b, t], its own K/V already written, and sees
cache slots <= that position (with `sliding_window=w` also > position - w); slot i holds
position i. One program handles `block_q` queries of one query head of one sequence (the
tiling of flash_attention.py: GQA reads the KV group's cache row, never a repeated copy) and
walks the key tiles from the lowest slot any of its queries sees to the highest, each tile
masked per query. A quantized cache (int8 / fp8 codes, per-(token, head) scales) is read as
codes and dequantized in registers as in decode_attention.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (FLOAT_DTYPES, LOG2_E, MASK_VALUE, check_array, check_head_dim,
                                    check_same_dtype, check_softcap, dot_f32, multiple_of,
                                    softcap_log2)
from pallas_kernels._jax_private import is_tracer
from pallas_kernels.flash_attention import FlashBlockSizes, default_block_sizes
from pallas_kernels.kv_quant import (CODE_DTYPES, check_quantized_cache, codes_as,
                                     reference_operands)

# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


def online_softmax_tile(q, k, v, scales, kv_ok, cols, pos, carry, *, qk_scale: float,
                        window: int | None, softcap: float | None):
    """One key tile of the base-2 online softmax of queries q [R, D] at positions pos [R]
    (query r sees cols <= pos[r], with a window also > pos[r] - window): k, v [block_k, D] the
    tile as loaded (codes when scales = (k_s, v_s) [block_k] are given), kv_ok [block_k]
    its loaded keys, cols [block_k] their positions. carry = (acc [R, D], m [R], l [R])
    float32 -> the same. Shared by the contiguous and paged chunk kernels."""
    acc, m, l = carry
    if scales is not None:
        k = codes_as(k, q.dtype)
    sc = dot_f32(q, k, trans_b=True)  # [R, block_k]
    if scales is not None:
        sc = sc * scales[0][None, :]
    visible = kv_ok[None, :] & (cols[None, :] <= pos[:, None])
    if window is not None:
        visible &= cols[None, :] > pos[:, None] - window
    sc = jnp.where(visible, softcap_log2(sc * qk_scale, softcap), MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(sc - m_new[:, None])  # [R, block_k]
    l = l * alpha + jnp.sum(p, axis=-1)
    if scales is not None:
        pv = dot_f32((p * scales[1][None, :]).astype(q.dtype), codes_as(v, q.dtype))
    else:
        pv = dot_f32(p.astype(v.dtype), v)
    return acc * alpha[:, None] + pv, m_new, l


def chunk_attention_kernel(pos_ref, q_ref, k_ref, v_ref, *refs, sm_scale: float, t: int, s: int,
                           block_k: int, window: int | None, quantized: bool,
                           softcap: float | None = None):
    # pos_ref [block_q] int32: the tile's query positions (rows >= t lie past the array and are
    #   masked on load, as are their queries)
    # q_ref, o_ref [block_q, D]: the tile's queries of one head, and their output
    # k_ref, v_ref [S_pad, D]: the sequence's cache row of that head's KV group (codes when
    #   quantized); rows >= s are masked, never used
    # ks_ref, vs_ref [S_pad] (quantized): that row's scales
    if quantized:
        ks_ref, vs_ref, o_ref = refs
    else:
        (o_ref,) = refs
    block_q, d = q_ref.shape
    rows = pl.program_id(2) * block_q + jnp.arange(block_q)  # [block_q] query index
    row_ok = rows < t
    pos = plgpu.load(pos_ref, mask=row_ok, other=0)  # [block_q]
    q = plgpu.load(q_ref, mask=row_ok[:, None], other=0)  # [block_q, D]
    qk_scale = sm_scale * LOG2_E  # softmax in base 2

    # Key tiles [lo, hi): from the lowest slot a query of the tile sees to its highest position.
    hi = pl.cdiv(jnp.minimum(jnp.max(jnp.where(row_ok, pos, 0)) + 1, s), block_k)
    lo = 0
    if window is not None:
        lowest = jnp.min(jnp.where(row_ok, pos, s))
        lo = jnp.maximum(lowest - window + 1, 0) // block_k

    def step(j, carry):  # carry: [block_q, D], [block_q], [block_q] (float32)
        base = multiple_of(j * block_k, block_k)
        cols = base + jnp.arange(block_k)  # [block_k] slot
        kv_ok = cols < s
        # (a float fill: Triton casts no integer to fp8)
        k = plgpu.load(k_ref.at[pl.ds(base, block_k), :], mask=kv_ok[:, None], other=0.0)
        v = plgpu.load(v_ref.at[pl.ds(base, block_k), :], mask=kv_ok[:, None], other=0.0)
        scales = None
        if quantized:
            scales = tuple(plgpu.load(r.at[pl.ds(base, block_k)], mask=kv_ok, other=0
                                      ).astype(jnp.float32) for r in (ks_ref, vs_ref))
        return online_softmax_tile(q, k, v, scales, kv_ok, cols, pos, carry,
                                   qk_scale=qk_scale, window=window, softcap=softcap)

    carry = (jnp.zeros((block_q, d), jnp.float32),
             jnp.full((block_q,), MASK_VALUE, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    acc, _, l = lax.fori_loop(lo, hi, step, carry)
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    plgpu.store(o_ref, out.astype(o_ref.dtype), mask=row_ok[:, None])


# ---------------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------------


def _validate(q, k_cache, v_cache, positions, sliding_window, k_scale, v_scale):
    op = "chunk_attention"
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"{op}: sliding_window must be >= 1, got {sliding_window}")
    check_array(op, "q", q, 4)
    b, t, hq, d = q.shape
    check_array(op, "positions", positions, 2, dtypes=(jnp.dtype(jnp.int32),))
    if tuple(positions.shape) != (b, t):
        raise ValueError(f"{op}: positions must be [B, T] = {(b, t)}, got "
                         f"{tuple(positions.shape)}")
    quantized = k_scale is not None or v_scale is not None
    dtypes = CODE_DTYPES if quantized else FLOAT_DTYPES
    check_array(op, "k_cache", k_cache, 4, dtypes)
    check_array(op, "v_cache", v_cache, 4, dtypes)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{op}: k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} must have one shape")
    bk, s, hkv, dk = k_cache.shape
    if bk != b or dk != d or hkv == 0 or hq % hkv:
        raise ValueError(f"{op}: q {tuple(q.shape)} ([B, T, Hq, D]) does not match the caches "
                         f"{tuple(k_cache.shape)} ([B, S, Hkv, D], Hq a multiple of Hkv)")
    if quantized:
        check_quantized_cache(op, k_cache, v_cache, k_scale, v_scale)
    else:
        check_same_dtype(op, q=q, k_cache=k_cache, v_cache=v_cache)
    if not is_tracer(positions):  # under jit the caller owns this check
        pos = jax.device_get(positions)
        if pos.size and (pos.max() >= s or pos.min() < 0):
            raise ValueError(f"{op}: positions must lie in [0, {s}) (the cache holds {s} "
                             f"slots), got min {pos.min()} max {pos.max()}")


def chunk_attention(q, k_cache, v_cache, positions, *, k_scale=None, v_scale=None,
                    sm_scale: float | None = None, sliding_window: int | None = None,
                    interpret: bool = False, block_sizes: FlashBlockSizes | None = None,
                    softcap: float | None = None):
    """q [B, T, Hq, D] at positions [B, T] (int32, in [0, S)) attends to the cache slots of
    k/v_cache [B, S, Hkv, D] at or before its position (HF's sliding window: > position - w).

    k_scale, v_scale [B, S, Hkv] (float32 / float16): the caches hold int8 or fp8 codes of a
    quantized cache, dequantized in registers. Returns [B, T, Hq, D] in q's dtype. softcap:
    scores = softcap * tanh(scores / softcap) before the mask (Gemma 2), or None.
    """
    _validate(q, k_cache, v_cache, positions, sliding_window, k_scale, v_scale)
    softcap = check_softcap("chunk_attention", softcap)
    d = q.shape[-1]
    check_head_dim("chunk_attention", d)
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    blocks = block_sizes or default_block_sizes(d, jnp.dtype(q.dtype).itemsize)
    window = int(sliding_window) if sliding_window is not None else None
    return _chunk_attention_triton(q, k_cache, v_cache, positions, k_scale, v_scale,
                                   sm_scale=sm_scale, blocks=blocks, window=window,
                                   softcap=softcap, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "blocks", "window", "softcap",
                                             "interpret"))
def _chunk_attention_triton(q, k_cache, v_cache, positions, k_scale, v_scale, *, sm_scale,
                            blocks, window, softcap, interpret):
    b, t, hq, d = q.shape
    _, s, hkv, _ = k_cache.shape
    g = hq // hkv
    block_q, block_k = blocks.block_q, blocks.block_k
    s_pad = pl.cdiv(s, block_k) * block_k  # whole key tiles (rows >= s are masked)
    quantized = k_scale is not None
    kernel = functools.partial(chunk_attention_kernel, sm_scale=sm_scale, t=t, s=s,
                               block_k=block_k, window=window, quantized=quantized,
                               softcap=softcap)
    row = pl.BlockSpec((None, s_pad, None, d), lambda i, h, j: (i, 0, h // g, 0))
    in_specs = [pl.BlockSpec((None, block_q), lambda i, h, j: (i, j)),
                pl.BlockSpec((None, block_q, None, d), lambda i, h, j: (i, j, h, 0)), row, row]
    args = [positions, q, k_cache, v_cache]
    if quantized:  # the KV head's scales [S_pad], strided by Hkv
        in_specs += [pl.BlockSpec((None, s_pad, None), lambda i, h, j: (i, 0, h // g))] * 2
        args += [k_scale, v_scale]
    return pl.pallas_call(
        kernel,
        grid=(b, hq, pl.cdiv(t, block_q)),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_q, None, d), lambda i, h, j: (i, j, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret,
        name="chunk_attention_quantized" if quantized else "chunk_attention",
    )(*args)


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def chunk_attention_reference(q, k_cache, v_cache, positions, *, k_scale=None, v_scale=None,
                              sm_scale: float | None = None, sliding_window: int | None = None,
                              interpret: bool = False, block_sizes: FlashBlockSizes | None = None,
                              softcap: float | None = None):
    """Plain jnp with the same signature (interpret and block_sizes are ignored); a quantized
    cache is dequantized to float32 first."""
    del interpret, block_sizes
    _validate(q, k_cache, v_cache, positions, sliding_window, k_scale, v_scale)
    softcap = check_softcap("chunk_attention", softcap)
    b, t, hq, d = q.shape
    _, s, hkv, _ = k_cache.shape
    k_cache, v_cache, precision = reference_operands(k_cache, v_cache, k_scale, v_scale,
                                                     q.dtype)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    qg = q.reshape(b, t, hkv, hq // hkv, d)  # [B, T, Hkv, G, D]
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_cache, preferred_element_type=jnp.float32,
                        precision=precision) * scale  # [B, Hkv, G, T, S]
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    slots = jnp.arange(s)[None, None, :]  # [1, 1, S]
    visible = slots <= positions[:, :, None]  # [B, T, S]
    if sliding_window is not None:
        visible &= slots > positions[:, :, None] - sliding_window
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v_cache.dtype), v_cache,
                   preferred_element_type=jnp.float32, precision=precision)
    return o.reshape(b, t, hq, d).astype(q.dtype)
