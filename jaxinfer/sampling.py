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
penalized, temperature-scaled logits *before* truncation and before a grammar's mask (what
vLLM reports as "processed logprobs"); greedy rows use temperature 1. `top_logprobs` > 0 also
reports the most likely tokens of that distribution and their logprobs (OpenAI's alternatives).

Structured output: `token_bitmask` [B, ceil(V / 32)] int32 (bit i % 32 of word i // 32 set:
token i allowed; llguidance's layout) removes disallowed tokens after the penalties, before
greedy argmax and truncation, so top-k / top-p act on what the grammar allows. Unconstrained
rows of a constrained batch carry all bits set (-1 words). Ids past the mask's 32 * W bits (a
model vocabulary padded beyond the tokenizer's) are disallowed. Without a mask (None) the
program has no mask work at all.

Per-row parameters live in `SamplingTensors` ([B] arrays), so one compiled step serves a batch
mixing greedy and sampled requests. Its static `SamplingFlags` (host-derived, pytree aux data)
let the traced code drop whole stages: no penalty pass without penalties, no top-n search
without top-k, no radix select unless some row uses top-p without top-k, no random numbers
when every row is greedy. A new flag combination compiles a new executable; the top-k cap is
rounded up to a power of two so that only a few get compiled.

Cost (H200, V = 151936, jitted `sample`, ms at B = 1 / 32 / 256; XLA fuses the elementwise
stages, the penalties and the Gumbel draw into row reductions):
    greedy 0.04 / 0.05 / 0.07; temperature only 0.05 / 0.08 / 0.28 (the [B, V] Gumbel noise);
    top_k=50 0.07 / 0.11 / 0.51; top_k=50 + top_p + min_p 0.08 / 0.13 / 0.61; top_k=1000 0.14 /
    0.25 / 0.80; top_p=0.9 alone 0.20 / 0.31 / 1.45; min_p or penalties add ~0.04 at B=256.
- top-k: XLA's GPU `lax.top_k` sorts the whole row for k > 16 (2.6 ms at B=256, the same as a
  full sort), so `_top_values` finds the top n exactly in two stages: chunk maxima (one pass),
  the n best chunks, then top-n among n * 128 candidates. This was 3x faster end to end.
- top-p needs the distribution in sorted order. With top-k the nucleus lies inside the sorted
  top-n candidates, so it costs a cumsum over n values. Without top-k the nucleus may span much
  of the vocabulary; instead of a full sort (3.2 ms end to end at B=256) `_radix_select` finds
  the boundary value exactly in 16 passes over the row (1.45 ms), each pass comparing the
  masses above 3 candidate thresholds. Prefer top-k + top-p for large batches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import pytree

# Temperatures below this are treated as greedy, as vLLM does: dividing by them overflows float32.
GREEDY_TEMPERATURE = 1e-5
# The most alternatives per token a request may ask for (OpenAI's limit for top_logprobs).
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries of a request's logit_bias (its [B, L] arrays: L a power of two)


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

    The defaults sample at temperature 1 (as vLLM's); `generate` without `sampling` is greedy
    (as HF's `generate`), and so is the CLI unless given --temperature.

    temperature: 0 = greedy (argmax); otherwise logits are divided by it. >= 0, finite.
    top_k: keep the k most likely tokens; 0 = off. Integer >= 0 (clamped to the vocabulary).
    top_p: nucleus sampling mass in (0, 1]; 1.0 = off.
    min_p: keep tokens with probability >= min_p * max probability; in [0, 1), 0 = off.
    repetition_penalty: HF semantics over prompt + output tokens; > 0, 1.0 = off.
    presence_penalty, frequency_penalty: vLLM/OpenAI semantics over generated tokens; in [-2, 2].
    logprobs: report the log-probability of each chosen token.
    top_logprobs: also report the k most likely tokens at each position and their logprobs
        (OpenAI's top_logprobs); 0 = off, at most MAX_TOP_LOGPROBS.
    seed: this request's own seed; its draws then depend on (seed, position) only. None = derive
        them from the batch seed and the request's index.
    logit_bias: {token id: bias in [-100, 100]} added to the logits before every other stage
        (OpenAI's and vLLM's; at most MAX_LOGIT_BIAS entries), kept as sorted (id, bias) pairs.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        problems = []
        bias = self.logit_bias
        if bias is None:
            bias = ()
        elif isinstance(bias, dict):
            bias = tuple(bias.items())
        try:
            bias = tuple(sorted((k, v) for k, v in bias))
        except (TypeError, ValueError):
            problems.append(f"logit_bias must be a {{token id: bias}} mapping, got {bias!r}")
            bias = ()
        bad = [(k, v) for k, v in bias if not (_is_int(k) and k >= 0 and _is_real(v)
                                                and -100 <= v <= 100)]
        if bad:
            problems.append(f"logit_bias must map token ids >= 0 to biases in [-100, 100], got "
                            f"{dict(bad[:3])!r}")
        elif len(bias) > MAX_LOGIT_BIAS:
            problems.append(f"logit_bias has {len(bias)} entries, at most {MAX_LOGIT_BIAS}")
        else:
            bias = tuple((int(k), float(v)) for k, v in bias)
        object.__setattr__(self, "logit_bias", bias)

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
        check("top_logprobs", lambda k: _is_int(k) and 0 <= k <= MAX_TOP_LOGPROBS,
              f"an integer in [0, {MAX_TOP_LOGPROBS}] (0 = off)")
        check("seed", lambda s: s is None or (_is_int(s) and 0 <= s < 2**32),
              "None or an integer in [0, 2**32)")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def check_vocabulary(self, vocab_size: int) -> None:
        """A ValueError naming the first logit_bias id outside [0, vocab_size), if any."""
        bad = [k for k, _ in self.logit_bias if k >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary "
                             f"[0, {vocab_size})")


# ---------------------------------------------------------------------------------------------
# Per-row parameters of a batch, as a pytree
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SamplingFlags:
    """Which stages some row of the batch needs; static (part of the compiled program)."""

    any_greedy: bool = False
    all_greedy: bool = False
    top_k_cap: int = 0  # static n of the top-n search, >= every row's top_k; 0: no top-k row
    top_p: bool = False
    top_p_without_top_k: bool = False  # some top-p row has no top-k: needs the radix select
    min_p: bool = False
    repetition_penalty: bool = False
    presence_frequency_penalty: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # static k of the alternatives search: 0, or MAX_TOP_LOGPROBS
    logit_bias: int = 0  # static L of the [B, L] bias arrays (a power of two); 0: no bias

    @property
    def penalties(self) -> bool:
        return self.repetition_penalty or self.presence_frequency_penalty

    def union(self, other: SamplingFlags) -> SamplingFlags:
        """Flags that run every stage either needs. A row's token and logprob do not depend on
        the stages the batch compiled, so a server can keep one growing set of flags (few
        executables) instead of compiling each batch's own."""
        return SamplingFlags(
            any_greedy=self.any_greedy or other.any_greedy,
            all_greedy=self.all_greedy and other.all_greedy,
            top_k_cap=max(self.top_k_cap, other.top_k_cap),
            top_logprobs=max(self.top_logprobs, other.top_logprobs),
            logit_bias=max(self.logit_bias, other.logit_bias),
            **{f.name: getattr(self, f.name) or getattr(other, f.name)
               for f in dataclasses.fields(self)
               if f.name not in ("any_greedy", "all_greedy", "top_k_cap", "top_logprobs",
                                 "logit_bias")})


@pytree.dataclass
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
    bias_ids: jax.Array  # [B, L] int32: logit_bias's token ids, padded with (0, 0.0)
    bias_values: jax.Array  # [B, L] float32
    flags: SamplingFlags = pytree.static_field(SamplingFlags())

    @property
    def batch_size(self) -> int:
        return self.greedy.shape[0]

    def widen(self, flags: SamplingFlags) -> SamplingTensors:
        """These rows under flags (a union of theirs and others'): the bias arrays padded to
        flags.logit_bias entries, so the program is the one those flags compiled."""
        pad = flags.logit_bias - self.bias_ids.shape[1]
        if pad < 0:
            raise ValueError(f"flags.logit_bias {flags.logit_bias} < the rows' "
                             f"{self.bias_ids.shape[1]} entries")
        return self.replace(bias_ids=jnp.pad(self.bias_ids, ((0, 0), (0, pad))),
                            bias_values=jnp.pad(self.bias_values, ((0, 0), (0, pad))),
                            flags=flags)

    @classmethod
    def from_params(cls, params: SamplingParams | Sequence[SamplingParams],
                    batch_size: int | None = None) -> SamplingTensors:
        """Stack per-request params into [B] arrays (a single SamplingParams is broadcast)."""
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
        greedy = np.array([p.greedy for p in params])
        sampled = [p for p in params if not p.greedy]
        # Truncation is meaningless for greedy rows: switch it off there, keeping flags minimal.
        top_k = np.array([0 if p.greedy else p.top_k for p in params], np.int32)
        top_p = np.array([1.0 if p.greedy else p.top_p for p in params], np.float32)
        min_p = np.array([0.0 if p.greedy else p.min_p for p in params], np.float32)
        max_k = max((p.top_k for p in sampled), default=0)
        most = max(len(p.logit_bias) for p in params)
        width = 1 << (most - 1).bit_length() if most else 0  # few distinct programs, as top_k
        bias_ids = np.zeros((len(params), width), np.int32)
        bias_values = np.zeros((len(params), width), np.float32)
        for i, p in enumerate(params):
            for j, (k, v) in enumerate(p.logit_bias):
                bias_ids[i, j], bias_values[i, j] = k, v
        flags = SamplingFlags(
            any_greedy=bool(greedy.any()),
            all_greedy=bool(greedy.all()),
            # Rounded up to a power of two so that few distinct programs get compiled.
            top_k_cap=1 << (max_k - 1).bit_length() if max_k else 0,
            top_p=any(p.top_p < 1 for p in sampled),
            top_p_without_top_k=any(p.top_p < 1 and p.top_k == 0 for p in sampled),
            min_p=any(p.min_p > 0 for p in sampled),
            repetition_penalty=any(p.repetition_penalty != 1 for p in params),
            presence_frequency_penalty=any(p.presence_penalty != 0 or p.frequency_penalty != 0
                                           for p in params),
            logprobs=any(p.logprobs or p.top_logprobs for p in params),
            # One k for every batch that asks (one more program, not one per k).
            top_logprobs=MAX_TOP_LOGPROBS if any(p.top_logprobs for p in params) else 0,
            logit_bias=width,
        )

        def f32(name):
            return np.array([getattr(p, name) for p in params], np.float32)

        arrays = dict(
            greedy=greedy,
            temperature=np.where(greedy, 1.0, [p.temperature for p in params]).astype(np.float32),
            top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=f32("repetition_penalty"),
            presence_penalty=f32("presence_penalty"),
            frequency_penalty=f32("frequency_penalty"),
            bias_ids=bias_ids, bias_values=bias_values)
        # One transfer call for all of them (the engine builds these every step it admits or
        # finishes a request).
        return cls(**jax.device_put(arrays), flags=flags)


@pytree.dataclass
class SampleOutput:
    tokens: jax.Array  # [B] int32
    logprobs: jax.Array  # [B] float32: chosen token under the processed, untruncated distribution
    top_ids: jax.Array | None = None  # [B, K] int32: the K most likely tokens (flags.top_logprobs)
    top_logprobs: jax.Array | None = None  # [B, K] float32: their logprobs, descending


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


@pytree.dataclass
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
        if not (_is_int(seed) and 0 <= seed < 2**32):
            raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
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
    """logit_bias (OpenAI's: added first, as vLLM does), then repetition (HF), then frequency
    and presence (vLLM) penalties on logits [B, V]."""
    flags = params.flags
    if flags.logit_bias:  # padding entries add 0.0 to token 0: exact, in any order
        rows = jnp.arange(logits.shape[0])[:, None]  # [B, 1]
        logits = logits.at[rows, params.bias_ids].add(params.bias_values)
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


_TOP_CHUNK = 128  # logits per chunk in _top_values (32 and 512 measured slower on the H200)


def _top_k(x: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """The n largest values of each row of x [B, V], descending [B, n], and their ids [B, n].

    XLA's GPU top_k sorts the whole row once k > 16 (2.6 ms for [256, 152k] on an H200), so a
    large vocabulary is searched in two stages: the maxima of chunks of C logits (one pass),
    the n chunks with the largest maxima, then top-n among those n * C values. Every value of
    the true top n lies in those chunks, except extra copies of a value tied with the n-th.
    """
    b, v = x.shape
    if n * 64 >= v:
        return jax.lax.top_k(x, n)
    chunk = min(_TOP_CHUNK, 1 << (v // (4 * n)).bit_length() - 1)  # n * chunk <= V / 4
    pad = -v % chunk
    chunks = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(b, -1, chunk)
    _, best = jax.lax.top_k(jnp.max(chunks, axis=-1), n)  # [B, n] chunk ids
    candidates = jnp.take_along_axis(chunks, best[:, :, None], axis=1)  # [B, n, chunk]
    values, at = jax.lax.top_k(candidates.reshape(b, n * chunk), n)  # at: in the candidates
    ids = jnp.take_along_axis(best, at // chunk, axis=1) * chunk + at % chunk
    return values, ids.astype(jnp.int32)


def _top_values(x: jax.Array, n: int) -> jax.Array:
    """The n largest values of each row of x [B, V], descending [B, n] (`_top_k`'s values;
    under jit the ids are dead code)."""
    return _top_k(x, n)[0]


def _allowed(token_bitmask: jax.Array, v: int) -> jax.Array:
    """[B, W] int32 bitmask (llguidance's layout) -> [B, V] bool; ids past 32 * W: False."""
    b, w = token_bitmask.shape
    bits = (token_bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    bits = bits.reshape(b, w * 32)[:, :v] != 0
    if w * 32 < v:
        bits = jnp.pad(bits, ((0, 0), (0, v - w * 32)))
    return bits


def _row_sum(x: jax.Array, ordered: bool) -> jax.Array:
    """Sum over the last axis of x [B, V] -> [B]. ordered: as a fixed tree of elementwise adds
    (halves added pairwise), so a row's sum has the same bits at any B; XLA's reductions tile
    rows by the batch's shape (a row's logprob moved by an ulp between B = 1 and 8)."""
    if not ordered:
        return jnp.sum(x, axis=-1)
    n = 1 << (x.shape[-1] - 1).bit_length()
    x = jnp.pad(x, ((0, 0), (0, n - x.shape[-1])))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[:, :half] + x[:, half:]
    return x[:, 0]


def _sortable_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (-inf smallest, +inf largest; no NaN here)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where((bits >> 31) == 1, ~bits, bits | jnp.uint32(0x80000000))


def _key_to_float(key: jax.Array) -> jax.Array:
    bits = jnp.where((key >> 31) == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


_RADIX_BITS = 2  # bits of the key settled per pass of _radix_select
_NEG_INF_KEY = 0x007FFFFF  # _sortable_key(-inf)


def _radix_select(x: jax.Array, shift: jax.Array, target: jax.Array,
                  ordered: bool = False) -> jax.Array:
    """Per row, the largest value t of x [B, V] with sum(exp(x - shift)[x >= t]) >= target.

    That is the nucleus boundary of softmax(x), found without sorting: the mass is
    non-increasing in t, so t's order-preserving uint32 key is settled digit by digit from the
    top. Each of the 32 / _RADIX_BITS passes reads x once (the masked exp sums fuse into one
    reduction) for the 2**bits - 1 candidate next digits. shift [B, 1] is the row
    maximum; the result is capped at it (for a target of 0).
    """
    x = jnp.where(x == 0, 0.0, x)  # -0.0 -> +0.0, so equal floats have equal keys

    def settle_digit(i, found):  # found [B]: the digits settled so far
        bit = (32 - _RADIX_BITS - _RADIX_BITS * i).astype(jnp.uint32)
        digit = jnp.zeros_like(found)
        for d in range(1, 1 << _RADIX_BITS):
            pivot = jnp.maximum(found | (jnp.uint32(d) << bit), _NEG_INF_KEY)  # [B]
            t = _key_to_float(pivot)[:, None]  # NaN above +inf: compares false, mass 0
            mass = _row_sum(jnp.where(x >= t, jnp.exp(x - shift), 0.0), ordered)  # [B]
            digit = digit + (mass >= target).astype(jnp.uint32)  # monotone in d: a count
        return found | (digit << bit)

    found = jax.lax.fori_loop(0, 32 // _RADIX_BITS, settle_digit,
                              jnp.zeros(x.shape[:1], jnp.uint32))
    found = jnp.clip(found, _NEG_INF_KEY, _sortable_key(jnp.max(x, axis=-1)))
    return _key_to_float(found)


def _truncation_cut(scaled: jax.Array, params: SamplingTensors,
                    ordered: bool = False) -> jax.Array | None:
    """Per-row threshold [B]: top-k/top-p/min-p keep exactly the tokens with scaled >= cut.
    ordered: every sum in a fixed order (_row_sum; a prefix sum by associative_scan)."""
    flags = params.flags
    neg_inf = jnp.float32(-jnp.inf)
    row_max = jnp.max(scaled, axis=-1)  # [B]
    cut = None

    if flags.top_k_cap:
        n = min(flags.top_k_cap, scaled.shape[1])
        top = _top_values(scaled, n)  # [B, n] descending
        k = jnp.clip(params.top_k, 0, n)  # [B]
        kth = jnp.take_along_axis(top, jnp.maximum(k, 1)[:, None] - 1, axis=1)[:, 0]
        cut = jnp.where(k > 0, kth, neg_inf)  # keeps every token tied with the k-th, as HF
    if flags.top_p:
        cut = jnp.full(row_max.shape, neg_inf) if cut is None else cut
        # Unnormalised probabilities exp(x - max) of the top-k-renormalised distribution.
        shift = jnp.where(jnp.isfinite(row_max), row_max, 0.0)[:, None]  # [B, 1]
        weight = jnp.where(scaled >= cut[:, None], jnp.exp(scaled - shift), 0.0)  # [B, V]
        target = params.top_p * _row_sum(weight, ordered)  # [B] mass the nucleus must reach
        boundary = jnp.full(row_max.shape, neg_inf)
        if flags.top_k_cap:
            # Top-k rows: the nucleus lies in the sorted top n; token i stays iff the mass
            # above it is below the target.
            valid = (top >= cut[:, None]) & (top > neg_inf)  # [B, n] the top-k set
            w = jnp.where(valid, jnp.exp(top - shift), 0.0)
            above = (jax.lax.associative_scan(jnp.add, w, axis=1) if ordered
                     else jnp.cumsum(w, axis=-1)) - w
            keep = valid & (above < target[:, None])
            last = jnp.maximum(jnp.sum(keep, axis=-1), 1) - 1  # [B]
            boundary = jnp.take_along_axis(top, last[:, None], axis=1)[:, 0]
        if flags.top_p_without_top_k:  # the nucleus of the whole distribution
            selected = _radix_select(scaled, shift, target, ordered)
            boundary = selected if not flags.top_k_cap else jnp.where(
                params.top_k > 0, boundary, selected)
        cut = jnp.maximum(cut, jnp.where(params.top_p < 1, boundary, neg_inf))
    if flags.min_p:
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
                         seen_mask: jax.Array | None = None,
                         token_bitmask: jax.Array | None = None,
                         batch_invariant: bool = False) -> SampleOutput:
    """Sample one token per row of logits [B, V]; also its logprob (see the module docstring).

    keys: [B] typed keys (`request_keys`, `step_keys`); params: per-row `SamplingTensors`, or
    SamplingParams for every row. token_counts [B, V] int32 (generated tokens) feeds presence and
    frequency penalties, seen_mask [B, V] bool (prompt + generated) the repetition penalty.
    token_bitmask [B, W] int32: the tokens each row may take (structured output); None: all.
    batch_invariant (static; KernelPolicy.batch_invariant): the sums over the vocabulary (the
    logprob's normalizer, top-p's masses) in a fixed order, so a row's token and logprob are
    the same bits at any batch size (a few more small kernels per step).
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
    b, v = logits.shape
    if not isinstance(params, SamplingTensors):
        params = SamplingTensors.from_params(params, b if isinstance(params, SamplingParams)
                                             else None)
    if params.batch_size != b:
        raise ValueError(f"SamplingTensors has {params.batch_size} rows, logits {b}")
    if token_bitmask is not None and (token_bitmask.ndim != 2 or token_bitmask.shape[0] != b):
        raise ValueError(f"token_bitmask must be [B, W] = [{b}, W], got {token_bitmask.shape}")
    flags = params.flags
    keys = _as_row_keys(keys, b)
    neg_inf = jnp.float32(-jnp.inf)

    x = logits.astype(jnp.float32)  # [B, V]
    x = jnp.where(jnp.isnan(x), neg_inf, x)  # a NaN must never win an argmax
    x = apply_penalties(x, params, token_counts=token_counts, seen_mask=seen_mask)
    allowed = None if token_bitmask is None else _allowed(token_bitmask, v)  # [B, V]

    def constrain(y):  # what the grammar allows (truncation and the draw act on it)
        return y if allowed is None else jnp.where(allowed, y, neg_inf)

    if flags.all_greedy:
        scaled = x
        tokens = jnp.argmax(constrain(x), axis=-1)
    else:
        scaled = x / params.temperature[:, None]  # [B, V]; greedy rows have temperature 1
        drawn = constrain(scaled)
        cut = _truncation_cut(drawn, params, batch_invariant)
        masked = drawn if cut is None else jnp.where(drawn >= cut[:, None], drawn, neg_inf)
        gumbel = jax.vmap(jax.random.gumbel, in_axes=(0, None, None))(keys, (v,), jnp.float32)
        tokens = jnp.argmax(masked + gumbel, axis=-1)  # [B]
        if flags.any_greedy:
            tokens = jnp.where(params.greedy, jnp.argmax(constrain(x), axis=-1), tokens)
    tokens = tokens.astype(jnp.int32)

    if batch_invariant:
        top = jnp.max(scaled, axis=-1)  # exact in any order
        shift = jnp.where(jnp.isfinite(top), top, 0.0)
        lse = shift + jnp.log(_row_sum(jnp.exp(scaled - shift[:, None]), True))  # [B]
    else:
        lse = jax.nn.logsumexp(scaled, axis=-1)  # [B]
    chosen = jnp.take_along_axis(scaled, tokens[:, None], axis=1)[:, 0]  # [B]
    logprobs = jnp.where(jnp.isfinite(lse) & jnp.isfinite(chosen), chosen - lse, neg_inf)
    top_ids = top_lps = None
    if flags.top_logprobs:
        values, top_ids = _top_k(scaled, min(flags.top_logprobs, v))  # [B, K]
        top_lps = jnp.where(jnp.isfinite(lse)[:, None], values - lse[:, None], neg_inf)
    return SampleOutput(tokens=tokens, logprobs=logprobs, top_ids=top_ids,
                        top_logprobs=top_lps)


def sample_positions(logits: jax.Array, keys: jax.Array, params: SamplingTensors, *,
                     tokens: jax.Array | None = None, active: jax.Array | None = None,
                     token_counts: jax.Array | None = None,
                     seen_mask: jax.Array | None = None,
                     token_bitmask: jax.Array | None = None, batch_invariant: bool = False,
                     laws: bool = False) -> tuple[SampleOutput, tuple | None]:
    """`sample_with_logprobs` at T positions of each row (a speculative verification's):
    logits [B, T, V], keys [B, T]; position j's penalties also count tokens [B, T - 1]'s
    first j (the drafts before it, as if accepted; rows not `active` [B] count none).
    -> (SampleOutput of [B, T] tokens and logprobs, [B, T, N] top; with laws the
    `processed_logits` pair, [B, T, V] each). The B * T rows are sampled in one call, not T:
    a row's draw depends on nothing but its logits, key and parameters, and one call is one
    set of kernels (and one program to compile) instead of T."""
    b, t, v = logits.shape
    flags = params.flags
    x = logits.astype(jnp.float32)
    x = jnp.where(jnp.isnan(x), -jnp.inf, x)  # as sample_with_logprobs, before the penalties
    if flags.penalties:  # each position's own statistics (and bias), then none in the batch
        xs, counts, seen = [], token_counts, seen_mask
        for j in range(t):
            xs.append(apply_penalties(x[:, j], params, token_counts=counts, seen_mask=seen))
            if j + 1 < t:
                counts, seen = update_penalty_state(counts, seen, tokens[:, j], active)
        x = jnp.stack(xs, axis=1)  # [B, T, V]
        flags = dataclasses.replace(flags, repetition_penalty=False,
                                    presence_frequency_penalty=False, logit_bias=0)
    # [B * T] rows, row b's T positions together
    rows = jax.tree.map(lambda a: jnp.repeat(a, t, axis=0), params).replace(flags=flags)
    x = x.reshape(b * t, v)
    bitmask = None if token_bitmask is None else jnp.repeat(token_bitmask, t, axis=0)
    out = sample_with_logprobs(x, keys.reshape(b * t), rows, token_bitmask=bitmask,
                               batch_invariant=batch_invariant)
    out = jax.tree.map(lambda a: a.reshape(b, t, *a.shape[1:]), out)
    law = None
    if laws:
        law = tuple(a.reshape(b, t, v) for a in processed_logits(
            x, rows, batch_invariant=batch_invariant))
    return out, law


def processed_logits(logits: jax.Array, params: SamplingTensors, *,
                     token_counts: jax.Array | None = None, seen_mask: jax.Array | None = None,
                     batch_invariant: bool = False) -> tuple[jax.Array, jax.Array]:
    """The distribution a sampled row's Gumbel-max draw follows, for logits [B, V]: ->
    (scaled [B, V]: penalized / temperature, what logprobs are taken under; masked [B, V]:
    scaled with -inf outside the top-k/top-p/min-p set; softmax(masked) is the draw's law).
    The same stages as `sample_with_logprobs` (speculative rejection sampling needs the law)."""
    x = logits.astype(jnp.float32)
    x = jnp.where(jnp.isnan(x), -jnp.inf, x)
    x = apply_penalties(x, params, token_counts=token_counts, seen_mask=seen_mask)
    scaled = x / params.temperature[:, None]
    cut = _truncation_cut(scaled, params, batch_invariant)
    masked = scaled if cut is None else jnp.where(scaled >= cut[:, None], scaled, -jnp.inf)
    return scaled, masked


def sample(logits: jax.Array, keys: jax.Array,
           params: SamplingTensors | SamplingParams | Sequence[SamplingParams], *,
           token_counts: jax.Array | None = None, seen_mask: jax.Array | None = None,
           token_bitmask: jax.Array | None = None, batch_invariant: bool = False) -> jax.Array:
    """Tokens [B] int32 for logits [B, V]: `sample_with_logprobs` without the logprobs.

    Under jit the logprob computation is dead code and XLA removes it.
    """
    return sample_with_logprobs(logits, keys, params, token_counts=token_counts,
                                seen_mask=seen_mask, token_bitmask=token_bitmask,
                                batch_invariant=batch_invariant).tokens
