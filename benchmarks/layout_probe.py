"""Does the decode weight stream go faster with the weights stored [N, K] instead of [K, N]?

    PYTHONPATH=. python3 benchmarks/layout_probe.py [--only o,down] [--json F]

Why: the decode matmuls stream W [K, N] (row-major, as the loader stores it) in [block_k,
block_n] tiles, so every tile row is block_n * 2 bytes (128 B for the 64-wide tiles) and
consecutive rows are N * 2 bytes apart (8-28 KB): the HBM sees short bursts scattered over many
DRAM pages. Stored [N, K] (nn.Linear's own layout), a program owning block_n output columns
reads block_n rows that run contiguously along K: a [block_n, block_k] tile is block_k * 2
bytes per row (512 B at 256 deep) and a program's whole chunk is one contiguous region when it
owns all of K. The lm_head's XLA GEMM, which reaches 4.47 TB/s against our 4.1-4.3, reads long
contiguous runs.

The probe times, per decode shape of Llama-3-8B at batch 1 (q/k/v, o, gate+up, down), a plain
Pallas GEMV (float32 K-chunk partials when split) in both layouts over a few tile shapes, and
XLA's dot on both layouts: kernel time from a profiler trace (median, no host or chain effects)
and the result checked against a float32 reference. Answer on the H200 (session 10,
benchmarks/NOTES.md run K): no layout, tile, program count or cache policy here beats the
model's defaults; at the lm_head's length the GEMV streams 4.5 TB/s in either layout.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from benchmarks.profile_decode import device_kernels, load_trace
from pallas_kernels._common import dot_f32

HBM_TBS = 4.27  # ../shared/docs/GPU.md, measured copy bandwidth of the H200
BM = 16  # rows of the dot (tensor-core minimum); row 0 is the real one at batch 1

# name: (K, N, weights)
SHAPES = {"qkv": (4096, 6144, 1), "o": (4096, 4096, 1), "gateup": (4096, 14336, 2),
          "down": (14336, 4096, 1),
          # the lm_head's shape: long enough that ramp and tail vanish, the steady rate shows
          "lmhead": (4096, 128256, 1)}
# (block_n, block_k, warps, stages, split[, stride[, "ef"]]) per shape and layout; the first
# "kn" row is the model's default (norm_matmul.default_block_sizes). stride < block_n: each
# program owns `stride` columns (its block_n-wide tiles masked past them), so that N / stride
# programs cover the SMs when N / block_n does not (SwiGLU: 14336 / 128 = 112 programs on 132
# SMs); stride None: block_n columns. "ef": the weight loads marked evict_first (kn only).
CONFIGS = {
    "qkv": {"kn": [(64, 256, 4, 3, 2), (64, 128, 4, 4, 2), (32, 256, 4, 3, 1),
                   (128, 256, 4, 3, 2, 96), (128, 128, 4, 4, 2, 96), (64, 256, 4, 3, 1, 48),
                   (64, 512, 4, 3, 1, 48)],
            "nk": [(64, 256, 4, 3, 2), (32, 256, 4, 3, 1), (32, 512, 4, 3, 1), (64, 128, 4, 4, 2),
                   (16, 512, 4, 3, 2), (32, 256, 4, 4, 2), (64, 512, 4, 2, 2)]},
    "o": {"kn": [(64, 256, 4, 3, 2), (32, 256, 4, 3, 1), (32, 128, 4, 4, 1),
                 # unsplit 64-wide: 64 programs, but the whole row in one program (an epilogue
                 # could finish the residual add and the next norm's operand)
                 (64, 256, 4, 3, 1), (64, 128, 4, 4, 1), (64, 512, 4, 2, 1), (64, 256, 8, 3, 1),
                 (64, 128, 4, 6, 1)],
          "nk": [(64, 256, 4, 3, 2), (32, 256, 4, 3, 1), (32, 512, 4, 3, 1), (32, 128, 4, 4, 1),
                 (16, 512, 4, 3, 2), (16, 256, 4, 4, 2), (64, 256, 4, 4, 2)]},
    "gateup": {"kn": [(128, 128, 4, 3, 1), (64, 256, 4, 3, 1), (128, 128, 4, 3, 1, 112),
                      (128, 128, 4, 4, 1, 112), (128, 256, 4, 2, 1, 112),
                      (128, 128, 4, 3, 1, None, "ef")],
               "nk": [(128, 128, 4, 3, 1), (64, 256, 4, 3, 1), (128, 64, 4, 4, 1),
                      (64, 128, 4, 4, 1), (128, 256, 8, 2, 1)]},
    "down": {"kn": [(64, 256, 4, 3, 2), (32, 256, 4, 3, 1), (64, 256, 4, 3, 2, None, "ef")],
             "nk": [(64, 256, 4, 3, 2), (32, 256, 4, 3, 1), (32, 512, 4, 3, 1),
                    (32, 256, 4, 4, 1), (16, 512, 4, 3, 2), (64, 128, 4, 4, 2)]},
    "lmhead": {"kn": [(64, 256, 4, 3, 1), (128, 128, 4, 3, 1), (128, 256, 4, 3, 1),
                      (256, 64, 4, 4, 1), (256, 128, 8, 3, 1), (128, 128, 4, 3, 1, None, "ef"),
                      (64, 256, 4, 3, 1, None, "ef")],
               "nk": [(64, 256, 4, 3, 1), (128, 128, 4, 3, 1)]},
}


def gemv_kernel(x_ref, *refs, layout: str, n_weights: int, block_k: int, k_chunk: int,
                m: int, partial: bool, n: int, bn: int, stride: int | None,
                evict_first: bool = False):
    # x_ref [BM, Kp] (rows >= m masked); w_refs: kn [Kp, block_n] / nk [block_n, Kp];
    # out: partial -> n_weights [BM, block_n] float32 refs (this K chunk), else one
    # [BM, block_n] ref (SiLU(gate) * up when two weights).
    # stride: the refs are whole arrays (w [Kp, N], out [(S,) M, N]) and this program owns
    # columns [j * stride, +stride), read and written as masked block_n-wide tiles.
    w_refs, o_refs = refs[:n_weights], refs[n_weights:]
    row_ok = x_ok = (jnp.arange(BM) < m)[:, None]  # [BM, 1]
    chunk_start = pl.program_id(1) * k_chunk
    if stride is not None:
        col0 = pl.multiple_of(pl.program_id(0) * stride, 16)
        cols = col0 + jnp.arange(bn)
        col_ok = ((jnp.arange(bn) < stride) & (cols < n))[None, :]  # [1, bn]
        row_ok = row_ok & col_ok

    def step(j, accs):
        start = pl.multiple_of(chunk_start + j * block_k, block_k)
        x = plgpu.load(x_ref.at[:, pl.ds(start, block_k)], mask=x_ok, other=0)
        if stride is not None:
            return tuple(acc + dot_f32(x, plgpu.load(w_ref.at[pl.ds(start, block_k),
                                                              pl.ds(col0, bn)],
                                                     mask=col_ok, other=0))
                         for acc, w_ref in zip(accs, w_refs))
        if layout == "kn" and evict_first:  # streamed once: first out of L2
            return tuple(acc + dot_f32(x, plgpu.load(w_ref.at[pl.ds(start, block_k), :],
                                                     eviction_policy="evict_first"))
                         for acc, w_ref in zip(accs, w_refs))
        if layout == "kn":
            return tuple(acc + dot_f32(x, w_ref[pl.ds(start, block_k), :])
                         for acc, w_ref in zip(accs, w_refs))
        return tuple(acc + dot_f32(x, w_ref[:, pl.ds(start, block_k)], trans_b=True)
                     for acc, w_ref in zip(accs, w_refs))

    accs = lax.fori_loop(0, k_chunk // block_k, step,
                         (jnp.zeros((BM, bn), jnp.float32),) * n_weights)

    def store(ref, val):
        if stride is None:
            plgpu.store(ref, val, mask=row_ok)
        elif partial:
            plgpu.store(ref.at[pl.program_id(1), pl.ds(0, BM), pl.ds(col0, bn)], val,
                        mask=row_ok)
        else:
            plgpu.store(ref.at[pl.ds(0, BM), pl.ds(col0, bn)], val, mask=row_ok)

    if partial:
        for ref, acc in zip(o_refs, accs):
            store(ref, acc)
        return
    out = accs[0]
    if n_weights == 2:
        out = accs[0] * jax.nn.sigmoid(accs[0]) * accs[1]
    store(o_refs[0], out.astype(o_refs[0].dtype))


@functools.partial(jax.jit, static_argnames=("layout", "cfg", "name"))
def gemv(x, weights, *, layout: str, cfg: tuple, name: str):
    """x [M, K] (M <= 16) @ each weight (kn: [K, N], nk: [N, K]) -> [M, N] (two weights:
    SiLU(x @ w0) * (x @ w1)); split chunks summed by XLA."""
    bn, bk, warps, stages, split, *extra = cfg
    stride = extra[0] if extra else None
    evict_first = len(extra) > 1 and extra[1] == "ef"
    m, k = x.shape
    n = weights[0].shape[1 if layout == "kn" else 0]
    assert k % (split * bk) == 0 and (stride or n % bn == 0), (k, n, cfg)
    assert stride is None or layout == "kn"
    k_chunk = k // split
    partial = split > 1
    w_spec = (pl.BlockSpec((k, bn), lambda j, s: (0, j)) if layout == "kn"
              else pl.BlockSpec((bn, k), lambda j, s: (j, 0)))
    if stride:
        w_spec = pl.BlockSpec((k, n), lambda j, s: (0, 0))
    if partial:
        out_specs = [pl.BlockSpec((None, BM, bn), lambda j, s: (s, 0, j))] * len(weights)
        if stride:
            out_specs = [pl.BlockSpec((split, BM, n), lambda j, s: (0, 0, 0))] * len(weights)
        out_shape = [jax.ShapeDtypeStruct((split, m, n), jnp.float32)] * len(weights)
    else:
        out_specs = [pl.BlockSpec((BM, bn), lambda j, s: (0, j)) if not stride
                     else pl.BlockSpec((BM, n), lambda j, s: (0, 0))]
        out_shape = [jax.ShapeDtypeStruct((m, n), x.dtype)]
    out = pl.pallas_call(
        functools.partial(gemv_kernel, layout=layout, n_weights=len(weights), block_k=bk,
                          k_chunk=k_chunk, m=m, partial=partial, n=n, bn=bn, stride=stride,
                          evict_first=evict_first),
        grid=(-(-n // (stride or bn)), split),
        in_specs=[pl.BlockSpec((BM, k), lambda j, s: (0, 0))] + [w_spec] * len(weights),
        out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=jax.devices()[0].platform != "gpu", name=name,
    )(x, *weights)
    if not partial:
        return out[0]
    sums = [o.sum(axis=0) for o in out]
    res = sums[0] if len(sums) == 1 else jax.nn.silu(sums[0]) * sums[1]
    return res.astype(x.dtype)


def xla_gemv(x, weights, *, layout: str):
    outs = [x @ (w if layout == "kn" else w.T) for w in weights]
    return outs[0] if len(outs) == 1 else jax.nn.silu(outs[0]) * outs[1]


def reference(x, weights_kn):
    outs = [jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                    precision=lax.Precision.HIGHEST) for w in weights_kn]
    return outs[0] if len(outs) == 1 else jax.nn.silu(outs[0]) * outs[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(SHAPES), help="shapes: " + ",".join(SHAPES))
    p.add_argument("--layers", type=int, default=6, help="weight sets per variant (> L2)")
    p.add_argument("--scale", type=int, default=1, help="divide K and N (CPU smoke runs)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    on_gpu = jax.devices()[0].platform == "gpu"
    key = jax.random.key(0)
    calls = {}  # variant -> (jitted fn over all layers, weights, kernel-name tag or None)
    checks = {}
    for si, shape in enumerate(args.only.split(",")):
        k, n, nw = SHAPES[shape]
        k, n = k // args.scale, n // args.scale
        x = jax.random.normal(jax.random.fold_in(key, si), (1, k), jnp.float32).astype(
            jnp.bfloat16)
        kn = [[(jax.random.normal(jax.random.fold_in(key, 1000 * si + 10 * l + w), (k, n),
                                  jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
               for w in range(nw)] for l in range(args.layers)]
        nk = [[w.T.copy() for w in ws] for ws in kn]  # the same values stored [N, K]
        want = reference(x, kn[0])
        for layout, wsets in (("kn", kn), ("nk", nk)):
            for ci, cfg in enumerate(CONFIGS[shape][layout]):
                bn, bk, warps, stages, split, *extra = cfg
                stride = extra[:1] if extra and extra[0] else []
                while (k // split) % bk:  # --scale: a tile depth that divides the chunk
                    bk //= 2
                if stride and args.scale > 1:
                    stride = [max(16, stride[0] // args.scale // 16 * 16)]
                cfg = (bn, bk, warps, stages, split, *(stride or [None]), *extra[1:])
                tag = f"lp_{shape}_{layout}_{ci}"
                label = (f"{shape} {layout} pallas {bn}x{bk} w{warps} s{stages} split{split}"
                         + (f" stride{stride[0]}" if stride else "")
                         + (" evict_first" if "ef" in extra else ""))
                fn = jax.jit(lambda x, wsets, layout=layout, cfg=cfg, tag=tag: [
                    gemv(x, tuple(ws), layout=layout, cfg=cfg, name=tag) for ws in wsets])
                calls[label] = (fn, x, wsets, tag, nw * k * n * 2,
                                -(-n // (stride[0] if stride else bn)) * split)
                checks[label] = want
            label = f"{shape} {layout} xla"
            fn = jax.jit(lambda x, wsets, layout=layout: [
                xla_gemv(x, tuple(ws), layout=layout) for ws in wsets])
            calls[label] = (fn, x, wsets, None, nw * k * n * 2, 0)
            checks[label] = want
    rows, failures = [], 0
    ok_calls = {}
    for label, (fn, x, wsets, tag, nbytes, programs) in calls.items():
        try:
            got = jax.block_until_ready(fn(x, wsets))[0].astype(jnp.float32)
        except Exception as e:  # one failing variant does not hide the others
            print(f"{label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            failures += 1
            continue
        want = checks[label]
        err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        if not err < 2e-2:
            print(f"{label}: WRONG, rel err {err:.2e}", flush=True)
            failures += 1
            continue
        ok_calls[label] = (fn, x, wsets, tag, nbytes, programs, err)
    if not on_gpu:
        print(f"checked {len(ok_calls)} variants in interpret mode (no GPU: no timing)")
        return 0 if failures == 0 else 2
    # Kernel time: Pallas variants by their kernel names in one trace; XLA variants each in
    # a trace of their own (their kernels carry XLA's names).
    durations = collections.defaultdict(list)

    def trace(fns):
        log_dir = tempfile.mkdtemp(prefix="layout-probe-")
        with jax.profiler.trace(log_dir):
            for _ in range(5):
                for fn, x, wsets in fns:
                    jax.block_until_ready(fn(x, wsets))
        return device_kernels(load_trace(log_dir))

    pallas = {l: c for l, c in ok_calls.items() if c[3] is not None}
    for e in trace([c[:3] for c in pallas.values()]):
        durations[e["name"]].append(float(e["dur"]))
    for label, (fn, x, wsets, tag, nbytes, programs, err) in ok_calls.items():
        if tag is None:
            # every kernel of the variant's trace, per call, per layer
            us = sum(float(e["dur"]) for e in trace([(fn, x, wsets)])) / 5 / args.layers
        else:
            # the Pallas kernel alone: a split's XLA sum of the chunks is not counted (the
            # model's consumers add the chunks in their own loops)
            hits = [d for name, ds in durations.items()
                    if re.search(re.escape(tag) + r"(\D|$)", name) for d in ds]
            if not hits:
                print(f"{label}: no kernel in the trace", flush=True)
                continue
            us = sorted(hits)[len(hits) // 2]
        tbs = nbytes / us / 1e6
        floor = nbytes / HBM_TBS / 1e6
        rows.append(dict(variant=label, us=us, tbs=tbs, over_floor_us=us - floor,
                         programs=programs, rel_err=err))
        print(f"{label:46s} {us:7.2f} us  {tbs:.2f} TB/s  +{us - floor:5.2f} us over "
              f"bytes/{HBM_TBS}  {programs:4d} programs  err {err:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if failures == 0 else 2


if __name__ == "__main__":
    sys.exit(main())
