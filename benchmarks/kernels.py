"""Pallas kernels vs their peers on one GPU, in one run: correctness first, then speed.

    PYTHONPATH=. python3 benchmarks/kernels.py --json out.json [--only flash,decode,small] [--quick]

For each op and shape: the relative error of our kernel against the pure-jnp reference on the
GPU, then the median time of ours and of each peer (cuDNN through
`jax.nn.dot_product_attention(implementation="cudnn")`, the XLA reference), reported as TFLOP/s
or TB/s, the fraction of the measured ceiling (808 TFLOP/s bf16 matmul, 4.27 TB/s copy,
both measured on the H200) and the ratio ours / peer. Block-size variants of our kernels are timed
side by side, so one call sweeps them. A short table comes last; full numbers go to --json.

Timing: compile and warm up outside the timed region, then `repeats` runs of `iters` calls each
(inputs rotated among several random sets when one set fits in the 60 MB L2), blocking once at
the end of each run; the median run gives the time per call.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk

PEAK_TFLOPS = 808.0  # bf16 matmul 8192^3 through XLA on the H200
PEAK_TBS = 4.27  # device-to-device copy on the H200, read + write
L2_BYTES = 60 * 2 ** 20

RESULTS: list[dict] = []


def rel_err(out, ref) -> float:
    out = jnp.asarray(out, jnp.float32)
    ref = jnp.asarray(ref, jnp.float32)
    if not bool(jnp.all(jnp.isfinite(out))):
        return float("nan")
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def time_fn(fn, arg_sets, *, iters: int, repeats: int = 5) -> float:
    """Median seconds per call of fn(*args), rotating over arg_sets.

    Calls taking less than ~2 ms (host-timed, a sync each) whose first argument is small are
    timed inside one jitted program of `unroll` chained calls (see _chained): from a Python
    loop, such calls measure the host's dispatch (B1 decode and M64 RMSNorm took ~40 us for XLA
    and ours alike on the H200, 2026-12 run 1), not the GPU. (A 0.2 ms threshold sat at the
    synced call's own round trip: kernels flipped between the two timings run to run.)
    """
    jax.block_until_ready(fn(*arg_sets[0]))  # compile + warm up
    t0 = time.perf_counter()
    for args in arg_sets:
        jax.block_until_ready(fn(*args))
    per_call = (time.perf_counter() - t0) / len(arg_sets)
    unroll = 1
    first = arg_sets[0][0]
    if per_call < 2e-3 and first.size * first.dtype.itemsize <= 4 * 2 ** 20:
        unroll = len(arg_sets) * max(1, 32 // len(arg_sets))
        fn = _chained(fn, arg_sets, unroll)
        arg_sets = [tuple(a for args in arg_sets for a in args)]
        jax.block_until_ready(fn(*arg_sets[0]))
        iters = max(3, iters // unroll)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for i in range(iters):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) / (iters * unroll))
    return statistics.median(runs)


def _chained(fn, arg_sets, unroll: int):
    """One jitted program calling fn `unroll` times over the rotating arg sets.

    Each call's first argument gets `+ 0 * (a scalar of the previous output)`: a data dependence
    that keeps XLA from merging identical calls (it does not fold x * 0 for floats) at the cost
    of one elementwise pass over that argument, so put a small array first (q, x).
    """
    n = len(arg_sets)
    arity = len(arg_sets[0])

    def many(*flat):
        sets = [flat[i * arity:(i + 1) * arity] for i in range(n)]
        link = jnp.float32(0)
        for i in range(unroll):
            first, *rest = sets[i % n]
            first = first + (0 * link).astype(first.dtype)
            out = fn(first, *rest)
            link = jax.tree.leaves(out)[0].ravel()[0].astype(jnp.float32)
        return link

    return jax.jit(many)


def iters_for(seconds_per_call_guess: float) -> int:
    return int(min(200, max(10, 0.25 / max(seconds_per_call_guess, 1e-6))))


def record(op: str, shape: str, impl: str, seconds: float, *, flops=None, nbytes=None,
           err=None, **extra):
    row = dict(op=op, shape=shape, impl=impl, ms=seconds * 1e3, err=err, **extra)
    if flops is not None:
        row["tflops"] = flops / seconds / 1e12
        row["frac_ceiling"] = row["tflops"] / PEAK_TFLOPS
    if nbytes is not None:
        row["tbs"] = nbytes / seconds / 1e12
        row["frac_ceiling"] = row["tbs"] / PEAK_TBS
    RESULTS.append(row)
    rate = (f"{row['tflops']:7.1f} TFLOP/s" if flops is not None else f"{row['tbs']:6.3f} TB/s")
    e = "" if err is None else f"  err {err:.2e}"
    print(f"{op:7s} {shape:34s} {impl:34s} {seconds * 1e3:9.3f} ms  {rate}  "
          f"{row['frac_ceiling'] * 100:5.1f}% of ceiling{e}", flush=True)
    return row


def summarize(op: str, shape: str, best: dict | None, peer: dict | None, peer_name: str):
    """Print and record the best variant of ours against the peer (a TB/s op)."""
    if best is None or peer is None:
        return
    print(f"   -> best ours {best['impl']}: {best['tbs']:.3f} TB/s, "
          f"{peer['ms'] / best['ms']:.2f}x {peer_name.upper()}", flush=True)
    RESULTS.append(dict(op=op, shape=shape, summary=True, best=best["impl"],
                        ours_tbs=best["tbs"], peer=peer_name, peer_tbs=peer["tbs"],
                        ratio=peer["ms"] / best["ms"]))


def guarded(label, fn, *args, **kwargs):
    """Run one measurement; a failing variant prints its error and the sweep goes on."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 -- a benchmark sweep must survive one bad variant
        print(f"FAILED {label}: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
        traceback.print_exc(limit=3)
        RESULTS.append(dict(impl=label, failed=f"{type(exc).__name__}: {str(exc)[:500]}"))
        return None


def rand(key, shape, dtype, n_sets: int = 1):
    keys = jax.random.split(jax.random.PRNGKey(key), n_sets)
    return [jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys]


# ---------------------------------------------------------------------------------------------
# Flash attention (prefill)
# ---------------------------------------------------------------------------------------------

FLASH_SHAPES = [
    # b, t, hq, hkv, d, causal
    (4, 4096, 32, 32, 128, True),
    (4, 4096, 32, 32, 128, False),
    (4, 4096, 32, 8, 128, True),
    (4, 4096, 32, 32, 64, True),
    (4, 4096, 32, 32, 256, True),
]

TRITON_FLASH_VARIANTS = {
    128: [pk.FlashBlockSizes(128, 64, 8, 3), pk.FlashBlockSizes(128, 128, 8, 3),
          pk.FlashBlockSizes(128, 64, 4, 3), pk.FlashBlockSizes(64, 64, 4, 3),
          pk.FlashBlockSizes(128, 32, 4, 4)],
    64: [pk.FlashBlockSizes(128, 64, 4, 3), pk.FlashBlockSizes(128, 128, 8, 3),
         pk.FlashBlockSizes(64, 64, 4, 4)],
    256: [pk.FlashBlockSizes(64, 32, 4, 2), pk.FlashBlockSizes(64, 64, 8, 2),
          pk.FlashBlockSizes(128, 32, 8, 2)],
}

MC = pk.MosaicFlashConfig
MOSAIC_FLASH_VARIANTS = {
    # The default first. MosaicFlashConfig.overlap "qk_pv" issues Q K_{j+1}^T with P_j V_j
    # (run 4, D128: qk_pv without pingpong won all three shapes, causal 521, full 590, GQA 534
    # TFLOP/s; a variant that only waited for the next K inside the P V scope, 1-2% over none,
    # was removed).
    # Dropped after losing: 64x192 (run 3), 64x64 st4, st3 + qk_pv, k_wait (run 4), st3 pp.
    # Run 6: "qk_pv_intra" (FA3 intra-warpgroup overlap: softmax of S_{j+1} while P_j V_j runs)
    # 518.4 causal / 593.6 full / 534.9 GQA against qk_pv's 522.0 / 584.3 / 535.0, i.e. a tie
    # (the default stays); with pingpong 497-563. wg_ranges (per-warpgroup KV ranges; at kv128
    # on these shapes both warpgroups' ranges are the block's, so it is timed at kv64, where
    # warpgroup 0 skips a fully masked diagonal tile per causal block): 464 / 526 / 479.
    128: [MC(64, 128, 2, False, "qk_pv"), MC(64, 128, 2, False, "qk_pv_intra"),
          MC(64, 128, 2, True, "qk_pv_intra"), MC(64, 128, 2, True, "qk_pv"),
          MC(64, 128, 2, True), MC(64, 64, 2, False, "qk_pv_intra", wg_ranges=True)],
    64: [MC(64, 128, 2, True), MC(64, 128, 3, True), MC(64, 128, 2, False, "qk_pv")],
    # D256 (run 5): qk_pv 566.5 over 533.0 without it, pingpong + qk_pv 549.0; st3 does not
    # fit shared memory. D64: st2 pp 380.5, st3 pp 374.3, qk_pv 358-374 (cuDNN 394).
    256: [MC(64, 64, 2, False, "qk_pv"), MC(64, 64, 2, False), MC(64, 64, 2, True, "qk_pv")],
}


def bench_flash(quick: bool, head_dims: str | None = None):
    shapes = FLASH_SHAPES[:2] if quick else FLASH_SHAPES
    if head_dims:  # "128" or "64,128"
        shapes = [sh for sh in shapes if str(sh[4]) in head_dims.split(",")]
    for b, t, hq, hkv, d, causal in shapes:
        shape = f"B{b} T{t} H{hq}/{hkv} D{d} {'causal' if causal else 'full'}"
        dtype = jnp.bfloat16
        q = rand(1, (b, t, hq, d), dtype)[0]
        k = rand(2, (b, t, hkv, d), dtype)[0]
        v = rand(3, (b, t, hkv, d), dtype)[0]
        flops = 4 * b * hq * t * t * d * (0.5 if causal else 1.0)
        args = [(q, k, v)]
        ref_fn = jax.jit(lambda q, k, v: pk.flash_attention_reference(q, k, v, causal=causal))
        ref = guarded(f"flash xla-reference {shape}", ref_fn, q, k, v)

        def measure(impl, fn, check=True):
            out = fn(q, k, v)
            err = rel_err(out, ref) if (check and ref is not None) else None
            secs = time_fn(fn, args, iters=iters_for(flops / 300e12))
            return record("flash", shape, impl, secs, flops=flops, err=err)

        cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"))
        peer = guarded("flash cudnn", measure, "cudnn", cudnn)
        xla = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla"))
        guarded("flash xla", measure, "xla", xla)
        best = None
        for blocks in TRITON_FLASH_VARIANTS[d][: (1 if quick else None)]:
            fn = jax.jit(lambda q, k, v, blocks=blocks: pk.flash_attention(
                q, k, v, causal=causal, block_sizes=blocks, backend="triton"))
            name = f"ours triton {blocks.block_q}x{blocks.block_k} w{blocks.num_warps} s{blocks.num_stages}"
            row = guarded(name, measure, name, fn)
            if row and (best is None or row["ms"] < best["ms"]):
                best = row
        for cfg in MOSAIC_FLASH_VARIANTS[d][: (2 if quick else None)]:
            fn = jax.jit(lambda q, k, v, cfg=cfg: pk.flash_attention(
                q, k, v, causal=causal, backend="mosaic", mosaic_config=cfg))
            name = f"ours mosaic {cfg}"
            row = guarded(name, measure, name, fn)
            if row and (best is None or row["ms"] < best["ms"]):
                best = row
        if best is not None and peer is not None:
            print(f"   -> best ours {best['impl']}: {best['tflops']:.1f} TFLOP/s, "
                  f"{peer['ms'] / best['ms']:.2f}x cuDNN", flush=True)
            RESULTS.append(dict(op="flash", shape=shape, summary=True, best=best["impl"],
                                ours_tflops=best["tflops"], peer="cudnn",
                                peer_tflops=peer["tflops"], ratio=peer["ms"] / best["ms"]))
        del q, k, v, ref


# ---------------------------------------------------------------------------------------------
# Decode attention
# ---------------------------------------------------------------------------------------------

DECODE_SHAPES = [
    # b, s, hq, hkv, d
    (1, 1024, 32, 8, 128), (1, 8192, 32, 8, 128), (1, 32768, 32, 8, 128),
    (8, 8192, 32, 8, 128), (16, 4096, 32, 8, 128), (32, 8192, 32, 8, 128),
    (64, 8192, 32, 8, 128), (64, 32768, 32, 8, 128), (8, 8192, 64, 8, 128),
]

DECODE_VARIANTS = [pk.DecodeBlockSizes(64, None, 4, 3), pk.DecodeBlockSizes(128, None, 4, 3),
                   pk.DecodeBlockSizes(64, None, 4, 4), pk.DecodeBlockSizes(32, None, 4, 4),
                   pk.DecodeBlockSizes(128, None, 8, 2), pk.DecodeBlockSizes(64, 16, 4, 3),
                   pk.DecodeBlockSizes(64, 32, 4, 3), pk.DecodeBlockSizes(128, 16, 4, 3),
                   pk.DecodeBlockSizes(64, 64, 4, 3)]


def bench_decode(quick: bool, only_shapes: str | None = None):
    shapes = DECODE_SHAPES[1:2] if quick else DECODE_SHAPES
    if only_shapes:  # "BxS,...": e.g. 8x8192,1x32768
        want = {tuple(int(v) for v in x.split("x")) for x in only_shapes.split(",")}
        shapes = [sh for sh in DECODE_SHAPES if sh[:2] in want]
    for b, s, hq, hkv, d in shapes:
        shape = f"B{b} S{s} H{hq}/{hkv} D{d}"
        dtype = jnp.bfloat16
        kv_bytes = 2 * b * s * hkv * d * 2  # K and V, every position valid
        n_sets = max(1, min(8, math.ceil(3 * L2_BYTES / kv_bytes)))
        qs = rand(10, (b, hq, d), dtype, n_sets)
        ks = rand(11, (b, s, hkv, d), dtype, n_sets)
        vs = rand(12, (b, s, hkv, d), dtype, n_sets)
        lengths = jnp.full((b,), s, jnp.int32)
        args = [(qs[i], ks[i], vs[i], lengths) for i in range(n_sets)]
        nbytes = kv_bytes + 2 * b * hq * d * 2
        ref_fn = jax.jit(pk.decode_attention_reference)
        ref = ref_fn(*args[0])

        def measure(impl, fn, check=True):
            err = rel_err(fn(*args[0]), ref) if check else None
            secs = time_fn(fn, args, iters=iters_for(nbytes / 3e12))
            return record("decode", shape, impl, secs, nbytes=nbytes, err=err)

        peer = guarded("decode xla", measure, "xla (reference)", ref_fn, check=False)
        best = None
        for blocks in DECODE_VARIANTS[: (1 if quick else None)]:
            fn = jax.jit(lambda q, k, v, l, blocks=blocks: pk.decode_attention(
                q, k, v, l, block_sizes=blocks))
            name = (f"ours triton bk{blocks.block_k} w{blocks.num_warps} s{blocks.num_stages}"
                    f" splits{blocks.num_splits or 'auto'}")
            row = guarded(name, measure, name, fn)
            if row and (best is None or row["ms"] < best["ms"]):
                best = row
        summarize("decode", shape, best, peer, "xla")
        # Ragged lengths: bytes counted over the valid positions only.
        if b >= 8 and s >= 8192:
            lens = jax.random.randint(jax.random.PRNGKey(5), (b,), s // 8, s + 1, jnp.int32)
            rargs = [(a[0], a[1], a[2], lens) for a in args]
            rbytes = 2 * int(lens.sum()) * hkv * d * 2 + 2 * b * hq * d * 2
            rref = ref_fn(*rargs[0])
            best_blocks = DECODE_VARIANTS[0]
            if best is not None:
                best_blocks = next(v for v in DECODE_VARIANTS
                                   if f"bk{v.block_k} w{v.num_warps} s{v.num_stages} "
                                      f"splits{v.num_splits or 'auto'}" in best["impl"])
            fn = jax.jit(lambda q, k, v, l: pk.decode_attention(q, k, v, l, block_sizes=best_blocks))

            def ragged():
                err = rel_err(fn(*rargs[0]), rref)
                secs = time_fn(fn, rargs, iters=iters_for(rbytes / 3e12))
                record("decode", shape + " ragged", "ours (best blocks)", secs, nbytes=rbytes, err=err)
                secs = time_fn(ref_fn, rargs, iters=iters_for(rbytes / 1e12))
                record("decode", shape + " ragged", "xla (reference)", secs, nbytes=rbytes)
            guarded("decode ragged", ragged)
        del qs, ks, vs, args


# ---------------------------------------------------------------------------------------------
# RoPE, RMSNorm, SwiGLU
# ---------------------------------------------------------------------------------------------


def bench_small(quick: bool):
    dtype = jnp.bfloat16
    # RoPE on the queries of a prefill chunk: B4 T4096 H32 D128 (bytes: read + write x).
    b, t, h, d = 4, 4096, 32, 128
    xs = rand(20, (b, t, h, d), dtype)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    inv = jnp.asarray(1.0 / 500000.0 ** (np.arange(0, d, 2) / d), jnp.float32)
    nbytes = 2 * xs[0].size * 2
    ref_fn = jax.jit(pk.rope_reference)
    ours = jax.jit(pk.rope)
    err = rel_err(ours(xs[0], pos, inv), ref_fn(xs[0], pos, inv))
    for impl, fn, e in (("ours triton", ours, err), ("xla (reference)", ref_fn, None)):
        guarded(f"rope {impl}", lambda fn=fn, impl=impl, e=e: record(
            "rope", f"B{b} T{t} H{h} D{d}", impl,
            time_fn(fn, [(xs[0], pos, inv)], iters=50), nbytes=nbytes, err=e))
    # RMSNorm over hidden states: [16384, 4096] and one decode batch [64, 4096].
    for m in ((64, 16384) if not quick else (16384,)):
        x = rand(21, (m, 4096), dtype, 4 if m <= 64 else 1)
        w = rand(22, (4096,), dtype)[0]
        nbytes = 2 * m * 4096 * 2
        ref_fn = jax.jit(lambda x, w: pk.rms_norm_reference(x, w, eps=1e-5))
        ours = jax.jit(lambda x, w: pk.rms_norm(x, w, eps=1e-5))
        err = rel_err(ours(x[0], w), ref_fn(x[0], w))
        for impl, fn, e in (("ours triton", ours, err), ("xla (reference)", ref_fn, None)):
            guarded(f"rms {impl}", lambda fn=fn, impl=impl, e=e, x=x: record(
                "rmsnorm", f"M{m} D4096", impl,
                time_fn(fn, [(xi, w) for xi in x], iters=100), nbytes=nbytes, err=e))
    # SwiGLU, Llama-3-8B MLP shapes: decode (weight-streaming) and prefill (matmul-bound).
    k, n = 4096, 14336
    wg = rand(23, (k, n), dtype, 2)
    wu = rand(24, (k, n), dtype, 2)
    wg = [w * (k ** -0.5) for w in wg]
    wu = [w * (k ** -0.5) for w in wu]
    for m in ((1, 16, 64, 4096) if not quick else (1, 4096)):
        x = rand(25, (m, k), dtype)[0]
        args = [(x, wg[i], wu[i]) for i in range(2)]
        flops = 2 * 2 * m * k * n
        nbytes = 2 * k * n * 2 + m * k * 2 + m * n * 2
        ref_fn = jax.jit(pk.swiglu_reference)
        ref = ref_fn(*args[0])
        variants = [None]
        if not quick:
            variants += ([pk.MatmulBlockSizes(16, 32, 256, 4, 4), pk.MatmulBlockSizes(16, 128, 128, 4, 4)]
                         if m <= 64 else
                         [pk.MatmulBlockSizes(128, 128, 64, 8, 3), pk.MatmulBlockSizes(64, 128, 64, 4, 3)])
        shape = f"M{m} K{k} N{n}"
        metric = dict(nbytes=nbytes) if m <= 64 else dict(flops=flops)
        for blocks in variants:
            fn = jax.jit(lambda x, a, c, blocks=blocks: pk.swiglu(x, a, c, block_sizes=blocks))
            name = "ours triton " + ("default" if blocks is None else
                                     f"{blocks.block_m}x{blocks.block_n}x{blocks.block_k} w{blocks.num_warps} s{blocks.num_stages}")
            guarded(name, lambda fn=fn, name=name: record(
                "swiglu", shape, name, time_fn(fn, args, iters=50), err=rel_err(fn(*args[0]), ref),
                **metric))
        guarded("swiglu xla", lambda: record("swiglu", shape, "xla (reference)",
                                             time_fn(ref_fn, args, iters=50), **metric))


# ---------------------------------------------------------------------------------------------
# Decode projections (weight-streaming matmuls, M = batch): norm_matmul / swiglu
# ---------------------------------------------------------------------------------------------

MB = pk.MatmulBlockSizes
GEMV_VARIANTS = [  # block_m, block_n, block_k, warps, stages, split_k
    MB(16, 32, 128, 4, 4), MB(16, 32, 256, 4, 4), MB(16, 64, 128, 4, 4), MB(16, 64, 256, 4, 3),
    MB(16, 128, 128, 4, 4), MB(16, 64, 128, 4, 4, 2), MB(16, 64, 128, 4, 4, 4),
    MB(16, 128, 128, 4, 4, 4), MB(16, 128, 128, 4, 4, 8), MB(16, 32, 128, 4, 4, 2),
    MB(16, 64, 256, 4, 3, 2), MB(16, 128, 64, 4, 5, 4), MB(16, 64, 128, 8, 4, 4),
    MB(16, 256, 64, 4, 4, 8),
]


def bench_gemv(quick: bool, m: int = 1):
    """The five weight streams of a Llama-3-8B decode step at batch m, fused as the model
    calls them, against XLA running the unfused reference (norm, dot, residual / SiLU)."""
    dtype = jnp.bfloat16
    d, f, v = 4096, 14336, 128256
    # name, K, N, norm in the prologue, residual, swiglu, float32 out
    cases = [("qkv", d, 6144, True, False, False, False), ("wo", d, d, False, True, False, False),
             ("gate_up", d, f, True, False, True, False), ("down", f, d, False, True, False, False),
             ("lm_head", d, v, True, False, False, True)]
    variants = GEMV_VARIANTS[:3] if quick else GEMV_VARIANTS
    for name, k, n, norm, resid, is_swiglu, f32_out in cases:
        n_w = 2 if is_swiglu else 1
        wbytes = n_w * k * n * 2
        n_sets = max(2, min(8, math.ceil(3 * L2_BYTES / wbytes)))
        xs = rand(30, (m, k), dtype, n_sets)
        nw = (1 + 0.1 * rand(31, (k,), jnp.float32)[0]).astype(dtype)
        ws = [[w * (k ** -0.5) for w in rand(32 + i, (k, n), dtype, n_sets)] for i in range(n_w)]
        r = rand(40, (m, n), dtype)[0]
        args = [(xs[i], *[w[i] for w in ws]) for i in range(n_sets)]
        nbytes = wbytes + m * k * 2 + m * n * (4 if f32_out else 2) * (2 if resid else 1)
        shape = f"{name} M{m} K{k} N{n}"
        nwk = nw if norm else None

        def ours_fn(blocks):
            if is_swiglu:
                return jax.jit(lambda x, a, b: pk.swiglu(x, a, b, norm_weight=nwk, eps=1e-5,
                                                          block_sizes=blocks))
            return jax.jit(lambda x, w: pk.norm_matmul(
                x, nwk, w, eps=1e-5, residual=r if resid else None,
                out_dtype=jnp.float32 if f32_out else None, block_sizes=blocks))

        if is_swiglu:
            ref_fn = jax.jit(lambda x, a, b: pk.swiglu_reference(x, a, b, norm_weight=nwk,
                                                                 eps=1e-5))
        else:
            ref_fn = jax.jit(lambda x, w: pk.norm_matmul_reference(
                x, nwk, w, eps=1e-5, residual=r if resid else None,
                out_dtype=jnp.float32 if f32_out else None))
        ref = ref_fn(*args[0])
        peer = guarded(f"gemv xla {shape}", lambda: record(
            "gemv", shape, "xla (unfused reference)", time_fn(ref_fn, args, iters=100),
            nbytes=nbytes))
        best = None
        for blocks in [None] + variants:
            label = ("ours default" if blocks is None else
                     f"ours {blocks.block_n}x{blocks.block_k} w{blocks.num_warps} "
                     f"s{blocks.num_stages} split{blocks.split_k}")

            def one(blocks=blocks, label=label):
                fn = ours_fn(blocks)
                err = rel_err(fn(*args[0]), ref)
                return record("gemv", shape, label, time_fn(fn, args, iters=100),
                              nbytes=nbytes, err=err)
            row = guarded(label, one)
            if row and (best is None or row["ms"] < best["ms"]):
                best = row
        summarize("gemv", shape, best, peer, "xla")
        del xs, ws, args


# ---------------------------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write all rows to this file")
    parser.add_argument("--only", default="flash,decode,small,gemv",
                        help="comma-separated subset of flash,decode,small,gemv")
    parser.add_argument("--quick", action="store_true", help="one shape and variant per op")
    parser.add_argument("--flash-head-dims", default=None,
                        help="flash shapes to run, by head dim: 128 or 64,128 (default: all)")
    parser.add_argument("--decode-shapes", default=None,
                        help="decode shapes to run, as BxS,... (default: all)")
    args = parser.parse_args(argv)
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}", flush=True)
    if dev.platform != "gpu":
        print("no GPU: these kernels only compile for NVIDIA GPUs (tests use interpret mode)")
        return 1
    parts = args.only.split(",")
    t0 = time.time()
    for name, fn in (("flash", bench_flash), ("decode", bench_decode), ("small", bench_small),
                     ("gemv", bench_gemv)):
        if name in parts:
            if name == "decode":
                guarded("bench decode", fn, args.quick, args.decode_shapes)
            elif name == "flash":
                guarded("bench flash", fn, args.quick, args.flash_head_dims)
            else:
                guarded(f"bench {name}", fn, args.quick)
            print(f"[{name} done at {time.time() - t0:.0f}s]", flush=True)
            if args.json:  # after each part, so a run cut short still leaves its numbers
                with open(args.json, "w") as f:
                    json.dump(dict(device=dev.device_kind, jax=jax.__version__, rows=RESULTS),
                              f, indent=1)
    print("\nsummary (ours best variant vs peer, same run)")
    print(f"{'op':7s} {'shape':34s} {'ours':>10s} {'peer':>10s} {'ratio':>6s}  best variant")
    for r in RESULTS:
        if r.get("summary"):
            unit = "tflops" if "ours_tflops" in r else "tbs"
            ours, peer = r[f"ours_{unit}"], r[f"peer_{unit}"]
            ceiling = PEAK_TFLOPS if unit == "tflops" else PEAK_TBS
            print(f"{r['op']:7s} {r['shape']:34s} {ours:10.3f} {peer:10.3f} {r['ratio']:6.2f}  "
                  f"{r['best']} ({ours / ceiling * 100:.0f}% of ceiling; {unit}, peer {r['peer']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
