"""The engine in a process of its own, as vLLM V1's EngineCore: the server's two halves share
no GIL.

The engine process (spawned: JAX initialises there only, so the API process never takes the
device) owns the Engine: it schedules, dispatches and reads steps, runs the grammars'
matchers (the sampler's masks are built there) and checks stop strings. The API process
(uvicorn's event loop) owns HTTP, server-sent events, chat templates, prompt tokenization and
detokenization. In one process the engine thread and the event loop took turns on one GIL
(~234 ms of one core per 1k tokens at 64 rows on the H200, 0.78x the engine's throughput).

They talk over one `multiprocessing` pipe (tuples pickled with the pickle module's own
pickler: multiprocessing's ForkingPickler costs more per message):
    API -> engine: ("add", request id, prompt ids, add_request kwargs) | ("abort", id)
                   | ("close",)
    engine -> API: one message per engine step: (add results, outputs, stats), the step's
                   outputs for all rows together (one pickle, one event-loop wake-up).
The API process names the requests, so an abort can follow an add at once: the engine takes
commands in order (an abort of a request not yet added cannot happen, one already finished
is a no-op). An engine process that dies (EOF on the pipe) fails every request under way
with EngineDead and calls `on_death` (the server then stops).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import pickle
import signal
import sys
import time
from typing import NamedTuple

log = logging.getLogger("jaxinfer.serve")
PROTOCOL = pickle.HIGHEST_PROTOCOL


class EngineDead(RuntimeError):
    """The engine process is gone: nothing can be served."""


class Output(NamedTuple):
    """The tokens one request got in one engine step (RequestOutput's fields)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None
    finished: bool
    finish_reason: str | None
    new_top_logprobs: list | None
    draft_tokens: int
    accepted_tokens: int


class Stats(NamedTuple):
    """The engine process's figures, sent with every message (for /metrics)."""

    running: int = 0
    waiting: int = 0
    pages_in_use: int = 0
    prefix_cache_hit_rate: float = 0.0
    generated_tokens: int = 0
    draft_tokens: int = 0  # speculative decoding: drafts verified, accepted, plain rounds
    accepted_tokens: int = 0
    plain_rounds: int = 0
    thread_cpu_s: float = 0.0  # the engine loop's thread (its host work)
    process_cpu_s: float = 0.0  # the whole engine process (JAX's threads too)


@dataclasses.dataclass
class Submitted:
    request_id: str
    prompt_tokens: int
    stop_ids: frozenset[int]  # its stop token ids (they add no text)
    queue: asyncio.Queue  # Output, then None when it finished (or an EngineDead)


# -------------------------------------------------------------------------------------------
# The engine process
# -------------------------------------------------------------------------------------------


def engine_main(args, conn) -> None:
    """The engine process: build the Engine `jaxinfer serve` args describe, say ("ready",
    info) or ("failed", exception), then serve commands until "close" or the pipe's end."""
    # Ctrl-C reaches the whole process group: the API process drains its streams, which
    # needs this process stepping until it says "close".
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        engine, info = _build(args)
    except BaseException as e:  # noqa: BLE001 - the API process reports it and exits
        try:
            conn.send(("failed", e))
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            conn.send(("failed", RuntimeError(f"{type(e).__name__}: {e}")))
        return
    conn.send(("ready", info))
    EngineLoop(engine, conn).run()


def _build(args):
    import jax

    from jaxinfer import cli, memory

    model, engine = cli.serve_engine(args)
    if jax.default_backend() == "gpu":
        # Every dispatch shape compiled before the first client: one first met while serving
        # stalls every row for its compile (~3 s at 8B on the H200).
        from jaxinfer.sampling import SamplingParams

        t0 = time.perf_counter()
        n = engine.warmup([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)],
                          progress=sys.stderr.isatty())
        print(f"jaxinfer serve: compiled {n} executables in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
    tokenizer = model.tokenizer
    if tokenizer is not None:
        # llguidance's tokenizer (~1 s for a large vocabulary) now, not at the first grammar
        # with every row waiting.
        from jaxinfer import structured

        structured.ll_tokenizer(tokenizer)
    c = model.config
    info = {"tokenizer": tokenizer, "vocab_size": c.vocab_size, "num_layers": c.num_layers,
            "dtype": str(c.dtype), "load_s": args.load_s,
            "device": jax.devices()[0].device_kind,
            "params": memory.gib(sum(x.nbytes for x in jax.tree.leaves(model.params))),
            "kv_pool": memory.gib(engine.state.cache.nbytes()),
            "kv_cache_dtype": engine.kv_cache_dtype, "total_pages": engine.total_pages,
            "page_size": engine.page_size, "max_num_seqs": engine.max_num_seqs,
            "max_model_len": engine.max_model_len,
            "num_speculative_tokens": engine.num_speculative_tokens}
    return engine, info


class EngineLoop:
    """The engine process's loop: take the commands that came, step, send the step's results
    in one message. Every Engine call happens here."""

    CPU_EVERY_S = 0.25  # how often the CPU times in Stats are read again

    def __init__(self, engine, conn):
        self.engine, self.conn = engine, conn
        self._cpu = (0.0, 0.0)
        self._cpu_read = -self.CPU_EVERY_S

    def run(self) -> None:
        engine, conn = self.engine, self.conn
        try:
            while True:
                if not engine.has_unfinished():
                    conn.poll(None)  # idle: sleep until a command (or the pipe's end)
                added, changed = [], False
                while conn.poll():
                    command = pickle.loads(conn.recv_bytes())
                    if command[0] == "close":
                        return
                    changed = True
                    if command[0] == "add":
                        added.append(self._add(*command[1:]))
                    elif command[1] in engine.requests:  # ("abort", id); finished: no-op
                        engine.abort(command[1])
                outs = engine.step() if engine.has_unfinished() else []
                if outs or changed:
                    outputs = [(o.request_id, o.new_token_ids, o.new_logprobs, o.finished,
                                o.finish_reason, o.new_top_logprobs, o.draft_tokens,
                                o.accepted_tokens) for o in outs]
                    conn.send_bytes(pickle.dumps((added, outputs, self.stats()), PROTOCOL))
        except (EOFError, OSError):  # the API process is gone
            return

    def _add(self, rid: str, prompt, kwargs) -> tuple:
        """-> (id, (prompt tokens, stop ids)) or (id, the exception add_request raised)."""
        try:
            if kwargs.get("grammar") is not None:
                from jaxinfer.structured import Grammar

                kwargs["grammar"] = Grammar.from_spec(self.engine.model.tokenizer,
                                                      kwargs["grammar"])
            self.engine.add_request(prompt, request_id=rid, **kwargs)
        except Exception as e:  # noqa: BLE001 - that request's answer; the others go on
            return rid, e
        req = self.engine.requests[rid]
        return rid, (len(req.prompt), req.stop_ids)

    def stats(self) -> Stats:
        e = self.engine
        now = time.perf_counter()
        if now - self._cpu_read >= self.CPU_EVERY_S:  # a clock read per step showed up
            self._cpu, self._cpu_read = (time.thread_time(), time.process_time()), now
        return Stats(len(e.scheduler.running), len(e.scheduler.waiting), e.pool.in_use,
                     e.prefix_cache_hit_rate(), e.stats["generated_tokens"],
                     e.stats["draft_tokens"], e.stats["accepted_tokens"],
                     e.stats["plain_rounds"], *self._cpu)


# -------------------------------------------------------------------------------------------
# The API process
# -------------------------------------------------------------------------------------------


def start_engine(args, max_pending: int = 256) -> EngineClient:
    """Spawn the engine process for `jaxinfer serve` args and wait until it is ready (its
    start-up errors raise here, as they would in this process)."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=engine_main, args=(args, theirs), name="jaxinfer-engine",
                          daemon=True)
    process.start()
    theirs.close()  # the engine's end lives in the engine: EOF here when it dies
    try:
        status, value = ours.recv()
    except EOFError:
        process.join(5)
        raise RuntimeError(f"the engine process exited while starting "
                           f"({_exit_status(process.exitcode)})") from None
    except BaseException:  # Ctrl-C while it loads: it ignores SIGINT, so stop it here
        process.terminate()
        process.join(5)
        raise
    if status == "failed":
        process.join(30)
        raise value
    return EngineClient(ours, value, process, max_pending)


def _exit_status(code) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class EngineClient:
    """The API process's end of the pipe: submits and aborts requests, hands each request its
    outputs through an asyncio.Queue, keeps the engine's latest Stats. Its methods run on
    the event loop."""

    def __init__(self, conn, info: dict, process=None, max_pending: int = 256):
        self.conn, self.info, self.process = conn, info, process
        self.max_pending = max_pending
        self.tokenizer = info["tokenizer"]
        self.stats = Stats()
        self.error: str | None = None  # why the engine process is gone
        self.on_death = None  # called once, after every request under way got EngineDead
        self._requests: dict[str, tuple[asyncio.Future, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def pending(self) -> int:
        """Requests submitted and not finished."""
        return len(self._requests)

    def attach(self) -> None:
        """Read the engine's messages on the running event loop (the server's startup)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop and self.error is None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self.conn.fileno())
            self._loop = loop
            loop.add_reader(self.conn.fileno(), self._receive)

    async def submit(self, prompt, **kwargs) -> Submitted:
        """Queue a request (token ids; Engine.add_request's keyword arguments, a grammar as
        its spec). ValueError: add_request's checks; OverflowError: the queue is full (the
        server answers 429); EngineDead."""
        self.attach()
        if self.error is not None:
            raise EngineDead(self.error)
        if self.pending >= self.max_pending:
            raise OverflowError(f"{self.pending} requests are already queued or running")
        rid = str(next(self._ids))
        future, queue = self._loop.create_future(), asyncio.Queue()
        self._requests[rid] = (future, queue)
        self._send(("add", rid, prompt, kwargs))
        try:
            prompt_tokens, stop_ids = await future
        except asyncio.CancelledError:  # the client went away (or timed out) first
            self.abort(rid)
            raise
        return Submitted(rid, prompt_tokens, stop_ids, queue)

    def abort(self, request_id: str) -> None:
        """Stop a request (its pages go back at the engine's next command read); a finished
        or unknown one: nothing."""
        if self._requests.pop(request_id, None) is not None and self.error is None:
            self._send(("abort", request_id))

    def close(self) -> None:
        """Stop the engine process (requests still running are dropped)."""
        if self._loop is not None and not self._loop.is_closed() and self.error is None:
            self._loop.remove_reader(self.conn.fileno())
        if self.error is None:
            try:
                self.conn.send_bytes(pickle.dumps(("close",), PROTOCOL))
            except OSError:
                pass
        if self.process is not None:
            self.process.join(30)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(5)
        self.conn.close()

    def _send(self, command) -> None:
        try:
            self.conn.send_bytes(pickle.dumps(command, PROTOCOL))
        except OSError:  # the engine process is gone; _receive says so
            self._died()

    def _receive(self) -> None:
        """On the event loop, when the pipe has data: every message that came."""
        try:
            while self.conn.poll():
                added, outputs, stats = pickle.loads(self.conn.recv_bytes())
                self._deliver(added, outputs)
                self.stats = stats
        except (EOFError, OSError):
            self._died()

    def _deliver(self, added, outputs) -> None:
        requests = self._requests
        for rid, result in added:
            entry = requests.get(rid)
            if entry is None or entry[0].done():  # aborted meanwhile
                continue
            if isinstance(result, BaseException):
                del requests[rid]
                entry[0].set_exception(result)
            else:
                entry[0].set_result(result)
        for out in outputs:
            entry = requests.get(out[0])
            if entry is None:
                continue
            entry[1].put_nowait(Output._make(out))
            if out[3]:  # finished
                del requests[out[0]]
                entry[1].put_nowait(None)

    def _died(self) -> None:
        if self.error is not None:
            return
        code = None
        if self.process is not None:
            self.process.join(1)
            code = self.process.exitcode
        self.error = f"the engine process died ({_exit_status(code)})"
        log.error("%s; failing the %d requests under way and stopping the server",
                  self.error, len(self._requests))
        if self._loop is not None:
            self._loop.remove_reader(self.conn.fileno())
        dead = EngineDead(self.error)
        for future, queue in self._requests.values():
            if future.done():
                queue.put_nowait(dead)
            else:
                future.set_exception(dead)
        self._requests.clear()
        if self.on_death is not None:
            self.on_death()
