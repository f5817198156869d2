"""Quantized matmuls off the kernels' path (the CPU): dequantized one tile at a time.

Where no Pallas kernel runs (the CPU, float32 activations), x @ w of a `QuantizedWeight` is
computed as a loop over tiles of w: each tile's codes and scales are dequantized to a float32
tile of about `dequant_block_bytes(policy)` (on a CPU half its last-level cache, 8 to 32 MiB)
and multiplied, so XLA holds one tile instead of the weight's float copy, and the
dequantization cannot be hoisted out of the decode loop (an optimization barrier ties the
codes to the step's input). The model's memory is then its codes and scales, about the
checkpoint's file size, rather than every layer's float32 weights (XLA hoisted those out of
the decode loop: 9 GB for a 1 GB Q4_K_M file). Tiles are column blocks [K, cols], or for a
tall weight (a down projection) row blocks [rows, N], which are contiguous slices of the codes.

The tiles' values are those of `dequantize` (the same float32 products); a column tile's
outputs are each one float32 dot over K, a row tile's partial sums are added in order.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxinfer.ops import reference
from jaxinfer.plan import KernelPolicy, Plan
from jaxinfer.weights import Parts, QuantizedWeight, as_array, is_transposed
from pallas_kernels import cpu_quantized
from pallas_kernels.quantized import group_scales, unpack_plane

# The CPU's float32 tile: half the last-level cache, so the tile the dequantization writes is
# still cached when the dot reads it; 8 to 32 MiB, as smaller tiles ran on one thread (a large
# tile's dequantization XLA splits over both cores). Measured per machine: DECISIONS.md.
CPU_BLOCK_MIN, CPU_BLOCK_MAX = 8 << 20, 32 << 20
CPU_BLOCK_UNKNOWN = 16 << 20  # where the cache's size cannot be read


@functools.cache
def cpu_block_bytes(caches: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The CPU's default tile: half its last-level cache (Linux's sysfs `caches` folder)
    within [8, 32] MiB, a power of two; 16 MiB where the size cannot be read."""
    import glob

    best = (0, 0)  # (level, bytes)
    for d in glob.glob(f"{caches}/index*"):
        try:
            with open(f"{d}/level") as f:
                level = int(f.read())
            with open(f"{d}/size") as f:
                text = f.read().strip()  # "32768K"
            unit = {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0)
            size = int(text[:-1] if unit else text) << unit
        except (OSError, ValueError):
            continue
        best = max(best, (level, size))
    if not best[1]:
        return CPU_BLOCK_UNKNOWN
    half = 1 << (best[1] // 2).bit_length() - 1  # a power of two at most half the cache
    return min(max(half, CPU_BLOCK_MIN), CPU_BLOCK_MAX)


# At most this many rows (decode steps, small batches) multiply tile by tile; more (a prefill
# chunk) dequantize the weight whole, one weight at a time. XLA gives each loop's output
# buffer its own allocation for the whole step, so the [T, N] outputs of every layer's tile
# loops add up (prefill temp of 4 layers at 512 tokens: 212 MB tiled, 59 MB whole), while a
# whole weight's float32 copy is a temporary XLA reuses from one weight to the next; beside
# a GEMM of that many rows its dequantization costs little.
TILED_ROWS = 64


def dequant_block_bytes(policy: KernelPolicy) -> int:
    """Float32 bytes of one dequantized tile (the policy's, or its default: cpu_block_bytes()
    on the CPU, 0 elsewhere: a GPU's reference path dequantizes once per request,
    generate.run_params)."""
    block = policy.dequant_block_bytes
    if block is None:
        return cpu_block_bytes() if jax.default_backend() == "cpu" else 0
    return block


def plan_block_bytes(plan: Plan) -> int:
    """dequant_block_bytes of the plan's policy, 0 on a sharded plan: XLA partitions the
    whole-weight reference over the mesh, where a tile's slices of a sharded weight would
    gather its codes across devices."""
    return 0 if plan.sharded else dequant_block_bytes(plan.policy)


def block_columns(k: int, n: int, block_bytes: int) -> int:
    """Columns per tile of a [K, N] weight: the largest power of two whose float32 [K, cols]
    tile fits block_bytes (at least 1), at most N."""
    cols = 1
    while cols * 2 * k * 4 <= block_bytes and cols * 2 <= n:
        cols *= 2
    return cols


def dequantize_tile(qw: QuantizedWeight, dtype) -> jax.Array:
    """dequantize(qw) of a tile, the same float32 values, in the form XLA's CPU code runs
    fastest: the codes stay uint8 until one conversion (code_offset taken off in float32,
    exactly), and the per-group scales and offsets are made first (an optimization barrier):
    XLA would otherwise fuse their conversions and products (fp16 super-scales times 6-bit
    sub-scales) into every element's dequantization."""
    c, shift = None, 0
    for plane, b in zip(qw.planes, qw.bits):
        v = unpack_plane(plane, b, qw.tile, qw.k)  # [K, N] uint8 (int8 / fp8 as stored)
        c = v if c is None else c | (v << shift)
        shift += b
    c = c.astype(jnp.float32)
    if qw.code_offset:
        c = c - qw.code_offset
    s, o = jax.lax.optimization_barrier(group_scales(qw))  # [G, N] float32 each, o or None
    rows = qw.groups * qw.group  # K padded to whole groups (one group: per-column scales)
    cg = jnp.pad(c, ((0, max(rows - qw.k, 0)), (0, 0)))[:rows].reshape(qw.groups, qw.group, -1)
    w = cg * s[:, None, :]
    if o is not None:
        w = w + o[:, None, :]
    return w.reshape(rows, -1)[:qw.k].astype(dtype)


def _columns(qw: QuantizedWeight, start, width: int) -> QuantizedWeight:
    """Columns start .. start + width - 1 of qw (its arrays are [rows, N]): a weight [K, width]."""
    def take(a):
        return jax.lax.dynamic_slice_in_dim(a, start, width, axis=a.ndim - 1)
    return qw.map_columns(take).replace(out_shape=(width,))


def row_unit(qw: QuantizedWeight) -> int:
    """The fewest rows of K a row slice of qw can start and end at: whole byte rows of every
    plane, whole scale groups and super-groups."""
    unit = math.lcm(qw.group, qw.super_group or 1)
    for b in qw.bits:
        unit = math.lcm(unit, qw.tile * (8 // b) if b < 8 else 1)
    return unit


def block_rows(qw: QuantizedWeight, block_bytes: int) -> int | None:
    """Rows per tile for a tall weight read in row tiles [rows, N] (contiguous slices, the
    columns whole), or None to read it in column tiles: a weight wider than tall, or whose
    K is not whole units (row_unit), or whose one-unit tile is over twice block_bytes."""
    unit, k, n = row_unit(qw), qw.k, qw.n
    if k <= n or k % unit or unit * n * 4 > 2 * block_bytes:
        return None
    units = k // unit  # the most whole units that divide K and fit block_bytes
    return unit * max(m for m in range(1, units + 1)
                      if units % m == 0 and (m == 1 or m * unit * n * 4 <= block_bytes))


def _rows(qw: QuantizedWeight, start, count: int) -> QuantizedWeight:
    """Rows start .. start + count - 1 of K (multiples of row_unit) as a weight [count, N]."""
    def take(a, k_per_row: int):
        return None if a is None else jax.lax.dynamic_slice_in_dim(a, start // k_per_row,
                                                                    count // k_per_row, axis=0)
    return qw.replace(planes=tuple(take(p, 8 // b) for p, b in zip(qw.planes, qw.bits)),
                      scale=take(qw.scale, qw.group), offset=take(qw.offset, qw.group),
                      super_scale=take(qw.super_scale, qw.super_group),
                      super_offset=take(qw.super_offset, qw.super_group), k=count)


def blocked_matmul(x: jax.Array, qw: QuantizedWeight, block_bytes: int) -> jax.Array:
    """x [..., K] @ dequantize(qw) [K, *N] -> [..., *N] float32, one dequantized tile at a
    time (about block_bytes of float32 each): row tiles for a tall weight (a down
    projection: contiguous slices, partial products summed in order), else column tiles."""
    lead, k, n = x.shape[:-1], qw.k, qw.n
    # Tied to the input, the weight's tiles are never loop-invariant: XLA would otherwise
    # hoist the dequantization of a weight of one tile (no loop left) out of the decode loop.
    qw, xm = jax.lax.optimization_barrier((qw, x.reshape(-1, k)))  # xm [M, K]
    rows = block_rows(qw, block_bytes)
    if rows is not None:
        def add_tile(i, acc):  # acc [M, N] float32 += x's rows of tile i @ the tile
            part = dequantize_tile(_rows(qw, i * rows, rows), xm.dtype).reshape(rows, n)
            xs = jax.lax.dynamic_slice_in_dim(xm, i * rows, rows, axis=1)
            return acc + reference.linear(xs, part, out_dtype=jnp.float32)
        y = jax.lax.fori_loop(0, k // rows, add_tile, jnp.zeros((xm.shape[0], n), jnp.float32))
        return y.reshape(*lead, *qw.out_shape)
    cols = block_columns(k, n, block_bytes)
    blocks, rest = divmod(n, cols)

    def tile(start, width):  # [M, width] float32
        return reference.linear(xm, dequantize_tile(_columns(qw, start, width), xm.dtype),
                                out_dtype=jnp.float32)

    ys = jax.lax.map(lambda j: tile(j * cols, cols), jnp.arange(blocks))  # [blocks, M, cols]
    y = jnp.moveaxis(ys, 0, 1).reshape(xm.shape[0], blocks * cols)
    if rest:  # the last columns, fewer than a tile
        y = jnp.concatenate([y, tile(blocks * cols, rest)], axis=1)
    return y.reshape(*lead, *qw.out_shape)


def int8_rows(x: jax.Array, w, plan: Plan) -> jax.Array:
    """x as a CPU matmul of the quantized weight w takes it (KernelPolicy.cpu_int8_activations:
    rounded to int8 per 16 values, as the C++ kernel rounds it), else x."""
    if (plan_block_bytes(plan) and plan.policy.cpu_int8_activations
            and isinstance(w, QuantizedWeight) and w.layout == "tiles"):
        return cpu_quantized.round_to_int8(x).astype(x.dtype)
    return x


def linear(x: jax.Array, w, plan: Plan, bias=None, out_dtype=None) -> jax.Array:
    """The reference x [..., K] @ w (+ bias) -> [..., *N] in out_dtype (default x's), with
    QuantizedWeights (alone or among Parts) where the plan says (dequant_block_bytes) on the
    CPU kernel (at most cpu_quantized_rows rows) or dequantized a tile at a time, else
    dequantized whole."""
    block = plan_block_bytes(plan)
    if block and isinstance(w, QuantizedWeight) and w.layout == "tiles":
        rows = math.prod(x.shape[:-1])
        if rows <= TILED_ROWS:
            # one pass over the codes, no float tile written (KernelPolicy.cpu_quantized_rows)
            if rows <= plan.policy.cpu_quantized_rows and cpu_quantized.unfit(w) is None:
                y = cpu_quantized.quantized_matmul_cpu(
                    x.reshape(-1, w.k), w, int8_x=plan.policy.cpu_int8_activations)
                y = y.reshape(*x.shape[:-1], *w.out_shape)
            else:
                y = blocked_matmul(int8_rows(x, w, plan), w, block)
        else:  # a prefill: the weight whole (see TILED_ROWS), once its input is there, so
            # that XLA cannot dequantize every layer's weights up front and hold them all
            w, x = jax.lax.optimization_barrier((w, x))
            y = reference.linear(int8_rows(x, w, plan), dequantize_tile(w, x.dtype),
                                 out_dtype=jnp.float32)
            y = y.reshape(*x.shape[:-1], *w.out_shape)
    elif block and isinstance(w, Parts):
        y = w.combine([linear(x, p, plan, out_dtype=jnp.float32).reshape(*x.shape[:-1], -1)
                       for p in w.parts])
    else:
        y = reference.linear(x, as_array(w, x.dtype), transposed=is_transposed(w),
                             out_dtype=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype or x.dtype)
