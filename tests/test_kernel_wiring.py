"""The model's GPU path (every Pallas kernel wired in) run on the CPU in interpret mode.

On the GPU the model dispatches to the kernels (layers.py); on the CPU it takes the pure-jnp
references, so without this test CI would never run the wiring: the fused decode matmuls, the
RoPE + cache-append attention kernel reading the fused qkv, flash prefill. Here the dispatch
is forced on (`layers.use_kernels`) and every kernel runs with interpret=True, on a tiny
random bfloat16 model whose head dim (32) takes the fused attention path; prefill and decode
steps are compared with the reference path, step by step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from jaxinfer.cache import KVCache
from jaxinfer.configs import Config, RopeScaling
from jaxinfer.models import layers, llama
from kernel_testing import rel_err, set_boundaries

KERNELS = ("add_rms_norm", "flash_attention", "decode_attention", "decode_attention_append",
           "norm_matmul", "rms_norm", "swiglu", "swiglu_down")


@pytest.fixture
def kernels_in_interpret_mode(monkeypatch):
    for name in KERNELS:
        monkeypatch.setattr(pallas_kernels, name,
                            functools.partial(getattr(pallas_kernels, name), interpret=True))
    monkeypatch.setattr(layers, "use_kernels",
                        lambda dtype: jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16))


def tiny_config(**kw) -> Config:
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=64, tie_word_embeddings=False, dtype="bfloat16",
                rope_scaling=RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0,
                                         original_max_position_embeddings=16))
    base.update(kw)
    return Config(**base)


def decode_steps(params, config, ids):
    """Prefill a third of ids [B, T] (fresh), then one token per step -> logits [B, T, V]."""
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    split = t // 3
    cache = KVCache.init(config, b, t + 3)
    logits, cache = llama.forward(params, ids[:, :split], pos[:, :split], config, cache,
                                  fresh=True)
    out = [logits]
    for i in range(split, t):
        logits, cache = llama.forward(params, ids[:, i:i + 1], pos[:, i:i + 1], config, cache)
        out.append(logits)
    return np.asarray(jnp.concatenate(out, axis=1)), cache


BOUNDARIES = layers.BOUNDARY_MODES


@pytest.mark.parametrize("boundary", list(BOUNDARIES))
@pytest.mark.parametrize("variant", [{}, {"layer_windows": (5, None)}, {"qkv_bias": True}],
                         ids=["llama3", "window", "qkv_bias"])
def test_kernel_path_matches_reference_path(kernels_in_interpret_mode, variant, boundary,
                                            monkeypatch):
    set_boundaries(monkeypatch, boundary)
    config = tiny_config(**variant)
    params = layers.init_params(llama.param_specs(config), jax.random.key(0), jnp.bfloat16)
    if config.qkv_bias:  # non-zero biases, so that a dropped bias shows
        for lp in params["layers"]:
            lp["bqkv"] = (0.5 * jax.random.normal(jax.random.key(1), lp["bqkv"].shape)
                          ).astype(jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(2), (2, 13), 0, config.vocab_size)
    calls = []
    for name in ("add_rms_norm", "decode_attention_append", "norm_matmul", "rms_norm", "swiglu"):
        fn = getattr(pallas_kernels, name)

        def spy(*a, _fn=fn, _name=name, **k):
            calls.append(_name)
            if k.get("deltas") is not None:
                calls.append(f"{_name}+deltas")
            return _fn(*a, **k)
        monkeypatch.setattr(pallas_kernels, name, spy)
    fused, cache = decode_steps(params, config, ids)
    want = {"decode_attention_append", "norm_matmul", "rms_norm", "swiglu"}
    # (with the boundaries in the consumers' matmuls add_rms_norm is still the final norm's)
    add_kernel, in_swiglu, in_qkv = BOUNDARIES[boundary]
    want |= {"add_rms_norm"} if add_kernel else set()
    want |= {"swiglu+deltas"} if in_swiglu else set()
    want |= {"norm_matmul+deltas"} if in_qkv and not config.qkv_bias else set()
    assert set(calls) == want
    monkeypatch.setattr(layers, "use_kernels", lambda dtype: False)
    ref, ref_cache = decode_steps(params, config, ids)
    for i in range(ids.shape[1]):
        assert rel_err(fused[:, i], ref[:, i]) < 3e-2, f"position {i}"
    assert np.mean(fused.argmax(-1) == ref.argmax(-1)) >= 0.9
    # The kernel wrote the same (rotated) keys and values to the cache.
    for k, k_ref in zip(cache.k, ref_cache.k):
        assert rel_err(k[:, :ids.shape[1]], k_ref[:, :ids.shape[1]]) < 1e-2
    for v, v_ref in zip(cache.v, ref_cache.v):
        assert rel_err(v[:, :ids.shape[1]], v_ref[:, :ids.shape[1]]) < 1e-2


@pytest.mark.parametrize("boundary", ["swiglu", "consumers"])
def test_one_kernel_mlp_matches_reference_path(kernels_in_interpret_mode, boundary,
                                               monkeypatch):
    # Decode rows within layers.ONE_KERNEL_MLP_ROWS: each layer's MLP is one swiglu_down
    # call (its accumulator the zeroed buffer of the layer before, its output read by the
    # next q/k/v matmul or add_rms_norm as one float32 chunk); prefill keeps two kernels.
    set_boundaries(monkeypatch, boundary)
    monkeypatch.setattr(layers, "ONE_KERNEL_MLP_ROWS", 2)
    config = tiny_config(num_layers=3)
    params = layers.init_params(llama.param_specs(config), jax.random.key(0), jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(2), (2, 13), 0, config.vocab_size)
    calls = []
    for name in ("swiglu", "swiglu_down"):
        fn = getattr(pallas_kernels, name)

        def spy(*a, _fn=fn, _name=name, **k):
            calls.append(_name)
            return _fn(*a, **k)
        monkeypatch.setattr(pallas_kernels, name, spy)
    fused, _ = decode_steps(params, config, ids)
    steps = ids.shape[1] - ids.shape[1] // 3
    assert calls.count("swiglu_down") == steps * config.num_layers
    monkeypatch.setattr(layers, "use_kernels", lambda dtype: False)
    ref, _ = decode_steps(params, config, ids)
    for i in range(ids.shape[1]):
        assert rel_err(fused[:, i], ref[:, i]) < 3e-2, f"position {i}"
    assert np.mean(fused.argmax(-1) == ref.argmax(-1)) >= 0.9


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("boundary", list(BOUNDARIES))
@pytest.mark.parametrize("variant", [{}, {"layer_windows": (5, None)}, {"qkv_bias": True}],
                         ids=["llama3", "window", "qkv_bias"])
def test_kernel_path_matches_reference_path_gpu(variant, boundary, monkeypatch):
    """The same on the H200 with the compiled kernels (the HF fixtures' head dim 16 is below
    the fused attention kernel's 32, so test_gpu.py does not reach that kernel)."""
    set_boundaries(monkeypatch, boundary)
    config = tiny_config(**variant)
    params = layers.init_params(llama.param_specs(config), jax.random.key(0), jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(2), (2, 13), 0, config.vocab_size)
    fused, _ = decode_steps(params, config, ids)
    monkeypatch.setattr(layers, "use_kernels", lambda dtype: False)
    ref, _ = decode_steps(params, config, ids)
    for i in range(ids.shape[1]):
        assert rel_err(fused[:, i], ref[:, i]) < 3e-2, f"position {i}"
    assert np.mean(fused.argmax(-1) == ref.argmax(-1)) >= 0.9


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("rows", [1, 4])
def test_one_kernel_mlp_matches_reference_path_gpu(rows, monkeypatch):
    """The one-kernel MLP (float32 atomics) on the H200 at decode batch 1 (the default) and 4,
    against the references; and at batch 1 against the two-kernel MLP."""
    monkeypatch.setattr(layers, "ONE_KERNEL_MLP_ROWS", rows)
    config = tiny_config(num_layers=3)
    params = layers.init_params(llama.param_specs(config), jax.random.key(0), jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(2), (rows, 13), 0, config.vocab_size)
    fused, _ = decode_steps(params, config, ids)
    monkeypatch.setattr(layers, "ONE_KERNEL_MLP_ROWS", 0)
    two, _ = decode_steps(params, config, ids)
    assert rel_err(fused, two) < 1e-2
    monkeypatch.setattr(layers, "use_kernels", lambda dtype: False)
    ref, _ = decode_steps(params, config, ids)
    for i in range(ids.shape[1]):
        assert rel_err(fused[:, i], ref[:, i]) < 3e-2, f"position {i}"
    assert np.mean(fused.argmax(-1) == ref.argmax(-1)) >= 0.9
