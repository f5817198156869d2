"""Paged decode attention (pallas_kernels/paged_attention.py) vs JAX's bundled Pallas paged
kernel and our contiguous decode kernel, in one run: checks, then speed.

    PYTHONPATH=. python3 benchmarks/paged_attention.py --json out.jsonl   # the H200 (< 3 min)
    PYTHONPATH=. python3 benchmarks/paged_attention.py --quick            # the H200: fewer tilings
    PYTHONPATH=. python3 benchmarks/paged_attention.py --quick            # a CPU: tiny, interpret

The anchor: 64 sequences with lengths drawn uniformly from [1024, 16384] (seed 0), 32 query
heads / 8 KV heads, D 128, bf16, one query per row. The same K/V values in every layout:

- ours paged: `paged_decode_attention` at page sizes 16, 32 and 64 (pools [P, page, Hkv, D],
  the rows' pages in a random permutation of the pool, page 0 the null page), the default
  tiling and a few others (block_k, warps, stages, splits, fixed-size chunks);
- jax paged: `jax.experimental.pallas.ops.gpu.paged_attention.paged_attention` (its layout
  [Hkv, P, page, D], built from the same pools; block tables and lengths the same) at pages
  16 and 64, a few of its tilings (pages per compute block, k_splits, warps);
- ours contiguous: `decode_attention` on the rows laid out contiguously ([B, 16384, Hkv, D]).

Each output is checked against decode_attention_reference on the contiguous rows (bf16
tolerance 1.5e-2). Reported: ms (median of repeats after warm-up, benchmarks/kernels.py's
time_fn) and TB/s of the KV bytes the rows hold (sum over rows of length x Hkv x D x 2 bytes,
x 2 for K and V), the fraction of 4.27 TB/s (the H200's measured copy). Then the fused
`paged_decode_attention_append` (RoPE, the new K/V written in place: pools donated and fed
back) vs `paged_decode_attention` and the contiguous append at B 64, context 2048. JSON lines
(stdout and --json), then a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks.kernels import PEAK_TBS, iters_for, rel_err, time_fn

TOL_BF16 = 1.5e-2
HQ, HKV, D = 32, 8, 128
ANCHOR = dict(b=64, lo=1024, hi=16384)
QUICK_CPU = dict(b=3, lo=17, hi=100)  # interpret mode: a tiny shape (Hkv 8 x D 128 kept)
RESULTS: list[dict] = []


def guarded(label, fn, *args, **kwargs):
    """One measurement; a failing one prints its error, is recorded, and the sweep goes on."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 -- a benchmark sweep must survive one bad variant
        print(f"FAILED {label}: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
        traceback.print_exc(limit=3)
        RESULTS.append(dict(impl=label, failed=f"{type(exc).__name__}: {str(exc)[:500]}"))
        return None


def emit(row: dict) -> dict:
    RESULTS.append(row)
    print(json.dumps(row), flush=True)
    return row


def tiles(blocks: pk.DecodeBlockSizes) -> str:
    split = (f"keys{blocks.split_keys}" if blocks.split_keys
             else f"splits{blocks.num_splits or 'auto'}")
    return f"bk{blocks.block_k} w{blocks.num_warps} st{blocks.num_stages} {split}"


def our_variants(page: int, quick: bool) -> list[pk.DecodeBlockSizes]:
    """The default first; then more chunks (the ragged rows' long tail), other tiles."""
    db = pk.DecodeBlockSizes
    if quick:
        return [db(), db(num_splits=8), db(block_k=max(64, page), num_splits=16)]
    out = [db(), db(num_splits=4), db(num_splits=8), db(num_splits=16), db(split_keys=1024),
           db(block_k=128, num_stages=3, num_splits=8), db(block_k=32, num_stages=4, num_splits=8),
           db(num_warps=8, num_splits=8), db(num_stages=3, num_splits=16)]
    return out


def jax_variants(page: int, pages_per_seq: int, quick: bool) -> list[dict]:
    """Tilings of the bundled kernel: its defaults (8 pages per compute block, 16 splits,
    8 warps), then 64 / 128 / 256 keys per compute block at 16 and 32 splits, 4 warps; only
    those that divide the table (its asserts)."""
    out = [dict(pages_per_compute_block=8, k_splits=16, num_warps=8)]
    per = sorted({max(1, 64 // page), max(1, 128 // page), max(1, 256 // page)})
    out += [dict(pages_per_compute_block=n, k_splits=k, num_warps=4)
            for n in per for k in (16, 32)]
    ok = []
    for t in out:
        k = min(t["k_splits"], pages_per_seq)
        part = pages_per_seq // k
        if pages_per_seq % k == 0 and part % min(part, t["pages_per_compute_block"]) == 0:
            ok.append(dict(block_h=16, num_stages=2, **{**t, "k_splits": k}))
    return ok[:2] if quick else ok


def layout(contiguous, lengths, page: int, seed: int):
    """contiguous [B, S, Hkv, D] -> (pool [P, page, Hkv, D], block_tables [B, S // page]):
    each row's cdiv(length, page) pages at a random permutation of pool slots 1..P-1, the
    other table entries at the null page 0 (zeros)."""
    b, s = contiguous.shape[:2]
    need = -(-np.asarray(lengths) // page)
    pool = int(need.sum()) + 1
    slots = np.random.default_rng(seed).permutation(np.arange(1, pool))
    bt = np.zeros((b, s // page), np.int32)
    src = np.zeros(pool, np.int64)  # the contiguous page (row * S / page + j) each slot holds
    src[0] = -1
    n = 0
    for row, k in enumerate(need):
        bt[row, :k] = slots[n:n + k]
        src[slots[n:n + k]] = row * (s // page) + np.arange(k)
        n += k
    pages = contiguous.reshape(b * (s // page), page, *contiguous.shape[2:])
    pool_arr = jnp.where((jnp.asarray(src) >= 0)[:, None, None, None],
                         pages[jnp.asarray(np.maximum(src, 0))], 0)
    return pool_arr, jnp.asarray(bt)


def bench_anchor(quick: bool, interpret: bool, pages=(16, 32, 64)) -> None:
    shape = ANCHOR if not interpret else QUICK_CPU
    b, s = shape["b"], shape["hi"]
    s = -(-s // 64) * 64  # whole pages of every size
    lengths_np = np.random.default_rng(0).integers(shape["lo"], shape["hi"] + 1, b)
    lengths = jnp.asarray(lengths_np, jnp.int32)
    name = f"B{b} len U[{shape['lo']},{shape['hi']}] H{HQ}/{HKV} D{D} bf16"
    kv_bytes = int(lengths_np.sum()) * HKV * D * 2 * 2
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    q = jax.random.normal(keys[0], (b, HQ, D), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, HKV, D), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, HKV, D), jnp.float32).astype(jnp.bfloat16)
    ref = jax.jit(pk.decode_attention_reference)(q, k, v, lengths)
    iters = 1 if interpret else iters_for(kv_bytes / 3e12)
    repeats = 1 if interpret else 5
    emit(dict(part="shape", case="anchor", shape=name, kv_bytes=kv_bytes,
              mean_length=float(lengths_np.mean())))

    def measure(impl, fn, args, page=None, tiling=None, default=False):
        err = rel_err(fn(*args), ref)
        secs = time_fn(fn, [args], iters=iters, repeats=repeats)
        tbs = kv_bytes / secs / 1e12
        return emit(dict(part="time", case="anchor", shape=name, impl=impl, page=page,
                         tiling=tiling, default=default, ms=secs * 1e3, tbs=tbs,
                         frac_4_27=tbs / PEAK_TBS, err=err, ok=bool(err < TOL_BF16)))

    contiguous_variants = [pk.DecodeBlockSizes(), pk.DecodeBlockSizes(num_splits=8),
                           pk.DecodeBlockSizes(num_splits=16)]
    for blocks in contiguous_variants[: 1 if interpret else (2 if quick else None)]:
        fn = jax.jit(functools.partial(pk.decode_attention, block_sizes=blocks,
                                       interpret=interpret))
        guarded(f"contiguous {tiles(blocks)}", measure, "ours contiguous", fn,
                (q, k, v, lengths), None, tiles(blocks), blocks == pk.DecodeBlockSizes())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
    for page in pages:
        kp, bt = layout(k, lengths_np, page, seed=page)
        vp, _ = layout(v, lengths_np, page, seed=page)
        variants = our_variants(page, quick)[: 2 if interpret else None]
        for blocks in variants:
            fn = jax.jit(functools.partial(pk.paged_decode_attention, block_sizes=blocks,
                                           interpret=interpret))
            guarded(f"paged p{page} {tiles(blocks)}", measure, "ours paged", fn,
                    (q, kp, vp, bt, lengths), page, tiles(blocks),
                    blocks == pk.DecodeBlockSizes())
        if page in (16, 64):  # the bundled kernel's layout: [Hkv, P, page, D]
            kj, vj = kp.transpose(2, 0, 1, 3), vp.transpose(2, 0, 1, 3)
            del kp, vp
            # It applies no 1/sqrt(D): the query comes pre-scaled (as a model would fold it)
            q_scaled = (q.astype(jnp.float32) * D ** -0.5).astype(q.dtype)
            for i, tiling in enumerate(jax_variants(page, s // page, quick)
                                       [: 1 if interpret else None]):
                fn = jax.jit(functools.partial(jax_paged.paged_attention, interpret=interpret,
                                               **tiling))
                label = (f"ppcb{tiling['pages_per_compute_block']} "
                         f"ksplits{tiling['k_splits']} w{tiling['num_warps']} "
                         f"st{tiling['num_stages']}")
                guarded(f"jax paged p{page} {label}", measure, "jax paged", fn,
                        (q_scaled, kj, vj, bt, lengths), page, label, i == 0)
            del kj, vj
        else:
            del kp, vp


def time_loop(call, args, state, iters: int, repeats: int, n: int) -> float:
    """Median seconds per call of call(*args, *state) -> (out, *state'), n calls chained in
    one jitted loop: the state (pools written in place) carried and donated, each call's first
    argument linked to the previous output (+ 0 x a scalar of it) so that none is elided."""
    def many(state, *args):
        def body(_, carry):
            state, link = carry
            first = args[0] + (0 * link).astype(args[0].dtype)
            out, *state = call(first, *args[1:], *state)
            return tuple(state), out[0, 0, 0].astype(jnp.float32)
        return jax.lax.fori_loop(0, n, body, (tuple(state), jnp.float32(0)))

    fn = jax.jit(many, donate_argnums=(0,))
    state, link = fn(tuple(state), *args)  # compile + warm up
    jax.block_until_ready(link)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            state, link = fn(state, *args)
        jax.block_until_ready(link)
        runs.append((time.perf_counter() - t0) / (iters * n))
    return statistics.median(runs)


def bench_append(quick: bool, interpret: bool, pages=(16, 64)) -> None:
    """B 64, context 2048 (the new token at 2047): the fused paged append vs the paged decode
    kernel alone (K/V already written) and the contiguous append, each chained 16 times in
    one jitted loop (the pools carried and donated: written in place)."""
    b, ctx = (64, 2048) if not interpret else (2, 64)
    name = f"B{b} ctx {ctx} H{HQ}/{HKV} D{D} bf16"
    kv_bytes = b * ctx * HKV * D * 2 * 2
    n = 1 if interpret else 16
    iters = 1 if interpret else max(3, iters_for(kv_bytes / 3e12) // n)
    repeats = 1 if interpret else 5
    keys = jax.random.split(jax.random.PRNGKey(2), 3)
    qkv = jax.random.normal(keys[0], (b, HKV, HQ // HKV + 2, D)).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, ctx, HKV, D)).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, ctx, HKV, D)).astype(jnp.bfloat16)
    positions = jnp.full((b,), ctx - 1, jnp.int32)
    lengths = positions + 1
    inv = 1.0 / 500000.0 ** (jnp.arange(0, D, 2) / D)
    f = (ctx - 1) * inv
    rope = tuple(jnp.broadcast_to(jnp.concatenate([t(f), t(f)]), (b, D)).astype(jnp.float32)
                 for t in (jnp.cos, jnp.sin))
    q = qkv[:, :, :HQ // HKV].reshape(b, HQ, D)  # the decode kernel's query (unrotated)
    want_append = pk.decode_attention_append_reference(qkv, k, v, positions, rope=rope)[0]
    want_decode = pk.decode_attention_reference(q, k, v, lengths)
    emit(dict(part="shape", case="append", shape=name, kv_bytes=kv_bytes))

    def measure(impl, call, args, state, want, page=None):
        err = rel_err(jax.jit(call)(*args, *state)[0], want)
        secs = time_loop(call, args, [jnp.copy(x) for x in state], iters, repeats, n)
        tbs = kv_bytes / secs / 1e12
        return emit(dict(part="time", case="append", shape=name, impl=impl, page=page,
                         tiling="default", default=True, ms=secs * 1e3, tbs=tbs,
                         frac_4_27=tbs / PEAK_TBS, err=err, ok=bool(err < TOL_BF16)))

    def contiguous(qkv, positions, k, v):
        return pk.decode_attention_append(qkv, k, v, positions, rope=rope, interpret=interpret)

    guarded("append contiguous", measure, "ours contiguous append", contiguous,
            (qkv, positions), (k, v), want_append)
    for page in pages:
        kp, bt = layout(k, np.asarray(lengths), page, seed=page)
        vp, _ = layout(v, np.asarray(lengths), page, seed=page)

        def paged(qkv, bt, positions, kp, vp):
            return pk.paged_decode_attention_append(qkv, kp, vp, bt, positions, rope=rope,
                                                    interpret=interpret)

        def decode(q, bt, lengths, kp, vp):  # nothing written: the pools come back as given
            return pk.paged_decode_attention(q, kp, vp, bt, lengths, interpret=interpret), kp, vp

        guarded(f"append paged p{page}", measure, "ours paged append", paged,
                (qkv, bt, positions), (kp, vp), want_append, page)
        guarded(f"decode paged p{page}", measure, "ours paged decode", decode,
                (q, bt, lengths), (kp, vp), want_decode, page)
        del kp, vp


def table(rows: list[dict]) -> str:
    lines = ["| case | impl | page | tiling | ms | TB/s | of 4.27 | err |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("part") == "time":
            err = "" if r["err"] is None else f"{r['err']:.1e}"
            lines.append(f"| {r['case']} | {r['impl']}{' (default)' if r['default'] else ''} "
                         f"| {r['page'] or '-'} | {r['tiling']} | {r['ms']:.4f} | "
                         f"{r['tbs']:.3f} | {r['frac_4_27']:.1%} | "
                         f"{err}{'' if r['ok'] else ' BAD'} |")
    lines.append("")
    timed = [r for r in rows if r.get("part") == "time" and r["ok"]]
    for case in dict.fromkeys(r["case"] for r in timed):
        groups = {}
        for r in timed:
            if r["case"] == case:
                groups.setdefault((r["impl"], r["page"]), []).append(r)
        for (impl, page), rs in groups.items():
            best = min(rs, key=lambda r: r["ms"])
            default = next((r for r in rs if r["default"]), None)
            line = (f"{case} {impl}{f' page {page}' if page else ''}: best {best['tbs']:.3f} "
                    f"TB/s {best['ms']:.3f} ms ({best['tiling']})")
            if default is not None and default is not best:
                line += f"; default {default['tbs']:.3f} TB/s {default['ms']:.3f} ms"
            lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the JSON lines to this file")
    ap.add_argument("--quick", action="store_true",
                    help="fewer tilings; on a CPU a tiny shape in interpret mode")
    ap.add_argument("--skip", default="", help="comma list of anchor, append")
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    interpret = dev.platform != "gpu"
    if interpret and not args.quick:
        print("no GPU: run with --quick (interpret mode, a tiny shape)")
        return 1
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}", flush=True)
    t0 = time.time()
    skip = set(filter(None, args.skip.split(",")))
    pages = (16, 64) if interpret else (16, 32, 64)
    for part, fn in (("anchor", functools.partial(bench_anchor, pages=pages)),
                     ("append", bench_append)):
        if part in skip:
            continue
        guarded(part, fn, args.quick, interpret)
        print(f"[{part} done at {time.time() - t0:.0f}s]", flush=True)
        if args.json:  # after each part, so a run cut short still leaves its numbers
            with open(args.json, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in RESULTS)
    print("\n" + table(RESULTS))
    bad = [r for r in RESULTS if r.get("part") == "time" and not r["ok"]]
    failed = [r for r in RESULTS if "failed" in r]
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
