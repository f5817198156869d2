"""Quantized weights on the CPU path (jaxinfer/ops/blocked.py): tiles that dequantize to
gguf.quants' values, and a decode step / prefill that hold the codes, not every layer's float
copy (the compiled executables' memory analysis against the float32 load's bytes)."""

from __future__ import annotations

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import gguf_blocks
from jaxinfer.generate import decode_loop, init_state, prefill, run_params
from jaxinfer.model import from_params
from jaxinfer.ops import blocked
from jaxinfer.plan import KernelPolicy
from jaxinfer.sampling import SamplingParams
from jaxinfer.weights import param_bytes
from test_gguf_blocks import random_blocks
from test_kernel_wiring import random_params, tiny_config

QT = gguf.GGMLQuantizationType
BLOCKED = KernelPolicy(dequant_block_bytes=64 * 1024)  # small tiles: several per weight


def _weight(type_name: str, n: int, k: int, seed: int = 0):
    """A GGUF tensor of n rows of k: (QuantizedWeight [k, n], gguf.quants' float32 [k, n])."""
    raw = random_blocks(type_name, n, k, np.random.default_rng(seed))
    want = gguf.quants.dequantize(raw, QT[type_name]).reshape(n, k).T
    qw = jax.tree.map(jnp.asarray, gguf_blocks.repack(raw, type_name, k, n))
    return qw, np.ascontiguousarray(want)


@pytest.mark.parametrize("type_name", gguf_blocks.BLOCK_TYPES)
@pytest.mark.parametrize("k, n, rows", [(256, 600, False), (1024, 64, True)],
                         ids=["wide-column-tiles", "tall-row-tiles"])
def test_tiles_are_gguf_quants_values(type_name, k, n, rows):
    """A tile dequantizes to gguf.quants' values bit for bit, and the tiled product equals
    x @ those values (column tiles with a narrower last one; row tiles summed in order)."""
    qw, want = _weight(type_name, n, k)
    np.testing.assert_array_equal(np.asarray(blocked.dequantize_tile(qw, jnp.float32)), want)
    block = BLOCKED.dequant_block_bytes
    assert (blocked.block_rows(qw, block) is not None) == rows
    if not rows:
        assert n % blocked.block_columns(k, n, block)  # a last tile narrower than the others
    x = np.random.default_rng(1).standard_normal((3, k)).astype(np.float32)
    got = np.asarray(jax.jit(blocked.blocked_matmul, static_argnums=2)(jnp.asarray(x), qw,
                                                                       block))
    ref = x.astype(np.float64) @ want.astype(np.float64)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("sizes, want_mib", [
    ({1: "48K", 2: "1024K", 3: "32768K"}, 16),  # a 32 MiB L3 (Zen 4): half of it
    ({1: "48K", 2: "2048K", 3: "107520K"}, 32),  # 105 MiB: at most 32
    ({1: "32K", 2: "4M"}, 8),  # no L3, a 4 MiB L2: at least 8
    ({2: "64M", 3: "garbage"}, 32),  # an unreadable size is skipped: the L2's half
    ({}, 16),  # nothing to read (not Linux): 16
])
def test_cpu_tile_is_half_the_last_level_cache(tmp_path, sizes, want_mib):
    """The CPU's default tile (blocked.cpu_block_bytes) from a sysfs cache folder."""
    for i, (level, size) in enumerate(sizes.items()):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "size").write_text(f"{size}\n")
    assert blocked.cpu_block_bytes(str(tmp_path)) == want_mib << 20


@pytest.fixture(scope="module")
def quantized_model():
    """A tiny float32 llama of 6 layers, its matmul weights int4 (group 32), and the bytes of
    its float32 matmul weights: all layers', and one layer's. Quantized once for the module
    (op by op, ~2 s)."""
    config = tiny_config(dtype="float32", num_layers=6, hidden_size=256, intermediate_size=1024,
                         head_dim=64, vocab_size=512, max_position_embeddings=512)
    params = random_params(config)
    model = from_params(config, params, dtype="float32", quantization="int4", group_size=32)
    dense = from_params(config, params, dtype="float32")
    layer = param_bytes({n: w for n, w in dense.params["layers"][0].items()
                         if n.startswith("w")})
    return model, layer * config.num_layers, layer


def _compiled(model, policy, prompt_len: int):
    """(params as the request runs them, prefill's and decode loop's executables)."""
    plan = dataclasses.replace(model.plan, policy=policy)
    ids = np.arange(1, prompt_len + 1).tolist()
    state, tokens, lengths = init_state(model, [ids], 8, [SamplingParams(temperature=0.0)], 0,
                                        [])
    params = run_params(model, plan)
    first = prefill.lower(params, tokens, lengths, state, plan).compile()
    # the loop lowered on prefill's output shapes: nothing run (the same program)
    after = jax.eval_shape(lambda *a: prefill(*a, plan), params, tokens, lengths, state)
    loop = decode_loop.lower(params, after, plan).compile()
    return params, first, loop


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU path")
def test_cpu_decode_holds_the_codes_not_every_layers_float_weights(quantized_model):
    """The CPU default keeps a quantized model's codes through a request: the decode loop's
    temporaries stay under one layer's float32 weights and the prefill's (128 tokens, each
    weight dequantized whole after its input) under one layer's plus activations, where
    dequantizing every layer (XLA hoists it out of the decode loop, or schedules it up
    front) would hold all six layers' float copies. The old path (dequant_block_bytes=0:
    the whole model dequantized per request) shows what the measure sees when it does."""
    model, all_layers, one_layer = quantized_model
    codes = param_bytes(model.params)
    params, first, loop = _compiled(model, KernelPolicy(), prompt_len=100)
    assert param_bytes(params) == codes < all_layers / 4
    assert loop.memory_analysis().temp_size_in_bytes < one_layer
    activations = 128 * (4 * 256 + 512 + 3 * 1024) * 4  # prefill rows x widths, float32
    assert first.memory_analysis().temp_size_in_bytes < one_layer + activations
    assert one_layer + activations < all_layers / 2  # the bounds tell them apart

    params, _, loop = _compiled(model, KernelPolicy(dequant_block_bytes=0), prompt_len=100)
    held = loop.memory_analysis()
    assert param_bytes(params) > all_layers
    assert held.argument_size_in_bytes + held.temp_size_in_bytes > all_layers


def _assert_as_dequantized_whole(model, prompts):
    """Greedy tokens (and logprobs to float32 rounding) of prompts (a short one: decode
    steps; one of ~100 tokens: a prefill of 128 rows) as the model gives them dequantized
    whole once per request (dequant_block_bytes=0), with x as it is (the default). With x
    rounded to int8 (cpu_int8_activations) the C++ kernel's rows
    and XLA's tiles (cpu_quantized_rows=0) give each other's tokens and logprobs (to a
    rounding step: x that differs in its last bits may round to the next int8), and the
    whole model's tokens, their logprobs moved by the rounding (up to ~3% on these random
    tiny models)."""
    import jaxinfer

    sampling = SamplingParams(temperature=0.0, logprobs=True)

    def run(**policy):
        return jaxinfer.generate(model, prompts, max_new_tokens=6, sampling=sampling,
                                 policy=KernelPolicy(**policy))
    whole, as_is = run(dequant_block_bytes=0), run()
    rounded = run(cpu_int8_activations=True)
    tiles = run(cpu_int8_activations=True, cpu_quantized_rows=0)
    for a, b, r, t in zip(as_is, whole, rounded, tiles):
        assert a.token_ids == b.token_ids == r.token_ids == t.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
        np.testing.assert_allclose(r.logprobs, t.logprobs, atol=1e-2)
        np.testing.assert_allclose(r.logprobs, b.logprobs, rtol=0.05)
        assert not np.allclose(r.logprobs, b.logprobs, atol=1e-4)  # x was rounded


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU path")
def test_cpu_tiles_give_the_whole_weights_tokens(quantized_model):
    """Generating from the codes (decode steps on the C++ kernel, a prefill's weights
    dequantized one at a time) gives the tokens (and logprobs to float32 rounding) of the
    same model dequantized whole once per request."""
    model, _, _ = quantized_model
    _assert_as_dequantized_whole(model, [[5, 6, 7, 8], list(range(1, 101))])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU path")
@pytest.mark.parametrize("int8", [False, True], ids=["x", "int8-x"])
def test_cpu_speculative_on_quantized_weights_equals_plain(quantized_model, int8):
    """Greedy prompt lookup on a quantized model: verifications of 8 rows x 4 queries (32
    rows: XLA's tiles, KernelPolicy.cpu_quantized_rows = 16) give the tokens plain decoding's
    8 rows (the C++ kernel) give, with x as it is and rounded to int8 (both paths round it
    alike)."""
    import jaxinfer

    model, _, _ = quantized_model
    prompts = [[3 + i, 9, 4, 3 + i, 9, 4, 3 + i, 9] for i in range(8)]  # lookups find matches
    kw = dict(max_new_tokens=12, sampling=SamplingParams(temperature=0.0),
              policy=KernelPolicy(cpu_int8_activations=int8))
    plain = jaxinfer.generate(model, prompts, **kw)
    spec = jaxinfer.generate(model, prompts, speculative="ngram", num_speculative_tokens=3, **kw)
    assert sum(c.draft_tokens for c in spec) > 0  # verification rounds ran
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU path")
def test_cpu_moe_requests_hold_the_experts_codes():
    """A quantized MoE model (the Mixtral fixture, int4) on the CPU: a request's params keep
    the stacked experts as codes (the decode step dequantizes the chosen experts' slices, a
    prefill one layer's experts after its input), the decode loop's temporaries stay under
    every layer's float experts, and the tokens and logprobs are those of the model
    dequantized whole per request (dequant_block_bytes=0)."""
    import pathlib

    import jaxinfer
    from pallas_kernels.quantized import num_experts

    path = pathlib.Path(__file__).parent / "fixtures" / "data" / "hf" / "mixtral"
    model = jaxinfer.load(str(path), dtype="float32", quantization="int4", group_size=32)
    params, _, loop = _compiled(model, KernelPolicy(), prompt_len=20)
    experts = [lp[n] for lp in params["layers"] for n in ("experts_gate", "experts_up",
                                                          "experts_down")]
    assert all(num_experts(w) for w in experts)  # still stacked QuantizedWeights
    float_experts = sum(w.k * w.n * num_experts(w) * 4 for w in experts)
    assert param_bytes(params) == param_bytes(model.params)
    assert loop.memory_analysis().temp_size_in_bytes < float_experts
    _assert_as_dequantized_whole(model, [list(range(1, 21)), list(range(5, 100))])
