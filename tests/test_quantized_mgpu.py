"""The Mosaic GPU int4 / int8 / fp8 matmul (pallas_kernels/quantized_mgpu.py): its "nk" layout against the
tiles layout, the kernel against its reference in interpret mode, and the model's decode path
taking it (policy quant_matmul="mosaic") against the reference path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jaxinfer.plan import Plan
from jaxinfer.generate import int_layout_params
from jaxinfer.models import llama
from jaxinfer.weights import quantize_params, typed
from jaxinfer.cache import KVCache
from kernel_testing import jitted_calls_in, normal, rel_err
from pallas_kernels.quantized import dequantize, quantize_weight
from pallas_kernels.quantized_mgpu import MgpuMatmulConfig
from test_kernel_wiring import INTERPRET, assert_close_to_reference, decode_steps, random_params, tiny_config


def _int4(seed, k, n, bf16_scales=False, bits=4):
    """bits 4 or 8 (int, groups of 128), "fp8" (e4m3, groups of 128) or "fp8_col" (e4m3, one
    scale per column)."""
    fp8 = bits in ("fp8", "fp8_col")
    qw = jax.tree.map(jnp.asarray, quantize_weight(
        np.asarray(normal(seed, (k, n), jnp.float32)), bits=8 if fp8 else bits,
        group_size=None if bits == "fp8_col" else 128, float8=fp8))
    return qw.replace(scale=qw.scale.astype(jnp.bfloat16)) if bf16_scales else qw


@pytest.mark.parametrize("bits", [4, 8])
def test_nk_layout_dequantizes_bit_for_bit_and_converts_back(bits):
    qw = _int4(0, 384, 192, bits=bits)
    nk = pk.to_nk(qw)
    assert nk.layout == "nk" and nk.planes[0].shape == (192, 384)
    assert nk.planes[0].dtype == {4: jnp.int4, 8: jnp.int8}[bits]
    np.testing.assert_array_equal(dequantize(nk), dequantize(qw))
    back = pk.to_tiles(nk)
    assert back.layout == "tiles" and back.planes[0].dtype == qw.planes[0].dtype
    np.testing.assert_array_equal(back.planes[0], qw.planes[0])
    assert nk.nbytes() == 192 * 384 * bits // 8 + qw.scale.nbytes
    for bad, why in ((quantize_weight(np.ones((256, 128), np.float32), bits=4, group_size=32),
                      "groups of 128"),
                     (quantize_weight(np.ones((256, 96), np.float32), bits=4), "multiple of 64")):
        assert why in pk.nk_unfit(bad)
        with pytest.raises(ValueError, match=why):
            pk.to_nk(bad)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_col"])
def test_nk_layout_takes_fp8_bit_for_bit(fmt):
    """fp8 e4m3 values [N, K] as they are; a scale per column repeated per group of 128."""
    qw = _int4(0, 384, 192, bits=fmt)
    nk = pk.to_nk(qw)
    assert nk.planes[0].dtype == jnp.float8_e4m3fn and nk.scale.shape == (3, 192)
    np.testing.assert_array_equal(dequantize(nk), dequantize(qw))
    np.testing.assert_array_equal(pk.to_tiles(nk).planes[0].view(jnp.uint8),
                                  qw.planes[0].view(jnp.uint8))


@pytest.mark.parametrize("m, bf16_scales, bits, cfg", [
    (1, False, 4, None), (3, True, 4, None), (16, False, 4, None), (2, False, 8, None),
    (1, False, "fp8", None), (5, False, "fp8_col", None),
    (3, False, 4, MgpuMatmulConfig(gps=1)), (2, False, 8, MgpuMatmulConfig(gps=2, splits=2,
                                                                            stages=2))])
def test_kernel_matches_reference_interpret(m, bf16_scales, bits, cfg):
    nk = pk.to_nk(_int4(1, 512, 128, bf16_scales, bits))
    x = normal(2, (m, 512), jnp.bfloat16)
    want = pk.quantized_matmul_mgpu_reference(x, nk, out_dtype=jnp.float32)
    got = pk.quantized_matmul_mgpu(x, nk, cfg=cfg, interpret=True, out_dtype=jnp.float32)
    assert got.shape == (m, 128) and got.dtype == jnp.float32
    # Exact codes, each group's float32 product times its scale: float32 rounding only.
    assert rel_err(got, want) < 1e-5
    # The check can fail: the scales of another weight are far off.
    other = nk.replace(scale=pk.to_nk(_int4(3, 512, 128, bf16_scales, bits)).scale)
    assert rel_err(pk.quantized_matmul_mgpu(x, other, cfg=cfg, interpret=True), want) > 0.1


@pytest.mark.parametrize("interpret", [
    True, pytest.param(False, marks=[pytest.mark.gpu, pytest.mark.skipif(
        jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")])], ids=["interpret", "gpu"])
def test_two_weights_in_one_launch(interpret):
    """Gate and up as the SwiGLU takes them: one grid over both weights' blocks (N 128 and
    192), each output against its own reference."""
    a, b = pk.to_nk(_int4(6, 512, 128)), pk.to_nk(_int4(7, 512, 192))
    x = normal(8, (2, 512), jnp.bfloat16)
    ya, yb = pk.quantized_matmul_mgpu(x, (a, b), interpret=interpret, out_dtype=jnp.float32)
    assert ya.shape == (2, 128) and yb.shape == (2, 192)
    for y, w in ((ya, a), (yb, b)):
        assert rel_err(y, pk.quantized_matmul_mgpu_reference(x, w, out_dtype=jnp.float32)) < 1e-4


def test_decode_path_takes_the_mosaic_kernel_and_matches_reference():
    """int4 g128 everywhere (q/k/v, o, gate/up, down, the LM head): each decode-path product
    through the kernel (counted in the traced step); logits against the reference path."""
    config = tiny_config(hidden_size=128, intermediate_size=256, num_layers=1, vocab_size=128)
    params = quantize_params(typed(random_params(config), llama.param_specs(config)), "int4", 128)
    plan = Plan(config, INTERPRET.replace(quant_matmul="mosaic", dequant_block_bytes=0))
    nk = int_layout_params(params, plan)
    assert nk["embed"].layout == "tiles"  # a table's columns are gathered, not multiplied
    layouts = {w.layout for w in jax.tree.leaves(
        {k: v for k, v in nk.items() if k != "embed"},
        is_leaf=lambda a: isinstance(a, pk.QuantizedWeight)) if isinstance(w, pk.QuantizedWeight)}
    assert layouts == {"nk"}, layouts
    ids = jax.random.randint(jax.random.key(2), (2, 5), 0, config.vocab_size)
    cache = KVCache.init(config, 2, 16)
    tokens = jnp.ones((2, 1), jnp.int32)
    calls = jitted_calls_in(lambda p, c: llama.forward(p, tokens, tokens, plan, c), nk, cache)
    # one decode step through the kernel: q/k/v, o, gate and up (one launch), down, the head
    assert calls["int_matmul_mgpu"] == 5, calls
    fused, _ = decode_steps(nk, plan, ids)
    assert_close_to_reference(params, config, ids, fused)
    # And back: a Triton plan gets the tiles layout again.
    tiles = int_layout_params(nk, Plan(config, INTERPRET.replace(quant_matmul="triton")))
    np.testing.assert_array_equal(tiles["layers"][0]["w_down"].planes[0],
                                  params["layers"][0]["w_down"].planes[0])


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("bits", [4, 8, "fp8"])
@pytest.mark.parametrize("m, k, n, cfg", [
    (1, 4096, 1024, None), (16, 2048, 512, None), (64, 1024, 256, None),
    (3, 1024, 256, MgpuMatmulConfig(gps=1, stages=3, splits=2))])
def test_kernel_matches_reference_gpu(bits, m, k, n, cfg):
    """The compiled kernel on the H200 (default configurations and a one-group step)."""
    nk = pk.to_nk(_int4(4, k, n, bits=bits))
    x = normal(5, (m, k), jnp.bfloat16)
    want = pk.quantized_matmul_mgpu_reference(x, nk, out_dtype=jnp.float32)
    assert rel_err(pk.quantized_matmul_mgpu(x, nk, cfg=cfg, out_dtype=jnp.float32), want) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
def test_decode_path_takes_the_mosaic_kernel_gpu():
    """On the H200 the default policy repacks int4 g128 weights and decodes through the
    kernel; logits against the reference path."""
    config = tiny_config(hidden_size=128, intermediate_size=256, num_layers=2, vocab_size=128)
    params = quantize_params(typed(random_params(config), llama.param_specs(config)), "int4", 128)
    plan = Plan(config)
    nk = int_layout_params(params, plan)
    assert nk["layers"][0]["w_down"].layout == "nk"
    ids = jax.random.randint(jax.random.key(2), (2, 13), 0, config.vocab_size)
    fused, _ = decode_steps(nk, plan, ids)
    assert_close_to_reference(params, config, ids, fused)
