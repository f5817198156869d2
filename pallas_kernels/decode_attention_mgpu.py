"""Decode attention with RoPE and the K/V append, for Hopper on the Pallas Mosaic GPU backend.

Same contract as `decode_attention_append.decode_attention_append` for one new token per row
and a cache walked by one program per (row, KV head): the fused projection's q/k/v rows (one
16-bit array or float32 split-K parts, with the deferred RMSNorm), rotate-half RoPE, slot
`positions[b]` written, the queries attending to slots <= positions[b]. Why a second kernel: at
batch 1 the Pallas Triton kernel spends ~4 of its ~6 us in a dependent chain over its 1-3 cache
tiles (benchmarks/NOTES.md, runs H and I: warp-level mma chains and softmax per tile, its loads
issued only after the query gather). Here (one warpgroup per program):

  * every cache tile below the new slot's tile is requested with TMA at the kernel's start, into
    a ring of `stages` shared-memory slots, so the loads run under the gather;
  * the gather (the parts' sum, the deferred norm, RoPE, one rounding to the cache dtype, as
    the Triton kernel does) runs on [64, D/2] tiles in the wgmma register layout; the parts and
    the rotation tables come in with TMA (rows past the group's G + 2 are other heads' or
    zero-filled, and never stored);
  * the new key and value rows are stored into the cache with TMA, and once that store is
    complete the new slot's own tile is loaded like the others: every slot <= positions[b] is
    then read from the cache, the new one included (its value is the rounded, rotated row the
    store wrote, as the Triton kernel's own running softmax starts from);
  * per tile, S = Q K^T and O += P V on the tensor cores (wgmma, M = 64 query rows of which G
    are real), online softmax in float32 registers (base 2).

Scope (`supports`): no sliding window, head dim 128 (two 64-column halves for RoPE and the
128-byte swizzle), G + 2 <= 64, a cache of whole tiles. The Triton kernel stays the default
(`decode_attention_append`); this one is chosen by `layers.DECODE_ATTENTION` (see there).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import LOG2_E, MASK_VALUE

ROWS = 64  # wgmma's M: the group's query rows (G of them real), then k_new, v_new
WGMMA = plgpu.Layout.WGMMA


@dataclasses.dataclass(frozen=True)
class DecodeMosaicConfig:
    """block_kv: cache slots per tile; stages: ring slots (tiles in flight)."""
    block_kv: int = 64
    stages: int = 3

    def __post_init__(self):
        if self.block_kv % 64 or self.block_kv > 256 or self.stages < 1:
            raise ValueError(f"DecodeMosaicConfig: block_kv={self.block_kv} must be a multiple "
                             f"of 64 (<= 256), stages={self.stages} >= 1")


SMEM_LIMIT = 227 * 1024


def smem_bytes(cfg: DecodeMosaicConfig, d: int, parts: int, itemsize: int = 2) -> int:
    ring = 2 * cfg.stages * cfg.block_kv * d * itemsize
    gather = parts * ROWS * d * 4 + 2 * ROWS * (d // 2) * 4  # parts, cos/sin tables (float32)
    rows = ROWS * d * itemsize  # new rows, then the output
    interpret_q = ROWS * d * itemsize
    return ring + gather + rows + interpret_q + 1024


def supports(qkv_shape, k_cache, cfg: DecodeMosaicConfig, window) -> str | None:
    """None when this kernel can run the call, else why not."""
    *_, rows, d = qkv_shape
    if window is not None:
        return "sliding window"
    if d != 128:
        return f"head dim {d} (needs 128)"
    if rows > ROWS:
        return f"{rows - 2} query heads per KV head (needs <= {ROWS - 2})"
    if jnp.dtype(k_cache.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cache dtype {k_cache.dtype}"
    if k_cache.shape[1] % cfg.block_kv:
        return f"cache of {k_cache.shape[1]} slots (needs a multiple of {cfg.block_kv})"
    parts = len(qkv_shape) - 4 if len(qkv_shape) == 5 else 1
    if smem_bytes(cfg, d, qkv_shape[0] if len(qkv_shape) == 5 else 1) > SMEM_LIMIT:
        return f"config {cfg} needs more than {SMEM_LIMIT} bytes of shared memory"
    del parts
    return None


def _swizzled(dtype):
    swizzle = 128
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def _kernel(pos_ref, ss_ref, cs_ref, *refs, parts: int, groups: int, cfg: DecodeMosaicConfig,
            qk_scale: float, norm, interpret: bool):
    # pos_ref [B] int32; ss_ref [P, B] float32 (norm) or [1, 1] unused; cs_ref [B, 2, 64, D/2]
    # float32: per row r the cos / sin of that row's rotation (identity on the value row)
    # refs: P parts [P, B * Hkv * (G + 2), D] (a view of the projection's rows), the caches
    # [B, S, Hkv, D] (refs, updated in place), o_ref [B, Hkv, G, D], then the scratch:
    # part_smem [P, 64, D] f32, cs_smem [2, 64, D/2] f32, rows_smem [64, D] (new rows, then the
    # output), k_smem / v_smem [stages, block_kv, D], q_smem [64, D] (interpret: the staged
    # query), p_smem [64, block_kv] (interpret: the staged P), barriers.
    (qkv_ref, k_ref, v_ref, o_ref, part_smem, cs_smem, rows_smem, k_smem, v_smem, q_smem,
     p_smem, gather_ready, k_ready, v_ready) = refs
    bkv, stages = cfg.block_kv, cfg.stages
    b, h = lax.axis_index("b"), lax.axis_index("h")
    hkv, d = k_ref.shape[2], k_ref.shape[3]
    half = d // 2
    dtype = k_ref.dtype
    pos = pos_ref[b]
    last = pos // bkv  # the tile holding the new slot; tiles 0..last are walked
    ahead = min(stages, k_ref.shape[1] // bkv)  # tiles requested before the loop

    def issue(t, slot):
        start = t * bkv if isinstance(t, int) else pl.multiple_of(t * bkv, bkv)
        rows = pl.ds(start, bkv)
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h], k_smem.at[slot], k_ready.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[b, rows, h], v_smem.at[slot], v_ready.at[slot])

    # The cache tiles below the new slot's: requested now, they land during the gather.
    for t in range(ahead):
        pl.when(t < last)(functools.partial(issue, t, t))

    # The gather: the group's G + 2 rows of every part, and the rotation tables.
    first_row = (b * hkv + h) * (groups + 2)
    for p in range(parts):
        plgpu.copy_gmem_to_smem(qkv_ref.at[p, pl.ds(first_row, ROWS)], part_smem.at[p],
                                gather_ready.at[p])
    plgpu.copy_gmem_to_smem(cs_ref.at[b], cs_smem, gather_ready.at[parts])
    inv_rms = None
    if norm is not None:
        k_dim, eps = norm
        sum_sq = ss_ref[0, b]
        for p in range(1, parts):
            sum_sq += ss_ref[p, b]
        inv_rms = lax.rsqrt(sum_sq / k_dim + eps)
    for i in range(parts + 1):
        plgpu.barrier_wait(gather_ready.at[i])

    def gathered(cols):
        """The parts' sum over columns `cols` [64, D/2] float32, times inv_rms, rounded once to
        the cache dtype (as the projection would), back in float32."""
        total = None
        for p in range(parts):
            x = plgpu.load(part_smem.at[p, :, cols], layout=WGMMA)
            total = x if total is None else total + x
        if inv_rms is not None:
            total = total * inv_rms
        return total.astype(dtype).astype(jnp.float32)

    lo, hi = gathered(pl.ds(0, half)), gathered(pl.ds(half, half))
    cos = plgpu.load(cs_smem.at[0], layout=WGMMA)
    sin = plgpu.load(cs_smem.at[1], layout=WGMMA)
    # Rotate-half RoPE in float32, rounded once more (identity on the value row).
    rows_smem[:, pl.ds(0, half)] = (lo * cos - hi * sin).astype(dtype)
    rows_smem[:, pl.ds(half, half)] = (hi * cos + lo * sin).astype(dtype)
    plgpu.commit_smem()
    # The new key and value into slot pos; the new slot's tile is read only after that.
    plgpu.copy_smem_to_gmem(rows_smem.at[pl.ds(groups, 1)], k_ref.at[b, pl.ds(pos, 1), h])
    plgpu.copy_smem_to_gmem(rows_smem.at[pl.ds(groups + 1, 1)], v_ref.at[b, pl.ds(pos, 1), h])
    q = plgpu.load(rows_smem, layout=WGMMA)  # [64, D]: rows < G are the rotated queries
    if interpret:  # the interpreter takes no register operand for wgmma
        q_smem[...] = q
        plgpu.commit_smem()
        q = q_smem
    plgpu.wait_smem_to_gmem(0)
    for t in range(ahead):
        pl.when(t == last)(functools.partial(issue, t, t))

    def tile(j, carry):
        acc, m, l = carry  # [64, D] f32, [64], [64] f32 (WGMMA rows)
        slot = lax.rem(j, stages)
        plgpu.barrier_wait(k_ready.at[slot])

        def qk(s_ref):
            plgpu.wgmma(s_ref, q, k_smem.at[slot].transpose((1, 0)))
            return s_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((ROWS, bkv), jnp.float32))  # [64, block_kv]
        key = plgpu.broadcasted_iota(jnp.int32, (ROWS, bkv), 1, layout=WGMMA) + j * bkv
        visible = key <= pos
        s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1) * qk_scale)
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
        p = jnp.where(visible, p, 0.0)
        l = l * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        p16 = p.astype(dtype)
        plgpu.barrier_wait(v_ready.at[slot])
        if interpret:
            p_smem[...] = p16
            plgpu.commit_smem()

            def pv_fresh(o_ref):
                plgpu.wgmma(o_ref, p_smem, v_smem.at[slot])
                return o_ref[...]

            acc = acc + pl.run_scoped(pv_fresh, plgpu.ACC((ROWS, d), jnp.float32))
        else:
            def pv(o_ref):
                plgpu.wgmma(o_ref, p16, v_smem.at[slot])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))  # waits for the product

        @pl.when(j + stages <= last)
        def _refill():  # the slot is free: the tile `stages` ahead (the store is complete)
            issue(j + stages, slot)

        return acc, m_new, l

    init = (plgpu.layout_cast(jnp.zeros((ROWS, d), jnp.float32), WGMMA),
            plgpu.layout_cast(jnp.full((ROWS,), MASK_VALUE, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1)),
            plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))
    acc, m, l = lax.fori_loop(0, last + 1, tile, init)
    out = acc / lax.broadcast_in_dim(l, acc.shape, [0])  # l >= 1: the new slot is visible
    rows_smem[...] = out.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(rows_smem.at[pl.ds(0, groups)], o_ref.at[b, h])
    plgpu.wait_smem_to_gmem(0)


def rotation_tables(cos, sin, groups: int):
    """cos, sin [B, D] (rotate-half tables, halves equal) -> [B, 2, 64, D/2] float32: the
    first half of each, on every one of the kernel's 64 rows, the value row's (G + 1) an
    identity (cos 1, sin 0). One XLA op per step: every layer's call builds the same one."""
    b, d = cos.shape
    row = jnp.arange(ROWS)[None, :, None]  # [1, 64, 1]
    value_row = row == groups + 1
    c = jnp.where(value_row, 1.0, cos[:, None, : d // 2].astype(jnp.float32))
    s = jnp.where(value_row, 0.0, sin[:, None, : d // 2].astype(jnp.float32))
    return jnp.stack([jnp.broadcast_to(c, (b, ROWS, d // 2)),
                      jnp.broadcast_to(s, (b, ROWS, d // 2))], axis=1)


def decode_attention_append_mgpu(qkv, k_cache, v_cache, positions, *, rope, sm_scale=None,
                                 norm=None, config: DecodeMosaicConfig | None = None,
                                 interpret: bool = False):
    """decode_attention_append's contract (see there; `supports` lists what this kernel
    takes): qkv [B, Hkv, G + 2, D] or float32 parts [P, B, Hkv, G + 2, D]; rope (cos, sin)
    [B, D], required (without RoPE, the Triton kernel); norm (ss [P, B], K, eps) or None.
    Returns (out [B, Hq, D], k_cache, v_cache); the caches are updated in place inside a jit
    that donates them."""
    cfg = config or DecodeMosaicConfig()
    reason = supports(qkv.shape, k_cache, cfg, None)
    if reason is not None:
        raise ValueError(f"decode_attention_append_mgpu: unsupported {reason}")
    if rope is None:
        raise ValueError("decode_attention_append_mgpu: needs rope=(cos, sin); without RoPE "
                         "use decode_attention_append")
    d = qkv.shape[-1]
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    ss, norm_static = None, None
    if norm is not None:
        ss, norm_static = norm[0], (int(norm[1]), float(norm[2]))
    return _decode_attention_append_mgpu(qkv, k_cache, v_cache, positions, rope[0], rope[1], ss,
                                         sm_scale=sm_scale, norm=norm_static, cfg=cfg,
                                         interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "norm", "cfg", "interpret"))
def _decode_attention_append_mgpu(qkv, k_cache, v_cache, positions, cos, sin, ss, *, sm_scale,
                                  norm, cfg, interpret):
    if qkv.ndim == 4:
        qkv = qkv[None]  # one part
    parts, b, hkv, rows, d = qkv.shape
    groups = rows - 2
    # The parts as rows: a view, no copy. The TMA box of 64 rows from a group's first row runs
    # into the next groups' rows (never stored) and, past the last, is zero-filled.
    flat = qkv.reshape(parts, b * hkv * rows, d)
    if flat.dtype != jnp.float32:
        flat = flat.astype(jnp.float32)
    tables = rotation_tables(cos, sin, groups)
    ss = ss if ss is not None else jnp.zeros((1, 1), jnp.float32)
    k_ref, v_ref = jax.new_ref(k_cache), jax.new_ref(v_cache)
    dtype = k_cache.dtype
    swz = _swizzled(dtype)
    out = plgpu.kernel(
        functools.partial(_kernel, parts=parts, groups=groups, cfg=cfg,
                          qk_scale=sm_scale * LOG2_E, norm=norm, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((b, hkv, groups, d), dtype),
        scratch_types=[
            plgpu.SMEM((parts, ROWS, d), jnp.float32),
            plgpu.SMEM((2, ROWS, d // 2), jnp.float32),
            plgpu.SMEM((ROWS, d), dtype),
            plgpu.SMEM((cfg.stages, cfg.block_kv, d), dtype, transforms=swz),
            plgpu.SMEM((cfg.stages, cfg.block_kv, d), dtype, transforms=swz),
            plgpu.SMEM((ROWS, d) if interpret else (8, d), dtype, transforms=swz),
            plgpu.SMEM((ROWS, cfg.block_kv) if interpret else (8, 64), dtype, transforms=swz),
            plgpu.Barrier(num_barriers=parts + 1),  # the gather's parts, the tables
            plgpu.Barrier(num_barriers=cfg.stages),  # k_ready
            plgpu.Barrier(num_barriers=cfg.stages),  # v_ready
        ],
        grid=(b, hkv),
        grid_names=("b", "h"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(positions, ss, tables, flat, k_ref, v_ref)
    return out.reshape(b, hkv * groups, d), k_ref[...], v_ref[...]
