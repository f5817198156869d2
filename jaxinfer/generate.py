"""Prefill, the jitted decode step, and `generate` (batched, reproducible, streaming or not).

Data flow:
    prompts --tokenizer--> ids --prefill--> (first token, cache) --decode_step*--> tokens
The whole decode loop runs inside one jit (`lax.while_loop`) unless streaming, where a Python
loop calls the same jitted `decode_step` and yields tokens as they come.

Ragged batches are right-padded: a row's prompt occupies cache slots [0, len) and its i-th new
token goes to slot len + i, so every row keeps its own positions and batching never changes a
row's result (stale slots past a row's length are masked by causality, see cache.py).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer import sampling
from jaxinfer.cache import KVCache
from jaxinfer.models import registry
from jaxinfer.plan import KernelPolicy, Plan
from jaxinfer.sampling import SamplingParams

# Prompt lengths are padded up to one of these buckets (then to multiples of the largest), so a
# new prompt length rarely means a new compilation.
PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
CACHE_ROUND = 256  # cache lengths are multiples of this, for the same reason


@struct.dataclass
class DecodeState:
    """Everything the decode step reads and writes; donated to each step."""

    tokens: jax.Array  # [B] int32: the last token of each row, input of the next step
    positions: jax.Array  # [B] int32: the position (cache slot) `tokens` will be written to
    cache: KVCache
    sampler: sampling.SamplerState  # keys, penalty counts
    sampling: sampling.SamplingTensors  # per-row sampling parameters
    done: jax.Array  # [B] bool: row finished (EOS, stop token or its token budget)
    budget: jax.Array  # [B] int32: max new tokens of each row
    output: jax.Array  # [B, N] int32: new tokens, -1 where none
    logprobs: jax.Array  # [B, N] float32: logprob of each new token
    step: jax.Array  # [] int32: number of new tokens produced so far (the next output column)
    stop_ids: jax.Array  # [K] int32: token ids that end a row


@dataclasses.dataclass(frozen=True)
class Completion:
    token_ids: list[int]  # new tokens only, the stop token included when one ended the row
    text: str
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    logprobs: list[float] | None = None


def _bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    return -(-n // buckets[-1]) * buckets[-1]


def _record(state: DecodeState, new_tokens: jax.Array,
            new_logprobs: jax.Array | None) -> DecodeState:
    """Write one new token per row into the outputs and update the done mask (logprobs
    None: no row asked for them, and state.logprobs stays zero)."""
    alive = ~state.done
    col = state.step
    output = state.output.at[:, col].set(jnp.where(alive, new_tokens, -1))
    logprobs = state.logprobs
    if new_logprobs is not None:
        logprobs = logprobs.at[:, col].set(jnp.where(alive, new_logprobs, 0.0))
    hit_stop = jnp.any(new_tokens[:, None] == state.stop_ids[None, :], axis=-1)
    done = state.done | (alive & (hit_stop | (col + 1 >= state.budget)))
    return state.replace(tokens=jnp.where(alive, new_tokens, state.tokens), output=output,
                         logprobs=logprobs, done=done, step=col + 1,
                         sampler=sampling.observe(state.sampler, new_tokens, alive))


def _sample(logits: jax.Array, state: DecodeState, positions: jax.Array):
    """Sample one token per row; the key of row b depends only on (seed_b, request_b, position).
    -> (tokens [B], their logprobs [B], or None when no row asked for them: the logsumexp over
    the vocabulary and the logprobs' column write are then left out of the step)."""
    keys = sampling.step_keys(state.sampler, positions)
    out = sampling.sample_with_logprobs(logits, keys, state.sampling,
                                        token_counts=state.sampler.token_counts,
                                        seen_mask=state.sampler.seen_mask)
    return out.tokens, out.logprobs if state.sampling.flags.logprobs else None


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("state",))
def prefill(params: dict, tokens: jax.Array, lengths: jax.Array, state: DecodeState,
            plan: Plan) -> DecodeState:
    """Run the prompts (right-padded tokens [B, T], lengths [B]) and sample the first new token."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    forward = registry.family(plan.config).forward
    logits, cache = forward(params, tokens, positions, plan, state.cache,
                            logits_at=lengths - 1, fresh=True)  # [B, 1, V]
    state = state.replace(cache=cache.replace(lengths=lengths), positions=lengths)
    new_tokens, new_logprobs = _sample(logits[:, 0], state, lengths)
    return _record(state, new_tokens, new_logprobs)


def _decode_step(params: dict, state: DecodeState, plan: Plan) -> DecodeState:
    """One token for every row: (params, state) -> state. Finished rows stay where they are
    (they recompute their last slot), so no row ever reads or writes past its budget."""
    positions = state.positions  # [B]
    forward = registry.family(plan.config).forward
    logits, cache = forward(params, state.tokens[:, None], positions[:, None], plan,
                            state.cache)  # [B, 1, V]
    nxt = jnp.where(state.done, positions, positions + 1)
    state = state.replace(cache=cache.replace(lengths=nxt), positions=nxt)
    new_tokens, new_logprobs = _sample(logits[:, 0], state, nxt)
    return _record(state, new_tokens, new_logprobs)


decode_step = jax.jit(_decode_step, static_argnames=("plan",), donate_argnames=("state",))


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("state",))
def decode_loop(params: dict, state: DecodeState, plan: Plan) -> DecodeState:
    """Decode until every row is done, inside one executable. XLA's GPU while loop copies its
    predicate to the host after every iteration, so the host checks for the end once every k
    steps (the plan's steps_per_sync, or steps_per_sync_no_stop when the state has no stop ids:
    such runs end exactly at their largest budget, so no block overshoots) while k more fit in
    the output and the largest row budget, then once per step: no step runs past the token
    budget; only an early stop of every row (a stop id) can leave up to k - 1 no-op steps (a
    finished row rewrites its last slot)."""
    policy = plan.policy
    k = policy.steps_per_sync_no_stop if state.stop_ids.shape[0] == 0 else policy.steps_per_sync
    step = functools.partial(_decode_step, params, plan=plan)
    n = state.output.shape[1]

    def running(s: DecodeState, room: int):
        # Without stop ids a row is done exactly at its budget: the largest one ends the run.
        end = jnp.minimum(n, jnp.max(s.budget))
        return ~jnp.all(s.done) & (s.step + room <= end)

    if k > 1:
        state = jax.lax.while_loop(lambda s: running(s, k),
                                   lambda s: jax.lax.fori_loop(0, k, lambda _, s: step(s), s),
                                   state)
    return jax.lax.while_loop(lambda s: running(s, 1), step, state)


# ---------------------------------------------------------------------------------------------
# Host side: prompts -> ids, checks, the state, and ids -> Completion
# ---------------------------------------------------------------------------------------------


def _encode_prompts(model, prompts, chat: bool) -> list[list[int]]:
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                    and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a string, a list of strings or a list of token-id "
                         "lists, and not empty")
    ids = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if model.tokenizer is None:
                raise ValueError("this model was loaded without a tokenizer; pass token ids, "
                                 "or load a checkpoint with tokenizer files")
            if chat:
                p = model.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                        add_generation_prompt=True)
            else:
                p = model.tokenizer.encode(p)
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompt {i} is empty (no tokens); give it some text or token ids")
        ids.append(p)
    model.check_tokens(np.array([t for p in ids for t in p])[None])
    return ids


def _stop_ids(model, stop) -> tuple[list[int], list[str]]:
    ids = set(model.config.eos_token_ids)
    if model.tokenizer is not None:
        ids |= set(model.tokenizer.eos_token_ids)
    strings = []
    for s in ([] if stop is None else [stop] if isinstance(stop, (str, int)) else stop):
        if isinstance(s, str):
            if not s:
                raise ValueError("stop strings must not be empty")
            strings.append(s)
        else:
            ids.add(int(s))
    return sorted(ids), strings


def init_state(model, prompt_ids: list[list[int]], max_new_tokens: int,
               sampling_params: list[SamplingParams], seed: int, stop_ids: list[int],
               max_seq_len: int | None = None) -> tuple[DecodeState, jax.Array, jax.Array]:
    """Check lengths, allocate the cache, and build (state, padded prompt tokens, lengths)."""
    config = model.config
    longest = max(len(p) for p in prompt_ids)
    need = longest + max_new_tokens
    context = config.max_position_embeddings
    if need > context:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} = {need} "
                         f"exceeds the model's context of {context} tokens; shorten the prompt or "
                         "lower max_new_tokens")
    if max_seq_len is not None and need > max_seq_len:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} = {need} "
                         f"exceeds max_seq_len {max_seq_len}")
    t = min(_bucket(longest, PROMPT_BUCKETS), context)
    s = max_seq_len or min(_bucket(need, (CACHE_ROUND,)), context)
    s = max(s, t)
    b = len(prompt_ids)
    tokens = np.zeros((b, t), np.int32)
    for i, p in enumerate(prompt_ids):
        tokens[i, :len(p)] = p
    lengths = np.array([len(p) for p in prompt_ids], np.int32)
    tensors = sampling.SamplingTensors.from_params(sampling_params)
    state = DecodeState(
        tokens=jnp.zeros((b,), jnp.int32),
        positions=jnp.asarray(lengths),
        cache=KVCache.init(config, b, s),
        sampler=sampling.SamplerState.init(seed, sampling_params, prompt_ids,
                                           config.vocab_size, tensors),
        sampling=tensors,
        done=jnp.zeros((b,), bool),
        budget=jnp.full((b,), max_new_tokens, jnp.int32),
        output=jnp.full((b, max_new_tokens), -1, jnp.int32),
        logprobs=jnp.zeros((b, max_new_tokens), jnp.float32),
        step=jnp.zeros((), jnp.int32),
        stop_ids=jnp.asarray(stop_ids, jnp.int32).reshape(-1),  # [K]; K = 0: none
    )
    return state, jnp.asarray(tokens), jnp.asarray(lengths)


def _finish(model, ids: list[int], logprobs: list[float], stop_ids, stop_strings,
            want_logprobs: bool) -> Completion:
    """Cut a row at its first stop token or stop string and decode it."""
    reason = "length"
    for i, t in enumerate(ids):
        if t in stop_ids:
            ids, logprobs, reason = ids[: i + 1], logprobs[: i + 1], "stop"
            break
    text = model.tokenizer.decode(ids) if model.tokenizer is not None else ""
    if stop_strings and model.tokenizer is not None:
        hits = [(text.find(s), s) for s in stop_strings if s in text]
        if hits:
            cut, _ = min(hits)
            # Keep the fewest tokens whose text reaches the stop string; drop the string itself.
            for n in range(1, len(ids) + 1):
                if len(model.tokenizer.decode(ids[:n])) > cut:
                    ids, logprobs = ids[:n], logprobs[:n]
                    break
            text, reason = text[:cut], "stop"
    return Completion(token_ids=ids, text=text, finish_reason=reason,
                      logprobs=logprobs if want_logprobs else None)


def _prepare(model, prompts, max_new_tokens, sampling_params, seed, chat, stop, max_seq_len):
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    ids = _encode_prompts(model, prompts, chat)
    if sampling_params is None:
        sampling_params = SamplingParams(temperature=0.0)  # greedy, as HF generate defaults to
    if isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * len(ids)
    if len(sampling_params) != len(ids):
        raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(ids)} prompts")
    stop_ids, stop_strings = _stop_ids(model, stop)
    state, tokens, lengths = init_state(model, ids, int(max_new_tokens), list(sampling_params),
                                        seed, stop_ids, max_seq_len)
    return state, tokens, lengths, stop_ids, stop_strings, sampling_params


def _plan(model, policy) -> Plan:
    if policy is None:
        return model.plan
    if not isinstance(policy, KernelPolicy):
        raise ValueError(f"policy must be a jaxinfer.plan.KernelPolicy, got {type(policy).__name__}")
    return Plan(model.config, policy)


def generate(model, prompts, max_new_tokens: int = 128, sampling: SamplingParams | None = None,
             seed: int = 0, chat: bool = False, stop=None, max_seq_len: int | None = None,
             policy: KernelPolicy | None = None) -> list[Completion]:
    """Generate for a prompt or a batch of prompts; returns one `Completion` per prompt.

    prompts: a string, a list of strings, or token-id lists. chat=True wraps each string as a
    user message in the model's chat template. sampling: one SamplingParams for all prompts or
    a list with one per prompt. stop: stop strings and/or stop token ids (EOS always stops).
    Request i's random stream is derived from (seed, i, position), or from (its own
    SamplingParams.seed, position) when that is set, so it does not depend on the batch.
    policy: the kernel choices (default: the model's); `KernelPolicy.deterministic()` gives
    bitwise-repeatable tokens that do not depend on the rest of the batch either.
    """
    plan = _plan(model, policy)
    state, tokens, lengths, stop_ids, stop_strings, params_list = _prepare(
        model, prompts, max_new_tokens, sampling, seed, chat, stop, max_seq_len)
    state = prefill(model.params, tokens, lengths, state, plan)
    state = decode_loop(model.params, state, plan)
    out = np.asarray(state.output)
    lps = np.asarray(state.logprobs)
    results = []
    for row, sp in enumerate(params_list):
        n = int((out[row] >= 0).sum())
        results.append(_finish(model, out[row, :n].tolist(), lps[row, :n].tolist(),
                               stop_ids, stop_strings, sp.logprobs))
    return results


def stream(model, prompt, max_new_tokens: int = 128, sampling: SamplingParams | None = None,
           seed: int = 0, chat: bool = False, stop=None,
           policy: KernelPolicy | None = None) -> Iterator[str]:
    """Yield the text of one prompt's completion piece by piece as tokens are decoded.

    Runs the same jitted `decode_step` once per token (one host sync per token, which is what
    streaming needs); stops at EOS, a stop token, a stop string, or max_new_tokens.
    """
    plan = _plan(model, policy)
    state, tokens, lengths, stop_ids, stop_strings, _ = _prepare(
        model, [prompt], max_new_tokens, sampling, seed, chat, stop, None)
    if model.tokenizer is None:
        raise ValueError("stream() needs a tokenizer to turn tokens into text; use generate()")
    decoder = model.tokenizer.incremental_decoder()
    # Text that could still be the start of a stop string is held back until it is not.
    hold = max((len(s) - 1 for s in stop_strings), default=0)
    state = prefill(model.params, tokens, lengths, state, plan)
    text, emitted = "", 0
    while True:
        new = int(state.output[0, int(state.step) - 1])
        finished = new in stop_ids or bool(state.done[0])
        if new not in stop_ids:
            text += decoder.step(new)
        if finished:
            text += decoder.flush()
        cut = min((text.find(s) for s in stop_strings if s in text), default=-1)
        if cut >= 0:
            if cut > emitted:
                yield text[emitted:cut]
            return
        safe = len(text) if finished else len(text) - hold
        if safe > emitted:
            yield text[emitted:safe]
            emitted = safe
        if finished:
            return
        state = decode_step(model.params, state, plan)
