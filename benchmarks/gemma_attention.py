"""Gemma's attention on one GPU: soft-capped flash attention (prefill) and decode attention at
head_dim 256, correctness first, then speed.

    PYTHONPATH=. python3 benchmarks/gemma_attention.py --json out.jsonl [--quick]

Peers, in one call each: the XLA reference with the same soft-cap (`flash_attention_reference`
/ `decode_attention_reference` jitted: the same math, materialized scores), and cuDNN through
`jax.nn.dot_product_attention(implementation="cudnn")`, which takes no soft-cap: it is timed
without one, a speed ceiling rather than the same computation (its row says so). Prefill is
reported in TFLOP/s (the causal / windowed FLOPs actually needed), decode in TB/s of K/V read.
On a CPU `--quick` runs a tiny shape with the kernels in interpret mode (it checks the script,
not the speed). JSON lines (one per row) go to --json; a table comes last.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from benchmarks.kernels import RESULTS, guarded, iters_for, rand, record, rel_err, time_fn

# b, t, hq, hkv, d, window, softcap, label
PREFILL_SHAPES = [
    (1, 8192, 16, 8, 256, 4096, 50.0, "gemma2-9b"),
    (1, 8192, 16, 8, 256, None, 50.0, "gemma2-9b full"),
    (1, 8192, 8, 4, 256, 1024, None, "gemma3-4b local"),
    (1, 8192, 32, 16, 128, 1024, None, "gemma3-27b local"),
    (4, 4096, 16, 8, 256, None, 50.0, "gemma2-9b B4"),
]
# b, s (keys), hq, hkv, d, window, softcap, label
DECODE_SHAPES = [
    (1, 8192, 16, 8, 256, None, 50.0, "gemma2-9b"),
    (1, 32768, 16, 8, 256, None, 50.0, "gemma2-9b 32k"),
    (1, 32768, 4, 1, 256, 512, None, "gemma3-1b local 32k"),
    (8, 8192, 16, 8, 256, 4096, 50.0, "gemma2-9b B8 window"),
]
QUICK_PREFILL = [(1, 40, 2, 1, 256, 16, 50.0, "tiny")]
QUICK_DECODE = [(2, 64, 2, 1, 256, 16, 50.0, "tiny")]


def causal_flops(b, t, hq, d, window) -> float:
    """QK^T and PV FLOPs over the visible (query, key) pairs."""
    if window is None or window >= t:
        pairs = t * (t + 1) / 2
    else:
        pairs = window * (window + 1) / 2 + (t - window) * window
    return 4.0 * b * hq * d * pairs


def bench_prefill(shapes, interpret: bool):
    for b, t, hq, hkv, d, window, cap, label in shapes:
        shape = f"{label}: B{b} T{t} H{hq}/{hkv} D{d} w{window} cap{cap}"
        q = rand(1, (b, t, hq, d), jnp.bfloat16)[0]
        k = rand(2, (b, t, hkv, d), jnp.bfloat16)[0]
        v = rand(3, (b, t, hkv, d), jnp.bfloat16)[0]
        flops = causal_flops(b, t, hq, d, window)
        scale = d ** -0.5
        ref_fn = jax.jit(lambda q, k, v: pk.flash_attention_reference(
            q, k, v, sm_scale=scale, sliding_window=window, softcap=cap))
        ref = guarded(f"flash reference {shape}", ref_fn, q, k, v)

        def measure(impl, fn, check=True, **extra):
            err = rel_err(fn(q, k, v), ref) if (check and ref is not None) else None
            secs = time_fn(fn, [(q, k, v)], iters=1 if interpret else iters_for(flops / 300e12))
            return record("flash", shape, impl, secs, flops=flops, err=err, **extra)

        ours_fn = jax.jit(lambda q, k, v: pk.flash_attention(
            q, k, v, sm_scale=scale, sliding_window=window, softcap=cap, interpret=interpret))
        ours = guarded(f"flash ours {shape}", measure, "ours triton (default blocks)", ours_fn)
        xla = guarded(f"flash xla {shape}", measure, "xla reference (same softcap)", ref_fn,
                      check=False)
        cudnn = None
        if not interpret:
            local = None if window is None else (window - 1, 0)
            cudnn_fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, scale=scale, is_causal=True, local_window_size=local,
                implementation="cudnn"))
            cudnn = guarded(f"flash cudnn {shape}", measure, "cudnn (no softcap: ceiling)",
                            cudnn_fn, check=cap is None, softcap_applied=False)
        summary(shape, ours, xla, cudnn)


def bench_decode(shapes, interpret: bool):
    for b, s, hq, hkv, d, window, cap, label in shapes:
        shape = f"{label}: B{b} S{s} H{hq}/{hkv} D{d} w{window} cap{cap}"
        q = rand(4, (b, hq, d), jnp.bfloat16)[0]
        kc = rand(5, (b, s, hkv, d), jnp.bfloat16)[0]
        vc = rand(6, (b, s, hkv, d), jnp.bfloat16)[0]
        lengths = jnp.full((b,), s, jnp.int32)
        keys = s if window is None else min(window, s)
        nbytes = 2 * b * keys * hkv * d * 2  # K and V of the visible keys, bf16
        ref_fn = jax.jit(lambda q, kc, vc, n: pk.decode_attention_reference(
            q, kc, vc, n, sliding_window=window, softcap=cap))
        ref = guarded(f"decode reference {shape}", ref_fn, q, kc, vc, lengths)

        def measure(impl, fn, check=True):
            err = rel_err(fn(q, kc, vc, lengths), ref) if (check and ref is not None) else None
            secs = time_fn(fn, [(q, kc, vc, lengths)], iters=1 if interpret else 50)
            return record("decode", shape, impl, secs, nbytes=nbytes, err=err)

        ours_fn = jax.jit(lambda q, kc, vc, n: pk.decode_attention(
            q, kc, vc, n, sliding_window=window, softcap=cap, interpret=interpret))
        ours = guarded(f"decode ours {shape}", measure, "ours split-K (default blocks)", ours_fn)
        xla = guarded(f"decode xla {shape}", measure, "xla reference (same softcap)", ref_fn,
                      check=False)
        summary(shape, ours, xla, None)


def summary(shape, ours, xla, cudnn):
    unit = "tflops" if ours is not None and "tflops" in ours else "tbs"
    if ours is None:
        return
    row = dict(summary=True, shape=shape, unit=unit, ours=ours[unit],
               xla=None if xla is None else xla[unit],
               vs_xla=None if xla is None else xla["ms"] / ours["ms"],
               cudnn_no_softcap=None if cudnn is None else cudnn[unit],
               vs_cudnn=None if cudnn is None else cudnn["ms"] / ours["ms"])
    RESULTS.append(row)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the rows here, one JSON object a line")
    parser.add_argument("--quick", action="store_true",
                        help="one tiny shape each (interpret mode on a CPU)")
    parser.add_argument("--only", default="prefill,decode", help="prefill,decode or one")
    args = parser.parse_args(argv)
    dev = jax.devices()[0]
    interpret = dev.platform != "gpu"
    if interpret and not args.quick:
        print("no GPU: only --quick runs here (the kernels in interpret mode)", file=sys.stderr)
        return 1
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}", flush=True)
    parts = args.only.split(",")
    if "prefill" in parts:
        bench_prefill(QUICK_PREFILL if args.quick else PREFILL_SHAPES, interpret)
    if "decode" in parts:
        bench_decode(QUICK_DECODE if args.quick else DECODE_SHAPES, interpret)
    if args.json:
        with open(args.json, "w") as f:
            for row in RESULTS:
                f.write(json.dumps(dict(device=dev.device_kind, **row)) + "\n")
    print("\n| shape | ours | xla (same softcap) | speed-up vs xla | cudnn (no softcap) | "
          "speed-up vs cudnn |")
    print("|---|---|---|---|---|---|")
    for r in RESULTS:
        if r.get("summary"):
            def fmt(x, spec=".1f"):
                return "" if x is None else format(x, spec)
            unit = "TFLOP/s" if r["unit"] == "tflops" else "TB/s"
            spec = ".1f" if r["unit"] == "tflops" else ".3f"
            print(f"| {r['shape']} | {fmt(r['ours'], spec)} {unit} | {fmt(r['xla'], spec)} | "
                  f"{fmt(r['vs_xla'], '.2f')} | {fmt(r['cudnn_no_softcap'], spec)} | "
                  f"{fmt(r['vs_cudnn'], '.2f')} |")
    failed = [r for r in RESULTS if r.get("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
