"""Does programmatic dependent launch (PDL) overlap consecutive Pallas kernels under XLA?

    PYTHONPATH=. python3 benchmarks/pdl_probe.py [--layers 16] [--json FILE]

The B=1 decode step is a chain of kernels that each stream a weight (which does not depend on
the previous kernel) and read a small activation (which does). Every kernel pays a ramp and a
tail of ~2.5 us (benchmarks/NOTES.md, Run D); with PDL a kernel may start on the SMs its
predecessor frees and stream its weight before `griddepcontrol.wait`, hiding both. Pallas
Mosaic GPU exposes the two instructions (`plgpu.griddepcontrol_launch_dependents`,
`plgpu.griddepcontrol_wait`) and marks such kernels `uses_pdl`; whether XLA's runtime then
launches them with programmatic stream serialization is what this probe measures.

The kernel mimics a decode matmul: one block per SM, each streams its share of a weight
[num_sms, chunks, 64, 128] bf16 into shared memory with TMA (all chunks in flight), then reads
the activation x [num_sms, 64, 128] and writes y = x + its first weight tile. A chain of
`--layers` such kernels, each with its own weight (the chain is larger than L2), runs in one
jitted program with and without the PDL instructions. Output: us per kernel, the weight
bytes' rate, and the ratio; a PDL that works shows the PDL chain faster by about the ramp and
tail per kernel. The result is checked against jnp on every run.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

TILE = (64, 128)  # one bf16 TMA tile: 16 KiB


def streaming_kernel(num_blocks: int, chunks: int, pdl: bool):
    """y = x + w[:, 0]: x, y [num_blocks, 64, 128], w [num_blocks, chunks, 64, 128] (bf16);
    block b streams w[b] (chunks x 16 KiB) before it touches x."""

    def body(x_ref, w_ref, y_ref, w_smem, loaded):
        b = lax.axis_index("b")
        if pdl:
            # Every block has started: the next kernel may be scheduled on freed SMs.
            plgpu.griddepcontrol_launch_dependents()
        for c in range(chunks):  # all loads in flight at once (one barrier each)
            plgpu.copy_gmem_to_smem(w_ref.at[b, c], w_smem.at[c], loaded.at[c])
        for c in range(chunks):
            plgpu.barrier_wait(loaded.at[c])
        if pdl:
            # Only now the activation, which the previous kernel writes.
            plgpu.griddepcontrol_wait()
        y_ref[b] = x_ref[b] + w_smem[0]

    def call(x, w):
        return plgpu.kernel(
            body,
            out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
            scratch_types=[plgpu.SMEM((chunks, *TILE), jnp.bfloat16),
                           plgpu.Barrier(num_barriers=chunks)],
            grid=(num_blocks,),
            grid_names=("b",),
        )(x, w)

    return call


def chain(kernel, x, weights):
    for w in weights:  # [layers] of [num_blocks, chunks, 64, 128]
        x = kernel(x, w)
    return x


def chain_reference(x, weights):
    for w in weights:
        x = x + w[:, 0]
    return x


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--chunks", type=int, default=8, help="16 KiB weight tiles per block")
    p.add_argument("--blocks", type=int, default=None, help="default: one per SM")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        print("pdl_probe: needs an NVIDIA GPU (Hopper or newer)", file=sys.stderr)
        return 1
    blocks = args.blocks or dev.core_count
    keys = jax.random.split(jax.random.key(0), args.layers + 1)
    x = jax.random.normal(keys[0], (blocks, *TILE), jnp.float32).astype(jnp.bfloat16)
    weights = [jax.random.normal(k, (blocks, args.chunks, *TILE), jnp.float32).astype(jnp.bfloat16)
               for k in keys[1:]]
    want = jax.jit(chain_reference)(x, weights)
    weight_bytes = blocks * args.chunks * TILE[0] * TILE[1] * 2  # per kernel
    rows = []
    for pdl in (False, True):
        fn = jax.jit(functools.partial(chain, streaming_kernel(blocks, args.chunks, pdl)))
        got = jax.block_until_ready(fn(x, weights))
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x, weights))
            times.append(time.perf_counter() - t0)
        sec = sorted(times)[len(times) // 2] / args.layers  # median, per kernel
        row = dict(pdl=pdl, blocks=blocks, chunks=args.chunks, layers=args.layers,
                   us_per_kernel=sec * 1e6, weight_tbs=weight_bytes / sec / 1e12,
                   max_abs_err=err)
        rows.append(row)
        print(f"pdl={pdl!s:5s} {blocks} blocks x {args.chunks} x 16 KiB: "
              f"{row['us_per_kernel']:.2f} us/kernel, {row['weight_tbs']:.2f} TB/s of weight, "
              f"max |err| {err:.2e}", flush=True)
    print(f"PDL chain / plain chain time: {rows[1]['us_per_kernel'] / rows[0]['us_per_kernel']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["max_abs_err"] == 0.0 for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
