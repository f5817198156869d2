"""Verify attention that also applies RoPE and appends the new tokens' K/V, in one pallas_call:
decode_attention_append.py's kernel for T = K + 1 new tokens per row (a speculative
verification: the last token and K drafts), at positions[b, 0] + t.

Without it a verification's attention is the prologue in XLA (the projection's chunks summed
and normed, q and k rotated, K and V scattered into the cache, q regrouped per KV head), then
verify_attention.py's kernel and its merge: ~6 launches a layer where a decode step has one.
Here, per (sequence, KV head, chunk of the cache):

- q (T x G rows, row r = query t * Gq + head g), the T new keys and values are read straight
  from the projection's output, or summed from its float32 split-K chunks with the deferred
  norm's scale per token (one rounding to the activations' dtype), and rotated in float32.
- The chunk holding slot positions[b, 0] (the owner) writes the T new keys and values (aliased
  caches, in place under a donating jit) and starts each query row's running softmax from the
  new tokens, a [16+, D] tile of keys held in registers, those at or before the row's token
  unmasked (causal); every program then walks its chunk's cache slots < positions[b, 0]. No
  program reads a slot written here, so the programs need no ordering (as in
  decode_attention_append.py).
- Split-K over the cache and the merge are decode attention's; one chunk per row normalizes in
  the kernel and writes [B, T, Hq, D] itself.

Contiguous caches of the activations' dtype; a row's new positions must be consecutive (a
verification's and a chunked prefill's are). Quantized and paged caches keep the prologue and
verify_attention.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (LOG2_E, MASK_VALUE, check_array, check_head_dim,
                                    check_softcap, dot_f32, next_pow2, softcap_log2)
from pallas_kernels._jax_private import is_tracer
from pallas_kernels.chunk_attention import chunk_attention_reference
from pallas_kernels.decode_attention import DecodeBlockSizes, _merge_splits, attend_tiles
from pallas_kernels.decode_attention_append import append_block_sizes, check_positions
from pallas_kernels.norm_matmul import apply_norm_partials

# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


def verify_attention_append_kernel(pos_ref, *refs, sm_scale: float, chunk: int, block_k: int,
                                   window: int | None, t_new: int, groups: int, seq_len: int,
                                   has_rope: bool, num_parts: int, normalize: bool,
                                   norm: tuple | None, dtype, softcap: float | None = None):
    # pos_ref [B] int32 (whole array): each row's first new slot p0 (token t at p0 + t)
    # q_refs [Tp, Gq, D] x P: the projection's rows (t, g) of this KV group from each of the P
    #   parts (one 16-bit array, or a split-K matmul's float32 chunks, summed here); t >= T or
    #   g >= G masked
    # kn_refs, vn_refs [Tk, D] x P: rows G and G + 1 (the new keys before RoPE, the values),
    #   Tk = max(16, Tp) (rows >= T masked)
    # ss_ref [P, R'] (norm = ("sums", K, eps)): the parts' sums of squares of the projection's
    #   input rows, row b * T + t in column b * T + t
    # cos_ref, sin_ref [Tk, D] (has_rope): the rows' rotations, halves equal
    # k_ref, v_ref [S_pad, D]: one KV head's cache row, read at slots < p0 only
    # normalize: o_ref [Tp, Gq, D], the attention output (rows t < T, g < G stored); else
    #   acc_ref [R, D], m_ref [R], l_ref [R] (float32, R = Tp * Gq): this chunk's partials
    # ko_ref, vo_ref [S_pad, D]: the same buffers as k_ref / v_ref (aliased); slots
    #   p0 .. p0 + T - 1 written by the owner
    q_refs, kn_refs, vn_refs = (refs[i * num_parts:(i + 1) * num_parts] for i in range(3))
    refs = refs[3 * num_parts:]
    b = pl.program_id(0)
    p0, start = pos_ref[b], pl.program_id(2) * chunk
    ss_ref = cos_ref = sin_ref = None
    if norm is not None:
        ss_ref, *refs = refs
    if has_rope:
        cos_ref, sin_ref, *refs = refs
    k_ref, v_ref, *refs = refs
    if normalize:
        o_ref, ko_ref, vo_ref = refs
    else:
        acc_ref, m_ref, l_ref, ko_ref, vo_ref = refs
    tp, gq, d = q_refs[0].shape
    rp = tp * gq
    h = d // 2
    r = jnp.arange(rp)
    t_r, g_r = r // gq, r % gq  # [R]: each query row's token and head
    row_ok = (t_r < t_new) & (g_r < groups)  # [R]
    qk_scale = sm_scale * LOG2_E
    owns = (p0 >= start) & (p0 < start + chunk) & (p0 < seq_len)

    def inv_rms(token):
        """The deferred norm's scale of each token of an index array, or None."""
        if norm is None:
            return None
        _, norm_dim, eps = norm
        total = None
        for p in range(num_parts):
            x = plgpu.load(ss_ref.at[p, b * t_new + token], mask=token < t_new, other=1.0)
            total = x if total is None else total + x
        return jax.lax.rsqrt(total / norm_dim + eps)

    def finish(total, scale):
        """Parts' float32 sum times the norm's scale, rounded once to the activations' dtype."""
        if scale is not None:
            total = total * scale
        return total.astype(dtype)

    # The query rows [R, w] of columns [col, col + w), gathered over (t, g).
    scale_r = inv_rms(t_r)

    def query(col, w):
        cols = col + jnp.arange(w)
        total = None
        for ref in q_refs:
            x = plgpu.load(ref.at[t_r[:, None], g_r[:, None], cols[None, :]],
                           mask=row_ok[:, None], other=0).astype(jnp.float32)
            total = x if total is None else total + x
        return finish(total, None if scale_r is None else scale_r[:, None])

    def rot(ref, token, col):
        """The rotation table's columns [col, col + h) for each token of an index array [N]:
        [N, h] float32."""
        return plgpu.load(ref.at[token[:, None], (col + jnp.arange(h))[None, :]],
                          mask=(token < t_new)[:, None], other=0).astype(jnp.float32)

    if has_rope:
        c, s = rot(cos_ref, t_r, 0), rot(sin_ref, t_r, 0)  # [R, h]
        q_lo, q_hi = query(0, h).astype(jnp.float32), query(h, h).astype(jnp.float32)
        qs = ((q_lo * c - q_hi * s).astype(dtype), (q_hi * c + q_lo * s).astype(dtype))
        q_cols = (0, h)
    else:
        qs = (query(0, d),)
        q_cols = (0,)

    # The new tokens as one tile of keys [Tk, D] (rows j < T): rotated, written by the owner
    # in place, and attended first, causally (query row r sees new key j <= t_r).
    tk = kn_refs[0].shape[0]
    j = jnp.arange(tk)
    key_ok = j < t_new  # [Tk]
    scale_j = inv_rms(j)

    def new_tile(refs, col, w):  # the parts' [Tk, w] of the new keys / values
        total = None
        for ref in refs:
            x = plgpu.load(ref.at[pl.ds(0, tk), pl.ds(col, w)], mask=key_ok[:, None],
                           other=0).astype(jnp.float32)
            total = x if total is None else total + x
        return finish(total, None if scale_j is None else scale_j[:, None])

    v_new = new_tile(vn_refs, 0, d)  # [Tk, D]
    if has_rope:
        cj, sj = rot(cos_ref, j, 0), rot(sin_ref, j, 0)  # [Tk, h]
        lo, hi = new_tile(kn_refs, 0, h).astype(jnp.float32), new_tile(kn_refs, h, h).astype(
            jnp.float32)
        k_new = ((lo * cj - hi * sj).astype(dtype), (hi * cj + lo * sj).astype(dtype))
    else:
        k_new = (new_tile(kn_refs, 0, d),)
    write = (owns & key_ok & (p0 + j < seq_len))[:, None]  # [Tk, 1]
    col = 0
    for kp in k_new:
        plgpu.store(ko_ref.at[pl.ds(p0, tk), pl.ds(col, kp.shape[-1])],
                    kp.astype(ko_ref.dtype), mask=write)
        col += kp.shape[-1]
    plgpu.store(vo_ref.at[pl.ds(p0, tk), pl.ds(0, d)], v_new.astype(vo_ref.dtype), mask=write)

    s_new = None
    for qp, kp in zip(qs, k_new):
        part = dot_f32(qp, kp, trans_b=True)  # [R, Tk]
        s_new = part if s_new is None else s_new + part
    keep = (owns & row_ok)[:, None] & key_ok[None, :] & (j[None, :] <= t_r[:, None])
    if window is not None:
        keep &= t_r[:, None] - j[None, :] < window
    s_new = jnp.where(keep, softcap_log2(s_new * qk_scale, softcap), MASK_VALUE)
    m = jnp.max(s_new, axis=-1)  # [R]; MASK_VALUE on rows that see no new key
    p = jnp.where(keep, jnp.exp2(s_new - m[:, None]), 0.0)
    l = jnp.sum(p, axis=-1)
    acc = dot_f32(p.astype(v_new.dtype), v_new)  # [R, D]

    # Then the chunk's cache slots < p0 (every query row sees them, the window aside).
    end = jnp.minimum(jnp.minimum(start + chunk, p0), seq_len)
    first, limits = start, None
    if window is not None:  # row r sees slots > p0 + t_r - window; whole tiles below skipped
        first = jnp.maximum(start, p0 + 1 - window)
        start = jnp.maximum(start, (first // block_k) * block_k)
        limits = (jnp.where(row_ok, p0 + t_r, -1), window)
    acc, m, l = attend_tiles(tuple(zip(qs, q_cols)), k_ref, v_ref, start=start, first=first,
                             end=end, block_k=block_k, qk_scale=qk_scale, carry=(acc, m, l),
                             softcap=softcap, limits=limits)
    if normalize:  # the only chunk: l >= 1 on every stored row (its own token)
        o = acc / jnp.where(l > 0, l, 1.0)[:, None]
        plgpu.store(o_ref.at[t_r[:, None], g_r[:, None], jnp.arange(d)[None, :]],
                    o.astype(o_ref.dtype), mask=row_ok[:, None])
    else:
        plgpu.store(acc_ref, acc, mask=row_ok[:, None])
        plgpu.store(m_ref, m, mask=row_ok)
        plgpu.store(l_ref, l, mask=row_ok)


# ---------------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------------


def _validate(qkv, k_cache, v_cache, positions, rope, sliding_window, norm):
    """The checks; returns (B, T, S, Hkv, D, the activations' dtype)."""
    op = "verify_attention_append"
    if getattr(qkv, "ndim", None) not in (5, 6):
        raise ValueError(f"{op}: qkv must be [B, T, Hkv, G + 2, D], or the projection's float32 "
                         f"split-K chunks [S, B, T, Hkv, G + 2, D]")
    check_array(op, "qkv", qkv, qkv.ndim)
    if qkv.ndim == 6 and qkv.dtype != jnp.float32:
        raise ValueError(f"{op}: a 6-d qkv is the projection's float32 partial sums; got dtype "
                         f"{qkv.dtype}")
    if norm is not None:
        if qkv.ndim != 6:
            raise ValueError(f"{op}: norm= goes with the projection's float32 partial sums")
        if not isinstance(norm, (tuple, list)) or len(norm) != 3:
            raise ValueError(f"{op}: norm must be (sums of squares [S, R], K, eps)")
        ss, k_dim, eps = norm
        check_array(op, "norm sums of squares", ss, 2, (jnp.float32,))
        rows = qkv.shape[1] * qkv.shape[2]
        if ss.shape[0] != qkv.shape[0] or ss.shape[1] < rows:
            raise ValueError(f"{op}: the norm's sums of squares must be [S, R] with S = "
                             f"{qkv.shape[0]} and R >= B * T = {rows}, got {tuple(ss.shape)}")
        if int(k_dim) < 1 or float(eps) < 0:
            raise ValueError(f"{op}: norm K must be >= 1 and eps >= 0, got {k_dim}, {eps}")
    b, t, hkv, rows, d = qkv.shape[-5:]
    check_array(op, "k_cache", k_cache, 4)
    check_array(op, "v_cache", v_cache, 4)
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{op}: k_cache {k_cache.shape} {k_cache.dtype} and v_cache "
                         f"{v_cache.shape} {v_cache.dtype} must match")
    act = jnp.dtype(k_cache.dtype)  # the activations' (check_array: a float dtype)
    if qkv.ndim == 5 and qkv.dtype != act:
        raise ValueError(f"{op}: qkv {qkv.dtype} and the caches {act} must have one dtype")
    bc, s, hkv_c, dc = k_cache.shape
    if (bc, hkv_c, dc) != (b, hkv, d):
        raise ValueError(f"{op}: qkv {tuple(qkv.shape)} does not match the caches "
                         f"{tuple(k_cache.shape)} ([B, S, Hkv, D])")
    if rows < 3:
        raise ValueError(f"{op}: qkv must hold G >= 1 query rows, then the key and the value, "
                         f"per KV head; got {rows} rows")
    check_array(op, "positions", positions, 2, (jnp.int32,))
    if tuple(positions.shape) != (b, t):
        raise ValueError(f"{op}: positions must be [B, T] = {(b, t)}, got "
                         f"{tuple(positions.shape)}")
    if not is_tracer(positions):
        pos = np.asarray(jax.device_get(positions))
        if (pos != pos[:, :1] + np.arange(t)[None, :]).any():
            raise ValueError(f"{op}: each row's new positions must be consecutive "
                             f"(positions[b, 0] + t)")
        check_positions(op, pos[:, -1], s)
        check_positions(op, pos[:, 0], s)
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"{op}: sliding_window must be >= 1, got {sliding_window}")
    if rope is not None:
        if not isinstance(rope, (tuple, list)) or len(rope) != 2:
            raise ValueError(f"{op}: rope must be a (cos, sin) pair")
        for name, tab in zip(("cos", "sin"), rope):
            check_array(op, f"rope {name}", tab, 3)
            if tuple(tab.shape) != (b, t, d):
                raise ValueError(f"{op}: rope {name} must be [B, T, D] = {(b, t, d)}, got "
                                 f"{tuple(tab.shape)}")
    return b, t, s, hkv, d, act


def verify_attention_append(qkv, k_cache, v_cache, positions, *, rope=None,
                            sm_scale: float | None = None, sliding_window: int | None = None,
                            norm=None, interpret: bool = False,
                            block_sizes: DecodeBlockSizes | None = None,
                            softcap: float | None = None):
    """T new tokens per sequence at consecutive positions [B, T] (positions[b, 0] + t): rotate
    their q and k (RoPE, when `rope` = (cos, sin), each [B, T, D], halves equal), write their k
    and v at those slots of k/v_cache [B, S, Hkv, D], and attend each query to slots
    [0, its position] (causal among the new tokens; HF's sliding window: > position - w).

    qkv [B, T, Hkv, G + 2, D] (per KV head its G query heads, its key, its value), or the
    projection's float32 split-K chunks [S, B, T, Hkv, G + 2, D], summed here and rounded once
    to the caches' dtype; norm: their deferred RMSNorm's (sums of squares [S, R], K, eps), row
    b * T + t in column b * T + t. Returns (out [B, T, Hq, D], k_cache, v_cache); the caches are
    aliased to the outputs (in place inside a jit that donates them). Slots past the cache are
    not written. softcap: scores = softcap * tanh(scores / softcap) before the mask."""
    b, t, s, hkv, d, act = _validate(qkv, k_cache, v_cache, positions, rope, sliding_window,
                                     norm)
    softcap = check_softcap("verify_attention_append", softcap)
    check_head_dim("verify_attention_append", d)
    if rope is not None:
        check_head_dim("verify_attention_append (RoPE halves)", d // 2)
    if qkv.ndim == 5:
        qkv = qkv[None]  # one part
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    blocks, chunk, num_splits = append_block_sizes(block_sizes, b, hkv, s, d)
    window = int(sliding_window) if sliding_window is not None else None
    ss, norm_static = (None, None) if norm is None else (norm[0], ("sums", int(norm[1]),
                                                                   float(norm[2])))
    return _verify_attention_append_triton(
        qkv, k_cache, v_cache, positions[:, 0], rope, ss, sm_scale=sm_scale, blocks=blocks,
        chunk=chunk, num_splits=num_splits, window=window, norm=norm_static, dtype=act,
        softcap=softcap, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "blocks", "chunk", "num_splits",
                                             "window", "norm", "dtype", "softcap",
                                             "interpret"))
def _verify_attention_append_triton(qkv, k_cache, v_cache, first, rope, ss, *, sm_scale,
                                    blocks, chunk, num_splits, window, norm, dtype, softcap,
                                    interpret):
    # qkv [P, B, T, Hkv, G + 2, D]: P parts summed in the kernel; first [B]: each row's p0
    parts, b, t, hkv, rows, d = qkv.shape
    g = rows - 2
    s = k_cache.shape[1]
    tp, gq = next_pow2(t), next_pow2(g)
    tk = max(16, tp)  # the new keys' tile: tl.dot needs >= 16 rows (loads mask rows >= T)
    rp = tp * gq
    s_pad = num_splits * chunk
    # One chunk per row: the kernel writes the output itself; fixed-size chunks always go
    # through the (ordered) merge, as decode_attention_append does.
    normalize = num_splits == 1 and blocks.split_keys is None
    kernel = functools.partial(
        verify_attention_append_kernel, sm_scale=sm_scale, chunk=chunk, block_k=blocks.block_k,
        window=window, t_new=t, groups=g, seq_len=s, has_rope=rope is not None,
        num_parts=parts, normalize=normalize, norm=norm, dtype=dtype, softcap=softcap)
    row = pl.BlockSpec((None, s_pad, None, d), lambda i, h, c: (i, 0, h, 0))

    def qkv_spec(p, first_row, n_rows):  # part p's [Tp, n_rows, D] / [Tk, D] of KV group h
        if n_rows is None:  # one row (the key, the value), squeezed
            return pl.BlockSpec((None, None, tk, None, None, d),
                                lambda i, h, c: (p, i, 0, h, first_row, 0))
        return pl.BlockSpec((None, None, tp, None, n_rows, d),
                            lambda i, h, c: (p, i, 0, h, 0, 0))

    in_specs = [pl.BlockSpec((b,), lambda i, h, c: (0,))]
    in_specs += [qkv_spec(p, 0, gq) for p in range(parts)]
    in_specs += [qkv_spec(p, g, None) for p in range(parts)]
    in_specs += [qkv_spec(p, g + 1, None) for p in range(parts)]
    args = [first] + [qkv] * (3 * parts)
    if norm is not None:  # the parts' sums of squares [P, R'], whole
        in_specs.append(pl.BlockSpec(ss.shape, lambda i, h, c: (0, 0)))
        args.append(ss)
    if rope is not None:
        in_specs += [pl.BlockSpec((None, tk, d), lambda i, h, c: (i, 0, 0))] * 2
        args += list(rope)
    in_specs += [row, row]
    args += [k_cache, v_cache]
    if normalize:
        out_specs = [pl.BlockSpec((None, tp, None, gq, d), lambda i, h, c: (i, 0, h, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, t, hkv, g, d), dtype)]
    else:
        out_specs = [pl.BlockSpec((None, None, None, rp, d), lambda i, h, c: (i, h, c, 0, 0)),
                     pl.BlockSpec((None, None, None, rp), lambda i, h, c: (i, h, c, 0)),
                     pl.BlockSpec((None, None, None, rp), lambda i, h, c: (i, h, c, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, hkv, num_splits, rp, d), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, num_splits, rp), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, num_splits, rp), jnp.float32)]
    n_out = len(out_shape)
    out_specs += [row, row]
    out_shape += [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                  jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
    aliases = {len(args) - 2: n_out, len(args) - 1: n_out + 1}
    *outs, k_cache, v_cache = pl.pallas_call(
        kernel,
        grid=(b, hkv, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret,
        name="verify_attention_append",
    )(*args)
    if normalize:
        out = outs[0]  # [B, T, Hkv, G, D]
    else:
        merged = _merge_splits(*outs, ordered=blocks.split_keys is not None)  # [B, Hkv, R, D]
        out = merged.reshape(b, hkv, tp, gq, d)[:, :, :t, :g].transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, hkv * g, d).astype(dtype), k_cache, v_cache


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def verify_attention_append_reference(qkv, k_cache, v_cache, positions, *, rope=None,
                                      sm_scale: float | None = None,
                                      sliding_window: int | None = None, norm=None,
                                      interpret: bool = False,
                                      block_sizes: DecodeBlockSizes | None = None,
                                      softcap: float | None = None):
    """Plain jnp: sum the parts (normed), split qkv, rotate q and k, scatter the new K/V, then
    chunk attention's reference. Returns what the kernel does."""
    del interpret, block_sizes
    b, t, s, hkv, d, act = _validate(qkv, k_cache, v_cache, positions, rope, sliding_window,
                                     norm)
    if qkv.ndim == 6:  # the chunks summed (normed) in float32, rounded once
        flat = qkv.reshape(qkv.shape[0], b * t, *qkv.shape[3:])  # [S, B * T, Hkv, G + 2, D]
        qkv = (apply_norm_partials(flat, norm[0], int(norm[1]), float(norm[2]))
               if norm is not None else jnp.sum(flat, axis=0)).reshape(qkv.shape[1:])
    qkv = qkv.astype(act)
    g = qkv.shape[3] - 2
    q = qkv[:, :, :, :g].reshape(b, t, hkv * g, d)  # [B, T, Hq, D]
    k_new, v_new = qkv[:, :, :, g], qkv[:, :, :, g + 1]  # [B, T, Hkv, D]
    if rope is not None:
        cos, sin = (tab.astype(jnp.float32)[:, :, None, :] for tab in rope)  # [B, T, 1, D]

        def rotate(x):
            xf = x.astype(jnp.float32)
            half = d // 2
            rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
            return (xf * cos + rotated * sin).astype(act)
        q, k_new = rotate(q), rotate(k_new)
    rows = jnp.arange(b)[:, None]  # [B, 1]
    k_cache = k_cache.at[rows, positions].set(k_new, mode="drop")
    v_cache = v_cache.at[rows, positions].set(v_new, mode="drop")
    out = chunk_attention_reference(q, k_cache, v_cache, positions, sm_scale=sm_scale,
                                    sliding_window=sliding_window, softcap=softcap)
    return out, k_cache, v_cache
