"""The CPU's quantized matmul kernel (pallas_kernels/cpu_quantized.cc) at decode shapes: x as it
is against x rounded to int8 (`int8_x`, KernelPolicy.cpu_int8_activations), rounds alternated in
one process (a shared VM's speed drifts between processes).

    PYTHONPATH=. python benchmarks/cpu_kernel.py [--rows 1,5,16] [--threads 0] [--rounds 2]
        [--shapes Q4_K:1536x8960,Q6_K:8960x1536,Q8_0:1536x8960,Q6_K:1536x151936]

Shapes are K x N of random GGUF blocks (Qwen2.5-1.5B's gate, down, and tied head by default).
Prints the median ms of each (shape, rows, x) per round and the weights streamed a second.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from checkpoints import gguf_blocks  # noqa: E402
from pallas_kernels import cpu_quantized as cq  # noqa: E402
from test_gguf_blocks import random_blocks  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="Q4_K:1536x8960,Q6_K:8960x1536,Q8_0:1536x8960,"
                                        "Q6_K:1536x151936")
    ap.add_argument("--rows", default="1,5,16")
    ap.add_argument("--threads", type=int, default=0, help="XLA intra-op threads used (0: all)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=15)
    args = ap.parse_args()
    assert cq.available(), "the kernel could not be built"
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"jax {jax.__version__}, threads={args.threads}", flush=True)
    mm = jax.jit(cq.quantized_matmul_cpu, static_argnames=("threads", "int8_x"))
    for spec in args.shapes.split(","):
        t, shape = spec.split(":")
        k, n = (int(v) for v in shape.split("x"))
        raw = random_blocks(t, n, k, np.random.default_rng(0))
        qw = jax.tree.map(jnp.asarray, gguf_blocks.repack(raw, t, k, n))
        for m in (int(r) for r in args.rows.split(",")):
            x = jnp.asarray(np.random.default_rng(1).standard_normal((m, k)), jnp.float32)
            res: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.rounds):
                for int8_x in (False, True):
                    f = lambda: mm(x, qw, threads=args.threads, int8_x=int8_x)  # noqa: E731
                    f().block_until_ready()
                    ts = []
                    for _ in range(args.iters):
                        t0 = time.perf_counter()
                        f().block_until_ready()
                        ts.append(time.perf_counter() - t0)
                    res[int8_x].append(1e3 * float(np.median(ts)))
            best = {v: min(ms) for v, ms in res.items()}
            print(f"{t} {k}x{n} M={m}: x "
                  + " / ".join(f"{v:.3f}" for v in res[False]) + " ms, int8 x "
                  + " / ".join(f"{v:.3f}" for v in res[True])
                  + f" ms ({best[False] / best[True]:.2f}x; {k * n * m / best[True] / 1e6:.1f}"
                  " G weight-rows/s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
