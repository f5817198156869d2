"""`jaxinfer serve` in a process of its own on 127.0.0.1, for the server's tests."""

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest


# The engine arguments of the tests that serve tiny_chat_dir in float32 (test_server,
# test_server_load, test_server_runner): one pool and one set of shapes, so that the programs
# one server compiled load from the session's compilation cache (tests/conftest.py) in the next.
# A 2 MB pool: 243 pages of 16 tokens, room for all 4 rows at the full 512 tokens (128 pages)
# and a prefix cache besides.
TINY_ENGINE = ("--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", "512",
               "--kv-memory", "2MB")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(*args: str, timeout: float = 180.0, env: dict | None = None):
    """Start `jaxinfer serve ARGS --port P` and yield (url, process, a function returning its stderr so far) once /health answers;
    stopped at the end (SIGTERM, then killed). env: the process's environment (default
    os.environ)."""
    port = free_port()
    log = tempfile.TemporaryFile("w+")  # a file, not a pipe nobody reads that could fill up
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfer.cli", "serve", *args,
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log,
                            text=True, env={**(os.environ if env is None else env),
                                            "JAXINFER_API_KEY": ""})

    def stderr() -> str:
        log.seek(0)
        return log.read()

    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"jaxinfer serve exited: {stderr()}")
            if time.time() > deadline:
                pytest.fail(f"jaxinfer serve did not answer /health within {timeout:.0f} s: "
                            f"{stderr()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield url, proc, stderr
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
