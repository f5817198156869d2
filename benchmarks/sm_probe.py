"""Does a decode weight stream go faster when its programs cover every SM?

    PYTHONPATH=. python3 benchmarks/sm_probe.py [--json F]

Why: the batch-1 decode step's two big streams run below what the lm_head's XLA GEMM reaches
(4.5 TB/s): SwiGLU (K 4096, N 14336, two weights, 128-wide tiles: 112 programs on 132 SMs)
at ~4.15 TB/s, down (K 14336, N 4096, 64-wide tiles split 4: 256 programs, one resident per
SM) at ~4.0 (benchmarks/NOTES.md). If one SM streams only ~37 GB/s, 112 programs cannot
reach the HBM's rate and a schedule over exactly one program per SM (stream-K) would. This
probe measures the fused decode matmuls at batch 1 with program counts around the SM count,
by N (or split) alone, everything else as the model's defaults, from a profiler trace (GPU
time per kernel, no host or chain effects): TB/s per configuration, and per program. Also
the cost of a sublayer boundary (residual add of split-K chunks, RMSNorm) in the consumer's
main loop, by part (FUSED).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile

import jax
import jax.numpy as jnp

from benchmarks.profile_decode import device_kernels, load_trace
from pallas_kernels.norm_matmul import MatmulBlockSizes, fused_matmul

MB = MatmulBlockSizes
# name: (K, N, weights, blocks); the kernel name carries K and N, so each N is used once.
CASES = {
    "swiglu 112 programs (model)": (4096, 14336, 2, MB(16, 128, 128, 4, 3, 1)),
    "swiglu 128 programs": (4096, 16384, 2, MB(16, 128, 128, 4, 3, 1)),
    "swiglu 132 programs": (4096, 16896, 2, MB(16, 128, 128, 4, 3, 1)),
    "swiglu 65 programs": (4096, 8320, 2, MB(16, 128, 128, 4, 3, 1)),
    "swiglu 132 programs, 64 wide": (4096, 8448, 2, MB(16, 64, 128, 4, 3, 1)),
    "down 256 programs (model)": (14336, 4096, 1, MB(16, 64, 256, 4, 3, 4)),
    "down 133 programs, 32 wide unsplit": (14336, 4256, 1, MB(16, 32, 256, 4, 3, 1)),
    "down 130 programs, 64 wide split 2": (14336, 4160, 1, MB(16, 64, 256, 4, 3, 2)),
    "down 264 programs, 64 wide split 4": (14336, 4224, 1, MB(16, 64, 256, 4, 3, 4)),
}
# The cost of the sublayer boundary in the consumer's main loop (layers.BOUNDARY_MODES):
# (K, N, weights, blocks, norm, deltas chunks); N differs by one tile per variant (the plain
# SwiGLU is CASES' model row).
FUSED = {
    "swiglu + norm": (4096, 14336 + 128, 2, MB(16, 128, 128, 4, 3, 1), True, 0),
    "swiglu + 4 deltas": (4096, 14336 + 256, 2, MB(16, 128, 128, 4, 3, 1), False, 4),
    "swiglu + norm + 4 deltas (model)": (4096, 14336 + 384, 2, MB(16, 128, 128, 4, 3, 1),
                                         True, 4),
    "qkv plain": (4096, 6144, 1, MB(16, 64, 256, 4, 3, 2), False, 0),
    "qkv + norm": (4096, 6144 + 64, 1, MB(16, 64, 256, 4, 3, 2), True, 0),
    "qkv + 4 deltas": (4096, 6144 + 128, 1, MB(16, 64, 256, 4, 3, 2), False, 4),
    "qkv + norm + 4 deltas (model)": (4096, 6144 + 192, 1, MB(16, 64, 256, 4, 3, 2), True, 4),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6, help="weight sets per case (> L2)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if jax.devices()[0].platform != "gpu":
        print("sm_probe: needs an NVIDIA GPU", file=sys.stderr)
        return 1
    key = jax.random.key(0)
    x = jax.random.normal(key, (1, 14336), jnp.float32).astype(jnp.bfloat16)
    # The same (K, N) twice would share a kernel name: N is unique per case.
    calls, nbytes, programs = {}, {}, {}
    cases = {name: (*c, False, 0) for name, c in CASES.items()} | FUSED
    seen = collections.Counter((c[0], c[1]) for c in cases.values())
    assert max(seen.values()) == 1, seen
    for i, (name, (k, n, nw, blocks, norm, n_deltas)) in enumerate(cases.items()):
        ws = [[(jax.random.normal(jax.random.fold_in(key, 100 * i + 10 * j + w), (k, n),
                                  jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
               for w in range(nw)] for j in range(args.layers)]
        epilogue = "swiglu" if nw == 2 else "none"
        nwt = jnp.ones((k,), jnp.bfloat16) if norm else None
        deltas = (jax.random.normal(key, (n_deltas, 1, k), jnp.float32) if n_deltas
                  else None)
        fn = jax.jit(lambda x, ws, blocks=blocks, epilogue=epilogue, nwt=nwt, deltas=deltas: [
            fused_matmul(x, nwt, tuple(w), None, eps=1e-5, blocks=blocks, epilogue=epilogue,
                         interpret=False, partials=epilogue == "none", deltas=deltas)
            for w in ws])
        calls[name] = (fn, x[:, :k], ws)
        nbytes[name] = nw * k * n * 2
        split = max(1, blocks.split_k)
        programs[name] = -(-n // blocks.block_n) * split
    for fn, xk, ws in calls.values():
        jax.block_until_ready(fn(xk, ws))  # compile, warm up
    log_dir = tempfile.mkdtemp(prefix="sm-probe-")
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        for _ in range(5):
            for fn, xk, ws in calls.values():
                jax.block_until_ready(fn(xk, ws))
    durations = collections.defaultdict(list)
    for e in device_kernels(load_trace(log_dir)):
        durations[e["name"]].append(float(e["dur"]))
    rows = []
    for name, (k, n, nw, blocks, _, _) in cases.items():
        # the Pallas kernel of this case: its name holds _k{K}_n{N}
        hits = [d for kn, ds in durations.items() if f"_k{k}_n{n}" in kn for d in ds]
        if not hits:
            print(f"{name}: no kernel in the trace", file=sys.stderr)
            continue
        us = sorted(hits)[len(hits) // 2]
        tbs = nbytes[name] / us / 1e6
        rows.append(dict(case=name, k=k, n=n, programs=programs[name], us=us, tbs=tbs,
                         gbs_per_program=nbytes[name] / programs[name] / us / 1e3))
        print(f"{name:40s} {programs[name]:4d} programs  {us:7.2f} us  {tbs:.2f} TB/s  "
              f"{rows[-1]['gbs_per_program']:.1f} GB/s per program", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
