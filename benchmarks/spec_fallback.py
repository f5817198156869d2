"""What rejected drafts cost: plain greedy `generate` against speculation whose drafts are
never accepted (a random, untrained EAGLE head, over the whole vocabulary and over a draft
vocabulary), with the fallback to plain rounds and without it, plus prompt lookup, on a
random-weights preset (issue 38's "no slowdown when drafts are rejected"). Wall time per token of one generate call (median of 3 after a compiling run); the
speculative runs' acceptance counts, and whether their tokens are plain greedy's (on a GPU
under the default policy near-tied bf16 logits of a random model may pick another token in a
T = K + 1 forward than in a T = 1 one; `--policy deterministic` is the bitwise mode).

    PYTHONPATH=. python3 benchmarks/spec_fallback.py --preset llama3-8b [--new 256 --k 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import jax
import numpy as np

from jaxinfer import draft_head
from jaxinfer.bench import POLICIES, random_model
from jaxinfer.generate import generate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=None, help="the preset's first L layers")
    ap.add_argument("--new", type=int, default=256, help="new tokens per call")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="drafts per verification")
    ap.add_argument("--policy", default="default", choices=sorted(POLICIES))
    ap.add_argument("--draft-vocab", type=int, default=32768,
                    help="the draft-vocabulary head's tokens")
    ap.add_argument("--verify-ks", default="",
                    help="more K (e.g. 3,5): the draft-vocabulary head, every round verifying, "
                         "at each (a verification's cost in decode steps at that K)")
    ap.add_argument("--no-ngram", action="store_true", help="skip prompt lookup")
    ap.add_argument("--only", default="",
                    help="these runs only: names' starts separated by ';' (e.g. 'head 32768 "
                         "tokens, fallback;ngram'; plain always runs)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="the runs this many times over, plain first each time (same process)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    model = random_model(args.preset, dtype, policy=POLICIES[args.policy](),
                         num_layers=args.layers)
    prompt = [(i * 7919) % 20000 + 100 for i in range(args.prompt_len)]  # token ids
    head = draft_head.init_eagle(model, 0)
    # with a draft vocabulary of the first N ids (EAGLE-3's 32k): a draft reads D x N
    n = min(args.draft_vocab, model.config.vocab_size)
    small = draft_head.init_eagle(model, 0, d2t=np.arange(n))

    def timed(**kw):
        generate(model, [prompt], max_new_tokens=args.new, stop=[], **kw)  # compile
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            (out,) = generate(model, [prompt], max_new_tokens=args.new, stop=[], **kw)
            runs.append(time.perf_counter() - t0)
        return statistics.median(runs), out

    every = dataclasses.replace(small, adaptive=False)
    extra = [int(k) for k in args.verify_ks.split(",") if k]
    only = [o.strip() for o in args.only.split(";") if o.strip()]
    rows = []
    for r in range(args.rounds):
        plain_s, plain = timed()
        rows.append({"method": "plain", "round": r, "ms_per_token": plain_s * 1e3 / args.new})
        print(f"{args.preset} plain: {rows[-1]['ms_per_token']:.3f} ms/token", flush=True)
        for name, spec, k in (("head, fallback", head, args.k),
                              ("head, every round verifies",
                               dataclasses.replace(head, adaptive=False), args.k),
                              (f"head {n} tokens, fallback", small, args.k),
                              (f"head {n} tokens, every round verifies", every, args.k),
                              ("ngram", "ngram", args.k),
                              *((f"head {n} tokens, every round verifies, K={k}", every, k)
                                for k in extra)):
            if (name == "ngram" and args.no_ngram) or (only and not any(
                    name.startswith(o) for o in only)):
                continue
            s, out = timed(speculative=spec, num_speculative_tokens=k)
            row = {"method": name, "round": r, "k": k, "ms_per_token": s * 1e3 / args.new,
                   "vs_plain": plain_s / s, "drafted": out.draft_tokens,
                   "accepted": out.accepted_tokens, "checks": out.verifications,
                   "same_tokens": out.token_ids == plain.token_ids}
            rows.append(row)
            print(f"{args.preset} {name}: {row['ms_per_token']:.3f} ms/token = "
                  f"{row['vs_plain']:.3f}x plain; {out.accepted_tokens}/{out.draft_tokens} "
                  f"drafts accepted in {out.verifications} checks; plain greedy's tokens: "
                  f"{row['same_tokens']}", flush=True)
    if args.json:
        for r in rows:
            print(json.dumps({"preset": args.preset, "k": args.k, "policy": args.policy, **r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
