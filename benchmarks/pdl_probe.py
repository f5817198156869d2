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
  - triton-pdl MODE: a Pallas Triton GEMV (`triton_pdl_gemv`) with pallas_kernels.pdl's
    instructions placed by MODE (`--triton-modes`); "nowait" races by design, as above,
  - xla: jnp.dot.
`--configs=` (empty) leaves the Mosaic variants out. Session 9 (jax 0.11.2): no Triton variant
overlaps either, so XLA launches Pallas Triton kernels without the PDL attribute even when they
hold the grid-dependency ops (benchmarks/NOTES.md, Run J; pdl_ffi_probe.py launches them itself).
Output per variant: us per matmul, weight TB/s, and us over the bytes at 4.27 TB/s (the ramp +
tail a PDL that works should shrink). Every variant's chain is checked against jnp.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
from jax import lax

import pallas_kernels as pk
from benchmarks.chain_timing import finish, measure_all
from pallas_kernels.decode_matmul_mgpu import DecodeMatmulConfig, decode_matmul_mgpu


TRITON_PDL_MODES = ("plain", "start", "wait-only", "loop", "nowait")


def triton_pdl_gemv(x, w, *, mode: str, block_n: int = 32, block_k: int = 256,
                    stages: int = 3, layout: str = "rows", interpret: bool = False,
                    name: str | None = None):
    """x [1, K] @ w [K, N] -> [1, N], one program per block_n columns (unsplit: no XLA kernel
    between two products), with the PDL instructions placed by `mode`:
      plain      none;
      start      launch_dependents, then wait, at the start (nothing overlaps but the launch);
      wait-only  wait at the start; the next kernel launches when this one's programs exit;
      loop       launch_dependents at the start; each x tile's load takes a wait token, so
                 the pipeliner issues the first weight tiles before the wait;
      nowait     launch_dependents at the start, the wait after the store (a race by design:
                 shows whether consecutive kernels overlap at all).
    layout "rows": x and the output as [16, *] blocks of which row 0 is real (norm_matmul's
    form); "flat": 1-D x and output blocks (the form of a hand-written Triton GEMV)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    from pallas_kernels._common import dot_f32, multiple_of
    from pallas_kernels.pdl import gdc_launch_dependents, gdc_wait, gdc_wait_token

    k, n = w.shape
    rows = 16  # the dot's minimum M; row 0 is x

    flat = layout == "flat"

    def kernel(x_ref, w_ref, o_ref):
        if mode in ("start", "loop", "nowait"):
            gdc_launch_dependents()
        if mode in ("start", "wait-only"):
            gdc_wait()

        def step(j, acc):
            start = multiple_of(j * block_k, block_k)
            wt = w_ref[pl.ds(start, block_k), :]  # [block_k, block_n]
            xs = start
            if mode == "loop":
                xs = multiple_of(start + gdc_wait_token(), block_k)
            if flat:
                xt = x_ref[pl.ds(xs, block_k)][None, :]  # [1, block_k]
            else:
                xt = x_ref[pl.ds(0, 1), pl.ds(xs, block_k)]  # [1, block_k]
            return acc + dot_f32(jnp.broadcast_to(xt, (rows, block_k)), wt)

        acc = lax.fori_loop(0, k // block_k, step, jnp.zeros((rows, block_n), jnp.float32))
        if flat:
            o_ref[...] = jnp.sum(jnp.where((jnp.arange(rows) == 0)[:, None], acc, 0.0),
                                 axis=0).astype(o_ref.dtype)
        else:
            plgpu.store(o_ref, acc.astype(o_ref.dtype), mask=(jnp.arange(rows) < 1)[:, None])
        if mode in ("loop", "nowait"):
            gdc_wait()  # the kernel is marked as a PDL one; the wait is a no-op here in "loop"

    if flat:
        specs = dict(in_specs=[pl.BlockSpec((k,), lambda j: (0,)),
                               pl.BlockSpec((k, block_n), lambda j: (0, j))],
                     out_specs=pl.BlockSpec((block_n,), lambda j: (j,)),
                     out_shape=jax.ShapeDtypeStruct((n,), x.dtype))
        x = x.reshape(k)
    else:
        specs = dict(in_specs=[pl.BlockSpec((rows, k), lambda j: (0, 0)),
                               pl.BlockSpec((k, block_n), lambda j: (0, j))],
                     out_specs=pl.BlockSpec((rows, block_n), lambda j: (0, j)),
                     out_shape=jax.ShapeDtypeStruct((1, n), x.dtype))
    out = pl.pallas_call(
        kernel, grid=(n // block_n,), **specs,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=stages),
        interpret=interpret, name=name or f"pdl_gemv_{mode.replace('-', '_')}")(x, w)
    return out.reshape(1, n)


def variants(configs, triton_modes=TRITON_PDL_MODES):
    out = {"xla": lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype),
           "triton": lambda x, w: pk.norm_matmul(x, None, w)}  # takes any rows: give it 1
    for mode in triton_modes:
        out[f"triton-pdl {mode}"] = functools.partial(triton_pdl_gemv, mode=mode)
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
    p.add_argument("--triton-modes", default=",".join(TRITON_PDL_MODES))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if jax.devices()[0].platform != "gpu":
        print("pdl_probe: needs an NVIDIA GPU (Hopper or newer)", file=sys.stderr)
        return 1
    configs = [DecodeMatmulConfig(block_n=int(n), block_k=int(k), stages=int(s))
               for n, k, s in (c.split("x") for c in args.configs.split(",") if c)]
    modes = tuple(m for m in args.triton_modes.split(",") if m)
    rows, failures = [], 0
    for d in (int(v) for v in args.dims.split(",")):
        keys = jax.random.split(jax.random.key(d), args.layers + 1)
        x = jax.random.normal(keys[0], (8, d), jnp.float32).astype(jnp.bfloat16)
        # Scaled so that activations keep their size along the chain.
        weights = [(jax.random.normal(k, (d, d), jnp.float32) / d ** 0.5).astype(jnp.bfloat16)
                   for k in keys[1:]]
        want = jax.jit(functools.partial(chain, variants([])["xla"]))(x, weights)
        cases = [(name, functools.partial(chain, matmul),
                  x[:1] if name.startswith("triton") else x,  # B=1 as in the model; Mosaic
                  "nowait" in name)  # pads to 8; "nowait" races by design
                 for name, matmul in variants([c for c in configs if d % c.block_n == 0],
                                                      modes).items()]
        new_rows, new_failures = measure_all(cases, weights, want, dim=d, layers=args.layers,
                                             repeats=args.repeats, label=f"D={d:5d} ")
        rows += new_rows
        failures += new_failures
    return finish(rows, failures, args.json)


if __name__ == "__main__":
    sys.exit(main())
