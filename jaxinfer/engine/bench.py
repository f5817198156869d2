"""`jaxinfer bench --engine`: a synthetic serving trace through the engine, against static
batches of `generate` over the same requests.

The trace: `requests` requests arriving as a Poisson process of `rate` per second, prompt and
output lengths drawn uniformly from the given ranges, a `shared_fraction` of them starting
with one shared system prompt of `shared_len` tokens. Reported: output tokens per second,
time to first token and time per output token (p50, p99), the most pages in use, the prefix
cache's hit rate; and the same requests through static batches of `batch` prompts of
`generate` (each batch waits for its longest request), with the speed-up.
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxinfer.engine.engine import Engine
from jaxinfer.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Trace:
    prompts: list[list[int]]
    max_tokens: list[int]
    arrivals: list[float]  # seconds from the start


def make_trace(vocab: int, requests: int = 512, rate: float = 16.0,
               prompt_len: tuple[int, int] = (32, 1024), output_len: tuple[int, int] = (16, 512),
               shared_fraction: float = 0.3, shared_len: int = 512, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, shared_len).tolist()
    prompts, outs = [], []
    for _ in range(requests):
        prompt = rng.integers(0, vocab, int(rng.integers(*prompt_len, endpoint=True))).tolist()
        if rng.random() < shared_fraction:
            prompt = shared + prompt
        prompts.append(prompt)
        outs.append(int(rng.integers(*output_len, endpoint=True)))
    arrivals = np.cumsum(rng.exponential(1.0 / rate, requests)).tolist()
    return Trace(prompts, outs, arrivals)


def _pct(xs, q) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def serve_trace(engine: Engine, trace: Trace, progress: bool = True) -> dict:
    """Replay the trace in real time through the engine; per-request TTFT and TPOT."""
    greedy = SamplingParams(temperature=0.0)
    start = time.perf_counter()
    arrival, first, last, count = {}, {}, {}, {}
    nxt, peak_pages = 0, 0
    n = len(trace.prompts)
    hits0, queries0 = engine.pool.hits, engine.pool.queries
    with tqdm(total=n, desc="trace", disable=not progress, leave=False) as bar:
        while nxt < n or engine.has_unfinished():
            now = time.perf_counter() - start
            while nxt < n and trace.arrivals[nxt] <= now:
                rid = engine.add_request(trace.prompts[nxt], sampling=greedy,
                                         max_tokens=trace.max_tokens[nxt],
                                         request_id=f"t{nxt}")
                arrival[rid] = start + trace.arrivals[nxt]
                nxt += 1
            if not engine.has_unfinished():
                time.sleep(min(0.01, max(0.0, trace.arrivals[nxt] - now)))
                continue
            outs = engine.step()
            t = time.perf_counter()
            peak_pages = max(peak_pages, engine.pool.in_use)
            for o in outs:
                first.setdefault(o.request_id, t)
                last[o.request_id] = t
                count[o.request_id] = count.get(o.request_id, 0) + len(o.new_token_ids)
                if o.finished:
                    bar.update(1)
    elapsed = time.perf_counter() - start
    ttft = [first[r] - arrival[r] for r in first]
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in first if count[r] > 1]
    tokens = sum(count.values())
    queries = engine.pool.queries - queries0
    return {"requests": n, "output_tokens": tokens, "elapsed_s": elapsed,
            "tokens_per_s": tokens / elapsed, "requests_per_s": n / elapsed,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "tpot_p50_ms": 1e3 * _pct(tpot, 50), "tpot_p99_ms": 1e3 * _pct(tpot, 99),
            "peak_pages_in_use": peak_pages, "total_pages": engine.total_pages,
            "prefix_hit_rate": (engine.pool.hits - hits0) / queries if queries else 0.0,
            "preemptions": engine.stats["preemptions"]}


def static_batches(model, trace: Trace, batch: int, progress: bool = True) -> dict:
    """The same requests in arrival order through generate(), `batch` at a time, each batch
    started once its last request has arrived and the previous batch is done."""
    from jaxinfer.generate import generate

    start = time.perf_counter()
    tokens, ttft = 0, []
    n = len(trace.prompts)
    for i in tqdm(range(0, n, batch), desc="static", disable=not progress, leave=False):
        wait = trace.arrivals[min(i + batch, n) - 1] - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        outs = generate(model, trace.prompts[i:i + batch],
                        max_new_tokens=max(trace.max_tokens[i:i + batch]))
        done = time.perf_counter() - start
        for j, o in enumerate(outs):
            tokens += min(len(o.token_ids), trace.max_tokens[i + j])
            ttft.append(done - trace.arrivals[i + j])  # tokens arrive with the batch
    elapsed = time.perf_counter() - start
    return {"requests": n, "output_tokens": tokens, "elapsed_s": elapsed,
            "tokens_per_s": tokens / elapsed, "ttft_p50_s": _pct(ttft, 50),
            "ttft_p99_s": _pct(ttft, 99)}


def shared_prefix_ttft(engine_factory, vocab: int, system_len: int = 2000,
                       user_len: int = 64, requests: int = 8, seed: int = 1,
                       max_model_len: int | None = None) -> dict:
    """Time to first token of requests sharing a system prompt, one at a time, with prefix
    caching on and off (the first request warms the cache and the compiles; the rest are
    timed). A model of a shorter context (max_model_len) gets a system prompt of 3/4 of it."""
    if max_model_len is not None and system_len + user_len + 1 > max_model_len:
        system_len = max_model_len * 3 // 4
        user_len = max(1, min(user_len, max_model_len - system_len - 1))
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, system_len).tolist()
    prompts = [system + rng.integers(0, vocab, user_len).tolist() for _ in range(requests + 1)]
    out = {}
    for caching in (True, False):
        engine = engine_factory(prefix_caching=caching)
        times = []
        for i, p in enumerate(prompts):
            t0 = time.perf_counter()
            rid = engine.add_request(p, max_tokens=1)
            got = False
            while not got:
                got = any(o.request_id == rid and o.new_token_ids for o in engine.step())
            if i:
                times.append(time.perf_counter() - t0)
            while engine.has_unfinished():
                engine.step()
        out["on" if caching else "off"] = {"ttft_p50_s": _pct(times, 50),
                                           "hit_rate": engine.prefix_cache_hit_rate()}
        del engine  # its pages go before the next engine takes its own
    out["system_len"] = system_len
    return out


def steady_decode(engine: Engine, batch: int, context: int, steps: int = 32) -> float:
    """Seconds per engine step once `batch` requests of `context` prompt tokens all decode."""
    rng = np.random.default_rng(2)
    vocab = engine.model.config.vocab_size
    for _ in range(batch):
        engine.add_request(rng.integers(0, vocab, context).tolist(), max_tokens=steps * 4 + 8)
    while any(r.prefilling or r.scheduled == 0 for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    for _ in range(4):
        engine.step()
    jax.block_until_ready(engine.state.last_token)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    jax.block_until_ready(engine.state.last_token)
    dt = (time.perf_counter() - t0) / steps
    for rid in list(engine.requests):
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return dt


def main(args, model, name: str) -> int:
    """The --engine report (see the module docstring)."""
    vocab = model.config.vocab_size
    kw = dict(max_num_seqs=args.batch[0] if args.batch != [1] else None,
              decode_steps=args.decode_steps)
    if args.kv_memory is not None:
        kw["kv_memory"] = args.kv_memory
    results = {"model": name, "backend": jax.default_backend()}
    engine = Engine(model, **kw)
    t0 = time.perf_counter()
    engine.warmup(progress=True)  # every shape compiled before the timed trace
    results["engine"] = {"max_num_seqs": engine.max_num_seqs, "page_size": engine.page_size,
                         "total_pages": engine.total_pages, "decode_steps": engine.decode_steps,
                         "warmup_s": time.perf_counter() - t0}
    trace = make_trace(vocab, args.requests, args.rate, tuple(args.prompt_lens),
                       tuple(args.output_lens), args.shared_fraction, args.shared_len)
    results["trace"] = serve_trace(engine, trace)
    print(json.dumps({"trace": results["trace"]}), flush=True)
    if not args.no_static:
        results["static"] = static_batches(model, trace, engine.max_num_seqs)
        results["speedup"] = results["trace"]["tokens_per_s"] / results["static"]["tokens_per_s"]
        print(json.dumps({"static": results["static"]}), flush=True)
    max_model_len = engine.max_model_len
    del engine  # its pages go before the prefix runs' engines take their own
    results["shared_prefix"] = shared_prefix_ttft(
        lambda **k: Engine(model, **{**kw, **k}), vocab, max_model_len=max_model_len)
    for line in report_lines(results):
        print(line)
    if args.json:
        print(json.dumps(results))
    return 0


def report_lines(r: dict) -> list[str]:
    t = r["trace"]
    lines = [f"engine trace ({r['model']}, {r['backend']}): {t['requests']} requests, "
             f"{t['output_tokens']} output tokens in {t['elapsed_s']:.1f} s = "
             f"{t['tokens_per_s']:.1f} tok/s; TTFT p50 {t['ttft_p50_s']:.3f} s p99 "
             f"{t['ttft_p99_s']:.3f} s; TPOT p50 {t['tpot_p50_ms']:.1f} ms p99 "
             f"{t['tpot_p99_ms']:.1f} ms; peak pages {t['peak_pages_in_use']}/"
             f"{t['total_pages']}; prefix hit rate {t['prefix_hit_rate']:.1%}; "
             f"preemptions {t['preemptions']}"]
    if "static" in r:
        s = r["static"]
        lines.append(f"static batches of generate: {s['tokens_per_s']:.1f} tok/s, TTFT p50 "
                     f"{s['ttft_p50_s']:.3f} s p99 {s['ttft_p99_s']:.3f} s; engine / static = "
                     f"{r['speedup']:.2f}x")
    sp = r["shared_prefix"]
    lines.append(f"TTFT with a {sp['system_len']}-token shared system prompt: prefix caching on "
                 f"{sp['on']['ttft_p50_s']:.3f} s (hit rate {sp['on']['hit_rate']:.1%}), off "
                 f"{sp['off']['ttft_p50_s']:.3f} s")
    return lines
