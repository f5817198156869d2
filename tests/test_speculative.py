"""Speculative decoding (jaxinfer/speculative.py): the verification forward on the chunk
kernels, greedy / coupled / rejection-sampled acceptance against plain `generate`, the
drafters, and bad input."""

from __future__ import annotations

import dataclasses
import itertools
import re

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.cache import KVCache
from jaxinfer.configs import Config
from jaxinfer.models import llama
from jaxinfer.plan import KernelPolicy, Plan
# init_params: jaxinfer.weights.init_params's bits, fewer compiles
from kernel_testing import init_params, pallas_kernels_in, rel_err
from sampling_cases import MIXED


def tiny_bf16_config() -> Config:
    return Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=64,
                  tie_word_embeddings=False, dtype="bfloat16")


@pytest.mark.parametrize("verify_queries, kernel", [(16, "verify_attention"),
                                                     (2, "chunk_attention")])
def test_verification_forward_runs_a_kernel_and_matches_decode_steps(verify_queries, kernel):
    """T = 3 queries per row (the last token and 2 drafts) at per-row positions against a
    contiguous cache take the split-K verify kernel (up to KernelPolicy.verify_queries
    queries; the chunk kernel past it), in interpret mode, and give the logits the reference
    path gives one token at a time."""
    config = tiny_bf16_config()
    params = init_params(llama.param_specs(config), jax.random.key(0), jnp.bfloat16)
    ids = np.random.default_rng(1).integers(0, config.vocab_size, (2, 12), dtype=np.int32)
    lengths = np.array([5, 8], np.int32)  # rows hold prompts of different lengths
    # jitted: one program per shape (eagerly each op compiled alone); the same computations.
    # The inputs built in numpy for the same reason.
    forward = jax.jit(llama.forward, static_argnames=("plan", "fresh"))

    def prompt_cache(plan):
        pos = np.broadcast_to(np.arange(12, dtype=np.int32), (2, 12))
        _, cache = forward(params, ids, pos, plan, KVCache.init(config, 2, 16), fresh=True)
        return cache  # slots past a row's length hold stale tokens, as after rejected drafts

    verify_pos = lengths[:, None] + np.arange(3, dtype=np.int32)  # [B, 3]
    verify_ids = np.take_along_axis(ids, verify_pos, axis=1)
    kernel_plan = Plan(config, KernelPolicy(interpret=True, verify_queries=verify_queries))
    ref_plan = Plan(config, KernelPolicy.reference())
    names = pallas_kernels_in(lambda c: llama.forward(params, verify_ids, verify_pos,
                                                      kernel_plan, c),
                              prompt_cache(ref_plan))
    assert names[kernel] == config.num_layers, names
    got, _ = forward(params, verify_ids, verify_pos, kernel_plan, prompt_cache(ref_plan))
    got = np.asarray(got).astype(np.float32)  # exact; compared on the host
    cache = prompt_cache(ref_plan)
    for t in range(3):  # one token at a time through the reference
        want, cache = forward(params, verify_ids[:, t:t + 1], verify_pos[:, t:t + 1],
                              ref_plan, cache)
        want = np.asarray(want).astype(np.float32)
        assert rel_err(got[:, t], want[:, 0]) < 3e-2, t
        assert np.mean(got[:, t].argmax(-1) == want[:, 0].argmax(-1)) == 1.0


# ---------------------------------------------------------------------------------------------
# Against plain generate
# ---------------------------------------------------------------------------------------------

import pathlib  # noqa: E402

import jaxinfer  # noqa: E402
from jaxinfer import draft_head, speculative  # noqa: E402
from jaxinfer.model import from_params  # noqa: E402
from jaxinfer.sampling import SamplingParams  # noqa: E402

PROMPTS = ["x", "the cat sat on the mat and the cat sat on", "hello world", "a b c a b c a b",
           "one two three four five six seven eight nine ten one two three", "zz",
           "the the the", "to be or not to be, that is"]


@pytest.fixture(scope="module")
def looping(tiny_chat):
    """tiny_chat's config and tokenizer with unscaled random weights: its greedy text falls
    into loops, so prompt lookup has drafts to accept (tiny_chat's text rarely repeats)."""
    params = init_params(llama.param_specs(tiny_chat.config), jax.random.key(3), jnp.float32)
    return from_params(tiny_chat.config, params, tiny_chat.tokenizer, dtype="float32")


def assert_same(plain, spec):
    for row, (p, s) in enumerate(zip(plain, spec)):
        assert s.token_ids == p.token_ids, row
        assert (s.text, s.finish_reason) == (p.text, p.finish_reason), row
        assert (s.logprobs is None) == (p.logprobs is None), row
        if p.logprobs is not None:  # a verification's float32 logits: not a decode step's bits
            np.testing.assert_allclose(s.logprobs, p.logprobs, atol=1e-4)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("drafter", ["ngram", "draft", "self"])
def test_greedy_speculative_equals_plain_greedy(looping, tiny_chat, drafter, batch):
    """Token for token, with a stop token that ends rows in the middle of a round. The draft
    model is another model (drafts mostly rejected) or the target itself (mostly accepted):
    both ends of the acceptance rule."""
    spec_arg = {"ngram": "ngram", "draft": tiny_chat, "self": looping}[drafter]
    prompts = PROMPTS[:batch]
    # a stop token row 0 emits first mid-way (others may too); row 0 generated alone (its
    # tokens are its batch's row 0: test_generate.py), one program for both batch sizes
    (first,) = jaxinfer.generate(looping, PROMPTS[:1], max_new_tokens=24, chat=False)
    ids = first.token_ids
    stop = next(t for i, t in enumerate(ids) if i >= 12 and t not in ids[:i])
    plain = jaxinfer.generate(looping, prompts, max_new_tokens=24, chat=False, stop=[stop])
    spec = jaxinfer.generate(looping, prompts, max_new_tokens=24, chat=False, stop=[stop],
                             speculative=spec_arg, num_speculative_tokens=3)
    assert plain[0].finish_reason == "stop"
    assert_same(plain, spec)
    accepted = sum(c.accepted_tokens for c in spec)
    assert all(0 <= c.accepted_tokens <= c.draft_tokens for c in spec)
    if drafter != "draft":
        assert accepted > 0  # rounds of several tokens were exercised
    if drafter in ("ngram", "draft") and batch == 1:
        # Rounds without a match (n-gram), or while the drafts were mostly rejected (the
        # draft model: MIN_GAIN), were plain decode steps (the draft model's probes draft
        # one token); without the fallback every round verifies (a round cut by the stop
        # token may leave one short).
        (c,) = spec
        rounds = len(c.token_ids) - 1 - c.accepted_tokens
        assert 0 < c.draft_tokens < 3 * rounds
        if drafter == "ngram":
            assert c.draft_tokens % 3 == 0
        if drafter == "draft":
            (c,) = jaxinfer.generate(looping, prompts, max_new_tokens=24, chat=False,
                                     stop=[stop], num_speculative_tokens=3,
                                     speculative=speculative.DraftModel(tiny_chat,
                                                                        adaptive=False))
            assert c.token_ids == spec[0].token_ids
            rounds = len(c.token_ids) - 1 - c.accepted_tokens
            assert 3 * (rounds - 1) <= c.draft_tokens <= 3 * rounds


@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_coupled_sampling_equals_plain_sampling(looping, drafter):
    """Sampled rows (truncation, penalties, logit_bias, own seeds, greedy rows mixed in) get
    the tokens plain generate samples with the same seed: a row's draw depends only on its
    key at each position and the penalty counts of the tokens before it."""
    spec_arg = {"ngram": "ngram", "self": looping}[drafter]
    plain = jaxinfer.generate(looping, PROMPTS, max_new_tokens=24, chat=False, sampling=MIXED,
                              seed=5)
    spec = jaxinfer.generate(looping, PROMPTS, max_new_tokens=24, chat=False, sampling=MIXED,
                             seed=5, speculative=spec_arg, num_speculative_tokens=4)
    assert_same(plain, spec)
    assert sum(c.accepted_tokens for c in spec) > 0


def test_deterministic_speculative_is_bitwise_plain(looping):
    """KernelPolicy.deterministic() (bf16, the kernels in interpret mode): a verification's
    queries take the decode step's kernels and tiles (the cache read as pages by the chunk
    kernel, row-invariant matmuls), so greedy and coupled-sampled rows get plain decoding's
    tokens and logprobs bit for bit, not just to a tolerance."""
    from jaxinfer.plan import KernelPolicy

    model = from_params(looping.config, looping.params, looping.tokenizer, dtype="bfloat16")
    policy = KernelPolicy.deterministic(interpret=True)
    sampling = [SamplingParams(temperature=0.0, logprobs=True),
                SamplingParams(temperature=0.8, top_p=0.9, seed=3, logprobs=True)]
    kw = dict(max_new_tokens=24, chat=False, sampling=sampling, policy=policy)
    prompts = [PROMPTS[1] * 4, PROMPTS[3] * 8]  # past one 64-key tile (the kernels differ there)
    plain = jaxinfer.generate(model, prompts, **kw)
    spec = jaxinfer.generate(model, prompts, speculative="ngram", num_speculative_tokens=3,
                             **kw)
    assert sum(c.accepted_tokens for c in spec) > 0
    for p, s in zip(plain, spec):
        assert (s.token_ids, s.logprobs) == (p.token_ids, p.logprobs)


def test_ngram_drafts_follow_the_latest_longest_match():
    """Row 0: its last 2 tokens (7 8) occur earlier twice; the latest one (at 4) wins and its
    continuation runs into the suffix, so it repeats with its period (9, 7, 8, 9, ...).
    Row 1: no earlier occurrence of its last token: the last token repeated. Row 2: only the
    1-gram (5) occurs earlier. Slots past a row's last position hold stale tokens, never
    matched."""
    history = np.array([[7, 8, 1, 2, 7, 8, 9, 7, 8, 0, 7, 8],
                        [1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 4, 4],
                        [5, 6, 1, 2, 3, 5, 0, 0, 0, 0, 0, 0]], np.int32)
    last = np.array([8, 3, 5], np.int32)
    # jitted, as spec_round runs it: one program (eagerly each of its ops compiled alone)
    lookup = jax.jit(speculative.ngram_drafts, static_argnames=("k", "ngram"))
    drafts, found = lookup(history, last, k=5, ngram=speculative.NGram(max_n=3, min_n=1))
    np.testing.assert_array_equal(found, [True, False, True])
    np.testing.assert_array_equal(drafts, [[9, 7, 8, 9, 7], [4, 4, 4, 4, 4],
                                           [6, 1, 2, 3, 5]])


def test_stream_speculative_equals_generate(looping):
    # test_cli_speculative's shapes and drafter (its --speculative draft run is this program)
    sp = SamplingParams(temperature=0.8, logprobs=True)
    want = jaxinfer.generate(looping, PROMPTS[1], max_new_tokens=20, chat=False, sampling=sp)[0]
    out = jaxinfer.stream(looping, PROMPTS[1], max_new_tokens=20, chat=False, sampling=sp,
                          speculative=looping, num_speculative_tokens=3)
    text = "".join(out)
    assert text == want.text
    assert out.completion.token_ids == want.token_ids
    np.testing.assert_allclose(out.completion.logprobs, want.logprobs, atol=1e-4)
    assert out.completion.accepted_tokens > 0


def _other_tokenizer(tiny_chat, tmp_path):
    """tiny_chat's tokenizer with two tokens' ids swapped: same size, other ids."""
    import json

    from checkpoints.tokenizer import Tokenizer

    src = pathlib.Path(__file__).parent / "fixtures" / "data" / "tokenizer" / "tiny_hf"
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    return Tokenizer.from_hf_dir(tmp_path)


def test_bad_speculative_arguments(looping, tiny_chat, tmp_path):
    """Each refused before anything is compiled, naming the problem."""
    def run(**kw):
        return jaxinfer.generate(looping, "hi", max_new_tokens=8, chat=False, **kw)

    for k in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1"):
            run(speculative="ngram", num_speculative_tokens=k)
    context = looping.config.max_position_embeddings
    with pytest.raises(ValueError, match="more than the context left"):
        jaxinfer.generate(looping, "hi", max_new_tokens=context - 4, chat=False,
                          speculative="ngram", num_speculative_tokens=8)
    with pytest.raises(ValueError, match="speculative must be 'ngram'"):
        run(speculative="eagle")
    with pytest.raises(ValueError, match="speculative must be 'ngram'"):
        run(speculative=3)
    other_vocab = from_params(
        tiny_bf16_config(), init_params(llama.param_specs(tiny_bf16_config()), jax.random.key(0),
                                        jnp.float32), None, dtype="float32")
    with pytest.raises(ValueError, match="vocabulary .96 tokens. is not the target's"):
        run(speculative=other_vocab)
    swapped = dataclasses.replace(looping, tokenizer=_other_tokenizer(tiny_chat, tmp_path))
    with pytest.raises(ValueError, match="tokenizer differs from the target's"):
        run(speculative=speculative.DraftModel(swapped))
    with pytest.raises(ValueError, match="min_gain must be a number >= 0"):
        run(speculative=speculative.DraftModel(looping, min_gain=-1.0))
    with pytest.raises(ValueError, match="min_n <= max_n"):
        speculative.NGram(max_n=1, min_n=2)


def _chi_square_p(counts: np.ndarray, law: np.ndarray) -> float:
    """Pearson's chi-square p-value of counts [V] against probabilities law [V]; bins
    expecting fewer than 5 draws are pooled into one."""
    from scipy import stats

    expected = law * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.fixture(scope="module")
def law_models():
    """test_rejection_sampling_follows_the_target_law's (target, draft, laws): two random
    models (V = 16) and the target's exact laws (and the draft's for the second token),
    made once for its four cases (the models are read-only; the laws depend on them alone)."""
    config = Config(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=16,
                    eos_token_ids=())

    def model(key):  # weights 3x the fan-in scale: laws far from uniform
        # (scaled in numpy: the same bits as an eager multiply, without a compile per shape)
        params = jax.tree.map(lambda a: jax.device_put(3 * np.asarray(a)) if a.ndim > 1 else a,
                              init_params(llama.param_specs(config), jax.random.key(key),
                                          jnp.float32))
        return from_params(config, params, None, dtype="float32")

    target, draft = model(1), model(2)
    prompt, v = LAW_PROMPT, config.vocab_size

    def laws(m, prefix_len):  # p(next | prompt + every prefix of that length) [V] * len, V
        prefixes = np.array(list(itertools.product(range(v), repeat=prefix_len)),
                            np.int64).reshape(v ** prefix_len, prefix_len)  # [V ** len, len]
        ids = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], axis=1)
        logits = np.asarray(m(ids))[:, -1].astype(np.float64)  # softmax in numpy (float64)
        e = np.exp(logits - logits.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)  # [V ** len, V]

    p1 = laws(target, 0)[0]  # [V]
    p2 = laws(target, 1)  # [V, V]: row t1
    p3 = laws(target, 2).reshape(v, v, v)  # [t1, t2, V]
    return target, draft, dict(p1=p1, marginal2=p1 @ p2,
                               marginal3=np.einsum("a,ab,abc->c", p1, p2, p3),
                               always_accept=p1 @ laws(draft, 1))


LAW_PROMPT = [3, 1, 4]


@pytest.mark.parametrize("drafter,where", [("draft", "generate"), ("head", "generate"),
                                           ("draft", "engine"), ("head", "engine")])
def test_rejection_sampling_follows_the_target_law(drafter, where, law_models):
    """DraftModel(rejection=True), or a random feature head with rejection=True, whose law
    differs from the target's, in generate or the engine: the first two tokens of the first
    round (one of an accepted draft, a residual draw, or the bonus token) follow the target's
    marginal laws, computed exactly from its full forward over all V and V * V continuations
    (V = 16). For the draft model, the same counts against the law an always-accepting rule
    would give are refused, so the sample size can tell the two apart."""
    target, draft, law = law_models
    prompt, n, v = LAW_PROMPT, 6000, target.config.vocab_size
    spec_arg = speculative.DraftModel(draft, rejection=True) if drafter == "draft" else \
        dataclasses.replace(draft_head.init_eagle(target, 3), rejection=True)
    if where == "generate":
        out = jaxinfer.generate(target, [prompt] * n, max_new_tokens=3,
                                sampling=SamplingParams(temperature=1.0), seed=11,
                                speculative=spec_arg, num_speculative_tokens=2)
    else:  # request i's seed 11 + i; rows of one verification drawn apart
        # Prompts prefilled 512 rows a dispatch, the decode batch's (~36 engine steps, not
        # ~1500 of 4 rows): a request's draws follow its keys alone, so the same tokens. One
        # batch size each (512 rows): two programs, not ten and seven.
        engine = jaxinfer.Engine(target, max_num_seqs=512, page_size=8, max_model_len=16,
                                 max_prefill_rows=512, speculative=spec_arg,
                                 num_speculative_tokens=2, row_buckets=[512])
        out = engine.run([prompt] * n, sampling=SamplingParams(temperature=1.0),
                         max_tokens=3, seed=11)
    tokens = np.array([c.token_ids for c in out])  # [N, 3]: prefill's token, then the round's
    accepted = sum(c.accepted_tokens for c in out)
    assert 0.1 * n < accepted < 1.9 * n  # drafts are accepted and rejected
    # The coupled rule would give plain sampling's very tokens (the target's law too): the
    # rejection rule draws others. Plain sampling from generate's one program for all four
    # cases (not a plain engine's two more).
    if where == "generate":
        kw = dict(sampling=SamplingParams(temperature=1.0), seed=11)
    else:  # the engine's request i draws generate's with seed 11 + i (Engine.run)
        kw = dict(sampling=[SamplingParams(temperature=1.0, seed=11 + i) for i in range(64)])
    plain = jaxinfer.generate(target, [prompt] * 64, max_new_tokens=3, **kw)
    assert (np.array([c.token_ids for c in plain]) != tokens[:64]).any()

    count2 = np.bincount(tokens[:, 1], minlength=v)
    count3 = np.bincount(tokens[:, 2], minlength=v)
    assert _chi_square_p(np.bincount(tokens[:, 0], minlength=v), law["p1"]) > 1e-3
    assert _chi_square_p(count2, law["marginal2"]) > 1e-3
    assert _chi_square_p(count3, law["marginal3"]) > 1e-3
    if drafter == "draft":  # t2's law if every first draft were accepted
        assert _chi_square_p(count2, law["always_accept"]) < 1e-6


def test_cli_speculative(tiny_chat, tiny_chat_dir, capsys, tmp_path):
    """--speculative draft / ngram print the API's plain tokens and the acceptance counts;
    inconsistent flags are usage errors before anything loads."""
    import json

    from jaxinfer import cli

    # With logprobs, and K = 3 for the draft model: test_stream_speculative_equals_generate's
    # programs (the same shapes and flags), not ones of their own.
    sp = SamplingParams(temperature=0.7, logprobs=True)
    (ref,) = jaxinfer.generate(tiny_chat, PROMPTS[1], max_new_tokens=12, chat=False,
                               sampling=sp, seed=3)
    base = ["generate", PROMPTS[1], "--no-chat", "-n", "12", "--temperature", "0.7", "--seed",
            "3", "--model", str(tiny_chat_dir), "--json", "--logprobs"]
    for flags in (["--speculative", "draft", "--draft-model", str(tiny_chat_dir),
                   "--num-speculative-tokens", "3"],
                  ["--speculative", "ngram", "--num-speculative-tokens", "2"]):
        assert cli.main(base + flags) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["token_ids"] == ref.token_ids and got["text"] == ref.text
        np.testing.assert_allclose(got["logprobs"], ref.logprobs, atol=1e-4)
        counts = got["speculative"]
        assert 0 <= counts["accepted_tokens"] <= counts["draft_tokens"]
    assert counts["draft_tokens"] % 2 == 0
    # --rejection-sampling: a head's rejection=True run's tokens (not plain sampling's)
    head = draft_head.init_eagle(tiny_chat, 5)
    path = draft_head.save(head, tmp_path / "head.safetensors")
    # streamed, as the CLI runs it: the CLI's run below takes this program
    pieces = jaxinfer.stream(tiny_chat, PROMPTS[1], max_new_tokens=12, chat=False, sampling=sp,
                             seed=3, speculative=dataclasses.replace(head, rejection=True))
    "".join(pieces)
    rej = pieces.completion
    assert rej.token_ids != ref.token_ids
    assert cli.main(base + ["--speculative", "head", "--draft-head", str(path),
                            "--rejection-sampling"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == rej.token_ids
    for flags, match in ((["--speculative", "draft"], "needs --draft-model"),
                         (["--draft-model", str(tiny_chat_dir)], "need --speculative"),
                         (["--num-speculative-tokens", "3"], "need --speculative"),
                         (["--speculative", "ngram", "--rejection-sampling"],
                          "--rejection-sampling needs --speculative draft")):
        assert cli.main(base + flags) == 2
        assert match in capsys.readouterr().err


def test_bench_speculative(tiny_chat_dir, capsys):
    """jaxinfer bench --speculative: a verification cost per K and an acceptance row per K
    and task (whose run checks its tokens against plain greedy generate)."""
    import json

    from jaxinfer import cli

    assert cli.main(["bench", "--model", str(tiny_chat_dir), "--speculative", "ngram",
                     "--num-speculative-tokens", "1", "3", "--prompt-len", "16", "--gen-len",
                     "8", "--repeats", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()
            if line.startswith("{")]
    cost = [r for r in rows if "ratio" in r]
    runs = [r for r in rows if "tokens_per_verification" in r]
    assert [r["k"] for r in cost] == [1, 3] and all(r["ms"] > 0 for r in cost)
    assert [r["k"] for r in runs] == [1, 3]
    for r in runs:
        assert r["new_tokens"] == 8 and 1 <= r["tokens_per_verification"] <= r["k"] + 1
        assert r["probes"] == 0  # n-gram lookup has no fallback probes: K drafts a round
        assert r["verifications"] + r["plain_steps"] + r["accepted"] in (7, 8)
        assert r["same_tokens"]


def test_mla_model_speculative_equals_plain():
    """A DeepSeek (MLA) model verifies against its latent cache and drafts for itself."""
    from jaxinfer.configs import MLAConfig
    from jaxinfer.models import deepseek

    mla = MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
    config = Config(vocab_size=64, hidden_size=32, intermediate_size=32, num_layers=2,
                    num_heads=3, num_kv_heads=3, head_dim=16, family="deepseek", mla=mla,
                    max_position_embeddings=128)
    model = from_params(config, init_params(deepseek.param_specs(config), jax.random.key(0),
                                            jnp.float32), None, dtype="float32")
    prompts = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7], [9] * 5]
    plain = jaxinfer.generate(model, prompts, max_new_tokens=20)
    for drafter in ("ngram", model):
        spec = jaxinfer.generate(model, prompts, max_new_tokens=20, speculative=drafter,
                                 num_speculative_tokens=3)
        assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
        assert sum(c.accepted_tokens for c in spec) > 0


def test_host_ngram_equals_device_ngram():
    """The engine's host prompt lookup and generate's on-device one: the same drafts."""
    rng = np.random.default_rng(0)
    lookup = jax.jit(speculative.ngram_drafts, static_argnames=("k", "ngram"))
    for trial in range(40):
        length = int(rng.integers(1, 30))
        row = rng.integers(0, 4, length)  # a small alphabet: many matches
        stale = rng.integers(0, 4, 38 - length)  # slots past the row's tokens
        history = jnp.asarray(np.concatenate([row, stale])[None], jnp.int32)  # [1, 38]
        ngram = speculative.NGram(max_n=int(rng.integers(1, 4)), min_n=1)
        device, dfound = lookup(history, jnp.array([length - 1], jnp.int32), k=5, ngram=ngram)
        drafts, found = speculative.ngram_drafts_host(row.tolist(), 5, ngram)
        assert (drafts, found) == (device[0].tolist(), bool(dfound[0])), trial


@pytest.fixture(scope="module")
def engine_requests(looping):
    """(requests, generate()'s output for each) of test_engine_speculative_equals_generate:
    the same for its four drafters, so the reference runs once (per worker), not four times."""
    from test_engine import _reference

    reqs = _engine_requests(looping)
    return reqs, _reference(looping, reqs, batch=24)


def _engine_requests(looping):
    from test_engine import _requests

    reqs = _requests(looping, 24, seed=4)
    # Penalized greedy rows: this model repeats tokens unless its penalties count each one.
    return [(p, sp if i % 4 != 2 else SamplingParams(temperature=0.0, repetition_penalty=1.2,
                                                     frequency_penalty=0.4), n * 2)
            for i, (p, sp, n) in enumerate(reqs)]


@pytest.mark.parametrize("drafter", ["ngram", "oracle", "draft", "self"])
def test_engine_speculative_equals_generate(looping, tiny_chat, drafter, engine_requests,
                                            monkeypatch):
    """The engine with prompt lookup: requests arriving at random steps, shared prefixes,
    chunked prompts, a pool small enough to preempt, greedy and sampled rows with penalties:
    each request's tokens (and logprobs) are generate()'s, and every page comes back.
    "oracle": the drafts are generate()'s own continuation (prompt lookup replaced), so
    nearly every draft is accepted, on the penalized rows too, where each accepted draft must
    count in the next position's penalties. "draft": another model drafts (its pages beside
    the target's), "self": the model drafts for itself (most drafts accepted)."""
    from test_engine import _engine, _prime, _serve

    reqs, want = engine_requests
    if drafter == "oracle":
        futures = [p + toks for (p, _, _), (toks, _, _) in zip(reqs, want)]

        def oracle(tokens, k, ngram):
            for f in futures:
                if f[:len(tokens)] == tokens and len(f) > len(tokens):
                    return (f[len(tokens):] + [0] * k)[:k], True
            return [0] * k, True

        monkeypatch.setattr(speculative, "ngram_drafts_host", oracle)
    spec_arg = {"draft": tiny_chat, "self": looping}.get(drafter, "ngram")
    # 30 pages: few enough to preempt (a draft model's pool takes as many bytes again)
    engine = _engine(looping, pages=30 if spec_arg == "ngram" else 60, max_num_seqs=8,
                     speculative=spec_arg, num_speculative_tokens=3)
    assert engine.total_pages == 29  # 30 less the null page, whichever drafter
    # The engine's flags are every request's from the start: each dispatch shape compiles
    # once, and the four drafters' target programs are the same ones.
    _prime(engine, reqs)
    got, reasons = _serve(engine, reqs, np.random.default_rng(5))
    assert engine.stats["preemptions"] > 0
    rate = engine.stats["accepted_tokens"] / engine.stats["draft_tokens"]
    assert rate > {"oracle": 0.5, "self": 0.5}.get(drafter, 0.0 if drafter == "ngram" else -1)
    if drafter == "draft":  # mostly rejected: rounds fell back to plain steps (MIN_GAIN)
        assert engine.stats["plain_rounds"] > 0
    assert engine.free_pages == engine.total_pages and not engine.requests
    for i, (toks, lps, reason) in enumerate(want):
        assert (got[i][0], reasons[i]) == (toks, reason), i
        if reqs[i][1].logprobs:
            np.testing.assert_allclose(got[i][1], lps, atol=1e-4)


def test_engine_run_reports_acceptance_per_request(looping):
    """Engine.run with speculation: generate()'s tokens, each Completion's draft and accepted
    counts, which add up to the engine's."""
    from test_engine import _engine, _prime

    # test_engine_speculative_equals_generate[ngram]'s engine, primed with its requests'
    # sampling flags: its programs (prefill, decode, verification), not ones of its own
    engine = _engine(looping, pages=30, max_num_seqs=8, speculative="ngram",
                     num_speculative_tokens=3)
    _prime(engine, _engine_requests(looping))
    out = engine.run(PROMPTS[:4], max_tokens=20, chat=False)
    want = jaxinfer.generate(looping, PROMPTS[:4], max_new_tokens=20, chat=False)
    assert [c.token_ids for c in out] == [c.token_ids for c in want]
    assert sum(c.draft_tokens for c in out) == engine.stats["draft_tokens"] > 0
    assert sum(c.accepted_tokens for c in out) == engine.stats["accepted_tokens"] > 0
    assert all(c.accepted_tokens <= c.draft_tokens for c in out)


def test_engine_bad_speculative_arguments(looping):
    from test_engine import _engine

    for kw, match in (({"speculative": 3}, "None, 'ngram', 'head', 'mtp', an NGram"),
                      ({"speculative": "ngram", "num_speculative_tokens": 0},
                       "num_speculative_tokens must be an integer >= 1"),
                      ({"speculative": "ngram", "decode_steps": 2}, "decode_steps=1")):
        with pytest.raises(ValueError, match=match):
            _engine(looping, **kw)


@pytest.mark.parametrize("drafter", ["ngram", "self", "head"])
def test_engine_speculative_warmup_top_logprobs_and_grammar(looping, drafter):
    """A speculative engine: warmup() compiles its verifications (and a draft model's steps,
    a head's prefill and verification, and with structured=True the drafter's plain rounds
    under a grammar's mask) so serving compiles nothing new; top_logprobs of verified tokens
    are the plain engine's; a grammar request beside them takes plain rounds under its masks:
    the plain engine's tokens, in its language."""
    from test_engine import _engine

    from jaxinfer import draft_head
    from jaxinfer.engine import step
    from jaxinfer.structured import Grammar

    spec_arg = {"self": looping, "head": draft_head.init_eagle(looping, 1)}.get(drafter,
                                                                               "ngram")
    greedy = SamplingParams(temperature=0.0)
    top = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    # Two requests: rows of 1 and 2 are every shape serving them takes (4 would be warmed up
    # and never met), and chunks of 16 tokens (the 20-token prompt takes two) the one chunk
    # length. A draft model's pages take as many bytes again: twice the memory keeps the
    # target's pool (and so its prefill and decode programs) the plain engine's.
    small = dict(max_model_len=64, max_num_seqs=2, max_prefill_rows=2, chunk_size=16)
    engine = _engine(looping, speculative=spec_arg, num_speculative_tokens=2,
                     pages=128 if drafter == "self" else 64, **small)
    engine.warmup([greedy, top], structured=True)
    steps = (step.prefill_step, step.decode_step, step.verify_step, step.draft_step,
             step.draft_prefill_step)
    compiled = [f._cache_size() for f in steps]
    prompts = [list(range(3, 13)) * 2, list(range(40, 47))]
    regex = "(yes|no), [0-9]{2,4}"
    ids = [engine.add_request(p, sampling=sp, max_tokens=12)
           for p, sp in zip(prompts, [greedy, top])]
    ids.append(engine.add_request([5, 6, 7], max_tokens=12,
                                  grammar=Grammar.regex(looping.tokenizer, regex)))
    got = {i: ([], []) for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(out.new_top_logprobs or [])
    assert [f._cache_size() for f in steps] == compiled
    assert engine.stats["draft_tokens"] > 0
    plain = _engine(looping, **small)
    if drafter == "self":
        assert engine.total_pages == plain.total_pages
    ids2 = [plain.add_request(p, sampling=sp, max_tokens=12)
            for p, sp in zip(prompts, [greedy, top])]
    ids2.append(plain.add_request([5, 6, 7], max_tokens=12,
                                  grammar=Grammar.regex(looping.tokenizer, regex)))
    want = {i: ([], []) for i in ids2}
    while plain.has_unfinished():
        for out in plain.step():
            want[out.request_id][0].extend(out.new_token_ids)
            want[out.request_id][1].extend(out.new_top_logprobs or [])
    for a, b in zip(ids, ids2):
        assert got[a][0] == want[b][0]
        assert len(got[a][1]) == len(want[b][1])
        for x, y in zip(got[a][1], want[b][1]):
            assert [t for t, _ in x] == [t for t, _ in y]
            np.testing.assert_allclose([lp for _, lp in x], [lp for _, lp in y], atol=1e-4)
    assert len(got[ids[1]][1]) == 12 and all(len(t) == 3 for t in got[ids[1]][1])
    assert re.fullmatch(regex, looping.tokenizer.decode(got[ids[2]][0]))


def test_bench_tasks_match_the_cli_choices():
    from jaxinfer import cli, speculative_bench

    args = cli.build_parser().parse_args(["bench", "--tasks", *speculative_bench.TASKS])
    assert args.tasks == list(speculative_bench.TASKS)


def test_rejection_mode_keeps_greedy_rows_plain(looping):
    """In a DraftModel(rejection=True) batch, greedy rows (MIXED's rows 1 and 6, the second
    with a repetition penalty and logprobs) still take the argmax: plain generate's tokens
    (sampled rows follow the law: the chi-square test above). MIXED at the coupled test's
    shapes: its plain run (one program) is this test's."""
    kw = dict(max_new_tokens=24, chat=False, sampling=MIXED, seed=5)
    plain = jaxinfer.generate(looping, PROMPTS, **kw)
    spec = jaxinfer.generate(looping, PROMPTS, **kw, num_speculative_tokens=3,
                             speculative=speculative.DraftModel(looping, rejection=True))
    for row in (1, 6):
        assert spec[row].token_ids == plain[row].token_ids
    np.testing.assert_allclose(spec[6].logprobs, plain[6].logprobs, atol=1e-4)
    assert len(spec[2].logprobs) == len(spec[2].token_ids)
    assert sum(c.accepted_tokens for c in spec) > 0


def test_serve_speculative_equals_generate(tiny_chat, tiny_chat_dir):
    """`jaxinfer serve --speculative draft` in its own process (the model drafting for
    itself): a greedy completion and a seeded sampled one are generate()'s tokens; a grammar
    request is served in its language."""
    import openai

    from tests.serving import serve

    ids = [5, 6, 7, 8]
    greedy = jaxinfer.generate(tiny_chat, [ids], max_new_tokens=10)[0]
    sampled = jaxinfer.generate(tiny_chat, [ids], max_new_tokens=10,
                                sampling=SamplingParams(temperature=0.8, seed=3))[0]
    with serve("--model", str(tiny_chat_dir), "--dtype", "float32", "--max-num-seqs", "2",
               "--max-model-len", "128", "--kv-memory", "32MB", "--speculative", "draft",
               "--draft-model", str(tiny_chat_dir), "--num-speculative-tokens", "3",
               "--api-key", "test-key") as (url, _, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="test-key", timeout=60,
                               max_retries=0)
        for want, extra in ((greedy, {"temperature": 0}), (sampled, {"temperature": 0.8,
                                                                      "seed": 3})):
            r = client.completions.create(model=str(tiny_chat_dir), prompt=ids, max_tokens=10,
                                          **extra)
            assert r.choices[0].text == want.text
            assert r.usage.completion_tokens == len(want.token_ids)
        # A grammar request takes plain rounds under its masks: its language.
        regex = "(yes|no), [0-9]{2,4}"
        r = client.completions.create(model=str(tiny_chat_dir), prompt=ids, max_tokens=20,
                                      extra_body={"guided_regex": regex})
        assert re.fullmatch(regex, r.choices[0].text) and r.choices[0].finish_reason == "stop"
        metrics = dict(line.split() for line in httpx.get(
            url + "/metrics", headers={"Authorization": "Bearer test-key"}).text.splitlines()
            if line.startswith("jaxinfer_spec_"))
        # the model drafting for itself: its greedy drafts are accepted
        assert 0 < float(metrics["jaxinfer_spec_accepted_tokens"]) \
            <= float(metrics["jaxinfer_spec_draft_tokens"])
