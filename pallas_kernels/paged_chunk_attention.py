"""Paged chunk attention: T new queries per row at their own positions against a paged KV cache.

The paged counterpart of chunk_attention.py (chunked prefill, the suffix of a prefix-cache hit,
speculative verification). Per layer the cache is a pool of pages k/v_pages [P, page_size, Hkv,
D]; position p of row b lives at (block_tables[b, p // page_size], p % page_size). Page 0 is
the null page (idle rows, unused table entries): it may hold garbage, and no valid result
reads it. positions [B, T]: query t of row b sits at positions[b, t] (its K/V already written)
and sees positions <= it (with `sliding_window=w` also > position - w); -1 marks a padding
query, which reads nothing and gets zeros.

Tiling (GQA): one program handles one (row, KV head, block of queries) and all Gp = next_pow2(G)
query heads of the group, flattened into block_q = queries x Gp rows for the tensor cores, so
a small T (verification, T = 2..9) reads each K/V tile once for every query and head; a large T
gets T / (block_q / Gp) programs per (row, KV head). The program walks the key tiles (block_k
keys, never straddling a page: page_size % block_k == 0) from the lowest position any of its
queries sees to the highest, each tile's page read through the block table (a dynamic page
index, the pattern of jax's pallas/ops/gpu/paged_attention.py). Quantized codes (int8 / fp8,
per-(token, head) scales) are dequantized in registers as in chunk_attention.py.

Batch invariance: a query's bits do not depend on the other queries of its tile (so not on T,
the row index, the other rows or where the chunk starts), for a fixed `block_sizes`; the
default depends on D, the dtype and page_size only. Every program has the same shapes, a query's tiles
are visited in position order from its window's first tile (or 0), and the tiles a query visits
only because another query of the tile needs them contribute exactly nothing:
- a tile past its position (every score MASK_VALUE): the query has already seen key 0 (or the
  first key of its window), so m > MASK_VALUE is a real max, m_new = m, alpha = exp2(0) = 1
  and p = exp2(MASK_VALUE - m) = 0 exactly: l * 1 + 0 and acc * 1 + 0 @ v leave l and acc as
  they were, bit for bit (v is finite: only keys some query of the tile sees are loaded).
- a tile before its window (sliding window only, when a lower query of the tile needs it):
  m stays MASK_VALUE, p = exp2(0) = 1, so l and acc collect finite garbage; at the query's
  first visible tile alpha = exp2(MASK_VALUE - m_real) = 0 exactly and l = 0 * l + sum(p),
  acc = 0 * acc + p @ v: the bits of a start from l = 0, acc = 0 (a product's sum starts at
  +0, so -0 + it is it).
Padding queries (and the Gp - G padding heads) are masked and stored as zeros / not stored.

Split keys (opt-in, `PagedBlockSizes.split_keys`): a (row, KV head, query block) has only B x Hkv
x T / bq programs, 8 for one row of a verification; with split_keys = c each program also takes
one chunk of c positions ([i c, (i + 1) c), fixed whatever the batch or T) and writes a partial
(acc, m, l); the chunks merge in position order (a scan) in XLA. A chunk the query sees no key
of adds exactly +0 (selected out, not multiplied by 0), so the bits are still the query's own,
for a fixed split_keys (a different arithmetic from the unsplit kernel's).
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

from pallas_kernels._common import (FLOAT_DTYPES, LOG2_E, MASK_VALUE, check_array, check_head_dim,
                                    check_same_dtype, check_softcap, check_tiles, multiple_of,
                                    next_pow2, ref_precision)
from pallas_kernels._jax_private import is_tracer
from pallas_kernels.chunk_attention import online_softmax_tile
from pallas_kernels.kv_quant import CODE_DTYPES, SCALE_DTYPES, dequantize_kv


@dataclasses.dataclass(frozen=True)
class PagedBlockSizes:
    """block_q: rows per program (queries x the group's heads padded to a power of two);
    block_k: keys per tile, dividing page_size; split_keys: None, or chunks of this many
    positions (a multiple of block_k) per program, merged in order (see the module docstring).
    Powers of two >= 16."""
    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    split_keys: int | None = None

    def __post_init__(self):
        check_tiles(self, "block_q", "block_k")
        if self.split_keys is not None and (self.split_keys < self.block_k
                                            or self.split_keys % self.block_k):
            raise ValueError(f"PagedBlockSizes.split_keys={self.split_keys}: must be a "
                             f"multiple of block_k={self.block_k}")

# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


def paged_chunk_attention_kernel(pos_ref, bt_ref, q_ref, k_ref, v_ref, *refs, sm_scale: float,
                                 t: int, groups: int, page_size: int, block_k: int,
                                 window: int | None, quantized: bool,
                                 softcap: float | None = None, split_keys: int | None = None):
    # pos_ref [bq] int32: the block's query positions (-1: padding; entries >= t lie past the
    #   array and are masked on load)
    # bt_ref [max_pages] int32: this row's block table
    # q_ref, o_ref [bq, Gp, D]: the block's queries of the KV group's Gp (>= G) heads; heads
    #   >= G lie past the array, masked on load and store
    # k_ref, v_ref [P, page_size, D]: the page pool of this KV head (codes when quantized)
    # ks_ref, vs_ref [P, page_size] (quantized): their scales
    # split_keys: acc_ref [rows, D], m_ref, l_ref [rows] (float32): the partials of keys
    #   [c split_keys, (c + 1) split_keys), c = program_id(3), instead of o_ref
    if quantized:
        ks_ref, vs_ref, *refs = refs
    if split_keys is None:
        (o_ref,) = refs
    else:
        acc_ref, m_ref, l_ref = refs
    bq, gp, d = q_ref.shape
    rows = bq * gp
    q_ok = pl.program_id(2) * bq + jnp.arange(bq) < t  # [bq]
    pos = plgpu.load(pos_ref, mask=q_ok, other=-1)  # [bq]
    q_ok &= pos >= 0
    in_block = q_ok[:, None] & (jnp.arange(gp) < groups)[None, :]  # [bq, Gp]
    q = plgpu.load(q_ref, mask=in_block[:, :, None], other=0)  # [bq, Gp, D]
    q = q.reshape(rows, d)  # row r: query r // Gp, head r % Gp
    pos_rows = jnp.broadcast_to(pos[:, None], (bq, gp)).reshape(rows)  # [rows]
    qk_scale = sm_scale * LOG2_E  # softmax in base 2

    # Keys [key_lo, key_hi]: those some query of the block sees; tiles [lo, hi) cover them.
    key_hi = jnp.max(jnp.where(q_ok, pos, -1))  # -1: no valid query, no tile
    hi = pl.cdiv(key_hi + 1, block_k)
    key_lo, lo = 0, 0
    if window is not None:
        key_lo = jnp.maximum(jnp.min(jnp.where(q_ok, pos, key_hi)) - window + 1, 0)
        lo = key_lo // block_k
    if split_keys is not None:
        per_split = split_keys // block_k
        c = pl.program_id(3)
        lo = jnp.maximum(lo, c * per_split)
        hi = jnp.minimum(hi, (c + 1) * per_split)
    tiles_per_page = page_size // block_k

    def step(j, carry):  # carry: [rows, D], [rows], [rows] (float32)
        base = multiple_of(j * block_k, block_k)
        cols = base + jnp.arange(block_k)  # [block_k] position
        # Only keys some query sees are read: the rest of the page (an unwritten tail, the
        # positions below every window) may be garbage, even NaN, which 0 * v would spread.
        kv_ok = (cols >= key_lo) & (cols <= key_hi)
        # (lax.div / rem: j >= 0, and jnp's floor-division sign fixes do not lower in Triton)
        page = bt_ref[lax.div(j, tiles_per_page)]
        off = multiple_of(lax.rem(j, tiles_per_page) * block_k, block_k)
        # (a float fill: Triton casts no integer to fp8)
        k = plgpu.load(k_ref.at[page, pl.ds(off, block_k), :], mask=kv_ok[:, None], other=0.0)
        v = plgpu.load(v_ref.at[page, pl.ds(off, block_k), :], mask=kv_ok[:, None], other=0.0)
        scales = None
        if quantized:
            scales = tuple(plgpu.load(r.at[page, pl.ds(off, block_k)], mask=kv_ok, other=0
                                      ).astype(jnp.float32) for r in (ks_ref, vs_ref))
        return online_softmax_tile(q, k, v, scales, kv_ok, cols, pos_rows, carry,
                                   qk_scale=qk_scale, window=window, softcap=softcap)

    carry = (jnp.zeros((rows, d), jnp.float32),
             jnp.full((rows,), MASK_VALUE, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    acc, m, l = lax.fori_loop(lo, hi, step, carry)
    if split_keys is not None:  # (padding queries' garbage is selected out by the merge)
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l
        return
    # padding queries (pos -1) saw no key: zeros, not their garbage
    out = jnp.where((pos_rows >= 0)[:, None], acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
    out_ok = (pl.program_id(2) * bq + jnp.arange(bq) < t)[:, None] & (
        jnp.arange(gp) < groups)[None, :]
    plgpu.store(o_ref, out.reshape(bq, gp, d).astype(o_ref.dtype), mask=out_ok[:, :, None])


# ---------------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------------

OP = "paged_chunk_attention"


def default_block_sizes(head_dim: int, itemsize: int = 2, page_size: int = 64
                        ) -> PagedBlockSizes:
    """block_q counts rows (queries x Gp heads). Chosen from D, the dtype and the page size
    only, never from T or B (batch invariance: see the module docstring). 64 rows: a G=4 group
    fits 16 queries, so T=9 verification wastes under half the rows while a 512-query chunk
    still gets enough programs; block_k divides the page."""
    if itemsize >= 4:
        rows, bk, warps, stages = 32, 32, 4, 2
    elif head_dim <= 128:
        rows, bk, warps, stages = 64, 64, 4, 3
    else:
        rows, bk, warps, stages = 64, 32, 4, 2
    return PagedBlockSizes(block_q=rows, block_k=min(bk, page_size & -page_size),
                           num_warps=warps, num_stages=stages)


def _validate(q, k_pages, v_pages, block_tables, positions, sliding_window, k_scale, v_scale):
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"{OP}: sliding_window must be >= 1, got {sliding_window}")
    check_array(OP, "q", q, 4)
    b, t, hq, d = q.shape
    int32 = (jnp.dtype(jnp.int32),)
    check_array(OP, "positions", positions, 2, dtypes=int32)
    if tuple(positions.shape) != (b, t):
        raise ValueError(f"{OP}: positions must be [B, T] = {(b, t)}, got "
                         f"{tuple(positions.shape)}")
    check_array(OP, "block_tables", block_tables, 2, dtypes=int32)
    if block_tables.shape[0] != b:
        raise ValueError(f"{OP}: block_tables must be [B, max_pages] with B = {b}, got "
                         f"{tuple(block_tables.shape)}")
    quantized = k_scale is not None or v_scale is not None
    dtypes = CODE_DTYPES if quantized else FLOAT_DTYPES
    check_array(OP, "k_pages", k_pages, 4, dtypes)
    check_array(OP, "v_pages", v_pages, 4, dtypes)
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"{OP}: k_pages {tuple(k_pages.shape)} and v_pages "
                         f"{tuple(v_pages.shape)} must have one shape")
    _, page_size, hkv, dk = k_pages.shape
    if dk != d or hkv == 0 or hq % hkv:
        raise ValueError(f"{OP}: q {tuple(q.shape)} ([B, T, Hq, D]) does not match the pages "
                         f"{tuple(k_pages.shape)} ([P, page_size, Hkv, D], Hq a multiple of "
                         f"Hkv)")
    if quantized:
        if k_scale is None or v_scale is None:
            raise ValueError(f"{OP}: give both k_scale and v_scale (a quantized cache) or "
                             f"neither")
        if k_pages.dtype != v_pages.dtype:
            raise ValueError(f"{OP}: k_pages {k_pages.dtype} and v_pages {v_pages.dtype} "
                             f"codes must share one dtype")
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not hasattr(s, "shape") or tuple(s.shape) != tuple(k_pages.shape[:3]):
                raise ValueError(f"{OP}: {name} must be [P, page_size, Hkv] = "
                                 f"{tuple(k_pages.shape[:3])}, got "
                                 f"{tuple(getattr(s, 'shape', ()))}")
            if jnp.dtype(s.dtype) not in SCALE_DTYPES:
                raise ValueError(f"{OP}: {name} has dtype {s.dtype}, expected float32 or "
                                 f"float16")
        if k_scale.dtype != v_scale.dtype:
            raise ValueError(f"{OP}: k_scale and v_scale must share one dtype")
    else:
        check_same_dtype(OP, q=q, k_pages=k_pages, v_pages=v_pages)
    span = block_tables.shape[1] * page_size
    if not is_tracer(block_tables):  # an entry past the pool would read out of bounds
        bt = jax.device_get(block_tables)
        if bt.size and (bt.min() < 0 or bt.max() >= k_pages.shape[0]):
            raise ValueError(f"{OP}: block_tables entries must lie in [0, {k_pages.shape[0]}) "
                             f"(the pool's pages), got min {bt.min()} max {bt.max()}")
    if not is_tracer(positions):  # under jit the caller owns this check
        pos = jax.device_get(positions)
        if pos.size and (pos.max() >= span or pos.min() < -1):
            raise ValueError(f"{OP}: positions must lie in [0, {span}) (the block table spans "
                             f"{span} positions) or be -1 (padding), got min {pos.min()} max "
                             f"{pos.max()}")


def paged_chunk_attention(q, k_pages, v_pages, block_tables, positions, *, k_scale=None,
                          v_scale=None, sm_scale: float | None = None,
                          sliding_window: int | None = None, softcap: float | None = None,
                          block_sizes: PagedBlockSizes | None = None, interpret: bool = False):
    """q [B, T, Hq, D] at positions [B, T] (int32; -1: a padding query) attends to the paged
    cache k/v_pages [P, page_size, Hkv, D] through block_tables [B, max_pages] (int32): the
    positions at or before its own (HF's sliding window: > position - w).

    k_scale, v_scale [P, page_size, Hkv] (float32 / float16): the pages hold int8 or fp8
    codes, dequantized in registers. softcap: scores = softcap * tanh(scores / softcap)
    before the mask (Gemma 2), or None. block_sizes: block_q counts rows (queries x the
    group's heads padded to a power of two), block_k divides page_size; split_keys for few
    programs (one row's verification). Returns [B, T, Hq, D]
    in q's dtype; padding queries get zeros.
    """
    _validate(q, k_pages, v_pages, block_tables, positions, sliding_window, k_scale, v_scale)
    softcap = check_softcap(OP, softcap)
    d = q.shape[-1]
    check_head_dim(OP, d)
    page_size = k_pages.shape[1]
    if page_size % 16:
        raise ValueError(f"{OP}: page_size {page_size} is not a multiple of 16 (a key tile "
                         f"of >= 16 keys must not straddle pages)")
    blocks = block_sizes or default_block_sizes(d, jnp.dtype(q.dtype).itemsize, page_size)
    if page_size % blocks.block_k:
        raise ValueError(f"{OP}: block_k {blocks.block_k} must divide page_size {page_size} "
                         f"(a key tile must not straddle pages)")
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    window = int(sliding_window) if sliding_window is not None else None
    return _paged_chunk_attention_triton(q, k_pages, v_pages, block_tables, positions, k_scale,
                                         v_scale, sm_scale=sm_scale, blocks=blocks,
                                         window=window, softcap=softcap, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "blocks", "window", "softcap",
                                             "interpret"))
def _paged_chunk_attention_triton(q, k_pages, v_pages, block_tables, positions, k_scale,
                                  v_scale, *, sm_scale, blocks, window, softcap, interpret):
    b, t, hq, d = q.shape
    n_pages, page_size, hkv, _ = k_pages.shape
    g = hq // hkv
    gp = next_pow2(g)
    bq = max(1, blocks.block_q // gp)  # queries per program
    nq = pl.cdiv(t, bq)
    split = blocks.split_keys
    quantized = k_scale is not None
    kernel = functools.partial(
        paged_chunk_attention_kernel, sm_scale=sm_scale, t=t, groups=g, page_size=page_size,
        block_k=blocks.block_k, window=window, quantized=quantized, softcap=softcap,
        split_keys=split)
    qg = q.reshape(b, t, hkv, g, d)  # a bitcast
    q_spec = pl.BlockSpec((None, bq, None, gp, d), lambda i, h, j, *_: (i, j, h, 0, 0))
    pool = pl.BlockSpec((n_pages, page_size, None, d), lambda i, h, j, *_: (0, 0, h, 0))
    in_specs = [pl.BlockSpec((None, bq), lambda i, h, j, *_: (i, j)),
                pl.BlockSpec((None, block_tables.shape[1]), lambda i, h, j, *_: (i, 0)),
                q_spec, pool, pool]
    args = [positions, block_tables, qg, k_pages, v_pages]
    if quantized:  # the KV head's scales [P, page_size], strided by Hkv
        in_specs += [pl.BlockSpec((n_pages, page_size, None),
                                  lambda i, h, j, *_: (0, 0, h))] * 2
        args += [k_scale, v_scale]
    name = "paged_chunk_attention_quantized" if quantized else "paged_chunk_attention"
    params = plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    if split is None:
        out = pl.pallas_call(
            kernel, grid=(b, hkv, nq), in_specs=in_specs, out_specs=q_spec,
            out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype), compiler_params=params,
            interpret=interpret, name=name)(*args)
        return out.reshape(b, t, hq, d)
    rows = bq * gp
    splits = pl.cdiv(block_tables.shape[1] * page_size, split)
    acc, m, l = pl.pallas_call(
        kernel, grid=(b, hkv, nq, splits), in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, None, rows, d),
                                lambda i, h, j, c: (i, h, j, c, 0, 0))] + [
            pl.BlockSpec((None, None, None, None, rows), lambda i, h, j, c: (i, h, j, c, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((b, hkv, nq, splits, rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, nq, splits, rows), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, nq, splits, rows), jnp.float32)],
        compiler_params=params, interpret=interpret, name=name + "_split")(*args)
    o = _merge_ordered(acc, m, l)  # [B, Hkv, nq, rows, D]
    o = o.reshape(b, hkv, nq * bq, gp, d)[:, :, :t, :g]  # [B, Hkv, T, G, D]
    return o.transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d).astype(q.dtype)


def _merge_ordered(acc, m, l):
    """acc [..., splits, rows, D], m, l [..., splits, rows] (log2 domain) -> [..., rows, D]
    float32, the chunks summed in position order (a scan: XLA's reductions may tile a sum by
    shape). A chunk the query saw no key of (m = MASK_VALUE, garbage l and acc, or none) adds
    +0 by a select, whatever its garbage; no key at all (padding) gives zeros."""
    m_all = jnp.max(m, axis=-2)  # [..., rows] (a max is exact in any order)
    def add(carry, part):
        o, l_all = carry
        acc_c, m_c, l_c = part
        seen = m_c > MASK_VALUE
        w = jnp.exp2(m_c - m_all)
        l_all = l_all + jnp.where(seen, w * l_c, 0.0)
        o = o + jnp.where(seen[..., None], w[..., None] * acc_c, 0.0)
        return (o, l_all), None

    parts = (jnp.moveaxis(acc, -3, 0), jnp.moveaxis(m, -2, 0), jnp.moveaxis(l, -2, 0))
    zero = jnp.zeros(acc.shape[:-3] + acc.shape[-2:], jnp.float32)
    (o, l_all), _ = lax.scan(add, (zero, zero[..., 0]), parts)
    return o / jnp.where(l_all > 0, l_all, 1.0)[..., None]


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def gather_pages(pages, block_tables):
    """pages [P, page_size, ...] -> each row's contiguous view [B, max_pages * page_size, ...]."""
    g = pages[block_tables]  # [B, max_pages, page_size, ...]
    return g.reshape(g.shape[0], g.shape[1] * g.shape[2], *g.shape[3:])


def paged_chunk_attention_reference(q, k_pages, v_pages, block_tables, positions, *,
                                    k_scale=None, v_scale=None, sm_scale: float | None = None,
                                    sliding_window: int | None = None,
                                    softcap: float | None = None,
                                    block_sizes: PagedBlockSizes | None = None,
                                    interpret: bool = False):
    """Plain jnp with the same signature (block_sizes and interpret are ignored): the pages
    gathered to a contiguous view, masked attention with a float32 softmax; a quantized cache
    is dequantized to float32 first. Padding queries get zeros."""
    del block_sizes, interpret
    _validate(q, k_pages, v_pages, block_tables, positions, sliding_window, k_scale, v_scale)
    softcap = check_softcap(OP, softcap)
    b, t, hq, d = q.shape
    hkv = k_pages.shape[2]
    k, v = gather_pages(k_pages, block_tables), gather_pages(v_pages, block_tables)
    if k_scale is not None:
        k = dequantize_kv(k, gather_pages(k_scale, block_tables))
        v = dequantize_kv(v, gather_pages(v_scale, block_tables))
        precision = ref_precision(jnp.float32)
    else:
        precision = ref_precision(q.dtype)
    s = k.shape[1]
    slots = jnp.arange(s)[None, None, :]  # [1, 1, S]
    visible = (slots <= positions[:, :, None]) & (positions[:, :, None] >= 0)  # [B, T, S]
    if sliding_window is not None:
        visible &= slots > positions[:, :, None] - sliding_window
    # keys no query of the row sees (the null page, unwritten tails) may be garbage: zeroed
    seen = jnp.any(visible, axis=1)[:, :, None, None]  # [B, S, 1, 1]
    k, v = (jnp.where(seen, x, jnp.zeros((), x.dtype)) for x in (k, v))
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    qg = q.reshape(b, t, hkv, hq // hkv, d)  # [B, T, Hkv, G, D]
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32,
                        precision=precision) * scale  # [B, Hkv, G, T, S]
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v,
                   preferred_element_type=jnp.float32, precision=precision)
    return o.reshape(b, t, hq, d).astype(q.dtype)
