"""The engine on its own thread: the server's event loop only queues work and reads events.

JAX dispatch blocks, so `Engine.step()` never runs on the event loop. Requests, aborts and
outputs cross threads through a lock-protected inbox (loop -> engine thread) and
`loop.call_soon_threadsafe` (engine thread -> the request's asyncio.Queue), once per engine step
for all of that step's outputs (one wake-up of the event loop, not one per request). Every
Engine call happens on the engine thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import sys
import threading
import time

from jaxinfer.engine import Engine, RequestOutput


@dataclasses.dataclass
class Submitted:
    request_id: str
    prompt_tokens: int
    stop_ids: frozenset[int]  # its stop token ids (they add no text)
    queue: asyncio.Queue  # RequestOutput, then None when it finished or was aborted


class EngineRunner:
    """Owns an Engine and the thread that steps it."""

    def __init__(self, engine: Engine, max_pending: int = 256):
        self.engine = engine
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list = []  # ("add", kwargs, future, queue, loop) | ("abort", request_id)
        self._queues: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._outbox: dict = {}  # loop -> [(queue, item)], handed over once per engine step
        self._stop = False
        self.pending = 0  # requests submitted and not finished
        self.counters = {"requests": 0, "generated_tokens": 0, "prompt_tokens": 0}
        self.thread_cpu_s = 0.0  # the engine thread's CPU time so far (host overhead)
        # The engine thread takes the GIL back after every device call; behind a busy event
        # loop it waits up to the switch interval each time (5 ms by default, a third of a
        # decode step at 64 rows). Process-wide: this thread is why the process has two.
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)
        self._thread.start()

    # -- the event loop's side ------------------------------------------------------------

    async def submit(self, prompt, **kwargs) -> Submitted:
        """Queue a request (Engine.add_request's arguments); its checks' ValueError raises
        here. OverflowError: the queue is full (the server answers 429)."""
        if self.pending >= self.max_pending:
            raise OverflowError(f"{self.pending} requests are already queued or running")
        loop = asyncio.get_running_loop()
        future: concurrent.futures.Future = concurrent.futures.Future()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._inbox.append(("add", (prompt, kwargs), future, queue, loop))
            self.pending += 1
        self._wake.set()
        try:
            rid, prompt_tokens, stop_ids = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The client went away (or timed out) first: the engine thread either skips the
            # request (its future cancelled) or has added it, and then it is aborted.
            future.add_done_callback(self._abort_added)
            raise
        return Submitted(rid, prompt_tokens, stop_ids, queue)

    def _abort_added(self, future: concurrent.futures.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.abort(future.result()[0])

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()

    def close(self) -> None:
        """Stop the thread (requests still running are dropped)."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    # -- the engine thread ----------------------------------------------------------------

    def _send(self, rid: str, item) -> None:
        queue, loop = self._queues[rid]
        self._outbox.setdefault(loop, []).append((queue, item))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop is closed (its server stopped): nobody reads
                pass

    def _finish(self, rid: str) -> None:
        self._send(rid, None)
        del self._queues[rid]
        with self._lock:
            self.pending -= 1

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if item[0] == "abort":
                rid = item[1]
                if rid in self._queues:
                    if rid in self.engine.requests:
                        self.engine.abort(rid)
                    self._finish(rid)
                continue
            _, (prompt, kwargs), future, queue, loop = item
            if not future.set_running_or_notify_cancel():  # its client is gone already
                with self._lock:
                    self.pending -= 1
                continue
            try:
                rid = self.engine.add_request(prompt, **kwargs)
            except Exception as e:  # noqa: BLE001 - handed to the request's coroutine
                with self._lock:
                    self.pending -= 1
                future.set_exception(e)
                continue
            req = self.engine.requests[rid]
            prompt_tokens = len(req.prompt)
            self._queues[rid] = (queue, loop)
            self.counters["requests"] += 1
            self.counters["prompt_tokens"] += prompt_tokens
            future.set_result((rid, prompt_tokens, req.stop_ids))

    def _run(self) -> None:
        while not self._stop:
            self._take_inbox()
            self._flush()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            outs: list[RequestOutput] = self.engine.step()
            for out in outs:
                self.counters["generated_tokens"] += len(out.new_token_ids)
                if out.request_id not in self._queues:  # aborted meanwhile
                    continue
                self._send(out.request_id, out)
                if out.finished:
                    self._finish(out.request_id)
            self._flush()
            self.thread_cpu_s = time.thread_time()
            if not outs:
                time.sleep(0)  # let the loop's thread take the lock


def _deliver(items) -> None:
    """On the event loop: a step's outputs into their requests' queues."""
    for queue, item in items:
        queue.put_nowait(item)
