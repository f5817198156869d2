"""Flash attention (prefill) for Hopper on the Pallas Mosaic GPU backend.

Same semantics as `flash_attention.flash_attention` (causal, sliding window, GQA, Tq <= Tk with
the queries at the end, any length); bf16/fp16 only, head dim a multiple of 64.

One CUDA block handles 2 x `block_q` queries of one query head with three warpgroups:
  * warpgroup 2 (producer, few registers) streams K and V tiles of the head's KV group into a
    ring of `stages` shared-memory slots with TMA, waiting on per-slot "free" barriers;
  * warpgroups 0 and 1 (consumers, many registers) each own `block_q` query rows: per KV tile,
    S = Q K^T on the tensor cores (wgmma, Q and K from shared memory), online softmax in
    registers (float32, base 2), O += P V (wgmma with P from registers), then release the slot.
With `pingpong`, a two-party barrier makes the consumers alternate, so one warpgroup's softmax
overlaps the other's matrix products (the FlashAttention-3 schedule). `overlap` shortens or
removes the gap between a warpgroup's P V and its next Q K^T (see the config).

The producer loads the block's KV range (the union of its rows' visible keys). By default both
consumers walk all of it; with `wg_ranges` (opt-in) each walks its own rows' range and only
takes part in the barrier protocol for the tiles outside it. A range runs in ascending order:
masked edge tiles (sliding-window lower edge), tiles visible in full (no mask arithmetic), masked
edge tiles (causal diagonal, ragged end). Masked scores get a finite MASK_VALUE, so a row whose
first tile is fully masked carries no NaN (see _common.py).
Sequence lengths that are not tile multiples are padded in the wrapper (a copy only then).
Causal blocks run longest first, per section of one KV group's heads (see the kernel).
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


# How a consumer warpgroup orders its matrix products (MosaicFlashConfig.overlap).
OVERLAPS = ("none", "qk_pv", "qk_pv_intra")


@dataclasses.dataclass(frozen=True)
class MosaicFlashConfig:
    """block_q: rows per consumer warpgroup (the block handles 2 x block_q); block_kv: keys per
    tile; stages: K/V ring depth; pingpong: alternate the two consumers' softmax and matmuls.

    overlap: what keeps a consumer's tensor-core queue busy across KV steps.
      * "none": per step, wait for K_j, issue Q K_j^T, softmax, issue P V_j and wait for it.
        The P V scope (`pl.run_state`) ends in `wgmma.wait_group 0`, and only then is the next
        K barrier waited for and the next Q K^T issued: the queue drains once per step.
      * "qk_pv": software pipeline (FlashAttention-3): S_{j+1} = Q K_{j+1}^T and P_j V_j are
        issued back to back in one accumulator scope, Q K^T first, while the softmax works on
        S_j carried from the step before (a prologue computes S_0, the last step issues P V
        only). One more [block_q, block_kv] f32 accumulator per thread (64 registers at
        block_kv 128).
      * "qk_pv_intra": "qk_pv" with FlashAttention-3's intra-warpgroup overlap: O stays in a
        wgmma accumulator across the KV loop; after issuing S_{j+1} and P_j V_j, only S_{j+1} is
        waited for (wgmma.wait_group 1), so its softmax runs while P_j V_j is still on the
        tensor cores; O is rescaled once P_j V_j is done (just before P_{j+1} V_{j+1}). Per
        thread during the softmax (block_kv 128, D 128): O 64 registers (being written by the
        tensor cores), P_j 32 (bf16, the running product's operand), S_{j+1} 64 (f32, turned
        into P in place; converted to bf16 only after P_j V_j is done, as in FA3): about the
        same peak as "qk_pv", whose P only exists after its softmax.

    wg_ranges: each consumer walks the KV tiles its own block_q rows see, not the union over the
    block's 2 x block_q rows. The producer still loads the union; for the tiles outside its
    range a consumer only waits for the loads and releases the slots (and keeps the pingpong
    `turn` phases balanced). Saves a fully masked tile (causal: warpgroup 0 past its diagonal;
    sliding window: warpgroup 1 before its window) and some mask arithmetic whenever the two
    row groups' ranges differ: with block_kv = block_q = 64, or when (Tk - Tq) is not a multiple
    of block_kv (chunked prefill). With block_kv = 2 x block_q and (Tk - Tq) % block_kv == 0
    (the causal benchmark shapes at block_kv 128) the ranges are the same and nothing is saved:
    warpgroup 0's diagonal tile is half visible, not fully masked.
    """
    block_q: int = 64
    block_kv: int = 128
    stages: int = 2
    pingpong: bool = True
    overlap: str = "none"
    wg_ranges: bool = False

    def __post_init__(self):
        if self.block_q % 64 or self.block_kv % 64 or self.block_kv > 256:
            raise ValueError(f"MosaicFlashConfig: block_q ({self.block_q}) and block_kv "
                             f"({self.block_kv}) must be multiples of 64, block_kv <= 256")
        if self.stages < 2:
            raise ValueError(f"MosaicFlashConfig.stages={self.stages}: need >= 2")
        if self.overlap not in OVERLAPS:
            raise ValueError(f"MosaicFlashConfig.overlap={self.overlap!r}: one of {OVERLAPS}")

    def __str__(self):
        return (f"q{self.block_q}x2 kv{self.block_kv} st{self.stages}"
                f"{' pp' if self.pingpong else ''}"
                f"{'' if self.overlap == 'none' else ' ' + self.overlap}"
                f"{' wgr' if self.wg_ranges else ''}")


def default_config(head_dim: int) -> MosaicFlashConfig:
    """The fastest of benchmarks/kernels.py's sweep on the H200 per head dim
    (benchmarks/DECISIONS.md, "Prefill")."""
    if head_dim <= 64:
        return MosaicFlashConfig(block_q=64, block_kv=128, stages=2)
    if head_dim > 128:
        return MosaicFlashConfig(block_q=64, block_kv=64, stages=2, pingpong=False,
                                 overlap="qk_pv")
    return MosaicFlashConfig(block_q=64, block_kv=128, stages=2, pingpong=False, overlap="qk_pv")


SMEM_LIMIT = 227 * 1024


def smem_bytes(cfg: MosaicFlashConfig, head_dim: int, itemsize: int = 2) -> int:
    q = 2 * cfg.block_q * head_dim * itemsize
    kv = 2 * cfg.stages * cfg.block_kv * head_dim * itemsize
    return q + kv + 1024  # barriers and alignment


def supports(q, k, v, cfg: MosaicFlashConfig | None = None) -> str | None:
    """None when the Mosaic path can run these inputs, else the reason it cannot."""
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {q.dtype} (needs bfloat16 or float16)"
    d = q.shape[-1]
    if d % 64 or d > 256:
        return f"head dim {d} (needs a multiple of 64, <= 256)"
    cfg = cfg or default_config(d)
    if smem_bytes(cfg, d) > SMEM_LIMIT:
        return f"config {cfg} needs {smem_bytes(cfg, d)} bytes of shared memory"
    return None


def is_aligned(q, k, cfg: MosaicFlashConfig | None = None) -> bool:
    """True when Tq and Tk are whole tiles, so the wrapper needs no padded copies."""
    cfg = cfg or default_config(q.shape[-1])
    return q.shape[1] % (2 * cfg.block_q) == 0 and k.shape[1] % cfg.block_kv == 0


def _mma_transforms(dtype):
    swizzle = 128
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def _kernel(q_ref, k_ref, v_ref, o_ref, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready,
            k_free, v_free, turn, *scratch, cfg: MosaicFlashConfig, sm_scale: float, causal: bool,
            window: int | None, tq: int, tk: int, n_kv: int, group: int, num_tiles: int,
            interpret: bool):
    # q_ref, o_ref [B, Tq_pad, Hq, D], k_ref, v_ref [B, Tk_pad, Hkv, D] (GMEM)
    # q_smem [2, block_q, D]; k_smem, v_smem [stages, block_kv, D]
    bq, bkv, stages = cfg.block_q, cfg.block_kv, cfg.stages
    b = lax.axis_index("b")
    h = lax.axis_index("h")
    tile = lax.axis_index("t")
    if causal:
        # Blocks start in launch order, t fastest, then h. Causal blocks differ in length, so
        # the order is remapped: per section of `group` heads (one KV group, sharing K/V in
        # L2), all their longest rows first, heads fastest, then the next tile down. The short
        # work then sits at the end of every section instead of the long rows of the last
        # heads at the end of the grid (the tail where SMs idle).
        idx = h * num_tiles + tile  # [0, Hq * num_tiles): launch order within the batch row
        span = group * num_tiles
        section, r = idx // span, lax.rem(idx, span)
        h = section * group + lax.rem(r, group)
        tile = num_tiles - 1 - r // group
    wg = lax.axis_index("wg")
    offset = tk - tq

    def kv_range(p_first, p_last):
        """KV tiles [lo, hi) holding the keys visible to query positions p_first..p_last, of
        which [full_lo, full_hi) are visible to all of them (no mask)."""
        hi = jnp.minimum(pl.cdiv(jnp.minimum(p_last + 1, tk), bkv), n_kv) if causal else n_kv
        if window is not None:
            lo = jnp.maximum(p_first - window + 1, 0) // bkv
            full_lo = jnp.clip(pl.cdiv(jnp.maximum(p_last - window + 1, 0), bkv), lo, hi)
        else:
            lo = full_lo = jnp.int32(0)
        full_hi = jnp.clip((jnp.minimum(p_first + 1, tk) if causal else tk) // bkv, full_lo, hi)
        hi = jnp.asarray(hi, jnp.int32)
        lo = jnp.asarray(lo, jnp.int32)
        return lo, full_lo, full_hi, hi

    # KV range of the block: the producer loads it, the consumers walk it (all of it, or with
    # wg_ranges their own part; see the module docstring). The ring slots count from its `lo`.
    p_first = tile * (2 * bq) + offset
    lo, full_lo, full_hi, hi = kv_range(p_first, p_first + 2 * bq - 1)

    def slot_of(j):
        return lax.rem(j - lo, stages)

    def rendezvous():
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        row0 = tile * (2 * bq) + wg * bq
        my_q = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, bq), h], my_q, q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])
        d = q_ref.shape[-1]
        qk_scale = sm_scale * LOG2_E
        if cfg.pingpong:
            pl.when(wg == 1)(rendezvous)  # offset warpgroup 1 by one phase

        if cfg.wg_ranges:
            # This warpgroup's own tiles [c_lo, c_hi), inside the block's [lo, hi): warpgroup 0
            # (earlier rows) may end before the block's causal end, warpgroup 1 start after the
            # block's window start. Its masked / full tiles follow its own rows too.
            c_lo, c_full_lo, c_full_hi, c_hi = kv_range(row0 + offset, row0 + offset + bq - 1)
            # Warpgroup 1 of a block whose rows it holds are all padding (positions >= Tk) may
            # see no key of a narrow window: keep one (masked) tile, its output is dropped.
            c_lo = jnp.minimum(c_lo, c_hi - 1)
        else:
            c_lo, c_full_lo, c_full_hi, c_hi = lo, full_lo, full_hi, hi

        def skip(j, _):
            """Tile j of the block's range outside this warpgroup's: the barrier events of a
            step ("none" order) without its work. The loads are waited for: each consumer
            tracks every barrier's phases (each wait flips its parity bit), and releasing a
            slot only once it is loaded keeps the two consumers' releases of one slot in the
            same phase. Two `turn` phases per tile, as a working step has."""
            slot = slot_of(j)
            plgpu.barrier_wait(k_ready.at[slot])
            if cfg.pingpong:
                rendezvous()
            plgpu.barrier_arrive(k_free.at[slot])
            if cfg.pingpong:
                plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(v_ready.at[slot])
            if cfg.pingpong:
                plgpu.barrier_wait(turn)
            plgpu.barrier_arrive(v_free.at[slot])
            return _

        def qk_scores(slot):
            """S = Q K^T [bq, bkv] f32 for the K tile in `slot` (already waited for); releases
            the K slot once S is in registers."""
            def qk_product(s_ref):
                plgpu.wgmma(s_ref, my_q, k_smem.at[slot].transpose((1, 0)))
                if cfg.pingpong:
                    rendezvous()  # let the other warpgroup issue while this one waits
                return s_ref[...]

            s = pl.run_scoped(qk_product, plgpu.ACC((bq, bkv), jnp.float32))  # [bq, bkv]
            plgpu.barrier_arrive(k_free.at[slot])
            return s

        def softmax(j, s, acc, m, l, masked: bool):
            """Online softmax of tile j's raw scores s [bq, bkv]: returns the rescaled acc
            [bq, D], m, l [bq] and P [bq, bkv] in the input dtype; with acc None, the rescale
            factor alpha [bq] and P in float32 instead (for "qk_pv_intra", which rescales O and
            converts P once the P V in flight is done). With pingpong, it ends by signalling
            `turn` (softmax done)."""
            # Raw scores; the scale is folded into exp2's argument (one FMA per score) and m
            # is kept scaled. Masked scores are the finite MASK_VALUE for the row maximum.
            if masked:
                # Index grids are rebuilt per masked tile rather than kept live across the loop
                # (an int32 [bq, bkv] grid costs 64 registers per thread).
                rows = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 0, layout=plgpu.Layout.WGMMA)
                cols = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA)
                pos = rows + (row0 + offset)  # [bq, bkv] query position
                key = cols + j * bkv  # [bq, bkv] key position
                visible = key < tk
                if causal:
                    visible = visible & (key <= pos)
                if window is not None:
                    visible = visible & (key > pos - window)
                s = jnp.where(visible, s, MASK_VALUE)
            m_new = jnp.maximum(m, s.max(axis=1) * qk_scale)
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
            if masked:
                # A fused multiply-add leaves MASK_VALUE * scale - m_new far from 0 when a row
                # has no visible key yet (m_new = the rounded MASK_VALUE * scale): exp2 of that
                # may overflow, so masked entries are zeroed here rather than by the exponent.
                p = jnp.where(visible, p, 0.0)
            l = l * alpha + p.sum(axis=1)
            if acc is None:
                acc, p16 = alpha, p
            else:
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(v_smem.dtype)
            if cfg.pingpong:
                if d <= 128:
                    # The softmax finishes before the hand-over below is signalled (JAX's own
                    # Hopper kernel reports this ordering matters for speed).
                    acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                plgpu.barrier_arrive(turn)  # softmax done: hand the tensor cores over
            return acc, m_new, l, p16

        def products(acc, p16, slot, *, qk_slot=None, hand_over=False):
            """acc [bq, D] + P V for the V tile in `slot`, waited for on return.

            qk_slot: also S' = Q K^T for the K tile in that slot, issued before P V in the same
              accumulator scope, so the tensor cores have both queued; returns (acc, S').
            hand_over: pingpong rendezvous on `turn` after the issue (the other warpgroup may
              then issue while these products run).
            """
            def issue(o_ref, p_operand, s_ref):
                if s_ref is not None:
                    plgpu.wgmma(s_ref, my_q, k_smem.at[qk_slot].transpose((1, 0)))
                plgpu.wgmma(o_ref, p_operand, v_smem.at[slot])
                if hand_over and cfg.pingpong:
                    rendezvous()

            if interpret:
                # GPU interpret mode takes neither a register operand for wgmma nor
                # pl.run_state over an accumulator: stage P through shared memory and add a
                # fresh product (same arithmetic as the GPU path below).
                p_smem = stage_p(p16)
                if qk_slot is None:
                    def pv_fresh(o_ref):
                        issue(o_ref, p_smem, None)
                        return o_ref[...]

                    return acc + pl.run_scoped(pv_fresh, plgpu.ACC((bq, d), jnp.float32))

                def pair_fresh(o_ref, s_ref):
                    issue(o_ref, p_smem, s_ref)
                    return o_ref[...], s_ref[...]

                o, s = pl.run_scoped(pair_fresh, plgpu.ACC((bq, d), jnp.float32),
                                     plgpu.ACC((bq, bkv), jnp.float32))
                return acc + o, s
            if qk_slot is None:
                def pv_product(o_ref):
                    issue(o_ref, p16, None)

                return pl.run_state(pv_product)(plgpu.ACC.init(acc))

            def pair(refs):
                o_ref, s_ref = refs
                issue(o_ref, p16, s_ref)

            s0 = plgpu.layout_cast(jnp.zeros((bq, bkv), jnp.float32), plgpu.Layout.WGMMA)
            # The scope ends in wgmma.wait_group 0: both products are complete after it.
            acc, s = pl.run_state(pair)((plgpu.ACC.init(acc), plgpu.ACC.init(s0)))
            return acc, s

        def stage_p(p16):
            """Interpret mode: P [bq, bkv] staged in this warpgroup's shared-memory buffer."""
            p_smem = scratch[0].at[wg]
            p_smem[...] = p16
            plgpu.commit_smem()
            return p_smem

        def step(j, carry, masked: bool):
            """overlap "none": one KV tile, Q K^T to P V."""
            acc, m, l = carry  # [bq, D] f32 (WGMMA), [bq], [bq] f32 (WGMMA rows)
            slot = slot_of(j)
            plgpu.barrier_wait(k_ready.at[slot])
            s = qk_scores(slot)
            acc, m_new, l, p16 = softmax(j, s, acc, m, l, masked)
            plgpu.barrier_wait(v_ready.at[slot])
            if cfg.pingpong:
                plgpu.barrier_wait(turn)
            acc = products(acc, p16, slot)
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        def pipelined_step(j, carry, masked: bool, last: bool = False):
            """overlap "qk_pv": softmax of tile j (S_j from the step before), then P_j V_j
            with S_{j+1} = Q K_{j+1}^T issued ahead of it (none in the last step)."""
            acc, m, l, s = carry  # [bq, D], [bq], [bq], S_j [bq, bkv] f32 (WGMMA)
            slot = slot_of(j)
            acc, m_new, l, p16 = softmax(j, s, acc, m, l, masked)
            plgpu.barrier_wait(v_ready.at[slot])
            if last:
                if cfg.pingpong:
                    plgpu.barrier_wait(turn)
                acc = products(acc, p16, slot, hand_over=True)
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l
            next_slot = slot_of(j + 1)
            plgpu.barrier_wait(k_ready.at[next_slot])
            if cfg.pingpong:
                plgpu.barrier_wait(turn)
            # The rendezvous after the issue pairs with the other warpgroup's end of softmax,
            # as the one after Q K^T does in `step`: each turn phase lets one warpgroup's pair
            # of products run under the other's softmax. Turn phases per warpgroup: one for the
            # prologue's Q K^T, two per tile (end of softmax, after the issue, also in the last
            # step), the same for both, so the offset / balance rendezvous still pair up.
            acc, s = products(acc, p16, slot, qk_slot=next_slot, hand_over=True)
            plgpu.barrier_arrive(k_free.at[next_slot])  # S_{j+1} is in registers
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l, s

        def intra_step(o_acc, j, carry, masked: bool, last: bool = False):
            """overlap "qk_pv_intra": as pipelined_step, but P_{j-1} V_{j-1} (issued by the
            step before) is still running during the softmax of S_j; the step then waits for
            it, rescales O, issues S_{j+1} = Q K_{j+1}^T and P_j V_j, and waits for S_{j+1}
            only (none in the last step, which waits for its P V).

            o_acc: O [bq, D] f32, a wgmma accumulator kept across the loops (GPU); None in
            interpret mode, where O is the carry's `o` instead (P V added as it is issued).
            """
            o, m, l, s = carry  # O [bq, D] (interpret mode; else None), [bq], [bq], S_j
            slot = slot_of(j)
            alpha, m_new, l, p = softmax(j, s, None, m, l, masked)  # p: float32
            # Once the P V in flight (tile j - 1; none in the first step) is done: O *= alpha,
            # and P into the input dtype (as FlashAttention-3 does, so that the registers of
            # P_{j-1}, an operand of that P V, are free for P_j). Reading the accumulator waits
            # for all products (wgmma.wait_group 0).
            prev_done = lambda: plgpu.barrier_arrive(v_free.at[slot_of(j - 1)])
            scale = lax.broadcast_in_dim(alpha, (bq, d), [0])
            if interpret:
                pl.when(j > c_lo)(prev_done)
                p16 = p.astype(v_smem.dtype)
                o = o * scale
            else:
                o_prev = o_acc[...]
                pl.when(j > c_lo)(prev_done)
                p16 = p.astype(v_smem.dtype)
                o_acc[...] = o_prev * scale  # back into the accumulator (with wgmma.fence)
            plgpu.barrier_wait(v_ready.at[slot])
            next_slot = None if last else slot_of(j + 1)
            if not last:
                plgpu.barrier_wait(k_ready.at[next_slot])
            if cfg.pingpong:
                plgpu.barrier_wait(turn)  # turn phases as in pipelined_step

            def issue(o_dst, p_operand, s_ref):
                if s_ref is not None:
                    # Q K^T first: wgmma groups complete in order, so waiting for all but the
                    # newest group (P V) waits for S_{j+1} alone.
                    plgpu.wgmma(s_ref, my_q, k_smem.at[next_slot].transpose((1, 0)))
                plgpu.wgmma(o_dst, p_operand, v_smem.at[slot])
                if cfg.pingpong:
                    rendezvous()

            if interpret:
                p_smem = stage_p(p16)  # (see `products`)

                def fresh(o_fresh, s_ref=None):
                    issue(o_fresh, p_smem, s_ref)
                    return o_fresh[...], None if s_ref is None else s_ref[...]

                accs = [plgpu.ACC((bq, d), jnp.float32)]
                if not last:
                    accs.append(plgpu.ACC((bq, bkv), jnp.float32))
                o_new, s = pl.run_scoped(fresh, *accs)
                o = o + o_new
            elif last:
                issue(o_acc, p16, None)
                o = o_acc[...]  # waits for the last P V
            else:
                def pair(s_ref):
                    issue(o_acc, p16, s_ref)
                    return plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # P V keeps running

                s = pl.run_scoped(pair, plgpu.ACC((bq, bkv), jnp.float32))
            if last:
                plgpu.barrier_arrive(v_free.at[slot])
                return o, m_new, l
            plgpu.barrier_arrive(k_free.at[next_slot])  # S_{j+1} is in registers
            return o, m_new, l, s

        def pipelined_loops(step_fn, carry, last_masked: bool):
            """Tiles c_lo .. c_hi - 2 of a pipelined overlap in the three ranges (masking
            follows the tile whose S is softmaxed), then the last tile peeled off."""
            last = c_hi - 1
            masked_step = functools.partial(step_fn, masked=True)
            if window is not None:
                carry = lax.fori_loop(c_lo, jnp.minimum(c_full_lo, last), masked_step, carry)
            carry = lax.fori_loop(jnp.minimum(c_full_lo, last), jnp.minimum(c_full_hi, last),
                                  functools.partial(step_fn, masked=False), carry)
            carry = lax.fori_loop(jnp.minimum(c_full_hi, last), last, masked_step, carry)
            return step_fn(last, carry, masked=last_masked, last=True)

        acc = plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)
        m = plgpu.layout_cast(jnp.full((bq,), MASK_VALUE, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
        l = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        if cfg.wg_ranges:
            lax.fori_loop(lo, c_lo, skip, 0)  # warpgroup 1 before its window
        # The last tile is masked whenever it can be: the causal diagonal, a window edge,
        # ragged keys (a mask on a fully visible tile changes nothing).
        last_masked = causal or window is not None or tk % bkv != 0
        if cfg.overlap == "none":
            carry = (acc, m, l)
            masked_step = functools.partial(step, masked=True)
            if window is not None:
                carry = lax.fori_loop(c_lo, c_full_lo, masked_step, carry)
            carry = lax.fori_loop(c_full_lo, c_full_hi, functools.partial(step, masked=False),
                                  carry)
            carry = lax.fori_loop(c_full_hi, c_hi, masked_step, carry)
        elif cfg.overlap == "qk_pv":
            # Prologue: S of the first tile. Every block has at least one KV tile (its first
            # query sees key 0 or its window start), so lo < hi (and c_lo < c_hi).
            plgpu.barrier_wait(k_ready.at[slot_of(c_lo)])
            carry = (acc, m, l, qk_scores(slot_of(c_lo)))
            carry = pipelined_loops(pipelined_step, carry, last_masked)
        else:
            def intra_loops(o_acc):
                plgpu.barrier_wait(k_ready.at[slot_of(c_lo)])  # prologue: S of the first tile
                carry = (acc if o_acc is None else None, m, l, qk_scores(slot_of(c_lo)))
                return pipelined_loops(functools.partial(intra_step, o_acc), carry, last_masked)

            if interpret:
                carry = intra_loops(None)  # O in registers (the interpreter has no ACC store)
            else:
                # O zeroed in the accumulator, kept there across all the loops.
                carry = pl.run_scoped(intra_loops, plgpu.ACC((bq, d), jnp.float32))
        acc, m, l = carry
        if cfg.wg_ranges:
            lax.fori_loop(c_hi, hi, skip, 0)  # warpgroup 0 past its diagonal
        if cfg.pingpong:
            pl.when(wg == 0)(rendezvous)  # balance warpgroup 1's extra phase
        l = jnp.where(l > 0, l, 1.0)
        out = acc / lax.broadcast_in_dim(l, acc.shape, [0])
        my_q[...] = out.astype(my_q.dtype)  # Q is dead: its buffer stages the output
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(my_q, o_ref.at[b, pl.ds(row0, bq), h])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        kvh = lax.div(h, jnp.asarray(group, h.dtype))

        def load(j, _):
            slot = slot_of(j)

            src = (b, pl.ds(j * bkv, bkv), kvh)
            # K and V are waited for and issued one at a time: K's slot is released (after
            # Q K^T) before V's (after P V), so the next K load need not wait for the P V.
            for free, smem, ref, ready in ((k_free, k_smem, k_ref, k_ready),
                                           (v_free, v_smem, v_ref, v_ready)):
                pl.when(j - lo >= stages)(lambda free=free: plgpu.barrier_wait(free.at[slot]))
                plgpu.copy_gmem_to_smem(ref.at[src], smem.at[slot], ready.at[slot])
            return 0

        lax.fori_loop(lo, hi, load, 0)

        # Await the releases not awaited above, so every barrier completion is observed.
        def drain(j, _):
            slot = slot_of(j)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            return 0

        lax.fori_loop(jnp.maximum(hi - stages, lo), hi, drain, 0)


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "window", "cfg", "interpret"))
def _flash_attention_mgpu(q, k, v, *, causal, sm_scale, window, cfg, interpret):
    b, tq, hq, d = q.shape
    _, tk, hkv, _ = k.shape
    rows_per_block = 2 * cfg.block_q
    num_tiles = pl.cdiv(tq, rows_per_block)
    tq_pad = num_tiles * rows_per_block
    n_kv = pl.cdiv(tk, cfg.block_kv)
    tk_pad = n_kv * cfg.block_kv
    if tq_pad != tq:  # padded queries sit after the real ones and are sliced off
        q = jnp.pad(q, ((0, 0), (0, tq_pad - tq), (0, 0), (0, 0)))
    if tk_pad != tk:  # padded keys are masked (key < tk) in the last tile
        k = jnp.pad(k, ((0, 0), (0, tk_pad - tk), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, tk_pad - tk), (0, 0), (0, 0)))
    transforms = _mma_transforms(q.dtype)
    kernel = functools.partial(
        _kernel, cfg=cfg, sm_scale=sm_scale, causal=causal, window=window, tq=tq, tk=tk,
        n_kv=n_kv, group=hq // hkv, num_tiles=num_tiles, interpret=interpret)
    # Offsets in the grid are taken from the real Tq/Tk (positions), the shapes from the padded.
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((b, tq_pad, hq, d), q.dtype),
        scratch_types=[
            plgpu.SMEM((2, cfg.block_q, d), q.dtype, transforms=transforms),
            plgpu.SMEM((cfg.stages, cfg.block_kv, d), q.dtype, transforms=transforms),
            plgpu.SMEM((cfg.stages, cfg.block_kv, d), q.dtype, transforms=transforms),
            plgpu.Barrier(num_barriers=2),  # q_ready
            plgpu.Barrier(num_barriers=cfg.stages),  # k_ready
            plgpu.Barrier(num_barriers=cfg.stages),  # v_ready
            plgpu.Barrier(num_arrivals=2, num_barriers=cfg.stages),  # k_free
            plgpu.Barrier(num_arrivals=2, num_barriers=cfg.stages),  # v_free
            plgpu.Barrier(num_arrivals=2),  # turn (pingpong)
            # interpret mode only: P staged in shared memory (see the kernel)
            *([plgpu.SMEM((2, cfg.block_q, cfg.block_kv), q.dtype, transforms=transforms)]
              if interpret else []),
        ],
        grid=(b, hq, num_tiles),  # tiles fastest: neighbouring blocks share K/V in L2
        grid_names=("b", "h", "t"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(q, k, v)
    return out[:, :tq] if tq_pad != tq else out


def flash_attention_mgpu(q, k, v, *, causal: bool = True, sm_scale: float | None = None,
                         sliding_window: int | None = None, interpret=False,
                         config: MosaicFlashConfig | None = None):
    """The Hopper path; same contract as `flash_attention` (validated there)."""
    # flash_attention.flash_attention validated the inputs before dispatching here.
    cfg = config or default_config(q.shape[-1])
    reason = supports(q, k, v, cfg)
    if reason is not None:
        raise ValueError(f"flash_attention (mosaic backend): unsupported {reason}")
    d = q.shape[-1]
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    window = int(sliding_window) if sliding_window is not None else None
    return _flash_attention_mgpu(q, k, v, causal=causal, sm_scale=sm_scale, window=window,
                                 cfg=cfg, interpret=interpret)
