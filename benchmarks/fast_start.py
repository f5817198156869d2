"""Start-up time of `jaxinfer generate` in fresh processes: a cold compilation cache, then warm.

    python benchmarks/fast_start.py --runs 4                 # the embedded model, "Say hi." -n 8
    python benchmarks/fast_start.py --model /models/x.gguf -n 16

Each run empties a private cache's xla/ folder (the model file is linked in, never fetched),
runs the command once cold and once warm, and prints one JSON line per process: wall seconds,
and the load, first-token and decode figures `-v` logs. The median warm / cold ratio ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checkpoints import registry  # noqa: E402  (after the path: run from anywhere)


def one(cache: pathlib.Path, args) -> dict:
    env = {**os.environ, "JAXINFER_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "jaxinfer.cli", "-v", "generate", args.prompt, "-n",
           str(args.n), "--model", args.model]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    load = re.search(r"loaded .* in ([0-9.]+) s", proc.stderr)
    first = re.search(r"first token ([0-9.]+) s after the load, ([0-9.]+|None) tok/s",
                      proc.stderr)
    return {"wall_s": round(wall, 3), "load_s": float(load[1]) if load else None,
            "first_token_after_load_s": float(first[1]) if first else None,
            "decode_tokens_per_s": float(first[2]) if first and first[2] != "None" else None,
            "text": proc.stdout.strip()[:60]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=registry.DEFAULT_MODEL)
    p.add_argument("--prompt", default="Say hi.")
    p.add_argument("-n", type=int, default=8)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="jaxinfer-start-") as tmp:
        cache = pathlib.Path(tmp)
        if args.model in registry.MODELS:  # the user's cached file, linked in (with its stamp)
            real = registry.ensure_cached(args.model)
            (cache / args.model).mkdir()
            for f in real.parent.iterdir():
                (cache / args.model / f.name).symlink_to(f)
        ratios = []
        for _ in range(args.runs):
            shutil.rmtree(cache / "xla", ignore_errors=True)
            cold, warm = one(cache, args), one(cache, args)
            ratios.append(warm["wall_s"] / cold["wall_s"])
            for kind, r in (("cold", cold), ("warm", warm)):
                print(json.dumps({"cache": kind, **r}), flush=True)
    print(json.dumps({"warm_over_cold_median": round(statistics.median(ratios), 3),
                      "runs": args.runs, "model": args.model, "n": args.n}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
