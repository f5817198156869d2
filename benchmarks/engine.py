"""The serving engine on the H200, each figure beside its comparison in the same run.

    PYTHONPATH=. python3 benchmarks/engine.py --preset llama3-8b --parts decode,trace,prefix,det

- decode: a steady decode batch of 64 rows at 2k context through the engine (ms per engine
  step, host included: step n + 1 is dispatched before step n is read) against generate's
  contiguous batch-64 step (jaxinfer bench's device loop, and the same step dispatched from
  Python), same model, same run.
- trace: a Poisson trace (jaxinfer/engine/bench.py) through the engine and through static
  batches of 64 of generate: throughput, TTFT / TPOT p50 / p99, pages, hit rate.
- prefix: time to first token behind a 2,000-token shared system prompt, prefix caching on
  and off.
- det: KernelPolicy.deterministic(): `--det-rows` requests served together (arriving over
  several steps, prompts split into chunks) against each served alone: tokens and logprobs
  compared bitwise; and their tokens against generate() alone.
- spec_det: speculative decoding under KernelPolicy.deterministic(): n-gram speculative
  `generate` (greedy and coupled-sampled rows, K = --spec-k) against plain `generate`, tokens
  and logprobs compared bitwise, at batch 1 and 8, and the engine's speculative rows against
  the same plain rows; then the wall time of plain and speculative `generate` under that policy
  against the default policy (the mode's cost), same prompts, compiles excluded.
Random weights of the preset's real shapes, bf16. A table of every figure is printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import jax
import numpy as np

from jaxinfer import bench
from jaxinfer.engine import Engine
from jaxinfer.engine import bench as engine_bench
from jaxinfer.generate import generate
from jaxinfer.plan import KernelPolicy
from jaxinfer.sampling import SamplingParams

ROWS = []


def row(part: str, what: str, value: str, **extra):
    ROWS.append((part, what, value))
    print(json.dumps({"part": part, "what": what, "value": value, **extra}), flush=True)


def part_decode(model, args, kw):
    base = None
    if not args.no_ref:
        ref = bench.run(model, args.preset, 64, 2048, 64, repeats=2)
        base = ref.decode_ms_per_token
        row("decode", "generate B=64 ctx 2048 (device loop)", f"{base:.3f} ms/step",
            floor=ref.floor_fraction)
        host = ref.decode_ms_per_token + ref.host_overhead_ms_per_step
        row("decode", "generate B=64 (steps from Python)", f"{host:.3f} ms/step")
    kw = {**kw, "max_num_seqs": 64}
    for k in args.decode_steps:
        engine = Engine(model, **kw, decode_steps=k)
        engine.warmup()
        t0 = time.perf_counter()
        dt = engine_bench.steady_decode(engine, 64, 2048, steps=max(8, 32 // k))
        per_token = dt / k * 1e3
        versus = f" ({per_token / base:.3f}x generate's)" if base else ""
        row("decode", f"engine B=64 ctx 2048, {k} step(s)/dispatch",
            f"{per_token:.3f} ms/token{versus}", wall_s=time.perf_counter() - t0)
        del engine
        gc.collect()


def part_trace(model, args, kw):
    engine = Engine(model, **kw)
    trace = engine_bench.make_trace(model.config.vocab_size, args.requests, args.rate,
                                    shared_len=512)
    t0 = time.perf_counter()
    shapes = engine.warmup()  # compiles first, so the timed trace measures serving
    row("trace", f"engine warm-up ({shapes} executables, {engine.max_num_seqs} rows)",
        f"{time.perf_counter() - t0:.1f} s")
    r = engine_bench.serve_trace(engine, trace, progress=False)
    row("trace", f"engine, {args.requests} requests at {args.rate}/s",
        f"{r['tokens_per_s']:.0f} tok/s; TTFT p50 {r['ttft_p50_s']:.3f} s p99 "
        f"{r['ttft_p99_s']:.3f} s; TPOT p50 {r['tpot_p50_ms']:.1f} ms p99 {r['tpot_p99_ms']:.1f} ms;"
        f" peak pages {r['peak_pages_in_use']}/{r['total_pages']}; hit rate "
        f"{r['prefix_hit_rate']:.1%}; preemptions {r['preemptions']}", **r)
    del engine
    gc.collect()
    s = engine_bench.static_batches(model, trace, 64, progress=False)
    row("trace", "static batches of 64 (generate)",
        f"{s['tokens_per_s']:.0f} tok/s; TTFT p50 {s['ttft_p50_s']:.3f} s p99 "
        f"{s['ttft_p99_s']:.3f} s; engine / static = {r['tokens_per_s'] / s['tokens_per_s']:.2f}x",
        **s)


def part_prefix(model, args, kw):
    r = engine_bench.shared_prefix_ttft(lambda **k: Engine(model, **{**kw, **k}),
                                        model.config.vocab_size)
    row("prefix", "TTFT, 2000-token shared system prompt + 64 tokens",
        f"caching on {r['on']['ttft_p50_s'] * 1e3:.1f} ms (hit {r['on']['hit_rate']:.1%}), "
        f"off {r['off']['ttft_p50_s'] * 1e3:.1f} ms")


def part_det(model, args, kw):
    policy = KernelPolicy.deterministic()
    rng = np.random.default_rng(5)
    n, new = args.det_rows, args.det_tokens
    prompts = [rng.integers(0, model.config.vocab_size, int(rng.integers(16, 700))).tolist()
               for _ in range(n)]
    shared = prompts[0][:256]
    prompts = [shared + p if i % 4 == 0 else p for i, p in enumerate(prompts)]
    sps = [SamplingParams(temperature=0.0, logprobs=True) if i % 2 else
           SamplingParams(temperature=0.8, top_p=0.9, seed=i, logprobs=True) for i in range(n)]
    engine = Engine(model, **{**kw, "max_num_seqs": 64}, policy=policy)
    engine.warmup(sps[:2])
    t0 = time.perf_counter()
    ids = {}
    got = {}
    order = list(range(n))
    while order or engine.has_unfinished():
        for i in order[:8]:
            ids[engine.add_request(prompts[i], sampling=sps[i], max_tokens=new)] = i
        order = order[8:]
        for o in engine.step():
            t, lp = got.setdefault(ids[o.request_id], ([], []))
            t += o.new_token_ids
            lp += o.new_logprobs or []
    together_s = time.perf_counter() - t0
    alone = {}
    for i in range(args.det_alone):
        engine.reset_prefix_cache()
        (c,) = engine.run([prompts[i]], sampling=sps[i], max_tokens=new)
        alone[i] = (c.token_ids, c.logprobs)
    same = sum(alone[i][0] == got[i][0] and alone[i][1] == got[i][1] for i in alone)
    kinds = {i: ("greedy" if sps[i].greedy else "sampled") + (
        ":tokens" if alone[i][0] == got[i][0] else ":TOKENS-DIFFER") + (
        ":logprobs" if alone[i][1] == got[i][1] else ":LOGPROBS-DIFFER") for i in alone}
    row("det", f"engine {n} rows vs each alone (bitwise tokens + logprobs)",
        f"{same}/{len(alone)} equal", together_s=together_s, rows=kinds)
    del engine
    gc.collect()
    ref = generate(model, prompts[:args.det_alone], max_new_tokens=new,
                   sampling=sps[:args.det_alone], policy=policy)
    tok = sum(ref[i].token_ids == got[i][0] for i in range(args.det_alone))
    lpb = sum(ref[i].logprobs == got[i][1] for i in range(args.det_alone))
    row("det", "engine rows vs generate (deterministic), tokens / bitwise logprobs",
        f"{tok}/{args.det_alone} tokens, {lpb}/{args.det_alone} logprobs")


def part_spec_det(model, args, kw):
    det = KernelPolicy.deterministic()
    rng = np.random.default_rng(7)
    new = args.det_tokens
    # Prompts that repeat a random span: prompt lookup finds drafts; random weights decide.
    prompts = []
    for _ in range(8):
        span = rng.integers(0, model.config.vocab_size, int(rng.integers(8, 40))).tolist()
        prompts.append(span * int(rng.integers(3, 12)))
    sps = [SamplingParams(temperature=0.0, logprobs=True) if i % 2 == 0 else
           SamplingParams(temperature=0.8, top_p=0.9, seed=i, logprobs=True) for i in range(8)]
    spec = dict(speculative="ngram", num_speculative_tokens=args.spec_k)

    def run(batch, policy, **extra):
        out = []
        for i in range(0, 8, batch):
            out += generate(model, prompts[i:i + batch], max_new_tokens=new,
                            sampling=sps[i:i + batch], policy=policy, chat=False, **extra)
        return out

    plain = {}
    for batch in (1, 8):
        plain[batch] = run(batch, det)
        got = run(batch, det, **spec)
        same = [(g.token_ids, g.logprobs) == (p.token_ids, p.logprobs)
                for g, p in zip(got, plain[batch])]
        acc = sum(g.accepted_tokens for g in got)
        drafted = sum(g.draft_tokens for g in got)
        row("spec_det", f"ngram K={args.spec_k} speculative vs plain generate, batch {batch} "
            "(bitwise tokens + logprobs; greedy rows 0,2,4,6, sampled 1,3,5,7)",
            f"{sum(same)}/8 equal; {acc}/{drafted} drafts accepted",
            rows=["equal" if e else "DIFFER" for e in same])
    engine = Engine(model, **{**kw, "max_num_seqs": 8}, policy=det, **spec)
    got = {}
    ids = {engine.add_request(p, sampling=sp, max_tokens=new): i
           for i, (p, sp) in enumerate(zip(prompts, sps))}
    while engine.has_unfinished():
        for o in engine.step():
            t, lp = got.setdefault(ids[o.request_id], ([], []))
            t += o.new_token_ids
            lp += o.new_logprobs or []
    same = sum(got[i] == (plain[8][i].token_ids, plain[8][i].logprobs) for i in range(8))
    row("spec_det", "engine, ngram speculative, 8 rows together vs plain generate (bitwise)",
        f"{same}/8 equal")
    del engine
    gc.collect()
    # The mode's cost: wall time per generated token, second call of each (compiled).
    for batch in (1, 8):
        times = {}
        for name, policy, extra in (("default plain", None, {}), ("det plain", det, {}),
                                    ("default spec", None, spec), ("det spec", det, spec)):
            run(batch, policy, **extra)
            t0 = time.perf_counter()
            run(batch, policy, **extra)
            times[name] = (time.perf_counter() - t0) / (8 * new) * 1e3
        row("spec_det", f"ms per generated token, batch {batch}: default plain / det plain / "
            "default spec / det spec",
            " / ".join(f"{v:.2f}" for v in times.values()),
            det_cost_plain=times["det plain"] / times["default plain"],
            det_cost_spec=times["det spec"] / times["default spec"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--parts", default="decode,trace,prefix,det")
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--rate", type=float, default=24.0)
    p.add_argument("--decode-steps", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 4])
    p.add_argument("--kv-memory", default="40GB")
    p.add_argument("--det-rows", type=int, default=64)
    p.add_argument("--det-tokens", type=int, default=32)
    p.add_argument("--det-alone", type=int, default=8)
    p.add_argument("--spec-k", type=int, default=4, help="spec_det: drafts per round")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64, help="the engine's rows (trace)")
    p.add_argument("--no-ref", action="store_true", help="decode: skip generate's figure")
    args = p.parse_args()
    from jaxinfer import compilation_cache

    compilation_cache.enable()  # a later call on the same machine reuses the compiles
    model = bench.random_model(args.preset, "bfloat16", num_layers=args.num_layers)
    kw = dict(max_num_seqs=args.max_num_seqs, kv_memory=args.kv_memory)
    print(f"device: {jax.devices()[0].device_kind}", flush=True)
    for part in args.parts.split(","):
        t0 = time.perf_counter()
        globals()[f"part_{part}"](model, args, kw)
        print(f"# part {part}: {time.perf_counter() - t0:.1f} s", flush=True)
    print("\n| part | what | figure |\n| --- | --- | --- |")
    for part, what, value in ROWS:
        print(f"| {part} | {what} | {value} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
