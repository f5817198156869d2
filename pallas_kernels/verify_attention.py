"""Verify attention: a few new queries per sequence (a speculative verification: the last
token and K drafts) against a long KV cache, split over the keys as decode attention is.

The chunk kernel (chunk_attention.py) tiles the queries and walks all of a row's keys in one
program: at T = K + 1 queries a long cache is read by B * Hq programs with no split (0.15 TB/s
at B1, benchmarks/DECISIONS.md). Here one program handles one (sequence, KV head, chunk of
the keys) and all T x G query rows of that KV group at once (row r = query t * G + head g, each
with its own position: causal among the new tokens), as decode_attention.py does for G rows;
the chunks' partial softmaxes are merged by the same second step. A quantized cache is read
as codes, dequantized in registers (decode_attention.py). `paged_verify_attention` reads a
paged cache through the rows' block tables (paged_attention.py's tiles).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (LOG2_E, MASK_VALUE, check_head_dim, check_softcap,
                                    next_pow2)
from pallas_kernels.chunk_attention import _validate, chunk_attention_reference
from pallas_kernels.paged_chunk_attention import _validate as paged_validate
from pallas_kernels.paged_chunk_attention import paged_chunk_attention_reference
from pallas_kernels.decode_attention import (DecodeBlockSizes, _merge_splits, attend_tiles,
                                             default_block_sizes)

# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


def verify_attention_kernel(pos_ref, *refs, sm_scale: float, chunk: int, block_k: int,
                            window: int | None, rows: int, quantized: bool,
                            softcap: float | None = None, page_size: int | None = None):
    # pos_ref [Rp] int32: each query row's position (row r = t * G + g); rows >= R lie past
    #   the array and are masked on load
    # q_ref [Rp, D]: the T x G query rows of one KV group
    # k_ref, v_ref [S_pad, D]: one KV head's cache row (codes when quantized); a program reads
    #   its chunk's keys up to the highest row position only
    # ks_ref, vs_ref [S_pad] (quantized): that row's scales
    # acc_ref [Rp, D], m_ref [Rp], l_ref [Rp] (float32): this chunk's partials, R rows stored
    # Paged (page_size given): bt_ref [max_pages] int32 the row's block table first, and
    #   k_ref/v_ref (ks_ref/vs_ref) one KV head's page pools [P, page_size, D] ([P, page_size])
    pages = None
    if page_size is not None:
        bt_ref, *refs = refs
        pages = (bt_ref, page_size)
    q_ref, k_ref, v_ref, *refs = refs
    scales = None
    if quantized:
        ks_ref, vs_ref, *refs = refs
        scales = (ks_ref, vs_ref)
    acc_ref, m_ref, l_ref = refs
    rp, d = q_ref.shape
    row_ok = jnp.arange(rp) < rows  # [Rp]
    pos = plgpu.load(pos_ref, mask=row_ok, other=-1)  # [Rp]; -1 sees no key
    q = plgpu.load(q_ref, mask=row_ok[:, None], other=0)  # [Rp, D]
    start = pl.program_id(2) * chunk
    end = jnp.minimum(start + chunk, jnp.max(pos) + 1)
    first = None
    if window is not None:  # skip the chunk's whole tiles below every row's window
        lowest = jnp.min(jnp.where(row_ok, pos, jnp.iinfo(jnp.int32).max))
        first = jnp.maximum(start, lowest - window + 1)
        start = jnp.maximum(start, (first // block_k) * block_k)
    acc, m, l = attend_tiles(
        ((q, 0),), k_ref, v_ref, start=start, first=first, end=end, block_k=block_k,
        qk_scale=sm_scale * LOG2_E, scales=scales, softcap=softcap, limits=(pos, window),
        pages=pages,
        carry=(jnp.zeros((rp, d), jnp.float32), jnp.full((rp,), MASK_VALUE, jnp.float32),
               jnp.zeros((rp,), jnp.float32)))
    plgpu.store(acc_ref, acc, mask=row_ok[:, None])
    plgpu.store(m_ref, m, mask=row_ok)
    plgpu.store(l_ref, l, mask=row_ok)


# ---------------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------------


def verify_attention(q, k_cache, v_cache, positions, *, k_scale=None, v_scale=None,
                     sm_scale: float | None = None, sliding_window: int | None = None,
                     interpret: bool = False, block_sizes: DecodeBlockSizes | None = None,
                     softcap: float | None = None):
    """chunk_attention's operation (same signature; block_sizes are decode attention's):
    q [B, T, Hq, D] at positions [B, T] (int32, in [0, S)) attends to the cache slots of
    k/v_cache [B, S, Hkv, D] at or before its position (HF's sliding window: > position - w),
    read in chunks of keys split over programs. For few queries per row (T x G rows per
    program: their registers grow with T). Returns [B, T, Hq, D] in q's dtype."""
    _validate(q, k_cache, v_cache, positions, sliding_window, k_scale, v_scale)
    softcap = check_softcap("verify_attention", softcap)
    d = q.shape[-1]
    check_head_dim("verify_attention", d)
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    blocks = block_sizes or default_block_sizes(d)
    b, s, hkv, _ = k_cache.shape
    chunk, num_splits = blocks.chunking(b, hkv, s)
    window = int(sliding_window) if sliding_window is not None else None
    return _verify_attention_triton(q, k_cache, v_cache, positions, k_scale, v_scale,
                                    sm_scale=sm_scale, blocks=blocks, chunk=chunk,
                                    num_splits=num_splits, window=window, softcap=softcap,
                                    interpret=interpret)


def paged_verify_attention(q, k_pages, v_pages, block_tables, positions, *, k_scale=None,
                           v_scale=None, sm_scale: float | None = None,
                           sliding_window: int | None = None, softcap: float | None = None,
                           block_sizes: DecodeBlockSizes | None = None,
                           interpret: bool = False):
    """paged_chunk_attention's operation (same signature; block_sizes are decode attention's):
    q [B, T, Hq, D] at positions [B, T] (int32; -1: a padding query, zeros out) through
    block_tables [B, max_pages] into the pools k/v_pages [P, page_size, Hkv, D], split over
    the keys as verify_attention is."""
    paged_validate(q, k_pages, v_pages, block_tables, positions, sliding_window, k_scale,
                   v_scale)
    softcap = check_softcap("paged_verify_attention", softcap)
    d = q.shape[-1]
    check_head_dim("paged_verify_attention", d)
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    blocks = block_sizes or default_block_sizes(d)
    _, page_size, hkv, _ = k_pages.shape
    chunk, num_splits = blocks.chunking(q.shape[0], hkv, block_tables.shape[1] * page_size)
    window = int(sliding_window) if sliding_window is not None else None
    return _verify_attention_triton(q, k_pages, v_pages, positions, k_scale, v_scale,
                                    block_tables, sm_scale=sm_scale, blocks=blocks, chunk=chunk,
                                    num_splits=num_splits, window=window, softcap=softcap,
                                    interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "blocks", "chunk", "num_splits",
                                             "window", "softcap", "interpret"))
def _verify_attention_triton(q, k_cache, v_cache, positions, k_scale, v_scale,
                             block_tables=None, *, sm_scale, blocks, chunk, num_splits, window,
                             softcap, interpret):
    # block_tables [B, max_pages] int32: k/v_cache are page pools [P, page_size, Hkv, D],
    # else caches [B, S, Hkv, D]
    b, t, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    r = t * g
    rp = max(16, next_pow2(r))  # tl.dot needs >= 16 rows; the block covers them, loads mask
    s_pad = num_splits * chunk  # whole chunks (rows >= s are masked)
    # [B, Hkv, T * G, D]: a KV group's rows together (a small copy of the queries)
    qg = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, r, d)
    row_pos = jnp.repeat(positions, g, axis=1)  # [B, T * G]
    quantized = k_scale is not None
    paged = block_tables is not None
    page_size = k_cache.shape[1] if paged else None
    kernel = functools.partial(verify_attention_kernel, sm_scale=sm_scale, chunk=chunk,
                               block_k=blocks.block_k, window=window, rows=r,
                               quantized=quantized, softcap=softcap, page_size=page_size)
    if paged:  # the row's block table; one KV head's whole page pools, strided by Hkv
        pool = k_cache.shape[0]
        table = [pl.BlockSpec((None, block_tables.shape[1]), lambda i, h, c: (i, 0))]
        cache = pl.BlockSpec((pool, page_size, None, d), lambda i, h, c: (0, 0, h, 0))
        scale = pl.BlockSpec((pool, page_size, None), lambda i, h, c: (0, 0, h))
    else:  # one KV head's cache row [S_pad, D] and scales [S_pad], strided by Hkv
        table = []
        cache = pl.BlockSpec((None, s_pad, None, d), lambda i, h, c: (i, 0, h, 0))
        scale = pl.BlockSpec((None, s_pad, None), lambda i, h, c: (i, 0, h))
    in_specs = [pl.BlockSpec((None, rp), lambda i, h, c: (i, 0)), *table,
                pl.BlockSpec((None, None, rp, d), lambda i, h, c: (i, h, 0, 0)), cache, cache]
    args = [row_pos, *([block_tables] if paged else []), qg, k_cache, v_cache]
    if quantized:
        in_specs += [scale, scale]
        args += [k_scale, v_scale]
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(b, hkv, num_splits),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, rp, d), lambda i, h, c: (i, h, c, 0, 0)),
                   pl.BlockSpec((None, None, None, rp), lambda i, h, c: (i, h, c, 0)),
                   pl.BlockSpec((None, None, None, rp), lambda i, h, c: (i, h, c, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, num_splits, r, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, num_splits, r), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, num_splits, r), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret,
        name=("paged_" if paged else "") + (
            "verify_attention_quantized" if quantized else "verify_attention"),
    )(*args)
    merged = _merge_splits(acc, m, l, ordered=blocks.split_keys is not None)  # [B, Hkv, R, D]
    out = merged.reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d)
    out = jnp.where((positions >= 0)[:, :, None, None], out, 0.0)  # padding queries: zeros
    return out.astype(q.dtype)


# The references: chunk attention's (the same operations).
verify_attention_reference = chunk_attention_reference
paged_verify_attention_reference = paged_chunk_attention_reference
