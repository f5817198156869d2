"""The serving engine against `generate` alone, token for token (CPU, float32, tiny model)."""

import dataclasses
import pathlib
import re

import numpy as np
import pytest

import jaxinfer
from jaxinfer import SamplingParams
from jaxinfer.sampling import SamplingTensors
import jaxinfer.memory


def _engine(model, **kw):
    """A small engine: pages of 8 tokens, chunks of 16, a pool of `pages` pages, one batch
    size (max_num_seqs rows; prefill max_prefill_rows): half the programs to compile of the
    default sizes, which the warmup tests keep (row_buckets=None)."""
    pages = kw.pop("pages", 64)
    page_bytes = jaxinfer.memory.kv_bytes_per_token(model.config) * 8
    args = dict(max_num_seqs=4, page_size=8, chunk_size=16, max_num_batched_tokens=64,
                max_model_len=160, kv_memory=pages * page_bytes)
    args.update(kw)
    args.setdefault("row_buckets", (args["max_num_seqs"],))
    return jaxinfer.Engine(model, **args)


def _requests(model, n, seed):
    """n random requests: prompts of 1-80 tokens, a third sharing a 40-token prefix (some whole
    pages of it), greedy and sampled (own seeds), logprobs on some, 1-16 new tokens."""
    rng = np.random.default_rng(seed)
    v = model.config.vocab_size
    shared = rng.integers(3, v, 40).tolist()
    out = []
    for i in range(n):
        prompt = rng.integers(3, v, int(rng.integers(1, 80))).tolist()
        if i % 3 == 0:
            prompt = shared[:int(rng.integers(8, 41))] + prompt
        if i % 2:
            sp = SamplingParams(temperature=0.0, logprobs=i % 4 == 1)
        else:
            sp = SamplingParams(temperature=0.9, top_k=int(rng.choice([0, 20])), seed=1000 + i,
                                logprobs=i % 4 == 0)
        out.append((prompt, sp, int(rng.integers(1, 17))))
    return out


def _reference(model, reqs, batch: int = 1):
    """generate() for each request: alone (batch 1), or in batches of `batch` requests with
    the largest budget, each row cut to its own (generate's rows do not depend on their batch:
    test_generate.py), which is `batch` times fewer calls."""
    out = []
    for i in range(0, len(reqs), batch):
        group = reqs[i:i + batch]
        n = max(k for _, _, k in group)
        got = jaxinfer.generate(model, [p for p, _, _ in group], max_new_tokens=n,
                                sampling=[sp for _, sp, _ in group])
        for (_, sp, k), c in zip(group, got):
            toks, lps = c.token_ids[:k], (c.logprobs or [])[:k]
            reason = "stop" if toks[-1] in model.config.eos_token_ids else "length"
            out.append((toks, lps, reason))
    return out


def _prime(engine, reqs):
    """Serve one 1-token request of each sampling kind of reqs first, in one dispatch: the
    engine's sampling flags (the stages its programs run; they only grow) are then every
    request's from the start, so each dispatch shape compiles once instead of again as each
    new kind of request arrives. (The flags' growth while serving: the other tests.)"""
    kinds, flags = [], None
    for _, sp, _ in reqs:
        f = SamplingTensors.from_params([sp]).flags
        if flags is None or flags.union(f) != flags:
            kinds.append(sp)
            flags = f if flags is None else flags.union(f)
    assert len(kinds) <= engine.max_prefill_rows  # one dispatch
    engine.run([[5]] * len(kinds), sampling=kinds, max_tokens=1)


def _serve(engine, reqs, rng):
    """Requests added a few at a time between steps, in rng's order -> ({i: (tokens,
    logprobs)}, {i: finish_reason})."""
    order = list(rng.permutation(len(reqs)))
    ids, got, reasons = {}, {}, {}
    while order or engine.has_unfinished():
        for i in order[:int(rng.integers(0, 6))]:
            p, sp, n = reqs[i]
            ids[engine.add_request(p, sampling=sp, max_tokens=n)] = i
        added = set(ids.values())
        order = [i for i in order if i not in added]
        for out in engine.step():
            toks, lps = got.setdefault(ids[out.request_id], ([], []))
            toks += out.new_token_ids
            lps += out.new_logprobs or []
            if out.finished:
                reasons[ids[out.request_id]] = out.finish_reason
    return got, reasons


def test_engine_equals_generate(tiny_chat):
    """200 requests arriving at random steps, with shared prefixes, prompts split into chunks
    and preemption forced by a small pool: each request's tokens (and logprobs) are
    generate()'s for it, and every page is back at the end."""
    model = tiny_chat
    reqs = _requests(model, 200, seed=0)
    engine = _engine(model, pages=40, max_num_seqs=8)
    _prime(engine, reqs)
    got, reasons = _serve(engine, reqs, np.random.default_rng(1))
    assert engine.stats["preemptions"] > 0  # the pool was really too small
    assert engine.prefix_cache_hit_rate() > 0.05
    assert engine.free_pages == engine.total_pages and not engine.requests
    for i, (toks, lps, reason) in enumerate(_reference(model, reqs, batch=25)):
        assert got[i][0] == toks, i
        assert reasons[i] == reason, i
        if reqs[i][1].logprobs:
            np.testing.assert_allclose(got[i][1], lps, atol=1e-4)


def test_engine_with_two_decode_steps_and_pages_of_2_equals_generate(tiny_chat):
    """The same on fewer requests, with two decode steps dispatched per engine step, and
    pages of 2 tokens: rows past 64 tokens cross from block tables of 32 pages (the
    narrowest) to 64. generate() takes the 10 requests in one batch (its rows do not depend
    on their batch: test_generate.py); each alone compiled up to 10 prefill and decode
    programs (4 prompt lengths x the sampling kinds) for the same tokens."""
    model = tiny_chat
    reqs = _requests(model, 10, seed=2)
    assert max(len(p) + n for p, _, n in reqs) > 64
    engine = _engine(model, pages=24, decode_steps=2, page_size=2)
    got, reasons = _serve(engine, reqs, np.random.default_rng(3))
    for i, (toks, lps, reason) in enumerate(_reference(model, reqs, batch=len(reqs))):
        assert (got[i][0], reasons[i]) == (toks, reason), i


def test_prefix_cache_prefills_only_the_suffix(tiny_chat):
    """A second request with the first one's prompt as its prefix computes only its own
    tokens past the shared whole pages, and gets generate()'s tokens."""
    engine = _engine(tiny_chat)
    first = list(range(3, 60))
    second = first + [7, 8, 9]
    engine.run([first], max_tokens=4)
    before = engine.stats["prompt_tokens"]
    (out,) = engine.run([second], max_tokens=4)
    assert engine.stats["prompt_tokens"] - before == len(second) - 56  # 7 pages of 8 shared
    assert out.token_ids == jaxinfer.generate(tiny_chat, [second], max_new_tokens=4)[0].token_ids


def test_bad_requests_are_refused_alone(tiny_chat):
    """Each bad request raises ValueError naming the problem; the engine keeps serving the
    others, loses none of their tokens and leaks no page."""
    engine = _engine(tiny_chat)
    good = engine.add_request([5, 6, 7], max_tokens=6)
    engine.step()
    bad = [
        (dict(prompt=list(range(3, 200))), "max_model_len"),
        (dict(prompt=[5], max_tokens=0), "max_tokens"),
        (dict(prompt=[5], max_tokens=1.5), "max_tokens"),
        (dict(prompt=[]), "empty"),
        (dict(prompt=[10**9]), "vocabulary"),
        (dict(prompt=[5], sampling="greedy"), "SamplingParams"),
        (dict(prompt=[5], request_id=good), "already"),
        (dict(prompt=[5], stop=[""]), "stop"),
        (dict(prompt=[5], seed=-1), "seed"),
        (dict(prompt=[5], grammar='{"type": "object"}'), "Grammar"),
    ]
    for kw, words in bad:
        with pytest.raises(ValueError, match=words):
            engine.add_request(kw.pop("prompt"), **kw)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="no request"):
        engine.abort("nobody")
    got = []
    while engine.has_unfinished():
        got += [t for out in engine.step() for t in out.new_token_ids]
    assert got == jaxinfer.generate(tiny_chat, [[5, 6, 7]], max_new_tokens=6)[0].token_ids
    assert engine.free_pages == engine.total_pages


def test_abort_frees_pages_at_once(tiny_chat):
    engine = _engine(tiny_chat)
    keep = engine.add_request(list(range(3, 40)), max_tokens=30)
    gone = engine.add_request(list(range(3, 50)), max_tokens=30)
    for _ in range(3):
        engine.step()
    held = engine.total_pages - engine.free_pages
    engine.abort(gone)
    assert engine.total_pages - engine.free_pages < held
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert {o.request_id for o in outs} == {keep}
    assert engine.free_pages == engine.total_pages


def test_penalties_stop_strings_and_text_prompts(tiny_chat):
    """Per-request penalties (their statistics live in the engine's slots), logit_bias (rows
    without one beside rows with one or two entries), stop strings and chat-templated text
    give generate()'s output."""
    sp = [SamplingParams(temperature=0.0, repetition_penalty=1.3),
          SamplingParams(temperature=0.7, presence_penalty=1.0, frequency_penalty=0.5, seed=4,
                         logit_bias={40: 5.0}),
          SamplingParams(temperature=0.0, logit_bias={9: 6.0, 12: -100})]
    prompts = ["Hi there", "Name three painters.", [5, 6, 7, 5, 6]]
    engine = _engine(tiny_chat)
    outs = engine.run(prompts, sampling=sp, max_tokens=12, stop=["e"])
    # one batch: generate's rows do not depend on their batch (test_generate.py), and a row
    # without logit_bias beside one with two entries takes padding that adds 0.0 to token 0
    ref = jaxinfer.generate(tiny_chat, prompts, max_new_tokens=12, sampling=sp, stop=["e"])
    for a, b in zip(outs, ref):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    # ignore_eos: EOS (made the greedy pick by a bias) does not end the row, in the engine,
    # generate and speculative generate alike
    eos = tiny_chat.config.eos_token_ids[0]
    sp = SamplingParams(temperature=0.0, logit_bias={eos: 8.0})
    (out,) = engine.run([[5, 6, 7]], sampling=sp, max_tokens=12, ignore_eos=True)
    for ref in (jaxinfer.generate(tiny_chat, [[5, 6, 7]], max_new_tokens=12, sampling=sp,
                                  ignore_eos=ignore, **spec)[0]
                for ignore, spec in ((True, {}), (True, {"speculative": "ngram"}),
                                     (False, {}))):
        if ref.finish_reason == "stop":  # without ignore_eos: the row's first EOS ends it
            assert ref.token_ids == out.token_ids[:out.token_ids.index(eos) + 1]
            continue
        assert (out.token_ids, out.finish_reason) == (ref.token_ids, "length")
    assert out.token_ids.count(eos) > 1


def test_deterministic_engine_rows_are_bitwise_those_alone_and_generates(tiny_chat):
    """KernelPolicy.deterministic() (bf16, the Pallas kernels in interpret mode): requests
    served together, arriving at different steps, chunked and sharing prefixes, give the bits
    (tokens and logprobs) each gets served alone from an empty prefix cache, and those of
    generate() (its contiguous cache read as pages of 64 by the same kernel; one batch of all
    six, itself batch-invariant)."""
    from jaxinfer.model import from_params
    from jaxinfer.plan import KernelPolicy

    model = from_params(tiny_chat.config, tiny_chat.params, tiny_chat.tokenizer,
                        dtype="bfloat16")
    policy = KernelPolicy.deterministic(interpret=True)
    reqs = [(p, SamplingParams(temperature=sp.temperature, top_p=0.9, seed=i, logprobs=True), 6)
            for i, (p, sp, _) in enumerate(_requests(model, 6, seed=4))]
    page_bytes = jaxinfer.memory.kv_bytes_per_token(model.config) * 64
    engine = _engine(model, max_num_seqs=8, page_size=64, kv_memory=12 * page_bytes,
                     policy=policy)
    got, _ = _serve(engine, reqs, np.random.default_rng(5))
    gen = jaxinfer.generate(model, [p for p, _, _ in reqs], max_new_tokens=6,
                            sampling=[sp for _, sp, _ in reqs], policy=policy)
    for i, (p, sp, n) in enumerate(reqs):
        engine.reset_prefix_cache()
        (alone,) = engine.run([p], sampling=sp, max_tokens=n)
        assert (got[i][0], got[i][1]) == (alone.token_ids, alone.logprobs), i
        assert (got[i][0], got[i][1]) == (gen[i].token_ids, gen[i].logprobs), i


def test_int8_page_pool_equals_generate_with_an_int8_cache(tiny_chat):
    reqs = _requests(tiny_chat, 4, seed=6)
    engine = _engine(tiny_chat, kv_cache_dtype="int8")
    outs = engine.run([p for p, _, _ in reqs], sampling=[sp for _, sp, _ in reqs], max_tokens=8)
    # one batch: generate's rows do not depend on their batch (an int8 cache's codes and
    # scales are per token and head)
    ref = jaxinfer.generate(tiny_chat, [p for p, _, _ in reqs], max_new_tokens=8,
                            sampling=[sp for _, sp, _ in reqs], kv_cache_dtype="int8")
    for out, r in zip(outs, ref):
        assert out.token_ids == r.token_ids


HF = pathlib.Path(__file__).parent / "fixtures" / "data" / "hf"


@pytest.mark.parametrize("name, kv", [("deepseek_v3", None), ("deepseek_v2", "int8")])
def test_mla_engine_equals_generate(name, kv):
    """DeepSeek models page their latent (cache.PagedLatentCache): requests arriving at
    random steps, sharing prefixes, chunked, in a pool small enough to preempt, get
    generate()'s tokens (V3: q_lora, MoE, interleaved RoPE; V2 with an int8 latent pool
    against generate's int8 latent cache), and every page comes back."""
    model = jaxinfer.load(str(HF / name), dtype="float32")
    ctx = 64  # the V3 fixture's context
    rng = np.random.default_rng(0)
    shared = rng.integers(3, model.config.vocab_size, 24).tolist()
    reqs = []
    for i in range(10):
        prompt = rng.integers(3, model.config.vocab_size, int(rng.integers(1, 30))).tolist()
        if i % 3 == 0:
            prompt = shared[:int(rng.integers(8, 25))] + prompt
        sp = SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=0.9,
                                                                          seed=1000 + i)
        reqs.append((prompt, sp, int(rng.integers(1, min(13, ctx - len(prompt))))))
    pool = 10 * 8 * jaxinfer.memory.kv_bytes_per_token(model.config, kv)  # 10 pages of 8
    engine = _engine(model, kv_memory=pool, max_model_len=ctx, chunk_size=16,
                     kv_cache_dtype=kv)
    got, reasons = _serve(engine, reqs, np.random.default_rng(1))
    assert engine.stats["preemptions"] > 0 and engine.prefix_cache_hit_rate() > 0
    assert engine.free_pages == engine.total_pages and not engine.requests
    # generate's prompts in chunks: they attend to the cache's codes, as the engine's do (one
    # shot, a prompt attends to its float latents)
    policy = dataclasses.replace(model.plan.policy, prefill_chunk=16)
    want = jaxinfer.generate(model, [p for p, _, _ in reqs], max_new_tokens=12,
                             sampling=[sp for _, sp, _ in reqs], kv_cache_dtype=kv,
                             policy=policy)
    for i, ((_, _, n), ref) in enumerate(zip(reqs, want)):
        assert got[i][0] == ref.token_ids[:n], i


def test_stream_and_chat_turns_reuse_the_cache(tiny_chat):
    """Engine.stream gives jaxinfer.stream's pieces; the next chat turn (the conversation so
    far + a new message) prefills only what its cached pages do not hold; closing a stream
    early aborts its request."""
    engine = _engine(tiny_chat)
    turn = [{"role": "user", "content": "Name three famous painters and one painting."}]
    s = engine.stream(turn, max_tokens=12, stop=["e"])
    pieces = list(s)
    ref = jaxinfer.stream(tiny_chat, turn, max_new_tokens=12, stop=["e"])
    assert pieces == list(ref) and s.completion.text == ref.completion.text
    assert s.completion.token_ids == ref.completion.token_ids
    before = engine.stats["prompt_tokens"]
    turn = turn + [{"role": "assistant", "content": s.completion.text},
                   {"role": "user", "content": "And three sculptors?"}]
    s2 = engine.stream(turn, max_tokens=6)
    assert "".join(s2) == "".join(jaxinfer.stream(tiny_chat, turn, max_new_tokens=6))
    full = len(tiny_chat.tokenizer.apply_chat_template(turn))
    assert engine.stats["prompt_tokens"] - before < full - 16  # whole pages came from the cache
    s3 = engine.stream("Hello there", max_tokens=40)
    next(s3)
    s3.close()
    assert not engine.requests
    while engine.has_unfinished():
        engine.step()
    assert engine.free_pages == engine.total_pages


def test_warmup_compiles_every_shape_serving_needs(tiny_chat):
    """After warmup() serving compiles nothing new, and its tokens are still generate()'s;
    penalties included (warmup allocates their statistics on an idle engine)."""
    from jaxinfer.engine import step

    model = tiny_chat
    greedy = SamplingParams(temperature=0.0)
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    # the default batch sizes; chunks of 16: one length
    engine = _engine(model, max_model_len=64, chunk_size=16, row_buckets=None)
    # prefill rows 1/2/4 x chunks of 16, decode rows 1/2/4
    assert engine.warmup([greedy, penalized]) == 6
    assert engine.free_pages == engine.total_pages  # padding rows took no page
    compiled = step.prefill_step._cache_size() + step.decode_step._cache_size()
    reqs = [(p, penalized if i % 2 else greedy, n)
            for i, (p, _, n) in enumerate(_requests(model, 6, seed=4)) if len(p) + n <= 64]
    assert penalized in [sp for _, sp, _ in reqs] and greedy in [sp for _, sp, _ in reqs]
    got, _ = _serve(engine, reqs, np.random.default_rng(5))
    assert step.prefill_step._cache_size() + step.decode_step._cache_size() == compiled
    for i, (toks, _, _) in enumerate(_reference(model, reqs, batch=len(reqs))):
        assert got[i][0] == toks, i
    with pytest.raises(ValueError, match="idle engine"):
        engine.add_request([5, 6, 7], max_tokens=2)
        engine.warmup()


def test_warmup_structured_compiles_the_masked_programs(tiny_chat):
    """warmup(structured=True) also compiles the token-bitmask programs: a grammar request
    beside a free one then compiles nothing new."""
    from jaxinfer.engine import step
    from jaxinfer.structured import Grammar

    # Batch sizes of 2 and max_num_seqs (4): prefill rows 2/4 x chunks of 16, decode rows 2/4
    engine = _engine(tiny_chat, max_model_len=64, chunk_size=16, row_buckets=[2])
    assert engine.warmup(structured=True) == 8  # each of the 4 shapes with and without
    for bad, match in (((8,), "over max_num_seqs 4"), ((), "non-empty"), ((0,), ">= 1"),
                       (2, "sequence")):
        with pytest.raises(ValueError, match=match):
            _engine(tiny_chat, row_buckets=bad)
    compiled = step.prefill_step._cache_size() + step.decode_step._cache_size()
    engine.add_request([5, 6, 7], max_tokens=8,
                       grammar=Grammar.regex(tiny_chat.tokenizer, "(yes|no), [0-9]{2,4}"))
    engine.add_request([8, 9, 10, 11], max_tokens=6)
    while engine.has_unfinished():
        engine.step()
    assert step.prefill_step._cache_size() + step.decode_step._cache_size() == compiled


def test_constrained_rows_beside_free_rows(tiny_chat):
    """Structured output: a JSON-schema row and a regex row (greedy) served with two decode
    steps per engine step beside free rows, both preempted midway (recomputed from prompt
    and output). The free rows get generate()'s tokens and logprobs; each constrained row
    gets what a plain loop picks (the full forward, the mask from llguidance's own matcher,
    argmax), ending where the grammar does; its text matches the regex / validates against
    the schema. One row's top logprobs are log_softmax's."""
    import dataclasses
    import json

    import jax
    import jsonschema
    import llguidance
    import llguidance.numpy

    from jaxinfer.structured import JSON_WHITESPACE, Grammar, ll_tokenizer

    model, tok = tiny_chat, tiny_chat.tokenizer
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "age": {"type": "integer", "minimum": 0,
                                                       "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    regex = r"(yes|no), [0-9]{2,4}"
    free = _requests(model, 4, seed=8)
    free[0] = (free[0][0], SamplingParams(temperature=0.0, top_logprobs=3, logprobs=True), 6)
    constrained = [(list(range(20, 40)), Grammar.json_schema(tok, schema), schema),
                   ([5, 6, 7, 8], Grammar.regex(tok, regex), regex)]
    engine = _engine(model, pages=60, decode_steps=2)
    ids = [engine.add_request(p, sampling=sp, max_tokens=n) for p, sp, n in free]
    ids += [engine.add_request(p, max_tokens=130, grammar=g) for p, g, _ in constrained]
    held = [engine.requests[i] for i in ids]
    got = {i: ([], [], [], None) for i in ids}
    while engine.has_unfinished():
        if engine.stats["steps"] == 12:  # both grammar rows (the youngest) are recomputed
            engine.scheduler._preempt(spare=None)
            engine.scheduler._preempt(spare=None)
        for out in engine.step():
            toks, lps, tops, _ = got[out.request_id]
            toks += out.new_token_ids
            lps += out.new_logprobs or []
            tops += out.new_top_logprobs or []
            got[out.request_id] = (toks, lps, tops, out.finish_reason)
    assert [r.preemptions for r in held[4:]] == [1, 1]
    plain = [(p, dataclasses.replace(sp, top_logprobs=0), n) for p, sp, n in free]
    for i, (toks, lps, reason) in zip(ids, _reference(model, plain, batch=len(plain))):
        assert got[i][0] == toks and got[i][3] == reason
        if lps:
            np.testing.assert_allclose(got[i][1], lps, atol=1e-4)
    # Top logprobs of the first free row: the k most likely under log_softmax, descending.
    # Full forwards padded to one length: the grammar rows' (prompt + 130), one compile
    # (causal: the padding changes no earlier logit)
    width = max(len(p) for p, _, _ in constrained) + 130
    p, toks = free[0][0], got[ids[0]][0]
    assert len(p + toks) <= width
    logp = np.asarray(jax.nn.log_softmax(
        model(np.array([p + toks + [0] * (width - len(p + toks))]))[0], axis=-1))
    for j, top in enumerate(got[ids[0]][2]):
        want = np.argsort(-logp[len(p) - 1 + j])[:3]
        assert [t for t, _ in top] == want.tolist()
        np.testing.assert_allclose([lp for _, lp in top], logp[len(p) - 1 + j][want], atol=1e-4)
        assert top[0][0] == toks[j]
    with pytest.raises(ValueError, match="top_logprobs"):  # generate does not report them
        jaxinfer.generate(model, [p], sampling=free[0][1])
    # Constrained rows against a plain masked greedy loop.
    lt = ll_tokenizer(tok)
    for i, (prompt, grammar, spec) in zip(ids[4:], constrained):
        m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_regex(spec)
                                 if isinstance(spec, str) else
                                 llguidance.LLMatcher.grammar_from_json_schema(
                                     spec, defaults={"whitespace_pattern": JSON_WHITESPACE}))
        want, mask = [], llguidance.numpy.allocate_token_bitmask(1, tok.vocab_size)
        while len(want) < 130 and not m.is_stopped():
            seq = prompt + want
            logits = np.array(model(np.array([seq + [0] * (width - len(seq))]))
                              [0, len(seq) - 1:len(seq)], np.float32)
            llguidance.numpy.fill_next_token_bitmask(m, mask)
            llguidance.numpy.apply_token_bitmask_inplace(logits, mask)
            t = int(np.argmax(logits))
            if t in tok.eos_token_ids:
                want.append(t)
                break
            assert m.consume_token(t)
            want.append(t)
        assert got[i][0] == want and got[i][3] == "stop", repr(tok.decode(want))
        text = tok.decode(got[i][0])
        if isinstance(spec, str):
            assert re.fullmatch(spec, text), text
        else:
            jsonschema.validate(json.loads(text), spec)
    assert engine.free_pages == engine.total_pages
