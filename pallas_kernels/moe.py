"""The routed experts of a MoE layer: SwiGLU experts read straight out of the stacked weights.

    moe_decode(x, weights, experts, w_gate, w_up, w_down)    few tokens (decode): one program
                                                             row per token-expert assignment
    moe_grouped(x, weights, experts, w_gate, w_up, w_down)   many tokens (prefill): a grouped
                                                             GEMM over rows sorted by expert
    moe_experts_reference(...)                               both in plain jnp
    group_by_expert(experts, num_experts, block_m)           the grouped GEMM's row layout
    grouped_swiglu / grouped_down                            its two kernels (+ *_reference)

x [N, D]; weights [N, k] float32 (routing weights); experts [N, k] int32 in [0, E);
w_gate, w_up [E, D, F]; w_down [E, F, D] (x's dtype) -> sum_j weights[:, j] *
down_e(silu(x @ gate_e) * (x @ up_e)) [N, D] float32, e = experts[:, j]; the SwiGLU rounded to
x's dtype as HF rounds it.

Each stacked weight may instead be a QuantizedWeight of any format (pallas_kernels/quantized.py:
int8 / int4 group-wise, fp8 blocks, GGUF's blocks as repacked), its every array [E, rows, N]
(`stack_experts`); the three may differ (GGUF Q4_K_M: gate / up Q4_K, down Q6_K). The kernels
then read the chosen expert's code and scale tiles and dequantize them in registers
(`tile_load` / `tile_dot`), their reduction step the weight's tile (one scale row per step).

Both paths run two kernels, whose programs each own a row tile and a column tile and index the
stacked weight by the tile's expert, loaded from an int32 array inside the kernel: only the
chosen experts' weights are read, and no gathered copy of them is made.

- Decode: the tiles are the N * k assignments themselves, token-major, one real row each (x's
  row n as row 0 of the dot's block_m rows, the others masked to zero). Kernel 1 streams gate and
  up for F columns and applies the SwiGLU; kernel 2 streams the down projection for D columns,
  split along F (split_k) so that Mixtral's 2 x 64 column tiles still fill the SMs, and writes
  each F chunk's product times the routing weight as float32 chunks [S * k, N, D]: their sum is
  the output, taken by XLA or left to the consumer kernel (partials=True: the next layer's
  fused matmul adds them to the residual stream). Experts that two tokens share are read
  twice: for more rows the grouped path reads each once.
- Grouped: the assignments sorted by expert (jnp, outside the kernels: `group_by_expert`), each
  expert's group padded to block_m rows, so a row tile belongs to one expert; a tile -> expert
  map (-1: an empty tile past the used ones, which does no work) over the static upper bound of
  tiles. The programs walk the tiles in groups of group_m row tiles per column sweep, so that
  a wave of programs shares both x tiles and weight columns in the L2. The SwiGLU kernel writes
  act [R, F] in x's dtype, the down kernel [R, D] float32; XLA gathers each assignment's row and
  weights and sums its k experts (no scatter).
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

from pallas_kernels._common import (
    NUM_SMS_H200,
    check_array,
    check_tiles,
    dot_f32,
    multiple_of,
    ref_precision,
)
from pallas_kernels.quantized import (
    QuantizedWeight,
    WeightFormat,
    check_quantized_experts,
    dequantize,
    kernel_arrays,
    num_experts,
    take_experts,
    tile_dot,
    tile_load,
    weight_format,
)

INT32 = jnp.dtype(jnp.int32)
FLOAT32 = jnp.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class MoEBlockSizes:
    """Tiles of the experts' kernels. block_m: rows per grouped tile (the decode kernels' dot
    rows, one real); block_n: F columns per SwiGLU program (two float32 accumulators);
    block_n_down: D columns per down program; block_k: the reduction step (D in the SwiGLU,
    F in the down projection); group_m: row tiles a column sweep covers before the next
    (grouped); split_k: F chunks of the down projection, each its own program (decode)."""

    block_m: int = 128
    block_n: int = 64
    block_n_down: int = 128
    block_k: int = 64
    group_m: int = 8
    split_k: int = 1
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        check_tiles(self, "block_m", "block_n", "block_n_down", "block_k")
        for name in ("group_m", "split_k", "num_warps", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoEBlockSizes.{name}={value!r}: must be an integer >= 1")


def default_block_sizes(rows: int, d: int, f: int, e: int, k: int, itemsize: int = 2, *,
                        decode: bool) -> MoEBlockSizes:
    """Decode (and grouped GEMMs of few rows per expert): 16-row dots, SwiGLU column tiles
    narrowed (down to 32) until the row tiles x column tiles give a program per SM (Qwen3's
    F 768 over 8 assignments; Mixtral's 2 x 112 tiles of 128 beat 2 x 224 of 64 by 5%), the
    decode down projection split along F for two programs per SM.
    Grouped: 128-row tiles at prefill (16 when the experts average <= 16 rows, 64 when <= 64),
    64-wide SwiGLU tiles (two accumulators) and 128-wide down tiles.
    float32 (interpret mode, tests) gets half-depth tiles and 2 stages for shared memory."""
    a = rows * k
    target = 2 * NUM_SMS_H200
    small = 2 if itemsize >= 4 else 1  # float32: halve the depth
    if decode or a <= 16 * e:
        tiles = a if decode else max_tiles(a, e, 16)
        block_n = 128
        while block_n > 32 and tiles * -(-f // block_n) < NUM_SMS_H200:
            block_n //= 2
        block_k = 128 // small
        cols = -(-d // 64)
        split = max(1, min(8, -(-target // (tiles * cols)), f // (4 * block_k)))
        return MoEBlockSizes(block_m=16, block_n=block_n, block_n_down=64, block_k=block_k,
                             group_m=max(1, tiles), split_k=split if decode else 1,
                             num_warps=4, num_stages=3 if small == 1 else 2)
    block_m = 64 if a <= 64 * e else 128
    return MoEBlockSizes(block_m=block_m, block_n=64, block_n_down=128 // small,
                         block_k=64 // small, group_m=8, num_warps=8 if block_m == 128 else 4,
                         num_stages=3 if small == 1 else 2)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


def _tile_and_col(n_tiles: int, n_cols: int, group_m: int):
    """This program's (row tile, column tile): row tiles vary fastest within groups of
    group_m, so a wave of programs reads few x tiles and few weight columns."""
    pid = pl.program_id(0)
    per_group = group_m * n_cols
    first = (pid // per_group) * group_m
    size = jnp.minimum(n_tiles - first, group_m)
    return first + lax.rem(lax.rem(pid, per_group), size), lax.rem(pid, per_group) // size


def _masked(ref, mask):
    return ref[...] if mask is None else plgpu.load(ref, mask=mask, other=0)


def _both(a, b):
    return b if a is None else (a if b is None else a & b)


def _rows(ref, row, single: bool, block_m: int, start, block_k: int, k_ok):
    """The dot's left operand [block_m, block_k] at K offset `start`: block_m rows from `row`,
    or (single) row `row` alone in row 0 and zeros below (its sum over rows is then exact).
    One masked load that feeds the dot as loaded, so Triton's pipeliner prefetches it with
    the weight tiles (the ref's block has block_m rows of padding past the last row)."""
    mask = None if k_ok is None else k_ok[None, :]
    if single:
        mask = _both((jnp.arange(block_m) == 0)[:, None], mask)
    return _masked(ref.at[pl.ds(row, block_m), pl.ds(start, block_k)], mask)


class _ExpertBand:
    """A stacked weight array's ref seen as one expert's column band [rows, bn]: tile_load's
    `ref.at[rows, :]` becomes the single indexer `ref.at[expert, rows, cols]` (Triton's
    lowering takes one indexer per load)."""

    def __init__(self, ref, expert, col0, width: int):
        self.ref, self.expert, self.cols = ref, expert, pl.ds(col0, width)

    @property
    def at(self):
        return self

    def __getitem__(self, idx):
        rows, _ = idx
        return self.ref.at[self.expert, rows, self.cols]


class _Weight:
    """One stacked weight in a kernel: its refs (one array, or a QuantizedWeight's arrays)
    and its format (None: a plain array [E, K, N] in x's dtype)."""

    def __init__(self, refs, fmt: WeightFormat | None, expert, col0, bn: int, col_ok):
        self.refs, self.fmt, self.col_ok = refs, fmt, col_ok
        self.expert, self.col0, self.bn = expert, col0, bn

    def load(self, start, bk: int, k_ok):
        """The raw tile(s) at K offset `start` (a quantized weight's codes and scale rows;
        k_ok [bk]: the valid K positions, None when all are)."""
        if self.fmt is None:
            mask = _both(None if k_ok is None else k_ok[:, None], self.col_ok)
            return _masked(self.refs[0].at[self.expert, pl.ds(start, bk),
                                           pl.ds(self.col0, self.bn)], mask)
        if k_ok is None:
            k_ok = jnp.ones((bk,), jnp.bool_)
        bands = [_ExpertBand(r, self.expert, self.col0, self.bn) for r in self.refs]
        return tile_load(bands, self.fmt, start, k_ok, self.col_ok, _masked)

    def dot(self, x, raw, start):
        """x [bm, bk] @ the tile (dequantized in registers) -> [bm, bn] float32."""
        return dot_f32(x, raw) if self.fmt is None else tile_dot(x, raw, self.fmt, start)


def _weight_refs(refs, formats):
    """Split a kernel's flat weight refs by weight: one ref per plain array, n_arrays per
    quantized one; returns (the groups, the refs left)."""
    groups = []
    for fmt in formats:
        n = 1 if fmt is None else fmt.n_arrays
        groups.append(refs[:n])
        refs = refs[n:]
    return groups, refs


def _k_loop(weights, steps: int, first, bk: int, k_valid, body, init):
    """fori_loop over `steps` K steps of bk from `first`, a quantized weight's tiles loaded a
    step ahead (in the carry: Triton's pipeliner leaves loads that feed elementwise math in
    place, see quantized.tile_load); plain arrays' tiles are loaded in the step.
    k_valid(start) -> [bk] mask or None; body(start, k_ok, tiles, acc) -> acc."""
    quantized = any(w.fmt is not None for w in weights)

    def tiles_at(start, k_ok, ahead: bool):
        return tuple(w.load(start, bk, k_ok) if (w.fmt is not None) == ahead else None
                     for w in weights)

    def ok(start):
        # A quantized tile's loads always take a K mask (the prefetch past the end reads none).
        k_ok = k_valid(start)
        return (start + jnp.arange(bk)) < first + steps * bk if k_ok is None and quantized \
            else k_ok

    def step(j, carry):
        acc, ahead = carry
        start = multiple_of(first + j * bk, bk)
        k_ok = k_valid(start)
        now = tiles_at(start, k_ok, False)
        tiles = tuple(a if a is not None else b for a, b in zip(ahead, now))
        nxt = start + bk
        if quantized:
            ahead = tiles_at(nxt, ok(nxt), True)
        return body(start, k_ok, tiles, acc), ahead

    start0 = multiple_of(first, bk)
    ahead = tiles_at(start0, ok(start0), True) if quantized else (None,) * len(weights)
    return lax.fori_loop(0, steps, step, (init, ahead))[0]


def _swiglu_kernel(te_ref, x_ref, *refs, d: int, f: int, top_k: int, single: bool,
                   n_tiles: int, n_cols: int, blocks: MoEBlockSizes, formats: tuple):
    # te_ref [T] int32: each tile's expert (-1: empty); x_ref: single [N + bm, Dp] (tile t =
    # the assignment t, its row x[t // top_k]), else [R, Dp] rows sorted by expert;
    # then gate's and up's refs: a plain array [E, Dp, Fp], or a QuantizedWeight's arrays
    # [E, rows, Fp] (formats[i] not None); o_ref [T or R, Fp] in x's dtype. Dp, Fp: D, F
    # padded to the tiles (positions past D, F masked: never read or written).
    (wg_refs, wu_refs), (o_ref,) = _weight_refs(refs, formats)
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    tile, col = _tile_and_col(n_tiles, n_cols, blocks.group_m)
    expert = te_ref[tile]
    row = tile // top_k if single else tile * bm
    f0 = multiple_of(col * bn, bn)
    col_ok = ((f0 + jnp.arange(bn)) < f)[None, :] if f % bn else None  # [1, bn]
    weights = [_Weight(r, fmt, expert, f0, bn, col_ok)
               for r, fmt in zip((wg_refs, wu_refs), formats)]

    @pl.when(expert >= 0)
    def _():
        def k_valid(start):
            return (start + jnp.arange(bk)) < d if d % bk else None  # [bk]

        def body(start, k_ok, tiles, accs):
            x = _rows(x_ref, row, single, bm, start, bk, k_ok)  # [bm, bk]
            return tuple(acc + w.dot(x, t, start) for acc, w, t in zip(accs, weights, tiles))

        zeros = jnp.zeros((bm, bn), jnp.float32)
        gate, up = _k_loop(weights, pl.cdiv(d, bk), 0, bk, k_valid, body,
                           (zeros, zeros))  # [bm, bn] each
        if single:
            gate, up = (jnp.sum(a, axis=0, keepdims=True) for a in (gate, up))  # [1, bn]
        dtype = o_ref.dtype
        # silu(g) * u with each step rounded to x's dtype, as the jnp path does.
        g = gate.astype(dtype).astype(jnp.float32)
        silu = (g * jax.nn.sigmoid(g)).astype(dtype).astype(jnp.float32)
        act = (silu * up.astype(dtype).astype(jnp.float32)).astype(dtype)
        rows = 1 if single else bm
        out = o_ref.at[pl.ds(tile if single else row, rows), pl.ds(f0, bn)]
        if col_ok is None:
            out[...] = act
        else:
            plgpu.store(out, act, mask=jnp.broadcast_to(col_ok, (rows, bn)))


def _down_kernel(te_ref, a_ref, *refs, f: int, d: int, single: bool, top_k: int,
                 n_tiles: int, n_cols: int, k_chunk: int, blocks: MoEBlockSizes,
                 formats: tuple):
    # te_ref [T] int32; a_ref [T + bm or R, Fp] the SwiGLU rows (single: row t is tile t);
    # then down's refs: [E, Fp, Dp], or a QuantizedWeight's arrays [E, rows, Dp];
    # single: rw_ref [T] float32 the routing weights, then o_ref
    # [S * top_k, T // top_k, Dp] float32: this F chunk's sums times the routing weight, the
    # assignment t = n * top_k + j at chunk s * top_k + j, row n (the chunks' sum is the
    # output); else o_ref [1, R, Dp] float32.
    (wd_refs,), refs = _weight_refs(refs, formats)
    rw_ref, o_ref = refs if single else (None, *refs)
    bm, bn, bk = blocks.block_m, blocks.block_n_down, blocks.block_k
    tile, col = _tile_and_col(n_tiles, n_cols, blocks.group_m)
    chunk = pl.program_id(1)
    expert = te_ref[tile]
    row = tile if single else tile * bm
    d0 = multiple_of(col * bn, bn)
    col_ok = ((d0 + jnp.arange(bn)) < d)[None, :] if d % bn else None  # [1, bn]
    chunk_start = chunk * k_chunk
    chunk_end = jnp.minimum(chunk_start + k_chunk, f)
    ragged = f % k_chunk != 0 or f % bk != 0
    (w,) = weights = [_Weight(wd_refs, formats[0], expert, d0, bn, col_ok)]

    @pl.when(expert >= 0)
    def _():
        def k_valid(start):
            return (start + jnp.arange(bk)) < chunk_end if ragged else None  # [bk]

        def body(start, k_ok, tiles, acc):
            a = _rows(a_ref, row, single, bm, start, bk, k_ok)  # [bm, bk]
            return acc + w.dot(a, tiles[0], start)

        acc = _k_loop(weights, k_chunk // bk, chunk_start, bk, k_valid, body,
                      jnp.zeros((bm, bn), jnp.float32))
        if single:
            acc = jnp.sum(acc, axis=0, keepdims=True) * rw_ref[tile]  # [1, bn]
            out = o_ref.at[chunk * top_k + lax.rem(tile, top_k), pl.ds(tile // top_k, 1),
                           pl.ds(d0, bn)]
        else:
            out = o_ref.at[chunk, pl.ds(row, bm), pl.ds(d0, bn)]
        rows = 1 if single else bm
        if col_ok is None:
            out[...] = acc
        else:
            plgpu.store(out, acc, mask=jnp.broadcast_to(col_ok, (rows, bn)))


def _whole(shape):
    """A BlockSpec of the whole array (padded to `shape`, which may exceed it along some
    axes: the masked edge tiles then stay inside the block in interpret mode too)."""
    return pl.BlockSpec(tuple(shape), lambda *_: (0,) * len(shape))


def _pad(n: int, b: int) -> int:
    return pl.cdiv(n, b) * b


def _dims(w) -> tuple[int, int, int]:
    """(E, K, N) of a stacked weight: an array [E, K, N] or a stacked QuantizedWeight."""
    if isinstance(w, QuantizedWeight):
        return num_experts(w), w.k, w.n
    return tuple(w.shape)


def _format(w) -> WeightFormat | None:
    return weight_format(w) if isinstance(w, QuantizedWeight) else None


def _step(block_k: int, *weights) -> int:
    """The K step: a quantized weight's tile (one scale row per step; the weights of one
    kernel share it, checked by check_experts), else block_k."""
    tiles = {w.tile for w in weights if isinstance(w, QuantizedWeight)}
    return tiles.pop() if tiles else block_k


def _weight_operands(w, kp: int, np_: int):
    """(arrays, BlockSpecs) of a stacked weight for a kernel: the array padded (as a block)
    to [E, Kp, Np], or a QuantizedWeight's kernel arrays [E, rows, Np] (8-bit planes' rows
    padded to Kp: their masked edge tiles stay inside the block in interpret mode)."""
    if not isinstance(w, QuantizedWeight):
        return [w], [_whole((w.shape[0], kp, np_))]
    arrays = list(kernel_arrays(w))
    rows = [max(a.shape[1], kp) if i < len(w.bits) and w.bits[i] == 8 else a.shape[1]
            for i, a in enumerate(arrays)]
    return arrays, [_whole((a.shape[0], r, np_)) for a, r in zip(arrays, rows)]


@functools.partial(jax.jit, static_argnames=("top_k", "single", "blocks", "interpret"))
def _swiglu_call(tile_experts, x, w_gate, w_up, *, top_k, single, blocks, interpret):
    """act [T or R, F] in x's dtype (see _swiglu_kernel)."""
    _, d, f = _dims(w_gate)
    n_tiles = tile_experts.shape[0]
    rows = n_tiles if single else n_tiles * blocks.block_m
    blocks = dataclasses.replace(blocks, block_k=_step(blocks.block_k, w_gate, w_up))
    dp, fp = _pad(d, blocks.block_k), _pad(f, blocks.block_n)
    n_cols = fp // blocks.block_n
    group_m = min(blocks.group_m, n_tiles)
    formats = (_format(w_gate), _format(w_up))
    kernel = functools.partial(_swiglu_kernel, d=d, f=f, top_k=top_k, single=single,
                               n_tiles=n_tiles, n_cols=n_cols, formats=formats,
                               blocks=dataclasses.replace(blocks, group_m=group_m))
    (g_args, g_specs), (u_args, u_specs) = (_weight_operands(w, dp, fp) for w in (w_gate, w_up))
    return pl.pallas_call(
        kernel,
        grid=(n_tiles * n_cols,),
        in_specs=[_whole((n_tiles,)), _whole((x.shape[0] + single * blocks.block_m, dp)),
                  *g_specs, *u_specs],
        out_specs=_whole((rows, fp)),
        out_shape=jax.ShapeDtypeStruct((rows, f), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret,
        name=f"moe_{'decode' if single else 'grouped'}_swiglu_d{d}_f{f}"
             + "".join(f"_{w.name}" for w in (w_gate, w_up) if isinstance(w, QuantizedWeight)),
    )(tile_experts, x, *g_args, *u_args)


@functools.partial(jax.jit, static_argnames=("top_k", "single", "blocks", "interpret"))
def _down_call(tile_experts, act, w_down, routing=None, *, top_k, single, blocks, interpret):
    """single: [S * top_k, T // top_k, D], else [1, R, D], float32 (see _down_kernel)."""
    _, f, d = _dims(w_down)
    n_tiles = tile_experts.shape[0]
    rows = act.shape[0]
    bk = _step(blocks.block_k, w_down)
    blocks = dataclasses.replace(blocks, block_k=bk)
    split = max(1, min(blocks.split_k, pl.cdiv(f, bk)))
    k_chunk = _pad(pl.cdiv(f, split), bk)
    split = pl.cdiv(f, k_chunk)
    dp = _pad(d, blocks.block_n_down)
    n_cols = dp // blocks.block_n_down
    group_m = min(blocks.group_m, n_tiles)
    kernel = functools.partial(_down_kernel, f=f, d=d, single=single, top_k=top_k,
                               n_tiles=n_tiles, n_cols=n_cols, k_chunk=k_chunk,
                               formats=(_format(w_down),),
                               blocks=dataclasses.replace(blocks, group_m=group_m))
    w_args, w_specs = _weight_operands(w_down, split * k_chunk, dp)
    in_specs = [_whole((n_tiles,)), _whole((rows + single * blocks.block_m, split * k_chunk)),
                *w_specs]
    args = [tile_experts, act, *w_args]
    out = (split, rows, d)
    if single:
        in_specs.append(_whole((n_tiles,)))
        args.append(routing)
        out = (split * top_k, n_tiles // top_k, d)
    return pl.pallas_call(
        kernel,
        grid=(n_tiles * n_cols, split),
        in_specs=in_specs,
        out_specs=_whole((*out[:2], dp)),
        out_shape=jax.ShapeDtypeStruct(out, jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret,
        name=f"moe_{'decode' if single else 'grouped'}_down_f{f}_d{d}"
             + (f"_split{split}" if split > 1 else "")
             + (f"_{w_down.name}" if isinstance(w_down, QuantizedWeight) else ""),
    )(*args)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def check_experts(op: str, x, weights, experts, w_gate, w_up, w_down) -> None:
    """Raise ValueError naming the first input whose rank, shape or dtype does not fit."""
    check_array(op, "x", x, 2)
    n, d = x.shape
    named = (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down))
    for name, w in named:
        if isinstance(w, QuantizedWeight):
            check_quantized_experts(f"{op}: {name}", w)
            continue
        check_array(op, name, w, 3)
        if jnp.dtype(w.dtype) != jnp.dtype(x.dtype):
            raise ValueError(f"{op}: {name} has dtype {w.dtype} but x has {x.dtype}: the "
                             f"experts' weights and activations must share one dtype")
    e, _, f = _dims(w_gate)
    want = {"w_gate": (e, d, f), "w_up": (e, d, f), "w_down": (e, f, d)}
    for name, w in named:
        if _dims(w) != want[name]:
            raise ValueError(f"{op}: {name} has shape {_dims(w)}, expected {want[name]} "
                             f"(stacked [E, D, F] gate / up and [E, F, D] down, x [N, D={d}]; "
                             f"a quantized one's shape is its [E, K, N])")
    if isinstance(w_gate, QuantizedWeight) and isinstance(w_up, QuantizedWeight) \
            and w_gate.tile != w_up.tile:
        raise ValueError(f"{op}: w_gate ({w_gate.name}) and w_up ({w_up.name}) are read in "
                         f"one K loop but have K tiles {w_gate.tile} and {w_up.tile}; "
                         f"quantize them with the same group size")
    check_array(op, "experts", experts, 2, dtypes=(INT32,))
    check_array(op, "weights", weights, 2, dtypes=(FLOAT32,))
    if experts.shape[0] != n or not 1 <= experts.shape[1] <= e:
        raise ValueError(f"{op}: experts has shape {tuple(experts.shape)}, expected "
                         f"[N={n}, k] with 1 <= k <= E={e} (each token's chosen experts)")
    if tuple(weights.shape) != tuple(experts.shape):
        raise ValueError(f"{op}: weights has shape {tuple(weights.shape)}, expected "
                         f"{tuple(experts.shape)} (one routing weight per chosen expert)")


def _blocks(blocks, x, experts, w_gate, decode: bool) -> MoEBlockSizes:
    if blocks is None:
        e, d, f = _dims(w_gate)
        return default_block_sizes(x.shape[0], d, f, e, experts.shape[1], x.dtype.itemsize,
                                   decode=decode)
    if not isinstance(blocks, MoEBlockSizes):
        raise ValueError(f"block_sizes must be a MoEBlockSizes or None, got "
                         f"{type(blocks).__name__}")
    return blocks


def _combine(y, weights):
    """y [N * k, D] float32 (token-major) -> sum_j weights[:, j] * y[n, j] [N, D]."""
    n, k = weights.shape
    return jnp.sum(y.reshape(n, k, -1) * weights[:, :, None], axis=1)


# ---------------------------------------------------------------------------------------------
# Decode: one row per assignment
# ---------------------------------------------------------------------------------------------


def moe_decode(x, weights, experts, w_gate, w_up, w_down, *, partials: bool = False,
               interpret: bool = False, block_sizes: MoEBlockSizes | None = None):
    """The routed experts for few tokens (see the module docstring): x [N, D] -> [N, D]
    float32. Each assignment streams its expert's gate, up and down once; meant for N * k up
    to ~64 (beyond, or with many shared experts, moe_grouped reads less).
    partials=True: float32 [S * k, N, D] whose sum over the first axis is the output (each
    F chunk's product of each of the k experts, weighted), for a consumer that sums them
    itself (the next layer's fused matmul adds them to the residual stream)."""
    check_experts("moe_decode", x, weights, experts, w_gate, w_up, w_down)
    blocks = _blocks(block_sizes, x, experts, w_gate, decode=True)
    tile_experts = experts.reshape(-1)  # [N * k]: the assignments, token-major
    k = experts.shape[1]
    act = _swiglu_call(tile_experts, x, w_gate, w_up, top_k=k, single=True, blocks=blocks,
                       interpret=interpret)  # [N * k, F]
    parts = _down_call(tile_experts, act, w_down, weights.reshape(-1), top_k=k, single=True,
                       blocks=blocks, interpret=interpret)  # [S * k, N, D] float32
    return parts if partials else jnp.sum(parts, axis=0)


def take_dequantized(w, ids, dtype):
    """The chosen experts' weights w[ids] [..., K, N] (ids [...] int): an array's slices, or
    a QuantizedWeight's chosen arrays dequantized to dtype (as the kernels' float32 math,
    rounded once)."""
    if isinstance(w, QuantizedWeight):
        return dequantize(take_experts(w, ids), dtype)
    return jnp.take(w, ids, axis=0)


def moe_experts_reference(x, weights, experts, w_gate, w_up, w_down, *,
                          partials: bool = False, interpret: bool = False,
                          block_sizes: MoEBlockSizes | None = None):
    """moe_decode / moe_grouped in plain jnp: each token's k experts' weights taken and
    applied, float32 accumulation (IEEE for float32 inputs), the SwiGLU rounded to x's dtype,
    the k experts weighted in float32. partials=True: the k weighted products [k, N, D]
    (one chunk per expert: their sum is the output)."""
    del interpret, block_sizes
    check_experts("moe_experts_reference", x, weights, experts, w_gate, w_up, w_down)
    hp = ref_precision(x.dtype)
    g = jnp.einsum("nd,nkdf->nkf", x, take_dequantized(w_gate, experts, x.dtype), precision=hp,
                   preferred_element_type=jnp.float32)  # [N, k, F]
    u = jnp.einsum("nd,nkdf->nkf", x, take_dequantized(w_up, experts, x.dtype), precision=hp,
                   preferred_element_type=jnp.float32)
    act = (jax.nn.silu(g.astype(x.dtype)) * u.astype(x.dtype)).astype(x.dtype)
    y = jnp.einsum("nkf,nkfd->nkd", act, take_dequantized(w_down, experts, x.dtype),
                   precision=hp, preferred_element_type=jnp.float32)  # [N, k, D]
    if partials:
        return jnp.transpose(y * weights[:, :, None], (1, 0, 2))
    return _combine(y.reshape(-1, y.shape[-1]), weights)


moe_decode_reference = moe_experts_reference
moe_grouped_reference = moe_experts_reference


# ---------------------------------------------------------------------------------------------
# Grouped: rows sorted by expert, padded to whole tiles
# ---------------------------------------------------------------------------------------------


class Groups(NamedTuple):
    """Where the grouped GEMM puts each assignment (group_by_expert)."""
    row_token: jax.Array  # [R] int32: the token each padded row copies (padding: token 0)
    tile_experts: jax.Array  # [T] int32: each row tile's expert, -1 past the used tiles
    dest: jax.Array  # [N * k] int32: each assignment's row (token-major)


def max_tiles(assignments: int, num_experts: int, block_m: int) -> int:
    """The static bound on the row tiles: sum over experts of ceil(c_e / block_m) with
    sum c_e = assignments, at most min(E, assignments) of them nonzero."""
    used = min(num_experts, assignments)
    return (assignments + used * (block_m - 1)) // block_m


@functools.partial(jax.jit, static_argnames=("num_experts", "block_m"))
def group_by_expert(experts, num_experts: int, block_m: int) -> Groups:
    """experts [N, k] int32 -> the grouped layout: the assignments sorted by expert (stable,
    so a group keeps token order), each group padded to a multiple of block_m rows."""
    n, k = experts.shape
    a = n * k
    flat = experts.reshape(-1)  # [A]
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = jnp.cumsum(padded)  # [E]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # [A] sorted -> assignment
    expert = flat[order]
    rank = jnp.arange(a, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[expert]
    dest_sorted = (pad_end - padded)[expert] + rank  # [A]
    t = max_tiles(a, num_experts, block_m)
    row_token = jnp.zeros((t * block_m,), jnp.int32).at[dest_sorted].set(order // k)
    dest = jnp.zeros((a,), jnp.int32).at[order].set(dest_sorted)
    starts = jnp.arange(t, dtype=jnp.int32) * block_m
    tile_experts = jnp.searchsorted(pad_end, starts, side="right").astype(jnp.int32)
    tile_experts = jnp.where(starts < pad_end[-1], tile_experts, -1)
    return Groups(row_token, tile_experts, dest)


def check_grouped(op: str, rows, tile_experts, weight, blocks: MoEBlockSizes) -> None:
    check_array(op, "tile_experts", tile_experts, 1, dtypes=(INT32,))
    check_array(op, "rows", rows, 2)
    if isinstance(weight, QuantizedWeight):
        check_quantized_experts(op, weight)
    else:
        check_array(op, "weight", weight, 3, dtypes=(jnp.dtype(rows.dtype),))
    want = tile_experts.shape[0] * blocks.block_m
    k = _dims(weight)[1]
    if rows.shape[0] != want or rows.shape[1] != k:
        raise ValueError(f"{op}: rows {tuple(rows.shape)} must be [T * block_m = {want}, "
                         f"{k}] for {tile_experts.shape[0]} tiles of "
                         f"{blocks.block_m} and a weight {_dims(weight)}")


def grouped_swiglu(xs, tile_experts, w_gate, w_up, *, interpret: bool = False,
                   block_sizes: MoEBlockSizes = MoEBlockSizes()):
    """xs [R, D] (R = T * block_m rows, tile t all of expert tile_experts[t]; -1: skipped,
    its rows left unwritten) -> silu(xs @ w_gate[e]) * (xs @ w_up[e]) [R, F] in xs' dtype."""
    check_grouped("grouped_swiglu", xs, tile_experts, w_gate, block_sizes)
    check_grouped("grouped_swiglu", xs, tile_experts, w_up, block_sizes)
    if _dims(w_up) != _dims(w_gate) or _step(0, w_gate) != _step(0, w_up):
        raise ValueError(f"grouped_swiglu: w_up {_dims(w_up)} must match w_gate "
                         f"{_dims(w_gate)} (and a quantized one's K tile)")
    return _swiglu_call(tile_experts, xs, w_gate, w_up, top_k=1, single=False,
                        blocks=block_sizes, interpret=interpret)


def grouped_down(act, tile_experts, w_down, *, interpret: bool = False,
                 block_sizes: MoEBlockSizes = MoEBlockSizes()):
    """act [R, F] (tiles as in grouped_swiglu) -> act @ w_down[e] [R, D] float32."""
    check_grouped("grouped_down", act, tile_experts, w_down, block_sizes)
    blocks = dataclasses.replace(block_sizes, split_k=1)
    return _down_call(tile_experts, act, w_down, top_k=1, single=False, blocks=blocks,
                      interpret=interpret)[0]


def _grouped_reference(rows, tile_experts, block_m: int, product):
    """product(rows [T, block_m, K], weights [T, ...]) per tile, empty tiles zero."""
    t = tile_experts.shape[0]
    tiles = rows.reshape(t, block_m, -1)
    out = product(tiles, jnp.maximum(tile_experts, 0))  # [T, block_m, N]
    return jnp.where((tile_experts >= 0)[:, None, None], out, 0).reshape(t * block_m, -1)


def grouped_swiglu_reference(xs, tile_experts, w_gate, w_up, *, interpret: bool = False,
                             block_sizes: MoEBlockSizes = MoEBlockSizes()):
    """grouped_swiglu in plain jnp (empty tiles' rows zero)."""
    del interpret
    check_grouped("grouped_swiglu", xs, tile_experts, w_gate, block_sizes)
    hp = ref_precision(xs.dtype)

    def product(tiles, ids):
        g = jnp.einsum("tmd,tdf->tmf", tiles, take_dequantized(w_gate, ids, xs.dtype),
                       precision=hp, preferred_element_type=jnp.float32)
        u = jnp.einsum("tmd,tdf->tmf", tiles, take_dequantized(w_up, ids, xs.dtype),
                       precision=hp, preferred_element_type=jnp.float32)
        return (jax.nn.silu(g.astype(xs.dtype)) * u.astype(xs.dtype)).astype(xs.dtype)

    return _grouped_reference(xs, tile_experts, block_sizes.block_m, product)


def grouped_down_reference(act, tile_experts, w_down, *, interpret: bool = False,
                           block_sizes: MoEBlockSizes = MoEBlockSizes()):
    """grouped_down in plain jnp (empty tiles' rows zero)."""
    del interpret
    check_grouped("grouped_down", act, tile_experts, w_down, block_sizes)

    def product(tiles, ids):
        return jnp.einsum("tmf,tfd->tmd", tiles, take_dequantized(w_down, ids, act.dtype),
                          precision=ref_precision(act.dtype), preferred_element_type=jnp.float32)

    return _grouped_reference(act, tile_experts, block_sizes.block_m, product)


def moe_grouped(x, weights, experts, w_gate, w_up, w_down, *, partials: bool = False,
                interpret: bool = False, block_sizes: MoEBlockSizes | None = None):
    """The routed experts for many tokens (see the module docstring): x [N, D] -> [N, D]
    float32, through the grouped GEMM: every chosen expert's weights read once per sweep of
    its row tiles. partials=True: the k weighted products [k, N, D] float32 (their sum is the
    output), for a consumer kernel that adds them to the stream itself (a few rows)."""
    check_experts("moe_grouped", x, weights, experts, w_gate, w_up, w_down)
    blocks = _blocks(block_sizes, x, experts, w_gate, decode=False)
    groups = group_by_expert(experts, _dims(w_gate)[0], blocks.block_m)
    xs = x[groups.row_token]  # [R, D]
    act = grouped_swiglu(xs, groups.tile_experts, w_gate, w_up, interpret=interpret,
                         block_sizes=blocks)  # [R, F]
    y = grouped_down(act, groups.tile_experts, w_down, interpret=interpret,
                     block_sizes=blocks)  # [R, D] float32
    if partials:
        n, k = weights.shape
        return jnp.transpose(y[groups.dest].reshape(n, k, -1) * weights[:, :, None], (1, 0, 2))
    return _combine(y[groups.dest], weights)
