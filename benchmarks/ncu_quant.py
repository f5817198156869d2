"""The Mosaic int4 decode kernel's launches, alone, for Nsight Compute (issue 37).

    ncu --profile-from-start off --clock-control none --section Occupancy ... \\
        python3 benchmarks/ncu_quant.py --shapes 4096x28672 --configs 2-4-4,1-2-4
    PYTHONPATH=. python3 benchmarks/ncu_quant.py --cpu-check   # tiny shapes, interpret mode

Why: at one row the int4 step does not follow HBM bandwidth (2.05x bf16 on the H100, 1.65x on
the H200: benchmarks/DECISIONS.md, session 13), so the kernel is held back by latency. The
fact missing is per-block occupancy (what limits blocks per SM: registers or shared memory)
and the warps' stall reasons, which only the hardware counters give.

Each (shape, config) is compiled and run once outside the profiled window, checked against x
@ dequantize(w) in float32, then run --launches times inside a cudaProfilerStart / Stop window
(torch's, which ncu's --profile-from-start off honours for the whole process), so the
captured launches are the kernel's and its XLA epilogue's, not the compiles' or XLA's
autotuning (run with XLA_FLAGS=--xla_gpu_autotune_level=0 as well). One line per (shape,
config) names the order, so the report's launches can be matched to the configs.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.quantized import dequantize, quantize_weight
from pallas_kernels.quantized_mgpu import (MgpuMatmulConfig, default_config, int_matmul_mgpu,
                                           to_frag, to_nk)

TOL = 2e-2  # relative error (Frobenius) against x @ dequantize(w) in float32


def parse_configs(text: str) -> list[MgpuMatmulConfig]:
    """"G-S-K[-B][fwp],...": gps, stages, splits and optionally batch (groups per wgmma wait:
    fewer products in flight, fewer registers a thread); trailing letters: "f" int4 codes in
    fragment order (to_frag), "w" 128-code tiles for groups under 128 (wide), "p" scales and
    offsets applied to the codes before the product (pre) -> configs; ValueError if
    malformed."""
    out = []
    for c in text.split(","):
        flags = c[len(c.rstrip("fwp")):]
        fields = [int(v) for v in c[:len(c) - len(flags)].split("-")]
        if not 3 <= len(fields) <= 4:
            raise ValueError(c)
        out.append(MgpuMatmulConfig(*fields, frag="f" in flags, wide="w" in flags,
                                    pre="p" in flags))
    return out


def one(k: int, n: int, m: int, cfg: MgpuMatmulConfig, *, interpret: bool):
    """(jitted call, args, reference) for an int4 g128 weight of [K, N] and M rows."""
    w = jax.random.normal(jax.random.key(k + n), (k, n), jnp.float32) * 0.02
    q = to_nk(quantize_weight(w.astype(jnp.bfloat16), bits=4, group_size=128))
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.float32).astype(jnp.bfloat16)
    ref = jnp.dot(x.astype(jnp.float32), dequantize(q, jnp.float32).reshape(k, n))
    call = jax.jit(lambda x, c, s: int_matmul_mgpu(x, (c,), (s,), cfg=cfg,
                                                   interpret=interpret)[0])
    codes = to_frag(q.planes[0]) if cfg.frag else q.planes[0]
    return call, (x, codes, q.scale), ref


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="4096x6144,4096x4096,4096x28672,14336x4096",
                    metavar="KxN,...", help="Llama-3-8B's q/k/v, o, gate + up, down")
    ap.add_argument("--configs", default=None, metavar="G-S-K[-B],...",
                    help="gps-stages-splits[-batch][f] (f: codes in fragment order; default: "
                         "each shape's default_config)")
    ap.add_argument("--m", type=int, default=1, help="rows")
    ap.add_argument("--launches", type=int, default=3, help="profiled launches per config")
    ap.add_argument("--cpu-check", action="store_true",
                    help="a tiny shape (512 x 128) in interpret mode, no profiler window")
    args = ap.parse_args()
    try:
        configs = parse_configs(args.configs) if args.configs else [None]
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    except ValueError:
        ap.error("--shapes KxN,... and --configs gps-stages-splits[-batch],... take integers, "
                 "e.g. --shapes 4096x4096 --configs 2-4-4,1-2-4,2-2-4-1")
    if args.cpu_check:
        shapes = [(512, 128)]
        configs = configs if args.configs else [MgpuMatmulConfig(2, 2, 2),
                                                MgpuMatmulConfig(1, 2, 4, batch=1)]
    profiler = None
    if not args.cpu_check:
        import torch  # its cudaProfilerStart / Stop: ncu --profile-from-start off
        profiler = torch.cuda.profiler
    runs, failed = [], 0
    for k, n in shapes:
        for cfg in configs:
            cfg = cfg or default_config(args.m, k, n)
            if k % (cfg.splits * cfg.gps * 128) or n % 64:
                print(f"skip {k}x{n} {cfg}: K not {cfg.splits} splits of {cfg.gps} x 128")
                continue
            call, xs, ref = one(k, n, args.m, cfg, interpret=args.cpu_check)
            y = call(*xs).astype(jnp.float32)
            err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
            ok = err < TOL
            failed += not ok
            print(f"{'ok' if ok else 'FAIL'} {k}x{n} M={args.m} {cfg}: rel err {err:.2e}",
                  flush=True)
            if ok:
                runs.append((f"{k}x{n} {cfg}", call, xs))
    if profiler is not None:
        profiler.start()
        for name, call, xs in runs:  # in this order in the report, --launches each
            for _ in range(args.launches):
                call(*xs).block_until_ready()
        profiler.stop()
    for i, (name, _, _) in enumerate(runs):
        print(f"profiled #{i}: {name} x {0 if profiler is None else args.launches}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
