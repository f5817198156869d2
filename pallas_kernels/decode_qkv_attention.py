"""The decode step's attention input in one kernel, for short caches: the q/k/v projection
(residual add + RMSNorm in its main loop, as `norm_matmul(..., partials=True, deltas=)`) and,
in the tail of the same kernel, the decode attention of `decode_attention_append`.

At batch 1 and a few hundred cache slots the attention is a latency chain on Hkv programs
(~6 us on the H200 for Llama-3-8B, of which ~2 us are the kernel's own launch and ramp). Here
it runs in the projection's tail instead: every program of the projection stores its float32
partial sums of its [block_m, block_n] tile and K chunk (and its chunk's sums of squares of x),
then counts itself in its KV group's counter (an atomic add with release/acquire order, after a
thread barrier); the program that arrives last for a group (the group's G + 2 heads are
(G + 2) * D contiguous columns of the projection) reads the group's partials back (volatile
loads: other SMs wrote them), scales them by the deferred norm's rsqrt, applies RoPE, writes
the new K/V slot and attends to the cache (`decode_attention_append.append_attend`), and resets
the counter to 0 for the next layer. No program waits on another, so no program needs to be
resident at the same time as another (unlike a grid barrier).

The counters are a [Hkv] int32 buffer, 0 on entry and on exit, aliased in and out: one buffer
(jnp.zeros once per decode step) threads through every layer's call.

    decode_qkv_attention(x, norm_weight, w, k_cache, v_cache, positions, counters, *, rope,
                         eps, deltas=None, ...)
        -> (x + sum(deltas), attention out [B, Hq, D], k_cache, v_cache, counters)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import LOG2_E, check_array, check_head_dim, next_pow2
from pallas_kernels.decode_attention import check_cache_pair
from pallas_kernels.decode_attention_append import (
    append_attend, check_positions, check_rope, decode_attention_append_reference,
    deferred_inv_rms)
from pallas_kernels.norm_matmul import (
    MatmulBlockSizes, _validate as _validate_matmul, default_block_sizes, fused_matmul_kernel,
    norm_matmul_reference)
from pallas_kernels.rms_norm import add_deltas_reference, check_deltas

# Every sequence's attention runs in its group's last program (a static loop): a few at most.
MAX_BATCH = 4
# The tail reads the whole cache of a group in one program: a short cache only (the unsplit
# regime of decode_attention_append, choose_num_splits' unsplit_max).
MAX_SLOTS = 512


def _atomic_add(ref, index, value, interpret: bool):
    """ref[index] += value (int32 scalar), returning the old value. Interpret mode's rule takes
    a slice, the GPU lowering a scalar index."""
    if interpret:
        return plgpu.atomic_add(ref, (pl.ds(index, 1),), jnp.full((1,), value, jnp.int32))[0]
    return plgpu.atomic_add(ref, (index,), jnp.int32(value))


def qkv_attention_kernel(*refs, matmul: dict, n_deltas: int, batch: int, groups: int, d: int,
                         block_n: int, split: int, seq_len: int, block_k: int,
                         window: int | None, sm_scale: float, norm: tuple[int, float],
                         interpret: bool):
    # Grid (M tiles = 1, N tiles, K chunks) of the projection (norm_matmul's).
    # inputs: x_ref [block_m, Kp], n_deltas d_refs [block_m, Kp], nw_ref [Kp], w_ref
    #   [Kp, block_n] (the matmul's blocks); pos_ref [B]; cos_ref, sin_ref [B, D];
    #   k_ref, v_ref [B, S_pad, Hkv, D] (whole caches); cnt_ref [Hkv] int32
    # outputs: xo_ref [block_m, Kp] if n_deltas; parts_ref [S, Bp, Hkv, Rp, D] float32
    #   (whole: this program stores its tile, its group's last program reads the group's);
    #   ss_ref [T, S, Bp] float32 (whole: each program's chunk's sums of squares of x);
    #   o_ref [B, Hkv, Gp, D] (the attention output, G rows stored); ko_ref, vo_ref (the
    #   caches, aliased); cno_ref (the counters, aliased)
    n_in = 3 + n_deltas
    mm_in = refs[:n_in]
    pos_ref, cos_ref, sin_ref, k_ref, v_ref, _ = refs[n_in:n_in + 6]
    out = refs[n_in + 6:]
    xo = out[:1] if n_deltas else ()
    parts_ref, ss_ref, o_ref, ko_ref, vo_ref, cnt_ref = out[len(xo):]
    j, s = pl.program_id(1), pl.program_id(2)
    rows = groups + 2
    col0 = j * block_n
    g = col0 // (rows * d)  # this tile's KV group (a group's columns are contiguous)
    bm = matmul["block_m"]
    parts_tile = parts_ref.at[(s, pl.ds(0, bm), g, (col0 // d) % rows,
                               pl.ds(col0 % d, block_n))]  # [block_m, block_n]
    ss_tile = ss_ref.at[(j, s, pl.ds(0, bm))]  # [block_m]
    fused_matmul_kernel(*mm_in, *xo, parts_tile, ss_tile, **matmul, n_deltas=n_deltas,
                        ss_every_tile=True)

    # Arrive: this program's stores, then the count (release); the last one reads (acquire).
    if not interpret:
        plgpu.debug_barrier()
    tiles_per_group = rows * d // block_n
    last = _atomic_add(cnt_ref, g, 1, interpret) == tiles_per_group * split - 1

    if not interpret:
        plgpu.debug_barrier()

    @pl.when(last)
    def _reset():  # back to 0 for the next layer (no loop in this branch)
        _atomic_add(cnt_ref, g, -(tiles_per_group * split), interpret)

    # Every program runs the attention code, predicated on `last`; the others load, loop and
    # store nothing. With the code inside `pl.when(last)` the tail took 12.7 us on the H200
    # (against 6.2 for the whole separate kernel, and 8.2 with 32-key tiles: the cost grew
    # with the tile, as when the loop's loads are not pipelined); this form is the next
    # thing to measure (not yet compiled on the GPU; benchmarks/NOTES.md, run G).
    gp = o_ref.shape[2]
    bp = ss_ref.shape[2]
    s_pad = k_ref.shape[1]
    seq = jnp.arange(bp)
    # The chunks' sums of squares, from the group's first tile (same x rows, same chunks).
    sum_sq = sum(plgpu.load(ss_ref.at[(g * tiles_per_group, jnp.int32(c), pl.ds(0, bp))],
                            mask=jnp.broadcast_to(last, (bp,)), other=0, volatile=True)
                 for c in range(split))  # [Bp]
    for b in range(batch):
        bi = jnp.int32(b)
        inv_rms = deferred_inv_rms(jnp.sum(jnp.where(seq == b, sum_sq, 0.0)), norm)
        chunks = [jnp.int32(c) for c in range(split)]
        acc, _, l, row_ok = append_attend(
            [(parts_ref, (c, bi, g, pl.ds(0, gp))) for c in chunks],
            [(parts_ref, (c, bi, g, jnp.int32(groups))) for c in chunks],
            [(parts_ref, (c, bi, g, jnp.int32(groups + 1))) for c in chunks],
            k_ref, v_ref, ko_ref, vo_ref,
            kv_index=lambda r, cols, bi=bi: (bi, r, g, cols), gp=gp, d=d,
            pos=pos_ref[b], start=0, chunk=s_pad, seq_len=seq_len, window=window,
            block_k=block_k, groups=groups, qk_scale=sm_scale * LOG2_E, inv_rms=inv_rms,
            rope=(cos_ref, sin_ref, (bi,)), volatile=True, active=last)
        plgpu.store(o_ref.at[(bi, g, pl.ds(0, gp), pl.ds(0, d))],
                    (acc / l[:, None]).astype(o_ref.dtype), mask=row_ok[:, None] & last)


def _validate(x, norm_weight, w, k_cache, v_cache, positions, counters, rope, deltas):
    op = "decode_qkv_attention"
    _validate_matmul(x, norm_weight, w, None)
    if norm_weight is None:
        raise ValueError(f"{op}: needs the attention norm's weight (norm_weight [K])")
    if deltas is not None:
        check_deltas(op, x, deltas, float32_only=True)
    if w.ndim != 4:
        raise ValueError(f"{op}: w must be the fused projection [K, Hkv, G + 2, D], got "
                         f"{tuple(w.shape)}")
    _, hkv, rows, d = w.shape
    b = x.shape[0]
    _, s, hkv_c, dc = check_cache_pair(op, k_cache, v_cache, b, "x", "positions", positions)
    if (hkv_c, dc) != (hkv, d):
        raise ValueError(f"{op}: w {tuple(w.shape)} ([K, Hkv, G + 2, D]) does not match the "
                         f"caches' KV heads and head dim {(hkv_c, dc)}")
    if rows < 3:
        raise ValueError(f"{op}: w must hold G >= 1 query heads, then the key and the value, "
                         f"per KV head ([K, Hkv, G + 2, D]); got {rows}")
    if k_cache.dtype != x.dtype:
        raise ValueError(f"{op}: the caches must have x's dtype {x.dtype}, got {k_cache.dtype}")
    if b > MAX_BATCH or s > MAX_SLOTS:
        raise ValueError(f"{op}: for at most {MAX_BATCH} sequences and {MAX_SLOTS} cache slots "
                         f"(got {b} and {s}); use norm_matmul + decode_attention_append")
    check_array(op, "counters", counters, 1, (jnp.int32,))
    if counters.shape[0] != hkv:
        raise ValueError(f"{op}: counters must be [Hkv] = [{hkv}] int32 zeros, got "
                         f"{tuple(counters.shape)}")
    check_rope(op, rope, b, d)
    check_head_dim(op, d)
    check_head_dim(f"{op} (RoPE halves)", d // 2)
    check_positions(op, positions, s)


def decode_qkv_attention(x, norm_weight, w, k_cache, v_cache, positions, counters, *, rope,
                         eps: float = 1e-6, deltas=None, sm_scale: float | None = None,
                         sliding_window: int | None = None, interpret: bool = False,
                         block_sizes: MatmulBlockSizes | None = None, attn_block_k: int = 128):
    """One decode step's attention for B <= MAX_BATCH sequences and a cache of <= MAX_SLOTS
    slots: h = rms_norm(x + sum(deltas)), qkv = h @ w, then decode_attention_append's RoPE,
    cache write and attention on qkv, in one kernel.

    x [B, K] (the residual stream), norm_weight [K], w [K, Hkv, G + 2, D] (per KV head its G
    query heads, then the key, then the value), deltas [S', B, K] float32 or None (a split-K
    producer's chunks, added to x first), k_cache / v_cache [B, S, Hkv, D] (x's dtype),
    positions [B] (the new token's slot), counters [Hkv] int32 zeros (returned as zeros:
    thread one buffer through the layers), rope (cos, sin) [B, D] each.
    Returns (x + sum(deltas) (or x), out [B, Hq, D], k_cache, v_cache, counters). The caches
    and counters are aliased to the outputs (in place inside a jit that donates them)."""
    _validate(x, norm_weight, w, k_cache, v_cache, positions, counters, rope, deltas)
    m, k = x.shape
    _, hkv, rows, d = w.shape
    n = hkv * rows * d
    blocks = block_sizes
    if blocks is None:  # norm_matmul's, with tiles inside one head's columns
        blocks = default_block_sizes(m, n, k, x.dtype.itemsize, n_weights=1)
        blocks = dataclasses.replace(blocks, block_n=min(blocks.block_n, d))
    if blocks.block_n > d or d % blocks.block_n or blocks.block_m < m:
        raise ValueError(f"decode_qkv_attention: block_n must divide the head dim {d} and "
                         f"block_m cover the batch {m}; got {blocks}")
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    window = int(sliding_window) if sliding_window is not None else None
    if window is not None and window < 1:
        raise ValueError(f"decode_qkv_attention: sliding_window must be >= 1, got {window}")
    out = _qkv_attention(x, norm_weight, w.reshape(k, n), k_cache, v_cache, positions,
                         counters, tuple(rope), deltas, eps=float(eps), blocks=blocks,
                         groups=rows - 2, sm_scale=sm_scale, window=window,
                         attn_block_k=int(attn_block_k), interpret=interpret)
    x_new, o, k_cache, v_cache, counters = out
    return x_new, o.reshape(m, hkv * (rows - 2), d), k_cache, v_cache, counters


@functools.partial(jax.jit, static_argnames=("eps", "blocks", "groups", "sm_scale", "window",
                                             "attn_block_k", "interpret"))
def _qkv_attention(x, norm_weight, w, k_cache, v_cache, positions, counters, rope, deltas, *,
                   eps, blocks, groups, sm_scale, window, attn_block_k, interpret):
    # w [K, N], N = Hkv * (G + 2) * D
    m, k = x.shape
    n = w.shape[1]
    b, s, hkv, d = k_cache.shape
    rows = groups + 2
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    split = max(1, min(blocks.split_k, pl.cdiv(k, bk)))
    k_chunk = pl.cdiv(pl.cdiv(k, split), bk) * bk
    split = pl.cdiv(k, k_chunk)
    kp = split * k_chunk
    tiles = n // bn
    gp = max(16, next_pow2(groups))
    rp = max(gp, next_pow2(rows))  # the parts' row axis as blocked (query rows read as Gp)
    s_pad = pl.cdiv(s, attn_block_k) * attn_block_k
    n_deltas = 0 if deltas is None else deltas.shape[0]

    def whole(shape):
        return pl.BlockSpec(shape, lambda i, j, c: (0,) * len(shape))

    x_band = pl.BlockSpec((bm, kp), lambda i, j, c: (i, 0))
    in_specs = [x_band]
    args = [x]
    for c in range(n_deltas):
        in_specs.append(pl.BlockSpec((None, bm, kp), lambda i, j, cc, c=c: (c, i, 0)))
        args.append(deltas)
    in_specs += [pl.BlockSpec((kp,), lambda i, j, c: (0,)),
                 pl.BlockSpec((kp, bn), lambda i, j, c: (0, j))]
    args += [norm_weight, w]
    cache = whole((b, s_pad, hkv, d))
    in_specs += [whole((b,)), whole((b, d)), whole((b, d)), cache, cache, whole((hkv,))]
    args += [positions, *rope, k_cache, v_cache, counters]
    out_specs, out_shape = [], []
    if n_deltas:
        out_specs.append(x_band)
        out_shape.append(jax.ShapeDtypeStruct((m, k), x.dtype))
    out_specs += [whole((split, bm, hkv, rp, d)), whole((tiles, split, bm)),
                  whole((b, hkv, gp, d)), cache, cache, whole((hkv,))]
    out_shape += [jax.ShapeDtypeStruct((split, m, hkv, rows, d), jnp.float32),
                  jax.ShapeDtypeStruct((tiles, split, m), jnp.float32),
                  jax.ShapeDtypeStruct((b, hkv, groups, d), x.dtype),
                  jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                  jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
                  jax.ShapeDtypeStruct(counters.shape, jnp.int32)]
    n_out = len(out_shape)
    aliases = {len(args) - 3: n_out - 3, len(args) - 2: n_out - 2, len(args) - 1: n_out - 1}
    matmul = dict(m=m, n=n, k=k, eps=eps, block_m=bm, block_n=bn, block_k=bk, k_chunk=k_chunk,
                  n_weights=1, has_norm=True, has_residual=False, epilogue="none", partial=True)
    kernel = functools.partial(
        qkv_attention_kernel, matmul=matmul, n_deltas=n_deltas, batch=b, groups=groups, d=d,
        block_n=bn, split=split, seq_len=s, block_k=attn_block_k, window=window,
        sm_scale=sm_scale, norm=(k, eps), interpret=interpret)
    outs = pl.pallas_call(
        kernel,
        grid=(1, tiles, split),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret,
        name=f"{'add_' if n_deltas else ''}norm_matmul_attention_k{k}_n{n}_split{split}",
    )(*args)
    x_new = outs[0] if n_deltas else x
    _, _, o, k_cache, v_cache, counters = outs[-6:]
    return x_new, o, k_cache, v_cache, counters


def decode_qkv_attention_reference(x, norm_weight, w, k_cache, v_cache, positions, counters, *,
                                   rope, eps: float = 1e-6, deltas=None,
                                   sm_scale: float | None = None,
                                   sliding_window: int | None = None, interpret: bool = False,
                                   block_sizes=None, attn_block_k: int = 128):
    """The same in plain jnp: norm_matmul_reference, then decode_attention_append_reference
    (interpret and the block sizes are ignored; the counters are returned as given)."""
    del interpret, block_sizes, attn_block_k
    _validate(x, norm_weight, w, k_cache, v_cache, positions, counters, rope, deltas)
    if deltas is not None:
        x = add_deltas_reference(x, deltas)
    qkv = norm_matmul_reference(x, norm_weight, w, eps=eps)  # [B, Hkv, G + 2, D]
    out, k_cache, v_cache = decode_attention_append_reference(
        qkv, k_cache, v_cache, positions, rope=rope, sm_scale=sm_scale,
        sliding_window=sliding_window)
    return x, out, k_cache, v_cache, counters
