"""Is decoding bitwise repeatable and batch-invariant? Random weights of a preset's shapes.

    PYTHONPATH=. python3 benchmarks/determinism.py --preset llama3-8b [--layers N] [--json F]
        [--checks generate,rows,chunks,time,probe] [--batches 16,64,256] [--time-batches 1,64]
    (run_h200.sh det: generate on the whole model, rows,chunks,probe on 4 layers, time on the
    whole model: each a few compiles per policy, so each its own call under 10 minutes)
    PYTHONPATH=. python3 benchmarks/determinism.py --tiny --interpret --batches 4,20 \
        --time-batches 1,4   # the same code on a CPU (interpret mode, a tiny model): a smoke run

For each policy (default and deterministic), the checks asked for:
- generate: the float32 logits of a greedy decode of `--new` tokens, run 3 times (prefill +
  decode steps inside one jit), compared bit for bit; then one request's greedy tokens alone
  and at rows 0 and 3 of batches of `--generate-batches` (4, 16; the other rows random
  prompts of other lengths), through `jaxinfer.generate`.
- rows: one decode step (random caches of `--cache-len` slots): a request's float32 logits,
  their logsumexp (the logprobs' normalizer) and its new K/V alone, bit for bit against the
  same row at the first, a middle and the last index of batches of `--batches` rows (the
  other rows random tokens, caches and positions).
- chunks: a prompt of 48 tokens prefilled as the prefill_chunk path does (contiguous cache),
  in one call and as 16 + 32: the last token's logits and the cache, bit for bit. (Attention
  of a chunk against the cache is the jnp attention: XLA's GEMMs on the GPU, by T.)
- time: ms per decode step (jit, cache of --cache-len, median of --iters) at --time-batches.
- probe (once, not per policy): one fused matmul's rows at block_m 16, 64 and 128 with the same
  block_k and split (the deterministic tiles are block_m 16 at every M; equal bits here would
  allow larger tiles for large M).
Prints a table last.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer
from jaxinfer.cache import KVCache
from jaxinfer.configs import PRESETS, Config, RopeScaling
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


TINY = Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0,
              max_position_embeddings=2048, tie_word_embeddings=False, dtype="bfloat16",
              rope_scaling=RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0,
                                       original_max_position_embeddings=16))


def random_model(preset: str, layers: int | None = None) -> Model:
    config = TINY if preset == "tiny" else PRESETS[preset].replace(dtype="bfloat16")
    config = config.replace(num_layers=layers or config.num_layers)
    specs = registry.family(config).param_specs(config)
    return Model(config, init_params(specs, jax.random.key(0), jnp.bfloat16))


def check(model, policy: KernelPolicy, new: int = 64, seed: int = 1,
          batches=(4, 16)) -> dict:
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
    for batch in batches:
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


def _decode_once(params, tokens, positions, cache, plan: Plan):
    """One decode step: tokens, positions [B, 1] -> (logits [B, V] float32, their logsumexp
    [B], the cache)."""
    forward = registry.family(plan.config).forward
    logits, cache = forward(params, tokens, positions, plan, cache)
    return logits[:, 0], jax.nn.logsumexp(logits[:, 0], axis=-1), cache


decode_once = jax.jit(_decode_once, static_argnames=("plan",))
# The timed step updates its cache in place (no copy of the whole cache per step).
decode_donated = jax.jit(_decode_once, static_argnames=("plan",), donate_argnames=("cache",))


def decode_inputs(config, b: int, cache_len: int, seed: int, request=None, at=()):
    """b rows of random tokens, positions and cache contents; the request's own at rows
    `at` (request: (k, v per layer [S, Hkv, D], token [1], position [1]))."""
    keys = jax.random.split(jax.random.key(seed), 4)
    shape = (b, cache_len, config.num_kv_heads, config.head_dim)

    def layers(key):
        return [jax.random.normal(k, shape, jnp.float32).astype(config.dtype)
                for k in jax.random.split(key, config.num_layers)]
    ks, vs = layers(keys[0]), layers(keys[1])
    tokens = jax.random.randint(keys[2], (b, 1), 0, config.vocab_size)
    positions = jax.random.randint(keys[3], (b, 1), cache_len // 4, cache_len)
    if request is not None:
        rk, rv, token, position = request
        at = jnp.asarray(at)
        ks = [k.at[at].set(r) for k, r in zip(ks, rk)]
        vs = [v.at[at].set(r) for v, r in zip(vs, rv)]
        tokens, positions = tokens.at[at].set(token), positions.at[at].set(position)
    return tokens, positions, KVCache(tuple(ks), tuple(vs), positions[:, 0])


def rows_check(model, policy: KernelPolicy, batches, cache_len: int) -> dict:
    """A request's decode step alone vs at the first, a middle and the last row of each batch
    size: {"b64": True, ...} (logits, logsumexp and new K/V all bitwise equal)."""
    plan, config = Plan(model.config, policy), model.config
    tokens, positions, cache = decode_inputs(config, 1, cache_len, 7)
    request = ([k[0] for k in cache.k], [v[0] for v in cache.v], tokens[0], positions[0])
    logits, lse, new = decode_once(model.params, tokens, positions, cache, plan)
    alone = (np.asarray(logits[0]), np.asarray(lse[0]),
             [np.asarray(a[0]) for a in new.k + new.v])
    del cache, new
    out = {}
    for b in batches:
        at = sorted({0, b // 2 + 1 if b > 2 else 0, b - 1})
        inputs = decode_inputs(config, b, cache_len, 100 + b, request, at)
        logits, lse, new = decode_once(model.params, *inputs, plan)
        del inputs
        same = all(np.array_equal(np.asarray(logits[i]), alone[0])
                   and np.array_equal(np.asarray(lse[i]), alone[1])
                   and all(np.array_equal(np.asarray(a[i]), r)
                           for a, r in zip(new.k + new.v, alone[2])) for i in at)
        out[f"b{b}"] = bool(same)
        del logits, lse, new
    return out


@functools.partial(jax.jit, static_argnames=("plan",))
def prefill_part(params, tokens, start, logits_at, cache, plan: Plan):
    """generate.prefill_chunk's forward: tokens [B, C] at start.. into the contiguous cache."""
    b, c = tokens.shape
    positions = start + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
    forward = registry.family(plan.config).forward
    return forward(params, tokens, positions, plan, cache, logits_at=logits_at)


def chunks_check(model, policy: KernelPolicy, t: int = 48, first: int = 16) -> dict:
    """A prompt of t tokens in one prefill_chunk-style call vs first + (t - first) tokens."""
    plan, config = Plan(model.config, policy), model.config
    b = 2
    ids = jax.random.randint(jax.random.key(11), (b, t), 0, config.vocab_size)
    empty = KVCache.init(config, b, t)
    last = jnp.full((b,), t - 1, jnp.int32)
    one, one_cache = prefill_part(model.params, ids, 0, last, empty, plan)
    _, cache = prefill_part(model.params, ids[:, :first], 0, jnp.zeros((b,), jnp.int32), empty,
                            plan)
    two, two_cache = prefill_part(model.params, ids[:, first:], first, last - first, cache, plan)
    return dict(last_logits=bool(np.array_equal(np.asarray(one), np.asarray(two))),
                cache=all(np.array_equal(np.asarray(a), np.asarray(r))
                          for a, r in zip(one_cache.k + one_cache.v,
                                          two_cache.k + two_cache.v)))


def time_steps(model, policy: KernelPolicy, batches, cache_len: int, iters: int) -> dict:
    """ms per decode step at each batch size (median of iters, after a warm-up)."""
    plan = Plan(model.config, policy)
    out = {}
    for b in batches:
        tokens, positions, cache = decode_inputs(model.config, b, cache_len, 3)
        for _ in range(2):  # the second call's cache is the step's own output (its layout)
            cache = jax.block_until_ready(decode_donated(model.params, tokens, positions,
                                                         cache, plan))[2]
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            cache = jax.block_until_ready(decode_donated(model.params, tokens, positions,
                                                         cache, plan))[2]
            times.append(time.perf_counter() - t0)
        out[f"b{b}"] = round(1e3 * float(np.median(times)), 4)
        del cache
    return out


def tile_probe(k: int, n: int, interpret: bool, rows: int = 256) -> dict:
    """x [rows, k] @ w [k, n] through the fused matmul at block_m 16, 64, 128 (128 also with 8
    warps; the deterministic tiles' block_k and split otherwise), and row 0 alone (M = 1):
    bitwise equal to block_m 16's? {"m1_bm16": ..., "bm64": ..., "bm128": ..., ...}."""
    import dataclasses

    import pallas_kernels as pk
    from pallas_kernels.norm_matmul import default_block_sizes

    x = jax.random.normal(jax.random.key(1), (rows, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(2), (k, n), jnp.float32) / k ** 0.5
         ).astype(jnp.bfloat16)
    base = default_block_sizes(16, n, k)

    def run(xs, block_m, **change):
        blocks = dataclasses.replace(base, block_m=block_m, **change)
        return np.asarray(pk.norm_matmul(xs, None, w, out_dtype=jnp.float32,
                                         interpret=interpret, block_sizes=blocks))
    ref = run(x, 16)
    out = {"m1_bm16": bool(np.array_equal(run(x[:1], 16)[0], ref[0]))}
    # 2 stages where 3 would not fit the shared memory (stages do not change the sums).
    for name, bm, change in (("bm64", 64, {}), ("bm128", 128, dict(num_stages=2)),
                             ("bm128w8", 128, dict(num_stages=2, num_warps=8))):
        try:
            out[name] = bool(np.array_equal(run(x, bm, **change), ref))
        except Exception as e:  # a tile that does not fit: say so, go on
            out[name] = f"failed: {type(e).__name__}"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--layers", type=int, default=None, help="fewer layers (same shapes)")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--policies", default="default,deterministic")
    p.add_argument("--checks", default="generate,rows,chunks,time,probe")
    p.add_argument("--batches", default="16,64,256", help="rows: batch sizes")
    p.add_argument("--generate-batches", default="4,16", help="generate: batch sizes")
    p.add_argument("--time-batches", default="1,64", help="time: batch sizes")
    p.add_argument("--cache-len", type=int, default=1024, help="rows, time: cache slots")
    p.add_argument("--iters", type=int, default=20, help="time: steps timed")
    p.add_argument("--tiny", action="store_true", help="a tiny random model (CPU smoke run)")
    p.add_argument("--interpret", action="store_true", help="Pallas kernels in interpret mode")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    checks = set(args.checks.split(","))
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    model = random_model("tiny" if args.tiny else args.preset, args.layers)
    results = {}
    for name in args.policies.split(","):
        extra = dict(interpret=True) if args.interpret else {}
        policy = (KernelPolicy.deterministic(**extra) if name == "deterministic"
                  else KernelPolicy(**extra))
        r = results[name] = {}
        if "generate" in checks:
            r.update(check(model, policy, args.new, seed=1,
                           batches=ints(args.generate_batches)))
        if "rows" in checks:
            r["rows"] = rows_check(model, policy, ints(args.batches), args.cache_len)
        if "chunks" in checks:
            r["chunks"] = chunks_check(model, policy)
        if "time" in checks:
            r["ms_per_step"] = time_steps(model, policy, ints(args.time_batches),
                                          args.cache_len, args.iters)
        print(name, json.dumps(r), flush=True)
    if "probe" in checks:
        k, n = model.config.hidden_size, model.config.hidden_size
        results["probe"] = tile_probe(k, n, args.interpret)
        print("probe", json.dumps(results["probe"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    yes = lambda v: "yes" if v is True else ("NO" if v is False else str(v))  # noqa: E731
    print()
    if "generate" in checks:
        print(f"{'policy':14s} {'3 runs bitwise':>15s} {'max |diff|':>11s}  alone = rows 0/3 "
              f"of {args.generate_batches}")
    for name, r in results.items():
        if "bitwise_repeatable" in r:
            inv = " ".join(f"{k}:{yes(v)}" for k, v in r["batch_invariant"].items())
            print(f"{name:14s} {str(r['bitwise_repeatable']):>15s} "
                  f"{r['max_logit_diff']:11.3g}  {inv}")
    for name, r in results.items():
        if name == "probe":
            print(f"probe (row bits vs block_m 16): "
                  + " ".join(f"{k}:{yes(v)}" for k, v in r.items()))
            continue
        line = []
        if "rows" in r:
            line.append("alone = in batch: " + " ".join(f"{k}:{yes(v)}"
                                                        for k, v in r["rows"].items()))
        if "chunks" in r:
            line.append("one call = chunks: " + " ".join(f"{k}:{yes(v)}"
                                                         for k, v in r["chunks"].items()))
        if "ms_per_step" in r:
            line.append("ms/step: " + " ".join(f"{k}:{v}" for k, v in r["ms_per_step"].items()))
        if line:
            print(f"{name:14s} " + "; ".join(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
