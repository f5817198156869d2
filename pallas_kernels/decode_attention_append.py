"""Decode attention that also applies RoPE and appends the new token's K/V, in one pallas_call.

Input is the decoder's fused q/k/v projection, qkv [B, Hkv, G + 2, D]: per KV head its G query
heads, then its key, then its value (the layout of checkpoints/layout.py). Without this kernel
a decode step slices q, k and v out of it, rotates q and k (XLA concatenate fusions), writes K
and V with two dynamic-update-slice fusions and pads q to 16 rows: ~6 small kernels per layer,
each a few microseconds at batch 1. Here one kernel does all of it:

- qkv is passed three times with three BlockSpecs (the group's query rows, row G, row G + 1),
  so q, k_new and v_new are read straight from the projection's output.
- RoPE (optional; HF rotate-half with cos/sin [B, D] whose halves are equal) is applied in
  float32 to the query halves and to k_new; the query stays split in its two halves and the
  scores are q_lo . k_lo + q_hi . k_hi against the cache's two column halves.
- The caches are outputs aliased to the cache inputs (`input_output_aliases`), so inside a jit
  that donates them they are updated in place: of the programs of one (sequence, KV head), only
  the one whose chunk holds slot `positions[b]` writes the new row (the rotated key, the value).
- No program reads slot `positions[b]` from the cache: the owner starts its running softmax from
  the new token, and every program walks only the cache slots < positions[b] of its chunk.
  Reads and the one write never touch the same address, so the programs need no ordering.
- Split-K over the sequence and the XLA merge of the chunks are those of decode_attention.py;
  a short cache is one chunk per row, and the kernel then normalizes and writes the output
  itself (no merge).
- qkv may also come as the projection's float32 split-K chunks [S, B, Hkv, G + 2, D]: each
  BlockSpec above is then passed once per chunk and the kernel sums them (one rounding to the
  cache dtype), so the matmul's partial sums need no kernel of their own.
- A quantized cache (int8 / fp8 codes, per-(token, head) scales: kv_quant.py) also passes its
  scales, aliased the same way: the owner quantizes the new key and value in registers and
  writes their codes and scales (the same bits as the XLA append), the new token enters the
  softmax dequantized (as a later read sees it), and the cache tiles are read as codes
  (decode_attention.py). q, k and v are then rounded to the activations' dtype (`dtype`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (FLOAT_DTYPES, LOG2_E, MASK_VALUE, check_array,
                                     check_head_dim, check_same_dtype, check_softcap, next_pow2,
                                     softcap_log2)
from pallas_kernels._jax_private import is_tracer
from pallas_kernels.decode_attention import (
    DecodeBlockSizes, _merge_splits, attend_tiles, check_cache_pair, decode_attention_reference,
    default_block_sizes)
from pallas_kernels.kv_quant import check_quantized_cache, kv_codes, kv_scale, quantize_kv
from pallas_kernels.norm_matmul import apply_norm_partials

# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


def append_attend(q_src, k_src, v_src, k_ref, v_ref, ko_ref, vo_ref, *, gp: int,
                  d: int, pos, start, chunk: int, seq_len: int, window: int | None,
                  block_k: int, groups: int, qk_scale: float, dtype, inv_rms=None, rope=None,
                  scales=None, softcap: float | None = None, pages=None):
    """The body of the append kernels for one (sequence, KV group, chunk of `chunk` cache slots
    from `start`): gather q, k_new, v_new from the projection's parts (summed in float32, times
    the deferred norm's inv_rms if given, rounded once to `dtype`, the activations'), rotate q
    and k_new, write slot `pos` if this chunk holds it (quantized when `scales` are given), and
    run the online softmax over the cache slots < pos of the chunk, from the new token when the
    chunk holds it.

    Every ref is reached through one indexer (Pallas Triton stacks no views):
    q_src: per part (ref, prefix): ref[(*prefix, cols)] is the group's [Gp, cols] query rows
      (rows >= groups are masked, never read); k_src / v_src: per part (ref, prefix):
      ref[(*prefix, cols)] is the new key / value [cols].
    k_ref, v_ref [S_pad, D]: the caches, read at slots < pos; ko_ref, vo_ref: the same buffers
      (aliased), slot pos written.
    inv_rms: the deferred norm's scale, or None.
    rope: (cos_ref, sin_ref, prefix) with ref[(*prefix, cols)] this sequence's [cols] of the
      rotate-half tables (halves equal), or None.
    scales: a quantized cache's (ks_ref, vs_ref, kso_ref, vso_ref) [S_pad]: the scales read
      at slots < pos, and the same buffers (aliased) where slot pos's are written; or None.
    pages: (bt_ref [max_pages] int32, page_size) for a paged cache: the cache refs are page
      pools [P, page_size, D] (scales [P, page_size]), slot p at (bt_ref[p // page_size],
      p % page_size), and seq_len is max_pages * page_size; or None (see attend_tiles).
    Returns (acc [Gp, D], m [Gp], l [Gp]) float32 and the row mask [Gp] of the query heads."""
    # pos < seq_len keeps an out-of-range traced position from writing past the cache
    owns = (pos >= start) & (pos < start + chunk) & (pos < seq_len)
    row_ok = jnp.arange(gp) < groups  # [Gp]
    all_cols = pl.ds(0, d)
    h = d // 2

    def new_token():
        """(q pieces, (acc0, m0, l0)): the query gathered and rotated, the new slot written,
        the running softmax started from the new token for the chunk that holds it."""

        def gather(src, cols=all_cols, mask=None):
            """The parts' sum in float32 (times the deferred norm's inv_rms), rounded once to
            the cache dtype (as the matmul would)."""
            total = None
            for ref, prefix in src:
                idx = (*prefix, cols)
                x = ref[idx] if mask is None else plgpu.load(ref.at[idx], mask=mask, other=0)
                total = x.astype(jnp.float32) if total is None else total + x.astype(jnp.float32)
            if inv_rms is not None:
                total = total * inv_rms
            return total.astype(dtype)

        v_new = gather(v_src)  # [D]

        if rope is not None:
            # Rotate-half RoPE in float32: lo' = lo*c - hi*s, hi' = hi*c + lo*s (c, s: a half).
            cos_ref, sin_ref, prefix = rope
            lo, hi = pl.ds(0, h), pl.ds(h, h)
            c = cos_ref[(*prefix, lo)].astype(jnp.float32)[None, :]  # [1, D/2]
            s_ = sin_ref[(*prefix, lo)].astype(jnp.float32)[None, :]
            q_lo = gather(q_src, lo, row_ok[:, None]).astype(jnp.float32)  # [Gp, D/2]
            q_hi = gather(q_src, hi, row_ok[:, None]).astype(jnp.float32)
            qs = ((q_lo * c - q_hi * s_).astype(dtype),
                  (q_hi * c + q_lo * s_).astype(dtype))  # [Gp, D/2] each
            k_lo = gather(k_src, lo).astype(jnp.float32)[None, :]  # [1, D/2]
            k_hi = gather(k_src, hi).astype(jnp.float32)[None, :]
            k_parts = ((k_lo * c - k_hi * s_).astype(dtype),
                       (k_hi * c + k_lo * s_).astype(dtype))
        else:
            qs = (gather(q_src, mask=row_ok[:, None]),)  # [Gp, D]
            k_parts = (gather(k_src)[None, :],)  # [1, D]

        # What slot pos stores, and the key/value the new token attends with (as a later read
        # of the slot sees them): the rounded values, or their codes and the dequantized codes.
        k_store, v_store, k_att, v_att = k_parts, v_new, k_parts, v_new
        if scales is not None:
            f32 = jnp.float32
            code, scale_dtype = k_ref.dtype, scales[0].dtype
            # One axis per reduction: Triton's lowering reduces a [1, w] tile to [1], not to [].
            k_abs = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(kp.astype(f32)), axis=-1)
                                                   for kp in k_parts])  # [1]
            k_s = kv_scale(k_abs, code, scale_dtype)  # [1]
            v_s = kv_scale(jnp.max(jnp.abs(v_new.astype(f32)), axis=-1), code, scale_dtype)
            k_store = tuple(kv_codes(kp, k_s[:, None], code) for kp in k_parts)  # [1, w] each
            v_store = kv_codes(v_new, v_s, code)  # [D]
            k_att = tuple(c.astype(f32) * k_s.astype(f32)[:, None] for c in k_store)
            v_att = v_store.astype(f32) * v_s.astype(f32)

        @pl.when(owns)
        def _write_new_slot():
            if pages is None:
                page, row = (), pos
            else:  # clipped: only an owner (0 <= pos < seq_len) gets here on the GPU
                bt_ref, page_size = pages
                slot = jnp.clip(pos, 0, seq_len - 1)
                page, row = (bt_ref[slot // page_size],), slot % page_size
            col = 0
            for kp in k_store:
                w = kp.shape[-1]
                ko_ref[(*page, pl.ds(row, 1), pl.ds(col, w))] = kp
                col += w
            vo_ref[(*page, row, all_cols)] = v_store
            if scales is not None:
                _, _, kso_ref, vso_ref = scales
                kso_ref[(*page, pl.ds(row, 1))] = k_s
                vso_ref[(*page, pl.ds(row, 1))] = jnp.broadcast_to(v_s, (1,))

        # The owner's running softmax starts from the new token (its rotated key as stored,
        # so the score matches a later read from the cache); the others start empty.
        s_new = sum(jnp.sum(qp.astype(jnp.float32) * kp.astype(jnp.float32), axis=-1)
                    for qp, kp in zip(qs, k_att))  # [Gp]
        w0 = owns.astype(jnp.float32)  # 1 for the owner, 0 for the others
        m0 = jnp.where(owns, softcap_log2(s_new * qk_scale, softcap), MASK_VALUE)  # [Gp]
        l0 = jnp.broadcast_to(w0, (gp,))  # [Gp]
        acc0 = jnp.broadcast_to(w0 * v_att.astype(jnp.float32)[None, :], (gp, d))  # [Gp, D]
        return qs, (acc0, m0, l0)

    q_cols = (0, h) if rope is not None else (0,)
    qs, carry = new_token()

    # Cache slots this program reads: [first, end), end excluding the new slot itself.
    end = jnp.minimum(jnp.minimum(start + chunk, pos), seq_len)
    first = start
    if window is not None:
        # The query at pos sees slots > pos - window; whole tiles below that are skipped.
        first = jnp.maximum(start, pos + 1 - window)
        start = jnp.maximum(start, (first // block_k) * block_k)
    acc, m, l = attend_tiles(tuple(zip(qs, q_cols)), k_ref, v_ref, start=start, first=first,
                             end=end, block_k=block_k, qk_scale=qk_scale, carry=carry,
                             softcap=softcap, pages=pages,
                             scales=None if scales is None else scales[:2])
    return acc, m, l, row_ok


def deferred_inv_rms(sum_sq, norm: tuple | None):
    """rsqrt(sum_sq / K + eps) for norm = (kind, K, eps) (the deferred RMSNorm's scale), or
    None."""
    if norm is None:
        return None
    _, norm_dim, eps = norm
    return jax.lax.rsqrt(sum_sq / norm_dim + eps)


def decode_attention_append_kernel(pos_ref, *refs, sm_scale: float, chunk: int, block_k: int,
                                   window: int | None, groups: int, seq_len: int,
                                   has_rope: bool, num_parts: int, normalize: bool,
                                   norm: tuple | None, quantized: bool, dtype,
                                   softcap: float | None = None, page_size: int | None = None):
    # pos_ref [B] int32 (whole array): slot of each sequence's new token
    # bt_ref [max_pages] int32 (page_size given: a paged cache): this row's block table; the
    #   cache refs below are then one KV head's page pools [P, page_size, D] ([P, page_size])
    # q_refs [Gp, D] x P: qkv rows of one KV group from row 0, from each of the P parts (one
    #   16-bit array, or a split-K matmul's float32 chunks, summed here); rows >= G (the key,
    #   the value, past the array) are masked to zero on load
    # kn_refs, vn_refs [D] x P: qkv rows G and G + 1 of this KV group: the new key (before
    #   RoPE), the new value
    # ss_ref (norm = (kind, K, eps)): "sums": [P, B], the parts' sums of squares of the
    #   projection's input row; "rows": [Kp], that input row itself (entries >= K masked),
    #   whose squares are summed here; the parts' sum is scaled by rsqrt(sum / K + eps) (its
    #   RMSNorm, deferred here)
    # cos_ref, sin_ref [D] (has_rope): this sequence's rotation, halves equal
    # k_ref, v_ref [S_pad, D]: one KV head's cache row, read at slots < pos only (codes when
    #   quantized)
    # ks_ref, vs_ref [S_pad] (quantized): that row's scales
    # normalize=False: acc_ref [Gp, D], m_ref [Gp], l_ref [Gp] (float32): this chunk's
    #   partials, G rows stored; normalize=True (one chunk): o_ref [Gp, D], the attention output
    # ko_ref, vo_ref [S_pad, D]: the same buffers as k_ref / v_ref (aliased); slot pos written
    # kso_ref, vso_ref [S_pad] (quantized): the same buffers as ks_ref / vs_ref (aliased)
    pages = None
    if page_size is not None:
        bt_ref, *refs = refs
        pages = (bt_ref, page_size)
    q_refs, kn_refs, vn_refs = (refs[i * num_parts:(i + 1) * num_parts] for i in range(3))
    refs = refs[3 * num_parts:]
    inv_rms = None
    b = pl.program_id(0)
    pos, start = pos_ref[b], pl.program_id(2) * chunk
    if norm is not None:
        ss_ref, *refs = refs
        if norm[0] == "rows":  # one row of the same shape in every program: batch-invariant
            kp = ss_ref.shape[0]
            x = plgpu.load(ss_ref, mask=jnp.arange(kp) < norm[1], other=0).astype(jnp.float32)
            sum_sq = jnp.sum(x * x)
        else:
            sum_sq = ss_ref[0, b]
            for part in range(1, num_parts):
                sum_sq += ss_ref[part, b]
        inv_rms = deferred_inv_rms(sum_sq, norm)
    rope = None
    if has_rope:
        cos_ref, sin_ref, *refs = refs
        rope = (cos_ref, sin_ref, ())
    k_ref, v_ref, *refs = refs
    scales = None
    if quantized:
        ks_ref, vs_ref, *refs, kso_ref, vso_ref = refs
        scales = (ks_ref, vs_ref, kso_ref, vso_ref)
    if normalize:
        o_ref, ko_ref, vo_ref = refs
    else:
        acc_ref, m_ref, l_ref, ko_ref, vo_ref = refs
    gp, d = q_refs[0].shape
    acc, m, l, row_ok = append_attend(
        [(r, (slice(None),)) for r in q_refs], [(r, ()) for r in kn_refs],
        [(r, ()) for r in vn_refs], k_ref, v_ref, ko_ref, vo_ref,
        gp=gp, d=d, pos=pos, start=start, chunk=chunk,
        seq_len=seq_len, window=window, block_k=block_k, groups=groups,
        qk_scale=sm_scale * LOG2_E, dtype=dtype, inv_rms=inv_rms, rope=rope, scales=scales,
        softcap=softcap, pages=pages)
    if normalize:  # the only chunk: l >= 1 (the new token), no merge step
        if pages is not None:  # an idle paged row (pos < 0) has l = 0: zeros, not NaN
            l = jnp.where(l > 0, l, 1.0)
        plgpu.store(o_ref, (acc / l[:, None]).astype(o_ref.dtype), mask=row_ok[:, None])
    else:
        plgpu.store(acc_ref, acc, mask=row_ok[:, None])
        plgpu.store(m_ref, m, mask=row_ok)
        plgpu.store(l_ref, l, mask=row_ok)


# ---------------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------------


def check_rope(op: str, rope, b: int, d: int) -> None:
    """rope must be (cos, sin), each [B, D], D even."""
    if not isinstance(rope, (tuple, list)) or len(rope) != 2:
        raise ValueError(f"{op}: rope must be a (cos, sin) pair")
    for name, t in zip(("cos", "sin"), rope):
        check_array(op, f"rope {name}", t, 2)
        if tuple(t.shape) != (b, d):
            raise ValueError(f"{op}: rope {name} must have shape [B, D] = {(b, d)}, got "
                             f"{tuple(t.shape)}")
    if d % 2:
        raise ValueError(f"{op}: RoPE needs an even head dim, got {d}")


def check_positions(op: str, positions, s: int) -> None:
    """Concrete new-token slots must lie in [0, s); under jit the caller owns this check (an
    out-of-range traced position writes nothing and its output is unspecified)."""
    if not is_tracer(positions):
        pos = jax.device_get(positions)
        if pos.size and (pos.max() >= s or pos.min() < 0):
            raise ValueError(f"{op}: positions must lie in [0, {s}) (the cache holds {s} "
                             f"slots), got min {pos.min()} max {pos.max()}")


def _validate(qkv, k_cache, v_cache, positions, rope, sliding_window, norm=None, k_scale=None,
              v_scale=None, dtype=None) -> tuple[int, int, int, int, jnp.dtype]:
    """The checks; returns (B, S, Hkv, D, the activations' dtype)."""
    op = "decode_attention_append"
    quantized = k_scale is not None or v_scale is not None
    if norm is not None:
        if getattr(qkv, "ndim", None) != 5:
            raise ValueError(f"{op}: norm= goes with the projection's float32 partial sums "
                             f"qkv [S, B, Hkv, G + 2, D]")
        if not isinstance(norm, (tuple, list)) or len(norm) not in (2, 3):
            raise ValueError(f"{op}: norm must be (sums of squares [S, B], K, eps) or "
                             f"(the projection's input rows [B, K], eps)")
        if len(norm) == 2:
            rows_in, eps = norm
            check_array(op, "norm input rows", rows_in, 2)
            k_dim = rows_in.shape[1]
            if rows_in.shape[0] != qkv.shape[1]:
                raise ValueError(f"{op}: the norm's input rows must be [B, K] with B = "
                                 f"{qkv.shape[1]}, got {tuple(rows_in.shape)}")
        else:
            ss, k_dim, eps = norm
            check_array(op, "norm sums of squares", ss, 2, (jnp.float32,))
            if ss.shape[0] != qkv.shape[0] or ss.shape[1] < qkv.shape[1]:
                raise ValueError(f"{op}: the norm's sums of squares must be [S, B'] with S = "
                                 f"{qkv.shape[0]} and B' >= B = {qkv.shape[1]} (the first B "
                                 f"columns read), got {tuple(ss.shape)}")
        if int(k_dim) < 1 or float(eps) < 0:
            raise ValueError(f"{op}: norm K must be >= 1 and eps >= 0, got {k_dim}, {eps}")
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"{op}: sliding_window must be >= 1, got {sliding_window}")
    if getattr(qkv, "ndim", None) == 5:  # a split-K matmul's chunks, summed by the kernel
        check_array(op, "qkv", qkv, 5)
        if qkv.dtype != jnp.float32:
            raise ValueError(f"{op}: a 5-d qkv is the projection's float32 partial sums "
                             f"[S, B, Hkv, G + 2, D]; got dtype {qkv.dtype}")
        b, hkv, rows, d = qkv.shape[1:]
        _, s, hkv_c, dc = check_cache_pair(op, k_cache, v_cache, b, "qkv", "positions",
                                           positions, quantized)
        if quantized:
            check_quantized_cache(op, k_cache, v_cache, k_scale, v_scale)
            if dtype is None:
                raise ValueError(f"{op}: float32 partial sums into a quantized cache need "
                                 f"dtype= (the activations' dtype, that q/k/v round to)")
        else:
            check_same_dtype(op, k_cache=k_cache, v_cache=v_cache)
        act = jnp.dtype(dtype) if quantized else jnp.dtype(k_cache.dtype)
    else:
        check_array(op, "qkv", qkv, 4)
        b, hkv, rows, d = qkv.shape
        _, s, hkv_c, dc = check_cache_pair(op, k_cache, v_cache, b, "qkv", "positions",
                                           positions, quantized)
        if quantized:
            check_quantized_cache(op, k_cache, v_cache, k_scale, v_scale)
        else:
            check_same_dtype(op, qkv=qkv, k_cache=k_cache, v_cache=v_cache)
        act = jnp.dtype(qkv.dtype)
    if dtype is not None and jnp.dtype(dtype) != act:
        raise ValueError(f"{op}: dtype={jnp.dtype(dtype)} differs from the activations' "
                         f"{act} (give it only with a quantized cache's float32 partial sums)")
    if act not in FLOAT_DTYPES:
        raise ValueError(f"{op}: dtype {act} is not a float dtype")
    if hkv_c != hkv or dc != d:
        raise ValueError(f"{op}: qkv {tuple(qkv.shape)} ([B, Hkv, G + 2, D]) does not match the "
                         f"caches' KV heads and head dim {(hkv_c, dc)}")
    if rows < 3:
        raise ValueError(f"{op}: qkv must hold G >= 1 query rows, then the key and the value, "
                         f"per KV head ([B, Hkv, G + 2, D]); got {rows} rows")
    if rope is not None:
        check_rope(op, rope, b, d)
    check_positions(op, positions, s)
    return b, s, hkv, d, act


def decode_attention_append(qkv, k_cache, v_cache, positions, *, k_scale=None, v_scale=None,
                            dtype=None, rope=None, sm_scale: float | None = None,
                            sliding_window: int | None = None, norm=None,
                            interpret: bool = False,
                            block_sizes: DecodeBlockSizes | None = None,
                            softcap: float | None = None):
    """One new token per sequence: rotate its q and k (RoPE, when `rope` is given), write its
    k and v at slot positions[b] of k/v_cache [B, S, Hkv, D], and attend its q to slots
    [0, positions[b]].

    qkv [B, Hkv, G + 2, D]: per KV head, the G query heads (query head j*G + i is row i of KV
    head j, as HF orders them), then the key, then the value. Or the projection's float32
    split-K chunks [S, B, Hkv, G + 2, D] (`norm_matmul(..., partials=True)`): the kernel sums
    them and rounds once to the cache dtype, which saves the sum's own kernel. norm: with the
    chunks of a normed projection (`norm_matmul(x, norm_weight, w, partials=True)`), its
    (sums of squares [S, B], K, eps): the chunks' sum is scaled by rsqrt(sum / K + eps), the
    RMSNorm deferred to here; or (the projection's input rows x [B, K], eps): the kernel sums
    their squares itself, one row per program whatever the batch (batch-invariant, where the
    matmul's own sums are reduced in a layout that depends on the rows). rope: (cos, sin),
    each [B, D]
    (HF rotate-half tables, e.g. `cos(positions * inv_freq)` twice over; halves equal).
    Returns (out [B, Hq, D] in the caches' dtype, k_cache, v_cache). With `sliding_window=w` only
    slots > positions[b] - w are seen (HF semantics). The caches are aliased to the outputs: to
    update them in place, call this inside a jit that donates them (the model's decode step);
    an eager call or a jit without donation copies each cache once first.

    A quantized cache: k/v_cache hold int8 or fp8 codes and k_scale, v_scale [B, S, Hkv]
    (float32 / float16) their scales (kv_quant.py); the new key and value are quantized as they
    are written. dtype: the activations' dtype, that q/k/v round to and `out` has (qkv's; with
    float32 partial sums it must be given). Returns (out, k_cache, v_cache, k_scale, v_scale),
    all four caches aliased. softcap: scores = softcap * tanh(scores / softcap) before the mask
    (Gemma 2), or None.
    """
    _, _, _, _, act = _validate(qkv, k_cache, v_cache, positions, rope, sliding_window, norm,
                                k_scale, v_scale, dtype)
    softcap = check_softcap("decode_attention_append", softcap)
    if qkv.ndim == 4:
        qkv = qkv[None]  # [1, B, Hkv, G + 2, D]: one part
    d = qkv.shape[-1]
    check_head_dim("decode_attention_append", d)
    if rope is not None:
        check_head_dim("decode_attention_append (RoPE halves)", d // 2)
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    b, s, hkv, _ = k_cache.shape
    blocks, chunk, num_splits = append_block_sizes(block_sizes, b, hkv, s, d)
    window = int(sliding_window) if sliding_window is not None else None
    ss, norm_static = norm_operands(norm)
    out = _decode_attention_append_triton(
        qkv, k_cache, v_cache, positions, rope, ss, k_scale, v_scale, sm_scale=sm_scale,
        blocks=blocks, chunk=chunk, num_splits=num_splits, window=window, norm=norm_static,
        dtype=act, softcap=softcap, interpret=interpret)
    return out if k_scale is not None else out[:3]


def append_block_sizes(block_sizes: DecodeBlockSizes | None, b: int, hkv: int, s: int, d: int
                       ) -> tuple[DecodeBlockSizes, int, int]:
    """(blocks, keys per chunk, chunks) of the append kernels for caches of s slots per row."""
    blocks = block_sizes or default_block_sizes(d)
    chunk, num_splits = blocks.chunking(b, hkv, s)
    if block_sizes is None and num_splits == 1 and d <= 128:
        # One program per (sequence, KV head) walks the whole short cache in tiles of 128
        # keys (benchmarks/DECISIONS.md); at D 256 such tiles would not fit shared memory.
        blocks = DecodeBlockSizes(block_k=128, num_splits=1, num_stages=3)
        chunk, num_splits = blocks.chunking(b, hkv, s)
    return blocks, chunk, num_splits


def norm_operands(norm) -> tuple:
    """(the norm's array operand, its static (kind, K, eps)), or (None, None) for norm=None."""
    if norm is not None and len(norm) == 2:
        return norm[0], ("rows", int(norm[0].shape[1]), float(norm[1]))
    if norm is not None:
        return norm[0], ("sums", int(norm[1]), float(norm[2]))
    return None, None


@functools.partial(jax.jit, static_argnames=("sm_scale", "blocks", "chunk", "num_splits",
                                             "window", "norm", "dtype", "softcap",
                                             "interpret"))
def _decode_attention_append_triton(qkv, k_cache, v_cache, positions, rope, ss, k_scale,
                                    v_scale, block_tables=None, *, sm_scale, blocks, chunk,
                                    num_splits, window, norm, dtype, softcap, interpret):
    # qkv [P, B, Hkv, G + 2, D]: P parts summed in the kernel; dtype: the activations'
    # block_tables [B, max_pages] int32: k/v_cache are page pools [P, page_size, Hkv, D]
    # (paged_attention.py), else caches [B, S, Hkv, D]
    parts, b, hkv, rows, d = qkv.shape
    g = rows - 2
    paged = block_tables is not None
    page_size = k_cache.shape[1] if paged else None
    s = block_tables.shape[1] * page_size if paged else k_cache.shape[1]  # slots per row
    quantized = k_scale is not None
    gp = max(16, next_pow2(g))  # tl.dot needs >= 16 rows; the block covers them, loads mask
    block_k = blocks.block_k
    s_pad = num_splits * chunk  # cache blocks rounded up to whole chunks (rows >= s unread)
    # One chunk per row: the kernel writes the output itself; fixed-size chunks always go
    # through the (ordered) merge, so a row's result is the same for any count of chunks.
    normalize = num_splits == 1 and blocks.split_keys is None

    kernel = functools.partial(decode_attention_append_kernel, sm_scale=sm_scale, chunk=chunk,
                               block_k=block_k, window=window, groups=g, seq_len=s,
                               has_rope=rope is not None, num_parts=parts, normalize=normalize,
                               norm=norm, quantized=quantized, dtype=dtype, softcap=softcap,
                               page_size=page_size)
    if paged:  # one KV head's whole page pools, strided by Hkv
        pool = k_cache.shape[0]
        row = pl.BlockSpec((pool, page_size, None, d), lambda i, h, c: (0, 0, h, 0))
        scale_row = pl.BlockSpec((pool, page_size, None), lambda i, h, c: (0, 0, h))
    else:
        row = pl.BlockSpec((None, s_pad, None, d), lambda i, h, c: (i, 0, h, 0))
        scale_row = pl.BlockSpec((None, s_pad, None), lambda i, h, c: (i, 0, h))  # by Hkv

    def qkv_spec(p, first_row, n_rows):  # rows [first_row, +n_rows) of part p, KV group h
        if n_rows is None:  # one row, squeezed
            return pl.BlockSpec((None, None, None, None, d), lambda i, h, c: (p, i, h, first_row, 0))
        return pl.BlockSpec((None, None, None, n_rows, d), lambda i, h, c: (p, i, h, 0, 0))

    in_specs = [pl.BlockSpec((b,), lambda i, h, c: (0,))]
    if paged:  # the row's block table
        in_specs.append(pl.BlockSpec((None, block_tables.shape[1]), lambda i, h, c: (i, 0)))
    in_specs += [qkv_spec(p, 0, gp) for p in range(parts)]  # queries
    in_specs += [qkv_spec(p, g, None) for p in range(parts)]  # keys
    in_specs += [qkv_spec(p, g + 1, None) for p in range(parts)]  # values
    args = [positions] + ([block_tables] if paged else []) + [qkv] * (3 * parts)
    if norm is not None and norm[0] == "rows":  # this sequence's input row, padded to 2^n
        in_specs.append(pl.BlockSpec((None, next_pow2(norm[1])), lambda i, h, c: (i, 0)))
        args.append(ss)
    elif norm is not None:  # the parts' sums of squares [P, B], whole
        in_specs.append(pl.BlockSpec(ss.shape, lambda i, h, c: (0, 0)))
        args.append(ss)
    if rope is not None:
        in_specs += [pl.BlockSpec((None, d), lambda i, h, c: (i, 0))] * 2
        args += list(rope)
    in_specs += [row, row]
    args += [k_cache, v_cache]
    if quantized:
        in_specs += [scale_row, scale_row]
        args += [k_scale, v_scale]
    if normalize:
        out_specs = [pl.BlockSpec((None, None, gp, d), lambda i, h, c: (i, h, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, hkv, g, d), dtype)]
    else:
        out_specs = [pl.BlockSpec((None, None, None, gp, d), lambda i, h, c: (i, h, c, 0, 0)),
                     pl.BlockSpec((None, None, None, gp), lambda i, h, c: (i, h, c, 0)),
                     pl.BlockSpec((None, None, None, gp), lambda i, h, c: (i, h, c, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, hkv, num_splits, g, d), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, num_splits, g), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, num_splits, g), jnp.float32)]
    n_out = len(out_shape)
    out_specs += [row, row]
    out_shape += [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                  jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
    caches = [len(args) - 2, len(args) - 1]  # the caches' argument indices, in place
    if quantized:
        out_specs += [scale_row, scale_row]
        out_shape += [jax.ShapeDtypeStruct(k_scale.shape, k_scale.dtype),
                      jax.ShapeDtypeStruct(v_scale.shape, v_scale.dtype)]
        caches = [len(args) - 4, len(args) - 3, len(args) - 2, len(args) - 1]
    aliases = {arg: n_out + i for i, arg in enumerate(caches)}
    results = pl.pallas_call(
        kernel,
        grid=(b, hkv, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret,
        name=("paged_" if paged else "") + ("decode_attention_append_quantized" if quantized
                                            else "decode_attention_append"),
    )(*args)
    if quantized:
        *outs, k_cache, v_cache, k_scale, v_scale = results
    else:
        *outs, k_cache, v_cache = results
    out = outs[0] if normalize else _merge_splits(
        *outs, ordered=blocks.split_keys is not None).astype(dtype)  # [B, Hkv, G, D]
    out = out.reshape(b, hkv * g, d)  # [B, Hq, D]
    return out, k_cache, v_cache, k_scale, v_scale


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def rotate_half_f32(x, cos, sin):
    """HF rotate-half RoPE of x [B, H, D] with cos/sin [B, D], in float32, cast back."""
    xf = x.astype(jnp.float32)
    h = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., h:], xf[..., :h]], axis=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def decode_attention_append_reference(qkv, k_cache, v_cache, positions, *, k_scale=None,
                                      v_scale=None, dtype=None, rope=None,
                                      sm_scale: float | None = None,
                                      sliding_window: int | None = None, norm=None,
                                      interpret: bool = False,
                                      block_sizes: DecodeBlockSizes | None = None,
                                      softcap: float | None = None):
    """Plain jnp: split qkv, rotate q and k, scatter the new K/V (quantized, for a quantized
    cache), then `decode_attention_reference` (interpret and block_sizes are ignored).
    Returns what the kernel does."""
    del interpret, block_sizes
    b, s, hkv, d, act = _validate(qkv, k_cache, v_cache, positions, rope, sliding_window, norm,
                                  k_scale, v_scale, dtype)
    if qkv.ndim == 5:  # split-K chunks: summed in float32 (normed), rounded once
        if norm is not None and len(norm) == 2:
            xf = norm[0].astype(jnp.float32)
            qkv = apply_norm_partials(qkv, jnp.sum(xf * xf, axis=-1)[None], xf.shape[1],
                                      float(norm[1]))
        elif norm is not None:
            qkv = apply_norm_partials(qkv, norm[0], int(norm[1]), float(norm[2]))
        else:
            qkv = jnp.sum(qkv, axis=0)
        qkv = qkv.astype(act)
    g = qkv.shape[2] - 2
    q = qkv[:, :, :g].reshape(b, hkv * g, d)  # [B, Hq, D]
    k_new, v_new = qkv[:, :, g], qkv[:, :, g + 1]  # [B, Hkv, D]
    if rope is not None:
        cos, sin = (t.astype(jnp.float32) for t in rope)
        q, k_new = rotate_half_f32(q, cos, sin), rotate_half_f32(k_new, cos, sin)
    rows = jnp.arange(b)  # [B]
    if k_scale is not None:
        (k_new, k_s), (v_new, v_s) = (quantize_kv(x, k_cache.dtype, k_scale.dtype)
                                      for x in (k_new, v_new))  # [B, Hkv, D], [B, Hkv]
        k_scale = k_scale.at[rows, positions].set(k_s, mode="drop")  # [B, S, Hkv]
        v_scale = v_scale.at[rows, positions].set(v_s, mode="drop")
    k_cache = k_cache.at[rows, positions].set(k_new, mode="drop")  # [B, S, Hkv, D]
    v_cache = v_cache.at[rows, positions].set(v_new, mode="drop")
    out = decode_attention_reference(q, k_cache, v_cache, positions + 1, k_scale=k_scale,
                                     v_scale=v_scale, sm_scale=sm_scale,
                                     sliding_window=sliding_window, softcap=softcap)
    if k_scale is None:
        return out, k_cache, v_cache
    return out, k_cache, v_cache, k_scale, v_scale
