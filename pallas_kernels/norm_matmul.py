"""Fused matmul for the decoder's projections: [RMSNorm prologue] x @ w [+ residual | SwiGLU].

    norm_matmul(x, norm_weight, w, eps=, residual=)   rms_norm(x) @ w (+ residual)
    swiglu(x, w_gate, w_up, norm_weight=, eps=)        silu(h @ w_gate) * (h @ w_up), h = [norm](x)
                                                       (pallas_kernels/swiglu.py, same kernel)
    swiglu_down(x, w_gate, w_up, w_down, acc, clear)   acc + swiglu(...) @ w_down: the whole MLP,
                                                       each program's w_down rows added into acc
                                                       by atomics (swiglu.py, same kernel)
    ... deltas=d                                       x + sum(d) first (the residual add), and
                                                       that sum returned too
    norm_matmul(..., partials=True)                    unreduced float32 K chunks (+ the norm's
                                                       sums of squares) for a consumer kernel
    ... prefetch=((w_next, first_rows_plan(...)),)     the programs also ask the L2 for the next
                                                       kernel's first weight rows
                                                       (pallas_kernels/l2_prefetch.py)

Built for decode (M = batch, 1..64), where the op streams the weight and every separate small
kernel (the norm's reduce and scale, the residual add, a split-K reduction) costs more time than
the bytes it moves. A batch-invariant plan runs it at any M (prefill too) at the small-M tiles:
a row's arithmetic depends on block_k, the split and the row's own operands, never on M. One program owns a [block_m, block_n] output tile (of each weight: SwiGLU
multiplies x into the gate and the up slab in one pass) and one chunk of K:

- Residual add (deltas [S, M, K] given, a split-K producer's chunks): each x tile is x plus
  the chunks' tiles, summed in float32 and rounded once; the programs of the first N tile
  store it (the next residual stream). The decoder's sublayer boundary thus needs no kernel.
- Norm (norm_weight given): rms_norm(x) @ w = inv_rms * ((x * norm_weight) @ w), so the main
  loop multiplies (x * norm_weight) tiles (rounded to x's dtype, as HF rounds the normed x) and
  gathers each row's float32 sum of squares from the same x tiles; the epilogue scales by
  inv_rms. x is read once, in step with the weight stream.
- Main loop: x tile @ weight slab [block_k, block_n], float32 accumulation.
- Epilogue, split_k = 1: the norm scale, then the residual added in float32 or SiLU(gate) * up,
  then the cast.
  split_k > 1 (more programs than a thin N gives, so that every SM streams): each program writes
  float32 partials [split_k, M, N] (and its chunk's sums of squares) and the wrapper's sum, norm
  scale, residual and SiLU are left to XLA, which fuses them into one small kernel, or to the
  consumer (partials=True: the decode attention kernel sums and scales the q/k/v chunks).
Any M, K, N: edge tiles use masked loads and stores.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (NUM_SMS_H200, check_array, check_same_dtype, check_tiles,
                                     dot_f32, gate_activation, multiple_of, ref_precision,
                                     sum_chunks)
from pallas_kernels.atomics import atomic_add_relaxed
from pallas_kernels.l2_prefetch import PrefetchPlan, issue_prefetches, l2_prefetch
from pallas_kernels.quantized import (QuantizedWeight, check_quantized, dequantize,
                                      kernel_arrays, tile_dot, tile_load, weight_format)
from pallas_kernels.rms_norm import add_deltas_reference, check_deltas, rms_norm_reference


@dataclasses.dataclass(frozen=True)
class MatmulBlockSizes:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1  # chunks of K, each its own program (float32 partials summed by XLA)

    def __post_init__(self):
        check_tiles(self, "block_m", "block_n", "block_k")
        if self.split_k < 1:
            raise ValueError(f"{type(self).__name__}.split_k={self.split_k}: must be >= 1")


def default_block_sizes(m: int, n: int, k: int, itemsize: int = 2,
                        n_weights: int = 1, quantized: bool = False) -> MatmulBlockSizes:
    """Small M streams the weights: 64-wide N tiles 256 deep, 3 stages, and the fewest K
    chunks that give about one program per SM (tiles * split >= NUM_SMS - 8); SwiGLU (two
    weights per program) 128x128 tiles unsplit. Large M is matmul-bound: square tiles.
    float32 gets half-depth tiles and 2 stages to fit shared memory. Measurements:
    benchmarks/DECISIONS.md ("Decode matmuls")."""
    if itemsize >= 4:
        return MatmulBlockSizes(block_m=16 if m <= 16 else 64, block_n=32 if m <= 64 else 64,
                                block_k=64, num_warps=4, num_stages=2)
    if m <= 16 and quantized and n_weights == 2:
        # SwiGLU on quantized weights: both weights' code tiles sit in registers (dequantized
        # in the loop, the next pair loaded ahead), so the tiles are half as wide as bf16's.
        return MatmulBlockSizes(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    if m <= 16:
        if n_weights == 2:
            return MatmulBlockSizes(block_m=16, block_n=128, block_k=128, num_warps=4,
                                    num_stages=3)
        block_k = 256 if k >= 256 else 128
        tiles = -(-n // 64)
        split = max(1, min(8, -(-(NUM_SMS_H200 - 8) // tiles), k // (4 * block_k)))
        return MatmulBlockSizes(block_m=16, block_n=64, block_k=block_k, num_warps=4,
                                num_stages=3, split_k=split)
    if m <= 64:
        return MatmulBlockSizes(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)
    return MatmulBlockSizes(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


def _chunking(k: int, blocks: MatmulBlockSizes) -> tuple[int, int]:
    """(split, k_chunk): the K chunks fused_matmul gives blocks' programs."""
    split = max(1, min(blocks.split_k, pl.cdiv(k, blocks.block_k)))
    k_chunk = pl.cdiv(pl.cdiv(k, split), blocks.block_k) * blocks.block_k
    return pl.cdiv(k, k_chunk), k_chunk


def first_rows_plan(m: int, k: int, n: int, *, itemsize: int = 2, n_weights: int = 1,
                    rows: int | None = None, at: str = "end",
                    block_sizes: MatmulBlockSizes | None = None) -> PrefetchPlan:
    """What a consumer fused matmul of x [m, k] @ w [k, n] (default blocks) reads first: the
    first `rows` rows (default one block_k tile) of each of its K chunks, all n columns
    (contiguous in the row-major weight). A producer kernel prefetches them for it (norm_matmul
    / swiglu `prefetch=`) at the start or the end (`at`) of its own stream."""
    blocks = block_sizes or default_block_sizes(m, n, k, itemsize, n_weights=n_weights)
    split, k_chunk = _chunking(k, blocks)
    rows = min(rows or blocks.block_k, k_chunk, k - (split - 1) * k_chunk)
    return PrefetchPlan(starts=tuple(s * k_chunk * n for s in range(split)), length=rows * n,
                        at=at)


def check_prefetch(op: str, prefetch) -> None:
    """`prefetch=` of a kernel wrapper: (array, PrefetchPlan) pairs, each plan inside its array."""
    for pair in prefetch:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], PrefetchPlan)):
            raise ValueError(f"{op}: prefetch takes (array, PrefetchPlan) pairs, got {pair!r}")
        a, plan = pair
        size = math.prod(a.shape)
        if plan.starts and max(plan.starts) + plan.length > size:
            raise ValueError(f"{op}: prefetch plan reads past the end of its {a.shape} array")


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


def fused_matmul_kernel(*refs, m: int, n: int, k: int, eps: float, block_m: int, block_n: int,
                        block_k: int, k_chunk: int, n_weights: int, has_norm: bool,
                        has_residual: bool, epilogue: str, partial: bool, n_deltas: int,
                        activation: str = "silu", prefetch_plans: tuple = (),
                        programs: int = 1, threads: int = 128,
                        block_d: int = 256, down_prefetch: bool = False,
                        interpret: bool = False, stagger: bool = True,
                        transposed: bool = False, single_row: bool = True,
                        formats: tuple = ()):
    # refs, in order:
    #   x_ref [block_m, Kp]; n_deltas d_refs [block_m, Kp] (float32 partial sums added to x:
    #   the same [S, M, K] array once per chunk); nw_ref [Kp] if has_norm;
    #   n_weights w_refs [Kp, block_n] ([block_n, Kp] if transposed: w stored [N, K]), or
    #   for a quantized weight (formats[i] a WeightFormat) its arrays' [rows, block_n] bands
    #   (pallas_kernels/quantized.py: codes and scales, dequantized per tile by tile_dot);
    #   r_ref [block_m, block_n] if has_residual;
    #   epilogue "swiglu_down": wd_ref [block_n, D] (w_down's rows of this program's N tile),
    #   then acc_in, clear_in [block_m, D] float32 (aliased to the outputs acc, clear);
    #   one whole-array ref per prefetch plan (the next kernel's weights, never loaded here);
    #   outputs: xo_ref [block_m, Kp] if n_deltas (x + sum(deltas), written by the programs of
    #            the first N tile);
    #            partial -> n_weights refs [block_m, block_n] float32 (this K chunk's sums)
    #            (+ [block_m] sums of squares if has_norm, stored by the programs of the first
    #            N tile); "swiglu_down" -> acc (+= this tile's act @ w_down rows, atomically),
    #            clear (zeroed: the next layer's acc); else one ref [block_m, block_n].
    # Kp = split_k * k_chunk >= K; positions >= K are masked, never used.
    it = iter(refs)
    x_ref = next(it)
    d_refs = [next(it) for _ in range(n_deltas)]
    nw_ref = next(it) if has_norm else None
    formats = formats or (None,) * n_weights
    w_refs = [[next(it) for _ in range(1 if f is None else f.n_arrays)] for f in formats]
    down = epilogue == "swiglu_down"
    wd_ref = next(it) if down else None
    if down:
        next(it), next(it)  # acc and clear in: the same buffers as their outputs
    r_ref = next(it) if has_residual else None
    pf_refs = [next(it) for _ in prefetch_plans]
    xo_ref = next(it) if n_deltas else None
    o_refs = list(it)

    rows = pl.program_id(0) * block_m + jnp.arange(block_m)
    cols = pl.program_id(1) * block_n + jnp.arange(block_n)
    row_ok = (rows < m)[:, None] if m % block_m else None  # [block_m, 1]
    col_ok = (cols < n)[None, :] if n % block_n else None  # [1, block_n]
    # K positions need a mask when K is ragged against the tiles or the chunks.
    mask_k = (k % block_k != 0) or (pl.cdiv(k, k_chunk) * k_chunk != k)

    def load(ref, mask):
        return ref[...] if mask is None else plgpu.load(ref, mask=mask, other=0)

    def both(a, b):
        return b if a is None else (a if b is None else a & b)

    chunk_start = pl.program_id(2) * k_chunk
    chunk_end = jnp.minimum(chunk_start + k_chunk, k)

    def x_tile(start, masked: bool):
        # [block_k] mask of the K positions in this chunk, and the x tile [block_m, block_k].
        k_ok = (start + jnp.arange(block_k)) < chunk_end if masked else None
        x = load(x_ref.at[:, pl.ds(start, block_k)],
                 both(row_ok, None if k_ok is None else k_ok[None, :]))
        return k_ok, x

    # The elementwise operand math (deltas, norm) runs on op_rows rows. One weight at M = 1:
    # on the one real row, broadcast to the dot's block_m rows at the end, not on block_m
    # rows of which block_m - 1 are masked (fewer registers; SwiGLU measured the other way:
    # benchmarks/DECISIONS.md). single_row=False keeps block_m rows at M = 1 too: the same
    # arithmetic as at M > 1 (batch-invariant; the squares' reduction follows the layout).
    op_rows = 1 if m == 1 and n_weights == 1 and single_row else block_m

    def op_tile(ref, start):
        # ref's op_rows x block_k tile at `start` (a prefetch past the chunk's end reads
        # nothing).
        k_ok = (start + jnp.arange(block_k)) < chunk_end
        if op_rows == 1:
            return plgpu.load(ref.at[pl.ds(0, 1), pl.ds(start, block_k)], mask=k_ok[None, :],
                              other=0)
        return load(ref.at[:, pl.ds(start, block_k)], both(row_ok, k_ok[None, :]))

    def operands(start):
        # The x, delta and norm_weight tiles at `start`.
        k_ok = (start + jnp.arange(block_k)) < chunk_end
        tiles = [op_tile(x_ref, start)] + [op_tile(d_ref, start) for d_ref in d_refs]
        if has_norm:
            tiles.append(plgpu.load(nw_ref.at[pl.ds(start, block_k)], mask=k_ok, other=0))
        return tuple(tiles)

    prefetched = has_norm or n_deltas > 0
    # The programs of the first N tile write x + sum(deltas) (each its own K chunk).
    writes_x = pl.program_id(1) == 0

    def weight_tiles(start):
        # Each quantized weight's raw tiles at `start` (loaded a step ahead, in the carry).
        k_ok = (start + jnp.arange(block_k)) < chunk_end
        return tuple(() if f is None else tile_load(refs, f, start, k_ok, col_ok, load)
                     for refs, f in zip(w_refs, formats))

    quantized = any(f is not None for f in formats)

    def step(j, carry):
        accs, ss, wt, *cur = carry
        start = multiple_of(chunk_start + j * block_k, block_k)
        if quantized:
            wt, wt_next = wt, weight_tiles(start + block_k)
        if prefetched:
            # The x tile is built by elementwise math (the deltas' sum, the norm weight), not
            # fed to the dot as loaded, so Triton's pipeliner leaves these loads in place;
            # they are prefetched one tile ahead by hand (in the carry) instead.
            x, *deltas = cur[:1 + n_deltas]
            nw = cur[-1] if has_norm else None
            cur = operands(start + block_k)
            k_ok = (start + jnp.arange(block_k)) < chunk_end if mask_k else None  # [block_k]
            if n_deltas:
                # The chunks in order, then the residual, as add_rms_norm sums them; one
                # rounding to x's dtype (the residual stream's).
                total = deltas[0].astype(jnp.float32)
                for dt in deltas[1:]:
                    total += dt.astype(jnp.float32)
                x = (total + x.astype(jnp.float32)).astype(x.dtype)  # [op_rows, block_k]
                x_mask = jnp.broadcast_to(writes_x, (op_rows, block_k))
                if op_rows > 1:
                    x_mask = both(x_mask, row_ok)
                x_mask = both(x_mask, None if k_ok is None else k_ok[None, :])
                plgpu.store(xo_ref.at[pl.ds(0, op_rows), pl.ds(start, block_k)], x,
                            mask=x_mask)
            if has_norm:
                # rms_norm(x) @ w = inv_rms * ((x * norm_weight) @ w): the sum of squares
                # gathers in the same pass and the scale waits for the epilogue.
                xf = x.astype(jnp.float32)
                ss = ss + xf * xf  # [op_rows, block_k]; reduced once, after the loop
                x = (xf * nw.astype(jnp.float32)[None, :]).astype(x.dtype)
            if op_rows < block_m:
                x = jnp.broadcast_to(x, (block_m, block_k))  # the dot's rows (row 0 real)
        else:
            k_ok, x = x_tile(start, mask_k)
        if transposed:  # w tiles [block_n, block_k] of the [N, K] weight, rows = columns here
            w_mask = both(None if col_ok is None else col_ok.T,
                          None if k_ok is None else k_ok[None, :])
            accs = tuple(acc + dot_f32(x, load(w_ref.at[:, pl.ds(start, block_k)], w_mask),
                                       trans_b=True) for acc, (w_ref,) in zip(accs, w_refs))
        else:
            w_mask = both(None if k_ok is None else k_ok[:, None], col_ok)
            accs = tuple(acc + (dot_f32(x, load(refs[0].at[pl.ds(start, block_k), :], w_mask))
                                if f is None else
                                tile_dot(x, raw, f, start))
                         for acc, refs, f, raw in zip(accs, w_refs, formats, wt))
        return (accs, ss, wt_next if quantized else wt, *cur)

    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    # (accumulators, squares of x when has_norm, the prefetched operand tiles)
    init = ((zeros,) * n_weights,
            jnp.zeros((op_rows, block_k), jnp.float32) if has_norm else None,
            weight_tiles(multiple_of(chunk_start, block_k)) if quantized
            else ((),) * n_weights)
    if prefetched:
        init = (*init, *operands(multiple_of(chunk_start, block_k)))
    # This program's share of the next kernel's first weight rows, into the L2, at the start
    # or the end of its own stream (each plan's `at`).
    program = (pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)) \
        * pl.num_programs(2) + pl.program_id(2) if prefetch_plans else None
    issue_prefetches(pf_refs, prefetch_plans, program, programs, threads, "start")
    if down_prefetch:
        # This program's first w_down tile ([block_n rows, block_d]), read after the main
        # loop: into the L2 now, so the second loop's first loads do not wait on the HBM.
        f_rows = pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32)
        d_all = wd_ref.shape[1]
        first = lax.rem(pl.program_id(1), d_all // block_d) * block_d if stagger else 0
        l2_prefetch(wd_ref, jnp.minimum(f_rows, n - 1) * d_all + first,
                    nbytes=block_d * wd_ref.dtype.itemsize)
    accs, ss, *_ = lax.fori_loop(0, k_chunk // block_k, step, init)
    if not down:
        issue_prefetches(pf_refs, prefetch_plans, program, programs, threads, "end")
    if has_norm:
        ss = jnp.sum(ss, axis=1)  # [op_rows]: this chunk's sum of squares of each x row
        ss = jnp.broadcast_to(ss, (block_m,)) if op_rows < block_m else ss  # [block_m]
    mask = both(row_ok, col_ok)

    def store(ref, val, mask=mask):
        plgpu.store(ref, val, mask=mask)

    if partial:
        # This chunk's sums, and (norm) its sum of squares: XLA finishes the norm.
        for ref, acc in zip(o_refs, accs):
            store(ref, acc)
        if has_norm:
            @pl.when(pl.program_id(1) == 0)
            def store_ss():
                store(o_refs[n_weights], ss, None if row_ok is None else row_ok[:, 0])
        return
    if has_norm:
        inv_rms = lax.rsqrt(ss / k + eps)[:, None]  # [block_m, 1]
        accs = tuple(acc * inv_rms for acc in accs)
    out = accs[0]
    if epilogue in ("swiglu", "swiglu_down"):
        gate, up = accs
        out = gate_activation(gate, activation) * up
    if down:
        down_epilogue(out.astype(x_ref.dtype), wd_ref, *o_refs, m=m, n=n, block_m=block_m,
                      block_n=block_n, block_d=block_d, row_ok=row_ok, interpret=interpret,
                      stagger=stagger)
        issue_prefetches(pf_refs, prefetch_plans, program, programs, threads, "end")
        return
    if has_residual:
        out = out + load(r_ref, mask).astype(jnp.float32)
    store(o_refs[0], out.astype(o_refs[0].dtype))


def down_epilogue(act, wd_ref, acc_ref, clear_ref, *, m: int, n: int, block_m: int,
                  block_n: int, block_d: int, row_ok, interpret: bool, stagger: bool):
    """The "swiglu_down" epilogue: this program's SwiGLU tile act [block_m, block_n] (x's
    dtype; rows >= m are zero) times its rows of w_down (wd_ref [block_n, D]), added into
    acc_ref [block_m, D] (float32, every program's share summed by atomics: the down
    projection's reduction over N needs no kernel of its own); and this program's slice of
    clear_ref zeroed (the next layer's accumulator, dead here). block_d divides D (the
    wrapper's choice), so only rows need a mask; interpret mode's atomics take no mask, and
    there the rows past m (zeros, in the padded block) need none."""
    d = wd_ref.shape[1]
    assert d % block_d == 0, (d, block_d)
    # clear: program j (of -(-n // block_n)) zeroes columns [j * bz, (j + 1) * bz) of its rows.
    bz = max(16, 1 << (-(-d // -(-n // block_n)) - 1).bit_length())
    zc = pl.program_id(1) * bz + jnp.arange(bz)
    z_mask = (zc < d)[None, :]
    if row_ok is not None:
        z_mask = z_mask & row_ok
    plgpu.store(clear_ref.at[:, pl.ds(pl.program_id(1) * bz, bz)],
                jnp.zeros((block_m, bz), jnp.float32), mask=z_mask)
    f_ok = (pl.program_id(1) * block_n + jnp.arange(block_n) < n)[:, None] \
        if n % block_n else None  # [block_n, 1]: w_down rows past N are masked

    steps = d // block_d
    j = pl.program_id(1)  # (read outside the loop: interpret mode needs that)

    def step(t, carry):
        if stagger:
            # Program j starts at its own column tile: at any moment the programs' atomics
            # go to different columns, not all 112 to the same block_d (one L2 line queue).
            t = lax.rem(t + j, steps)
        start = multiple_of(t * block_d, block_d)
        w = wd_ref[:, pl.ds(start, block_d)] if f_ok is None else plgpu.load(
            wd_ref.at[:, pl.ds(start, block_d)], mask=f_ok, other=0)  # [block_n, block_d]
        y = dot_f32(act, w)  # [block_m, block_d] float32
        if m == 1:
            # One real row (the others are zero): one atomic per column, not block_m.
            atomic_add_relaxed(acc_ref, (pl.ds(0, 1), pl.ds(start, block_d)),
                             jnp.sum(y, axis=0, keepdims=True))
        else:
            atomic_add_relaxed(acc_ref, (slice(None), pl.ds(start, block_d)), y,
                             mask=None if interpret or row_ok is None
                             else jnp.broadcast_to(row_ok, y.shape))
        return carry

    lax.fori_loop(0, steps, step, 0)


@functools.partial(jax.jit, static_argnames=("eps", "blocks", "epilogue", "activation", "interpret",
                                             "out_dtype", "partials", "prefetch_plans",
                                             "block_d", "down_prefetch", "stagger",
                                             "transposed", "single_row"))
def fused_matmul(x, norm_weight, weights, residual, *, eps, blocks, epilogue, interpret,
                 out_dtype=None, partials=False, deltas=None, prefetch=(), prefetch_plans=(),
                 down=None, block_d=256, down_prefetch=False, stagger=True, activation="silu",
                 transposed=False, single_row=True):
    """x [M, K]; norm_weight [K] or None; weights: tuple of [K, N] (1, or 2 for SwiGLU; one
    [N, K] with transposed, no epilogue);
    residual [M, N] or None -> [M, N] in out_dtype (default x's dtype). partials=True (one
    weight, no residual or epilogue): the float32 K-chunk sums [S, M, N] unreduced, for a
    consumer that adds them itself (add_rms_norm, the decode attention kernel); with a norm,
    (those sums of (x * norm_weight) @ w, each chunk's sums of squares of x [S, M]): the
    consumer scales the total by rsqrt(sum of squares / K + eps).
    deltas [S, M, K] float32 or None: the matmul's x is x + sum(deltas) (a residual add of a
    split-K producer's chunks, rounded once to x's dtype); the result is then (x + sum(deltas),
    the output as above). Shapes are checked by the public wrappers.
    prefetch: arrays (the next kernel's weights) and prefetch_plans, one PrefetchPlan each:
    the programs prefetch their share of those elements into the L2 at the start or the end
    of their own stream (the plan's `at`).
    epilogue "swiglu_down" (two weights, one K chunk): down = (w_down [N, D], acc [M, D]
    float32, clear [M, D] float32) -> (acc + silu(gate) * up @ w_down, clear zeroed), after
    x + sum(deltas) when deltas are given; block_d: w_down's columns per step of its loop;
    down_prefetch: each program asks the L2 for its first w_down tile at its start.
    single_row=False: the operand math of an M = 1 call on block_m rows, as at M > 1."""
    if partials:
        assert residual is None and len(weights) == 1, "plain matmul only"
        out_dtype = jnp.float32
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    m, k = x.shape
    formats = tuple(weight_format(w) if isinstance(w, QuantizedWeight) else None
                    for w in weights)
    quantized = formats[0] is not None
    n = weights[0].n if quantized else weights[0].shape[0 if transposed else 1]
    assert not transposed or (len(weights) == 1 and epilogue == "none"), "plain matmul only"
    if quantized:  # one scale row per K step: the steps are the weights' tile
        assert not transposed and len({f and f.tile for f in formats}) == 1, "one tile"
        blocks = dataclasses.replace(blocks, block_k=formats[0].tile)
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    split, k_chunk = _chunking(k, blocks)
    # The blocks span whole chunks: the masked tail tiles then index inside the block
    # (interpret mode pads the arrays to the block shape).
    kp = split * k_chunk
    # Partial sums out of the kernel: a split K, or a consumer that applies the norm itself.
    partial = split > 1 or (partials and norm_weight is not None)
    if epilogue == "swiglu_down":
        assert split == 1 and not partials and residual is None, "one K chunk, no residual"
    tile = pl.BlockSpec((bm, bn), lambda i, j, s: (i, j))
    x_band = pl.BlockSpec((bm, kp), lambda i, j, s: (i, 0))  # rows of x, all of K
    in_specs = [x_band]
    args = [x]
    n_deltas = 0 if deltas is None else deltas.shape[0]
    for c in range(n_deltas):  # the same array once per chunk: every ref is 2-D
        in_specs.append(pl.BlockSpec((None, bm, kp), lambda i, j, s, c=c: (c, i, 0)))
        args.append(deltas)
    if norm_weight is not None:
        in_specs.append(pl.BlockSpec((kp,), lambda i, j, s: (0,)))
        args.append(norm_weight)
    if transposed:
        in_specs.append(pl.BlockSpec((bn, kp), lambda i, j, s: (j, 0)))
    else:
        for w in weights:
            arrays = kernel_arrays(w) if isinstance(w, QuantizedWeight) else (w,)
            # Dense: all Kp rows of a column band; quantized: all rows of each array's band.
            in_specs += [pl.BlockSpec((kp if a is w else a.shape[0], bn),
                                      lambda i, j, s: (0, j)) for a in arrays]
            args += list(arrays)
    if transposed:
        args += list(weights)
    aliases = {}
    if down is not None:
        w_down, acc, clear = down
        d = w_down.shape[1]
        band = pl.BlockSpec((bm, d), lambda i, j, s: (i, 0))  # rows of acc / clear, all of D
        in_specs += [pl.BlockSpec((bn, d), lambda i, j, s: (j, 0)), band, band]
        args += [w_down, acc, clear]
        first_out = 1 if deltas is not None else 0
        aliases = {len(args) - 2: first_out, len(args) - 1: first_out + 1}
    has_residual = residual is not None and not partial
    if has_residual:
        in_specs.append(tile)
        args.append(residual)
    for a in prefetch:  # whole arrays: the kernel only takes their addresses
        in_specs.append(pl.BlockSpec(a.shape, lambda i, j, s, nd=a.ndim: (0,) * nd))
        args.append(a)
    if partial:
        out_specs = [pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j))] * len(weights)
        out_shape = [jax.ShapeDtypeStruct((split, m, n), jnp.float32)] * len(weights)
        if norm_weight is not None:  # each chunk's sum of squares of x
            out_specs.append(pl.BlockSpec((None, bm), lambda i, j, s: (s, i)))
            out_shape.append(jax.ShapeDtypeStruct((split, m), jnp.float32))
    elif down is not None:
        out_specs = [band, band]
        out_shape = [jax.ShapeDtypeStruct((m, d), jnp.float32)] * 2
    else:
        out_specs, out_shape = [tile], [jax.ShapeDtypeStruct((m, n), out_dtype)]
    if n_deltas:  # x + sum(deltas), the next residual stream
        out_specs = [x_band] + out_specs
        out_shape = [jax.ShapeDtypeStruct((m, k), x.dtype)] + out_shape
    kernel = functools.partial(
        fused_matmul_kernel, m=m, n=n, k=k, eps=eps, block_m=bm, block_n=bn, block_k=bk,
        k_chunk=k_chunk, n_weights=len(weights), has_norm=norm_weight is not None,
        has_residual=has_residual, epilogue=epilogue, activation=activation, partial=partial,
        n_deltas=n_deltas, prefetch_plans=tuple(prefetch_plans),
        programs=pl.cdiv(m, bm) * pl.cdiv(n, bn) * split, threads=32 * blocks.num_warps,
        block_d=block_d, down_prefetch=down_prefetch, interpret=interpret, stagger=stagger,
        transposed=transposed, single_row=single_row, formats=formats if quantized else ())
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), split),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret,
        # The shape in the name tells the projections apart in a profile.
        name=f"{'add_' if n_deltas else ''}{'norm_' if norm_weight is not None else ''}"
             f"matmul_{epilogue}_k{k}_n{n}" + (f"_split{split}" if partial else "")
             + (f"_{weights[0].name}" if quantized else ""),
    )(*args)
    if down is not None:
        return tuple(out) if n_deltas else (None, *out)
    if n_deltas:
        x_new, *out = out
        return x_new, _finish(out, x, norm_weight, residual, eps=eps, epilogue=epilogue,
                              out_dtype=out_dtype, partial=partial, partials=partials,
                              activation=activation)
    return _finish(out, x, norm_weight, residual, eps=eps, epilogue=epilogue,
                   out_dtype=out_dtype, partial=partial, partials=partials,
                   activation=activation)


def _finish(out, x, norm_weight, residual, *, eps, epilogue, out_dtype, partial, partials,
            activation="silu"):
    """The pallas_call's outputs (a list) -> the result fused_matmul documents."""
    k = x.shape[1]
    if not partial:
        return out[0][None] if partials else out[0]
    if partials:  # [S, M, N] float32 (+ the sums of squares [S, M] with a norm)
        return out[0] if norm_weight is None else (out[0], out[1])
    # XLA sums the K chunks (in chunk order: sum_chunks) and applies the epilogue, fused into
    # one elementwise pass.
    sums = [sum_chunks(p) for p in out[:-1 if norm_weight is not None else None]]
    if norm_weight is not None:
        inv_rms = lax.rsqrt(sum_chunks(out[-1]) / k + eps)[:, None]  # [M, 1]
        sums = [acc * inv_rms for acc in sums]
    y = sums[0]
    if epilogue == "swiglu":
        y = gate_activation(sums[0], activation) * sums[1]
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y.astype(out_dtype)


# ---------------------------------------------------------------------------------------------
# norm_matmul: wrapper and reference
# ---------------------------------------------------------------------------------------------


def _validate(x, norm_weight, w, residual, transposed=False):
    op = "norm_matmul"
    check_array(op, "x", x, 2)
    if norm_weight is not None:
        check_array(op, "norm_weight", norm_weight, 1)
    if isinstance(w, QuantizedWeight):
        if transposed:
            raise ValueError(f"{op}: a quantized weight is [K, *N]; transposed=True is for "
                             f"[N, K] arrays")
        check_quantized(op, w, x.shape[1])
        w = jax.ShapeDtypeStruct(w.shape, x.dtype)  # the shape checks below, on its shape
    if not hasattr(w, "ndim") or w.ndim < 2:
        raise ValueError(f"{op}: w must be an array of rank >= 2 ([K, *N], [in, out]), got "
                         f"{getattr(w, 'shape', type(w).__name__)}")
    check_array(op, "w", w, w.ndim)
    arrays = dict(x=x, w=w)
    if norm_weight is not None:
        arrays["norm_weight"] = norm_weight
    if residual is not None:
        check_array(op, "residual", residual, getattr(residual, "ndim", 0))
        arrays["residual"] = residual
    check_same_dtype(op, **arrays)
    k = x.shape[1]
    if norm_weight is not None and norm_weight.shape[0] != k:
        raise ValueError(f"{op}: norm_weight has {norm_weight.shape[0]} entries, x has K={k} features")
    if transposed:
        if w.ndim != 2 or w.shape[1] != k:
            raise ValueError(f"{op}: x has K={k} features but the transposed w {tuple(w.shape)} "
                             f"is not [N, K] (transposed=True: w is [out, in])")
    elif w.shape[0] != k:
        raise ValueError(f"{op}: x has K={k} features but w {tuple(w.shape)} has {w.shape[0]} rows "
                         f"(w is [K, *N], [in, out])")
    want = (x.shape[0], *(w.shape[:1] if transposed else w.shape[1:]))
    if residual is not None and tuple(residual.shape) != want:
        raise ValueError(f"{op}: residual has shape {tuple(residual.shape)}, expected {want} "
                         f"([M, *N] of the output)")


def norm_matmul(x, norm_weight, w, *, eps: float = 1e-6, residual=None, out_dtype=None,
                partials: bool = False, deltas=None, prefetch: tuple = (),
                transposed: bool = False, single_row: bool = True,
                interpret: bool = False, block_sizes: MatmulBlockSizes | None = None):
    """rms_norm(x, norm_weight) @ w (+ residual); x [M, K], norm_weight [K] (None: no norm,
    a plain matmul), w [K, *N], residual [M, *N] -> [M, *N] in out_dtype, default x's dtype
    (float32 statistics and accumulation, the residual added in float32 before the one
    rounding; out_dtype=float32 keeps the accumulator, as for logits).
    partials=True (no residual or out_dtype): float32 [S, M, *N] whose sum over S is x @ w,
    left unreduced for a consumer that sums them itself (the K split's S chunks; S = 1
    unsplit). With norm_weight: (float32 [S, M, *N] whose sum is (x * norm_weight) @ w, the
    chunks' sums of squares of x [S, M]); the consumer multiplies the sum by
    rsqrt(sum of squares / K + eps) (`apply_norm_partials`).
    deltas [S', M, K] float32: x is first replaced by x + sum(deltas) (a split-K producer's
    chunks added to the residual stream, rounded once to x's dtype, in the same pass); the
    result is then (x + sum(deltas), the output as above).
    prefetch: (array, PrefetchPlan) pairs, the next kernel's weights and what it reads first
    (`first_rows_plan`): each program, its own stream done, asks the L2 for its share of them
    (pallas_kernels/l2_prefetch.py). A cache hint only: results are unchanged.
    transposed=True: w is [N, K] ([out, in]: an embedding table as a tied LM head), read in
    [block_n, block_k] tiles; no partials. single_row=False: an M = 1 call does its operand
    math (deltas, norm) on whole row tiles, bit for bit as M > 1 does (batch-invariant)."""
    _validate(x, norm_weight, w, residual, transposed)
    check_prefetch("norm_matmul", prefetch)
    if deltas is not None:
        check_deltas("norm_matmul", x, deltas, float32_only=True)
    if partials and (residual is not None or out_dtype is not None):
        raise ValueError("norm_matmul: partials=True is for a plain or normed matmul (no "
                         "residual or out_dtype)")
    if transposed and partials:
        raise ValueError("norm_matmul: transposed=True gives the finished product (no partials)")
    out_dims = w.shape[:1] if transposed else w.shape[1:]
    n = math.prod(out_dims)
    m, k = x.shape
    quantized = isinstance(w, QuantizedWeight)
    blocks = block_sizes or default_block_sizes(m, n, k, x.dtype.itemsize, n_weights=1,
                                                quantized=quantized)
    out = fused_matmul(x, norm_weight, (w if transposed or quantized else w.reshape(k, n),),
                       None if residual is None else residual.reshape(m, n),
                       eps=float(eps), blocks=blocks, epilogue="none", interpret=interpret,
                       out_dtype=None if out_dtype is None else jnp.dtype(out_dtype).name,
                       partials=partials, deltas=deltas,
                       prefetch=tuple(a for a, _ in prefetch),
                       prefetch_plans=tuple(p for _, p in prefetch),
                       transposed=transposed, single_row=single_row)
    x_new = None
    if deltas is not None:
        x_new, out = out
    ss = None
    if partials and norm_weight is not None:
        out, ss = out
    out = out.reshape(*out.shape[:-2], m, *out_dims)
    if ss is not None:
        out = (out, ss)
    return out if x_new is None else (x_new, out)


def apply_norm_partials(parts, ss, k: int, eps: float):
    """The finished normed matmul from `norm_matmul(..., partials=True)` with a norm:
    parts [S, M, *N], ss [S, M'] (M' >= M: the first M columns read) -> float32 [M, *N] (what
    a consumer kernel does in its gather)."""
    inv_rms = lax.rsqrt(sum_chunks(ss)[:parts.shape[1]] / k + eps)  # [M]
    return sum_chunks(parts) * inv_rms.reshape(-1, *(1,) * (parts.ndim - 2))


def norm_matmul_reference(x, norm_weight, w, *, eps: float = 1e-6, residual=None,
                          out_dtype=None, deltas=None, transposed: bool = False,
                          interpret: bool = False):
    """rms_norm(x) @ w (+ residual) in plain jnp: HF RMSNorm, float32 accumulation, the residual
    added in float32 before the cast to x's dtype (interpret is ignored). deltas and
    transposed as in norm_matmul (deltas: returns (x + sum(deltas), the output)); no partials."""
    del interpret
    _validate(x, norm_weight, w, residual, transposed)
    if isinstance(w, QuantizedWeight):
        w = dequantize(w, x.dtype)  # [K, *N]: as the kernel's float32 math, rounded once
    if deltas is not None:
        check_deltas("norm_matmul", x, deltas, float32_only=True)
        x = add_deltas_reference(x, deltas)
        return x, norm_matmul_reference(x, norm_weight, w, eps=eps, residual=residual,
                                        out_dtype=out_dtype, transposed=transposed)
    h = x if norm_weight is None else rms_norm_reference(x, norm_weight, eps=eps)  # [M, K]
    y = lax.dot_general(h, w, (((1,), (1 if transposed else 0,)), ((), ())),
                        precision=ref_precision(x.dtype),
                        preferred_element_type=jnp.float32)  # [M, *N]
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y.astype(out_dtype or x.dtype)
