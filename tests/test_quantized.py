"""Quantized weights: the kernels against their references (interpret mode), the model's
kernel path on quantized weights against its reference path, quantize-on-load of the HF
fixtures against the float model, and the bad inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
import pallas_kernels as pk
from jaxinfer.plan import KernelPolicy, Plan
from jaxinfer.weights import quantize_params, typed
from jaxinfer.models import llama
from kernel_testing import normal, pallas_kernels_in, rel_err
from pallas_kernels.quantized import dequantize, quantize_weight
from test_kernel_wiring import INTERPRET, assert_close_to_reference, decode_steps, random_params, tiny_config

FORMATS = {"int8": dict(bits=8), "int8_g32": dict(bits=8, group_size=32),
           "int4": dict(bits=4), "int4_g32": dict(bits=4, group_size=32),
           "int4_asym": dict(bits=4, symmetric=False, group_size=32),
           "fp8": dict(bits=8, float8=True, group_size=None)}


def _quantized(seed, k, n, fmt):
    w = np.asarray(normal(seed, (k, n), jnp.float32))
    return jax.tree.map(jnp.asarray, quantize_weight(w, **FORMATS[fmt])), w


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m, k, n", [(1, 256, 72), (17, 96, 40)])
def test_quantized_matmul_matches_reference(fmt, m, k, n):
    if "group_size" not in FORMATS[fmt] and k % 128:
        pytest.skip("group 128 does not divide K")
    qw, w = _quantized(1, k, n, fmt)
    for dtype, tol in ((jnp.bfloat16, 1e-2), (jnp.float32, 1e-5)):
        x = normal(2, (m, k), dtype)
        out = pk.quantized_matmul(x, qw, interpret=True)
        assert out.dtype == dtype and out.shape == (m, n)
        assert rel_err(out, pk.quantized_matmul_reference(x, qw)) < tol
    # The quantization itself: close to w (int4 coarsely).
    err = rel_err(dequantize(qw), w)
    assert err < {"int8": 0.01, "int4": 0.12, "fp8": 0.05}[fmt[:4].rstrip("_")], err


@pytest.mark.parametrize("fmt", ["int8_g32", "int4_g32", "fp8"])
def test_fused_norm_partials_and_swiglu_take_quantized_weights(fmt):
    m, k, n = 3, 96, 80
    x = normal(3, (m, k), jnp.bfloat16)
    nw = normal(4, (k,), jnp.bfloat16)
    deltas = normal(5, (2, m, k), jnp.float32)
    qw, _ = _quantized(6, k, n, fmt)
    x_new, y = pk.norm_matmul(x, nw, qw, deltas=deltas, interpret=True)
    x_ref, y_ref = pk.norm_matmul_reference(x, nw, qw, deltas=deltas)
    assert rel_err(x_new, x_ref) < 1e-2 and rel_err(y, y_ref) < 1e-2
    parts, ss = pk.norm_matmul(x, nw, qw, partials=True, interpret=True)
    from pallas_kernels.norm_matmul import apply_norm_partials
    assert rel_err(apply_norm_partials(parts, ss, k, 1e-6), pk.norm_matmul_reference(x, nw, qw)) < 1e-2
    gate, _ = _quantized(7, k, n, fmt)
    up, _ = _quantized(8, k, n, fmt)
    out = pk.swiglu(x, gate, up, norm_weight=nw, interpret=True)
    assert rel_err(out, pk.swiglu_reference(x, gate, up, norm_weight=nw)) < 2e-2


def test_kernel_path_on_quantized_weights_matches_reference_path():
    # int4 g32 everywhere, but the down projections fp8 and the LM head int8: each format
    # through the fused decode kernels (norm prologue, split-K partials, SwiGLU) in one run.
    config = tiny_config(num_layers=1)
    specs = llama.param_specs(config)
    base = typed(random_params(config), specs)
    params = quantize_params(base, "int4", 32)
    fp8 = quantize_params(base, "fp8")
    for lp, lf in zip(params["layers"], fp8["layers"]):
        lp["w_down"] = lf["w_down"]
    params["lm_head"] = quantize_params(base, "int8", 32)["lm_head"]
    plan = Plan(config, INTERPRET.replace(one_kernel_mlp_rows=0))
    ids = jax.random.randint(jax.random.key(2), (2, 5), 0, config.vocab_size)
    fused, _ = decode_steps(params, plan, ids)
    assert_close_to_reference(params, config, ids, fused)
    cache = jaxinfer.cache.KVCache.init(config, 2, 16)
    tokens = jnp.ones((2, 1), jnp.int32)
    names = pallas_kernels_in(lambda p, c: llama.forward(p, tokens, tokens, plan, c), params,
                              cache)
    kinds = {}
    for name, count in names.items():
        if "matmul" in name:
            kinds[name.rsplit("_", 1)[1]] = kinds.get(name.rsplit("_", 1)[1], 0) + count
    # q/k/v, o, SwiGLU int4 per layer; down fp8 per layer; the LM head int8.
    assert kinds == {"int4": 3 * config.num_layers, "fp8": config.num_layers, "int8": 1}, names
