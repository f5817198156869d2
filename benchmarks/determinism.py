"""Is decoding bitwise repeatable and batch-invariant? Random weights of a preset's shapes.

    PYTHONPATH=. python3 benchmarks/determinism.py --preset llama3-8b [--layers N] [--json F]

For each policy (default and deterministic): the float32 logits of a greedy decode of
`--new` tokens, run 3 times (prefill + decode steps inside one jit), compared bit for bit; then
one request's greedy tokens alone and at rows 0 and 3 of batches of 4 and 16 (the other rows
random prompts of other lengths), through `jaxinfer.generate`. Prints a table last.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer
from jaxinfer.cache import KVCache
from jaxinfer.configs import PRESETS
from jaxinfer.model import Model
from jaxinfer.models import registry
from jaxinfer.plan import KernelPolicy, Plan
from jaxinfer.sampling import SamplingParams
from jaxinfer.weights import init_params


@functools.partial(jax.jit, static_argnames=("plan", "new"))
def greedy_logits(params, prompt, plan: Plan, new: int):
    """prompt [B, T] -> the logits of `new` greedy steps, float32 [new, B, V]."""
    forward = registry.family(plan.config).forward
    b, t = prompt.shape
    cache = KVCache.init(plan.config, b, t + new)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, cache = forward(params, prompt, pos, plan, cache, logits_at=jnp.full((b,), t - 1),
                            fresh=True)

    def step(carry, i):
        logits, cache = carry
        token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]  # [B, 1]
        nxt, cache = forward(params, token, jnp.full((b, 1), t + i, jnp.int32), plan, cache)
        return (nxt, cache), logits[:, -1]

    _, out = jax.lax.scan(step, (logits, cache), jnp.arange(new))
    return out


def random_model(preset: str, layers: int | None = None) -> Model:
    config = PRESETS[preset].replace(dtype="bfloat16")
    config = config.replace(num_layers=layers or config.num_layers)
    specs = registry.family(config).param_specs(config)
    return Model(config, init_params(specs, jax.random.key(0), jnp.bfloat16))


def check(model, policy: KernelPolicy, new: int = 64, seed: int = 1) -> dict:
    """3 runs of a greedy decode's logits compared bit for bit, and one request's tokens alone
    and in batches (see the module docstring)."""
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    prompt = rng.integers(0, vocab, (1, 48)).astype(np.int32)
    plan = Plan(model.config, policy)
    runs = [np.asarray(greedy_logits(model.params, jnp.asarray(prompt), plan, new))
            for _ in range(3)]
    repeat = all(np.array_equal(runs[0], r) for r in runs[1:])
    diff = max(float(np.abs(runs[0] - r).max()) for r in runs[1:])
    request = prompt[0].tolist()
    greedy = SamplingParams(temperature=0.0)

    def tokens(prompts, row):
        out = jaxinfer.generate(model, prompts, max_new_tokens=new, sampling=greedy,
                                policy=policy)
        return out[row].token_ids

    alone = tokens([request], 0)
    invariant = {}
    for batch in (4, 16):
        # Other prompts of other lengths (one compile per batch size: the longest sets the
        # padded prompt and cache lengths, which differ from the request's alone).
        others = [rng.integers(0, vocab, int(rng.integers(8, 300))).tolist()
                  for _ in range(batch)]
        others[1] = rng.integers(0, vocab, 300).tolist()
        for row in (0, 3):
            prompts = list(others)
            prompts[row] = request
            invariant[f"b{batch}r{row}"] = tokens(prompts, row) == alone
    return dict(bitwise_repeatable=repeat, max_logit_diff=diff, batch_invariant=invariant)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--layers", type=int, default=None, help="fewer layers (same shapes)")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--policies", default="default,deterministic")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model = random_model(args.preset, args.layers)
    results = {}
    for name in args.policies.split(","):
        policy = KernelPolicy.deterministic() if name == "deterministic" else KernelPolicy()
        results[name] = check(model, policy, args.new, seed=1)
        print(name, json.dumps(results[name]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n{'policy':14s} {'3 runs bitwise':>15s} {'max |diff|':>11s}  alone = rows 0/3 of 4/16")
    for name, r in results.items():
        inv = " ".join(f"{k}:{'yes' if v else 'NO'}" for k, v in r["batch_invariant"].items())
        print(f"{name:14s} {str(r['bitwise_repeatable']):>15s} {r['max_logit_diff']:11.3g}  {inv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
