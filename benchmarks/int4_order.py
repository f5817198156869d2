"""int4 codes for the Mosaic kernel in K order against fragment order
(`KernelPolicy.int4_fragment_order`), end to end: `generate` at batch 1 (128 + 256 greedy
tokens) on a random-weights preset quantized to int4 g128, both layouts of one model in one
process, alternated ROUNDS times (median of 3 calls each), beside bf16. The two int4 runs
must give the same tokens: the kernel's MMA inputs are the same values in the same registers.

    PYTHONPATH=. python3 benchmarks/int4_order.py --preset llama3-8b [--rounds 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

from jaxinfer.bench import random_model
from jaxinfer.generate import generate, int_layout_params
from jaxinfer.plan import KernelPolicy, Plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--new", type=int, default=256, help="new tokens per call")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=None, help="the preset's first L layers")
    ap.add_argument("--no-bf16", action="store_true")
    args = ap.parse_args(argv)
    prompt = [(i * 7919) % 20000 + 100 for i in range(args.prompt_len)]  # token ids

    def timed(model):
        generate(model, [prompt], max_new_tokens=args.new, stop=[])  # compile
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            (out,) = generate(model, [prompt], max_new_tokens=args.new, stop=[])
            runs.append(time.perf_counter() - t0)
        return statistics.median(runs) * 1e3 / args.new, out.token_ids

    model = random_model(args.preset, "bfloat16", quantization="int4", num_layers=args.layers)

    def ordered(frag: bool):  # the weights with their int4 codes in that order (on the device)
        policy = KernelPolicy(int4_fragment_order=frag)
        return dataclasses.replace(model, policy=policy, params=int_layout_params(
            model.params, Plan(model.config, policy)))
    base, frag = ordered(False), ordered(True)
    del model
    rows = []
    for r in range(args.rounds):
        for name, model in (("int4 K order", base), ("int4 fragment order", frag)):
            ms, tokens = timed(model)
            rows.append({"variant": name, "round": r, "ms_per_token": ms, "tokens": tokens})
            print(f"{args.preset} {name}, round {r}: {ms:.3f} ms/token", flush=True)
    same = all(row["tokens"] == rows[0]["tokens"] for row in rows)
    print(f"int4 tokens the same in every run: {same}")
    if not args.no_bf16:
        del base, frag, ordered
        ms, _ = timed(random_model(args.preset, "bfloat16", num_layers=args.layers))
        rows.append({"variant": "bf16", "round": 0, "ms_per_token": ms})
        print(f"{args.preset} bf16: {ms:.3f} ms/token")
    best = {v: min(r["ms_per_token"] for r in rows if r["variant"] == v)
            for v in dict.fromkeys(r["variant"] for r in rows)}
    for v, ms in best.items():
        ratio = f", {best['bf16'] / ms:.2f}x bf16" if "bf16" in best else ""
        print(f"  {v}: best {ms:.3f} ms/token{ratio}")
    for row in rows:
        row.pop("tokens", None)
        print(json.dumps({"preset": args.preset, **row}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
