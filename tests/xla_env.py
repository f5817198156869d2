"""XLA's CPU compile flags for the suite's processes and the ones it starts.

tests/conftest.py turns XLA's CPU backend optimizations off for the test processes (and so for
the subprocesses they start, which inherit the environment): most of their time is compiling
tiny models and interpret-mode kernels, where LLVM's passes cost more than they save. A process
that runs the embedded 30-layer model for many decode steps is the other way round: its
compiles take about as long either way and its steps run ~3x slower without the passes, so it
takes `optimized_env()` instead.
"""

import os

FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",
                      "--xla_llvm_disable_expensive_passes=true")


def optimized_env(env: dict | None = None) -> dict:
    """A copy of `env` (default os.environ) without FAST_COMPILE_FLAGS in XLA_FLAGS."""
    env = dict(os.environ if env is None else env)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if f not in FAST_COMPILE_FLAGS]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    return env


def run_optimized(code: str, stdin: str = "", timeout: float = 600) -> object:
    """Run the Python `code` in a fresh process under `optimized_env()` (from the repository
    root, stdin given) and return the JSON object of its last stdout line that starts with
    "RESULT "; the process failing or printing none fails the calling test with its stderr."""
    import json
    import pathlib
    import subprocess
    import sys

    import pytest

    root = pathlib.Path(__file__).parent.parent
    env = optimized_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(root), env.get("PYTHONPATH"))))
    proc = subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True,
                          text=True, env=env, cwd=root, timeout=timeout, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"the optimized subprocess exited {proc.returncode}: {proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])
