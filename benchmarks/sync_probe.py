"""Decode steps per host check of the device loop (generate.STEPS_PER_SYNC), compared in one run.

    PYTHONPATH=. python3 benchmarks/sync_probe.py --preset llama3-8b --ks 1,3,5 [--rounds 3]

XLA's GPU while loop copies its predicate to the host after every iteration and the next
iteration waits for the host; `decode_loop(..., steps_per_sync=k)` runs k steps per iteration.
Each k gets its own compiled loop; the timings alternate between them (rounds), so machine
drift hits every k alike (no stop ids: every row runs its whole budget, and no k runs a step
past it). One JSON line per k at the end, with whether every k produced the same tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import numpy as np

from jaxinfer.bench import decode_bytes_per_step, HBM_BYTES_PER_S, random_model
from jaxinfer.generate import decode_loop, init_state, prefill
from jaxinfer.model import default_dtype
from jaxinfer.sampling import SamplingParams


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--ks", default="1,3,5")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default=None)
    args = p.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    model = random_model(args.preset, args.dtype or default_dtype())
    cfg = model.config
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (args.batch, args.prompt_len)).tolist()
    greedy = [SamplingParams(temperature=0.0)] * args.batch

    def prefilled():
        state, tokens, lengths = init_state(model, prompts, args.gen_len, greedy, 0, stop_ids=[])
        return jax.block_until_ready(prefill(model.params, tokens, lengths, state, cfg))

    s = prefilled()
    loops = {k: decode_loop.lower(model.params, s, cfg, k).compile() for k in ks}
    outputs = {}
    times = {k: [] for k in ks}
    for r in range(args.rounds + 1):  # round 0 warms up
        for k in ks:
            s = prefilled()
            t0 = time.perf_counter()
            s = jax.block_until_ready(loops[k](model.params, s))
            dt = time.perf_counter() - t0
            assert int(s.step) == args.gen_len, "decode loop stopped early"
            outputs[k] = np.asarray(s.output)
            if r:
                times[k].append(dt / (args.gen_len - 1))
    same = all(np.array_equal(outputs[k], outputs[ks[0]]) for k in ks)
    nbytes = decode_bytes_per_step(cfg, args.batch, args.prompt_len + args.gen_len // 2)
    bw = HBM_BYTES_PER_S.get(jax.default_backend())
    for k in ks:
        best = min(times[k])
        row = dict(steps_per_sync=k, ms_per_token=best * 1e3,
                   ms_per_token_all=[t * 1e3 for t in times[k]],
                   floor_fraction=(nbytes / bw) / best if bw else None, same_tokens=same)
        print(json.dumps(row), flush=True)
    return 0 if same else 2


if __name__ == "__main__":
    sys.exit(main())
