"""A bounded load test of `jaxinfer serve` on loopback, with the official async `openai` client.

`--clients` concurrent clients (default 64) send streaming requests for `--duration` seconds
(default 60), each starting its next request when the last ends. Of the requests, a
`--disconnect-fraction` (default 10%) drop the connection after a token or three and a
`--malformed-fraction` (default 5%) are malformed (bad JSON, an unknown model, out-of-range
values, an empty message list, a wrong type), which must get an OpenAI error body with a 4xx;
every other request must stream to `[DONE]` with its usage. At the end the server's
`jaxinfer_pages_in_use` must return to zero. Reported: failed well-formed requests (and why),
wrong answers to malformed ones, throughput, time to first token and time per output token
(p50 / p99), as a table and with `--json` one JSON line. Exit 0 when both invariants hold.

    PYTHONPATH=. python3 benchmarks/serve_load.py --clients 16 --duration 20 -- \\
        --max-num-seqs 16 --max-model-len 512            # starts `jaxinfer serve ARGS` itself
    PYTHONPATH=. python3 benchmarks/serve_load.py --url http://127.0.0.1:8000 --model NAME
    PYTHONPATH=. python3 benchmarks/serve_load.py --token-ids --engine-trace -- \\
        --preset llama3-8b --random-weights --max-num-seqs 64     # the H200 run

`--token-ids`: random token-id prompts through `/v1/completions` (for `--random-weights`
models, which have no tokenizer); otherwise chat questions through `/v1/chat/completions`.
`--engine-trace` (with a server it started): after the server stops, the requests that
completed are served again in this process directly through the `Engine` the same `serve`
arguments build, at the same concurrency (a request added as one finishes), greedy as over
HTTP, and the two throughputs are compared (the goal: the server within 10% of the engine).
For a clean comparison run it with `--disconnect-fraction 0 --malformed-fraction 0`: the
engine replays only the completed requests. `--warmup S` first runs S seconds of the same load
untimed (and the engine replays those requests untimed), so compiles stay out of the figures.

Only loopback addresses are accepted as targets; the run is bounded by `--duration` plus a
drain of at most `--drain-timeout` seconds.

`--client-procs N` spreads the clients over N processes (default: one per 16 clients, at most
half the cores). The official client parses every streamed chunk into pydantic objects: one
process spent ~0.3 s of CPU per 1k tokens here, so at thousands of tokens a second a single
client process, not the server, set the pace (its own queueing showed up as the server's time
to first token). `client_cpu_ms_per_1k_tokens` reports what the clients spent.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import ipaddress
import json
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse

import httpx
import numpy as np
import openai

QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "Why is the sky blue?", "Write a haiku about the sea.",
             "What is 7 times 8?", "Give me a tip for learning to cook.",
             "What is the largest planet in the solar system?", "Tell me a short story."]

MALFORMED = [  # (body, what it is); each must get a 4xx with an OpenAI error body
    (b"{not json", "invalid JSON"),
    (b'{"model": "no-such-model", "prompt": [1, 2], "max_tokens": 4}', "unknown model"),
    (b'{"model": "%(model)s", "prompt": [1, 2], "max_tokens": 4, "temperature": 7}',
     "temperature out of range"),
    (b'{"model": "%(model)s", "messages": []}', "empty messages"),
    (b'{"model": "%(model)s", "prompt": [1, 2], "max_tokens": "many"}', "max_tokens a string"),
    (b'{"model": "%(model)s", "prompt": [1, 2], "max_tokens": -3}', "max_tokens negative"),
    (b'[1, 2, 3]', "a list, not an object"),
]


@dataclasses.dataclass
class Request:
    kind: str  # "ok" | "disconnect" | "malformed"
    prompt: object  # token ids, or chat messages
    max_tokens: int
    start: float = 0.0
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    error: str | None = None
    warmup: bool = False


def _pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def _is_loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------
# The clients
# ---------------------------------------------------------------------------------------------


class Load:
    def __init__(self, args, url: str, model: str):
        self.args, self.url, self.model = args, url, model
        self.rng = random.Random(args.seed)
        self.requests: list[Request] = []
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=args.api_key or "none",
                                         timeout=args.request_timeout, max_retries=0)
        self.raw = httpx.AsyncClient(base_url=url, timeout=30, headers={
            "Authorization": f"Bearer {args.api_key or 'none'}",
            "Content-Type": "application/json"})

    def draw(self) -> Request:
        a, rng = self.args, self.rng
        i = self.drawn = getattr(self, "drawn", -1) + 1

        def every(fraction):  # exactly `fraction` of the requests, evenly spread
            return int((i + 1) * fraction) > int(i * fraction)

        kind = "malformed" if every(a.malformed_fraction) else \
            "disconnect" if every(a.disconnect_fraction) else "ok"
        max_tokens = rng.randint(*a.output_lens)
        if a.token_ids:
            prompt = [rng.randrange(10, a.vocab) for _ in range(rng.randint(*a.prompt_lens))]
        else:
            prompt = [{"role": "user", "content": rng.choice(QUESTIONS)}]
        return Request(kind, prompt, max_tokens)

    async def one(self, r: Request) -> None:
        r.start = time.perf_counter()
        try:
            if r.kind == "malformed":
                await self.malformed(r)
            else:
                await self.stream(r)
        except Exception as e:  # noqa: BLE001 - every failure is counted, with its reason
            r.error = f"{type(e).__name__}: {e}"[:300]
        r.end = time.perf_counter()

    async def stream(self, r: Request) -> None:
        common = dict(model=self.model, max_tokens=r.max_tokens, temperature=0, stream=True,
                      stream_options={"include_usage": True})
        if self.args.token_ids:
            stream = await self.client.completions.create(prompt=r.prompt, **common)
        else:
            stream = await self.client.chat.completions.create(messages=r.prompt, **common)
        leave_after = self.rng.randint(1, 3) if r.kind == "disconnect" else None
        chunks, usage = 0, None
        async with stream:  # leaving early closes the connection: the server aborts
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                if not chunk.choices:
                    continue
                c = chunk.choices[0]
                piece = c.text if self.args.token_ids else (c.delta.content or "")
                if piece or c.finish_reason:  # (a lone stop token shows no text)
                    if r.first is None:
                        r.first = time.perf_counter()
                    chunks += 1
                    if leave_after is not None and chunks >= leave_after:
                        return
        if r.kind == "ok":
            if usage is None:
                raise RuntimeError("the stream ended without its usage chunk")
            r.tokens = usage.completion_tokens
            if r.tokens < 1 or r.first is None:
                raise RuntimeError(f"no token and no finish reason came ({usage})")

    async def malformed(self, r: Request) -> None:
        body, what = self.rng.choice(MALFORMED)
        body = body.replace(b"%(model)s", self.model.encode())
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        resp = await self.raw.post(path, content=body)
        try:
            err = resp.json()["error"]
            well_formed = set(err) >= {"message", "type", "param", "code"}
        except (ValueError, KeyError, TypeError):
            well_formed = False
        if not (400 <= resp.status_code < 500 and well_formed):
            raise RuntimeError(f"{what}: {resp.status_code} {resp.text[:200]}")

    async def client_loop(self, until: float, warmup: bool) -> None:
        while time.time() < until:  # wall-clock deadlines: the same in every client process
            r = self.draw()
            r.warmup = warmup
            self.requests.append(r)
            await self.one(r)

    async def run(self, seconds: float, warmup: bool = False, clients: int | None = None
                  ) -> float:
        start = time.time()
        until = start + seconds
        await asyncio.gather(*(self.client_loop(until, warmup)
                               for _ in range(clients or self.args.clients)))
        return time.time() - start

    async def metric(self, name: str) -> float:
        text = (await self.raw.get("/metrics")).text
        value = next((line.split()[1] for line in text.splitlines()
                      if line.startswith(name + " ")), None)
        if value is None:  # (a StopIteration would end the coroutine as a RuntimeError)
            raise ValueError(f"the server's /metrics has no {name}")
        return float(value)

    async def pages_in_use(self) -> float:
        return await self.metric("jaxinfer_pages_in_use")

    async def wait_pages_zero(self, wait: float) -> float:
        deadline = time.perf_counter() + wait
        while True:
            pages = await self.pages_in_use()
            if pages == 0 or time.perf_counter() > deadline:
                return pages
            await asyncio.sleep(0.2)


CPU_METRICS = {"engine_thread": "jaxinfer_engine_thread_cpu_seconds",
               "engine_process": "jaxinfer_engine_process_cpu_seconds",
               "event_loop": "jaxinfer_event_loop_cpu_seconds"}


async def server_cpu(load: "Load") -> dict[str, float]:
    """CPU seconds so far of the server's engine thread, its whole engine process and its
    API process's event loop (from its /metrics)."""
    out = {}
    for name, metric in CPU_METRICS.items():
        with contextlib.suppress(ValueError, httpx.HTTPError):
            out[name] = await load.metric(metric)
    return out


def summarize(reqs: list[Request], elapsed: float) -> dict:
    ok = [r for r in reqs if r.kind == "ok"]
    good = [r for r in ok if r.error is None]
    tokens = sum(r.tokens for r in good)
    ttft = [r.first - r.start for r in good]
    tpot = [(r.end - r.first) / (r.tokens - 1) for r in good if r.tokens > 1]
    failures = [r.error for r in ok if r.error is not None]
    return {
        "requests": len(reqs), "well_formed": len(ok), "completed": len(good),
        "failed": len(failures), "failures": sorted(set(failures))[:5],
        "disconnected": sum(r.kind == "disconnect" for r in reqs),
        "disconnect_errors": sorted({r.error for r in reqs
                                     if r.kind == "disconnect" and r.error})[:5],
        "malformed": sum(r.kind == "malformed" for r in reqs),
        "malformed_wrong": sum(r.kind == "malformed" and r.error is not None for r in reqs),
        "malformed_errors": sorted({r.error for r in reqs
                                    if r.kind == "malformed" and r.error})[:5],
        "output_tokens": tokens, "elapsed_s": elapsed,
        "tokens_per_s": tokens / elapsed if elapsed else 0.0,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_ms": _pct(tpot, 50) and 1e3 * _pct(tpot, 50),
        "tpot_p99_ms": _pct(tpot, 99) and 1e3 * _pct(tpot, 99),
    }


# ---------------------------------------------------------------------------------------------
# The server, and the engine in this process
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def start_server(serve_args: list[str], api_key: str | None, timeout: float):
    """`jaxinfer serve SERVE_ARGS` on 127.0.0.1 and a free port, until /health answers;
    yields its url."""
    port = _free_port()
    log = tempfile.TemporaryFile("w+")
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", *serve_args, "--host", "127.0.0.1",
           "--port", str(port)] + (["--api-key", api_key] if api_key else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"

    def stderr() -> str:
        log.seek(0)
        return log.read()[-4000:]

    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"jaxinfer serve exited:\n{stderr()}")
            if time.time() > deadline:
                raise SystemExit(f"jaxinfer serve did not start in {timeout:.0f} s:\n{stderr()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # as a user stops it: drain, then exit
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def engine_replay(serve_args: list[str], reqs: list[Request], clients: int) -> dict:
    """The completed requests again, straight through the Engine `serve_args` build, at most
    `clients` at once; warm-up requests first and untimed."""
    from jaxinfer import cli
    from jaxinfer.sampling import SamplingParams

    args = cli.build_parser().parse_args(["serve", *serve_args])
    cli.check_serve_args(args)
    _, engine = cli.serve_engine(args)
    greedy = SamplingParams(temperature=0.0)

    def replay(batch: list[Request]) -> dict:
        todo = list(batch)
        start = time.perf_counter()
        added, first, tokens = {}, {}, {}
        ttft, tpot = [], []
        cpu0 = time.thread_time()
        while todo or engine.has_unfinished():
            while todo and len(added) < clients:
                r = todo.pop(0)
                rid = engine.add_request(r.prompt, sampling=greedy, max_tokens=r.max_tokens)
                added[rid] = time.perf_counter()
                tokens[rid] = 0
            for o in engine.step():
                now = time.perf_counter()
                if o.new_token_ids:
                    first.setdefault(o.request_id, now)
                    tokens[o.request_id] += len(o.new_token_ids)
                if o.finished:
                    t0 = added.pop(o.request_id)
                    ttft.append(first[o.request_id] - t0)
                    if tokens[o.request_id] > 1:
                        tpot.append((now - first[o.request_id]) / (tokens[o.request_id] - 1))
        elapsed = time.perf_counter() - start
        n = sum(tokens.values())
        return {"requests": len(batch), "output_tokens": n, "elapsed_s": elapsed,
                "engine_thread_cpu_ms_per_1k_tokens": 1e6 * (time.thread_time() - cpu0) / n
                if n else None,
                "tokens_per_s": n / elapsed if elapsed else 0.0,
                "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
                "tpot_p50_ms": _pct(tpot, 50) and 1e3 * _pct(tpot, 50),
                "tpot_p99_ms": _pct(tpot, 99) and 1e3 * _pct(tpot, 99)}

    done = [r for r in reqs if r.kind == "ok" and r.error is None]
    done.sort(key=lambda r: r.start)
    warm = [r for r in done if r.warmup]
    if warm:
        replay(warm)
    return replay([r for r in done if not r.warmup])


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def _fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def table(r: dict) -> list[str]:
    s = r["server"]
    lines = [f"serve_load: {r['clients']} clients for {r['duration_s']:.0f} s against "
             f"{r['model']} ({r['mode']})",
             f"  requests {s['requests']}: well-formed {s['well_formed']} (completed "
             f"{s['completed']}, FAILED {s['failed']}), disconnected early "
             f"{s['disconnected']}, malformed {s['malformed']} (wrong answers "
             f"{s['malformed_wrong']})",
             f"  throughput {s['tokens_per_s']:.1f} tok/s ({s['output_tokens']} tokens in "
             f"{s['elapsed_s']:.1f} s); TTFT p50 {_fmt(s['ttft_p50_s'], '.3f')} s p99 "
             f"{_fmt(s['ttft_p99_s'], '.3f')} s; TPOT p50 {_fmt(s['tpot_p50_ms'], '.1f')} ms "
             f"p99 {_fmt(s['tpot_p99_ms'], '.1f')} ms",
             f"  pages in use at the end: {r['pages_in_use_end']:g}"]
    if "engine_thread_cpu_ms_per_1k_tokens" in s:
        lines.append(f"  server host CPU per 1k tokens: engine thread "
                     f"{s['engine_thread_cpu_ms_per_1k_tokens']:.0f} ms (engine process "
                     f"{_fmt(s.get('engine_process_cpu_ms_per_1k_tokens'), '.0f')} ms), API "
                     f"event loop {_fmt(s.get('event_loop_cpu_ms_per_1k_tokens'), '.0f')} ms; "
                     f"the clients ({r['client_procs']} processes) "
                     f"{_fmt(s.get('client_cpu_ms_per_1k_tokens'), '.0f')} ms")
    for what in ("failures", "disconnect_errors", "malformed_errors"):
        lines += [f"  {what[:-1]}: {e}" for e in s[what]]
    if "engine" in r:
        e = r["engine"]
        lines.append(f"  engine in-process, same {e['requests']} requests: "
                     f"{e['tokens_per_s']:.1f} tok/s ({e['output_tokens']} tokens in "
                     f"{e['elapsed_s']:.1f} s); TTFT p50 {_fmt(e['ttft_p50_s'], '.3f')} s; "
                     f"TPOT p50 {_fmt(e['tpot_p50_ms'], '.1f')} ms; engine thread CPU "
                     f"{_fmt(e['engine_thread_cpu_ms_per_1k_tokens'], '.0f')} ms per 1k tokens; "
                     f"server / engine = {r['server_over_engine']:.3f}")
    lines.append("  OK" if r["ok"] else "  NOT OK (failed well-formed requests, wrong answers "
                                        "to malformed ones, or pages still in use)")
    return lines


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (loopback only); default: "
                                               "start `jaxinfer serve SERVE_ARGS` (after --)")
    p.add_argument("--model", default=None, help="the served model's name (default: the "
                                                 "first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--client-procs", type=int, default=None,
                   help="processes the clients run in (default: one per 16 clients, at most "
                        "half the cores)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=0.0, help="seconds of untimed load first")
    p.add_argument("--disconnect-fraction", type=float, default=0.10)
    p.add_argument("--malformed-fraction", type=float, default=0.05)
    p.add_argument("--token-ids", action="store_true",
                   help="random token-id prompts through /v1/completions")
    p.add_argument("--vocab", type=int, default=1000, help="token ids drawn below this")
    p.add_argument("--prompt-lens", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--output-lens", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="the client's timeout per request (a timeout is a failure)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds to wait for the pages to go back to zero at the end")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--engine-trace", action="store_true",
                   help="then serve the completed requests through the Engine in-process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="also one JSON line at the end")
    p.add_argument("serve_args", nargs="*", help="after --: `jaxinfer serve` arguments")
    args = p.parse_args(argv)
    if args.url is not None and not _is_loopback(args.url):
        p.error(f"--url {args.url}: only loopback addresses (127.0.0.0/8, ::1, localhost)")
    if args.url is not None and args.engine_trace:
        p.error("--engine-trace needs the server's arguments: let the harness start it")
    if args.clients < 1 or args.duration <= 0 or (args.client_procs or 1) < 1:
        p.error("--clients and --client-procs must be >= 1 and --duration > 0")
    if not 0 <= args.disconnect_fraction + args.malformed_fraction <= 1:
        p.error("the disconnect and malformed fractions must add up to at most 1")
    return args


def _proc_phase(args, url: str, model: str, index: int, clients: int, seconds: float,
                warmup: bool) -> tuple:
    """One client process's share of one phase -> (requests, start, end wall times, its CPU
    seconds)."""
    args = argparse.Namespace(**{**vars(args), "seed": args.seed * 1000 + index * 2 + warmup})

    async def phase():
        load = Load(args, url, model)
        try:
            start = time.time()
            await load.run(seconds, warmup=warmup, clients=clients)
            return load.requests, start, time.time()
        finally:
            await load.client.close()
            await load.raw.aclose()
    cpu = time.process_time()
    reqs, start, end = asyncio.run(phase())
    return reqs, start, end, time.process_time() - cpu


async def _run_phase(load: "Load", pool, procs: int, seconds: float, warmup: bool) -> tuple:
    """A phase of the load, in this process or spread over the pool's processes ->
    (elapsed wall seconds, the clients' CPU seconds)."""
    if pool is None:
        cpu = time.process_time()
        elapsed = await load.run(seconds, warmup=warmup)
        return elapsed, time.process_time() - cpu
    shares = [load.args.clients // procs + (i < load.args.clients % procs)
              for i in range(procs)]
    loop = asyncio.get_running_loop()
    done = await asyncio.gather(*(loop.run_in_executor(
        pool, _proc_phase, load.args, load.url, load.model, i, n, seconds, warmup)
        for i, n in enumerate(shares) if n))
    for reqs, *_ in done:
        load.requests += reqs
    return (max(d[2] for d in done) - min(d[1] for d in done), sum(d[3] for d in done))


async def _load_run(args, url: str) -> dict:
    model = args.model
    if model is None:
        async with httpx.AsyncClient(timeout=10) as c:
            resp = await c.get(url + "/v1/models",
                               headers={"Authorization": f"Bearer {args.api_key or 'none'}"})
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]
    load = Load(args, url, model)
    procs = args.client_procs or max(1, min(args.clients // 16, (os.cpu_count() or 2) // 2))
    pool = None if procs == 1 else concurrent.futures.ProcessPoolExecutor(
        procs, mp_context=multiprocessing.get_context("spawn"))
    try:
        if args.warmup > 0:
            await _run_phase(load, pool, procs, args.warmup, warmup=True)
            await load.wait_pages_zero(args.drain_timeout)
        cpu0 = await server_cpu(load)
        elapsed, client_cpu = await _run_phase(load, pool, procs, args.duration, warmup=False)
        cpu1 = await server_cpu(load)
        pages = await load.wait_pages_zero(args.drain_timeout)
    finally:
        await load.client.close()
        await load.raw.aclose()
        if pool is not None:
            pool.shutdown()
    timed = [r for r in load.requests if not r.warmup]
    server = summarize(timed, elapsed)
    for name in cpu1:  # host CPU the server spent per 1k tokens, by thread and process
        server[f"{name}_cpu_ms_per_1k_tokens"] = 1e6 * (cpu1[name] - cpu0.get(name, 0.0)) \
            / max(server["output_tokens"], 1)
    server["client_cpu_ms_per_1k_tokens"] = 1e6 * client_cpu / max(server["output_tokens"], 1)
    return {"model": model, "clients": args.clients, "client_procs": procs,
            "duration_s": args.duration,
            "mode": "token ids, /v1/completions" if args.token_ids
            else "chat, /v1/chat/completions", "server": server, "pages_in_use_end": pages,
            "requests": load.requests,
            "ok": server["failed"] == 0 and server["malformed_wrong"] == 0 and pages == 0}


def main(argv=None) -> int:
    args = parse(argv)
    if args.url is not None:
        result = asyncio.run(_load_run(args, args.url.rstrip("/")))
    else:
        with start_server(args.serve_args, args.api_key, args.start_timeout) as url:
            result = asyncio.run(_load_run(args, url))
    reqs = result.pop("requests")
    if args.engine_trace:
        result["engine"] = engine_replay(args.serve_args, reqs, args.clients)
        result["server_over_engine"] = (result["server"]["tokens_per_s"]
                                        / result["engine"]["tokens_per_s"])
    for line in table(result):
        print(line)
    if args.json:
        print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
