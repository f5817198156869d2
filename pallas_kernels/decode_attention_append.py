"""Decode attention that also appends the new token's K/V to the cache, in one pallas_call.

The decode step used to write the new K and V with two XLA dynamic-update-slice fusions, pad q
to 16 rows with a third, then run `decode_attention`. Here one kernel does all of it:

- The caches are outputs aliased to the cache inputs (`input_output_aliases`), so inside a jit
  that donates them they are updated in place: of the programs of one (sequence, KV head), only
  the one whose chunk holds slot `positions[b]` writes the new row (D elements per cache).
- No program reads slot `positions[b]` from the cache: the owner starts its running softmax from
  the new token (q . k_new, v_new taken from the k_new/v_new inputs), and every program walks
  only the cache slots < positions[b] of its chunk. Reads and the one write never touch the same
  address, so the programs need no ordering between them.
- q is passed as [B, Hkv, G, D] (a free reshape) with a block of Gp >= 16 rows; the kernel loads
  it with rows >= G masked to zero, and stores the partial results for the G real rows only. No
  padded copy of q or slice of the result is materialised.
- Split-K over the sequence and the XLA merge of the chunks are those of decode_attention.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import LOG2_E, MASK_VALUE, check_head_dim, next_pow2
from pallas_kernels.decode_attention import (
    DecodeBlockSizes, _merge_splits, attend_tiles, check_decode_inputs, choose_num_splits,
    decode_attention_reference)

# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


def decode_attention_append_kernel(pos_ref, q_ref, kn_ref, vn_ref, k_ref, v_ref,
                                   acc_ref, m_ref, l_ref, ko_ref, vo_ref, *, sm_scale: float,
                                   chunk: int, block_k: int, window: int | None, groups: int,
                                   seq_len: int):
    # pos_ref [B] int32 (whole array): slot of each sequence's new token
    # q_ref [Gp, D]: block over the G query heads of one KV group; rows >= G are not this
    #   group's (or lie past the array) and are masked to zero on load
    # kn_ref, vn_ref [D]: the new token's key / value for this KV head
    # k_ref, v_ref [S_pad, D]: one KV head's cache row, read at slots < pos only
    # acc_ref [Gp, D], m_ref [Gp], l_ref [Gp] (float32): this chunk's partials, G rows stored
    # ko_ref, vo_ref [S_pad, D]: the same buffers as k_ref / v_ref (aliased); slot pos written
    b = pl.program_id(0)
    split = pl.program_id(2)
    pos = pos_ref[b]
    start = split * chunk
    # pos < seq_len keeps an out-of-range traced position from writing past the cache
    owns = (pos >= start) & (pos < start + chunk) & (pos < seq_len)
    k_new = kn_ref[...]  # [D]
    v_new = vn_ref[...]  # [D]

    @pl.when(owns)
    def _write_new_slot():
        ko_ref[pos, :] = k_new
        vo_ref[pos, :] = v_new

    gp, d = q_ref.shape
    row_ok = jnp.arange(gp) < groups  # [Gp]
    q = plgpu.load(q_ref, mask=row_ok[:, None], other=0)  # [Gp, D]
    qk_scale = sm_scale * LOG2_E
    # The owner's running softmax starts from the new token; the others start empty.
    s_new = jnp.sum(q.astype(jnp.float32) * k_new.astype(jnp.float32)[None, :], axis=-1)
    w0 = owns.astype(jnp.float32)  # 1 for the owner, 0 for the others
    m0 = jnp.where(owns, s_new * qk_scale, MASK_VALUE)  # [Gp]
    l0 = jnp.broadcast_to(w0, (gp,))  # [Gp]
    acc0 = jnp.broadcast_to(w0 * v_new.astype(jnp.float32)[None, :], (gp, d))  # [Gp, D]

    # Cache slots this program reads: [first, end), end excluding the new slot itself.
    end = jnp.minimum(jnp.minimum(start + chunk, pos), seq_len)
    first = start
    if window is not None:
        # The query at pos sees slots > pos - window; whole tiles below that are skipped.
        first = jnp.maximum(start, pos + 1 - window)
        start = jnp.maximum(start, (first // block_k) * block_k)
    acc, m, l = attend_tiles(q, k_ref, v_ref, start=start, first=first, end=end,
                             block_k=block_k, qk_scale=qk_scale, carry=(acc0, m0, l0))
    plgpu.store(acc_ref, acc, mask=row_ok[:, None])
    plgpu.store(m_ref, m, mask=row_ok)
    plgpu.store(l_ref, l, mask=row_ok)


# ---------------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------------


def _validate(q, k_new, v_new, k_cache, v_cache, positions, sliding_window):
    op = "decode_attention_append"
    b, s, hkv, d = check_decode_inputs(op, q, k_cache, v_cache, "positions", positions,
                                       sliding_window, k_new=k_new, v_new=v_new)
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if x.shape != (b, hkv, d):
            raise ValueError(f"{op}: {name} must have shape [B, Hkv, D] = {(b, hkv, d)} "
                             f"(one token per sequence, the caches' KV heads), got "
                             f"{tuple(x.shape)}")
    # Concrete positions can be checked here; under jit the caller owns this check (an
    # out-of-range traced position writes nothing and its output is unspecified).
    if not isinstance(positions, jax.core.Tracer):
        pos = jax.device_get(positions)
        if pos.size and (pos.max() >= s or pos.min() < 0):
            raise ValueError(f"{op}: positions must lie in [0, {s}) (the cache holds {s} "
                             f"slots), got min {pos.min()} max {pos.max()}")


def decode_attention_append(q, k_new, v_new, k_cache, v_cache, positions, *,
                            sm_scale: float | None = None, sliding_window: int | None = None,
                            interpret: bool = False,
                            block_sizes: DecodeBlockSizes | None = None):
    """Write k_new / v_new [B, Hkv, D] at slot positions[b] of k/v_cache [B, S, Hkv, D], then
    attend q [B, Hq, D] (the token at positions[b]) to slots [0, positions[b]].

    Returns (out [B, Hq, D] in q's dtype, k_cache, v_cache). Equal to writing the slot and then
    `decode_attention(q, k_cache, v_cache, positions + 1, ...)`. With `sliding_window=w` only
    slots > positions[b] - w are seen (HF semantics). The caches are aliased to the outputs: to
    update them in place, call this inside a jit that donates them (the model's decode step);
    an eager call or a jit without donation copies each cache once first.
    """
    _validate(q, k_new, v_new, k_cache, v_cache, positions, sliding_window)
    d = q.shape[-1]
    check_head_dim("decode_attention_append", d)
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    blocks = block_sizes or DecodeBlockSizes()
    b, s, hkv, _ = k_cache.shape
    num_splits = blocks.num_splits or choose_num_splits(b, hkv, s, blocks.block_k)
    window = int(sliding_window) if sliding_window is not None else None
    return _decode_attention_append_triton(
        q, k_new, v_new, k_cache, v_cache, positions, sm_scale=sm_scale, blocks=blocks,
        num_splits=num_splits, window=window, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "blocks", "num_splits", "window",
                                             "interpret"))
def _decode_attention_append_triton(q, k_new, v_new, k_cache, v_cache, positions, *, sm_scale,
                                    blocks, num_splits, window, interpret):
    b, hq, d = q.shape
    _, s, hkv, _ = k_cache.shape
    g = hq // hkv
    gp = max(16, next_pow2(g))  # tl.dot needs >= 16 rows; the block covers them, loads mask
    block_k = blocks.block_k
    chunk = pl.cdiv(pl.cdiv(s, num_splits), block_k) * block_k
    num_splits = pl.cdiv(s, chunk)
    s_pad = num_splits * chunk  # cache blocks rounded up to whole chunks (rows >= s unread)
    qg = q.reshape(b, hkv, g, d)  # [B, Hkv, G, D]; a bitcast, no copy

    kernel = functools.partial(decode_attention_append_kernel, sm_scale=sm_scale, chunk=chunk,
                               block_k=block_k, window=window, groups=g, seq_len=s)
    head = pl.BlockSpec((None, None, d), lambda i, h, c: (i, h, 0))
    row = pl.BlockSpec((None, s_pad, None, d), lambda i, h, c: (i, 0, h, 0))
    acc, m, l, k_cache, v_cache = pl.pallas_call(
        kernel,
        grid=(b, hkv, num_splits),
        in_specs=[pl.BlockSpec((b,), lambda i, h, c: (0,)),
                  pl.BlockSpec((None, None, gp, d), lambda i, h, c: (i, h, 0, 0)),
                  head, head, row, row],
        out_specs=[pl.BlockSpec((None, None, None, gp, d), lambda i, h, c: (i, h, c, 0, 0)),
                   pl.BlockSpec((None, None, None, gp), lambda i, h, c: (i, h, c, 0)),
                   pl.BlockSpec((None, None, None, gp), lambda i, h, c: (i, h, c, 0)),
                   row, row],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, num_splits, g, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, num_splits, g), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, num_splits, g), jnp.float32),
                   jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        input_output_aliases={4: 3, 5: 4},  # k_cache -> output 3, v_cache -> output 4
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret,
        name="decode_attention_append",
    )(positions, qg, k_new, v_new, k_cache, v_cache)
    out = _merge_splits(acc, m, l).reshape(b, hq, d).astype(q.dtype)  # [B, Hq, D]
    return out, k_cache, v_cache


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def decode_attention_append_reference(q, k_new, v_new, k_cache, v_cache, positions, *,
                                      sm_scale: float | None = None,
                                      sliding_window: int | None = None,
                                      interpret: bool = False,
                                      block_sizes: DecodeBlockSizes | None = None):
    """Plain jnp: scatter the new K/V, then `decode_attention_reference` (interpret and
    block_sizes are ignored). Returns (out, k_cache, v_cache) like the kernel."""
    del interpret, block_sizes
    _validate(q, k_new, v_new, k_cache, v_cache, positions, sliding_window)
    rows = jnp.arange(q.shape[0])  # [B]
    k_cache = k_cache.at[rows, positions].set(k_new, mode="drop")  # [B, S, Hkv, D]
    v_cache = v_cache.at[rows, positions].set(v_new, mode="drop")
    out = decode_attention_reference(q, k_cache, v_cache, positions + 1, sm_scale=sm_scale,
                                     sliding_window=sliding_window)
    return out, k_cache, v_cache
