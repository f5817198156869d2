"""Decode attention over a paged KV cache, and its fused append form (RoPE + write + attend).

Layout (per layer): page pools k_pages, v_pages [P, page_size, Hkv, D] (16-bit / float32
values, or int8 / fp8 codes with scales k_scale, v_scale [P, page_size, Hkv] as in kv_quant.py)
and block_tables [B, max_pages] int32: position p of row b lives at page
block_tables[b, p // page_size], row p % page_size. Page 0 is the null page: idle rows and
unused table entries point at it; it may hold garbage, and no valid result ever reads it
(positions >= a row's length are masked before any load).

The kernels are decode_attention.py's and decode_attention_append.py's, given the row's block
table: one program per (row, KV head, chunk of the logical sequence) gets the KV head's whole
pools as refs and reads each key tile at a page index loaded from the table, so no contiguous
copy of a row is made. page_size and block_k are both powers of two >= 16: a page of >= block_k
keys holds whole tiles (one page index per tile); a smaller page makes each tile a gather over
block_k / page_size pages (one page index per key). Chunking (split-K, `split_keys`, the merge)
is that of the contiguous kernels over max_pages * page_size logical slots, so with equal block
sizes a row gets the same partial sums in the same order as from a contiguous cache.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels._common import (FLOAT_DTYPES, check_array, check_head_dim, check_softcap,
                                     is_pow2)
from pallas_kernels._jax_private import is_tracer
from pallas_kernels.decode_attention import (DecodeBlockSizes, _decode_attention_triton,
                                             decode_attention_reference, default_block_sizes)
from pallas_kernels.decode_attention_append import (
    _decode_attention_append_triton, _validate as _validate_append, append_block_sizes,
    decode_attention_append_reference, norm_operands)
from pallas_kernels.kv_quant import CODE_DTYPES, check_quantized_cache

I32 = (jnp.dtype(jnp.int32),)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def check_pages(op: str, k_pages, v_pages, block_tables, k_scale=None, v_scale=None
                ) -> tuple[int, int, int, int, int]:
    """Page pools [P, page_size, Hkv, D] of one shape (float, or codes with their scales
    [P, page_size, Hkv]), page_size a power of two >= 16, block_tables [B, max_pages] int32
    whose concrete entries lie in [0, P). Returns (P, page_size, Hkv, D, max_pages)."""
    quantized = k_scale is not None or v_scale is not None
    dtypes = CODE_DTYPES if quantized else FLOAT_DTYPES
    check_array(op, "k_pages", k_pages, 4, dtypes)
    check_array(op, "v_pages", v_pages, 4, dtypes)
    check_array(op, "block_tables", block_tables, 2, I32)
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"{op}: k_pages {tuple(k_pages.shape)} and v_pages "
                         f"{tuple(v_pages.shape)} must have one shape")
    pool, page_size, hkv, d = k_pages.shape
    if not is_pow2(page_size) or page_size < 16:
        raise ValueError(f"{op}: page_size {page_size} (k_pages [P, page_size, Hkv, D]) must be "
                         f"a power of two >= 16")
    if quantized:
        check_quantized_cache(op, k_pages, v_pages, k_scale, v_scale)
    elif k_pages.dtype != v_pages.dtype:
        raise ValueError(f"{op}: k_pages {k_pages.dtype} and v_pages {v_pages.dtype} differ")
    if block_tables.shape[1] < 1:
        raise ValueError(f"{op}: block_tables must have at least one page per row")
    if not is_tracer(block_tables) and block_tables.size:
        bt = jax.device_get(block_tables)
        if bt.min() < 0 or bt.max() >= pool:
            raise ValueError(f"{op}: block_tables entries must lie in [0, {pool}) (the pool "
                             f"holds {pool} pages), got min {bt.min()} max {bt.max()}")
    return pool, page_size, hkv, d, block_tables.shape[1]


def _validate(q, k_pages, v_pages, block_tables, lengths, sliding_window, k_scale, v_scale):
    op = "paged_decode_attention"
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"{op}: sliding_window must be >= 1, got {sliding_window}")
    check_array(op, "q", q, 3, FLOAT_DTYPES)
    check_array(op, "lengths", lengths, 1, I32)
    _, page_size, hkv, d, max_pages = check_pages(op, k_pages, v_pages, block_tables, k_scale,
                                                  v_scale)
    b, hq, dq = q.shape
    if k_scale is None and q.dtype != k_pages.dtype:
        raise ValueError(f"{op}: q {q.dtype} and k_pages {k_pages.dtype} must share one dtype")
    if dq != d:
        raise ValueError(f"{op}: head dim of q ({dq}) and the pages ({d}) differ")
    if hq % hkv:
        raise ValueError(f"{op}: query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if block_tables.shape[0] != b or lengths.shape[0] != b:
        raise ValueError(f"{op}: batch sizes differ: q {b}, block_tables "
                         f"{block_tables.shape[0]}, lengths {lengths.shape[0]}")
    s = max_pages * page_size
    if not is_tracer(lengths) and lengths.size:
        lens = jax.device_get(lengths)
        if lens.max() > s or lens.min() < 0:
            raise ValueError(f"{op}: lengths must lie in [0, {s}] (max_pages * page_size), got "
                             f"min {lens.min()} max {lens.max()}")
    return b, s, hkv, d


# ---------------------------------------------------------------------------------------------
# Wrappers
# ---------------------------------------------------------------------------------------------


def paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, *, k_scale=None,
                           v_scale=None, sm_scale: float | None = None,
                           sliding_window: int | None = None, softcap: float | None = None,
                           block_sizes: DecodeBlockSizes | None = None,
                           interpret: bool = False):
    """q [B, Hq, D] (the token at position lengths[b] - 1, its K/V already in the pages)
    attends to positions [0, lengths[b]) of row b, read through block_tables [B, max_pages]
    from the pools k_pages, v_pages [P, page_size, Hkv, D] (module docstring). With
    `sliding_window=w` only positions > lengths[b] - 1 - w are seen, and only their pages read.
    k_scale, v_scale [P, page_size, Hkv]: the pools hold int8 / fp8 codes, dequantized in
    registers. Returns [B, Hq, D] in q's dtype; a row of length 0 gets zeros. block_sizes:
    as decode_attention's (chunks over max_pages * page_size slots); any power-of-two block_k
    works with any page_size."""
    _, s, hkv, d = _validate(q, k_pages, v_pages, block_tables, lengths, sliding_window,
                             k_scale, v_scale)
    softcap = check_softcap("paged_decode_attention", softcap)
    check_head_dim("paged_decode_attention", d)
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    blocks = block_sizes or default_block_sizes(d)
    chunk, num_splits = blocks.chunking(q.shape[0], hkv, s)
    window = int(sliding_window) if sliding_window is not None else None
    return _decode_attention_triton(q, k_pages, v_pages, lengths, k_scale, v_scale, block_tables,
                                    sm_scale=sm_scale, blocks=blocks, chunk=chunk,
                                    num_splits=num_splits, window=window, softcap=softcap,
                                    interpret=interpret)


def _validate_paged_append(qkv, k_pages, v_pages, block_tables, positions, rope, sliding_window,
                           norm, k_scale, v_scale, dtype):
    """decode_attention_append's checks on the logical [B, max_pages * page_size] view (shape
    stand-ins: nothing is gathered), plus the pools' and the table's; positions < 0 (idle rows)
    are allowed. Returns (B, S, Hkv, D, the activations' dtype)."""
    op = "paged_decode_attention_append"
    _, page_size, hkv, d, max_pages = check_pages(op, k_pages, v_pages, block_tables, k_scale,
                                                  v_scale)
    s = max_pages * page_size
    b = block_tables.shape[0]
    view = lambda x, tail: jax.ShapeDtypeStruct((b, s, *tail), x.dtype)  # noqa: E731
    scales = [None if x is None else view(x, (hkv,)) for x in (k_scale, v_scale)]
    if not is_tracer(positions) and hasattr(positions, "shape"):
        positions = jnp.where(positions < 0, 0, positions)  # idle rows: checked as slot 0
    return _validate_append(qkv, view(k_pages, (hkv, d)), view(v_pages, (hkv, d)), positions,
                            rope, sliding_window, norm, *scales, dtype)


def paged_decode_attention_append(qkv, k_pages, v_pages, block_tables, positions, *,
                                  k_scale=None, v_scale=None, dtype=None, rope=None,
                                  sm_scale: float | None = None,
                                  sliding_window: int | None = None, norm=None,
                                  softcap: float | None = None,
                                  block_sizes: DecodeBlockSizes | None = None,
                                  interpret: bool = False):
    """decode_attention_append on a paged cache: rotate the new token's q and k (`rope`),
    write its k and v at position positions[b] of row b (page block_tables[b, pos //
    page_size], row pos % page_size of k_pages / v_pages [P, page_size, Hkv, D], in place
    when the caller's jit donates the pools) and attend q to positions [0, positions[b]].

    qkv, rope, norm, dtype, sliding_window, softcap, k_scale / v_scale ([P, page_size, Hkv]):
    as decode_attention_append. A row with positions[b] < 0 is idle: it writes nothing and
    gets zeros. The page holding a row's new slot must be that row's alone (shared prefix
    pages are read-only here: another program may be reading them). Returns (out [B, Hq, D],
    k_pages, v_pages[, k_scale, v_scale])."""
    _, s, hkv, _, act = _validate_paged_append(qkv, k_pages, v_pages, block_tables, positions,
                                               rope, sliding_window, norm, k_scale, v_scale,
                                               dtype)
    op = "paged_decode_attention_append"
    softcap = check_softcap(op, softcap)
    if qkv.ndim == 4:
        qkv = qkv[None]  # [1, B, Hkv, G + 2, D]: one part
    d = qkv.shape[-1]
    check_head_dim(op, d)
    if rope is not None:
        check_head_dim(f"{op} (RoPE halves)", d // 2)
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    blocks, chunk, num_splits = append_block_sizes(block_sizes, qkv.shape[1], hkv, s, d)
    window = int(sliding_window) if sliding_window is not None else None
    ss, norm_static = norm_operands(norm)
    out = _decode_attention_append_triton(
        qkv, k_pages, v_pages, positions, rope, ss, k_scale, v_scale, block_tables,
        sm_scale=sm_scale, blocks=blocks, chunk=chunk, num_splits=num_splits, window=window,
        norm=norm_static, dtype=act, softcap=softcap, interpret=interpret)
    return out if k_scale is not None else out[:3]


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------


def gather_pages(pages, block_tables):
    """pages [P, page_size, ...] -> each row's logical view [B, max_pages * page_size, ...]."""
    b, max_pages = block_tables.shape
    rows = pages[block_tables]  # [B, max_pages, page_size, ...]
    return rows.reshape(b, max_pages * pages.shape[1], *pages.shape[2:])


def paged_decode_attention_reference(q, k_pages, v_pages, block_tables, lengths, *,
                                     k_scale=None, v_scale=None, sm_scale: float | None = None,
                                     sliding_window: int | None = None,
                                     softcap: float | None = None,
                                     block_sizes: DecodeBlockSizes | None = None,
                                     interpret: bool = False):
    """Plain jnp: gather the rows' pages into contiguous caches, then
    decode_attention_reference (block_sizes and interpret are ignored). The null page's
    garbage must be finite here (p = 0 times inf is NaN); the kernel never loads it."""
    del block_sizes, interpret
    _validate(q, k_pages, v_pages, block_tables, lengths, sliding_window, k_scale, v_scale)
    k, v = gather_pages(k_pages, block_tables), gather_pages(v_pages, block_tables)
    if k_scale is not None:
        k_scale, v_scale = gather_pages(k_scale, block_tables), gather_pages(v_scale,
                                                                             block_tables)
    return decode_attention_reference(q, k, v, lengths, k_scale=k_scale, v_scale=v_scale,
                                      sm_scale=sm_scale, sliding_window=sliding_window,
                                      softcap=softcap)


def paged_decode_attention_append_reference(qkv, k_pages, v_pages, block_tables, positions, *,
                                            k_scale=None, v_scale=None, dtype=None, rope=None,
                                            sm_scale: float | None = None,
                                            sliding_window: int | None = None, norm=None,
                                            softcap: float | None = None,
                                            block_sizes: DecodeBlockSizes | None = None,
                                            interpret: bool = False):
    """Plain jnp: decode_attention_append_reference on the rows' gathered views (idle rows
    at slot 0), then its new slots scattered into the pools (idle rows dropped) and idle rows'
    outputs zeroed. Returns what the kernel does."""
    del block_sizes, interpret
    _validate_paged_append(qkv, k_pages, v_pages, block_tables, positions, rope,
                           sliding_window, norm, k_scale, v_scale, dtype)
    page_size = k_pages.shape[1]
    b = block_tables.shape[0]
    active = positions >= 0  # [B]
    pos = jnp.where(active, positions, 0)
    views = [gather_pages(x, block_tables) for x in (k_pages, v_pages)]
    if k_scale is not None:
        views += [gather_pages(x, block_tables) for x in (k_scale, v_scale)]
    else:
        views += [None, None]
    out, *new = decode_attention_append_reference(
        qkv, views[0], views[1], pos, k_scale=views[2], v_scale=views[3], dtype=dtype,
        rope=rope, sm_scale=sm_scale, sliding_window=sliding_window, norm=norm, softcap=softcap)
    rows = jnp.arange(b)
    # The written slot's page, or P (out of range: dropped) for an idle row.
    page = jnp.where(active, block_tables[rows, pos // page_size], k_pages.shape[0])  # [B]
    pools = [k_pages, v_pages] + ([k_scale, v_scale] if k_scale is not None else [])
    pools = [p.at[page, pos % page_size].set(n[rows, pos], mode="drop")
             for p, n in zip(pools, new)]
    out = jnp.where(active[:, None, None], out, jnp.zeros_like(out))
    return (out, *pools)
