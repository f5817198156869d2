"""Generation: greedy equality with transformers, cache vs full forward, batching, seeds, errors."""

import json
import re
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer import SamplingParams
from jaxinfer.cache import KVCache
from jaxinfer.generate import decode_loop, init_state, prefill
from jaxinfer.models import llama
from jaxinfer.plan import KernelPolicy

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "data"
HF_VARIANTS = sorted(p for p in (FIXTURES / "hf").iterdir() if (p / "ref.npz").exists())
REFERENCE = json.loads((FIXTURES / "gguf" / "smollm2_generate.json").read_text())


@pytest.fixture(scope="module")
def smollm():
    return jaxinfer.load("smollm2-135m-instruct", dtype="float32")


def test_greedy_matches_transformers_batched(smollm):
    """Every reference prompt in one ragged batch, chat and plain mixed, token for token."""
    cases = REFERENCE["generations"]
    n = REFERENCE["settings"]["max_new_tokens"]
    assert len(cases) >= 4 and {c["chat"] for c in cases} == {True, False}
    assert len({len(c["prompt_ids"]) for c in cases}) > 1  # really ragged
    assert sum(len(c["new_token_ids"]) >= 48 for c in cases) >= 4  # long runs, chat and plain
    # Our tokenizer and chat template give transformers' prompt ids...
    for c in cases:
        ours = (smollm.tokenizer.apply_chat_template([{"role": "user", "content": c["text"]}])
                if c["chat"] else smollm.tokenizer.encode(c["text"]))
        assert ours == c["prompt_ids"]
    # ...and one batch of all of them transformers' new tokens, stopping where it stopped.
    out = jaxinfer.generate(smollm, [c["prompt_ids"] for c in cases], max_new_tokens=n)
    for case, got in zip(cases, out):
        assert got.token_ids == case["new_token_ids"]
        stopped = len(case["new_token_ids"]) < n
        assert got.finish_reason == ("stop" if stopped else "length")
    # The text path (chat=True wraps a user message) gives the same tokens.
    chat_cases = [c for c in cases if c["chat"]]
    for case, got in zip(chat_cases, jaxinfer.generate(smollm, [c["text"] for c in chat_cases],
                                                       max_new_tokens=n, chat=True)):
        assert got.token_ids == case["new_token_ids"]
    assert "Paris" in out[0].text


def test_batching_does_not_change_outputs(tiny_chat):
    prompts = ["Hi", "Name three famous painters and one painting by each of them.", "2+2="]
    together = jaxinfer.generate(tiny_chat, prompts, max_new_tokens=24, chat=True)
    for p, t in zip(prompts, together):
        (alone,) = jaxinfer.generate(tiny_chat, [p], max_new_tokens=24, chat=True)
        assert alone.token_ids == t.token_ids


@pytest.mark.parametrize("variant", [v for v in HF_VARIANTS if v.name != "llama_dynamic"],
                         ids=lambda p: p.name)
def test_incremental_decoding_matches_full_forward(variant):
    """Prefill a prefix into the cache, then one token at a time: every step's logits equal the
    full forward's at that position (llama_dynamic is left out: its NTK base depends on the
    longest position in the call, so a full forward over T > max_position_embeddings rescales
    early positions that incremental decoding saw unscaled, exactly as in transformers)."""
    model = jaxinfer.load(str(variant), dtype="float32")
    ids = jnp.asarray(np.load(variant / "ref.npz")["input_ids"])  # [B, T]
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    forward = jax.jit(llama.forward, static_argnums=(3,))  # one compile per query length
    full, _ = forward(model.params, ids, pos, model.plan)
    split = t // 3
    cache = KVCache.init(model.config, b, t + 5)
    logits, cache = forward(model.params, ids[:, :split], pos[:, :split], model.plan, cache)
    steps = [logits]
    for i in range(split, t):
        logits, cache = forward(model.params, ids[:, i:i + 1], pos[:, i:i + 1], model.plan,
                                cache)
        steps.append(logits)
    inc = np.asarray(jnp.concatenate(steps, axis=1))
    full = np.asarray(full)
    for i in range(t):
        rel = np.linalg.norm(inc[:, i] - full[:, i]) / np.linalg.norm(full[:, i])
        assert rel <= 1e-4, f"position {i}: relative error {rel}"
    np.testing.assert_array_equal(inc.argmax(-1), full.argmax(-1))


def test_same_seed_same_tokens_and_batch_independence(tiny_chat):
    sp = SamplingParams(temperature=1.0, top_p=0.95, top_k=50)
    a = jaxinfer.generate(tiny_chat, ["Tell me a story.", "Why is the sky blue?"], max_new_tokens=16,
                          sampling=sp, seed=3, chat=True)
    b = jaxinfer.generate(tiny_chat, ["Tell me a story.", "Why is the sky blue?"], max_new_tokens=16,
                          sampling=sp, seed=3, chat=True)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    c = jaxinfer.generate(tiny_chat, ["Tell me a story.", "Why is the sky blue?"], max_new_tokens=16,
                          sampling=sp, seed=4, chat=True)
    assert [x.token_ids for x in c] != [x.token_ids for x in a]
    # A request with its own seed draws the same tokens alone or at another row of a batch.
    own = SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    (alone,) = jaxinfer.generate(tiny_chat, ["Why is the sky blue?"], max_new_tokens=16,
                                 sampling=own, chat=True)
    batch = jaxinfer.generate(tiny_chat, ["Hi", "Why is the sky blue?"], max_new_tokens=16,
                              sampling=[SamplingParams(temperature=0.7), own], seed=9, chat=True)
    assert batch[1].token_ids == alone.token_ids


def test_stop_strings_and_token_ids(tiny_chat):
    prompt = "Write a short poem about the moon."
    (full,) = jaxinfer.generate(tiny_chat, prompt, max_new_tokens=30, chat=True)
    assert len(full.text) > 20
    stop = full.text[12:16]  # a string that occurs mid-answer
    first = full.text.find(stop)
    for cut in (jaxinfer.generate(tiny_chat, prompt, max_new_tokens=30, chat=True, stop=[stop])[0],
                jaxinfer.generate(tiny_chat, prompt, max_new_tokens=30, chat=True, stop=stop)[0]):
        assert cut.finish_reason == "stop" and cut.text == full.text[:first]
        assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
        assert len(tiny_chat.tokenizer.decode(cut.token_ids)) > first  # tokens reach the stop string
    assert "".join(jaxinfer.stream(tiny_chat, prompt, max_new_tokens=30, chat=True,
                                   stop=[stop])) == full.text[:first]
    stop_tok = full.token_ids[3]
    (by_id,) = jaxinfer.generate(tiny_chat, prompt, max_new_tokens=30, chat=True, stop=[stop_tok])
    assert by_id.token_ids == full.token_ids[: full.token_ids.index(stop_tok) + 1]
    assert by_id.finish_reason == "stop"


def test_steps_per_sync_same_tokens(tiny_chat):
    """k = 5 decode steps per host check: the same tokens and finish reasons as one step, for
    rows that stop (a stop token inside a block of k) and rows that run their budget, in one
    batch (n - 1 = 47 decode steps: 9 blocks of 5, then 2 single steps); with no stop ids (a
    fixed-length run, as `jaxinfer bench`) the default blocks of 8 (a while loop holding an
    8-step loop, then the single-step loop) end exactly at the budget."""
    prompts = ["Tell me a story.", "Hi", "2+2=", "Name a colour."]
    n = 48
    free = jaxinfer.generate(tiny_chat, prompts, max_new_tokens=n, chat=True)
    stop_tok = free[0].token_ids[6]
    assert any(stop_tok not in c.token_ids for c in free)  # some rows run their budget
    one = jaxinfer.generate(tiny_chat, prompts, max_new_tokens=n, chat=True, stop=[stop_tok])
    five = jaxinfer.generate(tiny_chat, prompts, max_new_tokens=n, chat=True, stop=[stop_tok],
                             policy=KernelPolicy(steps_per_sync=5))
    assert {c.finish_reason for c in one} == {"stop", "length"}
    assert [(c.token_ids, c.finish_reason) for c in five] == \
        [(c.token_ids, c.finish_reason) for c in one]
    # no stop ids: blocks of 8, no step past the budget
    ids = tiny_chat.tokenizer.encode(prompts[1])
    state, tokens, lengths = init_state(tiny_chat, [ids], n, [SamplingParams(temperature=0.0)],
                                        0, stop_ids=[])
    state = prefill(tiny_chat.params, tokens, lengths, state, tiny_chat.plan)
    text = str(jax.make_jaxpr(lambda s: decode_loop(tiny_chat.params, s, tiny_chat.plan))(state))
    # a fori loop of known trip count traces to a scan
    assert text.count("while[") == 2
    assert len(re.findall(r"scan\[[^\]]*?length=8\b", text, re.S)) == 1
    state = decode_loop(tiny_chat.params, state, tiny_chat.plan)
    (plain,) = jaxinfer.generate(tiny_chat, [ids], max_new_tokens=n, stop=[stop_tok])
    got = np.asarray(state.output)[0].tolist()
    assert int(state.step) == n and got[:len(plain.token_ids)] == plain.token_ids


def test_stream_equals_generate(tiny_chat):
    (ref,) = jaxinfer.generate(tiny_chat, "What is the capital of France?", max_new_tokens=20,
                               chat=True)
    pieces = list(jaxinfer.stream(tiny_chat, "What is the capital of France?", max_new_tokens=20,
                                  chat=True))
    assert len(pieces) > 1 and "".join(pieces) == ref.text


def test_logprobs(tiny_chat):
    (c,) = jaxinfer.generate(tiny_chat, "Hi", max_new_tokens=6, chat=True,
                             sampling=SamplingParams(temperature=0.0, logprobs=True))
    ids = tiny_chat.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    logits = np.asarray(tiny_chat([ids + c.token_ids[:-1]]))[0, len(ids) - 1:]
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    want = logits[np.arange(len(c.token_ids)), c.token_ids] - logz
    np.testing.assert_allclose(c.logprobs, want, atol=1e-4)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[]), "not empty"),
    (dict(prompts=[""]), "prompt 0 is empty"),
    (dict(prompts="hi", max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(prompts="hi", max_new_tokens=9000), "exceeds the model's context of 512"),
    (dict(prompts=[[1] * 510], max_new_tokens=8), "exceeds the model's context"),
    (dict(prompts="hi", max_new_tokens=100, max_seq_len=64), "exceeds max_seq_len 64"),
    (dict(prompts=[[1, 2, 999999]]), "outside the vocabulary"),
    (dict(prompts=["a", "b"], sampling=[SamplingParams()]), "2 prompts"),
    (dict(prompts="hi", policy="deterministic"), "policy must be a jaxinfer.plan.KernelPolicy"),
])
def test_bad_generate_arguments(tiny_chat, kwargs, match):
    kwargs.setdefault("max_new_tokens", 4)
    with pytest.raises(ValueError, match=match):
        jaxinfer.generate(tiny_chat, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
])
def test_impossible_sampling_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_unknown_model_name():
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        jaxinfer.load("no-such-model")
