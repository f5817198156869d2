"""The serving engine against `generate` alone, token for token (CPU, float32, tiny model)."""

import numpy as np
import pytest

import jaxinfer
from jaxinfer import SamplingParams
from jaxinfer.cache import PagedKVCache


def _engine(model, **kw):
    """A small engine: pages of 8 tokens, chunks of 32, a pool of `pages` pages."""
    pages = kw.pop("pages", 64)
    page_bytes = PagedKVCache.page_bytes(model.config, 8, model.config.dtype)
    args = dict(max_num_seqs=4, page_size=8, chunk_size=32, max_num_batched_tokens=64,
                max_model_len=160, kv_memory=pages * page_bytes)
    return jaxinfer.Engine(model, **{**args, **kw})


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


def _reference(model, reqs):
    """generate() alone for each request."""
    return [jaxinfer.generate(model, [p], max_new_tokens=n, sampling=sp)[0] for p, sp, n in reqs]


def test_engine_equals_generate_alone(tiny_chat):
    """A few hundred requests arriving at random steps, with shared prefixes, prompts split
    into chunks and preemption forced by a small pool: each request's tokens (and logprobs)
    are those of generate() for it alone, and every page is back at the end."""
    model = tiny_chat
    reqs = _requests(model, 240, seed=0)
    engine = _engine(model, pages=24)
    rng = np.random.default_rng(1)
    order = rng.permutation(len(reqs))
    ids, got, reasons = {}, {}, {}
    pending = list(order)
    while pending or engine.has_unfinished():
        for i in pending[:int(rng.integers(0, 6))]:
            p, sp, n = reqs[i]
            ids[engine.add_request(p, sampling=sp, max_tokens=n)] = i
        pending = pending[len([i for i in ids.values() if i in pending]):] if False else \
            [i for i in pending if i not in ids.values()]
        for out in engine.step():
            toks, lps = got.setdefault(ids[out.request_id], ([], []))
            toks += out.new_token_ids
            lps += out.new_logprobs or []
            if out.finished:
                reasons[ids[out.request_id]] = out.finish_reason
    assert engine.stats["preemptions"] > 0  # the pool was really too small
    assert engine.prefix_cache_hit_rate() > 0
    assert engine.free_pages == engine.total_pages and not engine.requests
    for i, ref in enumerate(_reference(model, reqs)):
        toks, lps = got[i]
        assert toks == ref.token_ids, i
        assert reasons[i] == ref.finish_reason, i
        if reqs[i][1].logprobs:
            np.testing.assert_allclose(lps, ref.logprobs, atol=1e-4)
