"""int4 decode matmul where one load of a byte tile feeds both K tiles packed in it.

    int4_matmul(x, qw, blocks=Int4Blocks(...), interpret=)   x [M, K] @ dequantize(qw) -> [M, N]
    int4_matmul_reference(x, qw)                              the same in float32 jnp

Not wired into the model ops: a design under test (benchmarks/quant_designs.py).

The weight is the QuantizedWeight layout as it is (pallas_kernels/quantized.py), one 4-bit
plane, symmetric (no offset, no super scales): the plane [U * tile, N] uint8 holds, in its byte
unit u (rows u * tile .. u * tile + tile - 1), K tile 2u in the low nibbles and K tile 2u + 1 in
the high nibbles; scale [G, N] has one row per group (a multiple of tile); w = s * (c -
code_offset). The fused kernel of norm_matmul.py walks K tile by tile and so loads each byte
tile twice (once per nibble). Here a program walks byte units instead. Per unit it issues one
[tile, block_n] byte load, the two scale rows [1, block_n] of tiles 2u and 2u + 1 and the two x
tiles, and it spends them on two K tiles:

    acc += s[2u] * (x[:, K tile 2u] @ (lo - off)) + s[2u + 1] * (x[:, K tile 2u + 1] @ (hi - off))

The codes are exact in x's dtype, so each dot is exact up to float32 accumulation and the
scale multiplies the float32 dot (as quantized.tile_dot does).

Latency: each step's operands are loaded `depth` units ahead by hand, in the fori_loop carry.
Triton's pipeliner leaves loads that feed elementwise math in place, so it would not do this.
Loads past the chunk's last unit are clamped to that unit and never used. Grid (M tiles, N
tiles, split): split > 1 gives each program a chunk of the units. Its float32 partial sums
[split, M, N] are summed by XLA in chunk order.

mode="fma" (M = 1 only) uses no tensor core: x[k] * s * c accumulates into a float32
[tile, block_n] register tile, reduced over K once after the loop.
Any M, K, N: rows past M, columns past N and K positions past K are masked (x reads zero there,
so the zero codes of the plane's padding rows add nothing).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import NUM_SMS_H200, dot_f32, sum_chunks
from pallas_kernels.quantized import QuantizedWeight, check_quantized, dequantize


@dataclasses.dataclass(frozen=True)
class Int4Blocks:
    block_n: int = 64  # columns per program (a power of two >= 16)
    block_m: int = 16  # rows of x per program (the dot's M; M = 1 broadcasts one row)
    split_k: int = 0  # K chunks (programs along K); 0: enough programs to fill the SMs
    depth: int = 2  # byte units loaded ahead of the one being multiplied (1..4)
    mode: str = "dot"  # "dot": two tensor-core dots per unit; "fma": M = 1 FMAs, no dot
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_n", "block_m"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Int4Blocks.{name}={v}: must be a power of two >= 16")
        if not 1 <= self.depth <= 4:
            raise ValueError(f"Int4Blocks.depth={self.depth}: 1..4")
        if self.mode not in ("dot", "fma"):
            raise ValueError(f"Int4Blocks.mode={self.mode!r}: 'dot' or 'fma'")
        if self.split_k < 0:
            raise ValueError(f"Int4Blocks.split_k={self.split_k}: >= 0 (0: auto)")


def check_int4(op: str, qw, k: int) -> None:
    """Raise ValueError unless qw is a symmetric one-plane 4-bit QuantizedWeight with K = k."""
    check_quantized(op, qw, k)
    if (qw.bits != (4,) or qw.offset is not None or qw.super_scale is not None
            or qw.float8):
        raise ValueError(f"{op}: needs a symmetric int4 weight (one 4-bit plane, no offset or "
                         f"super scales), got {qw.name} bits={qw.bits}")


def _split(units: int, tiles: int, blocks: Int4Blocks) -> tuple[int, int]:
    """(split, units per chunk): the K chunks of the grid (auto: about one program per SM)."""
    split = blocks.split_k or max(1, -(-(NUM_SMS_H200 - 8) // tiles))
    split = max(1, min(split, units))
    upc = -(-units // split)
    return -(-units // upc), upc


def _kernel(x_ref, p_ref, s_ref, o_ref, *, m: int, n: int, k: int, tile: int, group: int,
            groups: int, units: int, upc: int, split: int, bm: int, bn: int, depth: int,
            mode: str, code_offset: int):
    # x_ref [bm, Kp] (this program's rows of x; Kp = split * upc * 2 * tile >= K)
    # p_ref [split * upc * tile, bn] uint8 (the plane's column band; rows past U * tile
    #        are never read: loads clamp to the chunk's last unit)
    # s_ref [G, bn] (the scale band)
    # o_ref [bm, bn] in out dtype (split 1) or float32 [bm, bn] (this chunk's partial sums)
    u_first = pl.program_id(2) * upc
    u_last = jnp.minimum(u_first + upc, units) - 1  # the chunk's last unit
    rows = pl.program_id(0) * bm + jnp.arange(bm)
    cols = pl.program_id(1) * bn + jnp.arange(bn)
    row_ok = (rows < m)[:, None] if m % bm else None  # [bm, 1]
    col_ok = (cols < n)[None, :] if n % bn else None  # [1, bn]
    ragged_k = 2 * units * tile != k  # K positions past K inside the last unit
    ragged_chunks = split * upc != units  # the last chunk has steps past the last unit
    one_row = m == 1

    def load(ref, mask):
        return ref[...] if mask is None else plgpu.load(ref, mask=mask, other=0)

    def both(a, b):
        return b if a is None else (a if b is None else a & b)

    def x_tile(start, live):
        # x at K offsets start .. start + tile - 1: [1, tile] at M = 1 ([tile, 1] in fma
        # mode), else [bm, tile]; zero past K and, where `live` is False, everywhere.
        k_ok = start + jnp.arange(tile) < k if ragged_k else None  # [tile]
        if live is not None:
            k_ok = both(k_ok, jnp.broadcast_to(live, (tile,)))
        if one_row:
            x = load(x_ref.at[pl.ds(0, 1), pl.ds(start, tile)],
                     None if k_ok is None else k_ok[None, :])  # [1, tile]
            return x.T if mode == "fma" else x
        return load(x_ref.at[:, pl.ds(start, tile)],
                    both(row_ok, None if k_ok is None else k_ok[None, :]))  # [bm, tile]

    def fetch(u):
        # Unit u's operands, all issued together: the byte tile [tile, bn], the scale rows of
        # K tiles 2u and 2u + 1 ([1, bn] each) and their x tiles. u past the chunk's last unit
        # reads that unit again (in bounds, never multiplied; x zeroed where it could be).
        live = (u <= u_last) if ragged_chunks else None
        u = jnp.minimum(u, u_last)
        row0 = u * 2 * tile  # K row of the low nibbles' tile
        byte_mask = None if col_ok is None else jnp.broadcast_to(col_ok, (tile, bn))
        codes = load(p_ref.at[pl.ds(pl.multiple_of(u * tile, tile), tile), :], byte_mask)
        g_lo = jnp.minimum(row0 // group, groups - 1)
        g_hi = jnp.minimum((row0 + tile) // group, groups - 1)
        s_lo = load(s_ref.at[pl.ds(g_lo, 1), :], col_ok)
        s_hi = load(s_ref.at[pl.ds(g_hi, 1), :], col_ok)
        return (codes, s_lo, s_hi, x_tile(row0, live), x_tile(row0 + tile, live))

    def nibbles(codes):
        # [tile, bn] uint8 -> the low and high nibbles' codes minus the offset (int32)
        v = codes.astype(jnp.int32)
        return (v & 15) - code_offset, (v >> 4) - code_offset

    def consume_dot(raw, acc):
        codes, s_lo, s_hi, x_lo, x_hi = raw
        lo, hi = nibbles(codes)
        if one_row:  # the dot's rows: one real row, broadcast
            x_lo = jnp.broadcast_to(x_lo, (bm, tile))
            x_hi = jnp.broadcast_to(x_hi, (bm, tile))
        d_lo = dot_f32(x_lo, lo.astype(x_lo.dtype))  # [bm, bn] float32, exact codes
        d_hi = dot_f32(x_hi, hi.astype(x_hi.dtype))
        return acc + d_lo * s_lo.astype(jnp.float32) + d_hi * s_hi.astype(jnp.float32)

    def consume_fma(raw, acc):
        # acc [tile, bn] float32: per K row and column, x * s * c summed over the units.
        codes, s_lo, s_hi, x_lo, x_hi = raw
        lo, hi = nibbles(codes)
        w_lo = lo.astype(jnp.float32) * s_lo.astype(jnp.float32)
        w_hi = hi.astype(jnp.float32) * s_hi.astype(jnp.float32)
        return acc + x_lo.astype(jnp.float32) * w_lo + x_hi.astype(jnp.float32) * w_hi

    consume = consume_fma if mode == "fma" else consume_dot

    def step(j, carry):
        acc, pending = carry
        # Issue the loads of unit j + depth before multiplying unit j.
        ahead = fetch(u_first + j + depth)
        acc = consume(pending[0], acc)
        return acc, (*pending[1:], ahead)

    acc0 = jnp.zeros((tile, bn) if mode == "fma" else (bm, bn), jnp.float32)
    pending0 = tuple(fetch(u_first + d) for d in range(depth))
    acc, _ = jax.lax.fori_loop(0, upc, step, (acc0, pending0))
    if mode == "fma":  # [1, bn]: the one row
        out = jnp.sum(acc, axis=0, keepdims=True)
        plgpu.store(o_ref.at[pl.ds(0, 1), :], out.astype(o_ref.dtype), mask=col_ok)
        return
    plgpu.store(o_ref, acc.astype(o_ref.dtype), mask=both(row_ok, col_ok))


@functools.partial(jax.jit, static_argnames=("qfmt", "blocks", "interpret", "out_dtype"))
def _int4_matmul(x, plane, scale, *, qfmt, blocks: Int4Blocks, interpret: bool, out_dtype):
    k, tile, group, code_offset = qfmt
    m = x.shape[0]
    n = plane.shape[1]
    groups = scale.shape[0]
    units = plane.shape[0] // tile
    bm, bn = blocks.block_m, blocks.block_n
    m_tiles, n_tiles = pl.cdiv(m, bm), pl.cdiv(n, bn)
    split, upc = _split(units, m_tiles * n_tiles, blocks)
    kp = split * upc * 2 * tile
    if split > 1:
        out_specs = pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j))
        out_shape = jax.ShapeDtypeStruct((split, m, n), jnp.float32)
    else:
        out_specs = pl.BlockSpec((bm, bn), lambda i, j, s: (i, j))
        out_shape = jax.ShapeDtypeStruct((m, n), out_dtype)
    kernel = functools.partial(
        _kernel, m=m, n=n, k=k, tile=tile, group=group, groups=groups, units=units, upc=upc,
        split=split, bm=bm, bn=bn, depth=blocks.depth, mode=blocks.mode,
        code_offset=code_offset)
    out = pl.pallas_call(
        kernel,
        grid=(m_tiles, n_tiles, split),
        in_specs=[pl.BlockSpec((bm, kp), lambda i, j, s: (i, 0)),
                  pl.BlockSpec((split * upc * tile, bn), lambda i, j, s: (0, j)),
                  pl.BlockSpec((groups, bn), lambda i, j, s: (0, j))],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret,
        name=f"int4_pair_{blocks.mode}_k{k}_n{n}" + (f"_split{split}" if split > 1 else ""),
    )(x, plane, scale)
    if split > 1:
        out = sum_chunks(out).astype(out_dtype)
    return out


def int4_matmul(x, qw: QuantizedWeight, *, blocks: Int4Blocks | None = None,
                out_dtype=None, interpret: bool = False):
    """x [M, K] @ dequantize(qw) [K, *N] -> [M, *N] in out_dtype (default x's dtype), float32
    accumulation; qw a symmetric int4 QuantizedWeight (quantize_weight(bits=4)), any group
    that is a multiple of its tile. blocks.mode="fma" needs M = 1."""
    if getattr(x, "ndim", 0) != 2:
        raise ValueError(f"int4_matmul: x must be [M, K], got {getattr(x, 'shape', x)}")
    check_int4("int4_matmul", qw, x.shape[1])
    blocks = blocks or Int4Blocks()
    if blocks.mode == "fma" and x.shape[0] != 1:
        raise ValueError(f"int4_matmul: mode='fma' is for M = 1, got M={x.shape[0]}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    plane = qw.planes[0].reshape(qw.planes[0].shape[0], qw.n)
    scale = qw.scale.reshape(qw.scale.shape[0], qw.n)
    out = _int4_matmul(x, plane, scale, qfmt=(qw.k, qw.tile, qw.group, qw.code_offset),
                       blocks=blocks, interpret=interpret, out_dtype=out_dtype.name)
    return out.reshape(x.shape[0], *qw.out_shape)


def int4_matmul_reference(x, qw: QuantizedWeight, out_dtype=jnp.float32):
    """x @ dequantize(qw) in float32 (IEEE), cast to out_dtype."""
    w = dequantize(qw, jnp.float32).reshape(qw.k, qw.n)
    y = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return y.reshape(x.shape[0], *qw.out_shape).astype(out_dtype)
