"""decode_qkv_attention (the q/k/v projection with the decode attention in its tail, run by
each KV group's last program) vs its reference (norm_matmul_reference, then
decode_attention_append_reference) and vs the two kernels it replaces.

CPU: interpret mode (programs run one after another, so the last to arrive is the last in
grid order) at shapes that are not block multiples. GPU (marked `gpu`): the compiled kernel at
Llama-3-8B decode shapes, where the programs race for the counters.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_testing import normal, rel_err
from pallas_kernels.decode_attention_append import decode_attention_append
from pallas_kernels.decode_qkv_attention import (decode_qkv_attention,
                                                 decode_qkv_attention_reference)
from pallas_kernels.norm_matmul import MatmulBlockSizes, norm_matmul

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2}
needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")


def rope_tables(positions, d, theta=10000.0):
    """HF rotate-half cos/sin [B, D] for integer positions [B] (float32)."""
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    f = np.asarray(positions)[:, None] * inv[None, :]
    emb = np.concatenate([f, f], axis=-1)
    return jnp.asarray(np.cos(emb), jnp.float32), jnp.asarray(np.sin(emb), jnp.float32)


def inputs(seed, b, s, k, hkv, g, d, dtype, n_deltas):
    scale = jnp.asarray([[0.3], [2.0], [1.0], [0.7]][:b])  # rows at different scales
    x = (scale * normal(seed, (b, k), jnp.float32)).astype(dtype)
    nw = (1.0 + 0.3 * normal(seed + 1, (k,), jnp.float32)).astype(dtype)
    w = (normal(seed + 2, (k, hkv, g + 2, d), jnp.float32) / np.sqrt(k)).astype(dtype)
    k_cache = normal(seed + 3, (b, s, hkv, d), dtype)
    v_cache = normal(seed + 4, (b, s, hkv, d), dtype)
    deltas = normal(seed + 5, (n_deltas, b, k), jnp.float32, 0.5) if n_deltas else None
    return x, nw, w, k_cache, v_cache, deltas


CASES = [
    # b, s, K, hkv, G, d, positions, window, n_deltas, block sizes (bm, bn, bk, warps, stages, split)
    (1, 45, 96, 2, 4, 32, (44,), None, 2, (16, 32, 32, 4, 1, 2)),
    (2, 40, 80, 2, 3, 32, (0, 23), None, 0, (16, 16, 32, 4, 1, 3)),  # K ragged, G = 3
    (3, 70, 64, 4, 2, 32, (69, 5, 31), 20, 4, (16, 32, 32, 4, 1, 1)),  # window, unsplit
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_s{}_k{}_h{}x{}_d{}_p{}_w{}_dl{}".format(*c))
def test_matches_reference_and_the_two_kernels(case, dtype):
    b, s, k, hkv, g, d, positions, window, n_deltas, blocks = case
    x, nw, w, k_cache, v_cache, deltas = inputs(7, b, s, k, hkv, g, d, dtype, n_deltas)
    positions = jnp.asarray(positions, jnp.int32)
    rope = rope_tables(positions, d)
    counters = jnp.zeros((hkv,), jnp.int32)
    blocks = MatmulBlockSizes(*blocks)
    x_new, out, k_out, v_out, cnt = decode_qkv_attention(
        x, nw, w, k_cache, v_cache, positions, counters, rope=rope, eps=1e-5, deltas=deltas,
        sliding_window=window, interpret=True, block_sizes=blocks, attn_block_k=16)
    assert out.shape == (b, hkv * g, d) and out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(cnt), np.zeros(hkv))  # reset for the next layer
    ref = decode_qkv_attention_reference(x, nw, w, k_cache, v_cache, positions, counters,
                                         rope=rope, eps=1e-5, deltas=deltas,
                                         sliding_window=window)
    assert rel_err(x_new, ref[0]) < 1e-6
    assert rel_err(out, ref[1]) < TOL[dtype]
    assert rel_err(k_out, ref[2]) < TOL[dtype] and rel_err(v_out, ref[3]) < TOL[dtype]
    # The two kernels it replaces (the model's path for longer caches), on the same inputs:
    # the same partial sums, so the same result up to the order of float32 sums.
    mm = norm_matmul(x, nw, w, eps=1e-5, partials=True, deltas=deltas, interpret=True,
                     block_sizes=blocks)
    x2, (parts, ss) = mm if deltas is not None else (x, mm)
    out2, k2, v2 = decode_attention_append(parts, k_cache, v_cache, positions, rope=rope,
                                           norm=(ss, k, 1e-5), sliding_window=window,
                                           interpret=True)
    np.testing.assert_array_equal(np.asarray(x_new), np.asarray(x2))
    assert rel_err(out, out2) < 1e-5 if dtype == jnp.float32 else rel_err(out, out2) < 1e-2
    assert rel_err(k_out, k2) < 1e-2 and rel_err(v_out, v2) < 1e-2
    # Only the new slots changed.
    rows = np.arange(b)
    for new, old in ((k_out, k_cache), (v_out, v_cache)):
        new, old = np.array(new), np.array(old)
        new[rows, np.asarray(positions)] = old[rows, np.asarray(positions)]
        np.testing.assert_array_equal(new, old)


def test_bad_inputs_raise():
    x, nw, w, k_cache, v_cache, deltas = inputs(3, 1, 20, 64, 2, 2, 32, jnp.float32, 0)
    positions = jnp.asarray([5], jnp.int32)
    rope = rope_tables(positions, 32)
    cnt = jnp.zeros((2,), jnp.int32)
    call = functools.partial(decode_qkv_attention, rope=rope, interpret=True)
    cases = [
        ((x, None, w, k_cache, v_cache, positions, cnt), "norm's weight"),
        ((x, nw, w.reshape(64, -1), k_cache, v_cache, positions, cnt), r"\[K, Hkv, G \+ 2, D\]"),
        ((x, nw, w, k_cache[:, :, :1], v_cache[:, :, :1], positions, cnt), "does not match"),
        ((x, nw, w, k_cache.astype(jnp.bfloat16), v_cache.astype(jnp.bfloat16), positions,
          cnt), "x's dtype"),
        ((x, nw, w, k_cache, v_cache, positions, cnt[:1]), r"counters must be \[Hkv\]"),
        ((x, nw, w, k_cache, v_cache, positions, cnt.astype(jnp.float32)), "counters"),
        ((x, nw, w, k_cache, v_cache, jnp.asarray([20], jnp.int32), cnt), r"\[0, 20\)"),
        ((x, nw, w, jnp.zeros((1, 600, 2, 32)), jnp.zeros((1, 600, 2, 32)), positions, cnt),
         "at most"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            call(*args)
    with pytest.raises(ValueError, match="rope cos must have shape"):
        decode_qkv_attention(x, nw, w, k_cache, v_cache, positions, cnt,
                             rope=(rope[0][:, :16], rope[1]), interpret=True)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("b,s", [(1, 384), (1, 512), (2, 300)])
@pytest.mark.parametrize("n_deltas", [0, 2])
def test_decode_qkv_attention_gpu(b, s, n_deltas):
    """Llama-3-8B shapes (K 4096, 8 KV heads x (4 + 2) x 128), the model's block sizes, many
    calls threading one counter buffer: the counters end at 0 and every call matches."""
    dtype = jnp.bfloat16
    x, nw, w, k_cache, v_cache, deltas = inputs(11, b, s, 4096, 8, 4, 128, dtype, n_deltas)
    positions = jnp.asarray([s - 1 - 41 * i for i in range(b)], jnp.int32)
    rope = rope_tables(positions, 128, 500000.0)
    ref = decode_qkv_attention_reference(x, nw, w, k_cache, v_cache, positions,
                                         jnp.zeros((8,), jnp.int32), rope=rope, eps=1e-5,
                                         deltas=deltas)
    call = jax.jit(functools.partial(decode_qkv_attention, rope=rope, eps=1e-5, deltas=deltas),
                   donate_argnums=(3, 4, 6))
    cnt = jnp.zeros((8,), jnp.int32)
    for _ in range(20):  # a race in the arrival count would show in some call
        x_new, out, k_out, v_out, cnt = call(x, nw, w, k_cache.copy(), v_cache.copy(),
                                             positions, cnt)
        assert rel_err(out, ref[1]) < TOL[dtype]
        assert rel_err(k_out, ref[2]) < 2e-3 and rel_err(v_out, ref[3]) < 2e-3
        assert rel_err(x_new, ref[0]) < 1e-6
    np.testing.assert_array_equal(np.asarray(cnt), np.zeros(8))
