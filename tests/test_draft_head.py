"""Feature draft heads (jaxinfer/draft_head.py): an EAGLE head (random, and trained by
`jaxinfer train-draft`) and DeepSeek-V3's MTP module draft for speculative decoding without
changing plain generate's tokens; heads for other models and `mtp` without MTP weights are
refused before anything compiles."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxinfer
from jaxinfer import draft_head, train_draft
from jaxinfer.cache import KVCache
from jaxinfer.models import llama, registry
from jaxinfer.model import from_params
from jaxinfer.plan import KernelPolicy
from jaxinfer.sampling import SamplingParams
from kernel_testing import init_params  # jaxinfer.weights.init_params's bits, fewer compiles
from sampling_cases import MIXED

HF = pathlib.Path(__file__).parent / "fixtures" / "data" / "hf"
PROMPTS = ["x", "the cat sat on the mat and the cat sat on", "hello world", "a b c a b c a b",
           "one two three four five six seven eight nine ten one two three", "zz",
           "the the the", "to be or not to be, that is"]


@pytest.fixture(scope="module")
def looping(tiny_chat):
    """tiny_chat with unscaled random weights: its greedy text loops (as test_speculative's)."""
    params = init_params(llama.param_specs(tiny_chat.config), jax.random.key(3), jnp.float32)
    return from_params(tiny_chat.config, params, tiny_chat.tokenizer, dtype="float32")


def test_random_head_is_lossless_greedy_and_sampled(looping):
    """A head with random weights drafts badly, but greedy rows (batches of 1 and 8, a stop
    token mid-round) and coupled sampled rows get plain generate's tokens exactly."""
    head = draft_head.init_eagle(looping, 1)
    # Batch 1: the drafts are rejected, so rounds fall back to plain steps (MIN_GAIN), and
    # each probe that finds them still rejected doubles the wait for the next: over 64
    # tokens 2 verifications of 3 drafts while the gain decays from its start (1) (the 2nd
    # and 3rd tokens), probes of one draft after 8 and 16 plain rounds (the 12th and 29th);
    # the 29th is the head's one first-draft hit in these tokens, so 2 verifications follow
    # (the 30th, 31st), then probes after 8 and 16 plain rounds (the 40th, 57th).
    (plain,) = jaxinfer.generate(looping, PROMPTS[:1], max_new_tokens=64, chat=False)
    (s,) = jaxinfer.generate(looping, PROMPTS[:1], max_new_tokens=64, chat=False,
                             speculative=head, num_speculative_tokens=3)
    assert s.token_ids == plain.token_ids and len(s.token_ids) == 64
    assert (s.draft_tokens, s.accepted_tokens) == (4 * 3 + 4, 0)
    assert s.verifications == 4 + 4  # the 4 verifications and the 4 probes
    # Batch 8 with a stop token mid-round: the 13th of the first prompt's greedy text
    stop = plain.token_ids[12]
    plain = jaxinfer.generate(looping, PROMPTS[:8], max_new_tokens=20, chat=False,
                              stop=[stop])
    spec = jaxinfer.generate(looping, PROMPTS[:8], max_new_tokens=20, chat=False,
                             stop=[stop], speculative=head, num_speculative_tokens=3)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert [s.finish_reason for s in spec] == [p.finish_reason for p in plain]
    assert spec[0].finish_reason == "stop"
    assert all(0 <= s.accepted_tokens <= s.draft_tokens for s in spec)
    kw = dict(max_new_tokens=16, chat=False, sampling=MIXED, seed=5)
    plain = jaxinfer.generate(looping, PROMPTS, **kw)
    spec = jaxinfer.generate(looping, PROMPTS, speculative=head, num_speculative_tokens=3, **kw)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]


@pytest.fixture(scope="module")
def trained(looping):
    """(peaked, its outputs on PROMPTS, the TrainResult): a head trained on the target's own
    greedy text (looping with a peaked LM head: its argmax is learnable)."""
    peaked = from_params(looping.config, {**looping.params, "embed": looping.params["embed"]
                                          .replace(w=8 * looping.params["embed"].w)},
                         looping.tokenizer, dtype="float32")
    outs = jaxinfer.generate(peaked, PROMPTS, max_new_tokens=48, chat=False)
    data = np.asarray([t for p, o in zip(PROMPTS, outs)
                       for t in peaked.tokenizer.encode(p) + o.token_ids], np.int32)
    return peaked, outs, train_draft.train(peaked, data, 150, lr=3e-3, seq_len=32, batch=8,
                                           progress=False)


def test_trained_head_drafts_and_train_draft_cli(looping, trained, tiny_chat, tiny_chat_dir,
                                                 tmp_path, capsys):
    """A head trained on the target's own greedy text lowers its loss, saves and loads, and
    gets drafts accepted with plain generate's tokens; a head for another model is refused.
    `jaxinfer train-draft` (windows at the texts' starts) writes the head and the loss curve
    beside the model, and `--speculative head` loads it."""
    from jaxinfer import cli

    peaked, outs, result = trained
    assert np.mean(result.losses[-15:]) < 0.5 * result.losses[0]
    # Training again the same way repeats the losses bit for bit and compiles nothing: the
    # target's weights are the step's argument, not constants of a program per call.
    data = np.asarray([t for p, o in zip(PROMPTS, outs)
                       for t in peaked.tokenizer.encode(p) + o.token_ids], np.int32)
    compiles = []

    def count(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        again = train_draft.train(peaked, data, 150, lr=3e-3, seq_len=32, batch=8,
                                  progress=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert not compiles, f"{len(compiles)} programs compiled"
    assert again.losses == result.losses
    path = draft_head.save(result.head, tmp_path / "head.safetensors")
    assert train_draft.plot_losses(result.losses, result.accuracy,
                                   tmp_path / "head.png").stat().st_size > 1000
    head = draft_head.load(path, peaked)
    # A batch of 8 with a stop token (the 13th of row 0's greedy text), as the random head's
    # test_random_head_is_lossless_greedy_and_sampled: its programs, not ones of their own.
    kw = dict(max_new_tokens=24, chat=False, stop=[outs[0].token_ids[12]])
    plain = jaxinfer.generate(peaked, PROMPTS, **kw)
    spec = jaxinfer.generate(peaked, PROMPTS, speculative=head, num_speculative_tokens=3, **kw)
    assert plain[0].finish_reason == "stop"
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert [s.finish_reason for s in spec] == [p.finish_reason for p in plain]
    accepted, drafted = sum(s.accepted_tokens for s in spec), sum(s.draft_tokens for s in spec)
    assert accepted > 0.3 * drafted, (accepted, drafted)  # a random head: ~0
    with pytest.raises(ValueError, match="made for another model"):
        draft_head.load(path, looping)
    with pytest.raises(ValueError, match="made for another model"):
        jaxinfer.generate(looping, "x", max_new_tokens=4, speculative=head)

    text = tmp_path / "data.jsonl"
    text.write_text("\n".join(json.dumps({"text": p + o.text}) for p, o in zip(PROMPTS, outs)))
    assert cli.main(["train-draft", str(tiny_chat_dir), "--data", str(text), "--steps", "10",
                     "--seq-len", "32", "--batch", "4", "--windows", "texts",
                     "--draft-vocab", "300"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (tiny_chat_dir / "eagle_head.png").is_file()
    assert draft_head.load(tiny_chat_dir / "eagle_head.safetensors",
                           tiny_chat).spec.draft_vocab == 300
    base = ["generate", PROMPTS[1], "--no-chat", "-n", "12", "--model", str(tiny_chat_dir),
            "--json"]
    assert cli.main(base) == 0
    want = json.loads(capsys.readouterr().out)
    assert cli.main(base + ["--speculative", "head", "--num-speculative-tokens", "3"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == want["token_ids"] and got["speculative"]["draft_tokens"] > 0
    assert cli.main(base + ["--speculative", "head", "--draft-head", str(path)]) == 2
    assert "made for another model" in capsys.readouterr().err
    assert cli.main(base + ["--speculative", "ngram", "--draft-head", str(path)]) == 2
    assert "--draft-head needs --speculative head" in capsys.readouterr().err


def test_draft_vocabulary_head(trained, tmp_path):
    """A head with a draft vocabulary (the data's 48 most frequent tokens, EAGLE-3's d2t)
    trained on the same text: its logits are -inf past those tokens, it saves and loads with
    its readout and ids, and its drafts are accepted with plain generate's tokens in generate
    and the engine, each round's first draft the training forward's argmax (K = 1)."""
    from test_engine import _engine

    peaked, outs, _ = trained
    data = np.asarray([t for p, o in zip(PROMPTS, outs)
                       for t in peaked.tokenizer.encode(p) + o.token_ids], np.int32)
    result = train_draft.train(peaked, data, 150, lr=3e-3, seq_len=32, batch=8,
                               progress=False, draft_vocab=48)
    d2t = np.asarray(result.head.params["d2t"])
    assert result.head.spec.draft_vocab == 48 and np.all(np.diff(d2t) > 0)
    assert set(np.unique(data, return_counts=True)[0][
        np.argsort(-np.unique(data, return_counts=True)[1], kind="stable")[:10]]) <= set(d2t)
    assert np.mean(result.losses[-15:]) < 0.5 * result.losses[0]
    head = draft_head.load(draft_head.save(result.head, tmp_path / "h.safetensors"), peaked)
    assert head.spec.draft_vocab == 48 and np.array_equal(np.asarray(head.params["d2t"]), d2t)
    prompts = [peaked.tokenizer.encode(p) for p in PROMPTS[:4]]
    plain = jaxinfer.generate(peaked, prompts, max_new_tokens=24)
    want = _first_draft_hits(peaked, head, prompts, [c.token_ids for c in plain])
    assert sum(want) > 10, want
    head = dataclasses.replace(head, adaptive=False)
    spec = jaxinfer.generate(peaked, prompts, max_new_tokens=24, speculative=head,
                             num_speculative_tokens=1)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert [c.accepted_tokens for c in spec] == want
    engine = _engine(peaked, speculative=head, num_speculative_tokens=1, chunk_size=16)
    got = engine.run(prompts, max_tokens=24)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
    assert [c.accepted_tokens for c in got] == want
    # jitted: one program (eagerly each op compiled alone); the inputs numpy, not device ops
    t = len(prompts[0])
    logits, _, _ = jax.jit(draft_head.forward, static_argnames="spec")(
        head.params, peaked.params, np.asarray([prompts[0]], np.int32),
        np.zeros((1, t, 64), np.float32), np.arange(t, dtype=np.int32)[None], head.spec)
    outside = np.setdiff1d(np.arange(peaked.config.vocab_size), d2t)
    assert np.all(np.isneginf(np.asarray(logits)[..., outside]))
    assert np.all(np.isfinite(np.asarray(logits)[..., d2t]))


# The teacher-forced passes below take their sequences padded to this length, in one batch:
# one target and one head program for all of them (one per sequence length took 20 compiles).
TEACHER_LEN = 128
# jitted, as training runs it (one program per shape instead of each op compiled alone)
_teacher_forced = jax.jit(train_draft.teacher_forced, static_argnames="spec")


def _teacher_drafts(model, head, seqs: list[list[int]]) -> list[np.ndarray]:
    """For each sequence, the argmax of the training forward's logits
    (train_draft.teacher_forced) at each of its positions: [T], the draft of token i + 1.
    Both forwards are causal, so the zero padding after a sequence leaves its logits those
    of the sequence alone."""
    from jaxinfer.generate import run_params

    assert max(map(len, seqs)) <= TEACHER_LEN
    params = run_params(model, model.plan)
    tokens = np.zeros((len(seqs), TEACHER_LEN), np.int32)
    for i, seq in enumerate(seqs):
        tokens[i, :len(seq)] = seq
    tokens = jnp.asarray(tokens)
    f, _ = train_draft.target_features(params, tokens, model.plan)
    logits, _ = _teacher_forced(head.params, params, tokens, f, spec=head.spec)
    draft = np.asarray(logits).argmax(-1)
    return [draft[i, :len(seq)] for i, seq in enumerate(seqs)]


def _first_draft_hits(model, head, prompts: list[list[int]],
                      outs: list[list[int]]) -> list[int]:
    """Per prompt, the drafts a greedy K = 1 loop must get accepted on its out (the prompt's
    greedy output), if each draft is the argmax of the training forward's logits
    (train_draft.teacher_forced) at the newest token's position: a round at p with draft
    argmax_p == out's token at p + 1 emits two tokens, otherwise one (the budget cuts the
    last round)."""
    hits_per_prompt = []
    for prompt, out, draft in zip(prompts, outs, _teacher_drafts(
            model, head, [p + o for p, o in zip(prompts, outs)])):
        seq = prompt + out
        p, count, hits = len(prompt), 1, 0
        while count < len(out):
            hit = draft[p] == seq[p + 1]
            hits += int(hit)
            step = min(1 + int(hit), len(out) - count)
            p, count = p + step, count + step
        hits_per_prompt.append(hits)
    return hits_per_prompt


def test_drafting_is_the_training_forward_in_generate_and_the_engine(trained):
    """The first draft of every round, in generate's loop and the engine's, is the argmax of
    the logits training fits at that position (the pair (t_p, f_{p-1})): with K = 1 the
    accepted drafts are exactly those the teacher-forced forward predicts, request by request
    (a shifted pair, a stale feature or a head cache filled from the wrong pairs would change
    them); with K = 3 the engine accepts what generate accepts."""
    from test_engine import _engine

    peaked, _, result = trained
    head = result.head
    prompts = [peaked.tokenizer.encode(p) for p in PROMPTS[:4]]
    plain = jaxinfer.generate(peaked, prompts, max_new_tokens=24)
    want = _first_draft_hits(peaked, head, prompts, [c.token_ids for c in plain])
    assert sum(want) > 10, want  # a trained head: most first drafts hit
    # every round a verification, as the engine's (no fallback to plain steps: MIN_GAIN)
    head = dataclasses.replace(head, adaptive=False)
    spec = jaxinfer.generate(peaked, prompts, max_new_tokens=24, speculative=head,
                             num_speculative_tokens=1)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert [c.accepted_tokens for c in spec] == want
    for k in (1, 3):
        engine = _engine(peaked, speculative=head, num_speculative_tokens=k, chunk_size=16)
        got = engine.run(prompts, max_tokens=24)
        assert [c.token_ids for c in got] == [c.token_ids for c in plain]
        if k == 1:
            assert [c.accepted_tokens for c in got] == want
        else:
            spec = jaxinfer.generate(peaked, prompts, max_new_tokens=24, speculative=head,
                                     num_speculative_tokens=3)
            assert [c.accepted_tokens for c in got] == [c.accepted_tokens for c in spec]
            assert sum(c.accepted_tokens for c in got) > 0.3 * sum(c.draft_tokens for c in got)
        assert engine.free_pages == engine.total_pages


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_plain_rounds_skip_the_head_and_its_probes_catch_up(trained, ignore_eos):
    """Plain rounds (the gain under min_gain) run no head forward; a probe's or a
    verification's first head forward writes every pair since the head's last one, so its
    draft is the training forward's at that position, as if the head had run every round (a
    hole or a shifted feature in the head's cache would change the trained head's drafts,
    and with them the rounds). The batch's rounds follow the schedule: verifications from
    the start gain while drafts hit, plain rounds below min_gain, probes (plain rounds
    checking one draft) after 8, 16, 32 plain rounds, a probe's hit bringing verifications
    back. Without stop ids the plain rounds run in blocks of steps_per_sync_no_stop (8, 5
    here: blocks that do not divide the probes' waits) with the same rounds."""
    from jaxinfer import speculative

    peaked, _, result = trained
    prompts = [peaked.tokenizer.encode(p) for p in PROMPTS[:4]]
    policy = KernelPolicy(steps_per_sync_no_stop=5)
    # a miss from the start gain (1) falls under min_gain, a probe's hit mostly lifts it back
    head = dataclasses.replace(result.head, min_gain=0.55)
    plain = jaxinfer.generate(peaked, prompts, max_new_tokens=40, ignore_eos=ignore_eos)
    spec = [jaxinfer.generate(peaked, [q], max_new_tokens=40, num_speculative_tokens=1,
                              speculative=head, ignore_eos=ignore_eos, policy=policy)[0]
            for q in prompts]  # batch 1: a row's rounds its own (a batch verifies for any row)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    # speculative._spec_round's schedule at K = 1, from the teacher's drafts
    seqs = [q + c.token_ids for q, c in zip(prompts, plain)]
    want, plains, probe_hits = [], 0, 0
    for q, c, seq, draft in zip(prompts, plain, seqs, _teacher_drafts(peaked, result.head,
                                                                        seqs)):
        p, count, n, gain = len(q), 1, len(c.token_ids), speculative.start_gain(head, 1)
        drafted = accepted = idle = 0
        patience = speculative.PROBE
        while count < n:
            hit = int(draft[p] == seq[p + 1])
            if gain >= head.min_gain:  # a verification
                step = min(1 + hit, n - count)
                drafted, accepted, gain = drafted + 1, accepted + min(hit, step), (gain + hit) / 2
                idle, patience = 0, speculative.PROBE
            elif idle >= patience:  # a probe: a plain round checking its draft
                step, drafted, gain, probe_hits = 1, drafted + 1, (gain + hit) / 2, probe_hits + hit
                idle, patience = 0, min(2 * patience, speculative.MAX_PROBE)
            else:
                step, idle, plains = 1, idle + 1, plains + 1
            p, count = p + step, count + step
        want.append((accepted, drafted, drafted))
    assert [(c.accepted_tokens, c.draft_tokens, c.verifications) for c in spec] == want
    # drafts were accepted, rounds fell back to plain ones, and probes brought them back
    assert sum(a for a, _, _ in want) >= 3 and plains >= 8 and probe_hits >= 1
    if not ignore_eos:  # the engine's rounds alike (its probes: a head's plain step's draft)
        from test_engine import _engine

        engine = _engine(peaked, speculative=head, num_speculative_tokens=1, chunk_size=16)
        got = [engine.run([q], max_tokens=40)[0] for q in prompts]
        assert [c.token_ids for c in got] == [c.token_ids for c in plain]
        assert [(c.accepted_tokens, c.draft_tokens) for c in got] == [w[:2] for w in want]


def test_engine_with_a_head_equals_generate(looping):
    """The engine drafting with a (random) EAGLE head: requests arriving at random steps,
    shared prefixes (prefix-cache hits carry the head's pages), chunked prompts, a pool small
    enough to preempt, greedy and seeded sampled rows with logprobs: each request's tokens are
    generate()'s, and every page comes back (an aborted request's too). Bad arguments are
    refused before any compile."""
    from test_engine import _engine, _prime, _reference, _requests, _serve

    reqs = _requests(looping, 16, seed=6)
    want = _reference(looping, reqs, batch=16)
    head = draft_head.init_eagle(looping, 2)
    engine = _engine(looping, pages=60, max_num_seqs=8, speculative=head,
                     num_speculative_tokens=3)
    _prime(engine, reqs)  # every request's sampling flags from the start: each shape once
    got, reasons = _serve(engine, reqs, np.random.default_rng(1))
    assert engine.stats["draft_tokens"] > 0 and engine.prefix_cache_hit_rate() > 0
    assert engine.stats["plain_rounds"] > 0  # a random head's drafts: plain steps (MIN_GAIN)
    assert engine.stats["preemptions"] > 0
    assert engine.free_pages == engine.total_pages and not engine.requests
    for i, (toks, lps, reason) in enumerate(want):
        assert (got[i][0], reasons[i]) == (toks, reason), i
        if reqs[i][1].logprobs:
            np.testing.assert_allclose(got[i][1], lps, atol=1e-4)
    rid = engine.add_request(reqs[0][0], max_tokens=40)  # aborted mid-decode
    while not engine.requests[rid].output:
        engine.step()
    engine.abort(rid)
    assert engine.free_pages == engine.total_pages
    # Alone, its rounds are generate's: 2 verifications while the gain decays, then probes
    # of one draft after 8, 16 and 32 plain rounds (this head misses all three). 64 tokens:
    # generate's program is test_random_head_is_lossless_greedy_and_sampled's batch 1.
    (want,) = jaxinfer.generate(looping, ["x"], max_new_tokens=64, chat=False,
                                speculative=head, num_speculative_tokens=3)
    (got,) = engine.run(["x"], max_tokens=64, chat=False)
    assert got.token_ids == want.token_ids
    assert (got.draft_tokens, got.accepted_tokens) == (want.draft_tokens, 0) == (2 * 3 + 3, 0)
    with pytest.raises(ValueError, match="made for another model"):
        _engine(looping, speculative=draft_head.init_eagle(
            from_params(looping.config, init_params(llama.param_specs(looping.config),
                                                    jax.random.key(9), jnp.float32),
                        looping.tokenizer, dtype="float32")))
    with pytest.raises(ValueError, match="not loaded from one"):
        _engine(looping, speculative="head")
    with pytest.raises(ValueError, match="needs a DeepSeek-V3 checkpoint"):
        _engine(looping, speculative="mtp")


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory) -> pathlib.Path:
    """The DeepSeek-V3 fixture with an MTP module as layer 3 (as V3 checkpoints store it):
    its block a copy of layer 2 (an MoE layer), random enorm / hnorm / eh_proj /
    shared_head."""
    d = tmp_path_factory.mktemp("mtp") / "deepseek_v3_mtp"
    shutil.copytree(HF / "deepseek_v3", d)
    tensors = load_file(d / "model.safetensors")
    rng = np.random.default_rng(0)
    v, dim = tensors["model.embed_tokens.weight"].shape
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v for k, v in tensors.items()
           if k.startswith("model.layers.2.")}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.3.{name}.weight"] = (1 + 0.3 * rng.standard_normal(dim)).astype(
            np.float32)
    mtp["model.layers.3.eh_proj.weight"] = (rng.standard_normal((dim, 2 * dim))
                                            / np.sqrt(2 * dim)).astype(np.float32)
    mtp["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"]
    mtp["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    save_file({**tensors, **mtp}, d / "model.safetensors")
    return d


@pytest.fixture(scope="module")
def mtp_model(with_mtp):
    """`with_mtp` loaded (float32), for both MTP tests: a model is read-only, so one load
    (its tensors staged, each shape's eager ops compiled) serves both."""
    return jaxinfer.load(str(with_mtp), dtype="float32")


def _rms(x, w, eps):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def test_mtp_matches_its_definition_and_is_lossless(with_mtp, mtp_model, tiny_chat):
    """The MTP module read from the checkpoint, run incrementally on its cache (a prefill,
    then a token at a time), gives the logits of its published definition written out here
    from the raw tensors: shared_head(norm(block(eh_proj([enorm(emb t_i), hnorm(f_{i-1})]))));
    greedy mtp-speculative equals plain greedy (a batch of 3); a checkpoint without MTP
    weights, and a Llama model, are refused before anything compiles."""
    d, model = with_mtp, mtp_model
    head = draft_head.load_mtp(model)
    raw = load_file(d / "model.safetensors")
    eps = model.config.rms_norm_eps
    ref = np.load(d / "ref.npz")
    # tokens, positions, features and their slices in numpy (eagerly each slice, zeros_like
    # and concatenate compiled a program of its own); the jitted forwards take them as they are
    tokens = np.asarray(ref["input_ids"][:1, :12], np.int32)  # [1, T]
    t = tokens.shape[1]
    positions = np.arange(t, dtype=np.int32)[None]
    # Each forward below jitted: one program each (run eagerly, each of the MoE layers' ops
    # compiled alone took most of this test's time); the same computations.
    fwd = jax.jit(registry.family(model.config).forward, static_argnames=("plan", "hidden"))
    logits, _, f = fwd(model.params, tokens, positions, model.plan, hidden=True)
    np.testing.assert_allclose(logits, model(tokens), rtol=1e-5, atol=1e-5)
    f = np.asarray(f)
    before = np.concatenate([np.zeros_like(f[:, :1]), f[:, :-1]], axis=1)  # f_{i-1}

    @jax.jit
    def definition(before):
        """Plain jnp on the checkpoint's tensors; the block is the target's own layer 2 (the
        module's block is a copy of it) through the family's layer code."""
        emb = jnp.asarray(raw["model.embed_tokens.weight"])[tokens]
        x = jnp.concatenate([_rms(emb, raw["model.layers.3.enorm.weight"], eps),
                             _rms(before, raw["model.layers.3.hnorm.weight"], eps)], -1)
        x = x @ jnp.asarray(raw["model.layers.3.eh_proj.weight"]).T
        block = {"embed": model.params["embed"], "layers": [model.params["layers"][2]],
                 "final_norm": jnp.ones(x.shape[-1]), "lm_head": model.params["lm_head"]}
        _, _, normed = fwd(block, tokens, positions, head.spec.plan, embeds=x, hidden=True)
        return (normed * raw["model.layers.3.shared_head.norm.weight"]) \
            @ jnp.asarray(raw["model.layers.3.shared_head.head.weight"]).T  # [1, T, V]

    want = definition(before)
    head_forward = jax.jit(draft_head.forward, static_argnames=("spec", "fresh"))
    cache = KVCache.init(head.spec.plan.config, 1, 16)
    got, cache, _ = head_forward(head.params, model.params, tokens[:, :6], before[:, :6],
                                 positions[:, :6], head.spec, cache, fresh=True)
    steps = [got]
    for i in range(6, t):
        got, cache, _ = head_forward(head.params, model.params, tokens[:, i:i + 1],
                                     before[:, i:i + 1], positions[:, i:i + 1], head.spec,
                                     cache)
        steps.append(got)
    np.testing.assert_allclose(np.concatenate([np.asarray(x) for x in steps], 1), want,
                               rtol=1e-4, atol=1e-4)

    prompts = [list(map(int, p)) for p in ref["greedy_prompt"]]
    # One batch of 3 rows (the two prompts, then the first again; it was also run alone as a
    # batch of 1, which compiled the MoE model's prefill, decode and speculative programs a
    # second time): each row's tokens are plain greedy's.
    batch = (prompts * 3)[:3]
    plain = jaxinfer.generate(model, batch, max_new_tokens=16)
    spec = jaxinfer.generate(model, batch, max_new_tokens=16, speculative="mtp",
                             num_speculative_tokens=2)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert all(s.draft_tokens > 0 for s in spec)

    plain_v3 = jaxinfer.load(str(HF / "deepseek_v3"), dtype="float32")
    with pytest.raises(ValueError, match="has no MTP weights"):
        jaxinfer.generate(plain_v3, prompts[0], max_new_tokens=4, speculative="mtp")
    with pytest.raises(ValueError, match="needs a DeepSeek-V3 checkpoint with MTP weights"):
        jaxinfer.generate(tiny_chat, "x", max_new_tokens=4, speculative="mtp")


def test_engine_with_mtp_equals_generate(mtp_model):
    """DeepSeek-V3's MTP module drafting in the engine (its MLA layer's latent in pages at the
    target's page indices): requests arriving at random steps, sharing prefixes, chunked, in
    a pool small enough to preempt, greedy and seeded sampled rows: each request's tokens are
    generate()'s, drafts are accepted, and every page comes back."""
    from test_engine import _engine, _serve

    model = mtp_model
    rng = np.random.default_rng(2)
    shared = rng.integers(3, 256, 24).tolist()
    reqs = []
    for i in range(8):
        prompt = rng.integers(3, 256, int(rng.integers(1, 30))).tolist()
        if i % 3 == 0:
            prompt = shared[:int(rng.integers(8, 25))] + prompt
        sp = SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=0.9,
                                                                          seed=1000 + i)
        reqs.append((prompt, sp, int(rng.integers(4, 13))))
    engine = _engine(model, pages=24, max_model_len=64, chunk_size=16, speculative="mtp",
                     num_speculative_tokens=2)
    got, _ = _serve(engine, reqs, np.random.default_rng(1))
    assert engine.stats["accepted_tokens"] > 0 and engine.stats["preemptions"] > 0
    assert engine.free_pages == engine.total_pages and not engine.requests
    want = jaxinfer.generate(model, [p for p, _, _ in reqs], max_new_tokens=12,
                             sampling=[sp for _, sp, _ in reqs])
    for i, ((_, _, n), ref) in enumerate(zip(reqs, want)):
        assert got[i][0] == ref.token_ids[:n], i
