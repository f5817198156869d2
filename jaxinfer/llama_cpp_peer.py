"""llama.cpp on the same GGUF file and cores: the CPU peer that `jaxinfer bench` runs beside
its own figures, through llama-cpp-python (`pip install llama-cpp-python`, which builds
llama.cpp for this machine), in a child process so that its peak RSS is its own.

    python -m jaxinfer.llama_cpp_peer FILE.gguf --prompt-len 128 --gen-len 64 [--threads N]

prints one JSON object: prefill tok/s (the prompt in one `eval`), decode ms/token (greedy, one
token per `eval`, the same random prompt ids as `bench`'s row 0), peak RSS in GB (the
child's high-water mark: the weights as llama.cpp maps them, its KV cache and compute
buffers, and llama-cpp-python's [n_batch, vocab] float32 logits buffer).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time


def available() -> str | None:
    """llama-cpp-python's version where it is installed, else None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def threads() -> int:
    """The cores this process may run on (what XLA's CPU client uses too)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def measure(path: str, prompt_len: int, gen_len: int, repeats: int = 3,
            seed: int = 0, timeout: float = 1800) -> dict:
    """Run the peer on path in a child process -> its JSON row (see the module docstring).
    Raises RuntimeError with the child's last words where it fails (a file llama.cpp cannot
    load, say)."""
    cmd = [sys.executable, "-m", "jaxinfer.llama_cpp_peer", str(path), "--prompt-len",
           str(prompt_len), "--gen-len", str(gen_len), "--repeats", str(repeats), "--seed",
           str(seed), "--threads", str(threads())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"llama.cpp on {path} failed (exit {proc.returncode}): "
                           + " | ".join(tail))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def row_text(r: dict, ours=None) -> str:
    """The peer's row, and ours against it where ours (a bench.BenchResult) is given."""
    text = (f"llama.cpp (llama-cpp-python {r['version']}, {r['threads']} threads) B=1 "
            f"ctx={r['prompt_len'] + r['gen_len']}: {r['decode_ms_per_token']:.3f} ms/tok "
            f"{1e3 / r['decode_ms_per_token']:.1f} tok/s prefill "
            f"{r['prefill_tokens_per_s']:.1f} tok/s peak RSS {r['peak_rss_gb']:.2f} GB")
    if ours is not None:
        text += (f"\n  ours / llama.cpp: decode {r['decode_ms_per_token'] / ours.decode_ms_per_token:.2f}x"
                 f" its tok/s, prefill {ours.prefill_tokens_per_s / r['prefill_tokens_per_s']:.2f}x")
        if ours.peak_memory_gb is not None:
            text += f", peak RSS {ours.peak_memory_gb / r['peak_rss_gb']:.2f}x its"
    if r.get("load_average", 0) > r["threads"]:  # its threads wait for each other spinning
        text += (f"\n  the load average was {r['load_average']:.1f} on {r['threads']} cores: "
                 f"llama.cpp's threads can slow down by orders of magnitude when they share "
                 f"cores with other work; compare on a quiet machine")
    return text


def _run(path: str, prompt_len: int, gen_len: int, repeats: int, seed: int, n_threads: int):
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=prompt_len + gen_len + 8, n_batch=min(prompt_len, 512),
                n_threads=n_threads, n_threads_batch=n_threads, seed=seed, verbose=False)
    # bench's prompt ids (row 0 of its batch): random ids of the model's vocabulary
    prompt = np.random.default_rng(seed).integers(0, llm.n_vocab(), prompt_len).tolist()

    def prefill():
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        return time.perf_counter() - t0

    prefill()  # warm-up: the first call pages the weights in
    prefill_s = statistics.median(prefill() for _ in range(repeats))
    decode = []
    for _ in range(repeats):
        prefill()
        t0 = time.perf_counter()
        for _ in range(gen_len - 1):  # greedy, as bench's rows
            llm.eval([llm.sample(top_k=1, temp=0.0)])
        decode.append((time.perf_counter() - t0) / (gen_len - 1))
    return {"peer": "llama.cpp", "version": available(), "file": path, "threads": n_threads,
            "load_average": os.getloadavg()[0],
            "prompt_len": prompt_len, "gen_len": gen_len,
            "prefill_tokens_per_s": prompt_len / prefill_s,
            "decode_ms_per_token": statistics.median(decode) * 1e3,
            "peak_rss_gb": _peak_rss_bytes() / 1e9}


def _peak_rss_bytes() -> int:
    """This process's resident high-water mark: VmHWM, its own address space's (getrusage's
    ru_maxrss survives exec on Linux: it would report the parent's peak, bench's)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=threads())
    args = ap.parse_args(argv)
    if available() is None:
        print("llama-cpp-python is not installed (pip install llama-cpp-python)", file=sys.stderr)
        return 2
    print(json.dumps(_run(args.path, args.prompt_len, args.gen_len, args.repeats, args.seed,
                          args.threads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
