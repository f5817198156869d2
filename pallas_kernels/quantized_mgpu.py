"""int4 / int8 / fp8 decode matmul for Hopper on the Pallas Mosaic GPU backend.

    y [M, N] = x [M, K] @ (codes [N, K] * scale[g, n])     codes int4, int8 or fp8 e4m3,
                                                           groups of 128

Swapped operands: the weight is wgmma's A operand (its N rows are the MMA's M side, 64 per
block) and x^T its B operand (M <= 64 rows padded to a multiple of 8 are the MMA's N side),
so one decode row costs an m64n8 product, not an m64 tile of padding. Per K step of `gps`
groups: TMA brings the [64, gps * 128] code tile (K contiguous per output column), x's
[Mp, gps * 128] tile and the groups' scales into shared memory; the block's one warpgroup
loads each group's codes in the upcast layout and converts them to bf16 (exact; int4: Mosaic's
lop3 path, two codes per instruction), issues one wgmma per group with A from registers into
a fresh float32 accumulator, waits once for the step, and adds each group's product times its
scales (a row each) to the running sum in registers, while `plgpu.emit_pipeline` keeps
`stages` TMA steps in flight (small blocks, several per SM). Scaling the [64, Mp] products
instead of the [64, 128] code tiles leaves the codes unrounded and costs 1.4-1.5x less with
fp16 scales (benchmarks/DECISIONS.md, with the schedules that lost: scales before the product,
a wait per group, 128-row blocks, warp specialization). The sum [64, Mp] f32 goes out
transposed ([N, Mp]); `splits` cuts K into that many ranges (a grid axis), summed in float32
by the wrapper.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.quantized import (QuantizedWeight, codes_of, dequantize, pack_plane,
                                      tile_for)

GROUP = 128  # the K step: one scale row per step
BN = 64  # weight rows (output columns) per block: one wgmma M

_WGMMA = plgpu.Layout.WGMMA
_WGMMA_ROW = plgpu.Layout.WGMMA.reduce(1)
# The register layout a code tile is loaded in, by code bits: one that converts to the wgmma
# layout with few shuffles once upcast to 16 bits.
_UPCAST = {4: plgpu.Layout.WGMMA_UPCAST_4X, 8: plgpu.Layout.WGMMA_UPCAST_2X}
_CODES = {4: jnp.int4, 8: jnp.int8}


@dataclasses.dataclass(frozen=True)
class MgpuMatmulConfig:
    """gps: groups of 128 per K step (one TMA tile); stages: K steps in flight; splits: K
    ranges (grid axis, float32 partial sums). A block takes BN = 64 weight rows (one wgmma M)."""
    gps: int = 2
    stages: int = 4
    splits: int = 1

    def __str__(self):
        return f"g{self.gps}_s{self.stages}_k{self.splits}"


def _smem_transforms(row_bits: int, dtype_bits: int):
    """Tiling + swizzle for a tile whose rows are row_bits wide (TMA and wgmma both read it)."""
    swizzle = min(128, row_bits // 8)
    return (plgpu.TilingTransform((8, swizzle * 8 // dtype_bits)),
            plgpu.SwizzleTransform(swizzle))


def nk_unfit(qw: QuantizedWeight) -> str | None:
    """Why qw cannot take the "nk" layout (None: it can): symmetric int4, int8 or fp8 e4m3 in
    groups of 128 (fp8 also one scale per column) of a [K, N] matrix or a stack of experts'
    [E, K, N], N a multiple of 64."""
    if qw.layout == "nk":
        return None
    signed8 = qw.bits == (8,) and qw.planes[0].dtype in (jnp.int8, jnp.float8_e4m3fn)
    group_ok = qw.group == GROUP or (qw.float8 and qw.group == qw.k)  # fp8: or per column
    if not (qw.bits == (4,) or signed8) or not group_ok or qw.offset is not None \
            or qw.super_scale is not None:
        return f"{qw.name}: not symmetric int4 / int8 / fp8 e4m3 in groups of {GROUP}"
    if qw.k % GROUP or qw.n % 64:
        return f"K={qw.k} not a multiple of {GROUP} or N={qw.n} not a multiple of 64"
    return None


def _t(a):
    return jnp.swapaxes(a, -1, -2)


def to_nk(qw: QuantizedWeight) -> QuantizedWeight:
    """The same weight in the "nk" layout (pallas_kernels/quantized.py): codes [N, K] int4,
    int8 or fp8 e4m3 ([E, N, K] for stacked experts). One fp8 scale per column becomes the
    same scale per group of 128."""
    if qw.layout == "nk":
        return qw
    if (why := nk_unfit(qw)) is not None:
        raise ValueError(f"to_nk: {why}")
    lead = qw.planes[0].shape[:-2]  # (E,) for stacked experts
    if qw.float8:
        if qw.group != GROUP:  # [1, N] -> [K / 128, N], the same values
            qw = qw.replace(scale=jnp.repeat(qw.scale, qw.k // GROUP, axis=-2), group=GROUP,
                            tile=tile_for(GROUP, qw.k))
        return qw.replace(planes=(_t(jnp.asarray(qw.planes[0]).reshape(*lead, qw.k, qw.n)),),
                          layout="nk")
    codes = jnp.asarray(codes_of(qw)).reshape(*lead, qw.k, qw.n)  # [.., K, N] int32, signed
    return qw.replace(planes=(_t(codes).astype(_CODES[qw.bits[0]]),), layout="nk")


def to_tiles(qw: QuantizedWeight) -> QuantizedWeight:
    """An "nk" weight back in the tiles layout the Triton kernels read (the planes it had)."""
    if qw.layout != "nk":
        return qw
    if qw.float8:
        return qw.replace(planes=(_t(qw.planes[0]),), layout="tiles")
    codes = codes_of(qw) + qw.code_offset  # [..., K, N] as stored
    pack = functools.partial(pack_plane, bits=4, tile=qw.tile)
    for _ in codes.shape[:-2]:  # one plane per expert
        pack = jax.vmap(pack)
    plane = codes.astype(jnp.int8) if qw.bits == (8,) else pack(codes)
    return qw.replace(planes=(plane,), layout="tiles")


MIN_BLOCKS = 128  # about one block per SM (the H200 has 132)


def default_config(m: int, k: int, n: int) -> MgpuMatmulConfig:
    """Two groups a step, four steps in flight, K in four ranges, as the groups allow (the
    best or within 5% of it at every decode shape of Llama-3-8B at M = 1 and 16). Above 16
    rows each block's x tile costs as much as its codes: the fewest K ranges that still give
    about every SM a block (M = 64: 1.1-1.2x faster than four ranges; benchmarks/DECISIONS.md)."""
    groups = k // GROUP
    gps = 2 if groups % 2 == 0 else 1
    fits = [sp for sp in (4, 2, 1) if groups % (sp * gps) == 0]
    splits = fits[0]
    if m > 16:
        splits = min((sp for sp in fits if n // BN * sp >= MIN_BLOCKS), default=splits)
    return MgpuMatmulConfig(gps=gps, stages=4, splits=splits)


def quantized_matmul_mgpu(x, qw, *, experts=None, cfg: MgpuMatmulConfig | None = None,
                          interpret: bool = False, out_dtype=None):
    """x [M, K] (M <= 64) @ dequantize(qw) for an "nk" weight -> [M, N] in out_dtype (x's).
    qw a tuple of nk weights with the same K and code dtype (gate and up): one launch, a
    tuple of outputs. experts = (ids [A], rows [A]) for stacked experts' weights: assignment
    a's x row rows[a] times expert ids[a] -> [A, N] (int_matmul_mgpu)."""
    qws = qw if isinstance(qw, tuple) else (qw,)
    for w in qws:
        if w.layout != "nk":
            raise ValueError(f"quantized_matmul_mgpu: {w.name} weight is not in the nk layout "
                             f"(to_nk)")
    rows = x.shape[0] if experts is None else experts[0].shape[0]
    cfg = cfg or default_config(rows, qws[0].k, sum(w.n for w in qws))
    out = int_matmul_mgpu(x, tuple(w.planes[0] for w in qws), tuple(w.scale for w in qws),
                          experts, cfg=cfg, interpret=interpret,
                          out_dtype=jnp.dtype(out_dtype or x.dtype))
    return out if isinstance(qw, tuple) else out[0]


def _bits(dtype) -> int:
    return 4 if dtype == jnp.int4 else 8  # int8, fp8 e4m3


def _codes(w_smem, j):
    """Group j of the code tile -> bf16 [bn, 128] codes (exact: int4, int8, fp8 e4m3) in the
    wgmma layout."""
    bits = _bits(w_smem.dtype)
    w = plgpu.load(w_smem.at[:, pl.ds(j * GROUP, GROUP)], layout=_UPCAST[bits])
    w = plgpu.layout_cast(w, _WGMMA)
    if w.dtype == jnp.float8_e4m3fn:  # Hopper converts e4m3 to f16 only; both exact here
        w = w.astype(jnp.float16)
    return w.astype(jnp.bfloat16)


def _row_scale(s_smem, j, shape):
    """Group j's scales [64] as float32, broadcast along the rows of shape (wgmma layout)."""
    s = plgpu.load(s_smem.at[j], layout=_WGMMA_ROW).astype(jnp.float32)
    return lax.broadcast_in_dim(s, shape, [0])


@functools.partial(jax.jit, static_argnames=("cfg", "interpret", "out_dtype"))
def int_matmul_mgpu(x, codes: tuple, scale: tuple, experts=None, *,
                    cfg: MgpuMatmulConfig = MgpuMatmulConfig(), interpret: bool = False,
                    out_dtype=jnp.bfloat16):
    """x [M, K] bf16 @ dequantize(codes_i [N_i, K] int4 / int8 / fp8, scale_i [K / 128, N_i])
    for each weight i -> a tuple of [M, N_i] out_dtype (float32 sums). The weights' blocks
    share one grid: one launch, the blocks of weight i where the grid's index falls in its
    range.

    experts = (ids [A], rows [A]) int32: stacked experts' weights (codes_i [E, N_i, K],
    scale_i [E, K / 128, N_i]); assignment a multiplies x's row rows[a] by expert ids[a]'s
    weight -> a tuple of [A, N_i] (a MoE layer's decode: only the chosen experts' codes are
    read). Each assignment's blocks multiply all M rows of x (the MMA's N side is 8 rows at
    least anyway) and keep row rows[a]'s column."""
    m, k = x.shape
    if not codes or len(codes) != len(scale) or len({c.dtype for c in codes}) != 1 \
            or len({c.shape[:-2] for c in codes}) != 1:
        raise ValueError("int_matmul_mgpu: codes and scales: one of each per weight, one code "
                         "dtype, one expert count")
    lead = codes[0].shape[:-2]  # (E,) for stacked experts, else ()
    if (experts is None) != (lead == ()) or len(lead) > 1:
        raise ValueError(f"int_matmul_mgpu: codes {codes[0].shape} need experts=(ids, rows) "
                         f"exactly when they are stacked [E, N, K]")
    for c, sc in zip(codes, scale):
        n, k2 = c.shape[-2:]
        if k2 != k or k % GROUP or sc.shape != (*lead, k // GROUP, n) or c.dtype not in (
                jnp.int4, jnp.int8, jnp.float8_e4m3fn):
            raise ValueError(f"int_matmul_mgpu: x {x.shape}, codes {c.shape}, scale "
                             f"{sc.shape} do not fit groups of {GROUP}")
        if n % BN:
            raise ValueError(f"int_matmul_mgpu: N {n} not a multiple of {BN}")
    if experts is not None:  # the experts' arrays as one [E * N_i, K] / [E * G, N_i] each
        codes = tuple(c.reshape(-1, k) for c in codes)
        scale = tuple(sc.reshape(-1, sc.shape[-1]) for sc in scale)
        ids, rows = (jnp.asarray(v, jnp.int32).reshape(-1) for v in experts)
        assignments = ids.shape[0]
    else:
        ids, rows, assignments = None, None, 1
    if m > 64:
        raise ValueError(f"int_matmul_mgpu is a decode kernel: M = {m} > 64")
    gps, bn = cfg.gps, BN
    if (k // GROUP) % (cfg.splits * gps):
        raise ValueError(f"int_matmul_mgpu: K groups {k // GROUP} not a multiple of splits x "
                         f"gps {cfg.splits * gps}")
    # x's tiles are Mp rows: TMA fills the rows past M with zeros (no pad op before the
    # kernel); they only reach output columns that are sliced off. The interpreter takes no
    # out-of-bounds read: it gets x padded.
    mp = max(8, -(-m // 8) * 8)
    x = x.astype(jnp.bfloat16)
    if interpret and mp != m:
        x = jnp.pad(x, ((0, mp - m), (0, 0)))
    bk = gps * GROUP
    steps = k // bk // cfg.splits
    bits = _bits(codes[0].dtype)
    w_tr = _smem_transforms(GROUP * bits, bits)  # one group wide: a group is a slice of them
    x_tr = _smem_transforms(bk * 16, 16)
    in_specs = [
        plgpu.BlockSpec((bn, bk), lambda i: (0, i), transforms=w_tr),
        plgpu.BlockSpec((mp, bk), lambda i: (0, i), transforms=x_tr),
        plgpu.BlockSpec((gps, bn), lambda i: (i, 0)),
    ]
    ns = [sc.shape[-1] for sc in scale]  # each weight's N
    starts = [sum(ns[:i]) // bn for i in range(len(ns) + 1)]  # each weight's first block
    nw = len(codes)
    groups = k // GROUP

    def kernel(*refs):
        if experts is not None:
            ids_gmem, refs = refs[0], refs[1:]
        x_gmem, refs = refs[0], refs[1:]
        w_refs, s_refs, (o_gmem, o_smem) = refs[:nw], refs[nw:2 * nw], refs[2 * nw:]
        nb, sp = lax.axis_index("n"), lax.axis_index("s")
        k0 = sp * steps * bk  # the split's first K
        # an assignment's blocks are consecutive: block j of its expert's weights
        e = ids_gmem[nb // starts[-1]] if experts is not None else 0
        j = nb % starts[-1] if experts is not None else nb

        def block(w_gmem, s_gmem, n_w, wb):  # block wb of one weight -> out rows from nb * bn
            ops = (w_gmem.at[pl.ds(e * n_w + wb * bn, bn), pl.ds(k0, steps * bk)],
                   x_gmem.at[:, pl.ds(k0, steps * bk)],
                   s_gmem.at[pl.ds(e * groups + k0 // GROUP, steps * gps), pl.ds(wb * bn, bn)])
            pipe = functools.partial(plgpu.emit_pipeline, grid=(steps,), in_specs=in_specs,
                                     max_concurrent_steps=cfg.stages)

            def products(w_smem, x_smem):  # [codes_j @ x_j^T for the step's groups j]
                if interpret:  # the GPU interpreter takes no register operand for wgmma
                    return [jnp.dot(_codes(w_smem, j), x_smem[:, pl.ds(j * GROUP, GROUP)].T,
                                    preferred_element_type=jnp.float32) for j in range(gps)]

                def scope(*accs):
                    for j, acc_ref in enumerate(accs):
                        plgpu.wgmma(acc_ref, _codes(w_smem, j),
                                    x_smem.at[:, pl.ds(j * GROUP, GROUP)].T)
                    return [acc_ref[...] for acc_ref in accs]  # one wait for the step's groups
                return pl.run_scoped(scope, *[plgpu.ACC((bn, mp), jnp.float32)] * gps)

            def body(_, w_smem, x_smem, s_smem, acc):  # acc [bn, Mp] += product_j * scale_j
                for j, part in enumerate(products(w_smem, x_smem)):
                    acc = acc + part * _row_scale(s_smem, j, part.shape)
                return acc
            zero = jnp.zeros((bn, mp), jnp.float32)
            acc = pipe(body, init_carry=zero if interpret else
                       plgpu.layout_cast(zero, _WGMMA))(*ops)
            o_smem[...] = acc  # [bn, Mp] f32
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[sp, pl.ds(nb * bn, bn)])
            plgpu.wait_smem_to_gmem(0)

        if nw == 1:
            block(w_refs[0], s_refs[0], ns[0], j)
        else:  # the weight whose blocks hold index j
            for i in range(nw):
                pl.when((j >= starts[i]) & (j < starts[i + 1]))(
                    functools.partial(block, w_refs[i], s_refs[i], ns[i], j - starts[i]))

    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((cfg.splits, assignments * starts[-1] * bn, mp),
                                      jnp.float32),
        scratch_types=[plgpu.SMEM((bn, mp), jnp.float32)],
        grid=(assignments * starts[-1], cfg.splits),
        grid_names=("n", "s"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(*(() if ids is None else (ids,)), x, *codes, *scale)
    y = jnp.sum(out, axis=0)  # [splits, A * N, Mp] f32 -> [A * N, Mp]
    if experts is None:
        y = y[:, :m].T  # [M, N]
    else:  # [A, N, Mp] -> each assignment's row: [A, N]
        y = y.reshape(assignments, -1, mp)
        y = jnp.take_along_axis(y, rows[:, None, None], axis=2)[..., 0]
    y = y.astype(out_dtype)
    return tuple(y[:, starts[i] * bn:starts[i + 1] * bn] for i in range(nw))


def quantized_matmul_mgpu_reference(x, qw: QuantizedWeight, *, cfg=None, interpret=False,
                                    out_dtype=None):
    """The same in plain jnp: x @ dequantize(qw) in float32 -> out_dtype (x's)."""
    y = jnp.dot(x.astype(jnp.float32), dequantize(qw, jnp.float32).reshape(qw.k, qw.n),
                precision=lax.Precision.HIGHEST)
    return y.astype(out_dtype or x.dtype)
