"""Soft-capping (Gemma 2) and head_dim 256 (Gemma) in the attention kernels: each kernel in
interpret mode against its pure-jnp reference with softcap on, at shapes that are not block
multiples, and the references against the softcap formula written out here (HF's: scores /
cap, tanh, * cap, then the mask)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from kernel_testing import normal, rel_err
from pallas_kernels import (DecodeBlockSizes, FlashBlockSizes, chunk_attention,
                            chunk_attention_reference, decode_attention,
                            decode_attention_append, decode_attention_append_reference,
                            decode_attention_reference, flash_attention,
                            flash_attention_reference)

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2}
CAP = 2.0  # small against scores of ~sqrt(D) * scale: tanh bends them
SMALL_FLASH = FlashBlockSizes(block_q=16, block_k=16, num_warps=4, num_stages=1)
SMALL_DECODE = DecodeBlockSizes(block_k=16, num_splits=2, num_stages=1)


def numpy_attention(q, k, v, visible, scale, cap):
    """q [Tq, D], k/v [Tk, D], visible [Tq, Tk]: HF's eager math in float64."""
    s = (q.astype(np.float64) @ k.astype(np.float64).T) * scale
    if cap is not None:
        s = np.tanh(s / cap) * cap
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v.astype(np.float64)


@pytest.mark.parametrize("d", [32, 256])
@pytest.mark.parametrize("window", [None, 9])
def test_flash_softcap_interpret(d, window):
    b, t, hq, hkv = 1, 37, 2, 1
    q, k, v = (normal(s, (b, t, h, d), jnp.float32) for s, h in ((1, hq), (2, hkv), (3, hkv)))
    scale = 0.3 / math.sqrt(d) * 4  # a scale != 1/sqrt(D) (query_pre_attn_scalar)
    out = flash_attention(q, k, v, sm_scale=scale, sliding_window=window, softcap=CAP,
                          interpret=True, block_sizes=SMALL_FLASH)
    ref = flash_attention_reference(q, k, v, sm_scale=scale, sliding_window=window,
                                    softcap=CAP)
    assert rel_err(out, ref) < TOL[jnp.float32]
    pos = np.arange(t)
    visible = pos[None, :] <= pos[:, None]
    if window is not None:
        visible &= pos[None, :] > pos[:, None] - window
    want = numpy_attention(np.asarray(q[0, :, 1]), np.asarray(k[0, :, 0]),
                           np.asarray(v[0, :, 0]), visible, scale, CAP)
    assert rel_err(ref[0, :, 1], want) < 1e-5
    uncapped = flash_attention_reference(q, k, v, sm_scale=scale, sliding_window=window)
    assert rel_err(uncapped, ref) > 1e-2  # the cap bites at this scale


def test_flash_softcap_bfloat16_and_mosaic_refusal():
    q, k, v = (normal(s, (2, 21, 4, 256), jnp.bfloat16) for s in (4, 5, 6))
    out = flash_attention(q, k, v, softcap=CAP, interpret=True, block_sizes=SMALL_FLASH)
    ref = flash_attention_reference(q, k, v, softcap=CAP)
    assert rel_err(out, ref) < TOL[jnp.bfloat16]
    with pytest.raises(ValueError, match="backend 'mosaic' has no softcap"):
        flash_attention(q, k, v, softcap=CAP, backend="mosaic", interpret=True)
    with pytest.raises(ValueError, match="softcap must be a positive number"):
        flash_attention(q, k, v, softcap=-1.0, interpret=True)


@pytest.mark.parametrize("d, dtype, window", [(256, jnp.float32, None), (256, jnp.float32, 7),
                                              (256, jnp.bfloat16, 7), (64, jnp.float32, None)])
def test_decode_softcap_interpret(d, dtype, window):
    b, s, hq, hkv = 2, 45, 4, 2
    q = normal(1, (b, hq, d), dtype, scale=3.0)
    kc, vc = normal(2, (b, s, hkv, d), dtype), normal(3, (b, s, hkv, d), dtype)
    lengths = jnp.asarray([45, 20], jnp.int32)
    out = decode_attention(q, kc, vc, lengths, softcap=CAP, sliding_window=window,
                           interpret=True, block_sizes=SMALL_DECODE)
    ref = decode_attention_reference(q, kc, vc, lengths, softcap=CAP, sliding_window=window)
    assert rel_err(out, ref) < TOL[dtype]
    pos = np.arange(s)
    n = 20
    visible = (pos < n) & ((pos >= n - window) if window else True)
    want = numpy_attention(np.asarray(q[1, :2], np.float32), np.asarray(kc[1, :, 0], np.float32),
                           np.asarray(vc[1, :, 0], np.float32),
                           np.broadcast_to(visible, (2, s)), 1 / math.sqrt(d), CAP)
    assert rel_err(ref[1, :2], want) < TOL[dtype]
    assert rel_err(decode_attention_reference(q, kc, vc, lengths, sliding_window=window),
                   ref) > 1e-2


@pytest.mark.parametrize("d, splits", [(256, 1), (256, 3), (32, 2)])
def test_append_softcap_interpret(d, splits):
    b, s, hq, hkv = 2, 40, 4, 2
    g = hq // hkv
    qkv = normal(1, (b, hkv, g + 2, d), jnp.float32, scale=2.0)
    kc, vc = normal(2, (b, s, hkv, d), jnp.float32), normal(3, (b, s, hkv, d), jnp.float32)
    positions = jnp.asarray([39, 17], jnp.int32)
    half = jnp.arange(d // 2, dtype=jnp.float32) * 0.01
    cos = jnp.broadcast_to(jnp.cos(jnp.concatenate([half, half])), (b, d))
    sin = jnp.broadcast_to(jnp.sin(jnp.concatenate([half, half])), (b, d))
    kw = dict(rope=(cos, sin), sm_scale=0.08, softcap=CAP, sliding_window=11)
    out, k_out, v_out = decode_attention_append(
        qkv, kc, vc, positions, interpret=True,
        block_sizes=DecodeBlockSizes(block_k=16, num_splits=splits, num_stages=1), **kw)
    ref, k_ref, v_ref = decode_attention_append_reference(qkv, kc, vc, positions, **kw)
    assert rel_err(out, ref) < TOL[jnp.float32]
    np.testing.assert_allclose(np.asarray(k_out), np.asarray(k_ref), rtol=1e-6, atol=1e-6)
    uncapped = decode_attention_append_reference(qkv, kc, vc, positions,
                                                 **{**kw, "softcap": None})[0]
    assert rel_err(uncapped, ref) > 1e-2


@pytest.mark.parametrize("d", [32, 256])
def test_chunk_softcap_interpret(d):
    b, t, s, hq, hkv = 1, 13, 30, 2, 1
    q = normal(1, (b, t, hq, d), jnp.float32, scale=3.0)
    kc, vc = normal(2, (b, s, hkv, d), jnp.float32), normal(3, (b, s, hkv, d), jnp.float32)
    positions = jnp.arange(10, 10 + t, dtype=jnp.int32)[None]
    out = chunk_attention(q, kc, vc, positions, softcap=CAP, sliding_window=8, interpret=True,
                          block_sizes=SMALL_FLASH)
    ref = chunk_attention_reference(q, kc, vc, positions, softcap=CAP, sliding_window=8)
    assert rel_err(out, ref) < TOL[jnp.float32]
    assert rel_err(chunk_attention_reference(q, kc, vc, positions, sliding_window=8), ref) > 1e-2


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_geglu_kernel_interpret(activation):
    import jax

    from pallas_kernels import MatmulBlockSizes, swiglu, swiglu_reference

    x = normal(1, (5, 40), jnp.float32)
    wg, wu = normal(2, (40, 37), jnp.float32, 0.3), normal(3, (40, 37), jnp.float32, 0.3)
    blocks = MatmulBlockSizes(block_m=16, block_n=16, block_k=16)
    out = swiglu(x, wg, wu, activation=activation, interpret=True, block_sizes=blocks)
    ref = swiglu_reference(x, wg, wu, activation=activation)
    assert rel_err(out, ref) < TOL[jnp.float32]
    gate = jax.nn.gelu if activation == "gelu_tanh" else jax.nn.silu
    want = gate(x @ wg) * (x @ wu)  # jax.nn.gelu's default is the tanh approximation
    assert rel_err(ref, want) < 1e-5
    with pytest.raises(ValueError, match="activation must be one of"):
        swiglu(x, wg, wu, activation="relu", interpret=True)
