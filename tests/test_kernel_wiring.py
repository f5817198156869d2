"""The model's GPU path (every Pallas kernel wired in) run on the CPU in interpret mode.

On the GPU the ops dispatch to the kernels; on the CPU to the pure-jnp references, so without
this test CI would never run the wiring: the fused decode matmuls and their boundaries, the
RoPE + cache-append attention kernel reading the fused qkv, the one-kernel MLP, flash prefill.
`KernelPolicy(interpret=True)` runs every kernel in interpret mode on a tiny random bfloat16
model whose head dim (32) takes the fused attention path; prefill and decode steps are compared
with `KernelPolicy.reference()`, step by step, and the kernels each step runs are read from
its jaxpr.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.cache import KVCache
from jaxinfer.configs import Config, MoEConfig, RopeScaling
from jaxinfer.models import llama
from jaxinfer.plan import Boundary, KernelPolicy, Plan
# init_params: jaxinfer.weights.init_params's bits, fewer compiles
from kernel_inputs import put
from kernel_testing import init_params, pallas_kernels_in, rel_err

C, K, X = Boundary.CONSUMER, Boundary.KERNEL, Boundary.XLA
# (norm_linear, gated_mlp, lm_head) boundaries: all in XLA, all add_rms_norm kernels, the
# attention -> MLP one in SwiGLU, both layer boundaries in the consumers (the default).
BOUNDARIES = {"xla": (X, X, X), "kernel": (K, K, K), "swiglu": (K, C, K), "consumers": (C, C, K)}
INTERPRET = KernelPolicy(interpret=True)


def boundaries(name: str) -> dict:
    nl, mlp, head = BOUNDARIES[name]
    return dict(norm_linear_boundary=nl, gated_mlp_boundary=mlp, lm_head_boundary=head)


def tiny_config(**kw) -> Config:
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=64, tie_word_embeddings=False, dtype="bfloat16",
                rope_scaling=RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0,
                                         original_max_position_embeddings=16))
    base.update(kw)
    return Config(**base)


def random_params(config: Config, seed: int = 0):
    return init_params(llama.param_specs(config), jax.random.key(seed), jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_init_params_helper_draws_the_packages_bits(dtype):
    """kernel_testing.init_params (the tests' compile-free random weights) is
    jaxinfer.weights.init_params bit for bit, dense and stacked experts."""
    from jaxinfer.weights import init_params as package_init

    specs = llama.param_specs(tiny_config(moe=MoEConfig(num_experts=4, experts_per_token=2,
                                                        expert_intermediate_size=32)))
    got, want = (jax.tree.leaves(f(specs, jax.random.key(7), dtype))
                 for f in (init_params, package_init))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(np.asarray(g), np.asarray(w))


def decode_steps(params, plan: Plan, ids, cache_len=None, forward=llama.forward):
    """Prefill a third of ids [B, T] (fresh), then one token per step -> logits [B, T, V].
    forward: llama.forward's signature (op by op by default: its compiles are shared by the
    tests around it)."""
    # ids, positions and their slices in numpy, put on the device as they are: eager slices
    # of device arrays compiled a program per slice (each step's start, each shape)
    ids = np.asarray(ids, np.int32)
    b, t = ids.shape
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    split = t // 3
    cache = KVCache.init(plan.config, b, cache_len or t + 3)
    logits, cache = forward(params, put(ids[:, :split]), put(pos[:, :split]), plan, cache,
                            fresh=True)
    out = [np.asarray(logits)]
    for i in range(split, t):
        logits, cache = forward(params, put(ids[:, i:i + 1]), put(pos[:, i:i + 1]), plan, cache)
        out.append(np.asarray(logits))
    return np.concatenate(out, axis=1), cache


def step_kernels(params, plan: Plan, batch: int) -> collections.Counter:
    """The Pallas kernels of one decode step (one token per row against a cache of 16)."""
    cache = KVCache.init(plan.config, batch, 16)
    tokens = jnp.ones((batch, 1), jnp.int32)
    return pallas_kernels_in(lambda p, c: llama.forward(p, tokens, tokens, plan, c), params,
                             cache)


def assert_close_to_reference(params, config, ids, fused, forward=llama.forward):
    ref, _ = decode_steps(params, Plan(config, KernelPolicy.reference()), ids, forward=forward)
    assert_close(fused, ref)


def assert_close(fused, ref):
    """Logits [B, T, V] of a kernel path against the reference path's."""
    for i in range(ref.shape[1]):
        assert rel_err(fused[:, i], ref[:, i]) < 3e-2, f"position {i}"
    assert np.mean(fused.argmax(-1) == ref.argmax(-1)) >= 0.9


@pytest.mark.parametrize("variant, boundary", [
    ({}, "xla"), ({}, "kernel"), ({}, "swiglu"), ({}, "consumers"),
    ({"layer_windows": (5, None)}, "consumers"), ({"qkv_bias": True}, "consumers")],
    ids=["llama3-xla", "llama3-kernel", "llama3-swiglu", "llama3-consumers", "window-consumers",
         "qkv_bias-consumers"])
def test_kernel_path_matches_reference_path(variant, boundary):
    config = tiny_config(**variant)
    params = random_params(config)
    if config.qkv_bias:  # non-zero biases, so that a dropped bias shows
        for lp in params["layers"]:
            lp["bqkv"] = (0.5 * jax.random.normal(jax.random.key(1), lp["bqkv"].shape)
                          ).astype(jnp.bfloat16)
    plan = Plan(config, INTERPRET.replace(one_kernel_mlp_rows=0, **boundaries(boundary)))
    ids = jax.random.randint(jax.random.key(2), (2, 13), 0, config.vocab_size)
    fused, cache = decode_steps(params, plan, ids)
    nl, mlp, _ = BOUNDARIES[boundary]
    names = step_kernels(params, plan, 2)
    matmuls = [n for n in names if "matmul" in n]
    # The layer's q/k/v (with the MLP's chunks added and the norm in its loop when the
    # boundary is in the consumer and there is no bias), o, SwiGLU (with o's chunks and the
    # norm in its loop), down; the attention kernel; the boundaries' kernels.
    qkv = "matmul_none_k64_n256"
    want_qkv = ("add_norm_" + qkv if nl is C and not config.qkv_bias else qkv)
    assert any(n.startswith(want_qkv) for n in matmuls), names
    assert any(n.startswith("add_norm_matmul_swiglu" if mlp is C else "matmul_swiglu")
               for n in matmuls), names
    assert names["decode_attention_append"] == config.num_layers
    # Two layers: (rms_norm, add_rms_norm) kernels. A q/k/v bias keeps the MLP -> attention
    # boundary out of the q/k/v matmul: it falls back to a kernel of its own.
    want = {"xla": (5, 0), "kernel": (1, 4), "swiglu": (1, 2),
            "consumers": (1, 2) if config.qkv_bias else (0, 1)}[boundary]
    assert (names["rms_norm"], names["add_rms_norm"]) == want, names
    # the reference's logits and cache from one run
    ref, ref_cache = decode_steps(params, Plan(config, KernelPolicy.reference()), ids)
    assert_close(fused, ref)
    # The kernel wrote the same (rotated) keys and values to the cache.
    for k, k_ref in zip(cache.k + cache.v, ref_cache.k + ref_cache.v):
        assert rel_err(k[:, :ids.shape[1]], k_ref[:, :ids.shape[1]]) < 1e-2


def test_one_kernel_mlp_matches_reference_path():
    # Decode rows within one_kernel_mlp_rows: each layer's MLP is one swiglu_down call (its
    # accumulator the zeroed buffer of the layer before, its output read by the next q/k/v
    # matmul or add_rms_norm as one float32 chunk); prefill keeps two kernels.
    config = tiny_config(num_layers=3)
    params = random_params(config)
    plan = Plan(config, INTERPRET.replace(one_kernel_mlp_rows=2))
    ids = jax.random.randint(jax.random.key(2), (2, 13), 0, config.vocab_size)
    names = step_kernels(params, plan, 2)
    assert names["add_norm_matmul_swiglu_down_k64_n96"] == config.num_layers, names
    assert not any("matmul_none_k96" in n for n in names)  # no separate down projection
    fused, _ = decode_steps(params, plan, ids)
    assert_close_to_reference(params, config, ids, fused)


def test_deterministic_policy_is_batch_invariant_in_interpret_mode():
    """KernelPolicy.deterministic(): a request's logits, bit for bit, alone and at row 3 of a
    batch of 4 whose other rows hold other tokens and whose cache is longer (more key chunks:
    attention_chunk 16 here), prefill and decode; and close to the references. (Batches of 4
    and 16 on the H200's compiled kernels: tests/test_determinism.py.)"""
    config = tiny_config()
    params = random_params(config)
    plan = Plan(config, KernelPolicy.deterministic(interpret=True, attention_chunk=16))
    ids = np.asarray(jax.random.randint(jax.random.key(3), (4, 7), 0, config.vocab_size))
    # jitted: one program per shape (op by op, the interpret-mode kernels' ops each compile
    # alone, and at two batch shapes); the same computations, as the engine runs them
    forward = jax.jit(llama.forward, static_argnames=("plan", "fresh"))
    alone, _ = decode_steps(params, plan, ids[1:2], cache_len=24, forward=forward)
    batch = ids.copy()
    batch[3] = ids[1]
    together, _ = decode_steps(params, plan, batch, cache_len=48, forward=forward)
    np.testing.assert_array_equal(together[3], alone[0])
    assert_close_to_reference(params, config, ids[1:2], alone, forward)
    names = step_kernels(params, plan, 1)
    assert "add_norm_matmul_swiglu_down_k64_n96" not in names  # no float atomics
    assert any("matmul_none_k64_n96" in n for n in names), names  # the LM head


def test_reference_policy_runs_no_kernel():
    config = tiny_config()
    params = random_params(config)
    assert not step_kernels(params, Plan(config, KernelPolicy.reference()), 2)
    assert not step_kernels(params, Plan(config, KernelPolicy()), 2)  # the CPU: references


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("boundary", ["kernel", "consumers"])
@pytest.mark.parametrize("variant", [{}, {"layer_windows": (5, None)}, {"qkv_bias": True}],
                         ids=["llama3", "window", "qkv_bias"])
def test_kernel_path_matches_reference_path_gpu(variant, boundary):
    """The same on the H200 with the compiled kernels (the HF fixtures' head dim 16 is below
    the fused attention kernel's 32, so test_gpu.py does not reach that kernel)."""
    config = tiny_config(**variant)
    params = random_params(config)
    ids = jax.random.randint(jax.random.key(2), (2, 13), 0, config.vocab_size)
    fused, _ = decode_steps(params, Plan(config, KernelPolicy(**boundaries(boundary))), ids)
    assert_close_to_reference(params, config, ids, fused)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("rows", [1, 4])
def test_one_kernel_mlp_matches_reference_path_gpu(rows):
    """The one-kernel MLP (float32 atomics) on the H200 at decode batch 1 (the default) and 4,
    against the references; and against the two-kernel MLP."""
    config = tiny_config(num_layers=3)
    params = random_params(config)
    ids = jax.random.randint(jax.random.key(2), (rows, 13), 0, config.vocab_size)
    fused, _ = decode_steps(params, Plan(config, KernelPolicy(one_kernel_mlp_rows=rows)), ids)
    two, _ = decode_steps(params, Plan(config, KernelPolicy(one_kernel_mlp_rows=0)), ids)
    assert rel_err(fused, two) < 1e-2
    assert_close_to_reference(params, config, ids, fused)
