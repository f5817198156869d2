"""Quantized decode matmul for Hopper on the Pallas Mosaic GPU backend.

    y [M, N] = x [M, K] @ w,   w[k, n] = s[g, n] * c[n, k] + o[g, n]    g = k // group

codes c [N, K] int4 (4-bit codes), int8 (5- to 8-bit codes) or fp8 e4m3, in groups of 16, 32,
64 or 128 (int4 from 32); s a scale per group (float, or int8 / uint8 sub-scales times float
super-scales per super-group: the K-quants), o an optional offset per group (float, or uint8
sub-mins times -super-offsets), plus code_shift * s where the stored codes are centred (Q4_1's
0..15 kept as int4 c - 8: s * (c - 8 + 8) + o). GGUF's Q4_0 ... Q6_K and our int4 / int8 / fp8
all fit (pallas_kernels/quantized.py's "nk" layout, `to_nk`).

Swapped operands: the weight is wgmma's A operand (its N rows are the MMA's M side, 64 per
block) and x^T its B operand (M <= 64 rows padded to a multiple of 8 are the MMA's N side),
so one decode row costs an m64n8 product, not an m64 tile of padding. Per K step of `gps`
* 128: TMA brings the [64, gps * 128] code tile (K contiguous per output column), x's
[Mp, gps * 128] tile and the groups' scale rows (offset rows, super rows, x's group sums) into
shared memory; the block's one warpgroup loads each group's codes in the upcast layout (or
128 codes at a time, sliced per group in registers: `wide`) and converts them to bf16 (exact;
int4: Mosaic's lop3 path, two codes per instruction), issues one wgmma per group with A from
registers into a fresh float32 accumulator, waits once per `batch` groups, and adds each group's product times its scales (a row each, computed in float32 from
the compact arrays as `dequantize` does) to the running sum in registers, plus the offsets
(a row) times x's sums over the group (X [G, Mp], reduced by XLA before the launch; a column),
while `plgpu.emit_pipeline` keeps `stages` TMA steps in flight (small blocks, several per SM).
Scaling the [64, Mp] products instead of the [64, group] code tiles leaves the codes unrounded
and costs 1.4-1.5x less with fp16 scales at groups of 128 (benchmarks/DECISIONS.md, with the
schedules that lost: scales before the product, a wait per group, 128-row blocks, warp
specialization). The exception is int4 codes with offsets in groups under 128 (Q4_K, Q4_1,
int4 with zero points; cfg.pre): there each group's scale and offset go onto its codes in bf16
(the weight rounded once, as prefill's dequantize rounds it), a step's groups chain their
wgmmas into one accumulator and x's sums are not needed: the per-group work on the
accumulator costs more than the per-code multiply-add at such groups. The sum [64, Mp] f32
goes out transposed ([N, Mp]); `splits` cuts K into that many ranges (a grid axis), summed in
float32 by the wrapper.

With norm_w (decode rows <= 8), each K step first rewrites x's tile in place: the residual
add of a producer's K-range sums and the RMSNorm's weight (its scale left to the caller), so
no add_rms_norm kernel runs before the launch. Every program redoes it for its K range
(KernelPolicy.mosaic_norm_rows says where that pays: before q/k/v, at three stages;
benchmarks/DECISIONS.md, sessions 20 and 22).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.quantized import (QuantizedWeight, codes_of, dequantize, from_frag,
                                      nk_bias, pack_plane, tile_for, to_frag)

GROUP = 128  # the unit of the K step (gps of them); K a multiple of it
GROUPS = (16, 32, 64, 128)  # group sizes the kernel takes (int4 from 32: its upcast tile)
BN = 64  # weight rows (output columns) per block: one wgmma M
ROWS_OUT = 16  # up to this many rows of x, the sums stored as [splits, M, N] (int_matmul_mgpu)

_WGMMA = plgpu.Layout.WGMMA
_WGMMA_ROW = plgpu.Layout.WGMMA.reduce(1)  # [64]: one value per row of a [64, Mp] tile
_WGMMA_COL = plgpu.Layout.WGMMA.reduce(0)  # [Mp]: one value per column
# The register layout a code tile is loaded in, by code bits: one that converts to the wgmma
# layout with few shuffles once upcast to 16 bits.
_UPCAST = {4: plgpu.Layout.WGMMA_UPCAST_4X, 8: plgpu.Layout.WGMMA_UPCAST_2X}
_CODES = {4: jnp.int4, 8: jnp.int8}
# The boundary's [8, bk] tiles (x, its deltas, the normed x): warp w holds rows 2w and 2w + 1,
# a lane 4 consecutive columns of each 128: one layout for the bf16 and the float32 tiles
# (16-byte swizzle chunks hold whole vectors of either) whose row sums stay in a warp.
_BOUNDARY = plgpu.Layout.TILED(fa.Tiling(((8, 128), (2, 128), (4,))), warp_dims=(-5,),
                               lane_dims=(-2,), vector_dim=-1)
_BOUNDARY_ROW = _BOUNDARY.reduce((0,))  # [bk]: a column's value (the norm weight, a delta row)
NORM_ROWS = 8  # the most rows of x the boundary in the kernel takes (one 8-row x tile)
_ACC_REGS = 64  # float32 registers a thread gives the products in flight ([64, Mp]: Mp / 2)
_SMEM = 216 * 1024  # shared memory the stages and the output may take (H200: 227 KB)


@dataclasses.dataclass(frozen=True)
class MgpuMatmulConfig:
    """gps: 128-wide units of K per step (one TMA tile); stages: K steps in flight; splits: K
    ranges (grid axis, float32 partial sums); batch: groups whose products share one wgmma
    wait (0: all of the step's); wide (groups under 128): code tiles 128 codes wide, loaded
    once per batch and sliced per group in registers, not one group wide (16-byte rows are
    unswizzled) and loaded per group. A block takes BN = 64 weight rows (one wgmma M)."""
    gps: int = 2
    stages: int = 4
    splits: int = 1
    batch: int = 0
    wide: bool = False
    frag: bool = False  # int4 codes stored in fragment order (to_frag): no relayout
    # groups under 128: each group's scale and offset applied to its codes in bf16 before the
    # product (the weight rounded to bf16 once, as the prefill path's dequantize does), so a
    # step's groups chain their wgmmas into one accumulator and x's group sums are not needed
    pre: bool = False

    def __str__(self):
        return (f"g{self.gps}_s{self.stages}_k{self.splits}"
                + (f"_b{self.batch}" if self.batch else "") + ("_w" if self.wide else "")
                + ("_f" if self.frag else "") + ("_p" if self.pre else ""))


@dataclasses.dataclass(frozen=True)
class NkFormat:
    """The static half of an nk weight as the kernel reads it: w = s * (c + code_shift) + o
    per group of `group` rows of K; s = scale (x super_scale per super_group: two-level),
    o = offset (or -(super_offset * offset)); the flags say which arrays come."""
    group: int = GROUP
    super_group: int = 0
    code_shift: int = 0
    offset: bool = False
    super_scale: bool = False
    super_offset: bool = False

    @property
    def x_sums(self) -> bool:  # an offset term: x's sums per group are an input
        return self.offset or self.code_shift != 0


def nk_format(qw: QuantizedWeight) -> NkFormat:
    """The kernel's static format of an nk weight (nk_bias - code_offset: the codes' shift)."""
    return NkFormat(group=GROUP if qw.float8 and qw.group == qw.k else qw.group,
                    super_group=qw.super_group if qw.super_scale is not None else 0,
                    code_shift=0 if qw.float8 else nk_bias(qw.bits) - qw.code_offset,
                    offset=qw.offset is not None, super_scale=qw.super_scale is not None,
                    super_offset=qw.super_offset is not None)


def _smem_transforms(row_bits: int, dtype_bits: int):
    """Tiling + swizzle for a tile whose rows are row_bits wide (TMA and wgmma both read it);
    16-byte rows are tiled unswizzled (Mosaic swizzles 32 to 128 bytes)."""
    swizzle = min(128, row_bits // 8)
    tiling = plgpu.TilingTransform((8, swizzle * 8 // dtype_bits))
    return (tiling, plgpu.SwizzleTransform(swizzle)) if swizzle >= 32 else (tiling,)


def nk_unfit(qw: QuantizedWeight) -> str | None:
    """Why qw cannot take the "nk" layout (None: it can): 4-bit codes (groups of 32, 64, 128),
    5- / 6-bit codes, int8 or fp8 e4m3 (groups of 16 to 128; fp8 also one scale per column),
    with or without offsets and two-level scales (super-groups of 128 * 2^i), of a [K, N]
    matrix or a stack of experts' [E, K, N], K a multiple of 128 and N of 64."""
    if qw.layout == "nk":
        return None
    signed8 = qw.bits == (8,) and qw.planes[0].dtype in (jnp.int8, jnp.float8_e4m3fn)
    codes_ok = signed8 or qw.bits in ((4,), (4, 1), (4, 2))
    group_ok = (qw.group in GROUPS and not (qw.bits == (4,) and qw.group < 32)) or (
        qw.float8 and qw.group == qw.k)
    sg = qw.super_group // GROUP
    super_ok = qw.super_scale is None or (
        qw.super_group % GROUP == 0 and sg & (sg - 1) == 0 and qw.super_group % qw.group == 0)
    if not (codes_ok and group_ok and super_ok):
        return (f"{qw.name}: not 4- to 8-bit codes (int8, not uint8) or fp8 in groups of "
                f"{GROUPS} (int4 from 32) with super-groups of 128 * 2^i")
    if qw.k % GROUP or qw.n % 64:
        return f"K={qw.k} not a multiple of {GROUP} or N={qw.n} not a multiple of 64"
    if qw.group == 64 and (qw.k // GROUP) % 2:  # it would take one unit a step (below)
        return f"K={qw.k}: an odd number of 128-row units with groups of 64"
    return None


def _t(a):
    return jnp.swapaxes(a, -1, -2)


def to_nk(qw: QuantizedWeight, frag: bool = False) -> QuantizedWeight:
    """The same weight in the "nk" layout (pallas_kernels/quantized.py): codes [N, K] int4
    (4-bit codes), int8 (5- to 8-bit) or fp8 e4m3, centred by nk_bias ([E, N, K] for stacked
    experts). One fp8 scale per column becomes the same scale per group of 128. frag: int4
    codes stored in fragment order (to_frag; other codes as they are)."""
    if qw.layout == "nk":
        if qw.frag == frag or qw.planes[0].dtype != jnp.int4:
            return qw
        c = qw.planes[0]  # the other order
        return qw.replace(planes=(to_frag(c) if frag else from_frag(c),), frag=frag)
    if (why := nk_unfit(qw)) is not None:
        raise ValueError(f"to_nk: {why}")
    lead = qw.planes[0].shape[:-2]  # (E,) for stacked experts
    if qw.float8:
        if qw.group != GROUP:  # [1, N] -> [K / 128, N], the same values
            qw = qw.replace(scale=jnp.repeat(qw.scale, qw.k // GROUP, axis=-2), group=GROUP,
                            tile=tile_for(GROUP, qw.k))
        return qw.replace(planes=(_t(jnp.asarray(qw.planes[0]).reshape(*lead, qw.k, qw.n)),),
                          layout="nk")
    # [..., K, N] int32: the stored codes, centred
    codes = jnp.asarray(codes_of(qw)).reshape(*lead, qw.k, qw.n) + (
        qw.code_offset - nk_bias(qw.bits))
    codes = _t(codes).astype(_CODES[4 if sum(qw.bits) == 4 else 8])  # [..., N, K]
    frag = frag and codes.dtype == jnp.int4
    return qw.replace(planes=(to_frag(codes) if frag else codes,), layout="nk", frag=frag)


def to_tiles(qw: QuantizedWeight) -> QuantizedWeight:
    """An "nk" weight back in the tiles layout the Triton kernels read (the planes it had)."""
    if qw.layout != "nk":
        return qw
    if qw.float8:
        return qw.replace(planes=(_t(qw.planes[0]),), layout="tiles")
    codes = codes_of(qw) + qw.code_offset  # [..., K, N] as stored
    qw = qw.replace(frag=False)
    if qw.bits == (8,):
        return qw.replace(planes=(codes.astype(jnp.int8),), layout="tiles")
    planes, shift = [], 0
    for b in qw.bits:  # low bits first
        pack = functools.partial(pack_plane, bits=b, tile=qw.tile)
        for _ in codes.shape[:-2]:  # one plane per expert
            pack = jax.vmap(pack)
        planes.append(pack((codes >> shift) & ((1 << b) - 1)))
        shift += b
    return qw.replace(planes=tuple(planes), layout="tiles")


MIN_BLOCKS = 128  # about one block per SM (the H200 has 132)


def default_config(m: int, k: int, n: int, fmt: NkFormat = NkFormat(),
                   code_bits: int = 4, norm: bool = False) -> MgpuMatmulConfig:
    """Two 128-wide units a step, four steps in flight, K in four ranges, as K allows (the
    best or within 5% of it at every decode shape of Llama-3-8B at M = 1 and 16, groups of
    128: benchmarks/DECISIONS.md); above 16 rows the fewest ranges that still give about every
    SM a block (M = 64: 1.1-1.2x faster than four); a split holds whole super-groups; the products of as many
    groups in flight as _ACC_REGS registers hold; fewer stages where four would pass _SMEM
    (8-bit codes at 64 rows); groups under 128 loaded 128 codes at a time (`wide`, faster
    at one row: benchmarks/DECISIONS.md). norm (the boundary in the main loop): at most three
    stages, since its deltas' tiles and the residual stream's staging take a program's shared
    memory past four programs an SM (session 22: q/k/v's boundary 2.2% slower a step at four
    stages, 1.1-2.1% faster at three)."""
    units = k // GROUP
    gps = 2 if units % 2 == 0 else 1
    whole = max(gps, fmt.super_group // GROUP)  # units a split must hold whole
    fits = [sp for sp in (4, 2, 1) if units % (sp * whole) == 0]
    splits = fits[0]
    if m > 16:  # x's tile costs as much as the codes: fewer K ranges, still a block per SM
        splits = min((sp for sp in fits if n // BN * sp >= MIN_BLOCKS), default=splits)
    mp = max(8, -(-m // 8) * 8)
    per_step = gps * GROUP // fmt.group
    batch = max(1, min(per_step, 2 * _ACC_REGS // mp))
    # A stage's bytes: codes, x, then per group a scale (and offset) row and x's sum, and
    # the super rows, counted at 4 bytes an element (at most).
    bk = gps * GROUP
    pre = _pre(fmt, code_bits)
    stage = (BN * bk * code_bits // 8 + mp * bk * 2
             + per_step * 4 * (BN * (1 + fmt.offset) + mp * (fmt.x_sums and not pre))
             + 2 * BN * 4)
    stages = max(2, min(3 if norm else 4, (_SMEM - BN * mp * 4) // stage))
    return MgpuMatmulConfig(gps=gps, stages=stages, splits=splits,
                            batch=0 if batch == per_step or pre else batch,
                            wide=fmt.group < GROUP, pre=pre)


def weight_config(qw, rows: int, *, norm: bool = False) -> MgpuMatmulConfig:
    """default_config for nk weight(s) qw (a tuple: one launch) at `rows` rows of x (or
    token-expert assignments), in the codes' order."""
    qws = qw if isinstance(qw, tuple) else (qw,)
    return dataclasses.replace(
        default_config(rows, qws[0].k, sum(w.n for w in qws), nk_format(qws[0]),
                       _bits(qws[0].planes[0].dtype), norm=norm), frag=qws[0].frag)


def quantized_matmul_mgpu(x, qw, *, experts=None, cfg: MgpuMatmulConfig | None = None,
                          interpret: bool = False, out_dtype=None, partials: bool = False,
                          norm_weight=None, eps: float = 0.0, deltas=None):
    """x [M, K] (M <= 64) @ dequantize(qw) for an "nk" weight -> [M, N] in out_dtype (x's);
    partials: the float32 sums of the K ranges unreduced, [S, M, N], for a consumer kernel
    that adds them (S = 1 above ROWS_OUT rows; with experts [S, A, N]).
    qw a tuple of nk weights with the same K, format and code dtype (gate and up): one launch,
    a tuple of outputs. experts = (ids [A], rows [A]) for stacked experts' weights:
    assignment a's x row rows[a] times expert ids[a] -> [A, N] (int_matmul_mgpu).

    norm_weight [K] (M <= NORM_ROWS; formats with offsets only with cfg.pre, `nk_norm_unfit`):
    the pre-norm boundary in the kernel, x' = x + sum(deltas [S', M, K] float32) (None: x) ->
    (rms_norm(x', norm_weight, eps) @ w, x' [M, K], the sums of squares of x' [S, Mp]); with
    partials the K ranges' sums are left unscaled (rms_norm's scale, rsqrt(sum of squares / K
    + eps), to the consumer)."""
    qws = qw if isinstance(qw, tuple) else (qw,)
    for w in qws:
        if w.layout != "nk":
            raise ValueError(f"quantized_matmul_mgpu: {w.name} weight is not in the nk layout "
                             f"(to_nk)")
    fmt = nk_format(qws[0])
    if any(nk_format(w) != fmt for w in qws):
        raise ValueError(f"quantized_matmul_mgpu: weights of different formats "
                         f"({', '.join(w.name for w in qws)}) take one launch each")
    if len({w.frag for w in qws}) > 1:
        raise ValueError(f"quantized_matmul_mgpu: {', '.join(w.name for w in qws)}: codes in "
                         f"fragment order and in K order take one launch each")
    if cfg is not None and cfg.frag != qws[0].frag:
        raise ValueError(f"quantized_matmul_mgpu: cfg.frag={cfg.frag}, but the codes are stored "
                         f"in {'fragment' if qws[0].frag else 'K'} order (to_nk(frag=...))")
    rows = x.shape[0] if experts is None else experts[0].shape[0]
    norm = norm_weight is not None
    cfg = cfg or weight_config(qws, rows, norm=norm)

    def arrays(name):
        return tuple(getattr(w, name) for w in qws) if getattr(fmt, name) else ()
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    out = int_matmul_mgpu(x, tuple(w.planes[0] for w in qws), tuple(w.scale for w in qws),
                          arrays("offset"), arrays("super_scale"), arrays("super_offset"),
                          experts, norm_weight, deltas, fmt=fmt, cfg=cfg, interpret=interpret,
                          out_dtype=jnp.float32 if norm and not partials else out_dtype,
                          partials=partials)
    if not norm:
        return out if isinstance(qw, tuple) else out[0]
    out, (x_new, ss) = out
    if not partials:  # rms_norm's scale per row
        inv_rms = lax.rsqrt(jnp.sum(ss[:, :x.shape[0]], axis=0) / x.shape[1] + eps)[:, None]
        out = tuple((y * inv_rms).astype(out_dtype) for y in out)
    return (out if isinstance(qw, tuple) else out[0]), x_new, ss


def nk_norm_unfit(x_rows: int, qw) -> str | None:
    """Why the boundary (residual add, RMSNorm) cannot run in the kernel's main loop for x of
    x_rows rows times qw (an nk weight or a tuple of them); None: it can."""
    qws = qw if isinstance(qw, tuple) else (qw,)
    if x_rows > NORM_ROWS:
        return f"{x_rows} rows (the kernel's boundary takes at most {NORM_ROWS})"
    if any(nk_format(w).x_sums and not _pre(nk_format(w), _bits(w.planes[0].dtype))
           for w in qws):
        return "a format with offsets and 8-bit codes or groups of 128 (x's group sums are " \
               "taken before the kernel)"
    return None


def _pre(fmt: NkFormat, code_bits: int) -> bool:
    """Whether the default config puts the scales and offsets on the codes before the
    product (cfg.pre): int4 codes with offsets in groups under 128 (Q4_K, Q4_1, int4 with
    zero points), where it is faster; Q4_0 and the int8-coded formats are not
    (benchmarks/DECISIONS.md, session 25)."""
    return fmt.x_sums and code_bits == 4 and fmt.group < GROUP


def _bits(dtype) -> int:
    return 4 if dtype == jnp.int4 else 8  # int8, fp8 e4m3


def _codes(w_smem, u, unit, frag=False, interpret=False):
    """Codes u * unit .. + unit - 1 of the code tile -> bf16 [bn, unit] (exact: int4, int8,
    fp8 e4m3) in the wgmma layout (frag: int4 codes stored in fragment order)."""
    bits = _bits(w_smem.dtype)
    if frag and interpret:  # the interpreter: the tile's codes put back in order
        return from_frag(w_smem[:, pl.ds(u * unit, unit)]).astype(jnp.bfloat16)
    w = plgpu.load(w_smem.at[:, pl.ds(u * unit, unit)], layout=_UPCAST[bits])
    if frag:
        return _frag_convert(w)
    w = plgpu.layout_cast(w, _WGMMA)
    if w.dtype == jnp.float8_e4m3fn:  # Hopper converts e4m3 to f16 only; both exact here
        w = w.astype(jnp.float16)
    return w.astype(jnp.bfloat16)


def _frag_convert(codes):
    """int4 [64, unit] in WGMMA_UPCAST_4X, stored in fragment order -> bf16 [64, unit] in the
    WGMMA layout, the registers renamed, not moved: per 32-bit word of 8 codes, pair j is
    ((q >> 4j) & 0x000F000F) ^ 0x43084308 (the codes offset by 8 under a bf16 exponent of
    128) minus 136 (as Mosaic's own int4 -> bf16 conversion, without its prmt, its mov and
    the shuffles)."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm

    shape = codes.shape

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
                       return_type=plgpu.ShapeDtypeStruct(shape, jnp.bfloat16,
                                                          layout=plgpu.Layout.WGMMA))
    def convert(_, c):
        i32 = ir.IntegerType.get_signless(32)
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        regs = c.registers  # [1, unit / 32, 1, 1, 2, 1, 1, 1, 1] of vector<8xi4>
        out = np.empty(fa.WGMMA_LAYOUT.registers_shape(shape), dtype=object)
        base = arith.constant(i32, 0x43084308)  # one register for every pair's lop3 and sub
        for idx in np.ndindex(regs.shape):
            q = mu.bitcast(regs[idx], i32)
            for j in range(4):
                s = q if j == 0 else arith.shrui(q, arith.constant(i32, 4 * j))
                v = llvm.inline_asm(
                    i32, [s, base],
                    """
                    {
                    .reg .b32 t;
                    lop3.b32 t, $1, 0x000F000F, $2, (0xf0 & 0xcc) ^ 0xaa;
                    sub.bf16x2 $0, t, $2;
                    }
                    """, "=r,r,r")
                o = list(idx)
                o[1] = 4 * idx[1] + j
                out[tuple(o)] = mu.bitcast(v, bf16x2)
        return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)
    return convert(codes)


def _row(ref, j):
    """Row j of a [rows, 64] scale / offset tile as float32 [64] (one value per wgmma row)."""
    return plgpu.load(ref.at[j], layout=_WGMMA_ROW).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("fmt", "cfg", "interpret", "out_dtype",
                                             "partials"))
def int_matmul_mgpu(x, codes: tuple, scale: tuple, offset: tuple = (), super_scale: tuple = (),
                    super_offset: tuple = (), experts=None, norm_w=None, deltas=None, *,
                    fmt: NkFormat = NkFormat(),
                    cfg: MgpuMatmulConfig = MgpuMatmulConfig(), interpret: bool = False,
                    out_dtype=jnp.bfloat16, partials: bool = False):
    """x [M, K] bf16 @ w_i for each weight i -> a tuple of [M, N_i] out_dtype (float32 sums):
    w_i[k, n] = s[g, n] * (codes_i[n, k] + fmt.code_shift) + o[g, n], g = k // fmt.group,
    codes_i [N_i, K] int4 / int8 / fp8; scale_i, offset_i [K / group, N_i]; super_scale_i,
    super_offset_i [K / super_group, N_i] (each tuple empty where fmt says the array is
    absent; s and o as NkFormat says). The weights' blocks share one grid: one launch, the
    blocks of weight i where the grid's index falls in its range.

    experts = (ids [A], rows [A]) int32: stacked experts' weights (every array [E, ...]);
    assignment a multiplies x's row rows[a] by expert ids[a]'s weight -> a tuple of [A, N_i]
    (a MoE layer's decode: only the chosen experts' codes are read). Each assignment's blocks
    multiply all M rows of x (the MMA's N side is 8 rows at least anyway) and keep row
    rows[a]'s column.
    partials: the K ranges' float32 sums unreduced, a tuple of [S, M, N_i]; with experts
    [S, A, N_i] (each assignment's row).

    norm_w [K] (M <= NORM_ROWS, no experts): the sublayer boundary in the main loop. Each K
    step's x tile becomes x + sum(deltas) (deltas [S', M, K] float32, a producer's K-range
    sums, added in chunk order and rounded once: the residual stream), then that times norm_w
    rounded to bf16 (the operand); the float32 sums of squares of x + sum(deltas) gather in
    registers. The products are rms_norm's without its scale (rms_norm(x) @ w = inv_rms *
    ((x * norm_w) @ w), as the bf16 path's kernels): the caller scales. Returns (the tuple of
    outputs, (x + sum(deltas) [M, K] bf16 (x itself without deltas), the sums of squares
    [S, Mp] float32, rows past M zero)); the programs of the first block of each K range store
    those."""
    m, k = x.shape
    if norm_w is None and deltas is not None:
        raise ValueError("int_matmul_mgpu: deltas go with norm_w (the boundary before a norm)")
    if norm_w is not None:
        if experts is not None or m > NORM_ROWS or norm_w.shape != (k,):
            raise ValueError(f"int_matmul_mgpu: the boundary in the kernel takes x of at most "
                             f"{NORM_ROWS} rows, no experts and norm_w [K]; got x {x.shape}, "
                             f"norm_w {norm_w.shape}")
        if deltas is not None and (deltas.ndim != 3 or deltas.shape[1:] != (m, k)
                                   or deltas.dtype != jnp.float32):
            raise ValueError(f"int_matmul_mgpu: deltas must be float32 [S, M, K] = [S, {m}, "
                             f"{k}], got {deltas.dtype} {deltas.shape}")
    nw = len(codes)
    lead = codes[0].shape[:-2] if codes else ()  # (E,) for stacked experts, else ()
    if (experts is None) != (lead == ()) or len(lead) > 1:
        raise ValueError(f"int_matmul_mgpu: codes {codes[0].shape} need experts=(ids, rows) "
                         f"exactly when they are stacked [E, N, K]")
    if experts is not None:  # the experts' arrays as one [E * rows, N] each (codes [E * N, K])
        codes, scale, offset, super_scale, super_offset = (
            tuple(a.reshape(-1, a.shape[-1]) for a in arrays)
            for arrays in (codes, scale, offset, super_scale, super_offset))
        ids, rows = (jnp.asarray(v, jnp.int32) for v in experts)
        if ids.ndim != 1 or ids.shape != rows.shape:
            raise ValueError(f"int_matmul_mgpu: experts=(ids, rows) must be two [A] arrays, "
                             f"got {ids.shape} and {rows.shape}")
        assignments = ids.shape[0]
    else:
        ids, rows, assignments = None, None, 1
    group, sg = fmt.group, fmt.super_group
    given = {"scale": scale, "offset": offset, "super_scale": super_scale,
             "super_offset": super_offset}
    wanted = {"scale": True, "offset": fmt.offset, "super_scale": fmt.super_scale,
              "super_offset": fmt.super_offset}
    if not codes or len({c.dtype for c in codes}) != 1 or any(
            len(a) != (nw if wanted[f] else 0) for f, a in given.items()):
        raise ValueError(f"int_matmul_mgpu: codes and the arrays {fmt} names: one of each per "
                         f"weight, one code dtype")
    if group not in GROUPS or k % GROUP or (codes[0].dtype == jnp.int4 and group < 32) or (
            (fmt.super_scale or fmt.super_offset) and (not sg or sg % GROUP or sg % group)):
        raise ValueError(f"int_matmul_mgpu: K {k} not a multiple of {GROUP}, or groups of "
                         f"{group} / super-groups of {sg} that the kernel does not take")
    e_n = lead[0] if lead else 1  # experts stacked in each array's rows
    for i, c in enumerate(codes):
        n, k2 = c.shape
        n //= e_n
        shapes = {"scale": (e_n * k // group, n), "offset": (e_n * k // group, n),
                  "super_scale": (e_n * k // max(sg, 1), n),
                  "super_offset": (e_n * k // max(sg, 1), n)}
        if k2 != k or c.dtype not in (jnp.int4, jnp.int8, jnp.float8_e4m3fn) or any(
                a[i].shape != shapes[f] for f, a in given.items() if a):
            raise ValueError(f"int_matmul_mgpu: x {x.shape}, codes {c.shape}, "
                             f"{ {f: a[i].shape for f, a in given.items() if a} } do not fit "
                             f"{fmt}")
        if n % BN:
            raise ValueError(f"int_matmul_mgpu: N {n} not a multiple of {BN}")
    if m > 64:
        raise ValueError(f"int_matmul_mgpu is a decode kernel: M = {m} > 64")
    if cfg.frag and codes[0].dtype != jnp.int4:
        raise ValueError(f"int_matmul_mgpu: fragment order (cfg.frag) is for int4 codes, got "
                         f"{codes[0].dtype}")
    gps, bn = cfg.gps, BN
    if gps == 1 and group == 64:
        # One 128-wide unit a step in groups of 64 crashed the H200 test process (illegal
        # access, 2026-12-03; groups of 32 and 128 ran there); not yet found.
        raise ValueError("int_matmul_mgpu: groups of 64 take at least two 128-wide units a "
                         "step (gps >= 2)")
    bk = gps * GROUP
    kr = k // cfg.splits  # K per split
    if k % (cfg.splits * bk) or (sg and (kr % sg or (bk % sg and sg % bk))):
        raise ValueError(f"int_matmul_mgpu: K {k} not {cfg.splits} splits of whole steps of "
                         f"{bk}" + (f" and super-groups of {sg}" if sg else ""))
    # x's tiles are Mp rows: below 8 rows TMA fills the rows past M with zeros (no pad op
    # before the kernel); they only reach output columns that are sliced off. TMA refuses a
    # gmem array of more than 8 rows that are not a multiple of 8 (M = 10 failed on the
    # H200), and the interpreter takes no out-of-bounds read: those get x padded.
    mp = max(8, -(-m // 8) * 8)
    x = x.astype(jnp.bfloat16)
    xin = [jnp.pad(x, ((0, mp - m), (0, 0))) if (interpret or m > 8) and mp != m else x]
    xs_in = fmt.x_sums and not cfg.pre  # x's group sums an input (pre: offsets in the codes)
    if xs_in:  # X [G, Mp] float32: x's sum over each group (rows past M zero), the pad
        # and transpose on the reduce's input: one XLA fusion before the launch, not a reduce
        # then a pad (a Q4_K_M step: 96 launches fewer, 1-2% faster; benchmarks/DECISIONS.md)
        xf = jnp.pad(x.astype(jnp.float32), ((0, mp - m), (0, 0)))
        xin.append(jnp.sum(xf.reshape(mp, k // group, group).transpose(1, 0, 2), axis=2))
    steps = kr // bk
    gst = bk // group  # groups per step
    batch = cfg.batch or gst
    bits = _bits(codes[0].dtype)
    # A load's codes: a whole tile column of the smem layout (Mosaic slices whole tiles), of
    # at least 16 bytes (TMA's least box row).
    unit = max(group, GROUP) if cfg.wide else group
    w_tr = _smem_transforms(max(unit * bits, 128), bits)
    x_tr = _smem_transforms(group * 16, 16)
    srows = max(1, bk // sg) if sg else 0  # super rows per step
    per = sg // bk if sg and sg > bk else 1  # steps per super row
    row_spec = plgpu.BlockSpec((gst, bn), lambda i: (i, 0))
    specs = {"scale": row_spec, "offset": row_spec,
             "super_scale": plgpu.BlockSpec((srows, bn), lambda i: (i // per, 0)),
             "super_offset": plgpu.BlockSpec((srows, bn), lambda i: (i // per, 0))}
    fields = [f for f in given if wanted[f]]
    in_specs = [plgpu.BlockSpec((bn, bk), lambda i: (0, i), transforms=w_tr),
                plgpu.BlockSpec((mp, bk), lambda i: (0, i), transforms=x_tr)]
    if xs_in:
        in_specs.append(plgpu.BlockSpec((gst, mp), lambda i: (i, 0)))
    norm = norm_w is not None
    nd = 0 if deltas is None else deltas.shape[0]
    if norm and xs_in:  # x's group sums are taken before the kernel, of x, not the normed x
        raise ValueError(f"int_matmul_mgpu: the boundary in the kernel takes a format with "
                         f"offsets ({fmt}) only with cfg.pre")
    if norm:  # the norm weight's [bk] (then each delta's [S', M, bk]), unswizzled
        in_specs.append(plgpu.BlockSpec((bk,), lambda i: (i,)))
        if nd:
            in_specs.append(plgpu.BlockSpec((nd, m, bk), lambda i: (0, 0, i)))
    in_specs += [specs[f] for f in fields]
    ns = [c.shape[0] // e_n for c in codes]  # each weight's N
    starts = [sum(ns[:i]) // bn for i in range(len(ns) + 1)]  # each weight's first block
    na = 1 + len(fields)  # arrays per weight: codes, then fields'

    def kernel(*refs):
        if experts is not None:
            ids_gmem, refs = refs[0], refs[1:]
        x_gmem, refs = refs[0], refs[1:]
        xs_gmem, refs = (refs[0], refs[1:]) if xs_in else (None, refs)
        if norm:
            nw_gmem, *refs = refs
            d_gmem, *refs = refs if nd else (None, *refs)
        weights = [refs[i * na:(i + 1) * na] for i in range(nw)]
        o_gmem, *refs = refs[nw * na:]
        if norm:
            xn_gmem, *refs = refs if nd else (None, *refs)
            ss_gmem, *refs = refs
        o_smem, *refs = refs
        if norm:
            xn_smem, *refs = refs if nd else (None, *refs)
            ss_smem, = refs
        nb, sp = lax.axis_index("n"), lax.axis_index("s")
        k0 = sp * kr  # the split's first K
        # an assignment's blocks are consecutive: block j of its expert's weights
        e = ids_gmem[nb // starts[-1]] if experts is not None else 0
        j = nb % starts[-1] if experts is not None else nb

        def block(arrays, n_w, wb):  # block wb of one weight -> out rows from nb * bn
            cols = pl.ds(wb * bn, bn)
            ops = [arrays[0].at[pl.ds(e * n_w + wb * bn, bn), pl.ds(k0, kr)],
                   x_gmem.at[:, pl.ds(k0, kr)]]
            if xs_in:
                ops.append(xs_gmem.at[pl.ds(k0 // group, kr // group)])
            if norm:
                ops.append(nw_gmem.at[pl.ds(k0, kr)])
                if nd:
                    ops.append(d_gmem.at[:, :, pl.ds(k0, kr)])
            for f, a in zip(fields, arrays[1:]):
                rows = pl.ds(e * (k // sg) + k0 // sg, kr // sg) if f.startswith("super") \
                    else pl.ds(e * (k // group) + k0 // group, kr // group)
                ops.append(a.at[rows, cols])
            pipe = functools.partial(plgpu.emit_pipeline, grid=(steps,), in_specs=in_specs,
                                     max_concurrent_steps=cfg.stages)

            def products(w_smem, x_smem, js, rows=None):  # [codes_j @ x_j^T for groups j]
                """rows (cfg.pre): {j: (scale, offset or None) bf16 [bn] rows} -> [sum over j
                of (codes_j * scale + offset) @ x_j^T], one accumulator."""
                def xj(j):  # x [Mp, group] of group j
                    return x_smem.at[:, pl.ds(j * group, group)]

                def weight(j, c):  # the group's bf16 operand
                    if rows is None:
                        return c
                    sj, oj = rows[j]
                    w = c * lax.broadcast_in_dim(sj, (bn, group), [0])
                    return w if oj is None else w + lax.broadcast_in_dim(oj, (bn, group), [0])

                def codes_of_groups():  # group j's bf16 [bn, group] codes, a load per unit
                    units = {}
                    for j in js:
                        u, r = divmod(j * group, unit)
                        if u not in units:
                            units[u] = _codes(w_smem, u, unit, cfg.frag, interpret)
                        yield j, units[u] if unit == group else units[u][:, r:r + group]
                if interpret:  # the GPU interpreter takes no register operand for wgmma
                    parts = [jnp.dot(weight(j, c), xj(j)[...].T,
                                     preferred_element_type=jnp.float32)
                             for j, c in codes_of_groups()]
                    return parts if rows is None else [functools.reduce(jnp.add, parts)]

                def scope(*accs):
                    for i, (j, c) in enumerate(codes_of_groups()):
                        plgpu.wgmma(accs[0 if rows else i], weight(j, c), xj(j).T)
                    return [acc_ref[...] for acc_ref in accs]  # one wait for the batch
                n_acc = 1 if rows else len(js)
                return pl.run_scoped(scope, *[plgpu.ACC((bn, mp), jnp.float32)] * n_acc)

            def boundary(step, x_smem, nw_smem, d_smem, sq):
                """x_smem <- (x + sum(deltas)) * norm_w in bf16; -> sq + its squares (summed
                over K once, after the loop). No branch here: a pl.when costs two barriers."""
                row = lax.broadcasted_iota(jnp.int32, (mp, bk), 0)

                def bcast(ref):  # a [bk] row over the [8, bk] tile, float32
                    v = plgpu.load(ref, layout=_BOUNDARY_ROW).astype(jnp.float32)
                    return lax.broadcast_in_dim(v, (mp, bk), [1])
                xt = plgpu.load(x_smem, layout=_BOUNDARY)
                if nd:
                    total = None  # row r of the deltas' sum, in chunk order, on row r only
                    for r in range(m):
                        dr = bcast(d_smem.at[0, r])
                        for c in range(1, nd):
                            dr = dr + bcast(d_smem.at[c, r])
                        if m > 1:
                            dr = jnp.where(row == r, dr, 0.0)
                        total = dr if total is None else total + dr
                    xt = (total + xt.astype(jnp.float32)).astype(jnp.bfloat16)
                    xn_smem.at[step][...] = xt  # the residual stream (the first block's out)
                xf = xt.astype(jnp.float32)
                x_smem[...] = (xf * bcast(nw_smem)).astype(jnp.bfloat16)
                plgpu.commit_smem()  # the stores before the wgmmas read the tile
                return sq + xf * xf

            def body(idx, w_smem, x_smem, *rest):  # acc [bn, Mp] += product_j * s_j + o_j X_j
                *tiles, acc = rest
                if norm:
                    acc, sq = acc
                    nw_smem, *tiles = tiles  # (no x sums: refused with norm_w)
                    d_smem, *tiles = tiles if nd else (None, *tiles)
                    sq = boundary(idx[0], x_smem, nw_smem, d_smem, sq)
                t = dict(zip(fields, tiles[xs_in:]))
                sup = {}

                def super_row(f, j):  # super-group row of group j, loaded once a step
                    r = j * group // sg if srows > 1 else 0
                    if (f, r) not in sup:
                        sup[f, r] = _row(t[f], r)
                    return sup[f, r]

                def bcast(v, dim):  # a row [64] or column [Mp] over [bn, Mp]
                    return lax.broadcast_in_dim(v, (bn, mp), [dim])

                def scale_offset(j):  # group j's rows as dequantize forms them, float32
                    s = _row(t["scale"], j)  # super * sub
                    if fmt.super_scale:
                        s = super_row("super_scale", j) * s
                    o = None
                    if fmt.offset:
                        o = _row(t["offset"], j)
                        if fmt.super_offset:
                            o = -(super_row("super_offset", j) * o)
                    if fmt.code_shift:
                        o = fmt.code_shift * s if o is None else o + fmt.code_shift * s
                    return s, o

                for j0 in range(0, gst, batch):
                    js = range(j0, min(j0 + batch, gst))
                    if cfg.pre:  # w = codes * s + o in bf16, the groups in one accumulator
                        rows = {}
                        for j in js:
                            s, o = scale_offset(j)
                            rows[j] = (s.astype(jnp.bfloat16),
                                       None if o is None else o.astype(jnp.bfloat16))
                        acc = acc + products(w_smem, x_smem, js, rows)[0]
                        continue
                    for j, part in zip(js, products(w_smem, x_smem, js)):
                        s, o = scale_offset(j)
                        acc = acc + part * bcast(s, 0)
                        if o is not None:
                            xsum = plgpu.load(tiles[0].at[j], layout=_WGMMA_COL)  # [Mp]
                            acc = acc + bcast(o, 0) * bcast(xsum, 1)
                return (acc, sq) if norm else acc
            zero = jnp.zeros((bn, mp), jnp.float32)
            init = zero if interpret else plgpu.layout_cast(zero, _WGMMA)
            if norm:
                sq0 = jnp.zeros((mp, bk), jnp.float32)
                init = (init, sq0 if interpret else plgpu.layout_cast(sq0, _BOUNDARY))
            acc = pipe(body, init_carry=init)(*ops)
            if norm:
                acc, sq = acc

                @pl.when(nb == 0)
                def _():  # the first block of each K range: the sums of squares, x + deltas
                    ss_smem[...] = jnp.sum(sq, axis=1)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(ss_smem, ss_gmem.at[sp])
                    for st in range(steps if nd else 0):  # TMA boxes of at most 256
                        plgpu.copy_smem_to_gmem(xn_smem.at[st, pl.ds(0, m)],
                                                xn_gmem.at[:, pl.ds(k0 + st * bk, bk)])
            if rows_out:  # o [M, 64]: column r of acc, a masked row sum each (a few shuffles)
                col = lax.broadcasted_iota(jnp.int32, (bn, mp), 1)
                for r in range(m):
                    o_smem[r] = jnp.sum(jnp.where(col == r, acc, 0.0), axis=1)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[sp, :, pl.ds(nb * bn, bn)])
            else:
                o_smem[...] = acc  # [bn, Mp] f32
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[sp, pl.ds(nb * bn, bn)])
            plgpu.wait_smem_to_gmem(0)

        if nw == 1:
            block(weights[0], ns[0], j)
        else:  # the weight whose blocks hold index j
            for i in range(nw):
                pl.when((j >= starts[i]) & (j < starts[i + 1]))(
                    functools.partial(block, weights[i], ns[i], j - starts[i]))

    arrays = [a for i in range(nw) for a in (codes[i], *(given[f][i] for f in fields))]
    # Up to ROWS_OUT rows, each block stores its [64, Mp] sums' columns of x's rows, [M, 64]
    # (the rest are TMA's zero rows): the epilogue reads M rows and transposes nothing.
    rows_out = m <= ROWS_OUT
    out_type = [jax.ShapeDtypeStruct(
        (cfg.splits, m, assignments * starts[-1] * bn) if rows_out else
        (cfg.splits, assignments * starts[-1] * bn, mp), jnp.float32)]
    scratch = [plgpu.SMEM((m, bn) if rows_out else (bn, mp), jnp.float32)]
    extra_in = ()
    if norm:  # x + deltas [M, K] (stored through [steps, 8, bk] in smem), sums [S, Mp]
        if nd:
            out_type.append(jax.ShapeDtypeStruct((m, k), jnp.bfloat16))
            scratch.append(plgpu.SMEM((steps, mp, bk), jnp.bfloat16))
        out_type.append(jax.ShapeDtypeStruct((cfg.splits, mp), jnp.float32))
        scratch.append(plgpu.SMEM((mp,), jnp.float32))
        extra_in = (norm_w.astype(jnp.bfloat16),) + ((deltas,) if nd else ())
    out, *normed = plgpu.kernel(
        kernel,
        out_type=tuple(out_type),
        scratch_types=scratch,
        grid=(assignments * starts[-1], cfg.splits),
        grid_names=("n", "s"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(*(() if ids is None else (ids,)), *xin, *extra_in, *arrays)
    if norm:
        extras = (normed[0] if nd else x, normed[-1])
        return _int_matmul_outputs(out, m, mp, nw, starts, bn, assignments, rows, experts,
                                   rows_out, partials, out_dtype), extras
    return _int_matmul_outputs(out, m, mp, nw, starts, bn, assignments, rows, experts,
                               rows_out, partials, out_dtype)


def _int_matmul_outputs(out, m, mp, nw, starts, bn, assignments, rows, experts, rows_out,
                        partials, out_dtype):
    """The kernel's [S, M, A * N] (or [S, A * N, Mp]) sums -> each weight's output."""
    if partials and rows_out and experts is None:  # [S, M, N_i] each
        return tuple(out[..., starts[i] * bn:starts[i + 1] * bn] for i in range(nw))
    if experts is not None:  # each assignment's row: [S, A, N]
        s, a = out.shape[0], assignments
        if rows_out:  # [S, M, A, N]
            y = out.reshape(s, m, a, -1)[:, rows, jnp.arange(a)]
        else:  # [S, A, N, Mp]
            y = jnp.take_along_axis(out.reshape(s, a, -1, mp), rows[None, :, None, None],
                                    axis=3)[..., 0]
        if partials:
            return tuple(y[..., starts[i] * bn:starts[i + 1] * bn] for i in range(nw))
        y = jnp.sum(y, axis=0)
    else:
        y = jnp.sum(out, axis=0)  # rows_out: [M, N], else [N, Mp] f32
        if not rows_out:
            y = y[:, :m].T  # [M, N]
    if partials:  # one "K range": the sum [1, M, N_i]
        return tuple(y[None, :, starts[i] * bn:starts[i + 1] * bn] for i in range(nw))
    y = y.astype(out_dtype)
    return tuple(y[:, starts[i] * bn:starts[i + 1] * bn] for i in range(nw))


def quantized_matmul_mgpu_reference(x, qw: QuantizedWeight, *, cfg=None, interpret=False,
                                    out_dtype=None):
    """The same in plain jnp: x @ dequantize(qw) in float32 -> out_dtype (x's)."""
    y = jnp.dot(x.astype(jnp.float32), dequantize(qw, jnp.float32).reshape(qw.k, qw.n),
                precision=lax.Precision.HIGHEST)
    return y.astype(out_dtype or x.dtype)
