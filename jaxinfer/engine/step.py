"""The engine's jitted steps: a prefill chunk and a decode step over rows of a paged cache.

Both take the engine's device state (the page pools, each request slot's newest token, the
penalty statistics) and rows the host built for this dispatch, and return the new state and
the tokens they sampled. A decode row's input token is read from `last_token[slot]` on the
device, where the step before wrote it: the host never has to wait for a token's value to
dispatch the next step (it reads step n while step n + 1 runs).

With a feature head (an EAGLE head, jaxinfer/draft_head.py) the state also holds the head's
pages (`HeadPages`): the prefill and verification steps write the target's features and the
head's K/V under the rows' block tables, and a verification first drafts with the head.

Sampling keys are those of `generate`: row b's token at position p is drawn with
fold_in(fold_in(key(seed_b), key_id_b), p), so a request's draws depend on nothing but its own
seed, its id and the position, whatever batch, row or chunking it is computed in.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer import draft_head, pytree, sampling
from jaxinfer.cache import PagedKVCache, PagedLatentCache
from jaxinfer.models import registry
from jaxinfer.plan import Plan


@pytree.dataclass
class HeadPages:
    """A feature head's pages, indexed by the target's page ids (the rows' block tables): the
    head's one-layer K/V, slot i holding the pair (t_i, f_{i-1}), and the target's feature f_i
    (its final-normed hidden state) at slot i. Both are functions of the tokens through i only,
    so a prefix-cached page carries them as it carries the target's K/V; a chunk or a prefix
    hit starting at c reads f_{c-1} from the page before it, and a verification of the newest
    token at p reads f_{p-1}."""

    cache: PagedKVCache | PagedLatentCache  # the head's layer (tables: a placeholder)
    feats: jax.Array  # [P, page_size, D]: the target's feature at each page slot


@pytree.dataclass
class EngineState:
    """What the engine keeps on the device between steps; donated to every step."""

    cache: PagedKVCache  # the page pools (block_tables: a placeholder; rows carry theirs)
    last_token: jax.Array  # [R + 1] int32: each request slot's newest token; R: padding rows'
    token_counts: jax.Array | None = None  # [R + 1, V] int32: generated-token counts
    seen_mask: jax.Array | None = None  # [R + 1, V] bool: prompt + generated tokens
    head: HeadPages | None = None  # a feature head's pages (None: no head)


@pytree.dataclass
class Rows:
    """One dispatch's rows (built on the host; padding rows: slot R, position -1)."""

    slot: jax.Array  # [B] int32: the request slot (R for padding rows)
    position: jax.Array  # [B] int32: position of the row's first input token
    count: jax.Array  # [B] int32: the row's valid input tokens (a chunk; 1 for decode)
    seed: jax.Array  # [B] uint32: the request's seed
    key_id: jax.Array  # [B] int32: the request's key id (0 with its own seed)
    block_tables: jax.Array  # [B, W] int32: the row's pages (0: the null page)
    sampling: sampling.SamplingTensors  # [B] per-row parameters
    # [B, ceil(V / 32)] int32: the tokens each row may take (structured output; -1 words: all).
    # None when no row has a grammar: another program, with no mask work.
    token_bitmask: jax.Array | None = None


def _keys(rows: Rows, positions: jax.Array) -> jax.Array:
    """Typed keys [B] for tokens at positions [B] (as generate's SamplerState + step_keys)."""
    base = jax.vmap(jax.random.fold_in)(jax.vmap(jax.random.key)(rows.seed), rows.key_id)
    return jax.vmap(jax.random.fold_in)(base, positions)


def _sample(logits, rows: Rows, positions, counts, seen, plan: Plan):
    """-> (tokens [B], logprobs [B] (zeros when no row asked), top, counts, seen); top:
    (ids [B, K], logprobs [B, K]) of the most likely tokens when some row asked, else None."""
    out = sampling.sample_with_logprobs(logits, _keys(rows, positions), rows.sampling,
                                        token_counts=counts, seen_mask=seen,
                                        token_bitmask=rows.token_bitmask,
                                        batch_invariant=plan.policy.batch_invariant)
    logprobs = out.logprobs if rows.sampling.flags.logprobs else jnp.zeros_like(out.logprobs)
    top = (out.top_ids, out.top_logprobs) if out.top_ids is not None else None
    counts, seen = sampling.update_penalty_state(counts, seen, out.tokens)
    return out.tokens, logprobs, top, counts, seen


def _penalty_rows(state: EngineState, rows: Rows):
    """The rows' penalty statistics when some row of the dispatch uses penalties."""
    if not rows.sampling.flags.penalties:
        return None, None
    return state.token_counts[rows.slot], state.seen_mask[rows.slot]


def _store(state: EngineState, rows: Rows, cache, tokens, counts, seen) -> EngineState:
    # The state keeps its own placeholder tables: with the dispatch's, the next step's input
    # shapes would depend on the previous dispatch's and compile once per pair.
    cache = cache.with_tables(state.cache.block_tables)
    state = state.replace(cache=cache, last_token=state.last_token.at[rows.slot].set(tokens))
    if counts is not None:
        state = state.replace(token_counts=state.token_counts.at[rows.slot].set(counts),
                              seen_mask=state.seen_mask.at[rows.slot].set(seen))
    return state


@functools.partial(jax.jit, static_argnames=("plan", "head_spec"), donate_argnames=("state",))
def prefill_step(params: dict, state: EngineState, tokens: jax.Array, rows: Rows,
                 plan: Plan, head_params: dict | None = None,
                 head_spec: draft_head.HeadSpec | None = None):
    """One chunk per row: tokens [B, C] at positions position..position + count - 1 (the rest
    padding) written to the pages, attending to everything before them; the token after each
    row's chunk is sampled (kept by the host for rows whose chunk ends their prompt: those
    rows carry their slot, the others slot R). With a feature head (state.head, head_params,
    head_spec): the chunk's features and the head's pairs into its pages too.
    -> (state, tokens [B], logprobs [B], top)."""
    b, c = tokens.shape
    offsets = jnp.arange(c, dtype=jnp.int32)[None, :]  # [1, C]
    positions = jnp.where(offsets < rows.count[:, None], rows.position[:, None] + offsets, -1)
    forward = registry.family(plan.config).forward
    cache = state.cache.with_tables(rows.block_tables)
    # logits [B, 1, V]; with a head also its features f [B, C, D]
    logits, cache, *f = forward(params, tokens, positions, plan, cache,
                                logits_at=jnp.maximum(rows.count - 1, 0),
                                hidden=state.head is not None)
    counts, seen = _penalty_rows(state, rows)
    new, logprobs, top, counts, seen = _sample(logits[:, 0], rows, rows.position + rows.count,
                                               counts, seen, plan)
    state = _store(state, rows, cache, new, counts, seen)
    if state.head is not None:
        state = state.replace(head=_head_prefill(head_params, params, state.head, tokens,
                                                 positions, f[0], rows, head_spec))
    return state, new, logprobs, top


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("state",))
def decode_step(params: dict, state: EngineState, rows: Rows, plan: Plan):
    """One token per row: the slot's newest token at `position` (padding rows: -1, idle).
    -> (state, tokens [B], logprobs [B], top (see _sample))."""
    forward = registry.family(plan.config).forward
    counts, seen = _penalty_rows(state, rows)
    logits, cache = forward(params, state.last_token[rows.slot][:, None],
                            rows.position[:, None], plan,
                            state.cache.with_tables(rows.block_tables))  # [B, 1, V]
    nxt = jnp.where(rows.position < 0, rows.position, rows.position + 1)
    new, logprobs, top, counts, seen = _sample(logits[:, 0], rows, nxt, counts, seen, plan)
    return _store(state, rows, cache, new, counts, seen), new, logprobs, top


@functools.partial(jax.jit, donate_argnames=("state",))
def set_penalty_rows(state: EngineState, slots: jax.Array, counts: jax.Array,
                     seen: jax.Array) -> EngineState:
    """A (re)admitted request's penalty statistics: counts [n, V] of its generated tokens,
    seen [n, V] its prompt and generated tokens, at slots [n]."""
    return state.replace(token_counts=state.token_counts.at[slots].set(counts),
                         seen_mask=state.seen_mask.at[slots].set(seen))


@functools.partial(jax.jit, static_argnames=("plan", "head_spec", "k", "plain"),
                   donate_argnames=("state",))
def verify_step(params: dict, state: EngineState, tokens: jax.Array | None, rows: Rows,
                plan: Plan, head_params: dict | None = None,
                head_spec: draft_head.HeadSpec | None = None, k: int = 0,
                plain: bool = False, draft_laws: jax.Array | None = None):
    """Speculative decoding's step (jaxinfer/speculative.py): tokens [B, K + 1] per row, its
    newest token then K drafts, at position..position + K in one forward; the target's token
    at each position as `decode_step` would sample it if the drafts before it were accepted;
    the drafts accepted while they equal it. With a feature head (head_spec; tokens None):
    the head drafts the k tokens first (`_head_drafts`), and the verified positions' features
    and the accepted drafts' pairs go to its pages. -> (state, tokens [B, K + 1]: the accepted
    drafts then the target's next token, -1 after them; logprobs [B, K + 1]; top: (ids
    [B, K + 1, N], logprobs [B, K + 1, N]) of each position's most likely tokens when some
    row asked for top_logprobs, else None; the drafts [B, K], or a plain step's head draft
    [B, 1]). Rows carry a token bitmask only in a plain step (rows with a grammar: their
    drafter's plain round). plain (with a head): a decode step, T = 1, that still writes the
    head's pair at the newest token and its feature (the head's first forward; its draft, not
    scored, is a probe's), so the head's pages have no hole when rounds verify again.
    draft_laws [B, K, V] (a draft model's, from draft_step; a head with head_spec.rejection
    makes its own): sampled rows accept by rejection sampling (speculative._rejection), greedy
    rows as above."""
    from jaxinfer.speculative import _leading, _rejection

    if head_spec is not None:
        state, tokens, draft_laws = _head_drafts(head_params, params, state, rows, head_spec,
                                                 1 if plain else k)
        if plain:  # the head's draft is a probe's (speculative.py): returned, not scored
            probe, tokens, draft_laws = tokens[:, 1:], tokens[:, :1], None
    b, t = tokens.shape
    if rows.token_bitmask is not None and t != 1:
        raise ValueError("verify_step: a grammar's token bitmask takes a plain step (T = 1)")
    # Positions past the block table never yield a kept token (max_model_len ends the row
    # first): padding (-1), so no kernel reads or writes past a row's table.
    end = rows.block_tables.shape[1] * state.cache.page_size  # W * page_size
    offsets = jnp.arange(t, dtype=jnp.int32)[None, :]  # [1, K + 1]
    positions = jnp.where((rows.position[:, None] >= 0) & (rows.position[:, None] + offsets
                                                           < end),
                          rows.position[:, None] + offsets, -1)  # [B, K + 1]
    forward = registry.family(plan.config).forward
    # logits [B, K + 1, V]; with a head also its features f [B, K + 1, D]
    logits, cache, *f = forward(params, tokens, positions, plan,
                                state.cache.with_tables(rows.block_tables),
                                hidden=state.head is not None)
    counts0, seen0 = _penalty_rows(state, rows)
    rejection = draft_laws is not None and not rows.sampling.flags.all_greedy
    # the key of each position p + 1 + j: [B, K + 1]
    keys = jax.vmap(lambda q: _keys(rows, q), in_axes=1, out_axes=1)(
        rows.position[:, None] + 1 + offsets)
    # the penalties of position j + 1 count draft j + 1
    out, target_laws = sampling.sample_positions(
        logits, keys, rows.sampling, tokens=tokens[:, 1:], token_counts=counts0,
        seen_mask=seen0, token_bitmask=rows.token_bitmask,
        batch_invariant=plan.policy.batch_invariant, laws=rejection)
    ys = out.tokens  # [B, K + 1]
    lps = out.logprobs if rows.sampling.flags.logprobs else jnp.zeros_like(out.logprobs)
    if rejection:  # the target's laws (scaled, masked) [B, K + 1, V] each
        a, ys, lps = _rejection(tokens[:, 1:], draft_laws, ys, lps, target_laws, keys,
                                rows.sampling)
    else:  # coupled: accepted while each draft is the token plain decoding samples there
        a = _leading(tokens[:, 1:] == ys[:, :-1])  # [B] drafts accepted
    kept = offsets <= a[:, None]  # [B, K + 1]
    for j in range(t):  # the statistics count the kept tokens only
        counts0, seen0 = sampling.update_penalty_state(counts0, seen0, ys[:, j], kept[:, j])
    last = jnp.take_along_axis(ys, a[:, None], axis=1)[:, 0]
    state = _store(state, rows, cache, last, counts0, seen0)
    if state.head is not None:
        state = state.replace(head=_head_verified(head_params, params, state.head, tokens,
                                                  positions, f[0], a, rows, head_spec))
    top = None if out.top_ids is None else (out.top_ids, out.top_logprobs)
    drafts = probe if head_spec is not None and plain else tokens[:, 1:]
    return state, jnp.where(kept, ys, -1), lps, top, drafts


# -- a feature head's work (speculative decoding with an EAGLE head; jaxinfer/draft_head.py) --


def _page_slots(positions: jax.Array, block_tables: jax.Array, num_pages: int,
                page_size: int):
    """Pool coordinates (page, offset) of positions [B, T] under block_tables [B, W]; padding
    (-1) gets page num_pages, which scatters drop."""
    idx = jnp.clip(positions // page_size, 0, block_tables.shape[1] - 1)
    page = jnp.take_along_axis(block_tables, idx, axis=1)
    return jnp.where(positions >= 0, page, num_pages), positions % page_size


def _write_feats(feats: jax.Array, f: jax.Array, positions: jax.Array,
                 block_tables: jax.Array) -> jax.Array:
    """f [B, T, D] into the feature pages feats [P, page_size, D] at positions [B, T]."""
    page, off = _page_slots(positions, block_tables, *feats.shape[:2])
    return feats.at[page, off].set(f.astype(feats.dtype), mode="drop")


def _read_feats(feats: jax.Array, positions: jax.Array, block_tables: jax.Array):
    """The features at positions [B] -> [B, D]; zeros where the position is < 0 (f_{-1} = 0,
    as in training)."""
    page, off = _page_slots(positions[:, None], block_tables, *feats.shape[:2])
    f = feats[jnp.minimum(page, feats.shape[0] - 1), off][:, 0]
    return jnp.where((positions >= 0)[:, None], f, 0)


def _head_prefill(head_params, params, head: HeadPages, tokens, positions, f, rows: Rows,
                  spec: draft_head.HeadSpec) -> HeadPages:
    """A prefill chunk into the head's pages: the features f [B, C, D] at positions [B, C],
    and the pairs (t_i, f_{i-1}) at the head's slots i, f_{c-1} before the chunk read from
    its page (written by the chunk before, or a cached page's)."""
    # Written before read: a row may start on a prefix page another row of this step fills
    # (the scheduler registers pages as it schedules them).
    feats = _write_feats(head.feats, f, positions, rows.block_tables)
    prev = _read_feats(feats, rows.position - 1, rows.block_tables)  # [B, D]
    before = jnp.concatenate([prev[:, None].astype(f.dtype), f[:, :-1]], axis=1)  # f_{i-1}
    _, cache, _ = draft_head.forward(head_params, params, tokens, before, positions, spec,
                                     head.cache.with_tables(rows.block_tables),
                                     logits_at=jnp.maximum(rows.count - 1, 0))
    return HeadPages(cache=cache.with_tables(head.cache.block_tables), feats=feats)


def _head_drafts(head_params, params, state: EngineState, rows: Rows,
                 spec: draft_head.HeadSpec, k: int):
    """K drafts per row from the head, as speculative.head_drafts: the pair (x, f_{p-1}) of the
    row's newest token x (last_token) at p into the head's slot p, whose output drafts d_1;
    then one draft at a time, each step taking the head's own feature estimate g. Draft j is
    drawn with the target's key of its position (coupled drafting). Slots past p hold
    estimates until the verification rewrites the accepted ones (`_head_verified`).
    -> (state, tokens [B, K + 1]: x, then K drafts, with spec.rejection the drafts' laws'
    masked logits [B, K, V] else None)."""
    from jaxinfer.speculative import _draft_law, _draw

    head = state.head
    page_size = head.feats.shape[1]
    p = rows.position  # [B]; -1: padding
    live = p >= 0
    x = state.last_token[rows.slot]  # [B]
    feat = _read_feats(head.feats, p - 1, rows.block_tables)[:, None]  # f_{p-1}: [B, 1, D]
    cache = head.cache.with_tables(rows.block_tables)
    tok, pos = x[:, None], jnp.where(live, p, -1)[:, None]
    drafts, laws = [], []
    for j in range(k):
        logits, cache, feat = draft_head.forward(
            head_params, params, tok, feat, _in_table(pos, rows.block_tables, page_size), spec,
            cache)  # [B, 1, V], g [B, 1, D]
        masked = _draft_law(logits[:, 0], rows.sampling)  # [B, V]
        nxt = _draw(masked, _keys(rows, p + 1 + j), rows.sampling.greedy,
                    rows.sampling.flags.all_greedy)  # [B]
        drafts.append(nxt)
        laws.append(masked)
        tok, pos = nxt[:, None], jnp.where(live, p + 1 + j, -1)[:, None]
    state = state.replace(head=head.replace(cache=cache.with_tables(head.cache.block_tables)))
    return (state, jnp.concatenate([x[:, None], jnp.stack(drafts, axis=1)], axis=1),
            jnp.stack(laws, axis=1) if spec.rejection else None)


def _head_verified(head_params, params, head: HeadPages, tokens, positions, f, a, rows: Rows,
                   spec: draft_head.HeadSpec) -> HeadPages:
    """After a verification of tokens [B, K + 1] at positions [B, K + 1] with features f
    [B, K + 1, D] and a [B] drafts accepted: the kept positions' features (p..p + a) into the
    feature pages, and the accepted drafts' true pairs (d_j, f_{p+j-1}), j = 1..a, over the
    estimates drafting left in the head's slots p + 1..p + a. The head's slots then hold true
    pairs wherever the target's slots hold verified tokens (a page cached later carries no
    estimate); slot p + a + 1, the next newest token's, is the next drafting's."""
    t = tokens.shape[1]
    kept = jnp.arange(t, dtype=jnp.int32)[None, :] <= a[:, None]  # [B, K + 1]
    feats = _write_feats(head.feats, f, jnp.where(kept, positions, -1), rows.block_tables)
    if t == 1:  # a plain step: no drafts, no pairs to rewrite
        return head.replace(feats=feats)
    accepted = jnp.where(kept[:, 1:] & (positions[:, 1:] >= 0), positions[:, 1:], -1)
    _, cache, _ = draft_head.forward(head_params, params, tokens[:, 1:], f[:, :-1], accepted,
                                     spec, head.cache.with_tables(rows.block_tables),
                                     logits_at=jnp.zeros_like(a))
    return HeadPages(cache=cache.with_tables(head.cache.block_tables), feats=feats)


# -- a draft model's steps (speculative decoding with a draft model; jaxinfer/speculative.py) --


def _in_table(positions: jax.Array, block_tables: jax.Array, page_size: int) -> jax.Array:
    """positions [B, T] past the rows' block tables as padding (-1): nothing kept lies there
    (max_model_len ends a row first), and no kernel then reads past a table."""
    return jnp.where(positions < block_tables.shape[1] * page_size, positions, -1)


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("cache",))
def draft_prefill_step(params: dict, cache: PagedKVCache, tokens: jax.Array, rows: Rows,
                       plan: Plan) -> PagedKVCache:
    """prefill_step's chunk [B, C] into the draft model's pages (the same page indices as the
    target's: both pools follow the rows' block tables); no token is sampled."""
    b, c = tokens.shape
    offsets = jnp.arange(c, dtype=jnp.int32)[None, :]  # [1, C]
    positions = jnp.where(offsets < rows.count[:, None], rows.position[:, None] + offsets, -1)
    forward = registry.family(plan.config).forward
    _, out = forward(params, tokens, positions, plan, cache.with_tables(rows.block_tables),
                     logits_at=jnp.maximum(rows.count - 1, 0))
    return out.with_tables(cache.block_tables)  # its placeholder tables, as _store's


@functools.partial(jax.jit, static_argnames=("plan", "k", "laws"), donate_argnames=("cache",))
def draft_step(params: dict, cache: PagedKVCache, last_two: jax.Array, rows: Rows, plan: Plan,
               k: int, laws: bool = False):
    """K drafts per row from the draft model: its first forward takes the row's token before
    its newest and the newest, last_two [B, 2] at position - 1, position (rewriting the first
    is idempotent; it is missing when the last round accepted every draft), then one token at
    a time; draft j is drawn with the target's key of its position (coupled drafting, as
    speculative.model_drafts). -> (cache, tokens [B, K + 1]: the newest token, then K drafts,
    with `laws` the drafts' laws' masked logits [B, K, V] for rejection sampling, else None)."""
    from jaxinfer.speculative import _draft_law, _draw

    forward = registry.family(plan.config).forward
    page_size = cache.page_size
    placeholder = cache.block_tables
    p = rows.position  # [B]; -1: padding
    live = (p >= 0)[:, None]
    tokens = last_two
    positions = jnp.where(live, jnp.stack([p - 1, p], axis=1), -1)
    drafts, masks = [], []
    for j in range(k):
        logits, cache = forward(params, tokens, _in_table(positions, rows.block_tables,
                                                          page_size), plan,
                                cache.with_tables(rows.block_tables))
        masked = _draft_law(logits[:, -1], rows.sampling)  # [B, V]
        nxt = _draw(masked, _keys(rows, p + 1 + j), rows.sampling.greedy,
                    rows.sampling.flags.all_greedy)  # [B]
        drafts.append(nxt)
        masks.append(masked)
        tokens, positions = nxt[:, None], jnp.where(live, (p + 1 + j)[:, None], -1)
    # The placeholder tables it came with (as _store's): the next step's shapes stay its own.
    return (cache.with_tables(placeholder),
            jnp.concatenate([last_two[:, 1:], jnp.stack(drafts, axis=1)], axis=1),
            jnp.stack(masks, axis=1) if laws else None)
