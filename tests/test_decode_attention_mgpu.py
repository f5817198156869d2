"""pallas_kernels/decode_attention_mgpu.py against decode_attention_append's jnp reference: the
attention output, and both caches (the new slot written, nothing else touched), under the
Mosaic GPU interpreter on the CPU (small shapes) and on the GPU (the Llama-3-8B decode shapes,
`pytest -m gpu`); it lowers for an H200; and what it does not take is refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_testing import rel_err
from pallas_kernels.decode_attention_append import decode_attention_append_reference
from pallas_kernels.decode_attention_mgpu import (DecodeMosaicConfig,
                                                  decode_attention_append_mgpu, supports)
from test_gpu_lowering import S, lower_for_h200

BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32


def rope_tables(positions, d):
    inv_freq = 1.0 / 10000 ** (jnp.arange(0, d, 2, dtype=F32) / d)
    emb = positions[:, None].astype(F32) * inv_freq[None]
    emb = jnp.concatenate([emb, emb], axis=-1)  # [B, D], halves equal
    return jnp.cos(emb), jnp.sin(emb)


def inputs(b, hkv, g, d, slots, parts, positions, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    shape = (parts, b, hkv, g + 2, d) if parts else (b, hkv, g + 2, d)
    qkv = jax.random.normal(k[0], shape, F32)
    if not parts:
        qkv = qkv.astype(BF16)
    kc = jax.random.normal(k[1], (b, slots, hkv, d), F32).astype(BF16)
    vc = jax.random.normal(k[2], (b, slots, hkv, d), F32).astype(BF16)
    pos = jnp.asarray(positions, I32)
    norm = None
    if parts:
        norm = (jax.random.uniform(k[3], (parts, b), F32, 0.5, 2.0) * 4096, 4096, 1e-5)
    return qkv, kc, vc, pos, rope_tables(pos, d), norm


def check(got, want, pos):
    out, kc, vc = got
    w_out, w_kc, w_vc = want
    assert out.shape == w_out.shape and out.dtype == w_out.dtype
    assert rel_err(out, w_out) < 1e-2
    # The caches: bit for bit (slot pos of each row written, every other slot as it was).
    np.testing.assert_array_equal(np.asarray(kc, np.float32), np.asarray(w_kc, np.float32))
    np.testing.assert_array_equal(np.asarray(vc, np.float32), np.asarray(w_vc, np.float32))


@pytest.mark.parametrize("positions, cfg", [
    ((200, 63), DecodeMosaicConfig()),  # several tiles; the new slot at a tile's end
    ((0, 64), DecodeMosaicConfig()),  # the first slot; the first slot of a tile
    ((255, 130), DecodeMosaicConfig(block_kv=128, stages=1)),  # the ring's one slot refilled
    ((129, 7), DecodeMosaicConfig(block_kv=64, stages=2)),
], ids=["tiles", "edges", "one-stage", "two-stages"])
def test_interpret_matches_reference(positions, cfg):
    qkv, kc, vc, pos, rope, norm = inputs(2, 2, 4, 128, 256, 2, positions)
    got = decode_attention_append_mgpu(qkv, kc, vc, pos, rope=rope, norm=norm, config=cfg,
                                       interpret=True)
    check(got, decode_attention_append_reference(qkv, kc, vc, pos, rope=rope, norm=norm), pos)


def test_interpret_one_16bit_part_without_norm():
    qkv, kc, vc, pos, rope, _ = inputs(1, 2, 2, 128, 128, 0, (77,))
    got = decode_attention_append_mgpu(qkv, kc, vc, pos, rope=rope, interpret=True)
    check(got, decode_attention_append_reference(qkv, kc, vc, pos, rope=rope), pos)


def test_lowers_for_h200_at_the_8b_shapes():
    def run(qkv, kc, vc, pos, cos, sin, ss):
        return decode_attention_append_mgpu(qkv, kc, vc, pos, rope=(cos, sin),
                                            norm=(ss, 4096, 1e-5))

    text = lower_for_h200(run, S((2, 1, 8, 6, 128), F32), S((1, 512, 8, 128), BF16),
                          S((1, 512, 8, 128), BF16), S((1,), I32), S((1, 128), F32),
                          S((1, 128), F32), S((2, 1), F32))
    assert "mosaic_gpu" in text


def test_refuses_what_it_does_not_take():
    cfg = DecodeMosaicConfig()
    cache = S((1, 256, 8, 128), BF16)
    assert supports((1, 8, 6, 128), cache, cfg, window=4096) == "sliding window"
    assert "head dim 64" in supports((1, 8, 6, 64), S((1, 256, 8, 64), BF16), cfg, None)
    assert "multiple of 64" in supports((1, 8, 6, 128), S((1, 200, 8, 128), BF16), cfg, None)
    assert supports((1, 8, 6, 128), cache, cfg, None) is None
    qkv, kc, vc, pos, rope, _ = inputs(1, 2, 2, 128, 128, 0, (3,))
    with pytest.raises(ValueError, match="needs rope"):
        decode_attention_append_mgpu(qkv, kc, vc, pos, rope=None)
    with pytest.raises(ValueError, match="block_kv"):
        DecodeMosaicConfig(block_kv=96)


@pytest.mark.gpu
@pytest.mark.parametrize("positions", [(128,), (200,), (383,), (1000,)])
def test_gpu_matches_reference_8b_shapes(positions):
    """Llama-3-8B at batch 1: 8 KV heads of 4 queries, the q/k/v projection's two float32
    chunks with its deferred norm, a cache of 1024 slots."""
    qkv, kc, vc, pos, rope, norm = inputs(1, 8, 4, 128, 1024, 2, positions)
    want = jax.jit(lambda *a: decode_attention_append_reference(*a, rope=rope, norm=norm))(
        qkv, kc, vc, pos)
    got = jax.jit(lambda *a: decode_attention_append_mgpu(*a, rope=rope, norm=norm))(
        qkv, kc, vc, pos)
    check(got, want, pos)
