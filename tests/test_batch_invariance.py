"""KernelPolicy.deterministic() at any batch (CPU, interpret mode, a tiny random bf16 Llama).

Every matmul (q/k/v, o, SwiGLU, down, the LM head) and norm runs the fused Pallas kernels at
one set of tiles per weight shape, whatever M = B * T: a row's decode logits are the same bits
alone and at any index of a batch of 20 or 64 (past the old 16-row limit), and a prompt
prefilled in one call or in chunks gives the same cache and last logits. (The compiled
kernels on the H200: benchmarks/determinism.py.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache import KVCache
from jaxinfer.models import llama
from jaxinfer.ops.dispatch import decode_path
from jaxinfer.ops.linear import MATMUL
from jaxinfer.ops.mlp import SWIGLU
from jaxinfer.plan import KernelPolicy, Plan
from kernel_inputs import put
from kernel_testing import host_normal
from test_kernel_wiring import random_params, step_kernels, tiny_config

CACHE = 32  # slots per row
DET = KernelPolicy.deterministic(interpret=True, attention_chunk=16)


def _batch(config, b: int, seed: int, request: dict, at: tuple[int, ...]):
    """A decode step's inputs for b rows of random caches, tokens and positions, the
    request's own at rows `at`. Built in numpy, then put on the device (eager jax.random and
    .at[].set ops compiled a program each per batch size)."""
    rng = np.random.default_rng(seed)
    shape = (b, CACHE, config.num_kv_heads, config.head_dim)
    ks = [host_normal(int(s), shape, jnp.bfloat16)
          for s in rng.integers(0, 2**31, config.num_layers)]
    vs = [host_normal(int(s), shape, jnp.bfloat16)
          for s in rng.integers(0, 2**31, config.num_layers)]
    tokens = rng.integers(0, config.vocab_size, (b, 1)).astype(np.int32)
    positions = rng.integers(0, CACHE, (b, 1)).astype(np.int32)
    for i in at:
        for k, r in zip(ks, request["k"]):
            k[i] = r
        for v, r in zip(vs, request["v"]):
            v[i] = r
        tokens[i] = request["token"]
        positions[i] = request["position"]
    cache = KVCache(tuple(put(k) for k in ks), tuple(put(v) for v in vs), put(positions[:, 0]))
    return put(tokens), put(positions), cache


def test_decode_logits_bitwise_equal_at_batch_1_20_64():
    config = tiny_config()
    params = random_params(config)
    plan = Plan(config, DET)
    tokens, positions, cache = _batch(config, 1, 7, None, ())
    request = dict(k=[np.asarray(k[0]) for k in cache.k], v=[np.asarray(v[0]) for v in cache.v],
                   token=np.asarray(tokens[0]), position=np.array([21], np.int32))
    step = jax.jit(lambda p, t, pos, c: llama.forward(p, t, pos, plan, c))
    alone = step(params, *_batch(config, 1, 7, request, (0,)))
    for b, seed, at in ((20, 1, (13,)), (64, 2, (0, 47))):
        logits, new_cache = step(params, *_batch(config, b, seed, request, at))
        for i in at:
            np.testing.assert_array_equal(np.asarray(logits[i]), np.asarray(alone[0][0]),
                                          err_msg=f"B={b} row {i}")
            for layer, layer_alone in zip(new_cache.k + new_cache.v,
                                          alone[1].k + alone[1].v):
                np.testing.assert_array_equal(np.asarray(layer[i]), np.asarray(layer_alone[0]))
    # 64 rows still take the fused kernels, the LM head included (no XLA GEMM).
    names = step_kernels(params, plan, 64)
    assert any(n.startswith("matmul_none_k64_n96") for n in names), names  # the LM head
    assert any("matmul_swiglu" in n for n in names), names


def test_chunked_prefill_bitwise_equal_to_one_call():
    """The prefill_chunk path (contiguous cache, not fresh: the chunks attend through the jnp
    attention against the cache, the same code for one call of 16 tokens and for 7 + 9):
    the cache and the last prompt token's logits, bit for bit."""
    config = tiny_config()
    params = random_params(config)
    plan = Plan(config, DET)
    b, t = 2, 16
    ids = np.random.default_rng(5).integers(0, config.vocab_size, (b, t)).astype(np.int32)
    last = np.full((b,), t - 1, np.int32)

    @jax.jit
    def chunk(tokens, start, cache, logits_at):
        c = tokens.shape[1]
        pos = start + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
        return llama.forward(params, tokens, pos, plan, cache, logits_at=logits_at)

    empty = KVCache.init(config, b, CACHE)
    one, one_cache = chunk(put(ids), 0, empty, put(last))
    _, cache = chunk(put(ids[:, :7]), 0, empty, put(np.zeros((b,), np.int32)))
    two, two_cache = chunk(put(ids[:, 7:]), 7, cache, put(last - 7))
    np.testing.assert_array_equal(np.asarray(two), np.asarray(one))
    for a, ref in zip(two_cache.k + two_cache.v, one_cache.k + one_cache.v):
        np.testing.assert_array_equal(np.asarray(a[:, :t]), np.asarray(ref[:, :t]))


def test_every_matmul_takes_the_fused_kernel_at_any_rows():
    """The dispatch: under batch_invariant the fused kernels at any M (decode and prefill);
    the default policy keeps its fused_rows limit."""
    config = tiny_config()
    params = random_params(config)
    lp = params["layers"][0]
    det, default = Plan(config, DET), Plan(config, KernelPolicy(interpret=True))
    for shape in ((1, 1), (16, 1), (17, 1), (256, 1), (1, 7), (4, 300)):
        x = jax.ShapeDtypeStruct((*shape, config.hidden_size), jnp.bfloat16)
        assert decode_path(x, det)
        for w in (lp["wqkv"], params["lm_head"]):
            assert MATMUL.pick(x, w, det).name == "fused_small_m"
        assert SWIGLU.pick(x, lp["w_gate"], lp["w_up"], det).name == "pallas"
        assert decode_path(x, default) == (shape[0] * shape[1] <= 16)
