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
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk

from jaxinfer import memory, pytree, sampling
from jaxinfer import prompts as prompts_lib
from jaxinfer import sharding as sharding_lib
from jaxinfer.cache import KVCache, check_kv_dtype
from jaxinfer.models import registry
from jaxinfer.ops.dispatch import kernels_on
from jaxinfer.ops.linear import int_layout
from jaxinfer.plan import KernelPolicy, Plan
from jaxinfer.sampling import SamplingParams
from jaxinfer.ops.blocked import plan_block_bytes
from jaxinfer.weights import (Kind, ParamSpec, Parts, QuantizedWeight, cast_floating,
                              dequantize_params)

# Prompt lengths are padded up to one of these buckets (then to multiples of the largest), so a
# new prompt length rarely means a new compilation.
PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
CACHE_ROUND = 256  # cache lengths are multiples of this, for the same reason
# The output columns ([B, N] tokens and logprobs) round up to these, then multiples of the
# largest: max_new_tokens is a traced budget, so -n 8 and -n 50 share one executable.
NEW_TOKEN_BUCKETS = (64, 256, 1024)
# Prefill chunks generate tries, largest first, where the default prefill's activations
# (KernelPolicy.prefill_chunk None: one shot off the CPU) would not fit the device.
AUTO_PREFILL_CHUNKS = (2048, 1024, 512, 256)


@pytree.dataclass
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
    prompt_tokens: int = 0  # the prompt's length in tokens (after the chat template)
    # With speculative decoding: drafts proposed to this request, those accepted (emitted as
    # proposed), and the rounds that checked drafts: verifications (K drafts each) and the
    # fallback's probes (a plain step checking the drafter's 1; never accepted: the step
    # emits its own token).
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    verifications: int | None = None


def bucket(n: int, buckets: Sequence[int]) -> int:
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


def _sample(logits: jax.Array, state: DecodeState, positions: jax.Array, plan: Plan):
    """Sample one token per row; the key of row b depends only on (seed_b, request_b, position).
    -> (tokens [B], their logprobs [B], or None when no row asked for them: the logsumexp over
    the vocabulary and the logprobs' column write are then left out of the step)."""
    keys = sampling.step_keys(state.sampler, positions)
    out = sampling.sample_with_logprobs(logits, keys, state.sampling,
                                        token_counts=state.sampler.token_counts,
                                        seen_mask=state.sampler.seen_mask,
                                        batch_invariant=plan.policy.batch_invariant)
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
    cache = sharding_lib.constrain_cache(cache.replace(lengths=lengths), plan.sharding)
    state = state.replace(cache=cache, positions=lengths)
    new_tokens, new_logprobs = _sample(logits[:, 0], state, lengths, plan)
    return _record(state, new_tokens, new_logprobs)


def _decode_step(params: dict, state: DecodeState, plan: Plan) -> DecodeState:
    """One token for every row: (params, state) -> state. Finished rows stay where they are
    (they recompute their last slot), so no row ever reads or writes past its budget."""
    positions = state.positions  # [B]
    forward = registry.family(plan.config).forward
    logits, cache = forward(params, state.tokens[:, None], positions[:, None], plan,
                            state.cache)  # [B, 1, V]
    nxt = jnp.where(state.done, positions, positions + 1)
    cache = sharding_lib.constrain_cache(cache.replace(lengths=nxt), plan.sharding)
    state = state.replace(cache=cache, positions=nxt)
    new_tokens, new_logprobs = _sample(logits[:, 0], state, nxt, plan)
    return _record(state, new_tokens, new_logprobs)


decode_step = jax.jit(_decode_step, static_argnames=("plan",), donate_argnames=("state",))


def steps_per_sync(plan: Plan, state: DecodeState) -> int:
    """Decode steps between the host's checks for the end (static: the state's stop ids)."""
    policy = plan.policy
    return policy.steps_per_sync_no_stop if state.stop_ids.shape[0] == 0 else policy.steps_per_sync


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("state",))
def decode_loop(params: dict, state: DecodeState, plan: Plan,
                until: jax.Array | None = None) -> DecodeState:
    """Decode until every row is done (or, with `until` [] int32, until that many tokens are
    out: a caller showing progress runs the loop in segments), inside one executable. XLA's GPU
    while loop copies its predicate to the host after every iteration, so the host checks for
    the end once every k steps (the plan's steps_per_sync, or steps_per_sync_no_stop when the
    state has no stop ids: such runs end exactly at their largest budget, so no block
    overshoots) while k more fit in the output and the largest row budget, then once per step:
    no step runs past the token budget; only an early stop of every row (a stop id) can leave
    up to k - 1 no-op steps (a finished row rewrites its last slot)."""
    k = steps_per_sync(plan, state)
    step = functools.partial(_decode_step, params, plan=plan)
    n = state.output.shape[1]

    def running(s: DecodeState, room: int):
        # Without stop ids a row is done exactly at its budget: the largest one ends the run.
        end = jnp.minimum(n, jnp.max(s.budget))
        if until is not None:
            end = jnp.minimum(end, until)
        return ~jnp.all(s.done) & (s.step + room <= end)

    if k > 1:
        state = jax.lax.while_loop(lambda s: running(s, k),
                                   lambda s: jax.lax.fori_loop(0, k, lambda _, s: step(s), s),
                                   state)
    return jax.lax.while_loop(lambda s: running(s, 1), step, state)


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("state", "last"))
def prefill_chunk(params: dict, tokens: jax.Array, start: jax.Array, lengths: jax.Array,
                  state: DecodeState, last: jax.Array, plan: Plan):
    """One chunk of a long prefill: tokens [B, C] at positions start.. start + C - 1 go into the
    cache, attending to everything before them. last [B, V] float32 takes each row's logits
    of its last prompt token when that token is in this chunk. -> (state, last)."""
    b, c = tokens.shape
    positions = start + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
    forward = registry.family(plan.config).forward
    logits, cache = forward(params, tokens, positions, plan, state.cache,
                            logits_at=jnp.clip(lengths - 1 - start, 0, c - 1))  # [B, 1, V]
    here = (lengths - 1 >= start) & (lengths - 1 < start + c)
    cache = sharding_lib.constrain_cache(cache, plan.sharding)
    return state.replace(cache=cache), jnp.where(here[:, None], logits[:, 0], last)


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("state",))
def sample_first(last: jax.Array, lengths: jax.Array, state: DecodeState,
                 plan: Plan) -> DecodeState:
    """After the chunks: the first new token of every row from its last prompt logits."""
    state = state.replace(cache=state.cache.replace(lengths=lengths), positions=lengths)
    new_tokens, new_logprobs = _sample(last, state, lengths, plan)
    return _record(state, new_tokens, new_logprobs)


def prefill_chunk_size(plan: Plan) -> int:
    """The plan's prefill chunk in tokens, 0 for one shot (KernelPolicy.prefill_chunk)."""
    chunk = plan.policy.prefill_chunk
    if chunk is None:
        return 1024 if jax.default_backend() == "cpu" else 0
    return chunk


# ---------------------------------------------------------------------------------------------
# Host side: prompts -> ids, checks, the state, and ids -> Completion
# ---------------------------------------------------------------------------------------------


def _stop_ids(model, stop, ignore_eos: bool = False) -> tuple[list[int], list[str]]:
    """(stop token ids: EOS unless ignore_eos, and stop's ids; stop strings)."""
    if not isinstance(ignore_eos, bool):
        raise ValueError(f"ignore_eos must be True or False, got {ignore_eos!r}")
    ids = set()
    if not ignore_eos:
        ids |= set(model.config.eos_token_ids)
        if model.tokenizer is not None:
            ids |= set(model.tokenizer.eos_token_ids)
    strings = []
    stops = [] if stop is None else [stop] if isinstance(stop, (str, int)) else stop
    if not isinstance(stops, (list, tuple)):
        raise ValueError(f"stop must be a string, a token id or a list of them, got "
                         f"{type(stop).__name__}")
    for s in stops:
        if isinstance(s, str):
            if not s:
                raise ValueError("stop strings must not be empty")
            strings.append(prompts_lib.check_text(s, "a stop string"))
        elif isinstance(s, (int, np.integer)) and not isinstance(s, bool):
            if not 0 <= s < model.config.vocab_size:
                raise ValueError(f"stop token id {s} is outside the vocabulary "
                                 f"[0, {model.config.vocab_size})")
            ids.add(int(s))
        else:
            raise ValueError(f"stop entries must be strings or token ids, got "
                             f"{type(s).__name__} {s!r}")
    return sorted(ids), strings


def init_state(model, prompt_ids: list[list[int]], max_new_tokens: int,
               sampling_params: list[SamplingParams], seed: int, stop_ids: list[int],
               max_seq_len: int | None = None, prompt_multiple: int = 1,
               kv_cache_dtype: str | None = None, sharding=None, reserve: int = 0,
               ) -> tuple[DecodeState, jax.Array, jax.Array]:
    """Check lengths and memory, allocate the cache, and build (state, padded prompt tokens
    [B, T], lengths [B]). The prompt pads to a bucket (a multiple of `prompt_multiple`), the
    cache to a multiple of CACHE_ROUND, the output to NEW_TOKEN_BUCKETS: a new prompt length or
    max_new_tokens then mostly reuses the compiled executables (the budget is a traced value).
    kv_cache_dtype: None (the model's dtype), "int8" or "fp8" (cache.py). sharding: the
    plan's (jaxinfer/sharding.py): the cache is allocated in its shards, the rest replicated.
    reserve: cache slots past the last token's (a speculative verification writes K drafts
    there; the caller checks that they fit the context)."""
    check_kv_dtype(kv_cache_dtype, "kv_cache_dtype")
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
    if reserve and need + reserve > min(context, max_seq_len or context):
        room = min(context, max_seq_len or context) - need
        raise ValueError(f"num_speculative_tokens {reserve} is more than the context left "
                         f"({room} slots after the longest prompt of {longest} tokens and "
                         f"max_new_tokens {max_new_tokens}: a verification writes K drafts past "
                         "the last token); lower num_speculative_tokens or max_new_tokens")
    t = min(bucket(longest, PROMPT_BUCKETS), context)
    t = -(-t // prompt_multiple) * prompt_multiple
    s = max_seq_len or min(bucket(need + reserve, (CACHE_ROUND,)), context)
    s = max(s, t)
    n = bucket(max_new_tokens, NEW_TOKEN_BUCKETS)
    b = len(prompt_ids)
    chunk = prompt_multiple if prompt_multiple > 1 else t  # the largest prefill step's tokens
    memory.check_request(config, b, t, s, chunk, kv_cache_dtype, sharding,
                         quantized=has_quantized(model.params))
    tokens = np.zeros((b, t), np.int32)
    for i, p in enumerate(prompt_ids):
        tokens[i, :len(p)] = p
    lengths = np.array([len(p) for p in prompt_ids], np.int32)
    tensors = sampling.SamplingTensors.from_params(sampling_params)
    state = DecodeState(
        tokens=jnp.zeros((b,), jnp.int32),
        positions=jnp.asarray(lengths),
        cache=_new_cache(config, b, s, kv_cache_dtype, sharding),
        sampler=sampling.SamplerState.init(seed, sampling_params, prompt_ids,
                                           config.vocab_size, tensors),
        sampling=tensors,
        done=jnp.zeros((b,), bool),
        budget=jnp.full((b,), max_new_tokens, jnp.int32),
        output=jnp.full((b, n), -1, jnp.int32),
        logprobs=jnp.zeros((b, n), jnp.float32),
        step=jnp.zeros((), jnp.int32),
        stop_ids=jnp.asarray(stop_ids, jnp.int32).reshape(-1),  # [K]; K = 0: none
    )
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    if sharding is not None:
        cache = state.cache
        state, tokens, lengths = sharding_lib.replicated((state.replace(cache=None), tokens,
                                                          lengths), sharding)
        state = state.replace(cache=cache)
    return state, tokens, lengths


def _new_cache(config, batch: int, slots: int, kv_dtype, sharding):
    """A zeroed cache; with a sharding, allocated in its shards (never whole on one device)."""
    init = functools.partial(KVCache.init, config, batch, slots, kv_dtype=kv_dtype)
    if sharding is None:
        return init()
    shardings = sharding_lib.cache_shardings(jax.eval_shape(init), sharding)
    return jax.jit(init, out_shardings=shardings)()


def _finish(model, ids: list[int], logprobs: list[float], stop_ids, stop_strings,
            want_logprobs: bool, prompt_tokens: int) -> Completion:
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
                      logprobs=logprobs if want_logprobs else None, prompt_tokens=prompt_tokens)


@dataclasses.dataclass
class _Request:
    ids: list[list[int]]
    state: DecodeState
    tokens: jax.Array  # [B, T]
    lengths: jax.Array  # [B]
    stop_ids: list[int]
    stop_strings: list[str]
    sampling: list[SamplingParams]
    plan: Plan
    max_new_tokens: int
    params: dict  # what the compiled functions take (run_params)


def _read_whole(path) -> bool:
    """Whether an op reads this weight whole rather than through the matmul ops (which
    dequantize a tile at a time, ops/blocked.py): MLA's absorbed kv_b (ops/mla.py). Stacked
    experts stay codes: ops/moe.py's paths dequantize the chosen experts' slices (decode) or
    a layer's experts (prefill) inside the step."""
    return jax.tree_util.keystr(path).endswith("['wkv_b']")


@functools.partial(jax.jit, static_argnames=("plan", "blocked"))
def _dequantized(params, plan: Plan, blocked: bool = False):
    """params with their QuantizedWeights dequantized and cast to the model's dtype; with
    blocked, only those an op reads whole (_read_whole)."""
    config = plan.config
    specs = registry.family(config).param_specs(config)
    if blocked:
        def one(path, spec, p):
            if not _read_whole(path):
                return p
            return cast_floating(dequantize_params(p, spec), config.dtype, spec)
        return jax.tree_util.tree_map_with_path(one, specs, params,
                                                is_leaf=lambda s: isinstance(s, ParamSpec))
    return cast_floating(dequantize_params(params, specs), config.dtype, specs)


def has_quantized(params) -> bool:
    """Whether params hold a quantized matmul weight (alone or among Parts)."""
    return any(isinstance(w, QuantizedWeight | Parts) for w in jax.tree.leaves(
        params, is_leaf=lambda a: isinstance(a, QuantizedWeight | Parts)))


def int_layout_params(params, plan: Plan):
    """params with their quantized matmul weights (alone, among Parts, or a layer's stacked
    experts) in the layout the plan's kernels read (jaxinfer/ops/linear.int_layout): "nk" for
    the Mosaic GPU kernel where a weight fits it (pk.nk_unfit: int4 / int8 / fp8, GGUF's block
    types), else the tiles the Triton kernels read. Embedding tables keep theirs."""
    layout = int_layout(plan)
    specs = registry.family(plan.config).param_specs(plan.config)

    frag = plan.policy.int4_fragment_order

    def convert(p):
        if not isinstance(p, QuantizedWeight) or p.layout == layout and (
                layout == "tiles" or p.frag == frag or p.planes[0].dtype != jnp.int4):
            return p
        if layout == "tiles":
            return _to_tiles(p)
        return p if pk.nk_unfit(p) is not None else _to_nk(p, frag=frag)

    def one(spec, p):
        if spec.kind not in (Kind.DENSE, Kind.EXPERTS):
            return p
        if isinstance(p, Parts):  # a Q4_K_M layer's q, k (Q4_K) and v (Q6_K): each its own
            return dataclasses.replace(p, parts=tuple(convert(q) for q in p.parts))
        return convert(p)
    return jax.tree.map(one, specs, params, is_leaf=lambda s: isinstance(s, ParamSpec))


_to_nk = jax.jit(pk.to_nk, static_argnames=("frag",))
_to_tiles = jax.jit(lambda w: pk.to_tiles(w))


def run_params(model, plan: Plan):
    """The params a request's compiled functions take. Where the ops take the references
    (the CPU; KernelPolicy.reference()) the matmuls dequantize their weights a tile at a time
    inside each step where the plan says (KernelPolicy.dequant_block_bytes, the CPU's
    default; not on a sharded plan), so only weights an op reads whole (MLA's kv_b) are dequantized here,
    once per request; with 0 every quantized weight is, in one jitted call, rather than in
    every prefill and decode step: the model keeps its codes between requests, and a
    step-by-step stream does not dequantize per token."""
    params = model.params
    if has_quantized(params):
        params = int_layout_params(params, plan)
    if has_quantized(params) and not kernels_on(plan, plan.config.dtype):
        blocked = plan_block_bytes(plan) > 0
        specs = registry.family(plan.config).param_specs(plan.config)
        whole = any(_read_whole(path) for path, _ in
                    jax.tree_util.tree_leaves_with_path(
                        specs, is_leaf=lambda s: isinstance(s, ParamSpec)))
        if not blocked or whole:
            params = _dequantized(params, plan, blocked)
    if plan.sharding is not None:  # placed as the rules say (no copy where they already are)
        specs = registry.family(plan.config).param_specs(plan.config)
        params = sharding_lib.shard_params(params, specs, plan.sharding)
    return params


def fitting_state(model, prompt_ids: list[list[int]], max_new_tokens: int,
                  sampling_params: list[SamplingParams], seed: int, stop_ids: list[int],
                  plan: Plan, max_seq_len: int | None = None, kv_cache_dtype: str | None = None,
                  reserve: int = 0, one_shot: bool = False
                  ) -> tuple[DecodeState, jax.Array, jax.Array, Plan]:
    """init_state for the plan's prefill (the prompt padded to whole chunks where it takes
    more than one) -> (state, tokens, lengths, plan). Where the default prefill's activations
    (KernelPolicy.prefill_chunk None: one shot off the CPU) would not fit the device, the
    prompts go in the largest of AUTO_PREFILL_CHUNKS that fits, as a serving engine would,
    and the plan returned says so; an explicit prefill_chunk is kept (memory.OutOfMemory).
    one_shot: one shot first wherever the plan's chunk is the default (the plan returned
    then names the prefill_chunk it took, 0 for one shot)."""
    longest = max(len(p) for p in prompt_ids)
    auto = plan.policy.prefill_chunk is None
    if one_shot and auto:
        plan = dataclasses.replace(plan, policy=plan.policy.replace(prefill_chunk=0))
    chunk = prefill_chunk_size(plan)

    def state_for(chunk):
        multiple = chunk if chunk and longest > chunk else 1
        return init_state(model, prompt_ids, max_new_tokens, sampling_params, seed, stop_ids,
                          max_seq_len, multiple, kv_cache_dtype, plan.sharding, reserve)
    try:
        return (*state_for(chunk), plan)
    except memory.OutOfMemory:
        chunks = [c for c in AUTO_PREFILL_CHUNKS if c < min(chunk or longest, longest)]
        if not auto or not chunks:
            raise
    for c in chunks:
        try:
            out = state_for(c)
        except memory.OutOfMemory:
            if c == chunks[-1]:  # the least this request needs
                raise
            continue
        return (*out, dataclasses.replace(plan, policy=plan.policy.replace(prefill_chunk=c)))


def prefill_prompts(params, tokens: jax.Array, lengths: jax.Array, state: DecodeState,
                    plan: Plan, longest: int, bar=None) -> DecodeState:
    """The prompts [B, T] into the cache and the first new token: one shot, or where the
    longest prompt (tokens, known on the host) takes more than the plan's prefill chunk,
    chunk by chunk against the cache (fitting_state padded T to whole chunks), a tick of
    `bar` (tqdm) per chunk."""
    chunk = prefill_chunk_size(plan)
    plan = plan.loop_free()
    b, t = tokens.shape
    if not chunk or longest <= chunk:
        return prefill(params, tokens, lengths, state, plan)
    last = jnp.zeros((b, plan.config.vocab_size), jnp.float32)
    tokens = np.asarray(tokens)  # sliced on the host: no slicing op compiled per chunk
    for start in range(0, t, chunk):
        state, last = prefill_chunk(params, tokens[:, start:start + chunk], jnp.int32(start),
                                    lengths, state, last, plan)
        if bar is not None and not bar.disable:  # a tick when the chunk is done
            jax.block_until_ready(last)
            bar.update(min(chunk, bar.total - bar.n))
    return sample_first(last, lengths, state, plan)


def _prepare(model, prompts, max_new_tokens, sampling_params, seed, chat, stop, max_seq_len,
             policy, kv_cache_dtype=None, mesh=None, reserve: int = 0,
             ignore_eos: bool = False) -> _Request:
    """Every check on the host, before anything is allocated or compiled."""
    check_kv_dtype(kv_cache_dtype, "kv_cache_dtype")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {type(seed).__name__} {seed!r}")
    if chat is not None and not isinstance(chat, bool):
        raise ValueError(f"chat must be True, False or None (automatic), got {chat!r}")
    plan = _plan(model, policy, mesh)
    ids = prompts_lib.encode(model.tokenizer, prompts, chat, model.config.vocab_size)
    if sampling_params is None:
        sampling_params = SamplingParams(temperature=0.0)  # greedy, as HF generate defaults to
    if isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * len(ids)
    sampling_params = list(sampling_params)
    if len(sampling_params) != len(ids):
        raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(ids)} prompts")
    for i, sp in enumerate(sampling_params):
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling[{i}] must be a SamplingParams, got {type(sp).__name__}")
        sp.check_vocabulary(model.config.vocab_size)
        if sp.top_logprobs:
            raise ValueError("top_logprobs (alternatives per token) are reported by the "
                             "engine (jaxinfer.Engine, jaxinfer serve), not by generate")
    stop_ids, stop_strings = _stop_ids(model, stop, ignore_eos)
    state, tokens, lengths, plan = fitting_state(
        model, ids, int(max_new_tokens), sampling_params, int(seed), stop_ids, plan,
        max_seq_len, kv_cache_dtype, reserve)
    return _Request(ids, state, tokens, lengths, stop_ids, stop_strings, sampling_params, plan,
                    int(max_new_tokens), run_params(model, plan))


def _plan(model, policy, mesh=None) -> Plan:
    """The request's plan: the model's, with policy and mesh (jaxinfer.make_mesh) when given."""
    plan = model.plan
    if policy is not None:
        if not isinstance(policy, KernelPolicy):
            raise ValueError(f"policy must be a jaxinfer.plan.KernelPolicy, got "
                             f"{type(policy).__name__}")
        plan = dataclasses.replace(plan, policy=policy)
    if mesh is not None and (plan.sharding is None or plan.sharding.mesh != mesh):
        plan = dataclasses.replace(plan, sharding=sharding_lib.Sharding.create(mesh,
                                                                               plan.config))
    return plan


def _bar(progress: bool, total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not progress, leave=False, unit="tok")


def _run_prefill(model, req: _Request, progress: bool) -> DecodeState:
    """The prompts into the cache and the first new token (prefill_prompts), with a
    progress bar where they go in chunks."""
    chunk = prefill_chunk_size(req.plan)
    longest = max(len(p) for p in req.ids)
    if not chunk or longest <= chunk:  # one shot: no bar
        return prefill_prompts(req.params, req.tokens, req.lengths, req.state, req.plan,
                               longest)
    with _bar(progress, longest, "prefill") as bar:
        return prefill_prompts(req.params, req.tokens, req.lengths, req.state, req.plan,
                               longest, bar)


# Decode steps per host check when a progress bar is shown (one sync each: negligible).
PROGRESS_STEPS = 32


def generate(model, prompts, max_new_tokens: int = 128, sampling: SamplingParams | None = None,
             seed: int = 0, chat: bool | None = None, stop=None, max_seq_len: int | None = None,
             policy: KernelPolicy | None = None, progress: bool = False,
             kv_cache_dtype: str | None = None, mesh=None, speculative=None,
             num_speculative_tokens: int = 4, ignore_eos: bool = False) -> list[Completion]:
    """Generate for a prompt or a batch of prompts; returns one `Completion` per prompt.

    prompts: a string, token ids, or chat messages ([{"role": ..., "content": ...}], system
    turns included), or a list of those (jaxinfer/prompts.py). chat: strings go through the
    chat template as a user message; None (default) does so when the tokenizer has a template,
    as the CLI does; False feeds them as plain text. sampling: one SamplingParams for all
    prompts or a list with one per prompt. stop: stop strings and/or stop token ids (EOS stops
    too unless ignore_eos: then only max_new_tokens and stop end a row). Request i's random
    stream is derived from (seed, i, position), or from (its own SamplingParams.seed,
    position) when that is set, so it does not depend on the batch.
    policy: the kernel choices (default: the model's); `KernelPolicy.deterministic()` gives
    bitwise-repeatable tokens that do not depend on the rest of the batch either.
    progress: show progress bars (stderr, tqdm) for a chunked prefill and the decode.
    kv_cache_dtype: None (the model's dtype), "int8" or "fp8": a quantized KV cache, about
    half the bytes of a 16-bit one (codes with a scale per token and KV head; jaxinfer/cache.py).
    mesh: run on these devices (`jaxinfer.make_mesh(tp=, dp=, ep=)`, jaxinfer/sharding.py);
    default: the model's (a model loaded with a mesh carries it), else one device.
    speculative: None, "ngram" (prompt lookup; `speculative.NGram` to tune it), a loaded draft
    model with the same tokenizer, or `speculative.DraftModel(model, rejection=True)`:
    num_speculative_tokens drafts per step, verified in one forward of the model; the tokens
    are this function's without speculation (jaxinfer/speculative.py), and each Completion
    counts its draft_tokens and accepted_tokens.
    """
    if speculative is not None:
        from jaxinfer import speculative as spec

        return spec.generate(model, prompts, max_new_tokens, sampling, seed, chat, stop,
                             max_seq_len, policy, progress, kv_cache_dtype, mesh, speculative,
                             num_speculative_tokens, ignore_eos=ignore_eos)
    req = _prepare(model, prompts, max_new_tokens, sampling, seed, chat, stop, max_seq_len,
                   policy, kv_cache_dtype, mesh, ignore_eos=ignore_eos)
    with memory.reporting_oom(f"generating for {len(req.ids)} prompts"):
        state = _run_prefill(model, req, progress)
        if progress:
            with _bar(True, int(max_new_tokens), f"decode x{len(req.ids)}") as bar:
                bar.update(1)
                while not bool(jnp.all(state.done)):
                    state = decode_loop(req.params, state, req.plan,
                                        until=jnp.int32(int(state.step) + PROGRESS_STEPS))
                    bar.update(int(state.step) - bar.n)
        else:
            state = decode_loop(req.params, state, req.plan)
        out = np.asarray(state.output)
        lps = np.asarray(state.logprobs)
    results = []
    for row, sp in enumerate(req.sampling):
        n = int((out[row] >= 0).sum())
        results.append(_finish(model, out[row, :n].tolist(), lps[row, :n].tolist(),
                               req.stop_ids, req.stop_strings, sp.logprobs, len(req.ids[row])))
    return results


@jax.jit
def _newest(state: DecodeState):
    """Row 0's newest token: (its column, the token, done, its logprob), as new arrays."""
    col = state.step - 1
    return col, state.output[0, col], state.done[0], state.logprobs[0, col]


class TextStream:
    """The text of one completion, piece by piece (iterate it). Once it is exhausted,
    `completion` holds the whole `Completion` (token ids, finish reason, logprobs, prompt
    tokens), `time_to_first_token` the seconds from the call to the first piece's token and
    `token_times` (jaxinfer.stream) those to each token: the first decode step's compile shows
    in the second."""

    def __init__(self, pieces: Iterator[str]):
        self._pieces = pieces
        self.completion: Completion | None = None
        self.time_to_first_token: float | None = None
        self.token_times: list[float] = []

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        self._pieces.close()


def stream(model, prompt, max_new_tokens: int = 128, sampling: SamplingParams | None = None,
           seed: int = 0, chat: bool | None = None, stop=None,
           policy: KernelPolicy | None = None, progress: bool = False,
           kv_cache_dtype: str | None = None, mesh=None, speculative=None,
           num_speculative_tokens: int = 4, ignore_eos: bool = False) -> TextStream:
    """The text of one prompt's completion, yielded piece by piece as tokens are decoded.

    Takes one prompt of any form `generate` takes (and the same arguments). Runs the same jitted
    `decode_step` once per token (one host sync per token, which is what streaming needs);
    stops at EOS, a stop token, a stop string, or max_new_tokens. Checks every argument before
    returning, so errors are raised here, not at the first `next()`.
    """
    batch = prompts_lib.as_batch(prompt)
    if len(batch) != 1:
        raise ValueError(f"stream() takes one prompt, got a batch of {len(batch)}; use "
                         "generate() for batches")
    if model.tokenizer is None:
        raise ValueError("stream() needs a tokenizer to turn tokens into text; use generate()")
    t0 = time.perf_counter()
    out = TextStream(iter(()))
    if speculative is not None:  # speculative.py; one host read per round of K + 1 tokens
        from jaxinfer import speculative as spec

        sreq = spec._prepare(model, prompt, max_new_tokens, sampling, seed, chat, stop, None,
                             policy, kv_cache_dtype, mesh, speculative, num_speculative_tokens,
                             ignore_eos=ignore_eos)
        out._pieces = spec.pieces(model, sreq, progress, out, t0)
        return out
    req = _prepare(model, prompt, max_new_tokens, sampling, seed, chat, stop, None, policy,
                   kv_cache_dtype, mesh, ignore_eos=ignore_eos)
    out._pieces = _pieces(model, req, progress, out, t0)
    return out


class StreamText:
    """A stream's text, token by token: what is safe to show now, holding back text that
    could still be the start of a stop string; stop ids add no text."""

    def __init__(self, tokenizer, stop_ids, stop_strings):
        self.decoder = tokenizer.incremental_decoder()
        self.stop_ids, self.stop_strings = stop_ids, stop_strings
        self.hold = max((len(s) - 1 for s in stop_strings), default=0)
        self.text, self.emitted = "", 0

    def feed(self, token: int, finished: bool) -> tuple[str, bool]:
        """-> (the text to show now, whether a stop string ended the stream there)."""
        if token not in self.stop_ids:
            self.text += self.decoder.step(token)
        if finished:
            self.text += self.decoder.flush()
        cut = min((self.text.find(s) for s in self.stop_strings if s in self.text), default=-1)
        end = cut if cut >= 0 else len(self.text) if finished else len(self.text) - self.hold
        piece = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return piece, cut >= 0


def _pieces(model, req: _Request, progress: bool, out: TextStream, t0: float) -> Iterator[str]:
    shown = StreamText(model.tokenizer, req.stop_ids, req.stop_strings)
    want_logprobs = req.sampling[0].logprobs
    with memory.reporting_oom("the prefill"):
        state = _run_prefill(model, req, progress)
    ids, lps = [], []

    def finish():
        out.completion = _finish(model, ids, lps, req.stop_ids, req.stop_strings,
                                 want_logprobs, len(req.ids[0]))

    # From the second token on, the next step is dispatched before this token is read, so the
    # host's work per token (the read, detokenizing, the next dispatch) overlaps the device's.
    # Costs one unused step when a stop token ends the stream; none at the token budget.
    nxt = None
    plan = req.plan.loop_free()  # one step a call: no loop
    while True:
        peek = _newest(state)  # fresh arrays: `state` may be donated to the next step
        if ids and len(ids) + 2 <= req.max_new_tokens:
            nxt = decode_step(req.params, state, plan)
        col, new, done, lp = jax.device_get(peek)
        new = int(new)
        out.token_times.append(time.perf_counter() - t0)
        if out.time_to_first_token is None:
            out.time_to_first_token = out.token_times[0]
        ids.append(new)
        if want_logprobs:
            lps.append(float(lp))
        finished = new in req.stop_ids or bool(done)
        piece, stopped = shown.feed(new, finished)
        if stopped or finished:
            finish()
        if piece:
            yield piece
        if stopped or finished:
            return
        state = nxt if nxt is not None else decode_step(req.params, state, plan)
        nxt = None
