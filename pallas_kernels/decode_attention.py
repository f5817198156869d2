"""Decode attention: one query token per sequence against a KV cache with per-sequence lengths.

Split-K (FlashDecoding): the cache's sequence axis is cut into `num_splits` chunks; one program
handles one (sequence, KV head, chunk) and all the query heads of that KV group at once (GQA:
the group's K/V tile is read once for G query heads). Each program walks only the valid
positions of its chunk (< lengths[b]) and writes an unnormalised partial output with its
running max and sum; a second step merges the chunks (a few KB per sequence, fused by XLA).

A quantized cache (int8 / fp8 codes with per-(token, head) scales, kv_quant.py) is read as
codes: each K/V tile is converted to the query's dtype in registers (exactly), the scores are
scaled per key by k_scale (q . (s_k k) = s_k (q . k)) and the probabilities per key by v_scale
before the PV product, so no dequantized copy of the cache is ever made.
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

from pallas_kernels._common import (
    FLOAT_DTYPES, LOG2_E, MASK_VALUE, NUM_SMS_H200, check_array, check_head_dim,
    check_same_dtype, check_softcap, check_tiles, dot_f32, multiple_of, next_pow2, softcap_log2)
from pallas_kernels._jax_private import is_tracer
from pallas_kernels.kv_quant import (CODE_DTYPES, check_quantized_cache, codes_as,
                                     reference_operands)


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
    """block_k: keys per tile (power of two >= 16); num_splits: chunks of the sequence axis
    (None: `choose_num_splits`); split_keys: chunks of exactly this many keys instead (a
    multiple of block_k), whatever the batch and the cache length, always merged in chunk
    order: a row's result then depends on its own keys only (batch-invariant). Default
    stages: benchmarks/DECISIONS.md."""
    block_k: int = 64
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 4
    split_keys: int | None = None

    def __post_init__(self):
        check_tiles(self, "block_k")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"DecodeBlockSizes.num_splits={self.num_splits}: must be >= 1")
        if self.split_keys is not None:
            if self.num_splits is not None:
                raise ValueError("DecodeBlockSizes: give num_splits or split_keys, not both")
            if self.split_keys < self.block_k or self.split_keys % self.block_k:
                raise ValueError(f"DecodeBlockSizes.split_keys={self.split_keys}: must be a "
                                 f"multiple of block_k={self.block_k}")

    def chunking(self, batch: int, kv_heads: int, seq_len: int) -> tuple[int, int]:
        """(keys per chunk, chunks) for a cache of seq_len slots: split_keys, or
        num_splits (default `choose_num_splits`) chunks of whole tiles."""
        if self.split_keys is not None:
            return self.split_keys, pl.cdiv(seq_len, self.split_keys)
        splits = self.num_splits or choose_num_splits(batch, kv_heads, seq_len, self.block_k)
        chunk = pl.cdiv(pl.cdiv(seq_len, splits), self.block_k) * self.block_k
        return chunk, pl.cdiv(seq_len, chunk)


def default_block_sizes(head_dim: int) -> DecodeBlockSizes:
    """The decode kernels' defaults by head dim: at D 256 a 64-key K and V tile is 64 KB in
    16 bits, so 4 stages would need 256 KB of the 227 KB of shared memory a block may use; 2
    fit (and 8 warps spread the [Gp, 256] accumulator's registers)."""
    if head_dim > 128:
        return DecodeBlockSizes(block_k=64, num_warps=8, num_stages=2)
    return DecodeBlockSizes()


def choose_num_splits(batch: int, kv_heads: int, seq_len: int, block_k: int,
                      chunk: int = 1024, min_chunk: int = 256, unsplit_max: int = 512) -> int:
    """Chunks of about `chunk` keys, but at least one program per SM and at most ~4 per SM,
    each chunk >= min_chunk keys. A cache of <= unsplit_max slots is not split: a program
    reads at most that many keys and no merge runs (the append kernel then writes the output
    itself). Measurements: benchmarks/DECISIONS.md ("Decode attention")."""
    if seq_len <= unsplit_max:
        return 1
    rows = batch * kv_heads
    want = max(-(-seq_len // chunk), -(-NUM_SMS_H200 // rows))
    want = min(want, max(1, -(-4 * NUM_SMS_H200 // rows)))
    most = max(1, -(-seq_len // max(min_chunk, block_k)))
    return max(1, min(want, most))


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


def attend_tiles(q_parts, k_ref, v_ref, *, start, first, end, block_k: int, qk_scale: float,
                 carry, scales=None, softcap: float | None = None, pages=None, limits=None):
    """Online softmax (base 2) of a query over cache rows [first, end) of k_ref/v_ref [S, D],
    read in tiles of block_k rows from `start` (tile-aligned, <= first; first=None: from start);
    rows outside the range are masked, never used. The query comes in column pieces
    q_parts = ((q_i [Gp, w_i], col_i), ...) covering D (one piece [Gp, D] at 0, or RoPE's two
    halves): scores = sum_i q_i @ k[:, col_i:col_i + w_i]^T. carry = (acc [Gp, D], m [Gp],
    l [Gp]) float32; returns the same. scales: (ks_ref, vs_ref) [S] of a quantized cache whose
    codes k_ref/v_ref hold (see the module docstring), or None. softcap: scores soft-capped
    (softcap * tanh(. / softcap)) before the mask, or None. pages: (bt_ref [max_pages] int32,
    page_size) for a paged cache (paged_attention.py): k_ref/v_ref are then the page pools
    [P, page_size, D] (scales [P, page_size]) and cache position p lives at page
    bt_ref[p // page_size], row p % page_size; None: k_ref/v_ref [S, D] hold position p at row p.
    limits: (pos [Gp], window) when the query rows sit at their own positions (several tokens
    of a row, verify_attention.py): row i sees cache rows <= pos[i] (with a window also
    > pos[i] - window), on top of [first, end); None: every row sees [first, end)."""
    d = k_ref.shape[-1]
    cols = [col for _, col in q_parts]
    # A masked load's fill is cast to the ref's dtype: Triton casts no integer to fp8.
    fill = 0 if scales is None else 0.0

    def tile_index(base, rows, valid):
        """at(col, w): the tile's index into k_ref/v_ref, columns [col, col + w); at(): into
        the scales."""
        if pages is None:
            lead = (pl.ds(base, block_k),)
        elif pages[1] >= block_k:  # the tile lies in one page (both are powers of two)
            bt_ref, page_size = pages
            lead = (bt_ref[base // page_size], pl.ds(base % page_size, block_k))
        else:
            # block_k / page_size pages: one page index per key (a gather; masked keys read
            # the table's entry 0 and are themselves never loaded)
            bt_ref, page_size = pages
            page = plgpu.load(bt_ref.at[rows // page_size], mask=valid, other=0)  # [block_k]
            row = rows % page_size  # [block_k]
            # Every index an array (interpret mode loads no mix of arrays and slices).
            return lambda col=None, w=None: (page, row) if col is None else (
                page[:, None], row[:, None], col + jnp.arange(w)[None, :])
        return lambda col=None, w=None: lead if col is None else (*lead, pl.ds(col, w))

    def tile(qs, j, carry):
        acc, m, l = carry
        base = multiple_of(start + j * block_k, block_k)
        rows = base + jnp.arange(block_k)  # [block_k] cache position
        valid = rows < end
        if first is not None:
            valid &= rows >= first
        at = tile_index(base, rows, valid)
        s = None
        for q, col in zip(qs, cols):
            w = q.shape[-1]
            kk = plgpu.load(k_ref.at[at(col, w)],
                            mask=valid[:, None], other=fill)  # [block_k, w]
            if scales is not None:
                kk = codes_as(kk, q.dtype)
            part = dot_f32(q, kk, trans_b=True)  # [Gp, block_k]
            s = part if s is None else s + part
        v = plgpu.load(v_ref.at[at(0, d)],
                       mask=valid[:, None], other=fill)
        if scales is not None:
            ks_ref, vs_ref = scales
            k_s, v_s = (plgpu.load(r.at[at()], mask=valid, other=0
                                   ).astype(jnp.float32) for r in (ks_ref, vs_ref))  # [block_k]
            s = s * k_s[None, :]
        keep = valid[None, :]  # [1 or Gp, block_k]
        if limits is not None:
            pos, win = limits
            keep = keep & (rows[None, :] <= pos[:, None])
            if win is not None:
                keep &= rows[None, :] > pos[:, None] - win
        s = jnp.where(keep, softcap_log2(s * qk_scale, softcap), MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=-1)
        if scales is not None:
            dtype = qs[0].dtype
            acc = acc * alpha[:, None] + dot_f32((p * v_s[None, :]).astype(dtype),
                                                 codes_as(v, dtype))
        else:
            acc = acc * alpha[:, None] + dot_f32(p.astype(v.dtype), v)
        return acc, m_new, l

    n_blocks = pl.cdiv(jnp.maximum(end - start, 0), block_k)
    qs = tuple(q for q, _ in q_parts)
    return lax.fori_loop(0, n_blocks, lambda j, c: tile(qs, j, c), carry)


def decode_attention_kernel(len_ref, *refs, sm_scale: float, chunk: int, block_k: int,
                            window: int | None, groups: int, quantized: bool,
                            softcap: float | None = None, page_size: int | None = None):
    # len_ref [B] int32 (whole array; this program reads lengths[b])
    # bt_ref [max_pages] int32 (page_size given: a paged cache): this row's block table
    # q_ref [Gp, D]: a block over the G query heads of one KV group (Gp >= 16 for the tensor
    #   cores); rows >= G lie past the array and are masked to zero on load, so no padded
    #   copy of q is made
    # k_ref, v_ref [S_pad, D]: one KV head's cache row (rows >= lengths[b], and with a window
    # rows < lengths[b] - window, are never read); codes when quantized. Paged: one KV head's
    # page pools [P, page_size, D], position p at (bt_ref[p // page_size], p % page_size)
    # ks_ref, vs_ref [S_pad] (quantized): that row's scales, read where the codes are (paged:
    #   [P, page_size])
    # acc_ref [Gp, D], m_ref [Gp], l_ref [Gp] (float32): this chunk's partials, G rows stored
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
    b = pl.program_id(0)
    split = pl.program_id(2)
    length = len_ref[b]
    start = split * chunk
    end = jnp.minimum(start + chunk, length)
    first = None  # first position this program attends to, when not its first tile's start
    if window is not None:
        # The query sits at position length - 1 and sees keys > length - 1 - window; skip the
        # chunk's whole tiles below that (start stays tile-aligned, the rest is masked).
        first = jnp.maximum(start, length - window)
        start = jnp.maximum(start, (first // block_k) * block_k)
    gp, d = q_ref.shape
    row_ok = jnp.arange(gp) < groups  # [Gp]
    q = plgpu.load(q_ref, mask=row_ok[:, None], other=0)  # [Gp, D]
    acc, m, l = attend_tiles(
        ((q, 0),), k_ref, v_ref, start=start, first=first, end=end, block_k=block_k,
        qk_scale=sm_scale * LOG2_E, scales=scales, softcap=softcap, pages=pages,
        carry=(jnp.zeros((gp, d), jnp.float32), jnp.full((gp,), MASK_VALUE, jnp.float32),
               jnp.zeros((gp,), jnp.float32)))
    plgpu.store(acc_ref, acc, mask=row_ok[:, None])
    plgpu.store(m_ref, m, mask=row_ok)
    plgpu.store(l_ref, l, mask=row_ok)


# ---------------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------------


def check_cache_pair(op: str, k_cache, v_cache, batch: int, batch_of: str, rows_name: str,
                     rows, quantized: bool = False) -> tuple[int, int, int, int]:
    """Checks shared by the decode kernels: k/v caches [B, S, Hkv, D] of one shape (float, or
    int8 / fp8 codes when `quantized`), and the [B] int32 `rows` (lengths or positions), whose
    B agrees with `batch` (of the input named `batch_of`). Returns the caches' (B, S, Hkv, D).
    Dtypes are the caller's to compare."""
    dtypes = CODE_DTYPES if quantized else FLOAT_DTYPES
    check_array(op, "k_cache", k_cache, 4, dtypes)
    check_array(op, "v_cache", v_cache, 4, dtypes)
    check_array(op, rows_name, rows, 1, dtypes=(jnp.dtype(jnp.int32),))
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{op}: k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} must have one shape")
    if k_cache.shape[0] != batch or rows.shape[0] != batch:
        raise ValueError(f"{op}: batch sizes differ: {batch_of} {batch}, caches "
                         f"{k_cache.shape[0]}, {rows_name} {rows.shape[0]}")
    return tuple(k_cache.shape)


def check_decode_inputs(op: str, q, k_cache, v_cache, rows_name: str, rows, sliding_window,
                        k_scale=None, v_scale=None) -> tuple[int, int, int, int]:
    """decode_attention's checks: ranks, one dtype (or codes with their scales), cache/batch/
    head-dim/GQA agreement, the window. Returns (B, S, Hkv, D)."""
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"{op}: sliding_window must be >= 1, got {sliding_window}")
    check_array(op, "q", q, 3)
    b, hq, d = q.shape
    quantized = k_scale is not None or v_scale is not None
    _, s, hkv, dk = check_cache_pair(op, k_cache, v_cache, b, "q", rows_name, rows, quantized)
    if quantized:
        check_quantized_cache(op, k_cache, v_cache, k_scale, v_scale)
    else:
        check_same_dtype(op, q=q, k_cache=k_cache, v_cache=v_cache)
    if dk != d:
        raise ValueError(f"{op}: head dim of q ({d}) and the caches ({dk}) differ")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{op}: query heads ({hq}) must be a multiple of KV heads ({hkv})")
    return b, s, hkv, d


def _validate(q, k_cache, v_cache, lengths, sliding_window=None, k_scale=None, v_scale=None):
    op = "decode_attention"
    _, s, _, _ = check_decode_inputs(op, q, k_cache, v_cache, "lengths", lengths, sliding_window,
                                     k_scale, v_scale)
    # Concrete lengths (not traced) can be checked here; under jit the caller owns this check.
    if not is_tracer(lengths):
        lens = jax.device_get(lengths)
        if lens.size and (lens.max() > s or lens.min() < 0):
            raise ValueError(f"{op}: lengths must lie in [0, {s}] (the cache holds {s} "
                             f"positions), got min {lens.min()} max {lens.max()}")


def decode_attention(q, k_cache, v_cache, lengths, *, k_scale=None, v_scale=None,
                     sm_scale: float | None = None, interpret: bool = False,
                     block_sizes: DecodeBlockSizes | None = None,
                     sliding_window: int | None = None, softcap: float | None = None):
    """q [B, Hq, D] attends to cache positions [0, lengths[b]) of k/v_cache [B, S, Hkv, D].

    The query is the token at position lengths[b] - 1 (its own K/V already written). With
    `sliding_window=w` it sees positions > lengths[b] - 1 - w only (HF semantics), and only those
    are read. k_scale, v_scale [B, S, Hkv] (float32 / float16): the caches hold int8 or fp8
    codes of a quantized cache (kv_quant.py), dequantized in registers. Returns [B, Hq, D] in
    q's dtype; a sequence of length 0 gets zeros. softcap: scores = softcap * tanh(scores /
    softcap) before the mask (Gemma 2), or None.
    """
    _validate(q, k_cache, v_cache, lengths, sliding_window, k_scale, v_scale)
    softcap = check_softcap("decode_attention", softcap)
    d = q.shape[-1]
    check_head_dim("decode_attention", d)
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    blocks = block_sizes or default_block_sizes(d)
    b, s, hkv, _ = k_cache.shape
    chunk, num_splits = blocks.chunking(b, hkv, s)
    window = int(sliding_window) if sliding_window is not None else None
    return _decode_attention_triton(q, k_cache, v_cache, lengths, k_scale, v_scale,
                                    sm_scale=sm_scale, blocks=blocks, chunk=chunk,
                                    num_splits=num_splits, window=window, softcap=softcap,
                                    interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "blocks", "chunk", "num_splits",
                                             "window", "softcap", "interpret"))
def _decode_attention_triton(q, k_cache, v_cache, lengths, k_scale, v_scale, block_tables=None,
                             *, sm_scale, blocks, chunk, num_splits, window, softcap, interpret):
    # block_tables [B, max_pages] int32: k/v_cache are page pools [P, page_size, Hkv, D]
    # (paged_attention.py), else caches [B, S, Hkv, D]
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    gp = max(16, next_pow2(g))  # tl.dot needs >= 16 rows; the block covers them, loads mask
    block_k = blocks.block_k
    s_pad = num_splits * chunk  # cache blocks rounded up to whole chunks (rows >= s are masked)
    qg = q.reshape(b, hkv, g, d)  # [B, Hkv, G, D]; a bitcast, no copy

    quantized = k_scale is not None
    paged = block_tables is not None
    page_size = k_cache.shape[1] if paged else None
    kernel = functools.partial(decode_attention_kernel, sm_scale=sm_scale, chunk=chunk,
                               block_k=block_k, window=window, groups=g, quantized=quantized,
                               softcap=softcap, page_size=page_size)
    if paged:  # the row's block table; one KV head's whole page pools, strided by Hkv
        pool = k_cache.shape[0]
        table = [pl.BlockSpec((None, block_tables.shape[1]), lambda i, h, c: (i, 0))]
        cache = pl.BlockSpec((pool, page_size, None, d), lambda i, h, c: (0, 0, h, 0))
        scale = pl.BlockSpec((pool, page_size, None), lambda i, h, c: (0, 0, h))
    else:  # one KV head's cache row [S_pad, D] and scales [S_pad], strided by Hkv
        table = []
        cache = pl.BlockSpec((None, s_pad, None, d), lambda i, h, c: (i, 0, h, 0))
        scale = pl.BlockSpec((None, s_pad, None), lambda i, h, c: (i, 0, h))
    in_specs = [pl.BlockSpec((b,), lambda i, h, c: (0,)), *table,
                pl.BlockSpec((None, None, gp, d), lambda i, h, c: (i, h, 0, 0)), cache, cache]
    args = [lengths, *([block_tables] if paged else []), qg, k_cache, v_cache]
    if quantized:
        in_specs += [scale, scale]
        args += [k_scale, v_scale]
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(b, hkv, num_splits),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, gp, d), lambda i, h, c: (i, h, c, 0, 0)),
                   pl.BlockSpec((None, None, None, gp), lambda i, h, c: (i, h, c, 0)),
                   pl.BlockSpec((None, None, None, gp), lambda i, h, c: (i, h, c, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, num_splits, g, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, num_splits, g), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, num_splits, g), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret,
        name=("paged_" if paged else "") + (
            "decode_attention_quantized" if quantized else "decode_attention"),
    )(*args)
    merged = _merge_splits(acc, m, l, ordered=blocks.split_keys is not None)
    return merged.reshape(b, hq, d).astype(q.dtype)


def _merge_splits(acc, m, l, *, ordered: bool = False):
    """Second step: merge the chunks' partial softmaxes (log2 domain) -> [B, Hkv, G, D] f32.
    acc [B, Hkv, splits, G, D], m, l [B, Hkv, splits, G]. ordered: the sums run chunk by
    chunk in order (XLA's reductions may tile them by shape), so chunks past a row's keys
    (weight 0) change none of its bits."""
    if not ordered:
        m_all = jnp.max(m, axis=2, keepdims=True)  # [B, Hkv, 1, G]
        w = jnp.exp2(m - m_all)  # [B, Hkv, splits, G]; empty chunks have m = MASK_VALUE -> 0
        l_all = jnp.sum(w * l, axis=2)  # [B, Hkv, G]
        o = jnp.sum(w[..., None] * acc, axis=2)  # [B, Hkv, G, D]
    else:
        splits = m.shape[2]
        m_all = m[:, :, 0]
        for c in range(1, splits):
            m_all = jnp.maximum(m_all, m[:, :, c])
        l_all, o = None, None
        for c in range(splits):
            w = jnp.exp2(m[:, :, c] - m_all)  # [B, Hkv, G]
            lc, oc = w * l[:, :, c], w[..., None] * acc[:, :, c]
            l_all = lc if l_all is None else l_all + lc
            o = oc if o is None else o + oc
    return o / jnp.where(l_all > 0, l_all, 1.0)[..., None]  # length 0 -> zeros


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def decode_attention_reference(q, k_cache, v_cache, lengths, *, k_scale=None, v_scale=None,
                               sm_scale: float | None = None, interpret: bool = False,
                               sliding_window: int | None = None, softcap: float | None = None):
    """Plain-jnp decode attention with the same signature (interpret is ignored); a quantized
    cache is dequantized to float32 first."""
    del interpret
    _validate(q, k_cache, v_cache, lengths, sliding_window, k_scale, v_scale)
    softcap = check_softcap("decode_attention", softcap)
    b, hq, d = q.shape
    _, s, hkv, _ = k_cache.shape
    k_cache, v_cache, precision = reference_operands(k_cache, v_cache, k_scale, v_scale,
                                                     q.dtype)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    qg = q.reshape(b, hkv, hq // hkv, d)  # [B, Hkv, G, D]
    scores = jnp.einsum("bkgd,bskd->bkgs", qg, k_cache, preferred_element_type=jnp.float32,
                        precision=precision) * scale  # [B, Hkv, G, S]
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    valid = jnp.arange(s)[None, :] < lengths[:, None]  # [B, S]
    if sliding_window is not None:
        valid &= jnp.arange(s)[None, :] >= lengths[:, None] - sliding_window
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    o = jnp.einsum("bkgs,bskd->bkgd", p.astype(v_cache.dtype), v_cache,
                   preferred_element_type=jnp.float32, precision=precision)
    return o.reshape(b, hq, d).astype(q.dtype)
