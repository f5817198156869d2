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


@pytest.mark.parametrize("dtype, kind, window, blocks", [
    (jnp.bfloat16, None, None, None),
    (jnp.float32, None, 9, DecodeBlockSizes(block_k=16, num_splits=3)),
    (jnp.bfloat16, "int8", None, DecodeBlockSizes(block_k=32, split_keys=64))],
    ids=["bf16", "f32-window-splits", "int8-split_keys"])
def test_paged_verify_attention_matches_reference(dtype, kind, window, blocks):
    """Pages in random order, unwritten slots NaN (test_paged_chunk_attention's cache), rows
    sharing prefix pages, a row with fewer queries (padding -1) and an idle row."""
    from test_paged_chunk_attention import make_cache, query_positions, split_pages

    lengths = [37, 45, 20, 0]  # each row's positions so far, its queries' included
    pages, tables, _ = make_cache(3, lengths, page_size=16, max_pages=4, hkv=2, d=64,
                                  dtype=dtype, kind=kind, shared_pages=1)
    k_pages, v_pages, scales = split_pages(pages)
    positions = query_positions([33, 41, 18, 0], [4, 4, 2, 0], 4)  # [B, 4]
    q = normal(4, (4, 4, 8, 64), dtype)
    out = pk.paged_verify_attention(q, k_pages, v_pages, tables, positions, interpret=True,
                                    sliding_window=window, block_sizes=blocks, **scales)
    ref = pk.paged_verify_attention_reference(q, k_pages, v_pages, tables, positions,
                                              sliding_window=window, **scales)
    assert rel_err(out, ref) < (1e-2 if dtype == jnp.bfloat16 else 1e-5)
    assert not jnp.any(out[3]) and not jnp.any(out[2, 2:])  # padding queries: zeros


def test_paged_verify_attention_lowers_for_h200():
    """64 rows, 5 queries each, pages of 64 over a 32k table."""
    module = lower_for_h200(
        lambda q, k, v, bt, p: pk.paged_verify_attention(q, k, v, bt, p),
        S((64, 5, 32, 128), BF16), S((4097, 64, 8, 128), BF16), S((4097, 64, 8, 128), BF16),
        S((64, 512), I32), S((64, 5), I32))
    assert kernel_names(module)["paged_verify_attention"] == 1


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_model_verification_takes_the_kernel_and_matches_the_reference(paged):
    """A tiny bf16 model's T = 3 forward at per-row positions (one row idle when paged)
    against a cache the reference path filled: interpret-mode kernels vs the references."""
    from jaxinfer.cache import KVCache, PagedKVCache
    from jaxinfer.configs import Config
    from jaxinfer.models import llama
    from jaxinfer.plan import KernelPolicy, Plan
    # init_params: jaxinfer.weights.init_params's bits, fewer compiles
    from kernel_testing import init_params, pallas_kernels_in

    config = Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=64,
                    tie_word_embeddings=False, dtype="bfloat16")
    params = init_params(llama.param_specs(config), jax.random.key(0), jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(1), (2, 12), 0, config.vocab_size)
    ref_plan = Plan(config, KernelPolicy.reference())
    kernel_plan = Plan(config, KernelPolicy(interpret=True))
    pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    if paged:
        tables = jnp.array([[2, 0], [1, 0]], jnp.int32)  # pages of 16
        cache = PagedKVCache.init(config, 3, 16).with_tables(tables)
    else:
        cache = KVCache.init(config, 2, 16)
    # jitted: one program per shape (op by op, each op compiles alone); the same computations
    forward = jax.jit(llama.forward, static_argnames=("plan",))
    _, cache = forward(params, ids[:, :9], pos[:, :9], ref_plan, cache)
    verify_pos = jnp.array([[5, 6, 7], [8, 9, 10]], jnp.int32)
    if paged:
        verify_pos = verify_pos.at[1].set(-1)  # an idle row
    tokens = jnp.take_along_axis(ids, jnp.maximum(verify_pos, 0), axis=1)
    names = pallas_kernels_in(
        lambda c: llama.forward(params, tokens, verify_pos, kernel_plan, c), cache)
    want = "paged_verify_attention" if paged else "verify_attention"
    assert names[want] == config.num_layers, names
    got, _ = forward(params, tokens, verify_pos, kernel_plan, cache)
    ref, _ = forward(params, tokens, verify_pos, ref_plan, cache)
    rows = 1 if paged else 2
    assert rel_err(got[:rows], ref[:rows]) < 3e-2
