"""Is a grid barrier inside one persistent kernel cheaper than a kernel boundary at batch 1?

    PYTHONPATH=. python3 benchmarks/grid_barrier_probe.py [--dim 4096] [--layers 16] [--json F]

Why: the batch-1 decode step is a chain of weight-streaming kernels and pays ~2.5 us per kernel
(benchmarks/NOTES.md, Run D) in ramp (the first loads' latency) and tail. Programmatic
dependent launch would hide the ramp, but XLA does not overlap Pallas kernels (NOTES.md,
session 4). The other way to hide it is a persistent kernel: all phases in one launch, one
program per SM, phases separated by a grid barrier, and the next phase's first weight tiles
loaded *before* the barrier (they do not depend on the previous phase), so they are in flight
while the barrier waits. Whether that beats the kernel boundary decides if a decode-layer
megakernel is worth building.

The workload: a chain of `--layers` products y = x @ w_l, x [1, D], w_l [D, D] bf16 (each layer
its own weight; the chain is larger than L2), y the x of the next, timed in one executable
repeated `--repeats` times, as:
  - norm_matmul: the model's decode matmul per product (split-K, XLA sums the chunks);
  - kernels: one Pallas Triton kernel per product (the same program body as below);
  - persistent: one kernel, a counter barrier between phases;
  - persistent+prefetch: the same, the next phase's first `--prefetch` weight tiles loaded
    before the barrier.
Every program owns `block_n` output columns for all phases (D / block_n programs, at most one
per SM, so all are resident: the barrier needs that). Each variant is checked against jnp.

The barrier: after its stores (and a thread barrier), a program adds 1 to a counter (atomic,
release), then polls it with atomic reads (acquire) until all programs have arrived for this
phase; activations written by other programs are then loaded with volatile loads (not cached
in L1). Interpret mode runs programs one after another, so it can only run one program (the
CPU test does); on the GPU a program that is not resident would deadlock the rest.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import pallas_kernels as pk
from benchmarks.chain_timing import finish, measure_all

ROWS = 16  # the dot's minimum M: x's one row, the rest masked to zero
MAX_POLLS = 1 << 16  # per barrier, ~50 ms of polling


def _x_tile(src, k0, block_k):
    """x[0, k0:k0 + block_k] as a [ROWS, block_k] tile whose other rows are 0; a volatile load,
    not cached in L1: another program may have written it since this SM last read that line
    (the ".cg" cache modifier would say so more narrowly, but jax 0.11.2's Triton lowering
    looks ".cg" up under "cg" and fails).
    src = (ref, *leading indices) of a [..., 1, D] array (one indexer: interpret mode's masked
    loads take no stacked views)."""
    ref, *lead = src
    rows = jnp.arange(ROWS)[:, None] < 1
    return plgpu.load(ref.at[(*lead, pl.ds(0, ROWS), pl.ds(k0, block_k))], mask=rows, other=0,
                      volatile=True)


def _phase(src, w_ref, cols, *, block_k: int, first=()):
    """src (see _x_tile: x [1, D]) @ w_ref[:, cols] -> [ROWS, block_n] float32 (row 0 real).
    w_ref: a [D, D] ref. `first`: weight tiles of the first steps, already loaded."""
    d = w_ref.shape[-2]
    acc = jnp.zeros((ROWS, cols.size), jnp.float32)
    for i, w in enumerate(first):
        acc += jnp.dot(_x_tile(src, i * block_k, block_k), w,
                       preferred_element_type=jnp.float32)

    def step(j, acc):
        k0 = pl.multiple_of(j * block_k, block_k)
        w = w_ref[pl.ds(k0, block_k), cols]
        return acc + jnp.dot(_x_tile(src, k0, block_k), w, preferred_element_type=jnp.float32)

    return lax.fori_loop(len(first), d // block_k, step, acc)


def _store_row(dst, acc, cols):
    """Row 0 of acc into dst = (ref, *leading indices) of a [..., 1, D] array."""
    ref, *lead = dst
    rows = jnp.arange(ROWS)[:, None] < 1
    plgpu.store(ref.at[(*lead, pl.ds(0, ROWS), cols)], acc.astype(ref.dtype), mask=rows)


def phase_kernel(x_ref, w_ref, y_ref, *, block_n: int, block_k: int):
    # x_ref [1, D], w_ref [D, D], y_ref [1, D]; program p: columns p*block_n...
    cols = pl.ds(pl.program_id(0) * block_n, block_n)
    _store_row((y_ref,), _phase((x_ref,), w_ref, cols, block_k=block_k), cols)


def _grid_barrier(counter_ref, phase, programs: int, interpret: bool):
    """Wait until all `programs` programs have arrived `phase` times at counter_ref [1] (int32).
    Scalar atomics: Triton runs them once per program (one thread, the result broadcast), and
    jax 0.11.2's Pallas Triton lowering takes only scalar integer atomics (a vector of int32
    takes its float path). (Interpret mode runs one thread per program: no thread barrier, and
    it has no rule for it.)"""
    if not interpret:
        plgpu.debug_barrier()  # all of this program's threads have issued their stores
    def counter_add(v):
        if interpret:  # its rule takes a slice, not a scalar index
            return plgpu.atomic_add(counter_ref, (pl.ds(0, 1),), jnp.full((1,), v))[0]
        return plgpu.atomic_add(counter_ref, (jnp.int32(0),), jnp.int32(v))

    counter_add(1)  # arrive (release)
    target = phase * programs

    def not_all_there(carry):
        seen, polls = carry
        # Bounded, so that a program that never arrives (one not resident) costs the probe a
        # wrong result, which the check reports, rather than a hung GPU.
        return (seen < target) & (polls < MAX_POLLS)

    def poll(carry):  # acquire: what the others stored before arriving is visible after
        return counter_add(0), carry[1] + 1

    lax.while_loop(not_all_there, poll, (jnp.int32(0), jnp.int32(0)))
    if not interpret:
        plgpu.debug_barrier()


def persistent_kernel(x_ref, *refs, block_n: int, block_k: int, prefetch: int,
                      interpret: bool):
    # x_ref [1, D]; refs = L weight refs [D, D] (one buffer each, as the model's layers), the
    # counter [1] int32 (0 on entry), out [L, 1, D] (phase l's output, the x of phase l + 1),
    # the counter again (the same buffer, aliased): barrier arrivals
    *w_refs, _, out_ref, counter_ref = refs
    layers = len(w_refs)
    programs = pl.num_programs(0)
    cols = pl.ds(pl.program_id(0) * block_n, block_n)
    first = ()
    for layer in range(layers):
        here = jnp.int32(layer)  # an index array (a Python int has no shape for the indexer)
        src = (x_ref,) if layer == 0 else (out_ref, here - 1)
        acc = _phase(src, w_refs[layer], cols, block_k=block_k, first=first)
        _store_row((out_ref, here), acc, cols)
        if layer + 1 < layers:
            # The next weight's first tiles do not depend on this phase: in flight while the
            # barrier waits.
            first = tuple(w_refs[layer + 1][pl.ds(i * block_k, block_k), cols]
                          for i in range(prefetch))
            _grid_barrier(counter_ref, layer + 1, programs, interpret)


def chain_kernels(x, weights, *, block_n=32, block_k=256, stages=3, warps=4, interpret=False):
    """x [1, D], weights: L arrays [D, D] (separate buffers: a slice of one stacked array would
    be copied before each custom call): one kernel per layer."""
    d = x.shape[1]
    call = pl.pallas_call(
        functools.partial(phase_kernel, block_n=block_n, block_k=block_k),
        grid=(d // block_n,),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret, name=f"gemv_phase_d{d}")
    for w in weights:
        x = call(x, w)
    return x


def chain_persistent(x, weights, *, block_n=32, block_k=256, stages=3, warps=4, prefetch=0,
                     interpret=False):
    """x [1, D], weights: L arrays [D, D]: one persistent kernel for all layers."""
    layers, d = len(weights), x.shape[1]
    programs = d // block_n
    counter = jnp.zeros((1,), jnp.int32)
    out, _ = pl.pallas_call(
        functools.partial(persistent_kernel, block_n=block_n, block_k=block_k,
                          prefetch=prefetch, interpret=bool(interpret)),
        grid=(programs,),
        out_shape=(jax.ShapeDtypeStruct((layers, *x.shape), x.dtype),
                   jax.ShapeDtypeStruct((1,), jnp.int32)),
        input_output_aliases={1 + layers: 1},  # the counter is updated in place
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret, name=f"gemv_persistent_d{d}_l{layers}_pre{prefetch}")(
            x, *weights, counter)
    return out[-1]


def chain_norm_matmul(x, weights):
    """The model's decode matmul per layer (its default blocks: split-K + the XLA sum)."""
    for w in weights:
        x = pk.norm_matmul(x, None, w)
    return x


def chain_reference(x, weights):
    for w in weights:
        x = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return x


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--block-n", type=int, default=32)
    p.add_argument("--prefetch", default="1,2", help="tiles loaded before the barrier")
    p.add_argument("--bodies", default="256x3x4,512x4x4,512x3x8",
                   help="program bodies block_k x stages x warps, each as kernels and persistent")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if jax.devices()[0].platform != "gpu":
        print("grid_barrier_probe: needs an NVIDIA GPU", file=sys.stderr)
        return 1
    programs = args.dim // args.block_n
    if programs > jax.devices()[0].core_count:
        print(f"grid_barrier_probe: {programs} programs > {jax.devices()[0].core_count} SMs: "
              f"raise --block-n (all programs must be resident)", file=sys.stderr)
        return 1
    keys = jax.random.split(jax.random.key(0), 2)
    d = args.dim
    x = jax.random.normal(keys[0], (1, d), jnp.float32).astype(jnp.bfloat16)
    # Separate buffers per layer, as the model's; activations keep their size along the chain.
    weights = [(jax.random.normal(k, (d, d), jnp.float32) / d ** 0.5).astype(jnp.bfloat16)
               for k in jax.random.split(keys[1], args.layers)]
    want = jax.jit(chain_reference)(x, weights)
    variants = {"xla": chain_reference, "norm_matmul (production)": chain_norm_matmul}
    for body in args.bodies.split(","):
        bk, st, wa = (int(v) for v in body.split("x"))
        kw = dict(block_n=args.block_n, block_k=bk, stages=st, warps=wa)
        variants[f"kernels {body}"] = functools.partial(chain_kernels, **kw)
        variants[f"persistent {body}"] = functools.partial(chain_persistent, **kw)
        for pre in (int(v) for v in args.prefetch.split(",") if v):
            variants[f"persistent {body} +prefetch{pre}"] = functools.partial(
                chain_persistent, prefetch=pre, **kw)
    rows, failures = measure_all([(name, fn, x, False) for name, fn in variants.items()],
                                 weights, want, dim=d, layers=args.layers,
                                 repeats=args.repeats, label=f"D={d} ")
    return finish(rows, failures, args.json)


if __name__ == "__main__":
    sys.exit(main())
