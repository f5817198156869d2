"""Paged chunk attention (pallas_kernels/paged_chunk_attention.py) on one GPU: chunked prefill
and speculative verification against a paged cache, correctness first, then speed.

    PYTHONPATH=. python3 benchmarks/paged_prefill.py --json out.jsonl [--quick] [--only prefill]

(a) Chunked prefill: B=4 rows, a 512-query chunk at positions 1536..2047 of 2048-token contexts
(Llama-3-8B's GQA 32/8, D128, bf16; 64-token pages in random order), in TFLOP/s of the causal
pairs actually needed; beside it our contiguous `chunk_attention` on the same values (it takes
16-bit caches as well as int8 codes), the int8-code variants of both, and `flash_attention` of
a fresh 2048-token causal prefill as a ceiling (its own causal FLOPs). (b) Verification: T = 1,
2, 3, 5, 9 queries (of 1..9; five keep the run under 3 minutes) at the end of a 4096-token
context, B=1 and B=8, in TB/s of K/V read (every visible key once), unsplit and with
`split_keys` (B=1 has only 8 unsplit programs), beside
`decode_attention` (T=1, its default split-K and the fixed-chunk deterministic variant).

Timing: benchmarks/kernels.py's `time_fn` (warm-up, median of 5 runs; short calls chained in
one program; KV sets rotated past the 60 MB L2 in (b)). On a CPU `--quick` runs tiny shapes
with the kernels in interpret mode (a check of the script, not of the speed). JSON lines (one
per row) go to --json; a table comes last.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks.kernels import L2_BYTES, RESULTS, guarded, rand, record, rel_err, time_fn
from pallas_kernels.kv_quant import quantize_kv

HQ, HKV, D = 32, 8, 128
# (a) b, t (queries), context, page_size; (b) b, context, page_size, query counts
PREFILL = (4, 512, 2048, 64)
VERIFY = [(1, 4096, 64, (1, 2, 3, 5, 9)), (8, 4096, 64, (1, 2, 3, 5, 9))]
QUICK_PREFILL = (2, 20, 48, 16)
QUICK_VERIFY = [(1, 64, 16, (1, 3)), (2, 64, 16, (2,))]


def paged_from_contiguous(k, v, page_size: int, seed: int):
    """Contiguous k, v [B, S, Hkv, D] -> (k_pages, v_pages [P, page_size, Hkv, D], block_tables
    [B, S / page_size]): every page at a random place in the pool, page 0 the null page."""
    b, s, hkv, d = k.shape
    n = s // page_size
    perm = np.random.default_rng(seed).permutation(b * n) + 1
    bt = jnp.asarray(perm.reshape(b, n).astype(np.int32))
    inv = np.argsort(perm)  # pool slot i + 1 holds (row, page) inv[i]

    def pool(x):
        pages = x.reshape(b * n, page_size, hkv, d)[inv]
        return jnp.concatenate([jnp.zeros((1, page_size, hkv, d), x.dtype), pages])

    return pool(k), pool(v), bt


def quantized(x):
    return quantize_kv(x, jnp.int8)


def pages_of(scale, page_size: int, bt):
    """Scales [B, S, Hkv] laid out as the pool of `bt` (see paged_from_contiguous)."""
    b, s, hkv = scale.shape
    n = s // page_size
    inv = np.argsort(np.asarray(bt).reshape(-1) - 1)
    pages = scale.reshape(b * n, page_size, hkv)[inv]
    return jnp.concatenate([jnp.zeros((1, page_size, hkv), scale.dtype), pages])


def causal_pairs(first: int, t: int) -> int:
    """(query, key) pairs of t queries at positions first.. seeing keys <= their position."""
    return t * first + t * (t + 1) // 2


def bench_prefill(shape, interpret: bool):
    b, t, ctx, ps = shape
    label = f"prefill B{b} T{t}@{ctx - t} ctx{ctx} H{HQ}/{HKV} D{D} ps{ps}"
    q = rand(1, (b, t, HQ, D), jnp.bfloat16)[0]
    k = rand(2, (b, ctx, HKV, D), jnp.bfloat16)[0]
    v = rand(3, (b, ctx, HKV, D), jnp.bfloat16)[0]
    pos = jnp.broadcast_to(jnp.arange(ctx - t, ctx, dtype=jnp.int32), (b, t))
    kp, vp, bt = paged_from_contiguous(k, v, ps, 0)
    (kq, ks), (vq, vs) = quantized(k), quantized(v)
    kqp, vqp, _ = paged_from_contiguous(kq, vq, ps, 0)
    ksp, vsp = pages_of(ks, ps, bt), pages_of(vs, ps, bt)
    flops = 4.0 * b * HQ * D * causal_pairs(ctx - t, t)
    ref = guarded(f"reference {label}", jax.jit(pk.paged_chunk_attention_reference),
                  q, kp, vp, bt, pos)
    iters = 1 if interpret else 50
    rows = {}

    def measure(impl, fn, args, want=ref, fl=flops):
        err = rel_err(fn(*args), want) if want is not None else None
        rows[impl] = record("paged_prefill", label, impl, time_fn(fn, [args], iters=iters),
                            flops=fl, err=err)

    variants = [("paged bf16 (default blocks)", None),
                ("paged bf16 rows128", pk.PagedBlockSizes(128, 64, 8, 3)),
                ("paged bf16 rows128 k32", pk.PagedBlockSizes(128, 32, 4, 3))]
    if interpret:
        variants = variants[:1]
    for impl, blocks in variants:
        fn = jax.jit(lambda q, kp, vp, bt, pos, blocks=blocks: pk.paged_chunk_attention(
            q, kp, vp, bt, pos, block_sizes=blocks, interpret=interpret))
        guarded(f"{impl} {label}", measure, impl, fn, (q, kp, vp, bt, pos))
    fn = jax.jit(lambda q, k, v, pos: pk.chunk_attention(q, k, v, pos, interpret=interpret))
    guarded(f"contiguous {label}", measure, "contiguous chunk_attention bf16", fn,
            (q, k, v, pos))
    ref_q = guarded(f"reference int8 {label}", jax.jit(
        lambda *a: pk.paged_chunk_attention_reference(*a[:5], k_scale=a[5], v_scale=a[6])),
        q, kqp, vqp, bt, pos, ksp, vsp)
    fn = jax.jit(lambda q, kp, vp, bt, pos, ks, vs: pk.paged_chunk_attention(
        q, kp, vp, bt, pos, k_scale=ks, v_scale=vs, interpret=interpret))
    guarded(f"paged int8 {label}", measure, "paged int8", fn, (q, kqp, vqp, bt, pos, ksp, vsp),
            ref_q)
    fn = jax.jit(lambda q, k, v, pos, ks, vs: pk.chunk_attention(
        q, k, v, pos, k_scale=ks, v_scale=vs, interpret=interpret))
    guarded(f"contiguous int8 {label}", measure, "contiguous chunk_attention int8", fn,
            (q, kq, vq, pos, ks, vs), ref_q)
    # the ceiling: a fresh causal prefill of the whole context, at its own FLOPs
    qf = rand(4, (b, ctx, HQ, D), jnp.bfloat16)[0]
    fn = jax.jit(lambda q, k, v: pk.flash_attention(q, k, v, causal=True, backend="triton",
                                                    interpret=interpret))
    guarded(f"flash {label}", measure, f"flash_attention fresh {ctx} (ceiling)", fn,
            (qf, k, v), None, 4.0 * b * HQ * D * causal_pairs(0, ctx))
    summary(label, "tflops", rows, "paged bf16 (default blocks)",
            ("contiguous chunk_attention bf16", f"flash_attention fresh {ctx} (ceiling)"))


def bench_verify(shapes, interpret: bool):
    for b, ctx, ps, ts in shapes:
        kv_bytes = 2 * b * ctx * HKV * D * 2
        n_sets = 1 if interpret else max(1, min(8, math.ceil(3 * L2_BYTES / kv_bytes)))
        ks = rand(11, (b, ctx, HKV, D), jnp.bfloat16, n_sets)
        vs = rand(12, (b, ctx, HKV, D), jnp.bfloat16, n_sets)
        pools = [paged_from_contiguous(k, v, ps, i) for i, (k, v) in enumerate(zip(ks, vs))]
        iters = 1 if interpret else 100
        split = 16 if interpret else 256
        dec_split = 64 if interpret else 512
        # decode_attention: one query at position ctx - 1 (T = 1), the peer
        lengths = jnp.full((b,), ctx, jnp.int32)
        q1 = rand(10, (b, HQ, D), jnp.bfloat16, n_sets)
        dec_label = f"verify B{b} ctx{ctx} T1"
        dec_rows = {}
        dec_ref = guarded(f"decode reference {dec_label}", jax.jit(pk.decode_attention_reference),
                          q1[0], ks[0], vs[0], lengths)
        for impl, blocks in (("decode_attention (default split-K)", None),
                             (f"decode_attention split_keys={dec_split}",
                              pk.DecodeBlockSizes(block_k=64, split_keys=dec_split))):
            fn = jax.jit(lambda q, k, v, n, blocks=blocks: pk.decode_attention(
                q, k, v, n, block_sizes=blocks, interpret=interpret))

            def run(impl=impl, fn=fn):
                err = rel_err(fn(q1[0], ks[0], vs[0], lengths), dec_ref)
                sets = [(q1[i], ks[i], vs[i], lengths) for i in range(n_sets)]
                dec_rows[impl] = record("verify", dec_label, impl,
                                        time_fn(fn, sets, iters=iters), nbytes=kv_bytes, err=err)
            guarded(f"{impl} {dec_label}", run)
        for t in ts:
            label = f"verify B{b} ctx{ctx} T{t} ps{ps}"
            qs = rand(13 + t, (b, t, HQ, D), jnp.bfloat16, n_sets)
            pos = jnp.broadcast_to(jnp.arange(ctx - t, ctx, dtype=jnp.int32), (b, t))
            kp, vp, bt = pools[0]
            ref = guarded(f"reference {label}", jax.jit(pk.paged_chunk_attention_reference),
                          qs[0], kp, vp, bt, pos)
            rows = dict(dec_rows)
            for impl, blocks in (("paged (default blocks)", None),
                                 (f"paged split_keys={split}",
                                  pk.PagedBlockSizes(64, 16 if interpret else 64, 4, 3,
                                                     split_keys=split))):
                fn = jax.jit(lambda q, kp, vp, bt, pos, blocks=blocks: pk.paged_chunk_attention(
                    q, kp, vp, bt, pos, block_sizes=blocks, interpret=interpret))

                def run(impl=impl, fn=fn):
                    err = rel_err(fn(qs[0], kp, vp, bt, pos), ref) if ref is not None else None
                    sets = [(qs[i], *pools[i], pos) for i in range(n_sets)]
                    rows[impl] = record("verify", label, impl, time_fn(fn, sets, iters=iters),
                                        nbytes=kv_bytes, err=err)
                guarded(f"{impl} {label}", run)
            summary(label, "tbs", rows, "paged (default blocks)",
                    (f"paged split_keys={split}", "decode_attention (default split-K)",
                     f"decode_attention split_keys={dec_split}"))


def summary(label, unit, rows, ours, peers):
    if ours not in rows:
        return
    row = dict(summary=True, shape=label, unit=unit, ours=ours, ours_rate=rows[ours][unit])
    for p in peers:
        if p in rows:
            row[p] = rows[p][unit]
            row[f"{p} ms / ours ms"] = rows[p]["ms"] / rows[ours]["ms"]
    RESULTS.append(row)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the rows here, one JSON object a line")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes (interpret mode on a CPU); on a GPU: T 1 and 9 only")
    parser.add_argument("--only", default="prefill,verify", help="prefill,verify or one")
    args = parser.parse_args(argv)
    dev = jax.devices()[0]
    interpret = dev.platform != "gpu"
    if interpret and not args.quick:
        print("no GPU: only --quick runs here (the kernels in interpret mode)", file=sys.stderr)
        return 1
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}", flush=True)
    parts = args.only.split(",")
    verify = VERIFY
    if args.quick:
        verify = QUICK_VERIFY if interpret else [(b, c, p, (1, 9)) for b, c, p, _ in VERIFY]
    if "prefill" in parts:
        bench_prefill(QUICK_PREFILL if interpret else PREFILL, interpret)
    if "verify" in parts:
        bench_verify(verify, interpret)
    if args.json:
        with open(args.json, "w") as f:
            for row in RESULTS:
                f.write(json.dumps(dict(device=dev.device_kind, **row)) + "\n")
    print("\n| shape | ours | rate | peer | peer rate | peer ms / ours ms |")
    print("|---|---|---|---|---|---|")
    for r in RESULTS:
        if not r.get("summary"):
            continue
        unit = "TFLOP/s" if r["unit"] == "tflops" else "TB/s"
        spec = ".1f" if r["unit"] == "tflops" else ".3f"
        peers = [k for k in r if k.endswith(" ms / ours ms")]
        print(f"| {r['shape']} | {r['ours']} | {r['ours_rate']:{spec}} {unit} | | | |")
        for k in peers:
            p = k[:-len(" ms / ours ms")]
            print(f"| | | | {p} | {r[p]:{spec}} {unit} | {r[k]:.2f} |")
    failed = [r for r in RESULTS if r.get("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
