"""The sampler: logits [B, V] -> one token per row, pure and jittable.

Processing order (HF `generate` and vLLM agree on it):

    penalties -> greedy argmax | temperature -> top-k -> top-p -> min-p -> Gumbel-max draw

1. Penalties, on the raw float32 logits. Repetition penalty (HF): for every token seen in the
   prompt or the output so far, a positive logit is divided by the penalty and a negative one
   multiplied. Then frequency/presence penalties (vLLM/OpenAI), over generated tokens only:
   `logit -= frequency * count + presence * (count > 0)`.
2. Greedy rows (temperature 0) take the argmax of the penalized logits (first index on ties).
3. Sampled rows divide by their temperature, then truncate. Each truncation becomes a per-row
   threshold on the scaled logits (keep `scaled >= cut`), so the three compose by taking the
   largest threshold and the draw always runs over the whole vocabulary in token-id order:
   - top-k keeps the k largest, and every token tied with the k-th (as HF's TopKLogitsWarper);
   - top-p keeps the smallest prefix of the top-k-renormalised distribution (sorted by
     probability) whose mass reaches top_p; token i is kept iff the mass strictly above it is
     < top_p, so at least one token always survives (HF's TopPLogitsWarper rule). Tokens tied
     with the last kept one are kept as well (HF's pick among exact ties depends on sort order);
   - min-p keeps tokens whose probability is >= min_p * the largest probability. This is a ratio,
     so renormalisation by earlier stages does not change it: `scaled >= max + log(min_p)`.
4. The draw is Gumbel-max: argmax(masked scaled logits + Gumbel noise), the noise of row b drawn
   from its own key over all V ids. A request's token therefore depends only on its logits, its
   parameters and its key: not on its row, the batch size, or which stages the batch compiled.
   Keys come from (seed, request id, position) (`request_keys`, `SamplerState`).

Logprobs (`sample_with_logprobs`) are those of the chosen token under log_softmax of the
penalized, temperature-scaled logits *before* truncation (what vLLM reports as "processed
logprobs"); greedy rows use temperature 1.

Per-row parameters live in `SamplingTensors` ([B] arrays), so one compiled step serves a batch
mixing greedy and sampled requests. Its static `SamplingFlags` (host-derived, pytree aux data)
let the traced code drop whole stages: no penalties pass without penalties, no sort and no
`top_k` without top-k/top-p, no random numbers when every row is greedy. A new flag combination
compiles a new executable; top-k caps are rounded up to powers of two to keep that count small.

Cost per step at B rows over a vocabulary of V (the stages are elementwise or row reductions
that XLA fuses, plus):
- top-k: `lax.top_k(scaled, K)` with K = the batch's largest top_k rounded up to a power of two.
- top-p: needs the distribution sorted. Rows that also use top-k sort only their K candidates
  (the nucleus lies inside the top-k set), so top_k + top_p costs no more than top-k. Rows using
  top-p without top-k need a full sort of [B, V] values, O(V log V) per row, by far the most
  expensive stage at V ~ 152k. `SamplingTensors.from_params(..., top_p_candidates=N)` trades
  exactness for speed: the nucleus is then searched among the top N logits only (probabilities
  still normalised over the whole vocabulary), exact whenever the nucleus has at most N tokens
  and otherwise truncated to those N.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# Temperatures below this are treated as greedy, as vLLM does: dividing by them overflows float32.
GREEDY_TEMPERATURE = 1e-5


# ---------------------------------------------------------------------------------------------
# Host-side parameters of one request
# ---------------------------------------------------------------------------------------------


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(
        x, (bool, np.bool_))


@jax.tree_util.register_static  # a leafless pytree: jit takes it as a static argument
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token of one request. Frozen and hashable (static under jit).

    temperature: 0 = greedy (argmax); otherwise logits are divided by it. >= 0, finite.
    top_k: keep the k most likely tokens; 0 = off. Integer >= 0 (clamped to the vocabulary).
    top_p: nucleus sampling mass in (0, 1]; 1.0 = off.
    min_p: keep tokens with probability >= min_p * max probability; in [0, 1), 0 = off.
    repetition_penalty: HF semantics over prompt + output tokens; > 0, 1.0 = off.
    presence_penalty, frequency_penalty: vLLM/OpenAI semantics over generated tokens; in [-2, 2].
    logprobs: report the log-probability of each chosen token.
    seed: this request's own seed; its draws then depend on (seed, position) only. None = derive
        them from the batch seed and the request's index.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    seed: int | None = None

    def __post_init__(self):
        problems = []

        def check(name, ok, allowed):
            value = getattr(self, name)
            if not ok(value):
                problems.append(f"{name} must be {allowed}, got {value!r}")

        check("temperature", lambda t: _is_real(t) and math.isfinite(t) and t >= 0,
              "a finite number >= 0 (0 = greedy)")
        check("top_k", lambda k: _is_int(k) and k >= 0, "an integer >= 0 (0 = off)")
        check("top_p", lambda p: _is_real(p) and 0 < p <= 1, "in (0, 1] (1.0 = off)")
        check("min_p", lambda p: _is_real(p) and 0 <= p < 1, "in [0, 1) (0 = off)")
        check("repetition_penalty", lambda r: _is_real(r) and math.isfinite(r) and r > 0,
              "a finite number > 0 (1.0 = off)")
        check("presence_penalty", lambda r: _is_real(r) and -2 <= r <= 2, "in [-2, 2] (0 = off)")
        check("frequency_penalty", lambda r: _is_real(r) and -2 <= r <= 2, "in [-2, 2] (0 = off)")
        check("logprobs", lambda b: isinstance(b, (bool, np.bool_)), "a bool")
        check("seed", lambda s: s is None or (_is_int(s) and 0 <= s < 2**32),
              "None or an integer in [0, 2**32)")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


# ---------------------------------------------------------------------------------------------
# Per-row parameters of a batch, as a pytree
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SamplingFlags:
    """Which stages some row of the batch needs; static (part of the compiled program)."""

    any_greedy: bool = False
    all_greedy: bool = False
    top_k_cap: int = 0  # static K of lax.top_k (>= every row's top_k); 0: no row uses top-k
    top_p: bool = False
    # Some top-p row has no top-k: its nucleus is searched over `top_p_candidates` logits, or
    # over the whole (sorted) vocabulary when that is 0.
    top_p_without_top_k: bool = False
    top_p_candidates: int = 0
    min_p: bool = False
    repetition_penalty: bool = False
    presence_frequency_penalty: bool = False
    logprobs: bool = False

    @property
    def penalties(self) -> bool:
        return self.repetition_penalty or self.presence_frequency_penalty


def _round_up_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@struct.dataclass
class SamplingTensors:
    """Sampling parameters of every row of a batch. Build with `from_params`.

    Greedy rows carry temperature 1 and no truncation (those are ignored for them), so flags
    reflect only what sampled rows need.
    """

    greedy: jax.Array  # [B] bool
    temperature: jax.Array  # [B] float32, 1.0 on greedy rows
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] float32, 1.0 = off
    min_p: jax.Array  # [B] float32, 0.0 = off
    repetition_penalty: jax.Array  # [B] float32, 1.0 = off
    presence_penalty: jax.Array  # [B] float32
    frequency_penalty: jax.Array  # [B] float32
    flags: SamplingFlags = struct.field(pytree_node=False, default=SamplingFlags())

    @property
    def batch_size(self) -> int:
        return self.greedy.shape[0]

    @classmethod
    def from_params(cls, params: SamplingParams | Sequence[SamplingParams],
                    batch_size: int | None = None, *,
                    top_p_candidates: int | None = None) -> SamplingTensors:
        """Stack per-request params into [B] arrays (a single SamplingParams is broadcast).

        top_p_candidates: search the nucleus of rows using top-p without top-k among this many
        largest logits instead of sorting the whole vocabulary (see the module docstring).
        """
        if isinstance(params, SamplingParams):
            if batch_size is None:
                raise ValueError("SamplingTensors.from_params(one SamplingParams) needs "
                                 "batch_size to broadcast it to")
            params = [params] * int(batch_size)
        params = list(params)
        if not params or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("SamplingTensors.from_params needs a SamplingParams or a non-empty "
                             f"list of them, got {params!r}")
        if batch_size is not None and len(params) != batch_size:
            raise ValueError(f"got {len(params)} SamplingParams for batch_size {batch_size}")
        if top_p_candidates is not None and (not _is_int(top_p_candidates)
                                             or top_p_candidates < 1):
            raise ValueError(f"top_p_candidates must be None or an integer >= 1, "
                             f"got {top_p_candidates!r}")

        greedy = np.array([p.greedy for p in params])
        sampled = [p for p in params if not p.greedy]
        # Truncation is meaningless for greedy rows: switch it off there, keeping flags minimal.
        top_k = np.array([0 if p.greedy else p.top_k for p in params], np.int32)
        top_p = np.array([1.0 if p.greedy else p.top_p for p in params], np.float32)
        min_p = np.array([0.0 if p.greedy else p.min_p for p in params], np.float32)
        max_k = max((p.top_k for p in sampled), default=0)
        flags = SamplingFlags(
            any_greedy=bool(greedy.any()),
            all_greedy=bool(greedy.all()),
            top_k_cap=_round_up_pow2(max_k) if max_k > 0 else 0,
            top_p=any(p.top_p < 1 for p in sampled),
            top_p_without_top_k=any(p.top_p < 1 and p.top_k == 0 for p in sampled),
            top_p_candidates=int(top_p_candidates or 0),
            min_p=any(p.min_p > 0 for p in sampled),
            repetition_penalty=any(p.repetition_penalty != 1 for p in params),
            presence_frequency_penalty=any(p.presence_penalty != 0 or p.frequency_penalty != 0
                                           for p in params),
            logprobs=any(p.logprobs for p in params),
        )

        def f32(name):
            return jnp.asarray(np.array([getattr(p, name) for p in params], np.float32))

        return cls(
            greedy=jnp.asarray(greedy),
            temperature=jnp.asarray(np.where(greedy, 1.0, [p.temperature for p in params])
                                    .astype(np.float32)),
            top_k=jnp.asarray(top_k), top_p=jnp.asarray(top_p), min_p=jnp.asarray(min_p),
            repetition_penalty=f32("repetition_penalty"),
            presence_penalty=f32("presence_penalty"),
            frequency_penalty=f32("frequency_penalty"),
            flags=flags,
        )


@struct.dataclass
class SampleOutput:
    tokens: jax.Array  # [B] int32
    logprobs: jax.Array  # [B] float32: chosen token under the processed, untruncated distribution


# ---------------------------------------------------------------------------------------------
# Keys and penalty state
# ---------------------------------------------------------------------------------------------


def request_keys(seed, request_ids: jax.Array, positions: jax.Array) -> jax.Array:
    """Typed keys [B]: row b's key is fold_in(fold_in(key(seed), request_ids[b]), positions[b]).

    Depends on nothing but (seed, request, position), so a request draws the same numbers in any
    batch and at any row. Jittable (seed may be traced).
    """
    base = jax.random.key(seed)
    per_request = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(base, jnp.asarray(request_ids))
    return jax.vmap(jax.random.fold_in)(per_request, jnp.asarray(positions))


def update_penalty_state(token_counts: jax.Array | None, seen_mask: jax.Array | None,
                         tokens: jax.Array, active: jax.Array | None = None,
                         ) -> tuple[jax.Array | None, jax.Array | None]:
    """Count one new token per row: counts [B, V] int32 += 1 and seen [B, V] bool |= at `tokens`.

    `active` [B] bool leaves finished rows unchanged. Either array may be None (not tracked).
    Out-of-range ids (e.g. -1 padding) are dropped.
    """
    rows = jnp.arange(tokens.shape[0])  # [B]
    if active is not None:
        tokens = jnp.where(active, tokens, -1)
    # Negative indices would wrap around; send them past the end, where mode="drop" discards them.
    if token_counts is not None:
        idx = jnp.where(tokens < 0, token_counts.shape[1], tokens)
        token_counts = token_counts.at[rows, idx].add(1, mode="drop")
    if seen_mask is not None:
        idx = jnp.where(tokens < 0, seen_mask.shape[1], tokens)
        seen_mask = seen_mask.at[rows, idx].set(True, mode="drop")
    return token_counts, seen_mask


@struct.dataclass
class SamplerState:
    """The sampler's part of the decode state: per-request base keys and penalty statistics."""

    keys: jax.Array  # [B] typed keys: fold_in(key(seed), request) or key(request's own seed)
    token_counts: jax.Array | None  # [B, V] int32 generated-token counts (presence/frequency)
    seen_mask: jax.Array | None  # [B, V] bool prompt + generated tokens (repetition penalty)

    @classmethod
    def init(cls, seed: int, params: Sequence[SamplingParams],
             prompt_ids: Sequence[Sequence[int]], vocab_size: int,
             tensors: SamplingTensors | None = None,
             request_ids: Sequence[int] | None = None) -> SamplerState:
        """Keys for each request and penalty arrays (only those some request needs).

        Request b (id request_ids[b], default b) uses fold_in(key(seed), id), or fold_in(key(own
        seed), 0) when its SamplingParams.seed is set, so equal own seeds give equal draws.
        """
        params = list(params)
        if len(prompt_ids) != len(params):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompt_ids)} prompts")
        flags = (tensors or SamplingTensors.from_params(params)).flags
        ids = np.arange(len(params)) if request_ids is None else np.asarray(request_ids)
        seeds = np.array([seed if p.seed is None else p.seed for p in params], np.uint32)
        ids = np.where([p.seed is None for p in params], ids, 0).astype(np.int32)
        keys = jax.vmap(jax.random.fold_in)(jax.vmap(jax.random.key)(jnp.asarray(seeds)),
                                            jnp.asarray(ids))
        counts = seen = None
        if flags.presence_frequency_penalty:
            counts = jnp.zeros((len(params), vocab_size), jnp.int32)
        if flags.repetition_penalty:
            host = np.zeros((len(params), vocab_size), bool)
            for row, prompt in enumerate(prompt_ids):
                prompt = np.asarray(prompt, np.int64)
                if prompt.size and (prompt.min() < 0 or prompt.max() >= vocab_size):
                    raise ValueError(f"prompt {row} has token ids outside [0, {vocab_size})")
                host[row, prompt] = True
            seen = jnp.asarray(host)
        return cls(keys=keys, token_counts=counts, seen_mask=seen)


def step_keys(state: SamplerState, positions: jax.Array) -> jax.Array:
    """Keys [B] for sampling the token at `positions` [B]: fold_in(request key, position)."""
    return jax.vmap(jax.random.fold_in)(state.keys, positions)


def observe(state: SamplerState, tokens: jax.Array, active: jax.Array | None = None,
            ) -> SamplerState:
    """Record the new tokens [B] of the rows still `active` [B] in the penalty statistics."""
    counts, seen = update_penalty_state(state.token_counts, state.seen_mask, tokens, active)
    return state.replace(token_counts=counts, seen_mask=seen)


# ---------------------------------------------------------------------------------------------
# The sampler
# ---------------------------------------------------------------------------------------------


def apply_penalties(logits: jax.Array, params: SamplingTensors, *,
                    token_counts: jax.Array | None = None,
                    seen_mask: jax.Array | None = None) -> jax.Array:
    """Repetition (HF), then frequency and presence (vLLM) penalties on logits [B, V]."""
    flags = params.flags
    if flags.repetition_penalty:
        if seen_mask is None:
            raise ValueError("a repetition_penalty != 1 needs seen_mask [B, V] (tokens of the "
                             "prompt and output so far); see SamplerState")
        rp = params.repetition_penalty[:, None]  # [B, 1]
        penalized = jnp.where(logits > 0, logits / rp, logits * rp)
        logits = jnp.where(seen_mask, penalized, logits)
    if flags.presence_frequency_penalty:
        if token_counts is None:
            raise ValueError("presence/frequency penalties need token_counts [B, V] (generated "
                             "token counts); see SamplerState")
        counts = token_counts.astype(jnp.float32)  # [B, V]
        logits = (logits - params.frequency_penalty[:, None] * counts
                  - params.presence_penalty[:, None] * (counts > 0))
    return logits


def _truncation_cut(scaled: jax.Array, params: SamplingTensors) -> jax.Array | None:
    """Per-row threshold [B]: top-k/top-p/min-p keep exactly the tokens with scaled >= cut."""
    flags = params.flags
    b, v = scaled.shape
    neg_inf = jnp.float32(-jnp.inf)
    cut = None

    if flags.top_k_cap or flags.top_p:
        if flags.top_p_without_top_k:
            n = v if not flags.top_p_candidates else min(
                v, max(flags.top_p_candidates, flags.top_k_cap))
        else:
            n = min(v, flags.top_k_cap)
        if n == v:
            cand = -jnp.sort(-scaled, axis=-1)  # [B, V] descending; values only
        else:
            cand, _ = jax.lax.top_k(scaled, n)  # [B, N] descending

        cut = jnp.full((b,), neg_inf)
        if flags.top_k_cap:
            k = jnp.clip(params.top_k, 0, n)  # [B]
            kth = jnp.take_along_axis(cand, jnp.maximum(k, 1)[:, None] - 1, axis=1)[:, 0]
            cut = jnp.where(k > 0, kth, neg_inf)
        if flags.top_p:
            in_k = cand >= cut[:, None]  # [B, N] the top-k set (everything where top-k is off)
            lse = jax.nn.logsumexp(jnp.where(in_k, cand, neg_inf), axis=-1)  # [B]
            if flags.top_p_without_top_k and n < v:
                # Rows without top-k normalise over the whole vocabulary, not the candidates.
                lse = jnp.where(params.top_k > 0, lse, jax.nn.logsumexp(scaled, axis=-1))
            valid = in_k & (cand > neg_inf)
            probs = jnp.where(valid, jnp.exp(cand - lse[:, None]), 0.0)  # [B, N]
            mass_above = jnp.cumsum(probs, axis=-1) - probs  # exclusive prefix sum
            keep = valid & (mass_above < params.top_p[:, None])
            last = jnp.maximum(jnp.sum(keep, axis=-1), 1) - 1  # [B] index of the last kept
            cut_p = jnp.take_along_axis(cand, last[:, None], axis=1)[:, 0]
            # top_p == 1 keeps everything; the float prefix sum may reach 1 early, so skip it.
            cut = jnp.maximum(cut, jnp.where(params.top_p < 1, cut_p, neg_inf))

    if flags.min_p:
        row_max = jnp.max(scaled, axis=-1)  # [B]
        log_min_p = jnp.log(jnp.maximum(params.min_p, 1e-30))
        cut_m = jnp.where(params.min_p > 0, row_max + log_min_p, neg_inf)
        cut = cut_m if cut is None else jnp.maximum(cut, cut_m)
    return cut


def _as_row_keys(keys: jax.Array, batch: int) -> jax.Array:
    if not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        keys = jax.random.wrap_key_data(keys)  # legacy uint32 [..., 2] keys
    if keys.shape == ():
        # One key for the whole batch: a convenience; draws then depend on the row index.
        return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(keys, jnp.arange(batch))
    if keys.shape != (batch,):
        raise ValueError(f"keys must be one key or [B] = [{batch}] keys (see request_keys), "
                         f"got shape {keys.shape}")
    return keys


def sample_with_logprobs(logits: jax.Array, keys: jax.Array,
                         params: SamplingTensors | SamplingParams | Sequence[SamplingParams], *,
                         token_counts: jax.Array | None = None,
                         seen_mask: jax.Array | None = None) -> SampleOutput:
    """Sample one token per row of logits [B, V]; also its logprob (see the module docstring).

    keys: [B] typed keys (`request_keys`, `step_keys`); params: per-row `SamplingTensors`, or
    SamplingParams for every row. token_counts [B, V] int32 (generated tokens) feeds presence and
    frequency penalties, seen_mask [B, V] bool (prompt + generated) the repetition penalty.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
    b, v = logits.shape
    if not isinstance(params, SamplingTensors):
        params = SamplingTensors.from_params(params, b if isinstance(params, SamplingParams)
                                             else None)
    if params.batch_size != b:
        raise ValueError(f"SamplingTensors has {params.batch_size} rows, logits {b}")
    flags = params.flags
    keys = _as_row_keys(keys, b)
    neg_inf = jnp.float32(-jnp.inf)

    x = logits.astype(jnp.float32)  # [B, V]
    x = jnp.where(jnp.isnan(x), neg_inf, x)  # a NaN must never win an argmax
    x = apply_penalties(x, params, token_counts=token_counts, seen_mask=seen_mask)

    if flags.all_greedy:
        scaled = x
        tokens = jnp.argmax(x, axis=-1)
    else:
        scaled = x / params.temperature[:, None]  # [B, V]; greedy rows have temperature 1
        cut = _truncation_cut(scaled, params)
        masked = scaled if cut is None else jnp.where(scaled >= cut[:, None], scaled, neg_inf)
        gumbel = jax.vmap(jax.random.gumbel, in_axes=(0, None, None))(keys, (v,), jnp.float32)
        tokens = jnp.argmax(masked + gumbel, axis=-1)  # [B]
        if flags.any_greedy:
            tokens = jnp.where(params.greedy, jnp.argmax(x, axis=-1), tokens)
    tokens = tokens.astype(jnp.int32)

    lse = jax.nn.logsumexp(scaled, axis=-1)  # [B]
    chosen = jnp.take_along_axis(scaled, tokens[:, None], axis=1)[:, 0]  # [B]
    logprobs = jnp.where(jnp.isfinite(lse) & jnp.isfinite(chosen), chosen - lse, neg_inf)
    return SampleOutput(tokens=tokens, logprobs=logprobs)


def sample(logits: jax.Array, keys: jax.Array,
           params: SamplingTensors | SamplingParams | Sequence[SamplingParams], *,
           token_counts: jax.Array | None = None,
           seen_mask: jax.Array | None = None) -> jax.Array:
    """Tokens [B] int32 for logits [B, V]: `sample_with_logprobs` without the logprobs.

    Under jit the logprob computation is dead code and XLA removes it.
    """
    return sample_with_logprobs(logits, keys, params, token_counts=token_counts,
                                seen_mask=seen_mask).tokens
