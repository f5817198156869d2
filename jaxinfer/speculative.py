"""Speculative decoding: a drafter proposes K tokens, the target scores them in one forward.

One round, for every row (jitted, `spec_round`; `spec_loop` runs rounds in a while loop):

    x = the row's last token at position p (not yet in the cache); history = its tokens so far
    drafts d_1..d_K              n-gram prompt lookup (`NGram`), a draft model (`DraftModel`),
                                 or a head over the target's features (`draft_head.FeatureHead`:
                                 an EAGLE head, or DeepSeek-V3's MTP module)
    verify [x, d_1..d_K]         one target forward, T = K + 1 queries at p..p+K, causal among
                                 themselves (attend: verify_attention on a GPU); logits row j
                                 scores position p+1+j
    target tokens y_0..y_K       the plain sampler at each position, with the key of that
                                 position and the penalty counts as if d_1..d_j were accepted
    accept a = leading drafts with d_j == y_{j-1}; emit y_0..y_a (a + 1 tokens)

Greedy rows take the argmax and sampled rows a Gumbel-max draw keyed by (request, position)
only (sampling.py), so y_j is what plain decoding would sample at that position given the same
prefix: accepting while the drafts equal it ("coupled" acceptance) gives plain `generate`'s
tokens exactly, for any drafter. A draft model (and a head) also drafts with the target's
Gumbel noise of each position, so its draft equals the target's token whenever their perturbed
argmaxes agree.
`DraftModel(..., rejection=True)` instead accepts d_j with probability min(1, p(d_j) / q(d_j))
and on the first rejection samples from max(0, p - q) (Leviathan et al.): the target's law,
not plain generate's tokens. Rejected drafts need no cache work: their slots lie past the row's
new length, and the next round writes over them before attending to them (append precedes
attention in `attend`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import draft_head, memory, pytree, sampling
from jaxinfer import sharding as sharding_lib
from jaxinfer.cache import KVCache
from jaxinfer.generate import (PROGRESS_STEPS, Completion, DecodeState, StreamText, _bar,
                               _finish, _plan, _Request, run_params, steps_per_sync)
from jaxinfer.generate import _prepare as _prepare_request
from jaxinfer.generate import _run_prefill as _target_prefill
from jaxinfer.model import Model
from jaxinfer.models import registry
from jaxinfer.plan import Plan


# ---------------------------------------------------------------------------------------------
# Drafters (static: part of the compiled round)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NGram:
    """Prompt lookup: find the latest earlier occurrence of the row's last n tokens (n from
    max_n down to min_n) in its prompt and output, and propose the K tokens that followed it."""

    max_n: int = 3
    min_n: int = 1

    def __post_init__(self):
        if not (isinstance(self.min_n, int) and isinstance(self.max_n, int)
                and 1 <= self.min_n <= self.max_n):
            raise ValueError(f"NGram needs integers 1 <= min_n <= max_n, got min_n={self.min_n!r}"
                             f" max_n={self.max_n!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class DraftModel:
    """A smaller model with the target's vocabulary drafting K tokens greedily or with the
    target's Gumbel noise (its own KV cache). rejection: rejection sampling (min(1, p/q)) for
    sampled rows instead of the coupled acceptance (module docstring)."""

    model: Model
    rejection: bool = False
    adaptive: bool = True  # plain steps while its drafts are mostly rejected (MIN_GAIN)
    min_gain: float | None = None  # that threshold for this drafter (None: MIN_GAIN)


@dataclasses.dataclass(frozen=True)
class _DraftPlan:
    """The static part of a DraftModel: its plan, acceptance rule and fallback."""

    plan: Plan
    rejection: bool
    adaptive: bool = True
    min_gain: float | None = None


# A draft model's or a head's rounds verify while some live row's recent rounds accepted at
# least MIN_GAIN drafts on average (an average halving each round, from start_gain: two
# verifications with nothing accepted end the first rounds' verifying); below, rounds are plain
# decode steps (T = 1), with a probe after PROBE plain rounds to see whether drafts hit again,
# the wait doubling after each probe that finds them still rejected (up to MAX_PROBE: a probe
# every 8 rounds cost ~6% of a useless head's wall time on the H200). A probe is a plain round
# beside the drafter's first draft: whether that draft equals the token the round emits is all
# it asks (for greedy and coupled rows, what a verification of it would accept), so it costs a
# drafter forward, not a verification (1.15 decode steps at K = 1 on the H200, Llama-3-8B
# shapes). A verification costs 1.1-1.4 decode steps on the H200 and 1.5-1.7 on a CPU
# (benchmarks/DECISIONS.md): it pays from about half a draft accepted.
MIN_GAIN = 0.5
PROBE = 8
MAX_PROBE = 64


# ---------------------------------------------------------------------------------------------
# State
# ---------------------------------------------------------------------------------------------


@pytree.dataclass
class HeadState:
    """A feature head's per-row state (draft_head.py): its cache holds the true pairs
    (t_i, f_{i-1}) through slot pos; the last verification's target features wait to be paired
    with the tokens after them."""

    cache: KVCache  # the head's one-layer cache (a LatentCache for MTP): [B, S, ...]
    feats: jax.Array  # [B, K + 1, D]: the target's features f at positions pos..pos + K
    pos: jax.Array  # [B] int32: the position of feats[:, 0]


@pytree.dataclass
class SpecState:
    """The decode state plus what speculation tracks per row; donated to each round."""

    decode: DecodeState  # tokens/positions/cache/sampler/output; its `step` is unused
    count: jax.Array  # [B] int32: new tokens out per row (the row's next output column)
    history: jax.Array  # [B, S] int32: the row's token at each position (prompt + output)
    draft_cache: KVCache | None  # the draft model's cache (None for n-gram lookup)
    head: HeadState | None  # a feature head's state (None for the other drafters)
    drafted: jax.Array  # [B] int32: drafts proposed to the row
    accepted: jax.Array  # [B] int32: drafts accepted (emitted as they were proposed)
    verified: jax.Array  # [B] int32: rounds that checked drafts for the row (probes too)
    gain: jax.Array  # [B] float32: drafts accepted per verification, recent rounds weighted
    idle: jax.Array  # [] int32: plain rounds since the last verification (MIN_GAIN)
    patience: jax.Array  # [] int32: plain rounds before the next probe (PROBE .. MAX_PROBE)


# ---------------------------------------------------------------------------------------------
# Drafting
# ---------------------------------------------------------------------------------------------


def ngram_drafts(history: jax.Array, last: jax.Array, k: int, ngram: NGram):
    """Prompt-lookup drafts [B, k] from history [B, S] valid through position last [B], and
    whether each row found a match [B] bool.

    The longest n-gram (max_n..min_n) ending at `last` that also occurs earlier wins, at its
    latest occurrence i; the drafts are the tokens after it, hist[i + n ...], repeated with the
    period L - (i + n) where they would run into the suffix itself (a loop continues as a loop).
    No match: the last token repeated (the verification still yields one token)."""
    b, s = history.shape
    length = last + 1  # [B] valid tokens
    slots = jnp.arange(s, dtype=jnp.int32)  # [S] candidate starts i
    start = jnp.full((b,), -1, jnp.int32)  # [B] where the continuation starts; -1: none yet
    for n in range(ngram.max_n, ngram.min_n - 1, -1):
        suffix = jnp.take_along_axis(history, jnp.clip(length[:, None] - n + jnp.arange(n), 0,
                                                       s - 1), axis=1)  # [B, n]
        match = slots[None, :] <= (length - n - 1)[:, None]  # [B, S]: i + n < L, i >= 0
        for m in range(n):
            match &= jnp.roll(history, -m, axis=1) == suffix[:, m:m + 1]
        latest = jnp.max(jnp.where(match, slots[None, :], -1), axis=1)  # [B]
        start = jnp.where((start < 0) & (latest >= 0), latest + n, start)
    period = jnp.maximum(length - start, 1)  # [B]
    idx = start[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :] % period[:, None]  # [B, k]
    drafts = jnp.take_along_axis(history, jnp.clip(idx, 0, s - 1), axis=1)
    found = start >= 0
    return jnp.where(found[:, None], drafts, last_token(history, last)[:, None]), found


def last_token(history: jax.Array, last: jax.Array) -> jax.Array:
    """Each row's token at position last [B] of history [B, S]."""
    return jnp.take_along_axis(history, last[:, None], axis=1)[:, 0]  # [B]


def _draft_law(logits: jax.Array, tensors: sampling.SamplingTensors):
    """The draft's proposal law q for each row: the target's temperature and truncation
    without penalties (any q is exact under rejection sampling; this one tracks p).
    -> masked scaled logits [B, V] (softmax = q)."""
    plain = tensors.replace(flags=dataclasses.replace(tensors.flags, repetition_penalty=False,
                                                      presence_frequency_penalty=False))
    return sampling.processed_logits(logits, plain)[1]


def _draw(masked: jax.Array, keys: jax.Array, greedy: jax.Array, all_greedy: bool):
    """Gumbel-max from masked logits [B, V] with keys [B]; greedy rows [B] take the argmax."""
    argmax = jnp.argmax(masked, axis=-1).astype(jnp.int32)
    if all_greedy:
        return argmax
    v = masked.shape[-1]
    gumbel = jax.vmap(jax.random.gumbel, in_axes=(0, None, None))(keys, (v,), jnp.float32)
    return jnp.where(greedy, argmax, jnp.argmax(masked + gumbel, axis=-1).astype(jnp.int32))


def model_drafts(draft_params, state: SpecState, k: int, draft: _DraftPlan):
    """K drafts from the draft model -> (drafts [B, K], their laws' masked logits [B, K, V] or
    None, the draft cache). Its first forward takes the token before x and x at p - 1, p: the
    slot p - 1 may be missing (all K drafts accepted last round) or stale; rewriting it is
    idempotent. Draft j + 1 uses the target's key for position p + 1 + j."""
    d = state.decode
    p, x = d.positions, d.tokens  # [B]
    forward = registry.family(draft.plan.config).forward
    tensors = d.sampling
    prev = last_token(state.history, jnp.maximum(p - 1, 0))
    tokens = jnp.stack([prev, x], axis=1)  # [B, 2]
    positions = jnp.stack([p - 1, p], axis=1)
    cache = state.draft_cache
    drafts, laws = [], []
    for j in range(k):
        logits, cache = forward(draft_params, tokens, positions, draft.plan, cache)
        masked = _draft_law(logits[:, -1], tensors)  # [B, V]
        keys = sampling.step_keys(d.sampler, p + 1 + j)
        nxt = _draw(masked, keys, tensors.greedy, tensors.flags.all_greedy)  # [B]
        drafts.append(nxt)
        laws.append(masked)
        tokens, positions = nxt[:, None], (p + 1 + j)[:, None]
    return (jnp.stack(drafts, axis=1), jnp.stack(laws, axis=1) if draft.rejection else None,
            cache)


def head_drafts(params, head_params, state: SpecState, k: int, spec: draft_head.HeadSpec):
    """K drafts from a feature head -> (drafts [B, K], with spec.rejection their laws
    [B, K, V] else None, its HeadState). Its first forward takes the pairs (t_{pos+1+j},
    f_{pos+j}) at pos+1+j for j = 0..K, the tokens the last verification scored (after plain
    rounds, which skip the head: j up to K + MAX_PROBE, theirs too): those through x (at p)
    are now known true; those past it are stale, and their slots are written over before any
    query at or past them reads them (as rejected drafts' target slots). x's output drafts
    d_1; then one token at a time, each step taking the head's own feature estimate g. Draft
    j + 1 uses the target's key for position p + 1 + j."""
    d, hs = state.decode, state.head
    p, tensors = d.positions, d.sampling  # [B]
    b, s = state.history.shape
    rows = jnp.arange(b)

    def first(t: int):  # the first forward over pairs pos+1 .. pos+t -> logits, cache, g
        positions = hs.pos[:, None] + 1 + jnp.arange(t, dtype=jnp.int32)  # [B, T]
        tokens = jnp.take_along_axis(state.history, jnp.minimum(positions, s - 1), axis=1)
        at = jnp.clip(p - hs.pos - 1, 0, t - 1)  # [B]: x's index (done rows: any)
        logits, cache, g = draft_head.forward(head_params, params, tokens, hs.feats[:, :t],
                                              positions, spec, hs.cache, logits_at=at)
        return logits, cache, g[rows, at][:, None]  # [B, 1, V], cache, [B, 1, D]
    width = hs.feats.shape[1]
    if width == k + 1:
        logits, cache, g = first(k + 1)
    else:  # after plain rounds (they skip the head): their pairs too, in the same forward
        behind = jnp.any(~d.done & (p - hs.pos - 1 > k))
        logits, cache, g = jax.lax.cond(behind, lambda: first(width), lambda: first(k + 1))
    drafts, laws = [], []
    for j in range(k):
        masked = _draft_law(logits[:, 0], tensors)  # [B, V]
        nxt = _draw(masked, sampling.step_keys(d.sampler, p + 1 + j), tensors.greedy,
                    tensors.flags.all_greedy)  # [B]
        drafts.append(nxt)
        laws.append(masked)
        if j + 1 < k:
            logits, cache, g = draft_head.forward(head_params, params, nxt[:, None], g,
                                                  (p + 1 + j)[:, None], spec, cache)
    return (jnp.stack(drafts, axis=1), jnp.stack(laws, axis=1) if spec.rejection else None,
            hs.replace(cache=cache))


# ---------------------------------------------------------------------------------------------
# One round: draft, verify, accept, record
# ---------------------------------------------------------------------------------------------


def _leading(ok: jax.Array) -> jax.Array:
    """ok [B, K] bool -> [B] int32: how many leading entries are true."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)


def _rejection(drafts, draft_laws, ys, lps, target_laws, keys,
               tensors: sampling.SamplingTensors):
    """Rejection sampling for sampled rows (greedy rows keep the coupled rule): draft d_j is
    accepted with probability min(1, p(d_j) / q(d_j)) (u keyed by its position: keys
    [B, K + 1], the key of each scored position), the first rejected one replaced by a draw
    from max(0, p - q), after K acceptances the plain draw y_K. -> (accepted count a [B],
    tokens [B, K + 1], logprobs [B, K + 1])."""
    b, k = drafts.shape
    rows = jnp.arange(b)
    scaled, masked = target_laws  # [B, K + 1, V] each
    logp = jax.nn.log_softmax(masked[:, :k], axis=-1)  # [B, K, V]
    logq = jax.nn.log_softmax(draft_laws, axis=-1)  # [B, K, V]
    pick = drafts[:, :, None]
    ratio = jnp.exp(jnp.take_along_axis(logp, pick, 2) - jnp.take_along_axis(logq, pick, 2))
    u = jax.vmap(jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1))))(
        keys[:, :k])  # [B, K]
    ok = jnp.where(tensors.greedy[:, None], drafts == ys[:, :k], u < ratio[:, :, 0])
    a = _leading(ok)
    pa = jnp.exp(logp[rows, jnp.minimum(a, k - 1)])  # [B, V] at the first rejection
    qa = jnp.exp(logq[rows, jnp.minimum(a, k - 1)])
    diff = jnp.maximum(pa - qa, 0.0)
    residual = jnp.log(jnp.where(jnp.any(diff > 0, axis=-1, keepdims=True), diff, pa))
    rkeys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys[rows, jnp.minimum(a, k)], 2)
    fix = _draw(residual, rkeys, jnp.zeros((b,), bool), False)  # [B]
    emitted = jnp.concatenate([drafts, ys[:, k:]], axis=1)  # [B, K + 1]
    at_a = (jnp.arange(k + 1)[None, :] == a[:, None]) & (a < k)[:, None]
    emitted = jnp.where(at_a, fix[:, None], emitted)
    tokens = jnp.where(tensors.greedy[:, None], ys, emitted)
    if tensors.flags.logprobs:  # the emitted tokens' logprobs under the untruncated law
        lps = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), tokens[:, :, None],
                                  2)[:, :, 0]
    return a, tokens, lps


def _record_round(state: SpecState, tokens: jax.Array, lps: jax.Array, a: jax.Array,
                  cache, plan: Plan) -> SpecState:
    """Emit tokens[:, :a + 1] [B, K + 1] one column at a time (a stop id or the budget ends a
    row mid-run), into the outputs, the history and the penalty counts; advance each row."""
    d = state.decode
    b, t = tokens.shape
    rows = jnp.arange(b)
    p = d.positions
    done, count, history = d.done, state.count, state.history
    output, logprobs, sampler = d.output, d.logprobs, d.sampler
    n_out, s = output.shape[1], history.shape[1]
    for j in range(t):
        alive = ~done & (j <= a)
        tok = tokens[:, j]
        col = jnp.where(alive, count, n_out)  # past the end: dropped
        output = output.at[rows, col].set(tok, mode="drop")
        if d.sampling.flags.logprobs:
            logprobs = logprobs.at[rows, col].set(lps[:, j], mode="drop")
        history = history.at[rows, jnp.where(alive, p + 1 + j, s)].set(tok, mode="drop")
        hit_stop = jnp.any(tok[:, None] == d.stop_ids[None, :], axis=-1)
        done = done | (alive & (hit_stop | (count + 1 >= d.budget)))
        count = count + alive
        sampler = sampling.observe(sampler, tok, alive)
    emitted = count - state.count  # [B]
    new_p = p + emitted  # the last emitted token's slot: written by the next round
    cache = sharding_lib.constrain_cache(cache.replace(lengths=new_p), plan.sharding)
    decode = d.replace(tokens=last_token(history, new_p), positions=new_p, cache=cache,
                       sampler=sampler, done=done, output=output, logprobs=logprobs)
    gain = state.gain
    if t > 1:  # a verification: each live row's accepted drafts into its average
        gain = jnp.where(d.done, gain, 0.5 * gain + 0.5 * a.astype(jnp.float32))
    return state.replace(decode=decode, count=count, history=history,
                         drafted=state.drafted + jnp.where(d.done, 0, t - 1),
                         verified=state.verified + jnp.where(d.done, 0, int(t > 1)),
                         accepted=state.accepted + jnp.minimum(a, emitted), gain=gain)


def _verify_round(params, state: SpecState, drafts: jax.Array, draft_laws, plan: Plan,
                  append: bool = False) -> SpecState:
    """Verify drafts [B, K] (K = 0: a plain decode step), accept, record (with a feature
    head: also the target's features at p..p+K, for the head's next round; append: a plain
    step's feature joins those kept since the head's last forward)."""
    d = state.decode
    p, x = d.positions, d.tokens  # [B]
    k = drafts.shape[1]
    # The last token and the K drafts at p..p+K in one forward.
    tokens = jnp.concatenate([x[:, None], drafts], axis=1)  # [B, K + 1]
    positions = p[:, None] + jnp.arange(k + 1, dtype=jnp.int32)  # [B, K + 1]
    forward = registry.family(plan.config).forward
    out = forward(params, tokens, positions, plan, d.cache, hidden=state.head is not None)
    logits, cache = out[:2]  # [B, K + 1, V]

    rejection = draft_laws is not None and not d.sampling.flags.all_greedy
    # The target's token at each of p+1..p+K+1, as plain decoding would sample it there if
    # the drafts before it were accepted: that position's key, penalties counting d_1..d_j.
    keys = jax.vmap(sampling.step_keys, in_axes=(None, 1), out_axes=1)(
        d.sampler, p[:, None] + 1 + jnp.arange(k + 1))  # [B, K + 1]
    sampled, target_laws = sampling.sample_positions(
        logits, keys, d.sampling, tokens=drafts, active=~d.done,
        token_counts=d.sampler.token_counts, seen_mask=d.sampler.seen_mask,
        batch_invariant=plan.policy.batch_invariant, laws=rejection)
    ys, lps = sampled.tokens, sampled.logprobs  # [B, K + 1]
    if rejection:  # with the target's laws (scaled, masked) [B, K + 1, V] each
        a, ys, lps = _rejection(drafts, draft_laws, ys, lps, target_laws, keys, d.sampling)
    else:  # coupled: accept while the draft is the token plain decoding samples there
        a = _leading(drafts == ys[:, :k])
    hs = state.head
    if hs is not None and append:  # f_p at its place after pos (plain rounds <= MAX_PROBE)
        feats = hs.feats.at[jnp.arange(p.shape[0]), p - hs.pos].set(
            out[2][:, 0].astype(hs.feats.dtype), mode="drop")
        state = state.replace(head=hs.replace(feats=feats))
    elif hs is not None:  # f [B, K + 1, D] at p..p+K, padded to the kept width
        f = out[2]
        f = jnp.pad(f, ((0, 0), (0, hs.feats.shape[1] - f.shape[1]), (0, 0)))
        state = state.replace(head=hs.replace(feats=f.astype(hs.feats.dtype), pos=p))
    return _record_round(state, ys, lps, a, cache, plan)


def _spec_round(params, draft_params, state: SpecState, plan: Plan, k: int,
                drafter: NGram | _DraftPlan | draft_head.HeadSpec, running=None,
                block: int = 1) -> SpecState:
    """One round for every row (module docstring): draft, verify, accept, record. Inside
    spec_loop (`running(s, room)`: its predicate), the plain branch runs plain rounds until a
    drafter's rows may hit again (an n-gram match; a probe due) or the loop ends, an adaptive
    drafter's `block` at a time while they fit."""
    if isinstance(drafter, NGram):
        # No live row found a match: a plain decode step (T = 1) costs less than verifying
        # guesses that are almost surely wrong; inside spec_loop such steps run in an inner
        # loop until a row finds one (one host check a token, as plain decoding's loop).
        def lookup(s: SpecState):  # -> drafts [B, K], whether a live row found a match
            drafts, found = ngram_drafts(s.history, s.decode.positions, k, drafter)
            return drafts, jnp.any(found & ~s.decode.done)

        drafts, found = lookup(state)

        def verify(s: SpecState) -> SpecState:
            return _verify_round(params, s, drafts, None, plan)

        def plain(s: SpecState) -> SpecState:
            return _verify_round(params, s, drafts[:, :0], None, plan)

        def plains(s: SpecState) -> SpecState:
            if running is None:
                return plain(s)
            return jax.lax.while_loop(lambda s: running(s, 1) & ~lookup(s)[1], plain, s)

        return jax.lax.cond(found, verify, plains, state)
    is_head = isinstance(drafter, draft_head.HeadSpec)

    def draft(s: SpecState, n: int):  # -> drafts [B, n], their laws or None, the state
        if is_head:
            drafts, laws, head = head_drafts(params, draft_params, s, n, drafter)
            return drafts, laws, s.replace(head=head)
        drafts, laws, draft_cache = model_drafts(draft_params, s, n, drafter)
        return drafts, laws, s.replace(draft_cache=draft_cache)

    def verify(s: SpecState) -> SpecState:
        drafts, draft_laws, s = draft(s, k)
        return _verify_round(params, s, drafts, draft_laws, plan).replace(
            idle=jnp.zeros((), jnp.int32))

    if not drafter.adaptive:
        return verify(state)

    def drafted_plain(s: SpecState):
        """A plain round beside the drafter's first draft for the position it emits
        -> (that draft [B], the state after the round). A head's first forward writes every
        pair since its last one (the plain rounds before skipped it), and the round's feature
        starts its kept ones (as a verification of no drafts); a draft model's writes this
        round's last two tokens."""
        drafts, _, s = draft(s, 1)
        return drafts[:, 0], _verify_round(params, s, drafts[:, :0], None, plan)

    def plain(s: SpecState) -> SpecState:
        # No head forward: the step's feature is kept, and the next head forward writes every
        # pair since (no hole in its cache). A draft model runs every round (its cache).
        if is_head:
            none = jnp.zeros((s.count.shape[0], 0), jnp.int32)
            out = _verify_round(params, s, none, None, plan, append=True)
        else:
            out = drafted_plain(s)[1]
        return out.replace(idle=s.idle + 1)

    def probe(s: SpecState) -> SpecState:
        # A plain round that checks the drafter's first draft against its token: a hit counts
        # as a round whose K drafts were all accepted (the most a verification could have
        # shown), so any reachable min_gain lets the rows verify again; a miss as a
        # verification accepting none. The draft counts as proposed, not accepted (the round
        # emits its own token). A probe that finds them still rejected doubles the wait.
        first, out = drafted_plain(s)
        live = ~s.decode.done
        hit = live & (out.decode.tokens == first)  # [B]: the round's token, at p + 1
        gain = jnp.where(live, 0.5 * s.gain + 0.5 * jnp.where(hit, k, 0), s.gain)
        return out.replace(gain=gain, drafted=s.drafted + live, verified=s.verified + live,
                           idle=jnp.zeros((), jnp.int32),
                           patience=jnp.minimum(2 * s.patience, MAX_PROBE))

    def plains(s: SpecState) -> SpecState:
        # XLA's GPU while loop and switch each copy their predicate to the host: a plain round
        # per trip of spec_loop cost two host checks a token where plain decoding's loop costs
        # one (or one per steps_per_sync). These are the rounds one at a time would run: gain
        # does not move in plain rounds, so they last until a probe is due (or the loop's
        # end), in blocks while some live row needs them (benchmarks/DECISIONS.md).
        if running is None:  # spec_round: one round a call
            return plain(s)
        if block > 1:
            s = jax.lax.while_loop(
                lambda s: running(s, block) & (s.idle + block <= s.patience),
                lambda s: jax.lax.fori_loop(0, block, lambda _, s: plain(s), s), s)
        return jax.lax.while_loop(lambda s: running(s, 1) & (s.idle < s.patience), plain, s)

    live = ~state.decode.done
    hitting = jnp.any(live & (state.gain >= min_gain(drafter)))
    # a probe (drafts still rejected) doubles the wait for the next; a hit resets it
    branch = jnp.where(hitting, 2, jnp.where(state.idle >= state.patience, 1, 0))
    return jax.lax.switch(branch, (
        plains, probe, lambda s: verify(s).replace(patience=jnp.full((), PROBE, jnp.int32))),
        state)


def start_gain(drafter, k: int) -> float:
    """A row's gain before its first verification: min(K, 2 min_gain), so that two
    verifications accepting nothing end the first rounds' verifying (from K, a useless
    drafter's decay took log2(K) + 2 of them)."""
    if isinstance(drafter, NGram):  # no fallback: every round with a match verifies
        return float(k)
    return min(float(k), 2.0 * min_gain(drafter))


def min_gain(drafter) -> float:
    """The drafter's threshold of accepted drafts per verification (MIN_GAIN by default)."""
    value = drafter.min_gain
    if value is None:
        return MIN_GAIN
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"min_gain must be a number >= 0 (accepted drafts per verification), "
                         f"got {value!r}")
    return float(value)


spec_round = jax.jit(_spec_round, static_argnames=("plan", "k", "drafter"),
                     donate_argnames=("state",))


@functools.partial(jax.jit, static_argnames=("plan", "k", "drafter"), donate_argnames=("state",))
def spec_loop(params, draft_params, state: SpecState, plan: Plan, k: int,
              drafter: NGram | _DraftPlan | draft_head.HeadSpec,
              until: jax.Array | None = None) -> SpecState:
    """Rounds until every row is done (or, with `until` [] int32, until every live row has
    that many tokens out), inside one executable."""
    def running(s: SpecState, room: int = 1):  # some live row has `room` more tokens to go
        left = s.decode.budget - s.count  # [B]; a live row's is >= 1
        if until is not None:
            left = jnp.minimum(left, until - s.count)
        return jnp.any(~s.decode.done & (left >= room))

    return jax.lax.while_loop(running, functools.partial(
        _spec_round, params, draft_params, plan=plan, k=k, drafter=drafter, running=running,
        block=steps_per_sync(plan, state.decode)), state)


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("cache",))
def _draft_prefill(params, tokens: jax.Array, lengths: jax.Array, cache: KVCache, plan: Plan):
    """The prompts into the draft model's cache (its logits are not needed)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    _, cache = registry.family(plan.config).forward(params, tokens, positions, plan, cache,
                                                    logits_at=lengths - 1, fresh=True)
    return cache.replace(lengths=lengths)


@functools.partial(jax.jit, static_argnames=("plan", "spec", "k"), donate_argnames=("cache",))
def _head_prefill(params, head_params, tokens: jax.Array, lengths: jax.Array, cache,
                  plan: Plan, spec: draft_head.HeadSpec, k: int) -> HeadState:
    """The prompts into a feature head's cache: the target's features f over the prompts
    (one more target forward, without a cache: generate's prefill does not keep them), the
    pairs (t_i, f_{i-1}) at slots 0..T-1 (f_{-1} = 0). The first round pairs x (at L) with
    f_{L-1}: feats[:, 0] at pos L - 1."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    _, _, f = registry.family(plan.config).forward(params, tokens, positions, plan,
                                                   logits_at=lengths - 1, hidden=True)
    before = jnp.concatenate([jnp.zeros_like(f[:, :1]), f[:, :-1]], axis=1)  # [B, T, D]
    _, cache, _ = draft_head.forward(head_params, params, tokens, before, positions, spec,
                                     cache, logits_at=lengths - 1, fresh=True)
    feats = jnp.zeros((b, head_width(spec, k), f.shape[-1]), f.dtype).at[:, 0].set(
        f[jnp.arange(b), lengths - 1])
    return HeadState(cache=cache.replace(lengths=lengths), feats=feats, pos=lengths - 1)


def head_width(spec: draft_head.HeadSpec, k: int) -> int:
    """Features a head's state keeps: the K + 1 a verification scores, and with the fallback
    the MAX_PROBE plain rounds' more (they skip the head; the next verification's first
    forward takes their pairs all at once)."""
    return k + 1 + (MAX_PROBE if spec.adaptive else 0)


@jax.jit
def _start(state: DecodeState, tokens: jax.Array, lengths: jax.Array):
    """After the target's prefill: each row's history (prompt, then its first token)."""
    b, t = tokens.shape
    cache = state.cache  # KVCache or an MLA model's LatentCache: [B, S, ...] per layer
    s = (cache.k if isinstance(cache, KVCache) else cache.latent)[0].shape[1]
    history = jnp.zeros((b, s), jnp.int32).at[:, :t].set(tokens)  # T <= S (init_state)
    history = history.at[jnp.arange(b), lengths].set(state.tokens)
    return history, (state.output[:, 0] >= 0).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Host side: checks, prefill, results
# ---------------------------------------------------------------------------------------------


_KINDS = ("speculative must be 'ngram', 'head' (the EAGLE head saved beside the model), 'mtp' "
          "(DeepSeek-V3's MTP module), an NGram, a loaded draft model, a DraftModel or a "
          "draft_head.FeatureHead")


def resolve_drafter(speculative, model):
    """speculative argument -> (NGram | DraftModel | FeatureHead); a head's file and its
    target are checked here, before anything compiles."""
    if isinstance(speculative, str):
        if speculative == "ngram":
            return NGram()
        if speculative == "head":
            if model.source is None:
                raise ValueError("speculative='head' looks for the head beside the model's "
                                 "checkpoint, and this model was not loaded from one: pass "
                                 "draft_head.load(path, model)")
            return draft_head.load(draft_head.default_path(model.source), model)
        if speculative == "mtp":
            return draft_head.load_mtp(model)
        raise ValueError(f"{_KINDS}, got {speculative!r} (a draft model: load it with "
                         "jaxinfer.load and pass the model)")
    if isinstance(speculative, NGram | DraftModel):
        drafter = speculative
    elif isinstance(speculative, Model):
        drafter = DraftModel(speculative)
    elif isinstance(speculative, draft_head.FeatureHead):
        draft_head.check_fingerprint(speculative.fingerprint, model, "the draft head")
        drafter = speculative
    else:
        raise ValueError(f"{_KINDS}, got {type(speculative).__name__}")
    if isinstance(drafter, DraftModel):
        check_same_vocabulary(model, drafter.model)
    return drafter


def check_same_vocabulary(model, draft) -> None:
    """A draft model must share the target's token ids: same vocabulary size, and where both
    have tokenizers, the same token for every id."""
    v, dv = model.config.vocab_size, draft.config.vocab_size
    if v != dv:
        raise ValueError(f"the draft model's vocabulary ({dv} tokens) is not the target's ({v}); "
                         "speculative decoding needs a draft model with the same tokenizer")
    if model.tokenizer is not None and draft.tokenizer is not None:
        mine = model.tokenizer.backend.get_vocab(with_added_tokens=True)
        theirs = draft.tokenizer.backend.get_vocab(with_added_tokens=True)
        if mine != theirs:
            differ = len(set(mine.items()) ^ set(theirs.items()))
            raise ValueError(f"the draft model's tokenizer differs from the target's ({differ} "
                             "token/id pairs differ); speculative decoding needs a draft model "
                             "with the same tokenizer")


@dataclasses.dataclass
class _SpecRequest:
    req: _Request
    k: int
    drafter: NGram | _DraftPlan | draft_head.HeadSpec
    draft_params: dict | None


def _prepare(model, prompts, max_new_tokens, sampling_params, seed, chat, stop, max_seq_len,
             policy, kv_cache_dtype, mesh, speculative, num_speculative_tokens,
             ignore_eos: bool = False) -> _SpecRequest:
    """Every check on the host, before anything is allocated or compiled."""
    drafter = resolve_drafter(speculative, model)
    if not isinstance(drafter, NGram):
        min_gain(drafter)  # a bad threshold named before anything compiles
    if mesh is not None or model.sharding is not None:
        raise ValueError("speculative decoding runs on one device for now; drop mesh= (or load "
                         "the model without a mesh)")
    k = num_speculative_tokens
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
    k = int(k)
    # init_state checks that K slots past the last token fit the target's context.
    req = _prepare_request(model, prompts, max_new_tokens, sampling_params, seed, chat, stop,
                           max_seq_len, policy, kv_cache_dtype, mesh, reserve=k,
                           ignore_eos=ignore_eos)
    if isinstance(drafter, NGram):
        return _SpecRequest(req, k, drafter, None)
    if isinstance(drafter, draft_head.FeatureHead):  # its layer on the request's plan and dtype
        head = draft_head.for_model(drafter, model)
        spec = dataclasses.replace(
            head.spec, plan=dataclasses.replace(req.plan, config=head.spec.plan.config),
            rejection=drafter.rejection, adaptive=drafter.adaptive, min_gain=drafter.min_gain)
        return _SpecRequest(req, k, spec, head.params)
    need = max(len(p) for p in req.ids) + int(max_new_tokens) + k
    context = drafter.model.config.max_position_embeddings
    if need > context:
        raise ValueError(f"the draft model's context ({context} tokens) is shorter than the "
                         f"longest prompt + max_new_tokens + num_speculative_tokens ({need}); "
                         "lower max_new_tokens or use another draft model")
    plan = _plan(drafter.model, policy)
    return _SpecRequest(req, k, _DraftPlan(plan, drafter.rejection, drafter.adaptive,
                                           drafter.min_gain),
                        run_params(drafter.model, plan))


def _run_prefill(model, sreq: _SpecRequest, progress: bool) -> SpecState:
    req = sreq.req
    state = _target_prefill(model, req, progress)
    history, count = _start(state, req.tokens, req.lengths)
    b = count.shape[0]
    draft_cache = head = None
    if isinstance(sreq.drafter, _DraftPlan):
        draft_cache = KVCache.init(sreq.drafter.plan.config, b, history.shape[1])
        draft_cache = _draft_prefill(sreq.draft_params, req.tokens, req.lengths, draft_cache,
                                     sreq.drafter.plan)
    elif isinstance(sreq.drafter, draft_head.HeadSpec):
        # its first forward writes head_width pairs from its last true one
        cache = KVCache.init(sreq.drafter.plan.config, b,
                             history.shape[1] + head_width(sreq.drafter, sreq.k))
        head = _head_prefill(req.params, sreq.draft_params, req.tokens, req.lengths, cache,
                             req.plan, sreq.drafter, sreq.k)
    return SpecState(decode=state, count=count, history=history, draft_cache=draft_cache,
                     head=head, drafted=jnp.zeros((b,), jnp.int32),
                     accepted=jnp.zeros((b,), jnp.int32), verified=jnp.zeros((b,), jnp.int32),
                     gain=jnp.full((b,), start_gain(sreq.drafter, sreq.k), jnp.float32),
                     idle=jnp.zeros((), jnp.int32), patience=jnp.full((), PROBE, jnp.int32))


def _results(model, sreq: _SpecRequest, state: SpecState) -> list[Completion]:
    req = sreq.req
    out = np.asarray(state.decode.output)
    lps = np.asarray(state.decode.logprobs)
    drafted, accepted = np.asarray(state.drafted), np.asarray(state.accepted)
    verified = np.asarray(state.verified)
    results = []
    for row, sp in enumerate(req.sampling):
        n = int((out[row] >= 0).sum())
        done = _finish(model, out[row, :n].tolist(), lps[row, :n].tolist(), req.stop_ids,
                           req.stop_strings, sp.logprobs, len(req.ids[row]))
        results.append(dataclasses.replace(done, draft_tokens=int(drafted[row]),
                                           accepted_tokens=int(accepted[row]),
                                           verifications=int(verified[row])))
    return results


def generate(model, prompts, max_new_tokens, sampling, seed, chat, stop, max_seq_len, policy,
             progress, kv_cache_dtype, mesh, speculative,
             num_speculative_tokens, ignore_eos: bool = False) -> list[Completion]:
    """`jaxinfer.generate(..., speculative=...)` (see its docstring)."""
    sreq = _prepare(model, prompts, max_new_tokens, sampling, seed, chat, stop, max_seq_len,
                    policy, kv_cache_dtype, mesh, speculative, num_speculative_tokens,
                    ignore_eos=ignore_eos)
    req = sreq.req
    args = dict(plan=req.plan, k=sreq.k, drafter=sreq.drafter)
    with memory.reporting_oom(f"generating for {len(req.ids)} prompts"):
        state = _run_prefill(model, sreq, progress)
        if progress:
            with _bar(True, int(max_new_tokens), f"speculative x{len(req.ids)}") as bar:
                bar.update(1)
                while not bool(jnp.all(state.decode.done)):
                    state = spec_loop(req.params, sreq.draft_params, state,
                                      until=jnp.int32(bar.n + PROGRESS_STEPS), **args)
                    bar.update(int(jnp.max(state.count)) - bar.n)
        else:
            state = spec_loop(req.params, sreq.draft_params, state, **args)
    return _results(model, sreq, state)


@jax.jit
def _row0(state: SpecState):
    """Row 0's outputs so far: (count, output row, logprobs row, done), as new arrays."""
    d = state.decode
    return state.count[0], d.output[0], d.logprobs[0], d.done[0]


def pieces(model, sreq: _SpecRequest, progress: bool, out, t0: float) -> Iterator[str]:
    """`stream`'s pieces with speculation: one round per host read (1..K+1 tokens)."""
    req = sreq.req
    shown = StreamText(model.tokenizer, req.stop_ids, req.stop_strings)
    want_logprobs = req.sampling[0].logprobs
    with memory.reporting_oom("the prefill"):
        state = _run_prefill(model, sreq, progress)
    ids, lps = [], []
    while True:
        count, row, lp, done = jax.device_get(_row0(state))
        new = row[len(ids):int(count)].tolist()
        finished = bool(done)
        now = time.perf_counter() - t0
        if out.time_to_first_token is None:
            out.time_to_first_token = now
        for i, tok in enumerate(new):
            out.token_times.append(now)  # a round's tokens arrive together
            ids.append(int(tok))
            if want_logprobs:
                lps.append(float(lp[len(ids) - 1]))
            last = finished and i == len(new) - 1  # recording stops at a stop token
            piece, stopped = shown.feed(int(tok), last)
            if stopped or last:
                out.completion = dataclasses.replace(
                    _finish(model, ids, lps, req.stop_ids, req.stop_strings, want_logprobs,
                            len(req.ids[0])),
                    draft_tokens=int(state.drafted[0]), accepted_tokens=int(state.accepted[0]),
                    verifications=int(state.verified[0]))
            if piece:
                yield piece
            if stopped or last:
                return
        state = spec_round(req.params, sreq.draft_params, state, req.plan, sreq.k,
                           sreq.drafter)


def ngram_drafts_host(tokens: list[int], k: int, ngram: NGram) -> tuple[list[int], bool]:
    """`ngram_drafts` for one row on the host (the engine's rows keep their tokens there):
    the same rule over tokens, the row's prompt and output so far -> (k drafts, found)."""
    hist = np.asarray(tokens, np.int64)
    length = len(hist)
    for n in range(ngram.max_n, ngram.min_n - 1, -1):
        if length - n - 1 < 0:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(hist[:length - 1], n)  # starts < L-n
        hits = np.flatnonzero((windows == hist[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            period = length - start
            return [int(hist[start + i % period]) for i in range(k)], True
    return [int(hist[-1])] * k, False
