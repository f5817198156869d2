"""EngineRunner's thread hand-offs, on a stand-in engine whose calls the test holds (no JAX): a
request whose client leaves before the engine thread takes it is skipped, one that leaves while
it is being added is aborted once added, and the thread serves the next request either way."""

import asyncio
import threading
import types

from jaxinfer.server.runner import EngineRunner


class HeldEngine:
    """add_request and step wait for the test's go-ahead when `hold` is set."""

    def __init__(self):
        self.requests, self.aborted, self.running = {}, [], set()
        self.hold_add, self.hold_step = threading.Event(), threading.Event()
        self.in_add, self.in_step = threading.Event(), threading.Event()
        self.go_add, self.go_step = threading.Event(), threading.Event()
        self.count = 0

    def add_request(self, prompt, **kwargs):
        if self.hold_add.is_set():
            self.in_add.set()
            self.go_add.wait(10)
        self.count += 1
        rid = f"r{self.count}"
        self.requests[rid] = types.SimpleNamespace(prompt=list(prompt), stop_ids=frozenset())
        self.running.add(rid)
        return rid

    def abort(self, rid):
        self.aborted.append(rid)
        self.running.discard(rid)
        self.requests.pop(rid, None)

    def has_unfinished(self):
        return bool(self.running) or self.hold_step.is_set()

    def step(self):
        if self.hold_step.is_set():
            self.in_step.set()
            self.go_step.wait(10)
            self.hold_step.clear()
        return []


async def _until(predicate, wait=5.0):
    for _ in range(int(wait / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def test_a_client_gone_before_the_engine_takes_its_request():
    engine = HeldEngine()
    runner = EngineRunner(engine)

    async def main():
        engine.hold_step.set()  # the engine thread is inside a step
        await asyncio.to_thread(engine.in_step.wait, 5)
        task = asyncio.create_task(runner.submit([1, 2, 3]))
        await asyncio.sleep(0.05)
        task.cancel()  # the client left; its future is cancelled before the thread took it
        engine.go_step.set()
        await _until(lambda: runner.pending == 0)
        assert engine.requests == {}  # skipped, never added
        sub = await asyncio.wait_for(runner.submit([4, 5]), 5)  # the thread still serves
        assert sub.prompt_tokens == 2 and runner.pending == 1

    try:
        asyncio.run(main())
    finally:
        runner.close()


def test_a_client_gone_while_its_request_is_added():
    engine = HeldEngine()
    runner = EngineRunner(engine)

    async def main():
        engine.hold_add.set()
        task = asyncio.create_task(runner.submit([1, 2, 3]))
        await asyncio.to_thread(engine.in_add.wait, 5)
        task.cancel()  # mid add_request: the future can no longer be cancelled
        engine.hold_add.clear()
        engine.go_add.set()
        await _until(lambda: engine.aborted == ["r1"] and runner.pending == 0)
        sub = await asyncio.wait_for(runner.submit([4, 5]), 5)
        assert sub.request_id == "r2" and runner.pending == 1

    try:
        asyncio.run(main())
    finally:
        runner.close()
