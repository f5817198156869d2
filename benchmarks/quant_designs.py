"""int4 g128 decode matmul designs side by side (issue 37): correctness first, then speed.

    PYTHONPATH=. python3 benchmarks/quant_designs.py --json out.json [--quick]
    PYTHONPATH=. python3 benchmarks/quant_designs.py --cpu-check   # tiny shapes, interpret mode

For each shape K x N (4096 x 14336, 8192 x 28672; --quick: the first only) and rows M (1, 16)
with bf16 x and a random weight quantized by `quantize_weight(bits=4, group_size=128)`, each
variant's output is first checked against the float reference x @ dequantize(qw) in float32.
A variant whose relative error is above TOL prints FAIL, is not timed, and makes the script
exit 1. Then the variants are timed with benchmarks/kernels.py's `time_fn`, in the same
process, inputs rotated past the 60 MB L2. Each gets one JSON line: ms, TB/s of the bytes it
reads, the fraction of 4.27 TB/s, and the speed-up over our bf16 kernel and over tinygemm.

Variants:
  current            pk.quantized_matmul (norm_matmul's fused kernel) as it is
  bf16, xla_bf16     our bf16 kernel (norm_matmul) and XLA's dot, on dequantize(qw) in bf16
  xla_int4_deq       jnp.int4 codes [G, 128, N] and bf16 scales [G, N] as the jitted function's
                     inputs, dequantized in jnp (convert, scale, reshape) then jnp.dot: XLA:GPU
                     may fuse the int4 -> bf16 convert and the scale into its GEMM fusion
  xla_int4_einsum    the same codes, a batched dot over groups einsum('mgk,gkn->mgn') in float32,
                     then the scales and a sum over g
  xla_int4_nk        codes [N, K] and scales [N, G] (the torch Linear orientation, K contiguous),
                     dequantized, then a dot contracting K
  nk_deq_dot         the nk weight dequantized by XLA, then XLA's dot (what prefill rows take)
  mgpu_<config>      pallas_kernels/quantized_mgpu.py (Mosaic GPU: TMA tiles of codes [N, K] int4,
                     swapped-operand wgmma with the codes from registers, scales after each
                     group's product), with the model's fp16 scales: one variant per entry of
                     MGPU_CONFIGS that fits the shape, the default config (and with bf16 scales)
  mgpu_pair_<cfg>,   two weights of the shape (gate and up) in one launch, and in two
  mgpu_two_calls
  torch_tinygemm     torch.ops.aten._weight_int4pack_mm on _convert_weight_to_int4pack(inner k
                     tiles 8); the same codes and scales (zeros 0); skipped with a note without
                     torch or CUDA. Timed in a CUDA graph of calls, each call's x first passed
                     through one elementwise add of 0 * the previous output, as time_fn's chained
                     program does (torch_tinygemm_nolink: without that add)

A new design joins as one more entry of `jax_variants`. (A paired-nibble Pallas kernel, one
byte-tile load feeding both K tiles, was measured here and removed: benchmarks/DECISIONS.md.)
Past --budget seconds (default 420) the remaining timings are skipped with a note; --json is
rewritten after each (shape, M).

Bytes read: the weight's arrays plus x (int4: K N / 2 codes + G N 2-byte scales; tinygemm: its
packed codes + scales and zeros; bf16: K N 2). --cpu-check runs every JAX variant at tiny shapes
in interpret mode (checks, then a one-iteration timing of the whole path; CPU times mean
nothing).
"""

from __future__ import annotations

import os

# JAX takes 60% of the GPU memory here (its default is 75%): the rest is for torch (tinygemm).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from benchmarks.kernels import PEAK_TBS, rel_err, time_fn  # noqa: E402
from benchmarks.ncu_quant import parse_configs  # noqa: E402
from pallas_kernels.quantized import codes_of, dequantize, quantize_weight  # noqa: E402
from pallas_kernels.quantized_mgpu import (MgpuMatmulConfig, default_config,  # noqa: E402
                                           int_matmul_mgpu, to_frag, to_nk)

TOL = 2e-2  # relative error (Frobenius) against x @ dequantize(qw) in float32
GROUP = 128
RESULTS: list[dict] = []
FAILED: list[str] = []
NOTES: list[str] = []
T0 = time.perf_counter()


def record(**row) -> None:
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


# ---------------------------------------------------------------------------------------------
# The JAX variants: (name, fn(x, *args), args_of(set) -> tuple, bytes(m, k, n))
# ---------------------------------------------------------------------------------------------


def int4_bytes(m: int, k: int, n: int) -> int:
    return k * n // 2 + (k // GROUP) * n * 2 + m * k * 2


def bf16_bytes(m: int, k: int, n: int) -> int:
    return k * n * 2 + m * k * 2


def xla_int4_deq(x, c4, s):
    # c4 [G, 128, N] int4, s [G, N] bf16 -> w [K, N] bf16 inside the jit, then x @ w.
    g, gs, n = c4.shape
    w = (c4.astype(jnp.bfloat16) * s[:, None, :]).reshape(g * gs, n)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def xla_int4_einsum(x, c4, s):
    # x [M, G, 128] @ codes [G, 128, N] per group (exact codes, float32 sums), then * s, sum g.
    g, gs, n = c4.shape
    # XLA:CPU has no batched bf16 x bf16 -> f32 dot: there (--cpu-check only) the same exact
    # values go in as float32.
    dt = jnp.float32 if jax.default_backend() == "cpu" else x.dtype
    y = jnp.einsum("mgk,gkn->mgn", x.reshape(x.shape[0], g, gs).astype(dt), c4.astype(dt),
                   preferred_element_type=jnp.float32)  # [M, G, N]
    return jnp.sum(y * s.astype(jnp.float32)[None], axis=1).astype(x.dtype)


def xla_int4_nk(x, c4t, st):
    # c4t [N, K] int4, st [N, G] bf16 -> w [N, K] bf16, then x @ w^T.
    n, k = c4t.shape
    g = st.shape[1]
    w = (c4t.reshape(n, g, k // g).astype(jnp.bfloat16) * st[:, :, None]).reshape(n, k)
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(x.dtype)


# Runs 1-3 (2026-12-03: DECISIONS) compared schedules (warp-specialized, scales before the
# product, a wait per group, 128-row blocks: all removed) at gps 1-4, stages 3-8, splits 1-4.
# These are the default's neighbours.
MGPU_CONFIGS = [MgpuMatmulConfig(gps=g, stages=st, splits=sp)
                for g, st, sp in ((2, 4, 4), (2, 4, 2), (2, 6, 4), (4, 4, 2), (1, 8, 4), (2, 4, 1),
                                   (4, 4, 1))]


def mgpu_call(cfg: MgpuMatmulConfig, interpret: bool):
    return jax.jit(lambda x, c, sc: int_matmul_mgpu(x, (c,), (sc,), cfg=cfg,
                                                    interpret=interpret)[0])


def mgpu_fits(cfg: MgpuMatmulConfig, k: int, n: int) -> bool:
    return n % 64 == 0 and k % GROUP == 0 and (k // GROUP) % (cfg.splits * cfg.gps) == 0


def jax_variants(m: int, k: int, n: int, interpret: bool) -> list[tuple]:
    """(name, jitted fn, args_of(set dict) -> tuple, bytes)."""
    ib, bb = int4_bytes(m, k, n), bf16_bytes(m, k, n)
    out = [
        ("bf16", jax.jit(lambda x, w: pk.norm_matmul(x, None, w, interpret=interpret)),
         lambda s: (s["x"], s["w"]), bb),
        ("xla_bf16", jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32
                                                  ).astype(x.dtype)),
         lambda s: (s["x"], s["w"]), bb),
        ("current", jax.jit(lambda x, q: pk.quantized_matmul(x, q, interpret=interpret)),
         lambda s: (s["x"], s["q"]), ib),
        ("xla_int4_deq", jax.jit(xla_int4_deq), lambda s: (s["x"], s["c4"], s["s"]), ib),
        ("xla_int4_einsum", jax.jit(xla_int4_einsum), lambda s: (s["x"], s["c4"], s["s"]), ib),
        ("xla_int4_nk", jax.jit(xla_int4_nk), lambda s: (s["x"], s["c4t"], s["st"]), ib),
    ]
    # The model's dequantize on the nk layout, then XLA's dot (what prefill rows take).
    out.append(("nk_deq_dot", jax.jit(lambda x, q: jnp.dot(
        x, dequantize(q, x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)),
        lambda s: (s["x"], s["q_nk"]), ib))
    if m > 64:
        return out
    # quantize_weight's fp16 scales, as the model's weights carry them; one row with bf16
    # scales beside them.
    for cfg in MGPU_CONFIGS:
        if mgpu_fits(cfg, k, n):
            out.append((f"mgpu_{cfg}", mgpu_call(cfg, interpret),
                        lambda s, c="c4f" if cfg.frag else "c4t": (s["x"], s[c], s["q"].scale),
                        ib))
    cfg = default_config(m, k, n)
    if mgpu_fits(cfg, k, n):
        out.append((f"mgpu_default_{cfg}", mgpu_call(cfg, interpret),
                    lambda s: (s["x"], s["c4t"], s["q"].scale), ib))
        out.append((f"mgpu_default_{cfg}_bf16scale", mgpu_call(cfg, interpret),
                    lambda s: (s["x"], s["c4t"], s["s"]), ib))
        # the same with the codes in fragment order (converted in place, no relayout)
        frag = dataclasses.replace(cfg, frag=True)
        out.append((f"mgpu_frag_{frag}", mgpu_call(frag, interpret),
                    lambda s: (s["x"], s["c4f"], s["q"].scale), ib))
        # gate and up: two weights of this shape (the second one this weight's columns in
        # reverse: other bytes) in one launch, against two launches; the outputs averaged
        # back into one (checked against the one reference)
        pair = default_config(m, k, 2 * n)

        def mean(a, b):
            return ((a.astype(jnp.float32) + b[:, ::-1]) * 0.5).astype(a.dtype)
        out.append((f"mgpu_pair_{pair}", jax.jit(lambda x, c, sc, cr, scr: mean(
            *int_matmul_mgpu(x, (c, cr), (sc, scr), cfg=pair, interpret=interpret))),
            lambda s: (s["x"], s["c4t"], s["q"].scale, s["c4t_r"], s["scale_r"]),
            2 * ib - m * k * 2))
        out.append(("mgpu_two_calls", jax.jit(lambda x, c, sc, cr, scr: mean(*[
            int_matmul_mgpu(x, (c_,), (sc_,), cfg=cfg, interpret=interpret)[0]
            for c_, sc_ in ((c, sc), (cr, scr))])),
            lambda s: (s["x"], s["c4t"], s["q"].scale, s["c4t_r"], s["scale_r"]),
            2 * ib - m * k * 2))
    return out


def make_sets(k: int, n: int, sets: int) -> list[dict]:
    """Per set: the int4 weight (q) and the other variants' views of the same values."""
    out = []
    for i in range(sets):
        w = jax.random.normal(jax.random.key(i), (k, n), jnp.float32).astype(jnp.bfloat16) * 0.02
        q = quantize_weight(w, bits=4, group_size=GROUP)
        del w
        c = codes_of(q)  # [K, N] int32 in [-8, 7]
        s = q.scale.astype(jnp.bfloat16)  # [G, N]
        out.append(dict(
            q=q, w=dequantize(q, jnp.bfloat16),
            c4=c.reshape(k // GROUP, GROUP, n).astype(jnp.int4), s=s,
            c4t=c.T.astype(jnp.int4), c4t_r=c.T[::-1].astype(jnp.int4),
            c4f=to_frag(c.T.astype(jnp.int4)) if k % 32 == 0 else None,
            scale_r=q.scale[:, ::-1], st=s.T, q_nk=to_nk(q) if k % GROUP == 0 and n % 64 == 0
            else q,
            u8=(c + q.code_offset).astype(jnp.uint8)))  # codes 0..15 [K, N], for torch
        del c
        jax.block_until_ready(out[-1])
    return out


# ---------------------------------------------------------------------------------------------
# torch tinygemm
# ---------------------------------------------------------------------------------------------


def torch_setup(note: list):
    """torch with CUDA, or None (the reason appended to note)."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 -- any import failure means: no torch peer
        note.append(f"torch_tinygemm skipped: torch not importable ({type(exc).__name__}: "
                    f"{exc})")
        return None
    if not torch.cuda.is_available():
        note.append(f"torch_tinygemm skipped: torch {torch.__version__} sees no CUDA device")
        return None
    return torch


def tinygemm_pack(torch, st: dict, inner_k_tiles: int = 8):
    """One set's codes and scales as tinygemm takes them: (packed weight, scales_and_zeros
    [G, N, 2] bf16). Tinygemm's value is (q - 8) * scale + zero with q in 0..15, i.e. ours with
    q = our stored code (offset 8), scale = s, zero = 0. Weight [N, K] (Linear's), packed two
    codes a byte (even k in the high nibble), then _convert_weight_to_int4pack."""
    q = torch.from_numpy(np.array(st["u8"])).cuda()  # [K, N] uint8, 0..15
    qt = q.t().contiguous()  # [N, K]
    s = torch.from_numpy(np.array(st["q"].scale.astype(jnp.float32))).cuda()  # [G, N]
    sz = torch.stack([s, torch.zeros_like(s)], dim=2).to(torch.bfloat16).contiguous()
    try:  # torch >= 2.5: uint8 [N, K / 2]
        packed = ((qt[:, ::2] << 4) | qt[:, 1::2]).to(torch.uint8).contiguous()
        w = torch.ops.aten._convert_weight_to_int4pack(packed, inner_k_tiles)
    except Exception as exc:  # noqa: BLE001 -- older torch took int32 [N, K]
        print(f"note: _convert_weight_to_int4pack(uint8 [N, K/2]) failed ({type(exc).__name__}: "
              f"{str(exc)[:300]}); trying int32 [N, K]", flush=True)
        w = torch.ops.aten._convert_weight_to_int4pack(qt.to(torch.int32).contiguous(),
                                                       inner_k_tiles)
    return w, sz


def time_torch(torch, call, arg_sets, *, iters: int, link: bool, repeats: int = 5):
    """Median seconds per call of call(x, w, sz) over arg_sets, replayed as one CUDA graph of
    max(iters, sets) calls (a Python loop if capture fails). link: each call's x is x + 0 * the
    previous output's first element (one elementwise kernel, as time_fn's chained program)."""
    n_calls = max(iters, len(arg_sets))

    def body():
        prev = None
        for i in range(n_calls):
            x, w, sz = arg_sets[i % len(arg_sets)]
            if link and prev is not None:
                x = torch.add(x, prev[0:1, 0:1], alpha=0)
            prev = call(x, w, sz)
        return prev

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # warm-up on a side stream, as graph capture wants
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    how = "cuda graph"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        run = graph.replay
    except Exception as exc:  # noqa: BLE001 -- fall back to launching from Python
        print(f"note: CUDA graph capture failed ({type(exc).__name__}: {str(exc)[:300]}); "
              f"timing a Python loop", flush=True)
        torch.cuda.synchronize()
        run, how = body, "python loop"
    runs = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) * 1e-3 / n_calls)
    return statistics.median(runs), how


def bench_torch(torch, sets: list[dict], xs: list, ref, m: int, k: int, n: int,
                iters: int) -> dict:
    """Check, then time tinygemm at one (shape, M). {name: seconds} of what ran."""
    out = {}
    try:
        packed = [tinygemm_pack(torch, st) for st in sets]
        txs = [torch.from_numpy(np.array(x.astype(jnp.float32))).cuda().to(torch.bfloat16)
               for x in xs]
        mm = torch.ops.aten._weight_int4pack_mm  # (x [M, K], packed w, group, sz [G, N, 2])

        def call(x, w, sz):
            return mm(x, w, GROUP, sz)
        arg_sets = [(tx, w, sz) for tx, (w, sz) in zip(txs, packed)]
        y = call(*arg_sets[0])
        err = rel_err(jnp.asarray(y.float().cpu().numpy()), ref)
        nbytes = k * n // 2 + (k // GROUP) * n * 4 + m * k * 2
        print(f"check torch_tinygemm {k}x{n} M={m}: rel err {err:.2e}", flush=True)
        if not err <= TOL:
            FAILED.append(f"torch_tinygemm {k}x{n} M={m}")
            print(f"FAIL torch_tinygemm {k}x{n} M={m}: rel err {err} > {TOL}", flush=True)
            return out
        for name, link in (("torch_tinygemm", True), ("torch_tinygemm_nolink", False)):
            t, how = time_torch(torch, call, arg_sets, iters=iters, link=link)
            out[name] = (t, err, nbytes, how)
    except Exception as exc:  # noqa: BLE001 -- the peer failing must not end the run
        print(f"torch_tinygemm {k}x{n} M={m} failed: {type(exc).__name__}: {str(exc)[:1500]}",
              flush=True)
        traceback.print_exc(limit=4)
    return out


# ---------------------------------------------------------------------------------------------
# One shape
# ---------------------------------------------------------------------------------------------


def over_budget(budget: float | None) -> bool:
    return budget is not None and time.perf_counter() - T0 > budget


def run_shape(k: int, n: int, ms: tuple, *, iters: int, sets_n: int, interpret: bool,
              torch, repeats: int, only: str | None, budget: float | None = None,
              json_path: str | None = None) -> None:
    """Check and time every variant at K x N for each M."""
    t0 = time.perf_counter()
    sets = make_sets(k, n, sets_n)
    print(f"# {k}x{n}: {sets_n} weight sets ready in {time.perf_counter() - t0:.1f} s",
          flush=True)
    for m in ms:
        xs = [jax.random.normal(jax.random.key(1000 + 7 * m + i), (m, k), jnp.float32
                                ).astype(jnp.bfloat16) for i in range(sets_n)]
        for st, x in zip(sets, xs):
            st["x"] = x
        ref = jnp.dot(xs[0].astype(jnp.float32), dequantize(sets[0]["q"], jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)  # [M, N]
        variants = jax_variants(m, k, n, interpret)
        if only:
            keep = only.split(",")
            variants = [v for v in variants
                        if v[0] in ("bf16",) or any(v[0].startswith(p) for p in keep)]
        timed = {}
        # Check every variant first (a wrong one is not timed).
        checked = []
        for name, fn, args_of, nbytes in variants:
            try:
                err = rel_err(fn(*args_of(sets[0])), ref)
            except Exception as exc:  # noqa: BLE001 -- a failing variant is reported, not fatal
                print(f"FAILED {name} {k}x{n} M={m}: {type(exc).__name__}: {str(exc)[:1500]}",
                      flush=True)
                traceback.print_exc(limit=3)
                FAILED.append(f"{name} {k}x{n} M={m} (exception)")
                record(k=k, n=n, m=m, variant=name, failed=f"{type(exc).__name__}: "
                                                          f"{str(exc)[:300]}")
                continue
            print(f"check {name:28s} {k}x{n} M={m}: rel err {err:.2e}", flush=True)
            if not err <= TOL:
                print(f"FAIL {name} {k}x{n} M={m}: rel err {err} > {TOL}", flush=True)
                FAILED.append(f"{name} {k}x{n} M={m} (err {err:.3g})")
                record(k=k, n=n, m=m, variant=name, err=err, failed="rel err above TOL")
                continue
            checked.append((name, fn, args_of, nbytes, err))
        if torch is not None:
            for name, (t, err, nbytes, how) in bench_torch(torch, sets, xs, ref, m, k, n,
                                                           iters).items():
                timed[name] = (t, err, nbytes, how)
        # Time: bf16 first (every ratio's base), then the rest.
        for name, fn, args_of, nbytes, err in checked:
            if over_budget(budget):
                print(f"# {name} {k}x{n} M={m} not timed: past the --budget of {budget} s",
                      flush=True)
                NOTES.append(f"{name} {k}x{n} M={m} not timed (budget)")
                continue
            try:
                t = time_fn(fn, [args_of(st) for st in sets], iters=iters, repeats=repeats)
            except Exception as exc:  # noqa: BLE001
                print(f"FAILED timing {name} {k}x{n} M={m}: {type(exc).__name__}: "
                      f"{str(exc)[:1500]}", flush=True)
                FAILED.append(f"{name} {k}x{n} M={m} (timing exception)")
                continue
            timed[name] = (t, err, nbytes, "time_fn")
        t_bf16 = timed.get("bf16", (None,))[0]
        t_tiny = timed.get("torch_tinygemm", (None,))[0]
        for name, (t, err, nbytes, how) in timed.items():
            tbs = nbytes / t / 1e12
            record(k=k, n=n, m=m, variant=name, ms=t * 1e3, tbs=tbs, floor=tbs / PEAK_TBS,
                   vs_bf16=None if t_bf16 is None else t_bf16 / t,
                   vs_tinygemm=None if t_tiny is None else t_tiny / t,
                   err=err, bytes=nbytes, timing=how)
        print(f"# {k}x{n} M={m} done at {time.perf_counter() - t0:.1f} s", flush=True)
        write_json(json_path)
    del sets


def write_json(path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(dict(rows=RESULTS, failed=FAILED, notes=NOTES), f, indent=1)


def summary() -> None:
    rows = [r for r in RESULTS if "ms" in r]
    print("\n    K      N   M  variant                        ms      TB/s  floor  x bf16  x tiny")
    for r in rows:
        vb = "" if r["vs_bf16"] is None else f"{r['vs_bf16']:6.2f}"
        vt = "" if r["vs_tinygemm"] is None else f"{r['vs_tinygemm']:6.2f}"
        print(f"{r['k']:5d} {r['n']:6d} {r['m']:3d}  {r['variant']:28s} {r['ms']:8.4f} "
              f"{r['tbs']:7.3f} {r['floor']:6.3f}  {vb:>6s}  {vt:>6s}")
    print("\nbest int4 per shape (goal M=1: >= 3x bf16 and >= 1.7x tinygemm; M=16: >= 2x bf16)")
    for key in sorted({(r["k"], r["n"], r["m"]) for r in rows}):
        int4 = [r for r in rows if (r["k"], r["n"], r["m"]) == key
                and r["variant"] not in ("bf16", "xla_bf16") and "torch" not in r["variant"]]
        if not int4:
            continue
        best = min(int4, key=lambda r: r["ms"])
        vb = "n/a" if best["vs_bf16"] is None else f"{best['vs_bf16']:.2f}x bf16"
        vt = "n/a" if best["vs_tinygemm"] is None else f"{best['vs_tinygemm']:.2f}x tinygemm"
        print(f"  {key[0]}x{key[1]} M={key[2]}: {best['variant']} {best['ms']:.4f} ms, "
              f"{best['tbs']:.2f} TB/s, {vb}, {vt}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write every row here (after each shape and M)")
    ap.add_argument("--quick", action="store_true", help="4096 x 14336 only, fewer iterations")
    ap.add_argument("--cpu-check", action="store_true",
                    help="tiny shapes (K 256 / 384, N 384 / 200, M 1 and 3) in interpret mode")
    ap.add_argument("--only", default=None,
                    help="comma-separated name prefixes (e.g. current,xla_int4); bf16 is "
                         "always kept")
    ap.add_argument("--budget", type=float, default=420.0,
                    help="seconds after which the remaining timings are skipped (noted)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--shapes", default=None, metavar="KxN,...",
                    help="these shapes instead (e.g. 4096x6144,14336x4096)")
    ap.add_argument("--ms", default="1,16", help="rows M to run, comma-separated")
    ap.add_argument("--configs", default=None, metavar="G-S-K[-B],...",
                    help="the Mosaic configurations to time instead of MGPU_CONFIGS, as gps-"
                         "stages-splits[-batch] (e.g. 2-4-4,2-6-8,2-2-4-1)")
    args = ap.parse_args()
    if args.configs:
        try:
            MGPU_CONFIGS[:] = parse_configs(args.configs)
        except ValueError:
            ap.error(f"--configs {args.configs!r}: comma-separated gps-stages-splits[-batch][f] "
                     f"integers, e.g. 2-4-4,2-6-8,2-2-4-1")
    print(f"# jax {jax.__version__}, devices {jax.devices()}", flush=True)
    if args.cpu_check:
        for k, n in ((384, 200), (256, 384)):  # 3 and 2 groups of 128; N 200 not a tile multiple
            run_shape(k, n, (1, 3), iters=1, sets_n=2, interpret=True, torch=None, repeats=1,
                      only=args.only, json_path=args.json)
        NOTES.append("torch_tinygemm skipped: --cpu-check")
    else:
        torch = None if args.no_torch else torch_setup(NOTES)
        if torch is not None:
            print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
        for note in NOTES:
            print(f"# {note}", flush=True)
        shapes = [(4096, 14336)] if args.quick else [(4096, 14336), (8192, 28672)]
        if args.shapes:
            shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")]
        for k, n in shapes:
            # enough sets that one round's int4 bytes pass the 60 MB L2 twice over
            sets_n = max(2, -(-120 * 2 ** 20 // int4_bytes(1, k, n)))
            run_shape(k, n, tuple(int(m) for m in args.ms.split(",")),
                      iters=20 if args.quick else 50, sets_n=sets_n, interpret=False, torch=torch,
                      repeats=3 if args.quick else 5, only=args.only, budget=args.budget,
                      json_path=args.json)
    summary()
    for note in NOTES:
        print(f"note: {note}")
    print(f"\n{len(FAILED)} failed: {FAILED}" if FAILED else "\nall checks passed")
    print(f"wall {time.perf_counter() - T0:.1f} s")
    write_json(args.json)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
