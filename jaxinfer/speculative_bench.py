"""`jaxinfer bench --speculative`: what speculation buys, from two measurements.

1. The verification step's cost: one target forward of T = K + 1 tokens per row against a
   cache holding the prompt, against a decode step's forward (T = 1), for each K (median of
   --repeats timed calls, same call, same cache length).
2. Acceptance: `generate(..., speculative=...)` greedy on an input-grounded task (a passage to
   copy-edit or summarize, the kind of text prompt lookup drafts well), reporting the tokens
   each verification yields (its acceptance length), and the wall time against plain
   `generate` on the same prompt (greedy: the same tokens, checked).

The speed-up a device would see is about acceptance length / (verification cost in decode
steps + drafting cost); it is printed as that estimate, labelled as one, beside the measured
end-to-end wall-time ratio of this backend.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import statistics
import time
import types

import jax
import jax.numpy as jnp

from jaxinfer.cache import KVCache
from jaxinfer.generate import generate, run_params
from jaxinfer.models import registry
from jaxinfer.plan import Plan

log = logging.getLogger(__name__)

# Input-grounded tasks: most of the answer is already in the prompt.
PASSAGE = (
    "The lighthouse at Point Caldera was built in 1874 to guide grain ships into the harbour "
    "at night. Its keeper, Agnes Morrow, kept the lamp burning for thirty-one years, through "
    "storms that tore the roof from the oil store twice. In 1911 the lamp was replaced by an "
    "electric light, and the keeper's cottage became a museum. Today visitors can climb the "
    "ninety-four steps to the gallery, where the original brass lens still turns slowly "
    "every evening at dusk, and on clear days the grain terminals of the old harbour can be "
    "seen across the bay.")
TASKS = types.MappingProxyType({
    "edit": ("Copy the following passage exactly, but replace every occurrence of "
             "\"lamp\" with \"lantern\". Output only the passage.\n\n" + PASSAGE),
    "summarize": "Summarize the following passage in three sentences.\n\n" + PASSAGE,
})


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("cache",))
def _forward(params, tokens, positions, cache, plan: Plan):
    logits, cache = registry.family(plan.config).forward(params, tokens, positions, plan, cache)
    return logits, cache


def verification_cost(model, batch: int, context: int, ks: list[int], repeats: int) -> dict:
    """ms of a T = 1 forward and of each T = K + 1 forward against a cache of `context` valid
    slots -> {"decode_ms": ..., "verify": [{"k", "ms", "ratio"}]}."""
    plan = model.plan
    params = run_params(model, plan)
    cache = KVCache.init(model.config, batch, context + max(ks) + 1)

    def timed(t: int) -> float:
        nonlocal cache
        tokens = jnp.ones((batch, t), jnp.int32)
        positions = context + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
        logits, cache = _forward(params, tokens, positions, cache, plan)  # compile
        jax.block_until_ready(logits)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            logits, cache = _forward(params, tokens, positions, cache, plan)
            jax.block_until_ready(logits)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    decode = timed(1)
    return {"decode_ms": decode,
            "verify": [{"k": k, "ms": (ms := timed(k + 1)), "ratio": ms / decode} for k in ks]}


def acceptance(model, speculative, k: int, task: str, gen_len: int) -> dict:
    """Greedy generate with and without speculation on TASKS[task]: tokens per verification,
    acceptance rate, wall times (each run once after a warm-up run that compiles), and whether
    the speculative tokens are plain greedy's (a warning where not)."""
    prompt = TASKS[task]
    spec_kw = {"speculative": speculative, "num_speculative_tokens": k}

    def run(**kw):
        generate(model, prompt, max_new_tokens=gen_len, **kw)  # compile
        t0 = time.perf_counter()
        (out,) = generate(model, prompt, max_new_tokens=gen_len, **kw)
        return out, time.perf_counter() - t0

    plain, plain_s = run()
    spec, spec_s = run(**spec_kw)
    same = spec.token_ids == plain.token_ids
    if not same:  # lossless up to the kernels' numerics: a near-tie may pick the other token
        log.warning("%s: speculative greedy tokens differ from plain greedy ones (under "
                    "the default policy a T = K + 1 forward may break a near-tie of logits "
                    "otherwise than T = 1; KernelPolicy.deterministic() is the bitwise mode)",
                    task)
    # The prefill's token is no round's; a verification yields its accepted drafts + 1, a
    # plain step (no n-gram match, or a fallback round) 1, except a last round cut by a stop
    # token or the budget in its accepted drafts (no + 1): the count of plain steps may be
    # one short.
    verifications = spec.verifications
    plain_steps = max(0, len(spec.token_ids) - 1 - spec.accepted_tokens - verifications)
    # A verification drafts K, a fallback's probe 1 (a plain step checking one draft): the
    # probes among the verifications follow from the drafts proposed.
    probes = (k * verifications - spec.draft_tokens) // (k - 1) if k > 1 else 0
    return {"task": task, "k": k, "new_tokens": len(spec.token_ids),
            "drafted": spec.draft_tokens, "accepted": spec.accepted_tokens,
            "acceptance_rate": spec.accepted_tokens / max(spec.draft_tokens, 1),
            "verifications": verifications, "probes": probes, "plain_steps": plain_steps,
            "tokens_per_verification": 1 + spec.accepted_tokens / max(verifications - probes, 1),
            "plain_s": plain_s, "speculative_s": spec_s, "wall_speedup": plain_s / spec_s,
            "same_tokens": same}


def main(args, model, name: str) -> int:
    speculative = args.speculative
    if speculative == "draft":
        from jaxinfer.model import load

        speculative = load(args.draft_model, dtype=args.dtype)
    elif speculative in ("head", "mtp"):  # read and checked once, not per generate
        from jaxinfer import draft_head
        from jaxinfer.speculative import resolve_drafter

        speculative = draft_head.load(args.draft_head, model) if args.draft_head \
            else resolve_drafter(speculative, model)
    ks = args.num_speculative_tokens or [4]
    rows = []
    for b in args.batch:
        cost = verification_cost(model, b, args.prompt_len, sorted(set(ks)), args.repeats)
        for v in cost["verify"]:
            rows.append({"model": name, "backend": jax.default_backend(), "batch": b,
                         "context": args.prompt_len, "decode_ms": cost["decode_ms"], **v})
            print(f"{name} B={b} ctx={args.prompt_len}: verify K={v['k']} {v['ms']:.2f} ms = "
                  f"{v['ratio']:.2f} decode steps ({cost['decode_ms']:.2f} ms)", flush=True)
    ratio = {r["k"]: r["ratio"] for r in rows if r["batch"] == args.batch[0]}
    for k in ks:
        for task in args.tasks:
            a = acceptance(model, speculative, k, task, args.gen_len)
            # decode steps' worth of target forwards: verifications at their measured cost,
            # probes and plain steps one each
            cost = (a["verifications"] - a["probes"]) * ratio[k] + a["probes"] + a["plain_steps"]
            a.update(model=name, backend=jax.default_backend(), method=args.speculative,
                     estimated_speedup=(a["new_tokens"] - 1) / max(cost, 1e-9))
            rows.append(a)
            print(f"{name} {args.speculative} K={k} {task}: {a['tokens_per_verification']:.2f} "
                  f"tokens per verification ({a['accepted']}/{a['drafted']} drafts accepted, "
                  f"{a['probes']} of the verifications one-draft probes, {a['plain_steps']} "
                  f"other plain steps); estimated speed-up "
                  f"{a['estimated_speedup']:.2f}x (tokens / target forwards in decode steps at "
                  f"the measured verification cost; drafting not counted); wall time here "
                  f"{a['plain_s']:.2f} s plain, {a['speculative_s']:.2f} s speculative = "
                  f"{a['wall_speedup']:.2f}x", flush=True)
    if args.json:
        for r in rows:
            print(json.dumps(dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r))
    return 0
