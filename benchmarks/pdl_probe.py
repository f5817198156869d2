"""Does programmatic dependent launch (PDL) overlap consecutive decode matmuls under XLA?

    PYTHONPATH=. python3 benchmarks/pdl_probe.py [--dims 4096,8192] [--layers 16] [--json FILE]

The B=1 decode step is a chain of kernels that each stream a weight (which does not depend on
the previous kernel) and read a small activation (which does). Every kernel pays a ramp and a
tail of ~2.5 us (benchmarks/NOTES.md, Run D). With PDL a kernel may start on the SMs its
predecessor frees and stream its weight before `griddepcontrol.wait`. This probe times a chain
of `--layers` square matmuls x [8, D] @ w [D, D] (each layer its own weight; the chain is larger
than L2), y of one the x of the next, in one executable repeated `--repeats` times (so the
host's dispatch is amortized), for:
  - mosaic: pallas_kernels.decode_matmul_mgpu without the PDL instructions,
  - mosaic+pdl: the same kernel issuing its first weight tiles before `griddepcontrol.wait`,
  - mosaic+pdl-nowait: the same without the wait (wrong results by design: it shows whether
    XLA launches the kernels with PDL at all, i.e. whether consecutive kernels overlap),
  - triton: our current decode matmul (pallas_kernels.norm_matmul, x [1, D], default blocks),
  - xla: jnp.dot.
Output per variant: us per matmul, weight TB/s, and us over the bytes at 4.27 TB/s (the ramp +
tail a PDL that works should shrink). Every variant's chain is checked against jnp.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from benchmarks.chain_timing import finish, measure_all
from pallas_kernels.decode_matmul_mgpu import DecodeMatmulConfig, decode_matmul_mgpu


def variants(configs):
    out = {"xla": lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype),
           "triton": lambda x, w: pk.norm_matmul(x, None, w)}  # takes any rows: give it 1
    for cfg in configs:
        for pdl in (False, True, "nowait"):
            tag = {False: "", True: "+pdl", "nowait": "+pdl-nowait"}[pdl]
            out[f"mosaic{tag} n{cfg.block_n}k{cfg.block_k} st{cfg.stages}"] = (
                functools.partial(lambda x, w, cfg, pdl: decode_matmul_mgpu(
                    x, w, config=cfg, pdl=pdl), cfg=cfg, pdl=pdl))
    return out


def chain(matmul, x, weights):
    for w in weights:  # [layers] of [D, D]
        x = matmul(x, w)
    return x


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dims", default="4096,8192")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--configs", default="64x64x6,64x128x4,64x256x2",
                   help="mosaic block_n x block_k x stages variants")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if jax.devices()[0].platform != "gpu":
        print("pdl_probe: needs an NVIDIA GPU (Hopper or newer)", file=sys.stderr)
        return 1
    configs = [DecodeMatmulConfig(block_n=int(n), block_k=int(k), stages=int(s))
               for n, k, s in (c.split("x") for c in args.configs.split(","))]
    rows, failures = [], 0
    for d in (int(v) for v in args.dims.split(",")):
        keys = jax.random.split(jax.random.key(d), args.layers + 1)
        x = jax.random.normal(keys[0], (8, d), jnp.float32).astype(jnp.bfloat16)
        # Scaled so that activations keep their size along the chain.
        weights = [(jax.random.normal(k, (d, d), jnp.float32) / d ** 0.5).astype(jnp.bfloat16)
                   for k in keys[1:]]
        want = jax.jit(functools.partial(chain, variants([])["xla"]))(x, weights)
        cases = [(name, functools.partial(chain, matmul),
                  x[:1] if name == "triton" else x,  # B=1 as in the model; Mosaic pads to 8
                  "nowait" in name)  # races by design
                 for name, matmul in variants([c for c in configs if d % c.block_n == 0]).items()]
        new_rows, new_failures = measure_all(cases, weights, want, dim=d, layers=args.layers,
                                             repeats=args.repeats, label=f"D={d:5d} ")
        rows += new_rows
        failures += new_failures
    return finish(rows, failures, args.json)


if __name__ == "__main__":
    sys.exit(main())
