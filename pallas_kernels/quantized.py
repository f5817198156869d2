"""Quantized matmul weights: one layout for our int8 / int4 / fp8 and for llama.cpp's GGUF blocks.

    quantize_weight(w, bits=8|4, group_size=, symmetric=, float8=)  -> QuantizedWeight
    dequantize(qw)                          [K, *N] float32 (the reference every kernel meets)
    stack_experts(qws) / num_experts(qw)    E experts' weights as one, every array [E, ...]
    quantized_matmul(x, qw)                 x [M, K] @ dequantize(qw): the fused decode kernel
    quantized_matmul_reference(x, qw)       the same in plain jnp

A `QuantizedWeight` holds w [K, *N] ([in, out]) as integer codes (or fp8 values) with
per-group scales along K. Every weight of group g (rows g * group .. (g + 1) * group - 1 of
one column) is

    w = s[g] * c + o[g]      c: the integer code minus `code_offset` (or the fp8 value)
    s[g] = scale[g]                        or  super_scale[G'] * scale[g]   (two-level)
    o[g] = offset[g] (0 if absent)         or  -(super_offset[G'] * offset[g])
                                               G' = g * group // super_group

computed in float32. This covers our own formats and, repacked on load with bit-identical
values (the products are exact in float32), GGUF's Q4_0 (4-bit codes - 8, one fp16 scale per 32),
Q4_1 (+ an fp16 min), Q5_0 / Q5_1 (a fifth bit plane), Q8_0 (int8, fp16 scale per 32) and the
K-quants Q4_K / Q5_K (6-bit sub-scales and mins per 32 under fp16 super-scales per 256) and
Q6_K (6-bit codes - 32, int8 sub-scales per 16 under an fp16 super-scale), each within a few
percent of the file's bytes.

Codes are split into bit planes, low bits first: `bits=(4,)` for int4, `(4, 1)` for 5-bit,
`(4, 2)` for 6-bit, `(8,)` for int8 (dtype int8 or uint8) or fp8. The kernel reads K in tiles
of `tile` rows (tile divides the group, so each tile has one scale row per column); a plane of
b bits holds r = 8 // b tiles per byte row: tile t of K is stored at byte rows
(t // r) * tile .. + tile - 1, in bits b * (t % r) .. b * (t % r) + b - 1. A kernel step then
loads a [tile, block_n] byte tile and one shift and mask give the codes: no interleaved rows
to untangle in registers. Rows past K are zero codes.

`layout="nk"` (pallas_kernels/quantized_mgpu.py: 4-, 5-, 6- and 8-bit codes or fp8 in groups of
16 to 128, with or without offsets and two-level scales): the one plane is the stored codes
(code_offset not taken off) centred by nk_bias(bits) (2 ** (b - 1) for b < 8 bits, else 0): int4
for 4-bit codes, int8 for 5- to 8-bit ones (or the fp8 values), [N, K] (K contiguous per output
column, what the Mosaic GPU kernel's TMA tiles read); codes_of adds back nk_bias - code_offset.
The scales, offsets and every static field stay as they were (an fp8 scale per column is
repeated per group of 128), so `dequantize` gives the same values bit for bit and `to_tiles`
restores the planes.

A MoE layer's stacked experts are one QuantizedWeight whose every array has a leading expert
axis ([E, rows, N]); its static fields describe one expert's [K, N] (`stack_experts`). The
helpers below that read arrays (unpack_plane, codes_of, group_scales, dequantize) take any
leading axes: a stacked weight dequantizes to [E, K, *N].
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

MAX_TILE = 128  # rows per kernel step for groups of 128 and more (and per-channel scales)


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """w [K, *out_shape] as codes and group scales (see the module docstring)."""

    planes: tuple  # each [rows, N]: uint8 bit planes, or one int8 / uint8 / float8 plane [K, N]
    scale: jax.Array  # [G, N]: float, or int8 / uint8 sub-scales under super_scale
    offset: jax.Array | None = None  # [G, N]: float added, or uint8 sub-mins under super_offset
    super_scale: jax.Array | None = None  # [G', N] float (two-level scales)
    super_offset: jax.Array | None = None  # [G', N] float
    k: int = dataclasses.field(default=0, metadata={"static": True})
    out_shape: tuple = dataclasses.field(default=(), metadata={"static": True})
    bits: tuple = dataclasses.field(default=(8,), metadata={"static": True})
    group: int = dataclasses.field(default=0, metadata={"static": True})
    super_group: int = dataclasses.field(default=0, metadata={"static": True})
    tile: int = dataclasses.field(default=MAX_TILE, metadata={"static": True})
    code_offset: int = dataclasses.field(default=0, metadata={"static": True})
    name: str = dataclasses.field(default="int8", metadata={"static": True})  # for messages
    layout: str = dataclasses.field(default="tiles", metadata={"static": True})  # or "nk"
    # "nk" int4 codes stored in fragment order within every 32 of K (to_frag): the Mosaic
    # kernel converts them in place (KernelPolicy.int4_fragment_order)
    frag: bool = dataclasses.field(default=False, metadata={"static": True})

    # -- what the ops and checks read --------------------------------------------------------
    @property
    def n(self) -> int:
        return math.prod(self.out_shape)

    @property
    def in_features(self) -> int:
        return self.k

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape [K, *N] of the weight."""
        return (self.k, *self.out_shape)

    @property
    def float8(self) -> bool:
        return jnp.issubdtype(self.planes[0].dtype, jnp.floating)

    @property
    def groups(self) -> int:
        return -(-self.k // self.group)

    def nbytes(self) -> int:
        # int4 arrays ("nk" codes) take half a byte an element on the device
        return sum(int(a.size) * jnp.dtype(a.dtype).itemsize // (2 if a.dtype == jnp.int4
                                                                   else 1)
                   for a in jax.tree.leaves(self))

    def replace(self, **changes) -> QuantizedWeight:
        return dataclasses.replace(self, **changes)

    def with_out_shape(self, out_shape: tuple) -> QuantizedWeight:
        """The same weight seen with other output dims (their product unchanged)."""
        if math.prod(out_shape) != self.n:
            raise ValueError(f"out_shape {out_shape} does not hold the weight's {self.n} columns")
        return self.replace(out_shape=tuple(out_shape))

    def map_columns(self, fn) -> QuantizedWeight:
        """fn applied to every array's column axis (all are [rows, N]): fn(a [R, N]) -> [R, N']."""
        def f(a):
            return None if a is None else fn(a)
        return self.replace(planes=tuple(f(p) for p in self.planes), scale=f(self.scale),
                            offset=f(self.offset), super_scale=f(self.super_scale),
                            super_offset=f(self.super_offset))

    def __post_init__(self):
        planes = self.planes
        if isinstance(planes, list):
            object.__setattr__(self, "planes", tuple(planes))
        if isinstance(self.out_shape, list | int):
            shape = (self.out_shape,) if isinstance(self.out_shape, int) else self.out_shape
            object.__setattr__(self, "out_shape", tuple(shape))


jax.tree_util.register_dataclass(QuantizedWeight)


def plane_rows(k: int, tile: int, bits: int) -> int:
    """Byte rows of a plane of `bits`-bit codes for K rows read in tiles of `tile`."""
    per_byte = 8 // bits
    return -(-(-(-k // tile)) // per_byte) * tile


def check_layout(k: int, n: int, bits: tuple, group: int, tile: int, where: str = "") -> None:
    """Raise ValueError unless the static layout is one the kernels and references read."""
    at = f"{where}: " if where else ""
    if k < 1 or n < 1:
        raise ValueError(f"{at}a quantized weight needs K, N >= 1, got K={k}, N={n}")
    if not bits or sum(bits) > 8 or any(b not in (1, 2, 4, 8) for b in bits):
        raise ValueError(f"{at}bit planes {bits} are not supported (planes of 1, 2, 4 or 8 "
                         f"bits, at most 8 in all)")
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"{at}tile={tile} must be a power of two >= 16")
    if group < 1 or (group % tile and -(-k // group) > 1):
        raise ValueError(f"{at}group size {group} is not a multiple of the kernel tile {tile} "
                         f"(groups of 16 rows or a multiple of 16)")


def tile_for(group: int, k: int) -> int:
    """The kernel tile of a group size: the group itself up to MAX_TILE, else MAX_TILE."""
    if group >= k:  # one group: per-channel scales
        return MAX_TILE
    t = MAX_TILE
    while t > 16 and group % t:
        t //= 2
    return t


# ---------------------------------------------------------------------------------------------
# Packing codes into planes (numpy or jnp, by the input's type)
# ---------------------------------------------------------------------------------------------


def _xp(a):
    return np if isinstance(a, np.ndarray) else jnp


def pack_plane(codes, bits: int, tile: int):
    """codes [K, N] (integers in [0, 2**bits)) -> the plane [plane_rows(K, tile, bits), N]
    uint8 of the module docstring's layout (8-bit codes are returned unchanged)."""
    if bits == 8:
        return codes
    xp = _xp(codes)
    k, n = codes.shape
    r = 8 // bits
    units = -(-(-(-k // tile)) // r)
    pad = units * r * tile - k
    c = xp.pad(codes.astype(xp.uint8), ((0, pad), (0, 0))).reshape(units, r, tile, n)
    out = c[:, 0]
    for j in range(1, r):
        out = out | (c[:, j] << (bits * j))
    return out.reshape(units * tile, n).astype(xp.uint8)


def unpack_plane(plane, bits: int, tile: int, k: int):
    """The inverse of pack_plane: [rows, N] -> codes [K, N] (uint8; 8-bit planes as stored)."""
    if bits == 8:
        return plane[..., :k, :]
    xp = _xp(plane)
    *lead, rows, n = plane.shape
    r = 8 // bits
    u = plane.reshape(*lead, rows // tile, 1, tile, n)
    shifts = (xp.arange(r, dtype=xp.uint8) * bits).reshape(r, 1, 1)
    codes = (u >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*lead, rows * r, n)[..., :k, :]


# Fragment order of int4 "nk" codes within every 32 of K (QuantizedWeight.frag; the Mosaic
# kernel's MgpuMatmulConfig.frag): code 8a + 2b + c (a, b < 4, c < 2) is stored at 8b + 4c + a.
# Loaded in WGMMA_UPCAST_4X, lane b of a row then holds, as one 32-bit word, WGMMA's columns
# 2b, 2b + 1 of its 8-column tiles a, the pair for tile a in nibbles a and 4 + a: each pair
# converts in place (quantized_mgpu._frag_convert), with no relayout.
def to_frag(codes):
    """codes [..., K] (K a multiple of 32) -> the same codes in fragment order."""
    xp, lead, k = _xp(codes), codes.shape[:-1], codes.shape[-1]
    c = codes.astype(xp.int8).reshape(*lead, k // 32, 4, 4, 2)  # [.., a, b, c]
    return xp.moveaxis(c, -3, -1).reshape(codes.shape).astype(codes.dtype)  # [.., b, c, a]


def from_frag(stored):
    """The inverse of to_frag."""
    xp, lead, k = _xp(stored), stored.shape[:-1], stored.shape[-1]
    c = stored.astype(xp.int8).reshape(*lead, k // 32, 4, 2, 4)  # [.., b, c, a]
    return xp.moveaxis(c, -1, -3).reshape(stored.shape).astype(stored.dtype)


def codes_of(qw: QuantizedWeight):
    """The codes [..., K, N] as int32 minus code_offset (float32 for fp8), numpy or jnp as
    stored (leading axes: a stacked weight's experts)."""
    xp = _xp(qw.planes[0])
    if qw.layout == "nk":  # centred codes (or fp8 values) [..., N, K]
        if qw.float8:
            return xp.swapaxes(qw.planes[0].astype(xp.float32), -1, -2)
        c = qw.planes[0]
        c = xp.swapaxes((from_frag(c) if qw.frag else c).astype(xp.int32), -1, -2)
        shift = nk_bias(qw.bits) - qw.code_offset
        return c + shift if shift else c
    if qw.float8:
        return qw.planes[0][..., :qw.k, :].astype(xp.float32)
    c = None
    shift = 0
    for plane, b in zip(qw.planes, qw.bits):
        v = unpack_plane(plane, b, qw.tile, qw.k).astype(xp.int32)
        c = v if c is None else c | (v << shift)
        shift += b
    return c - qw.code_offset if qw.code_offset else c


def nk_bias(bits: tuple) -> int:
    """What the "nk" plane's codes are centred by: 2 ** (b - 1) for b-bit codes below 8 (4-bit
    codes 0..15 become int4 -8..7), 0 for 8-bit ones (stored signed)."""
    b = sum(bits)
    return 1 << (b - 1) if b < 8 else 0


def group_scales(qw: QuantizedWeight):
    """(s [..., G, N], o [..., G, N] or None) in float32: the per-group scale and offset."""
    xp = _xp(qw.scale)
    f32 = xp.float32
    s = qw.scale.astype(f32)
    ratio = qw.super_group // qw.group if qw.super_group else 0
    if qw.super_scale is not None:
        s = xp.repeat(qw.super_scale.astype(f32), ratio, axis=-2)[..., :s.shape[-2], :] * s
    o = None
    if qw.offset is not None:
        o = qw.offset.astype(f32)
        if qw.super_offset is not None:
            o = -(xp.repeat(qw.super_offset.astype(f32), ratio, axis=-2)[..., :o.shape[-2], :]
                  * o)
    return s, o


def dequantize(qw: QuantizedWeight, dtype=jnp.float32):
    """w [K, *out_shape] in dtype: s * c + o in float32 per the module docstring, then cast.
    A stacked weight (arrays [E, rows, N], or any leading axes) gives [E, K, *out_shape]."""
    xp = _xp(qw.planes[0])
    c = codes_of(qw).astype(xp.float32)  # [..., K, N]
    lead = tuple(c.shape[:-2])
    s, o = group_scales(qw)
    if qw.groups == 1:
        w = c * s[..., :1, :]
        if o is not None:
            w = w + o[..., :1, :]
    else:
        g = qw.group
        kp = qw.groups * g
        pad = ((0, 0),) * len(lead) + ((0, kp - qw.k), (0, 0))
        cg = xp.pad(c, pad).reshape(*lead, qw.groups, g, -1)
        w = cg * s[..., :, None, :]
        if o is not None:
            w = w + o[..., :, None, :]
        w = w.reshape(*lead, kp, -1)[..., :qw.k, :]
    return w.reshape(*lead, *qw.shape).astype(dtype)


# ---------------------------------------------------------------------------------------------
# Stacked experts: every array with a leading expert axis
# ---------------------------------------------------------------------------------------------


def num_experts(qw: QuantizedWeight) -> int:
    """E of a stacked experts' weight (arrays [E, rows, N]); 0 for one matrix ([rows, N])."""
    return int(qw.planes[0].shape[0]) if len(qw.planes[0].shape) == 3 else 0


def stack_experts(qws) -> QuantizedWeight:
    """E per-expert QuantizedWeights of one format ([K, N] each, the same static fields and
    array shapes) -> one whose every array is [E, ...] (numpy stays numpy)."""
    qws = list(qws)
    if not qws or not all(isinstance(q, QuantizedWeight) for q in qws):
        raise ValueError("stack_experts: give one or more QuantizedWeights (one per expert)")
    first = jax.tree.structure(qws[0])
    shapes = [tuple(a.shape) for a in jax.tree.leaves(qws[0])]
    for i, q in enumerate(qws):
        if num_experts(q):
            raise ValueError(f"stack_experts: expert {i} is already stacked")
        if (jax.tree.structure(q) != first
                or [tuple(a.shape) for a in jax.tree.leaves(q)] != shapes):
            raise ValueError(f"stack_experts: expert {i} ({q.name}, K={q.k}, N={q.n}) differs "
                             f"in format or shapes from expert 0 ({qws[0].name}, K={qws[0].k}, "
                             f"N={qws[0].n}); the experts of one weight share one layout")

    def stack(*arrays):
        return _xp(arrays[0]).stack(arrays)
    return jax.tree.map(stack, *qws)


def expert_view(qw: QuantizedWeight) -> QuantizedWeight:
    """One expert's arrays as shape / dtype structs (for the shape checks of one matrix)."""
    def one(a):
        return jax.ShapeDtypeStruct(tuple(a.shape[1:]), a.dtype)
    return jax.tree.map(one, qw)


def take_experts(qw: QuantizedWeight, ids) -> QuantizedWeight:
    """The chosen experts' arrays of a stacked weight: ids [...] int -> arrays [..., rows, N]
    (dequantize gives [..., K, *N])."""
    def take(a):
        return jnp.take(a, ids, axis=0)
    return jax.tree.map(take, qw)


def check_quantized_experts(op: str, qw, e: int | None = None, k: int | None = None) -> None:
    """Raise ValueError unless qw is a stacked experts' QuantizedWeight (arrays [E, rows, N])
    whose per-expert arrays fit its layout (check_quantized), with E = e and K = k when
    given."""
    if not isinstance(qw, QuantizedWeight):
        raise ValueError(f"{op}: expected a QuantizedWeight, got {type(qw).__name__}")
    n_exp = num_experts(qw)
    if not n_exp or any(len(a.shape) != 3 or a.shape[0] != n_exp
                        for a in jax.tree.leaves(qw)):
        raise ValueError(f"{op}: the quantized experts' weight ({qw.name}) needs every array "
                         f"[E, rows, N] (stack_experts), got shapes "
                         f"{[tuple(a.shape) for a in jax.tree.leaves(qw)]}")
    if e is not None and n_exp != e:
        raise ValueError(f"{op}: the quantized experts' weight holds {n_exp} experts, "
                         f"expected {e}")
    check_quantized(op, expert_view(qw), qw.k if k is None else k)


# ---------------------------------------------------------------------------------------------
# Our formats
# ---------------------------------------------------------------------------------------------


def quantize_weight(w, *, bits: int = 8, group_size: int | None = 128, symmetric: bool = True,
                    float8: bool = False) -> QuantizedWeight:
    """w [K, *N] ([in, out]) -> QuantizedWeight, group-wise along K.

    bits=8: int8 codes in [-127, 127] (symmetric) or uint8 codes with an offset; bits=4: 4-bit
    codes, symmetric (c - 8 in [-8, 7], scale absmax / 7) or asymmetric (c in [0, 15] with a
    float zero: w = s * c + min). float8=True: e4m3 values with a float32 scale absmax / 448.
    group_size: rows per scale group (a multiple of 16 that divides K, or None / K: one scale
    per column). Scales are float16 (float32 for fp8). Works on numpy (host) or jnp arrays."""
    if not hasattr(w, "shape") or len(w.shape) < 2:
        raise ValueError(f"quantize_weight: w must be an array [K, *N] of rank >= 2, got "
                         f"{getattr(w, 'shape', type(w).__name__)}")
    xp = _xp(w)
    k, out_shape = int(w.shape[0]), tuple(int(d) for d in w.shape[1:])
    n = math.prod(out_shape)
    if bits not in (4, 8) or (float8 and bits != 8):
        raise ValueError(f"quantize_weight: bits={bits!r}: 8 or 4 (float8 is 8-bit)")
    group = k if group_size is None else int(group_size)
    if group != k and (group < 16 or group % 16 or k % group):
        raise ValueError(f"quantize_weight: group_size={group_size} must be a multiple of 16 "
                         f"that divides K={k} (or None for one scale per column)")
    tile = tile_for(group, k)
    g = k // group
    wf = w.reshape(g, group, n).astype(xp.float32)
    name = "fp8" if float8 else f"int{bits}"
    if float8:
        amax = xp.max(xp.abs(wf), axis=1)  # [G, N]
        s = xp.where(amax > 0, amax / 448.0, 1.0).astype(xp.float32)
        c = (wf / s[:, None, :]).astype(jnp.float8_e4m3fn).reshape(k, n)
        return QuantizedWeight((c,), s, k=k, out_shape=out_shape, bits=(8,), group=group,
                               tile=tile, name=name)
    if symmetric:
        qmax = 127 if bits == 8 else 7
        amax = xp.max(xp.abs(wf), axis=1)
        s = (amax / qmax).astype(xp.float16)
        sf = s.astype(xp.float32)
        q = xp.round(wf / xp.where(sf > 0, sf, 1.0)[:, None, :])
        q = xp.clip(q, -qmax - (bits == 4), qmax).reshape(k, n)
        if bits == 8:
            return QuantizedWeight((q.astype(xp.int8),), s, k=k, out_shape=out_shape, bits=(8,),
                                   group=group, tile=tile, name=name)
        plane = pack_plane((q + 8).astype(xp.uint8), 4, tile)
        return QuantizedWeight((plane,), s, k=k, out_shape=out_shape, bits=(4,), group=group,
                               tile=tile, code_offset=8, name=name)
    qmax = (1 << bits) - 1
    lo, hi = xp.min(wf, axis=1), xp.max(wf, axis=1)
    s = ((hi - lo) / qmax).astype(xp.float16)
    o = lo.astype(xp.float16)
    sf = s.astype(xp.float32)
    q = xp.round((wf - o.astype(xp.float32)[:, None, :]) / xp.where(sf > 0, sf, 1.0)[:, None, :])
    q = xp.clip(q, 0, qmax).astype(xp.uint8).reshape(k, n)
    return QuantizedWeight((pack_plane(q, bits, tile),), s, o, k=k, out_shape=out_shape,
                           bits=(bits,), group=group, tile=tile, name=name + "_asym")


def from_fp8_blocks(w, scale_inv, block: int = 128) -> QuantizedWeight:
    """An fp8 e4m3 weight w [K, N] with block scales scale_inv [K / block, N / block] (the
    DeepSeek-V3 checkpoint format, transposed to [in, out]): w_true = w * scale_inv. The
    scales are repeated along N (block rows of K stay one group)."""
    xp = _xp(w)
    k, n = w.shape
    s = xp.repeat(scale_inv.astype(xp.float32), block, axis=1)[:, :n]
    return QuantizedWeight((w,), s, k=k, out_shape=(n,), bits=(8,), group=block,
                           tile=tile_for(block, k), name="fp8_block")


# ---------------------------------------------------------------------------------------------
# What a kernel needs: the static format and the arrays in a fixed order
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """The static half of a QuantizedWeight, as a kernel reads it (hashable: a jit key)."""

    k: int
    bits: tuple
    tile: int
    group: int
    super_group: int
    code_offset: int
    float8: bool
    has_offset: bool
    has_super_scale: bool
    has_super_offset: bool

    @property
    def n_arrays(self) -> int:
        return len(self.bits) + 1 + self.has_offset + self.has_super_scale + self.has_super_offset


def weight_format(qw: QuantizedWeight) -> WeightFormat:
    return WeightFormat(qw.k, qw.bits, qw.tile, qw.group, qw.super_group, qw.code_offset,
                        qw.float8, qw.offset is not None, qw.super_scale is not None,
                        qw.super_offset is not None)


def weight_arrays(qw: QuantizedWeight) -> tuple:
    """planes..., scale, [offset], [super_scale], [super_offset]: each [rows, N] (2-D)."""
    extra = [a for a in (qw.offset, qw.super_scale, qw.super_offset) if a is not None]
    return (*qw.planes, qw.scale, *extra)


def kernel_arrays(qw: QuantizedWeight) -> tuple:
    """weight_arrays as the kernels take them: an fp8 plane as its uint8 bits."""
    arrays = weight_arrays(qw)
    if qw.float8:
        arrays = (jax.lax.bitcast_convert_type(arrays[0], jnp.uint8), *arrays[1:])
    return arrays


def check_quantized(op: str, qw, k: int) -> None:
    """Raise ValueError unless qw is a QuantizedWeight with K = k whose arrays have the shapes
    its static layout implies."""
    if not isinstance(qw, QuantizedWeight):
        raise ValueError(f"{op}: expected a QuantizedWeight, got {type(qw).__name__}")
    if qw.k != k:
        raise ValueError(f"{op}: x has K={k} features but the quantized weight has K={qw.k}")
    check_layout(qw.k, qw.n, qw.bits, qw.group, qw.tile, op)
    n = qw.n
    want = [(plane_rows(qw.k, qw.tile, b) if b < 8 else qw.k, n) for b in qw.bits]
    want.append((qw.groups, n))
    if qw.offset is not None:
        want.append((qw.groups, n))
    sup = -(-qw.k // qw.super_group) if qw.super_group else 0
    want += [(sup, n)] * ((qw.super_scale is not None) + (qw.super_offset is not None))
    for a, shape in zip(weight_arrays(qw), want):
        if tuple(a.shape) != shape:
            raise ValueError(f"{op}: quantized weight ({qw.name}, K={qw.k}, N={n}) has an "
                             f"array of shape {tuple(a.shape)} where its layout needs {shape}")


def tile_load(refs, fmt: WeightFormat, start, k_ok, col_ok, load) -> tuple:
    """In a kernel: the raw tiles of the weight's rows start .. start + tile - 1 (each plane's
    byte tile [tile, block_n], then the scale / offset rows [1, block_n]), as loaded. Kept
    apart from tile_dot so that the kernel loads tile j + 1 while it computes tile j:
    Triton's pipeliner leaves loads whose values feed elementwise math in place."""
    from jax.experimental import pallas as pl

    tile = fmt.tile
    t = start // tile
    mask = k_ok[:, None] if col_ok is None else k_ok[:, None] & col_ok
    raw = []
    for ref, b in zip(refs, fmt.bits):
        row0 = start if b == 8 else (t // (8 // b)) * tile
        raw.append(load(ref.at[pl.ds(row0, tile), :], mask))  # [tile, block_n]
    g = jnp.minimum(start // fmt.group, -(-fmt.k // fmt.group) - 1)
    sup = jnp.minimum(start // fmt.super_group, -(-fmt.k // fmt.super_group) - 1) \
        if fmt.super_group else None
    rows = [g] + [g] * fmt.has_offset + [sup] * (fmt.has_super_scale + fmt.has_super_offset)
    for ref, i in zip(refs[len(fmt.bits):], rows):
        raw.append(load(ref.at[pl.ds(i, 1), :], col_ok))  # [1, block_n]
    return tuple(raw)


def tile_dot(x, raw: tuple, fmt: WeightFormat, start):
    """In a kernel: x [block_m, tile] @ the weight tile at `start` (tile_load's raw tiles),
    dequantized in registers, as float32 [block_m, block_n]. The scale (one row per tile)
    multiplies the float32 dot, the offset the rows' sums of x: s * (x @ c) + o * sum(x) =
    x @ (s * c + o), the codes exact in x's dtype (integers below 256)."""
    t = start // fmt.tile
    c = None
    shift = 0
    for v, b in zip(raw, fmt.bits):
        if b == 8:
            # fp8 comes as its uint8 bits (kernel_arrays): a masked load's zero fill cannot
            # be cast to float8 by the Triton lowering.
            c = jax.lax.bitcast_convert_type(v, jnp.float8_e4m3fn) if fmt.float8 \
                else v.astype(jnp.int32)
        else:
            r = 8 // b
            v = v.astype(jnp.int32)
            if r > 1:
                # lax.rem, not %: jnp's remainder guards a zero divisor with a select that
                # Pallas Triton lowers to i1 inside a fori_loop step (AssertionError i32/i1)
                v = (v >> (b * lax.rem(t, r))) & ((1 << b) - 1)
            c = v if c is None else c | (v << shift)
        shift += b

    if fmt.code_offset:
        c = c - fmt.code_offset
    acc = jax.lax.dot_general(x, c.astype(x.dtype), (((1,), (0,)), ((), ())),
                              precision=jax.lax.Precision.HIGHEST
                              if x.dtype == jnp.float32 else None,
                              preferred_element_type=jnp.float32)
    rest = iter(raw[len(fmt.bits):])
    s = next(rest).astype(jnp.float32)  # [1, block_n]
    o = next(rest).astype(jnp.float32) if fmt.has_offset else None
    if fmt.has_super_scale:
        s = next(rest).astype(jnp.float32) * s
    acc = acc * s
    if o is not None:
        if fmt.has_super_offset:
            o = -(next(rest).astype(jnp.float32) * o)
        acc = acc + jnp.sum(x.astype(jnp.float32), axis=1, keepdims=True) * o
    return acc


