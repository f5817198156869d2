"""Absorbed MLA decode attention (DeepSeek-V2/V3): the queries against the latent KV cache.

With MLA a layer caches one latent row per token, latent = [c_KV (R) ; k_rope (Dr)]
(DeepSeek: R = kv_lora_rank 512, Dr = qk_rope_head_dim 64). Absorbing W_UK into the query
(q_lat = W_UK_h^T q_nope per head, the caller's matmul) makes every head's key the latent row
itself and every head's value its first R columns, so decode never rebuilds K/V:

    scores[t, h, s] = (q[t, h] . latent[s]) * sm_scale    for s < lengths[b] - (Tq - 1 - t)
    out[t, h]       = softmax(scores[t, h]) @ latent[:, :R]            (before W_UV)

The Tq new tokens are already in the cache (Tq > 1: speculative verification, chunked prefill).

Kernel: all query rows of a sequence (Tq x H, flattened t-major) share one latent tile. A
program loads a [block_s, R + Dr] tile once (as its R and Dr column pieces, Triton tiles being
powers of two), computes all its rows' scores with one tensor-core dot per piece, runs the
online softmax in float32 and accumulates P @ tile[:, :R] in float32. Split-K over S (as
decode_attention.py): each program walks one chunk and writes its partial output, max and sum;
XLA merges the chunks (a cache of <= 512 slots is one chunk, and the kernel writes the output
itself). For many heads (DeepSeek-V3's 128) the rows are cut into blocks of block_m, and R into
blocks of block_r, across programs, so the [block_m, block_r] float32 accumulator stays in
registers; the programs of one chunk then read its tiles from L2.

An int8 / fp8 latent cache (codes in `latent`, per token one scale for c_KV and one for k_rope,
latent_scale [B, S, 2], kv_quant.quantize_latent) is read as codes, each byte once: the tile is
converted to the query's dtype in registers (exactly), and the scales never touch the tile:

    scores[h, s] = (q_lat . codes_R[s]) * scale_R[s] + (q_rope . codes_Dr[s]) * scale_Dr[s]
    out[h]       = sum_s (p[h, s] * scale_R[s]) codes_R[s]

so each scale multiplies a score column, and c_KV's again the probabilities before P @ codes.

Paged (paged_mla_attention, the serving engine's pools): latent_pages [P, page_size, R + Dr]
(scales [P, page_size, 2]); logical slot i of row b at (block_tables[b, i // page_size],
i % page_size); query t sees the slots <= positions[b, t] (-1: a padding query, zeros). The
same kernel with per-query limits positions + 1 instead of lengths - (Tq - 1 - t), given the
whole pool as rows [P * page_size, R + Dr] and the row's table: a tile (block_s <= page_size,
so it lies in one page) is read at the row its page index, loaded from the table, gives
(paged_attention.py's pattern). Chunks run over W * page_size logical slots; a program's tiles
end at the last slot its queries see, so stale slots and the null page are never loaded.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (FLOAT_DTYPES, LOG2_E, MASK_VALUE, check_array, dot_f32,
                                     is_pow2, multiple_of, next_pow2, ref_precision)
from pallas_kernels._jax_private import is_tracer
from pallas_kernels.decode_attention import _merge_splits, choose_num_splits
from pallas_kernels.kv_quant import CODE_DTYPES, SCALE_DTYPES, codes_as, dequantize_latent

OP = "mla_decode_attention"
SMEM_BYTES = 232448  # shared memory one block may opt in to on Hopper (H100 / H200)


class MLATiling(NamedTuple):
    """MLABlockSizes resolved for one call's shapes (every field concrete)."""
    block_s: int
    block_m: int
    block_r: int
    chunk: int  # cache slots per split
    num_splits: int
    num_warps: int
    num_stages: int
    q_dtype_partials: bool


@dataclasses.dataclass(frozen=True)
class MLABlockSizes:
    """block_s: latent rows per tile (power of two >= 16). block_m: query rows (of Tq x H) per
    program (None: all of them rounded up to a power of two >= 16, at most 64, 32 for float32
    queries). block_r: output columns of R per program (None: R while block_m x R <= 64 x 256
    float32 accumulators, else 256); a block_r < R recomputes the scores once per column
    block. num_splits: chunks of the sequence axis (None: `choose_num_splits`, one for
    S <= 512). num_warps (None: 4, 8 past 16 x 512 accumulators); num_stages (None: by the
    latent's bytes per value, 4 for codes, 3 for 16-bit, 2 for float32: a stage holds a
    [block_s, R + Dr] tile in shared memory; fewer where they would not fit beside the query
    block). q_dtype_partials: each split writes its output normalized and rounded to q's
    dtype instead of unnormalized float32 (the max and sum stay float32; a no-op for float32
    queries): half the bytes of a partial (a float32 one, 16 rows x 512, is ~1/9 of the latent
    bytes a 256-slot chunk reads, written once and read back by the merge). Unmeasured defaults: benchmarks/mla.py's variants
    on the H200 are what should set them."""
    block_s: int = 32
    block_m: int | None = None
    block_r: int | None = None
    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    q_dtype_partials: bool = False

    def __post_init__(self):
        for name in ("block_s", "block_m", "block_r"):
            val = getattr(self, name)
            if val is not None and (not is_pow2(val) or val < 16):
                raise ValueError(f"MLABlockSizes.{name}={val}: must be a power of two >= 16")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"MLABlockSizes.num_splits={self.num_splits}: must be >= 1")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"MLABlockSizes.num_warps={self.num_warps}: must be a power of "
                             f"two <= 16")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"MLABlockSizes.num_stages={self.num_stages}: must be >= 1")

    def resolve(self, batch: int, rows: int, rank: int, seq_len: int, q_bytes: int = 2,
                latent_bytes: int = 2, rope_dim: int = 64) -> MLATiling:
        """The tiling for `rows` = Tq x H query rows of q_bytes per value, latent rank R and a
        cache of seq_len slots of latent_bytes per value (R + rope_dim columns)."""
        block_m = self.block_m or min(64 if q_bytes <= 2 else 32, max(16, next_pow2(rows)))
        block_r = self.block_r or (rank if block_m * rank <= 64 * 256 else min(rank, 256))
        if block_r > rank:
            raise ValueError(f"MLABlockSizes.block_r={block_r} exceeds the latent rank {rank}")
        programs = pl.cdiv(rows, block_m) * (rank // block_r)
        splits = self.num_splits or choose_num_splits(batch, programs, seq_len, self.block_s)
        chunk = pl.cdiv(pl.cdiv(seq_len, splits), self.block_s) * self.block_s
        warps = self.num_warps or (4 if block_m * block_r <= 16 * 512 else 8)
        stages = self.num_stages
        if stages is None:
            # Shared memory holds `stages` latent tiles (and the R block's own tile when
            # block_r < R) beside the query block: the default count drops until they fit
            # (3 stages at 48 rows, bf16, R 512 asked 233472 bytes of 232448 on the H200).
            tile = self.block_s * latent_bytes * (rank + rope_dim
                                                  + (block_r if block_r < rank else 0))
            q_tile = block_m * (rank + rope_dim) * q_bytes
            stages = {1: 4, 2: 3}.get(latent_bytes, 2)
            while stages > 1 and stages * tile + q_tile > SMEM_BYTES:
                stages -= 1
        return MLATiling(self.block_s, block_m, block_r, chunk, pl.cdiv(seq_len, chunk), warps,
                         stages, self.q_dtype_partials and q_bytes < 4)


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


def mla_decode_kernel(lim_ref, *refs, qk_scale: float, chunk: int, block_s: int, rank: int,
                      rope_dim: int, block_r: int, r_blocks: int, rows: int, heads: int,
                      tq: int, quantized: bool, split: bool, page_size: int | None = None):
    # Contiguous (page_size None):
    #   lim_ref [B] int32 (whole array; this program reads lengths[b])
    #   lat_ref [S_pad, R + Dr]: the sequence's latent rows (codes when quantized); slot i at
    #     row i; rows >= lengths[b] are never read
    # Paged (page_size given):
    #   lim_ref [Tq] int32: this sequence's positions (query t sees slots <= positions[t])
    #   bt_ref [W] int32: its block table
    #   lat_ref [P * page_size, R + Dr]: the whole page pool, slot i at row
    #     bt_ref[i // page_size] * page_size + i % page_size; slots past the largest position
    #     of this program's queries are never read (nor the null page they point at)
    # q_ref [block_m, R + Dr]: query rows (t-major over Tq x H) of one sequence; rows >= Tq x H
    #   lie past the array and are masked to zero on load
    # sc_ref [S_pad or P * page_size, 2] (quantized): the rows' scales, c_KV's then k_rope's,
    #   read at the codes' rows
    # split: acc_ref [block_m, block_r] (float32, or q's dtype normalized), m_ref, l_ref
    #   [block_m] (float32): this chunk's partials; else o_ref [block_m, block_r] in q's dtype
    paged = page_size is not None
    if paged:
        bt_ref, *refs = refs
    q_ref, lat_ref, *refs = refs
    if quantized:
        sc_ref, *refs = refs
    prog, b, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    i, j = prog // r_blocks, prog % r_blocks  # row block, R column block
    block_m = q_ref.shape[0]
    row = i * block_m + jnp.arange(block_m)  # [block_m] index into Tq x H
    row_ok = row < rows
    t = jnp.minimum(row // heads, tq - 1)  # [block_m] each row's query (rows past Tq x H: any)
    if paged:  # query t sees slots <= positions[t] (-1, a padding query: none)
        limit = plgpu.load(lim_ref.at[t], mask=row_ok, other=-1) + 1  # [block_m]
    else:  # slots < length - (Tq - 1 - t): the new tokens after it are in the cache too
        limit = lim_ref[b] - (tq - 1 - t)  # [block_m]
    # The chunk's tiles end at the last slot any of this program's rows sees (contiguous:
    # lengths[b] when the block holds query Tq - 1); no slot past it is loaded.
    start = c * chunk
    end = jnp.minimum(start + chunk, jnp.max(jnp.where(row_ok, limit, 0)))
    q_lat = plgpu.load(q_ref.at[:, pl.ds(0, rank)], mask=row_ok[:, None], other=0)  # [bm, R]
    q_rope = plgpu.load(q_ref.at[:, pl.ds(rank, rope_dim)], mask=row_ok[:, None],
                        other=0)  # [bm, Dr]
    dtype = q_lat.dtype
    col0 = multiple_of(j * block_r, block_r)
    fill = 0.0 if quantized else 0  # a masked load's fill: Triton casts no integer to fp8

    def tile(k, carry):
        acc, m, l = carry  # [bm, block_r], [bm], [bm] float32
        base = multiple_of(start + k * block_s, block_s)
        pos = base + jnp.arange(block_s)  # [block_s] logical slot
        in_chunk = pos < end
        if paged:  # block_s <= page_size (both powers of two): the tile lies in one page
            at = bt_ref[base // page_size] * page_size + base % page_size
            at = multiple_of(at, block_s)
        else:
            at = base
        lat = plgpu.load(lat_ref.at[pl.ds(at, block_s), pl.ds(0, rank)],
                         mask=in_chunk[:, None], other=fill)  # [block_s, R]
        rope = plgpu.load(lat_ref.at[pl.ds(at, block_s), pl.ds(rank, rope_dim)],
                          mask=in_chunk[:, None], other=fill)  # [block_s, Dr]
        if block_r == rank:
            val = lat
        else:  # this program's R columns: a second read of the tile (from L1/L2)
            val = plgpu.load(lat_ref.at[pl.ds(at, block_s), pl.ds(col0, block_r)],
                             mask=in_chunk[:, None], other=fill)  # [block_s, block_r]
        if quantized:
            lat, rope, val = (codes_as(x, dtype) for x in (lat, rope, val))
        s_lat = dot_f32(q_lat, lat, trans_b=True)  # [bm, block_s]
        s_rope = dot_f32(q_rope, rope, trans_b=True)  # [bm, block_s]
        if quantized:  # the codes' scores column-scaled: each part by its own scale
            scale, scale_rope = (plgpu.load(sc_ref.at[pl.ds(at, block_s), jnp.int32(part)],
                                            mask=in_chunk, other=0.0).astype(jnp.float32)
                                 for part in (0, 1))  # [block_s] each
            s = s_lat * scale[None, :] + s_rope * scale_rope[None, :]
        else:
            s = s_lat + s_rope
        visible = in_chunk[None, :] & (pos[None, :] < limit[:, None])  # [bm, block_s]
        s = jnp.where(visible, s * qk_scale, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp2(m - m_new)
        # Zeroed where hidden: a row that sees no slot of this chunk (query t < Tq - 1 of a
        # chunk past its limit) keeps l = 0, acc = 0 instead of exp2(0) = 1 per hidden slot.
        p = jnp.where(visible, jnp.exp2(s - m_new[:, None]), 0.0)  # [bm, block_s]
        l = l * alpha + jnp.sum(p, axis=-1)
        if quantized:  # c_KV's scale folded into p: P @ codes is the dequantized product
            p = p * scale[None, :]
        acc = acc * alpha[:, None] + dot_f32(p.astype(dtype), val)
        return acc, m_new, l

    carry = (jnp.zeros((block_m, block_r), jnp.float32),
             jnp.full((block_m,), MASK_VALUE, jnp.float32), jnp.zeros((block_m,), jnp.float32))
    acc, m, l = lax.fori_loop(0, pl.cdiv(jnp.maximum(end - start, 0), block_s), tile, carry)
    if split:
        acc_ref, m_ref, l_ref = refs
        if acc_ref.dtype != jnp.float32:  # q_dtype_partials: this chunk's normalized output
            acc = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(acc_ref.dtype)
        plgpu.store(acc_ref, acc, mask=row_ok[:, None])
        plgpu.store(m_ref, m, mask=row_ok)
        plgpu.store(l_ref, l, mask=row_ok)
    else:
        (o_ref,) = refs
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]  # a row seeing no slot: zeros
        plgpu.store(o_ref, out.astype(o_ref.dtype), mask=row_ok[:, None])


# ---------------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------------


def _check_latent(op: str, name: str, q, latent, latent_scale, scale_shape: tuple,
                  scale_dims: str, sm_scale, rope_dim) -> int:
    """Both forms' rope_dim (-> int), dtypes (the latent's q's, or codes with scales of
    scale_shape, named scale_dims) and sm_scale."""
    d = q.shape[-1]
    rope_dim = int(rope_dim)
    if not 0 <= rope_dim < d:
        raise ValueError(f"{op}: rope_dim={rope_dim} must lie in [0, {d}) (q's last dim "
                         f"{d} = R + Dr)")
    if latent_scale is None:
        if latent.dtype != q.dtype:
            raise ValueError(f"{op}: q {q.dtype} and {name} {latent.dtype} must share one "
                             f"dtype (or pass latent_scale with int8 / fp8 codes)")
    else:
        if tuple(getattr(latent_scale, "shape", ())) != scale_shape:
            raise ValueError(f"{op}: latent_scale must be {scale_dims} = {scale_shape} (per "
                             f"token c_KV's and k_rope's scale, kv_quant.quantize_latent), "
                             f"got {tuple(getattr(latent_scale, 'shape', ()))}")
        if jnp.dtype(latent_scale.dtype) not in SCALE_DTYPES:
            raise ValueError(f"{op}: latent_scale has dtype {latent_scale.dtype}, expected "
                             f"float32 or float16")
    if sm_scale is None or not float(sm_scale) > 0:
        raise ValueError(f"{op}: sm_scale must be a positive number, got {sm_scale}")
    return rope_dim


def _validate(q, latent, lengths, sm_scale, latent_scale, rope_dim) -> tuple[int, int]:
    """Shapes, dtypes and lengths (when concrete); returns (R, Dr)."""
    check_array(OP, "q", q, 4)
    b, tq, h, d = q.shape
    dtypes = CODE_DTYPES if latent_scale is not None else FLOAT_DTYPES
    check_array(OP, "latent", latent, 3, dtypes)
    check_array(OP, "lengths", lengths, 1, dtypes=(jnp.dtype(jnp.int32),))
    bl, s, dl = latent.shape
    if bl != b or lengths.shape[0] != b:
        raise ValueError(f"{OP}: batch sizes differ: q {b}, latent {bl}, lengths "
                         f"{lengths.shape[0]}")
    if dl != d:
        raise ValueError(f"{OP}: q's last dim ({d}) and latent's ({dl}) must both be R + Dr")
    if tq < 1 or h < 1 or s < 1:
        raise ValueError(f"{OP}: empty input: q {tuple(q.shape)}, latent {tuple(latent.shape)}")
    rope_dim = _check_latent(OP, "latent", q, latent, latent_scale, (b, s, 2), "[B, S, 2]",
                             sm_scale, rope_dim)
    if not is_tracer(lengths):  # under jit the caller owns this check
        lens = jax.device_get(lengths)
        if lens.size and (lens.max() > s or lens.min() < 0):
            raise ValueError(f"{OP}: lengths must lie in [0, {s}] (the cache holds {s} "
                             f"slots), got min {lens.min()} max {lens.max()}")
    return d - rope_dim, rope_dim


def mla_decode_attention(q, latent, lengths, *, sm_scale: float, interpret: bool = False,
                         block_sizes: MLABlockSizes | None = None, latent_scale=None,
                         rope_dim: int = 64):
    """q [B, Tq, H, R + Dr] (the absorbed queries: W_UK-folded q_nope, then q_rope) against
    latent [B, S, R + Dr] (c_KV, then k_rope) at slots < lengths[b] - (Tq - 1 - t) for query t
    (lengths [B] int32 in [0, S]; a query that sees no slot gets zeros). rope_dim = Dr
    (DeepSeek-V2/V3: 64). latent_scale [B, S, 2] (float32 / float16): latent holds int8 / fp8
    codes, value = code * scale (latent_scale[..., 0] for the first R columns, [..., 1] for
    the last Dr: kv_quant.quantize_latent). Returns softmax(q . latent * sm_scale) @ latent[..., :R]
    [B, Tq, H, R] in q's dtype (float32 softmax statistics)."""
    rank, rope_dim = _validate(q, latent, lengths, sm_scale, latent_scale, rope_dim)
    _check_tileable(OP, rank, rope_dim)
    b, tq, h, _ = q.shape
    tiling = (block_sizes or MLABlockSizes()).resolve(
        b, tq * h, rank, latent.shape[1], jnp.dtype(q.dtype).itemsize,
        jnp.dtype(latent.dtype).itemsize, rope_dim)
    return _mla_triton(q, latent, lengths, latent_scale, qk_scale=float(sm_scale) * LOG2_E,
                       rank=rank, tiling=tiling, interpret=interpret)


def _check_tileable(op: str, rank: int, rope_dim: int) -> None:
    """R and Dr as the kernel tiles them (each a power of two in [16, 1024])."""
    for name, val in (("R (latent rank)", rank), ("Dr (rope_dim)", rope_dim)):
        if not is_pow2(val) or not 16 <= val <= 1024:
            raise ValueError(f"{op}: {name} = {val} cannot be tiled by the Pallas kernel "
                             f"(need a power of two in [16, 1024]); use {op}_reference")


@functools.partial(jax.jit, static_argnames=("qk_scale", "rank", "tiling", "interpret"))
def _mla_triton(q, latent, limits, latent_scale, block_tables=None, *, qk_scale, rank,
                tiling: MLATiling, interpret):
    # Contiguous: latent [B, S, R + Dr] (scales [B, S, 2]), limits = lengths [B].
    # Paged (block_tables [B, W] given): latent the pool [P, page_size, R + Dr] (scales
    # [P, page_size, 2]), limits = positions [B, Tq]; tiling.block_s <= page_size.
    b, tq, h, d = q.shape
    block_m, block_r, chunk, num_splits = (tiling.block_m, tiling.block_r, tiling.chunk,
                                           tiling.num_splits)
    rows = tq * h
    m_blocks, r_blocks = pl.cdiv(rows, block_m), rank // block_r
    quantized = latent_scale is not None
    split = num_splits > 1
    paged = block_tables is not None
    page_size = latent.shape[1] if paged else None
    kernel = functools.partial(
        mla_decode_kernel, qk_scale=qk_scale, chunk=chunk, block_s=tiling.block_s, rank=rank,
        rope_dim=d - rank, block_r=block_r, r_blocks=r_blocks, rows=rows, heads=h, tq=tq,
        quantized=quantized, split=split, page_size=page_size)
    # Grid (row block x R block, sequence, chunk): the programs sharing a chunk's latent tiles
    # are adjacent in launch order (axis 0 varies fastest), so their reads meet in L2.
    q_spec = pl.BlockSpec((None, block_m, d), lambda p, i, c: (i, p // r_blocks, 0))
    q = q.reshape(b, rows, d)  # [B, Tq x H, R + Dr]: a bitcast
    if paged:
        # The row's positions and block table; the whole pool as rows [P * page_size, R + Dr]
        # (a bitcast), each tile read at the row its page index gives.
        pool_rows = latent.shape[0] * page_size
        in_specs = [pl.BlockSpec((None, tq), lambda p, i, c: (i, 0)),
                    pl.BlockSpec((None, block_tables.shape[1]), lambda p, i, c: (i, 0)),
                    q_spec, pl.BlockSpec((pool_rows, d), lambda p, i, c: (0, 0))]
        args = [limits, block_tables, q, latent.reshape(pool_rows, d)]
        if quantized:
            in_specs.append(pl.BlockSpec((pool_rows, 2), lambda p, i, c: (0, 0)))
            args.append(latent_scale.reshape(pool_rows, 2))
    else:
        s_pad = num_splits * chunk  # whole chunks (slots >= S are masked, never read)
        in_specs = [pl.BlockSpec((b,), lambda p, i, c: (0,)), q_spec,
                    pl.BlockSpec((None, s_pad, d), lambda p, i, c: (i, 0, 0))]
        args = [limits, q, latent]
        if quantized:
            in_specs.append(pl.BlockSpec((None, s_pad, 2), lambda p, i, c: (i, 0, 0)))
            args.append(latent_scale)
    row_block = lambda p, i, c: (i, c, p // r_blocks)  # noqa: E731
    if split:
        out_specs = [pl.BlockSpec((None, None, block_m, block_r),
                                  lambda p, i, c: (i, c, p // r_blocks, p % r_blocks)),
                     pl.BlockSpec((None, None, block_m), row_block),
                     pl.BlockSpec((None, None, block_m), row_block)]
        acc_dtype = q.dtype if tiling.q_dtype_partials else jnp.float32
        out_shape = [jax.ShapeDtypeStruct((b, num_splits, rows, rank), acc_dtype),
                     jax.ShapeDtypeStruct((b, num_splits, rows), jnp.float32),
                     jax.ShapeDtypeStruct((b, num_splits, rows), jnp.float32)]
    else:
        out_specs = pl.BlockSpec((None, block_m, block_r),
                                 lambda p, i, c: (i, p // r_blocks, p % r_blocks))
        out_shape = jax.ShapeDtypeStruct((b, rows, rank), q.dtype)
    out = pl.pallas_call(
        kernel,
        grid=(m_blocks * r_blocks, b, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps,
                                             num_stages=tiling.num_stages),
        interpret=interpret,
        name=(PAGED_OP if paged else OP) + ("_quantized" if quantized else ""),
    )(*args)
    if split:  # the R blocks of a row wrote the same m and l (one computation of the scores)
        acc, m, l = out
        if tiling.q_dtype_partials:  # back to unnormalized float32 (fused into the merge)
            acc = acc.astype(jnp.float32) * l[..., None]
        out = _merge_splits(acc[:, None], m[:, None], l[:, None])[:, 0]  # [B, rows, R] f32
    return out.reshape(b, tq, h, rank).astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def mla_decode_attention_reference(q, latent, lengths, *, sm_scale: float,
                                   interpret: bool = False, block_sizes=None, latent_scale=None,
                                   rope_dim: int = 64):
    """Plain jnp with the same signature (interpret and block_sizes are ignored); a quantized
    latent is dequantized to float32 first (then the float math)."""
    del interpret, block_sizes
    rank, _ = _validate(q, latent, lengths, sm_scale, latent_scale, rope_dim)
    tq, s = q.shape[1], latent.shape[1]
    limit = lengths[:, None] - (tq - 1 - jnp.arange(tq))[None, :]  # [B, Tq]
    visible = jnp.arange(s)[None, None, :] < limit[:, :, None]  # [B, Tq, S]
    return _latent_attention(q, latent, latent_scale, visible, rank, sm_scale)


def _latent_attention(q, latent, latent_scale, visible, rank: int, sm_scale: float):
    """The references' math: q [B, Tq, H, R + Dr] over latent [B, S, R + Dr] (codes with
    latent_scale [B, S, 2]: dequantized to float32 first) at the slots visible [B, Tq, S]."""
    if latent_scale is not None:
        latent = dequantize_latent(latent, latent_scale, rank)  # [B, S, R + Dr] float32
        precision = ref_precision(jnp.float32)
    else:
        precision = ref_precision(q.dtype)
    scores = jnp.einsum("bthd,bsd->bths", q, latent, preferred_element_type=jnp.float32,
                        precision=precision) * sm_scale  # [B, Tq, H, S]
    scores = jnp.where(visible[:, :, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)  # no visible slot: zeros
    o = jnp.einsum("bths,bsr->bthr", p.astype(latent.dtype), latent[..., :rank],
                   preferred_element_type=jnp.float32, precision=precision)
    return o.astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# Paged: the serving engine's latent page pools
# ---------------------------------------------------------------------------------------------

PAGED_OP = "paged_mla_attention"


def _validate_paged(q, latent_pages, block_tables, positions, sm_scale, latent_scale,
                    rope_dim) -> tuple[int, int]:
    """Shapes and dtypes of the paged form (block tables' entries when concrete); -> (R, Dr)."""
    op = PAGED_OP
    check_array(op, "q", q, 4)
    b, tq, h, d = q.shape
    dtypes = CODE_DTYPES if latent_scale is not None else FLOAT_DTYPES
    check_array(op, "latent_pages", latent_pages, 3, dtypes)
    check_array(op, "block_tables", block_tables, 2, dtypes=(jnp.dtype(jnp.int32),))
    check_array(op, "positions", positions, 2, dtypes=(jnp.dtype(jnp.int32),))
    pages, page_size, dl = latent_pages.shape
    if block_tables.shape[0] != b or tuple(positions.shape) != (b, tq):
        raise ValueError(f"{op}: block_tables {tuple(block_tables.shape)} must be [B, W] and "
                         f"positions {tuple(positions.shape)} [B, Tq] = {(b, tq)} for q "
                         f"{tuple(q.shape)}")
    if not is_pow2(page_size):
        raise ValueError(f"{op}: page_size {page_size} (latent_pages [P, page_size, R + Dr]) "
                         f"must be a power of two")
    if dl != d:
        raise ValueError(f"{op}: q's last dim ({d}) and latent_pages' ({dl}) must both be "
                         f"R + Dr")
    rope_dim = _check_latent(op, "latent_pages", q, latent_pages, latent_scale,
                             (pages, page_size, 2), "[P, page_size, 2]", sm_scale, rope_dim)
    if not is_tracer(block_tables) and block_tables.size:
        bt = jax.device_get(block_tables)
        if bt.min() < 0 or bt.max() >= pages:
            raise ValueError(f"{op}: block_tables entries must lie in [0, {pages}) (the pool "
                             f"holds {pages} pages), got min {bt.min()} max {bt.max()}")
    if not is_tracer(positions) and positions.size:
        pos = jax.device_get(positions)
        slots = block_tables.shape[1] * page_size
        if pos.min() < -1 or pos.max() >= slots:
            raise ValueError(f"{op}: positions must lie in [-1, {slots}) (-1: a padding query; "
                             f"the tables hold {slots} slots), got min {pos.min()} max "
                             f"{pos.max()}")
    return d - rope_dim, rope_dim


def paged_mla_attention(q, latent_pages, block_tables, positions, *, sm_scale: float,
                        interpret: bool = False, block_sizes: MLABlockSizes | None = None,
                        latent_scale=None, rope_dim: int = 64):
    """mla_decode_attention over a paged latent: q [B, Tq, H, R + Dr] against latent_pages
    [P, page_size, R + Dr] (or int8 / fp8 codes with latent_scale [P, page_size, 2]); logical
    slot i of row b lives at (block_tables[b, i // page_size], i % page_size) (block_tables
    [B, W] int32). Query t of row b sees the slots <= positions[b, t] ([B, Tq] int32 in
    [-1, W * page_size); -1: a padding query, zeros). Returns [B, Tq, H, R] in q's dtype.
    The contiguous kernel reading each tile through the table: block_sizes as its, block_s
    clamped to page_size (a tile then lies in one page), chunks over W * page_size slots;
    slots past a row's largest position (and the null page) are never read."""
    rank, rope_dim = _validate_paged(q, latent_pages, block_tables, positions, sm_scale,
                                     latent_scale, rope_dim)
    _check_tileable(PAGED_OP, rank, rope_dim)
    b, tq, h, _ = q.shape
    page_size = latent_pages.shape[1]
    if page_size < 16:  # a tile lies in one page, and a tile is >= 16 rows (tensor cores)
        raise ValueError(f"{PAGED_OP}: page_size {page_size} must be >= 16 for the kernel; "
                         f"use paged_mla_attention_reference")
    blocks = block_sizes or MLABlockSizes()
    if blocks.block_s > page_size:
        blocks = dataclasses.replace(blocks, block_s=page_size)
    tiling = blocks.resolve(b, tq * h, rank, block_tables.shape[1] * page_size,
                            jnp.dtype(q.dtype).itemsize, jnp.dtype(latent_pages.dtype).itemsize,
                            rope_dim)
    return _mla_triton(q, latent_pages, positions, latent_scale, block_tables,
                       qk_scale=float(sm_scale) * LOG2_E, rank=rank, tiling=tiling,
                       interpret=interpret)


def paged_mla_attention_reference(q, latent_pages, block_tables, positions, *,
                                  sm_scale: float, interpret: bool = False, block_sizes=None,
                                  latent_scale=None, rope_dim: int = 64):
    """The absorbed queries q [B, Tq, H, R + Dr] against a paged latent: latent_pages
    [P, page_size, R + Dr] (or codes with latent_scale [P, page_size, 2]); logical slot i of
    row b lives at (block_tables[b, i // page_size], i % page_size). Query t of row b sees the
    slots <= positions[b, t] (its own token's, written before the call, and every earlier
    one); position -1 is a padding query (zeros). -> [B, Tq, H, R] in q's dtype. Plain jnp:
    the rows' pages gathered end to end (interpret and block_sizes are ignored)."""
    del interpret, block_sizes
    rank, _ = _validate_paged(q, latent_pages, block_tables, positions, sm_scale,
                              latent_scale, rope_dim)
    b, w = block_tables.shape

    def rows(pool):  # [P, page_size, ...] -> [B, W * page_size, ...]
        return pool[block_tables].reshape(b, w * pool.shape[1], *pool.shape[2:])
    latent = rows(latent_pages)
    scale = None if latent_scale is None else rows(latent_scale)
    slots = jnp.arange(latent.shape[1])
    visible = slots[None, None, :] <= positions[:, :, None]  # [B, Tq, W * page_size]
    return _latent_attention(q, latent, scale, visible, rank, sm_scale)
