"""Tests of jaxinfer/sampling.py.

Distributions are checked statistically: tens of thousands of rows with the same logits are
sampled in one call (each row its own request key), and the token histogram is compared with a
numpy reimplementation of the HF warpers (written independently of the module: HF's ascending
sort + `cumprobs <= 1 - top_p` nucleus rule) by a chi-square test at a ~3e-7 false-alarm level.
Every statistical test also checks that a plausible wrong implementation (off-by-one nucleus,
stages in the wrong order, ...) would fail the same bound, so the bound has teeth.
"""

import collections
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import sampling as S
from jaxinfer.sampling import SamplingParams, SamplingTensors

N_DRAWS = 40_000
SMALL = 4096

# ---------------------------------------------------------------------------------------------
# numpy references
# ---------------------------------------------------------------------------------------------


def np_softmax(x):
    x = np.asarray(x, np.float64)
    m = np.max(x)
    e = np.exp(x - m)
    return e / e.sum()


def ref_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, *,
              top_p_rule="hf", top_p_renormalize=True):
    """HF's warper chain (temperature, top-k, top-p, min-p) in float64 numpy -> probs [V].

    top_p_rule / top_p_renormalize select deliberately wrong variants, to show the bound bites.
    """
    x = np.asarray(logits, np.float64) / temperature
    v = x.shape[0]
    if top_k:
        kth = np.sort(x)[::-1][min(top_k, v) - 1]
        x = np.where(x < kth, -np.inf, x)
    if top_p < 1:
        base = x if top_p_renormalize else np.asarray(logits, np.float64) / temperature
        order = np.argsort(base, kind="stable")  # ascending, as HF's TopPLogitsWarper
        cum = np.cumsum(np_softmax(base[order]))
        if top_p_rule == "hf":
            remove = cum <= 1 - top_p
        elif top_p_rule == "drop_boundary":  # keeps only tokens whose own inclusion stays < top_p
            remove = cum < 1 - top_p + np_softmax(base[order])
        elif top_p_rule == "extra_token":  # keeps one token more than the nucleus
            remove = np.roll(cum <= 1 - top_p, -1)
            remove[-1] = False
        remove[-1] = False
        finite = np.isfinite(base[order])
        # The test logits must not sit on the boundary, or float rounding could flip a token.
        assert np.min(np.abs(cum[finite] - (1 - top_p))) > 1e-4, "boundary too close to top_p"
        x = x.copy()
        x[order[remove]] = -np.inf
    if min_p > 0:
        p = np_softmax(x)
        x = np.where(p < min_p * p.max(), -np.inf, x)
    return np_softmax(x)


def chi2_bound(df: int, z: float = 5.0) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df) at a normal z (z=5: ~3e-7 tail)."""
    if df <= 0:
        return 1e-9
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi2(tokens, probs):
    """(statistic, bound): inf when a token with zero expected probability was drawn."""
    tokens = np.asarray(tokens)
    n = tokens.size
    obs = np.bincount(tokens, minlength=probs.size)
    support = probs > 0
    if obs[~support].any():
        return math.inf, chi2_bound(int(support.sum()) - 1)
    expected = n * probs[support]
    stat = float(((obs[support] - expected) ** 2 / expected).sum())
    return stat, chi2_bound(int(support.sum()) - 1)


def assert_matches(tokens, probs, *, wrong=()):
    stat, bound = chi2(tokens, probs)
    tv = 0.5 * np.abs(np.bincount(tokens, minlength=probs.size) / len(tokens) - probs).sum()
    assert stat < bound, f"chi2 {stat:.1f} >= {bound:.1f} (TV {tv:.4f})"
    assert tv < 0.015, f"total variation {tv:.4f}"
    for name, wrong_probs in wrong:
        assert not np.allclose(wrong_probs, probs), f"wrong variant {name} is not different"
        wstat, wbound = chi2(tokens, wrong_probs)
        assert wstat > wbound, f"the bound would accept the wrong variant {name}"


def np_penalize(logits, seen, counts, rep, presence, frequency):
    """HF RepetitionPenaltyLogitsProcessor, then vLLM frequency/presence penalties, per row."""
    x = np.array(logits, np.float64)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            if seen[b, t]:
                x[b, t] = x[b, t] * rep[b] if x[b, t] < 0 else x[b, t] / rep[b]
            x[b, t] -= frequency[b] * counts[b, t] + presence[b] * (counts[b, t] > 0)
    return x


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

_sample = jax.jit(S.sample)
_sample_lp = jax.jit(S.sample_with_logprobs)


def draw(logits_row, params: SamplingParams, n=N_DRAWS, seed=0):
    """n tokens for the same logits, one request per row (request ids 0..n-1, position 7)."""
    logits = jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (n, len(logits_row)))
    keys = S.request_keys(seed, jnp.arange(n), jnp.full((n,), 7))
    return np.asarray(_sample(logits, keys, SamplingTensors.from_params(params, n)))


def logits_of(seed, v=16, scale=1.5):
    return np.random.default_rng(seed).normal(size=v) * scale


# ---------------------------------------------------------------------------------------------
# SamplingParams validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_k", -1), ("top_k", 2.5), ("top_k", True),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", float("nan")),
    ("min_p", 1.0), ("min_p", -0.1),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("frequency_penalty", float("nan")),
    ("logprobs", 1), ("seed", -3), ("seed", 1.5), ("top_logprobs", 21), ("top_logprobs", -1),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {3: 100.5}), ("logit_bias", {3: float("nan")}),
    ("logit_bias", {"3": 1.0}), ("logit_bias", [1, 2]),
    ("logit_bias", {i: 1.0 for i in range(S.MAX_LOGIT_BIAS + 1)}),
])
def test_invalid_params_raise_naming_the_parameter(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_valid_params_and_from_params_checks():
    SamplingParams(temperature=0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=-2,
                   frequency_penalty=2, repetition_penalty=1.2, logprobs=True, seed=5)
    with pytest.raises(ValueError, match="batch_size"):
        SamplingTensors.from_params(SamplingParams())
    with pytest.raises(ValueError, match="batch_size"):
        SamplingTensors.from_params([SamplingParams()] * 3, batch_size=2)
    with pytest.raises(ValueError, match="seen_mask"):
        S.sample(jnp.zeros((2, 5)), jax.random.key(0), SamplingParams(repetition_penalty=1.1))
    with pytest.raises(ValueError, match="token_counts"):
        S.sample(jnp.zeros((2, 5)), jax.random.key(0), SamplingParams(presence_penalty=0.5))
    # A SamplingParams is a static (leafless) pytree, so jit takes it as an argument directly.
    tokens = _sample(jnp.asarray([[0.0, 5.0, 1.0]]), jax.random.key(0), SamplingParams(top_k=1))
    assert tokens.tolist() == [1]
    with pytest.raises(ValueError, match="seed"):
        S.SamplerState.init(-1, [SamplingParams()], [[1]], 10)
    with pytest.raises(ValueError, match="keys"):
        S.sample(jnp.zeros((2, 5)), S.request_keys(0, jnp.arange(3), jnp.zeros(3, jnp.int32)),
                 SamplingParams())


# ---------------------------------------------------------------------------------------------
# Distributions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_temperature_distribution(temperature):
    logits = logits_of(1)
    tokens = draw(logits, SamplingParams(temperature=temperature))
    wrong_t = ref_probs(logits, temperature * 1.15)
    assert_matches(tokens, ref_probs(logits, temperature), wrong=[("temperature*1.15", wrong_t)])


@pytest.mark.parametrize("top_k", [1, 3, 6])
def test_top_k_distribution(top_k):
    logits = logits_of(2)
    tokens = draw(logits, SamplingParams(temperature=0.9, top_k=top_k))
    want = ref_probs(logits, 0.9, top_k=top_k)
    assert set(np.unique(tokens)) <= set(np.flatnonzero(want))  # nothing outside the top k
    assert_matches(tokens, want, wrong=[("k+1", ref_probs(logits, 0.9, top_k=top_k + 1))])


def test_top_k_ties_kept_and_larger_than_vocab():
    logits = np.array([0.0, 2.0, 1.0, 2.0, 1.0, -1.0])  # 3rd largest value 1.0 appears twice
    tokens = draw(logits, SamplingParams(top_k=3))
    assert_matches(tokens, ref_probs(logits, top_k=3))  # HF keeps all tokens tied with the k-th
    assert set(np.unique(tokens)) == {1, 2, 3, 4}
    tokens = draw(logits, SamplingParams(top_k=100))  # clamped to V: no truncation
    assert_matches(tokens, ref_probs(logits))


@pytest.mark.parametrize("top_p,seed", [(0.5, 3), (0.8, 4), (0.93, 5), (0.05, 6)])
def test_top_p_distribution_hf_boundary(top_p, seed):
    logits = logits_of(seed)
    tokens = draw(logits, SamplingParams(top_p=top_p))
    want = ref_probs(logits, top_p=top_p)
    assert set(np.unique(tokens)) <= set(np.flatnonzero(want))
    wrong = [("extra token", ref_probs(logits, top_p=top_p, top_p_rule="extra_token"))]
    if np.count_nonzero(want) > 1:
        wrong.append(("boundary dropped",
                      ref_probs(logits, top_p=top_p, top_p_rule="drop_boundary")))
    assert_matches(tokens, want, wrong=wrong)


def test_top_p_tiny_keeps_the_top_token():
    logits = logits_of(7)
    tokens = draw(logits, SamplingParams(top_p=1e-6), n=SMALL)
    assert (tokens == np.argmax(logits)).all()


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p_distribution(min_p):
    logits = logits_of(8)
    tokens = draw(logits, SamplingParams(temperature=1.2, min_p=min_p))
    want = ref_probs(logits, 1.2, min_p=min_p)
    wrong_t = ref_probs(logits, 1.0, min_p=min_p)  # min-p taken before temperature
    assert_matches(tokens, want, wrong=[("min-p before temperature", wrong_t)])


def test_combined_top_k_top_p_min_p():
    logits = logits_of(19, v=32, scale=1.0)
    # Each stage cuts here: top-k 9 -> nucleus 5 -> min-p 4 tokens.
    k_p = ref_probs(logits, 0.8, top_k=9, top_p=0.7)
    want = ref_probs(logits, 0.8, top_k=9, top_p=0.7, min_p=0.2)
    assert np.count_nonzero(want) < np.count_nonzero(k_p) < 9
    tokens = draw(logits, SamplingParams(temperature=0.8, top_k=9, top_p=0.7, min_p=0.2))
    assert_matches(tokens, want, wrong=[("no min-p", k_p)])
    tokens = draw(logits, SamplingParams(temperature=0.8, top_k=9, top_p=0.7))
    assert_matches(tokens, k_p, wrong=[
        # the nucleus taken over the full distribution instead of the top-k-renormalised one
        ("top-p not renormalised after top-k",
         ref_probs(logits, 0.8, top_k=9, top_p=0.7, top_p_renormalize=False)),
        ("top-p extra token",
         ref_probs(logits, 0.8, top_k=9, top_p=0.7, top_p_rule="extra_token"))])


# ---------------------------------------------------------------------------------------------
# Mixed batches, jit, determinism, batch independence
# ---------------------------------------------------------------------------------------------

MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=4),
    SamplingParams(top_p=0.75),  # top-p without top-k: the full-sort path
    SamplingParams(temperature=1.3, min_p=0.1),
    SamplingParams(temperature=0.9, top_k=7, top_p=0.8, min_p=0.02),
]


def test_mixed_batch_under_jit_matches_each_distribution():
    v, per_group = 16, 14_000
    group_logits = np.stack([logits_of(20 + g, v) for g in range(len(MIXED))])
    rows = np.random.default_rng(0).permutation(np.repeat(np.arange(len(MIXED)), per_group))
    params = [MIXED[g] for g in rows]
    keys = S.request_keys(3, jnp.arange(rows.size), jnp.zeros(rows.size, jnp.int32))
    tensors = SamplingTensors.from_params(params)
    tokens = np.asarray(_sample(jnp.asarray(group_logits[rows], jnp.float32), keys, tensors))
    for g, p in enumerate(MIXED):
        got = tokens[rows == g]
        if p.temperature == 0:
            assert (got == np.argmax(group_logits[g])).all()
            continue
        want = ref_probs(group_logits[g], p.temperature, p.top_k, p.top_p, p.min_p)
        assert_matches(got, want)


def test_changing_per_row_values_does_not_recompile():
    traces = []

    @jax.jit
    def step(logits, keys, tensors):
        traces.append(1)
        return S.sample(logits, keys, tensors)

    logits = jnp.asarray(np.stack([logits_of(i, 32) for i in range(4)]), jnp.float32)
    keys = S.request_keys(0, jnp.arange(4), jnp.zeros(4, jnp.int32))
    a = [SamplingParams(temperature=0), SamplingParams(top_k=5, top_p=0.9),
         SamplingParams(temperature=0.5, min_p=0.1), SamplingParams(top_p=0.5)]
    b = [SamplingParams(top_k=6, top_p=0.3), SamplingParams(temperature=0.2, min_p=0.3),
         SamplingParams(top_p=0.95), SamplingParams(temperature=0)]
    step(logits, keys, SamplingTensors.from_params(a))
    step(logits, keys, SamplingTensors.from_params(b))  # same stages
    assert len(traces) == 1
    step(logits, keys, SamplingTensors.from_params([SamplingParams()] * 4))  # fewer stages
    assert len(traces) == 2


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = logits_of(30, v=32, scale=0.5)
    p = SamplingParams(top_k=20, top_p=0.95)
    a, b, c = draw(logits, p, n=SMALL, seed=11), draw(logits, p, n=SMALL, seed=11), draw(
        logits, p, n=SMALL, seed=12)
    np.testing.assert_array_equal(a, b)
    assert (a != c).mean() > 0.5


def test_a_request_draws_the_same_tokens_alone_and_in_any_batch():
    v, positions = 32, 24
    req_params = {0: SamplingParams(top_k=5), 1: SamplingParams(top_p=0.8),
                  2: SamplingParams(temperature=0.6, min_p=0.05),
                  3: SamplingParams(temperature=1.0), 4: SamplingParams(top_k=3, top_p=0.9),
                  5: SamplingParams(temperature=0)}
    req_logits = {r: logits_of(40 + r, v, scale=0.8) for r in req_params}

    def run(reqs):
        """One batch: every (request, position) pair of `reqs` as a row; -> {(r, pos): token}."""
        pairs = [(r, t) for r in reqs for t in range(positions)]
        logits = jnp.asarray(np.stack([req_logits[r] for r, _ in pairs]), jnp.float32)
        keys = S.request_keys(5, jnp.array([r for r, _ in pairs]),
                              jnp.array([t for _, t in pairs]))
        tensors = SamplingTensors.from_params([req_params[r] for r, _ in pairs])
        out = np.asarray(_sample(logits, keys, tensors))
        return dict(zip(pairs, out.tolist()))

    everything = run([0, 1, 2, 3, 4, 5])  # every stage compiled in
    for subset in ([0], [4, 0], [3, 1, 2], [5, 2]):  # top-k only, no truncation, greedy mixes
        alone = run(subset)
        assert all(alone[pair] == everything[pair] for pair in alone), subset
    assert len(set(everything[(3, t)] for t in range(positions))) > 3  # draws do vary


# ---------------------------------------------------------------------------------------------
# Greedy, penalties, logprobs, degenerate rows
# ---------------------------------------------------------------------------------------------


def test_greedy_is_argmax_first_on_ties():
    rng = np.random.default_rng(50)
    logits = rng.normal(size=(64, 100)).astype(np.float32)
    logits[0] = 1.0  # all tied -> id 0
    logits[1, [3, 7]] = 50.0  # tied maxima -> the first
    keys = S.request_keys(0, jnp.arange(64), jnp.zeros(64, jnp.int32))
    for p in (SamplingParams(temperature=0.0), SamplingParams(temperature=1e-7, top_k=5)):
        tokens = np.asarray(_sample(jnp.asarray(logits), keys, SamplingTensors.from_params(p, 64)))
        np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
    assert tokens[1] == 3


def _penalty_case(b=8, v=40, seed=60):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(b, v)).astype(np.float32) * 3
    counts = rng.integers(0, 4, size=(b, v)) * (rng.random((b, v)) < 0.3)
    seen = (counts > 0) | (rng.random((b, v)) < 0.2)  # prompt tokens are seen but not counted
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.0 + 0.2 * i,
                             presence_penalty=0.5 - 0.25 * i, frequency_penalty=0.3 * (i % 3))
              for i in range(b)]
    return logits, counts.astype(np.int32), seen, params


def test_penalties_match_numpy_hf_vllm():
    logits, counts, seen, params = _penalty_case()
    want = np_penalize(logits, seen, counts, [p.repetition_penalty for p in params],
                       [p.presence_penalty for p in params], [p.frequency_penalty for p in params])
    tensors = SamplingTensors.from_params(params)
    got = S.apply_penalties(jnp.asarray(logits), tensors, token_counts=jnp.asarray(counts),
                            seen_mask=jnp.asarray(seen))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-5)
    assert not np.allclose(want, logits)
    keys = S.request_keys(0, jnp.arange(len(params)), jnp.zeros(len(params), jnp.int32))
    out = _sample_lp(jnp.asarray(logits), keys, tensors, token_counts=jnp.asarray(counts),
                     seen_mask=jnp.asarray(seen))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.argmax(want, axis=-1))
    assert (np.argmax(want, axis=-1) != np.argmax(logits, axis=-1)).any()  # penalties mattered


def test_logit_bias_is_added_before_the_penalties():
    """OpenAI's logit_bias (as vLLM applies it: before the penalties), rows with none, one
    and two entries in one batch; the greedy pick and the logprobs follow the biased logits;
    widen pads a row set to wider flags without changing anything; ids past the vocabulary
    are refused by check_vocabulary."""
    logits, counts, seen, _ = _penalty_case(b=3, v=12, seed=63)
    bias = [{}, {4: -100.0}, {2: 30.0, 7: -3.5}]
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=True,
                             logit_bias=b) for b in bias]
    assert params[2].logit_bias == ((2, 30.0), (7, -3.5))
    biased = logits.copy()
    for row, b in enumerate(bias):
        for k, v in b.items():
            biased[row, k] += v
    want = np_penalize(biased, seen, counts, [1.3] * 3, [0.0] * 3, [0.0] * 3)
    tensors = SamplingTensors.from_params(params)
    assert tensors.flags.logit_bias == 2 and tensors.bias_ids.shape == (3, 2)
    wide = tensors.widen(dataclasses.replace(tensors.flags, logit_bias=8))
    keys = S.request_keys(0, jnp.arange(3), jnp.zeros(3, jnp.int32))
    for t in (tensors, wide):
        got = S.apply_penalties(jnp.asarray(logits), t, seen_mask=jnp.asarray(seen))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-5)
        out = _sample_lp(jnp.asarray(logits), keys, t, seen_mask=jnp.asarray(seen))
        tokens = np.asarray(out.tokens)
        np.testing.assert_array_equal(tokens, np.argmax(want, axis=-1))
        lse = np.log(np.exp(want - want.max(-1, keepdims=True)).sum(-1)) + want.max(-1)
        np.testing.assert_allclose(np.asarray(out.logprobs), want[np.arange(3), tokens] - lse,
                                   rtol=1e-5, atol=1e-5)
    assert tokens[2] == 2 and np.argmax(logits[2]) != 2  # the bias mattered
    with pytest.raises(ValueError, match="token id 7 is outside the vocabulary"):
        params[2].check_vocabulary(7)


def test_sampled_distribution_after_penalties():
    logits, counts, seen, _ = _penalty_case(b=1, v=16, seed=61)
    p = SamplingParams(temperature=0.8, top_k=10, repetition_penalty=1.5, presence_penalty=0.4,
                       frequency_penalty=0.2)
    n = N_DRAWS
    keys = S.request_keys(1, jnp.arange(n), jnp.zeros(n, jnp.int32))
    tokens = np.asarray(_sample(
        jnp.broadcast_to(jnp.asarray(logits), (n, 16)), keys, SamplingTensors.from_params(p, n),
        token_counts=jnp.broadcast_to(jnp.asarray(counts), (n, 16)),
        seen_mask=jnp.broadcast_to(jnp.asarray(seen), (n, 16))))
    pen = np_penalize(logits, seen, counts, [1.5], [0.4], [0.2])[0]
    assert_matches(tokens, ref_probs(pen, 0.8, top_k=10),
                   wrong=[("no penalties", ref_probs(logits[0], 0.8, top_k=10))])


def test_logprobs_are_processed_untruncated_log_softmax():
    logits, counts, seen, _ = _penalty_case(b=6, v=40, seed=62)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=True),
              SamplingParams(temperature=0.5, top_k=3, logprobs=True),
              SamplingParams(temperature=1.5, top_p=0.5, presence_penalty=1.0),
              SamplingParams(min_p=0.2, frequency_penalty=0.5),
              SamplingParams(temperature=2.0),
              SamplingParams(temperature=0.0)]
    tensors = SamplingTensors.from_params(params)
    assert tensors.flags.logprobs
    keys = S.request_keys(0, jnp.arange(6), jnp.arange(6))
    out = _sample_lp(jnp.asarray(logits), keys, tensors, token_counts=jnp.asarray(counts),
                     seen_mask=jnp.asarray(seen))
    pen = np_penalize(logits, seen, counts, [p.repetition_penalty for p in params],
                      [p.presence_penalty for p in params], [p.frequency_penalty for p in params])
    tokens = np.asarray(out.tokens)
    for b, p in enumerate(params):
        scaled = pen[b] / (p.temperature or 1.0)
        want = scaled[tokens[b]] - np.log(np.exp(scaled - scaled.max()).sum()) - scaled.max()
        np.testing.assert_allclose(float(out.logprobs[b]), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
        np.asarray(_sample(jnp.asarray(logits), keys, tensors, token_counts=jnp.asarray(counts),
                           seen_mask=jnp.asarray(seen))), tokens)


def test_masked_nan_and_tied_rows_stay_in_range():
    v = 12
    logits = np.zeros((5, v), np.float32)
    logits[0] = -np.inf  # nothing allowed
    logits[1] = np.nan
    logits[2, :] = -np.inf
    logits[2, 5] = 3.0  # a single allowed token
    logits[3, 4] = np.nan  # one NaN among ties
    keys = S.request_keys(0, jnp.arange(5), jnp.zeros(5, jnp.int32))
    for p in (SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_p=0.5),
              SamplingParams(top_k=3, min_p=0.5), SamplingParams(top_k=2, top_p=0.3, min_p=0.1)):
        out = _sample_lp(jnp.asarray(logits), keys, SamplingTensors.from_params(p, 5))
        tokens, lps = np.asarray(out.tokens), np.asarray(out.logprobs)
        assert ((tokens >= 0) & (tokens < v)).all(), (p, tokens)
        assert not np.isnan(lps).any(), (p, lps)
        assert tokens[2] == 5 and tokens[3] != 4
        assert lps[0] == -np.inf and lps[2] == 0.0
    # Uniform ties sample uniformly.
    tokens = draw(np.zeros(8), SamplingParams(top_p=0.99))
    assert_matches(tokens, np.full(8, 1 / 8))


# ---------------------------------------------------------------------------------------------
# Stage skipping, keys, penalty state
# ---------------------------------------------------------------------------------------------


def _count_primitives(jaxpr, counts):
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        for value in eqn.params.values():  # bodies of jit, vmap-ed random, loops, ...
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _count_primitives(inner, counts)
    return counts


def _primitives(params, b=4, v=64):
    jaxpr = jax.make_jaxpr(S.sample)(jnp.zeros((b, v)), jax.random.key(0),
                                     SamplingTensors.from_params(params, b),
                                     seen_mask=jnp.zeros((b, v), bool))
    counts = _count_primitives(jaxpr.jaxpr, collections.Counter())
    counts["loop"] = counts["while"] + counts["scan"]
    return counts


def test_stages_are_skipped_by_the_static_flags():
    plain = _primitives(SamplingParams(temperature=0.8))
    assert plain["random_bits"] == 1 and plain["top_k"] == plain["loop"] == 0
    min_p = _primitives(SamplingParams(min_p=0.1))
    assert min_p["top_k"] == min_p["loop"] == min_p["sort"] == 0
    for p in (SamplingParams(top_k=5), SamplingParams(top_k=50, top_p=0.9, min_p=0.1)):
        # top-k: two-stage top_k (chunk maxima, then candidates); the nucleus inside them
        counts = _primitives(p, v=100_000)
        assert counts["top_k"] == 2 and counts["loop"] == 0
    top_p = _primitives(SamplingParams(top_p=0.9))
    assert top_p["loop"] == 1 and top_p["top_k"] == 0  # the radix select
    greedy = _primitives(SamplingParams(temperature=0))
    assert greedy["random_bits"] == 0 and greedy["div"] == 0
    assert _primitives(SamplingParams(temperature=0, repetition_penalty=1.1))["div"] > 0
    for counts in (plain, top_p, greedy):
        assert counts["sort"] == 0


@pytest.mark.parametrize("v,n", [(5000, 16), (5003, 8), (70_000, 50), (300, 8)])
def test_top_values_two_stage_is_exact(v, n):
    rng = np.random.default_rng(v)
    x = rng.normal(size=(6, v)).astype(np.float32)
    x[1] = np.round(x[1] * 2)  # many ties
    x[2, rng.choice(v, n + 3, replace=False)] = 9.0  # a tie spanning the n-th value
    x[3, : v // 2] = -np.inf
    x[4, rng.choice(v, n, replace=False)] = np.linspace(5, 6, n)  # the top n in few chunks
    got, ids = jax.jit(S._top_k, static_argnums=1)(jnp.asarray(x), n)
    np.testing.assert_array_equal(np.asarray(got), -np.sort(-x, axis=-1)[:, :n])
    ids = np.asarray(ids)
    assert all(len(set(row)) == n for row in ids)  # distinct ids, each holding its value
    np.testing.assert_array_equal(np.take_along_axis(x, ids, axis=1), np.asarray(got))


def test_token_bitmask_constrains_rows_and_drops_padded_ids():
    """A grammar's bitmask (llguidance's layout): a masked row draws only allowed ids, in the
    law of the allowed renormalised (with top-k applied after the mask); ids past the mask's
    32 * W bits (padded vocabulary) are never drawn though their logits are the largest;
    unmasked rows (-1 words) get exactly their tokens and logprobs without a mask; logprobs
    and top logprobs are those of the unmasked distribution."""
    v, n = 40, N_DRAWS
    logits = logits_of(11, v)
    logits[32:] = 9.0  # ids 32..39: the padded vocabulary, past a 1-word mask
    allowed = [3, 7, 8, 20, 31]
    word = np.int32(np.sum([np.int64(1) << i for i in allowed]) - (1 << 32))  # bit 31 set
    mask = np.full((n, 1), word, np.int32)
    mask[1::2] = -1  # unconstrained rows (but only 32 ids are covered)
    keys = S.request_keys(3, jnp.arange(n), jnp.full((n,), 7))
    sp = SamplingParams(temperature=0.8, top_k=3, logprobs=True, top_logprobs=2)
    x = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, v))
    out = _sample_lp(x, keys, SamplingTensors.from_params(sp, n), token_bitmask=mask)
    tokens = np.asarray(out.tokens)
    want = np.zeros(v)
    want[allowed] = ref_probs(logits[allowed], 0.8, top_k=3)
    wrong = np.zeros(v)  # top-k before the mask: only the allowed among the top 3 overall
    top3 = np.argsort(-logits[:32])[:3]
    keep = [i for i in allowed if i in top3] or allowed
    wrong[keep] = ref_probs(logits[keep], 0.8)
    assert_matches(tokens[0::2], want, wrong=[("top-k before the mask", wrong)])
    assert tokens[1::2].max() < 32
    free = np.asarray(_sample_lp(x[:, :32], keys, SamplingTensors.from_params(sp, n)).tokens)
    np.testing.assert_array_equal(tokens[1::2], free[1::2])
    lsm = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32) / 0.8))
    np.testing.assert_allclose(np.asarray(out.logprobs)[:4], lsm[tokens[:4]], rtol=1e-5)
    top_ids, top_lps = np.asarray(out.top_ids)[0], np.asarray(out.top_logprobs)[0]
    assert top_ids.shape == (S.MAX_TOP_LOGPROBS,)  # one k for all; the host keeps each row's
    np.testing.assert_allclose(top_lps, np.sort(lsm)[::-1][:S.MAX_TOP_LOGPROBS], rtol=1e-5)
    np.testing.assert_allclose(lsm[top_ids], top_lps, rtol=1e-5)
    greedy = _sample_lp(x[:2], keys[:2], SamplingTensors.from_params(
        SamplingParams(temperature=0), 2), token_bitmask=mask[:2])
    assert np.asarray(greedy.tokens).tolist() == [allowed[np.argmax(logits[allowed])],
                                                  int(np.argmax(logits[:32]))]


def test_request_keys_and_sampler_state():
    ids, pos = jnp.array([0, 5, 9]), jnp.array([3, 3, 100])
    keys = S.request_keys(42, ids, pos)
    manual = jax.random.fold_in(jax.random.fold_in(jax.random.key(42), 5), 3)
    np.testing.assert_array_equal(jax.random.key_data(keys[1]), jax.random.key_data(manual))
    params = [SamplingParams(), SamplingParams(seed=7), SamplingParams(seed=7, top_k=3)]
    state = S.SamplerState.init(42, params, [[1], [2], [3]], 10, request_ids=[0, 5, 9])
    assert state.token_counts is None and state.seen_mask is None  # no penalties, no arrays
    step = S.step_keys(state, pos)
    np.testing.assert_array_equal(jax.random.key_data(step[0]), jax.random.key_data(keys[0]))
    own = S.request_keys(7, jnp.array([0]), jnp.array([3]))[0]
    np.testing.assert_array_equal(jax.random.key_data(step[1]), jax.random.key_data(own))


def test_penalty_state_init_and_observe():
    params = [SamplingParams(repetition_penalty=1.2), SamplingParams(frequency_penalty=0.5),
              SamplingParams()]
    state = S.SamplerState.init(0, params, [[1, 1, 4], [2], [0, 9]], 10)
    seen = np.zeros((3, 10), bool)
    seen[0, [1, 4]] = seen[1, 2] = seen[2, [0, 9]] = True
    np.testing.assert_array_equal(np.asarray(state.seen_mask), seen)
    np.testing.assert_array_equal(np.asarray(state.token_counts), 0)  # prompts are not counted
    observe = jax.jit(S.observe)
    state = observe(state, jnp.array([3, 3, 3]), jnp.array([True, True, False]))
    state = observe(state, jnp.array([3, 7, -1]), None)
    counts = np.zeros((3, 10), np.int32)
    counts[0, 3] = 2
    counts[1, [3, 7]] = 1
    seen[0, 3] = seen[1, [3, 7]] = True
    np.testing.assert_array_equal(np.asarray(state.token_counts), counts)
    np.testing.assert_array_equal(np.asarray(state.seen_mask), seen)
    with pytest.raises(ValueError, match="outside"):
        S.SamplerState.init(0, params, [[10], [0], [0]], 10)


def test_radix_select_is_the_exact_nucleus_boundary():
    rng = np.random.default_rng(70)
    x = (rng.normal(size=(7, 3000)) * 2).astype(np.float32)
    x[1] = np.round(x[1])  # heavy ties
    x[2, 100:] = -np.inf
    x[3] = -np.inf  # nothing finite: target 0
    x[4, :] = 0.0
    x[4, :5] = -0.0  # signed zeros tie
    x[5] *= 40  # a peaked row: the nucleus is one token
    top_p = np.array([0.9, 0.5, 0.99, 0.7, 0.3, 0.9, 1e-6], np.float32)
    shift = np.where(np.isfinite(x.max(-1)), x.max(-1), 0)[:, None]
    w = np.exp(x.astype(np.float64) - shift)
    target = top_p * w.sum(-1)
    got = np.asarray(jax.jit(S._radix_select)(jnp.asarray(x), jnp.asarray(shift, jnp.float32),
                                              jnp.asarray(target, jnp.float32)))
    for b in range(x.shape[0]):
        order = np.argsort(-x[b], kind="stable")
        above = np.cumsum(w[b, order]) - w[b, order]  # mass strictly before each sorted token
        keep = np.flatnonzero(above < target[b])
        want = x[b, order[keep[-1]]] if keep.size else x[b].max()
        assert got[b] == want, (b, got[b], want)


def test_batch_invariant_rows_are_the_same_bits_at_any_batch():
    """batch_invariant=True: a row's token and logprob alone equal its bits in a batch of 8
    (XLA's own reductions over V moved some logprobs by an ulp between B = 1 and 8)."""
    v = 2048
    x = jax.random.normal(jax.random.key(0), (8, v)) * 8
    params = [SamplingParams(temperature=0.0, logprobs=True) if i % 2 else
              SamplingParams(temperature=0.8, top_p=0.9, seed=i, logprobs=True)
              for i in range(8)]
    params[4] = SamplingParams(temperature=0.7, top_k=40, top_p=0.8, seed=4, logprobs=True)
    keys = jax.vmap(jax.random.key)(jnp.arange(8))
    run = jax.jit(functools.partial(S.sample_with_logprobs, batch_invariant=True))
    tensors = SamplingTensors.from_params(params)
    full = run(x, keys, tensors)
    plain = _sample_lp(x, keys, tensors)
    np.testing.assert_array_equal(full.tokens, plain.tokens)
    np.testing.assert_allclose(full.logprobs, plain.logprobs, atol=1e-5)
    for i in range(8):
        one = run(x[i:i + 1], keys[i:i + 1],
                  SamplingTensors.from_params([params[i]]).replace(flags=tensors.flags))
        assert int(one.tokens[0]) == int(full.tokens[i])
        assert float(one.logprobs[0]) == float(full.logprobs[i]), i
