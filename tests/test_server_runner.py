"""The engine process's pipe (jaxinfer/server/runner.py).

EngineLoop and EngineClient over a pipe within this process, the loop on a thread, on a
stand-in engine whose calls the test holds (no JAX): a request whose client leaves before the
engine takes it, or while it is being added, is aborted, and the engine serves the next one
either way. Then the real thing: `jaxinfer serve` whose engine process is killed mid-stream
fails that stream with an error event, logs why and exits."""

import asyncio
import multiprocessing
import os
import signal
import threading
import types

import httpx
import openai
import pytest

from jaxinfer.server.runner import EngineClient, EngineLoop
from tests.serving import TINY_ENGINE, serve


class HeldEngine:
    """add_request and step wait for the test's go-ahead when `hold` is set."""

    def __init__(self):
        self.requests, self.aborted, self.running = {}, [], set()
        self.hold_add, self.hold_step = threading.Event(), threading.Event()
        self.in_add, self.in_step = threading.Event(), threading.Event()
        self.go_add, self.go_step = threading.Event(), threading.Event()
        self.scheduler = types.SimpleNamespace(running=[], waiting=[])
        self.pool = types.SimpleNamespace(in_use=0)
        self.stats = {"generated_tokens": 0, "draft_tokens": 0, "accepted_tokens": 0,
                      "plain_rounds": 0}

    def prefix_cache_hit_rate(self):
        return 0.0

    def add_request(self, prompt, request_id, **kwargs):
        if self.hold_add.is_set():
            self.in_add.set()
            self.go_add.wait(10)
        self.requests[request_id] = types.SimpleNamespace(prompt=list(prompt),
                                                          stop_ids=frozenset())
        self.running.add(request_id)
        return request_id

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


def _served(engine):
    """An EngineClient whose engine is `engine`, stepped by an EngineLoop on a thread."""
    ours, theirs = multiprocessing.Pipe()
    thread = threading.Thread(target=EngineLoop(engine, theirs).run, daemon=True)
    thread.start()
    return EngineClient(ours, {"tokenizer": None}), thread


async def _until(predicate, wait=5.0):
    for _ in range(int(wait / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def test_a_client_gone_before_the_engine_takes_its_request():
    engine = HeldEngine()
    engine.running.add("busy")  # the loop steps instead of waiting for commands
    client, thread = _served(engine)

    async def main():
        engine.hold_step.set()  # the engine is inside a step
        await asyncio.to_thread(engine.in_step.wait, 5)
        task = asyncio.create_task(client.submit([1, 2, 3]))
        await asyncio.sleep(0.05)
        task.cancel()  # the client left; its add and then its abort wait in the pipe
        await asyncio.gather(task, return_exceptions=True)
        assert client.pending == 0
        engine.go_step.set()
        await _until(lambda: engine.aborted == ["0"] and engine.requests == {})
        sub = await asyncio.wait_for(client.submit([4, 5]), 5)  # the engine still serves
        assert sub.prompt_tokens == 2 and client.pending == 1

    try:
        asyncio.run(main())
    finally:
        client.close()
        thread.join(5)


def test_a_client_gone_while_its_request_is_added():
    engine = HeldEngine()
    client, thread = _served(engine)

    async def main():
        engine.hold_add.set()
        task = asyncio.create_task(client.submit([1, 2, 3]))
        await asyncio.to_thread(engine.in_add.wait, 5)
        task.cancel()  # mid add_request
        await asyncio.gather(task, return_exceptions=True)
        engine.hold_add.clear()
        engine.go_add.set()
        await _until(lambda: engine.aborted == ["0"] and client.pending == 0)
        sub = await asyncio.wait_for(client.submit([4, 5]), 5)
        assert sub.request_id == "1" and client.pending == 1

    try:
        asyncio.run(main())
    finally:
        client.close()
        thread.join(5)


def test_engine_process_killed_mid_stream(tiny_chat_dir):
    """The stream under way ends with an error event naming the cause (no hang), the server
    logs it and exits 1."""
    with serve("--model", str(tiny_chat_dir), *TINY_ENGINE,
               "--served-model-name", "tiny") as (url, proc, stderr):
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            children = [int(c) for c in f.read().split()]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=30, max_retries=0)
        stream = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=200,
                                           stream=True)
        next(iter(stream))
        for pid in children:  # the engine process (and multiprocessing's resource tracker)
            if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read():
                os.kill(pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="engine process died"):
            for _ in stream:
                pass
        assert proc.wait(timeout=30) == 1
        log = stderr()
        assert "the engine process died (killed by SIGKILL)" in log, log
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
