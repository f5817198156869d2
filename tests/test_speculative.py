"""Speculative decoding (jaxinfer/speculative.py): the verification forward on the chunk
kernels, greedy / coupled / rejection-sampled acceptance against plain `generate`, the
drafters, and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache import KVCache
from jaxinfer.configs import Config
from jaxinfer.models import llama
from jaxinfer.plan import KernelPolicy, Plan
from jaxinfer.weights import init_params
from kernel_testing import pallas_kernels_in, rel_err


def tiny_bf16_config() -> Config:
    return Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=64,
                  tie_word_embeddings=False, dtype="bfloat16")


def test_verification_forward_runs_the_chunk_kernel_and_matches_decode_steps():
    """T = 3 queries per row (the last token and 2 drafts) at per-row positions against a
    contiguous cache take the chunk attention kernel (interpret mode), and give the logits the
    reference path gives one token at a time."""
    config = tiny_bf16_config()
    params = init_params(llama.param_specs(config), jax.random.key(0), jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(1), (2, 12), 0, config.vocab_size)
    lengths = jnp.array([5, 8], jnp.int32)  # rows hold prompts of different lengths

    def prompt_cache(plan):
        pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
        _, cache = llama.forward(params, ids, pos, plan, KVCache.init(config, 2, 16),
                                 fresh=True)
        return cache  # slots past a row's length hold stale tokens, as after rejected drafts

    verify_pos = lengths[:, None] + jnp.arange(3, dtype=jnp.int32)  # [B, 3]
    verify_ids = jnp.take_along_axis(ids, verify_pos, axis=1)
    kernel_plan = Plan(config, KernelPolicy(interpret=True))
    ref_plan = Plan(config, KernelPolicy.reference())
    names = pallas_kernels_in(lambda c: llama.forward(params, verify_ids, verify_pos,
                                                      kernel_plan, c),
                              prompt_cache(ref_plan))
    assert names["chunk_attention"] == config.num_layers, names
    got, _ = llama.forward(params, verify_ids, verify_pos, kernel_plan, prompt_cache(ref_plan))
    cache = prompt_cache(ref_plan)
    for t in range(3):  # one token at a time through the reference
        want, cache = llama.forward(params, verify_ids[:, t:t + 1], verify_pos[:, t:t + 1],
                                    ref_plan, cache)
        assert rel_err(got[:, t], want[:, 0]) < 3e-2, t
        assert np.mean(np.asarray(got[:, t].argmax(-1) == want[:, 0].argmax(-1))) == 1.0
