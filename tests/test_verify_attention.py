"""verify_attention (pallas_kernels/verify_attention.py): a few queries per row against a
long cache, split over the keys; against its reference (chunk attention's) in interpret mode
at shapes that are not multiples of the tiles, and lowered for an H200 on the CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from kernel_testing import normal, rel_err
from pallas_kernels.decode_attention import DecodeBlockSizes
from pallas_kernels.kv_quant import quantize_kv
from test_gpu_lowering import BF16, I32, S, kernel_names, lower_for_h200, verify_triton_modules

__all__ = ["verify_triton_modules"]  # the lowering checks' MLIR verifier (an autouse fixture)

B, T, HQ, HKV, D, SLOTS = 3, 4, 6, 2, 32, 100
# Rows at the start, the middle and the end of the cache, each causal among its 4 queries.
POSITIONS = jnp.array([[0, 1, 2, 3], [40, 41, 42, 43], [93, 94, 95, 96]], jnp.int32)


@pytest.mark.parametrize("kw", [
    {}, {"sliding_window": 7}, {"softcap": 20.0},
    {"block_sizes": DecodeBlockSizes(block_k=16, num_splits=3)},
    {"block_sizes": DecodeBlockSizes(block_k=16, split_keys=32), "sliding_window": 30},
    {"quantized": True, "block_sizes": DecodeBlockSizes(block_k=16, num_splits=2)}],
    ids=["default", "window", "softcap", "splits", "split_keys-window", "int8"])
def test_verify_attention_matches_reference(kw):
    kw = dict(kw)
    q = normal(0, (B, T, HQ, D), jnp.bfloat16)
    k = normal(1, (B, SLOTS, HKV, D), jnp.bfloat16)
    v = normal(2, (B, SLOTS, HKV, D), jnp.bfloat16)
    if kw.pop("quantized", False):
        (k, ks), (v, vs) = quantize_kv(k, jnp.int8), quantize_kv(v, jnp.int8)
        kw.update(k_scale=ks, v_scale=vs)
    out = pk.verify_attention(q, k, v, POSITIONS, interpret=True, **kw)
    kw.pop("block_sizes", None)
    ref = pk.verify_attention_reference(q, k, v, POSITIONS, **kw)
    assert rel_err(out, ref) < 1e-2


def test_verify_attention_lowers_for_h200():
    """Llama-3-8B shapes, batch 8, 5 queries (K = 4) at an 8k cache."""
    module = lower_for_h200(
        lambda q, k, v, p: pk.verify_attention(q, k, v, p),
        S((8, 5, 32, 128), BF16), S((8, 8192, 8, 128), BF16), S((8, 8192, 8, 128), BF16),
        S((8, 5), I32))
    assert kernel_names(module)["verify_attention"] == 1


@pytest.mark.parametrize("batch", [1, 8])
def test_llama3_8b_verification_forward_lowers_with_the_kernel(batch):
    """The model's verification forward (T = 5: the last token and 4 drafts) of one Llama-3-8B
    layer against a 4k cache, the ops forced onto the kernels: the attention is
    verify_attention."""
    from jaxinfer.cache import KVCache
    from jaxinfer.configs import PRESETS
    from jaxinfer.models import llama
    from jaxinfer.plan import Kernels, KernelPolicy, Plan
    from jaxinfer.weights import abstract_params

    config = PRESETS["llama3-8b"].replace(dtype="bfloat16", num_layers=1)
    plan = Plan(config, KernelPolicy(kernels=Kernels.PALLAS))
    cache = jax.eval_shape(lambda: KVCache.init(config, batch, 4096))

    def verify(params, tokens, positions, cache):
        return llama.forward(params, tokens, positions, plan, cache)

    module = lower_for_h200(verify, abstract_params(llama.param_specs(config), BF16),
                            S((batch, 5), I32), S((batch, 5), I32), cache)
    names = kernel_names(module)
    assert names["verify_attention"] == 1 and not names["chunk_attention"], names
