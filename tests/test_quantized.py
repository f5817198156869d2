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
from jaxinfer.plan import Plan
from jaxinfer.weights import quantize_params, typed
from jaxinfer.model import from_params
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


@pytest.mark.parametrize("fmt, m, k, n", [
    *((f, 17, 96, 40) for f in FORMATS if "group_size" in FORMATS[f]),
    ("int8", 1, 256, 72), ("int4", 1, 256, 72)])
def test_quantized_matmul_matches_reference(fmt, m, k, n):
    qw, w = _quantized(1, k, n, fmt)
    for dtype, tol in ((jnp.bfloat16, 1e-2), (jnp.float32, 1e-5)):
        x = normal(2, (m, k), dtype)
        out = pk.quantized_matmul(x, qw, interpret=True)
        assert out.dtype == dtype and out.shape == (m, n)
        assert rel_err(out, pk.quantized_matmul_reference(x, qw)) < tol
    # The quantization itself: close to w (int4 coarsely).
    err = rel_err(dequantize(qw), w)
    assert err < {"int8": 0.01, "int4": 0.12, "fp8": 0.05}[fmt[:4].rstrip("_")], err


@pytest.mark.parametrize("fmt", ["int4_g32", "fp8"])
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
    # only the weights kept in each other format quantized to it (each weight on its own)
    fp8 = quantize_params([lp["w_down"] for lp in base["layers"]], "fp8")
    for lp, w_down in zip(params["layers"], fp8):
        lp["w_down"] = w_down
    params["lm_head"] = quantize_params(base["lm_head"], "int8", 32)
    plan = Plan(config, INTERPRET.replace(one_kernel_mlp_rows=0))
    ids = jax.random.randint(jax.random.key(2), (2, 5), 0, config.vocab_size)
    # jitted: one program per shape (op by op, the interpret-mode kernels' ops each compile
    # alone); the same computations
    forward = jax.jit(llama.forward, static_argnames=("plan", "fresh"))
    fused, _ = decode_steps(params, plan, ids, forward=forward)
    assert_close_to_reference(params, config, ids, fused, forward)
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


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m, k, n", [(1, 768, 200), (7, 512, 1000), (16, 1280, 96)])
def test_quantized_kernels_match_reference_gpu(fmt, m, k, n):
    """The compiled kernels (matmul, the norm prologue with deltas, SwiGLU) on the H200."""
    qw, _ = _quantized(1, k, n, fmt)
    x = normal(2, (m, k), jnp.bfloat16)
    nw = normal(3, (k,), jnp.bfloat16)
    deltas = normal(4, (2, m, k), jnp.float32)
    assert rel_err(pk.quantized_matmul(x, qw), pk.quantized_matmul_reference(x, qw)) < 1e-2
    x_new, y = pk.norm_matmul(x, nw, qw, deltas=deltas)
    x_ref, y_ref = pk.norm_matmul_reference(x, nw, qw, deltas=deltas)
    assert rel_err(x_new, x_ref) < 1e-2 and rel_err(y, y_ref) < 1e-2
    assert rel_err(pk.swiglu(x, qw, qw, norm_weight=nw),
                   pk.swiglu_reference(x, qw, qw, norm_weight=nw)) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("how", ["int8", "int4", "fp8"])
def test_kernel_path_on_quantized_weights_matches_reference_path_gpu(how):
    config = tiny_config()
    params = quantize_params(typed(random_params(config), llama.param_specs(config)), how, 32)
    ids = jax.random.randint(jax.random.key(2), (2, 13), 0, config.vocab_size)
    fused, _ = decode_steps(params, Plan(config), ids)
    assert_close_to_reference(params, config, ids, fused)


# ---------------------------------------------------------------------------------------------
# Quantize on load, `jaxinfer quantize`, bad input
# ---------------------------------------------------------------------------------------------

HF = __import__("pathlib").Path(__file__).parent / "fixtures" / "data" / "hf"


@pytest.mark.parametrize("how, group, max_err, min_agree", [
    ("int8", 32, 0.03, 0.93), ("int4", 32, 0.45, 0.45), ("fp8", None, 0.12, 0.8)])
def test_quantize_on_load_of_hf_fixtures_stays_close(how, group, max_err, min_agree):
    """Logits of the fixtures quantized on load against their float32 load (tiny random
    models: near-uniform logits, so argmax flips at small errors; the measured figures are in
    benchmarks/DECISIONS.md)."""
    tokens = np.random.default_rng(0).integers(0, 128, (4, 32))
    for name in ("llama_gqa_tied_llama3", "qwen3"):
        ref = np.asarray(jaxinfer.load(str(HF / name), dtype="float32")(tokens))
        model = jaxinfer.load(str(HF / name), dtype="float32", quantization=how, group_size=group)
        assert all(type(lp["wqkv"]).__name__ == "QuantizedWeight"
                   for lp in model.params["layers"])
        out = np.asarray(model(tokens))
        assert rel_err(out, ref) < max_err
        assert np.mean(out.argmax(-1) == ref.argmax(-1)) >= min_agree


def test_quantize_command_output_reloads_to_identical_logits(tmp_path, capsys):
    from jaxinfer.cli import main

    dst = tmp_path / "q"
    assert main(["quantize", str(HF / "qwen3"), str(dst), "--to", "int4",
                 "--group-size", "32"]) == 0
    tokens = np.arange(12).reshape(2, 6)
    direct = jaxinfer.load(str(HF / "qwen3"), dtype="float32", quantization="int4", group_size=32)
    reloaded = jaxinfer.load(str(dst), dtype="float32")
    assert type(reloaded.params["layers"][0]["w_down"]).__name__ == "QuantizedWeight"
    np.testing.assert_array_equal(np.asarray(reloaded(tokens)), np.asarray(direct(tokens)))
    # Dequantized on request: the same values as float Dense weights.
    plain = jaxinfer.load(str(dst), dtype="float32", quantization="none")
    assert rel_err(plain(tokens), reloaded(tokens)) < 1e-5
    assert main(["quantize", str(HF / "qwen3"), str(dst), "--to", "int8"]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err


def test_quantized_checkpoint_without_its_metadata_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    from jaxinfer.cli import main

    dst = tmp_path / "q"
    main(["quantize", str(HF / "qwen3"), str(dst), "--to", "int8", "--group-size", "32"])
    tensors = load_file(str(dst / "model.safetensors"))
    save_file(tensors, str(dst / "model.safetensors"))  # the metadata dropped
    with pytest.raises(ValueError, match="metadata"):
        jaxinfer.load(str(dst))


def test_bad_quantization_inputs_are_named():
    w = np.ones((96, 8), np.float32)
    with pytest.raises(ValueError, match="group_size=64 must be a multiple of 16 that divides K=96"):
        quantize_weight(w, bits=4, group_size=64)
    with pytest.raises(ValueError, match="bits=3"):
        quantize_weight(w, bits=3)
    with pytest.raises(ValueError, match="quantization='int3'"):
        jaxinfer.load(str(HF / "qwen3"), quantization="int3")
    with pytest.raises(ValueError, match=r"\['embed'\]: group size 48 does not divide its K=64"):
        jaxinfer.load(str(HF / "qwen3"), dtype="float32", quantization="int8", group_size=48)
    qw = quantize_weight(np.ones((64, 8), np.float32), bits=8, group_size=32)
    with pytest.raises(ValueError, match="x has K=32 features but the quantized weight has K=64"):
        pk.quantized_matmul(jnp.ones((1, 32), jnp.bfloat16), qw, interpret=True)
    bad = qw.replace(scale=qw.scale[:1])
    with pytest.raises(ValueError, match=r"shape \(1, 8\) where its layout needs \(2, 8\)"):
        pk.quantized_matmul(jnp.ones((1, 64), jnp.bfloat16), bad, interpret=True)


def test_parts_weight_equals_its_combined_weight():
    """q/k/v of different layouts (Parts: a GGUF Q4_K_M layer's Q4_K q / k, Q6_K v) give the
    logits of the same values fused into one float weight."""
    from jaxinfer.weights import Dense, Parts, as_array

    config = tiny_config(dtype="float32", num_layers=1)
    params = jax.tree.map(lambda a: a.astype(jnp.float32), random_params(config))
    d, hkv, hd = config.hidden_size, config.num_kv_heads, config.head_dim
    g = config.num_heads // hkv
    wqkv = np.asarray(params["layers"][0]["wqkv"].w)  # [D, Hkv, G + 2, hd]
    q = quantize_weight(wqkv[:, :, :g].reshape(d, -1), bits=4, group_size=32)
    k = quantize_weight(wqkv[:, :, g].reshape(d, -1), bits=8, group_size=32)
    v = Dense(jnp.asarray(wqkv[:, :, g + 1].reshape(d, -1)))
    parts = Parts((q, k, v), groups=hkv, widths=(g, 1, 1), inner=hd, out_shape=(hkv, g + 2, hd))
    combined = as_array(parts, jnp.float32)
    assert combined.shape == wqkv.shape
    np.testing.assert_array_equal(np.asarray(combined[:, :, g + 1]), wqkv[:, :, g + 1])
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 6)))
    specs = llama.param_specs(config)
    out = {}
    for name, w in (("parts", parts), ("combined", combined)):
        p = typed(dict(params, layers=[dict(params["layers"][0], wqkv=w)]), specs)
        out[name] = from_params(config, p, dtype="float32")(tokens)
    assert rel_err(out["parts"], out["combined"]) < 1e-5


def test_a_gguf_kept_quantized_is_budgeted_at_its_file_size_on_a_gpu(monkeypatch):
    """On a GPU the kernels read the blocks: the load needs about the file's bytes, not the
    float params' (the CPU: test_a_gguf_kept_quantized_is_budgeted_at_its_file_size_on_cpu)."""
    from jaxinfer import memory
    from jaxinfer.configs import PRESETS

    config = PRESETS["llama3-8b"]  # 16 GB in bf16; a Q4_K_M file is about 4.9 GB
    monkeypatch.setenv("JAXINFER_MEMORY_LIMIT", "8GB")

    class Gpu:
        platform, device_kind = "gpu", "NVIDIA H200"

        def memory_stats(self):
            return None

    monkeypatch.setattr(jax, "devices", lambda *a: [Gpu()])
    memory.check_load(config, "bfloat16", host_float32_copy=False, stored_bytes=4_900_000_000)
    with pytest.raises(memory.OutOfMemory, match="loading this model"):
        memory.check_load(config, "bfloat16", host_float32_copy=False)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's estimate")
def test_a_gguf_kept_quantized_is_budgeted_at_its_file_size_on_cpu(monkeypatch):
    """The CPU's matmuls dequantize a tile at a time, so a GGUF kept in its blocks is budgeted
    at its file size (and its largest tensor in flight while read), not the float params';
    with dequant_block_bytes=0 the requests hold the float weights, so the float estimate.
    The refusal's remedy is one for a CPU: no bfloat16."""
    from jaxinfer import memory
    from jaxinfer.configs import PRESETS

    config = PRESETS["llama3-8b"]  # 32 GB in float32; a Q4_K_M file is about 4.9 GB
    monkeypatch.setenv("JAXINFER_MEMORY_LIMIT", "8GB")
    memory.check_load(config, "float32", host_float32_copy=False, stored_bytes=4_900_000_000)
    for kwargs in ({}, {"stored_bytes": 4_900_000_000, "blocked": False}):
        with pytest.raises(memory.OutOfMemory, match="loading this model") as refused:
            memory.check_load(config, "float32", host_float32_copy=False, **kwargs)
        assert "bfloat16" not in str(refused.value) and "quantized GGUF" in str(refused.value)


def test_quantize_on_load_gives_quantize_weights_codes():
    """Load quantizes each weight in one compiled program a shape: the same codes and scales,
    bit for bit, as quantize_weight run op by op on the float load's weight."""
    float_load = jaxinfer.load(str(HF / "qwen3"), dtype="float32")
    for how, group, kw in (("int4", 32, dict(bits=4, group_size=32)),
                           ("fp8", None, dict(bits=8, group_size=None, float8=True))):
        model = jaxinfer.load(str(HF / "qwen3"), dtype="float32", quantization=how,
                              group_size=group)
        for name in ("wqkv", "w_down"):
            w = float_load.params["layers"][1][name]
            with jax.disable_jit():
                want = quantize_weight(w.w.T if w.transposed else w.w, **kw)
            got = model.params["layers"][1][name]
            assert jax.tree.structure(got) == jax.tree.structure(want), (how, name)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                assert a.dtype == b.dtype and a.shape == b.shape, (how, name)
                np.testing.assert_array_equal(np.asarray(a).view(np.uint8),
                                              np.asarray(b).view(np.uint8))


def test_quantize_on_load_reads_one_tensor_at_a_time(monkeypatch):
    """An HF checkpoint (here sharded in 5 files) quantized on load is read tensor by tensor
    (never all first), to the same weights as quantizing the float load."""
    import checkpoints.hf

    tokens = np.arange(10).reshape(2, 5)
    float_load = jaxinfer.load(str(HF / "llama_sharded"), dtype="float32")
    after = from_params(float_load.config, float_load.params, dtype="float32",
                        quantization="int8")
    monkeypatch.setattr(checkpoints.hf, "read_safetensors", lambda *a: pytest.fail("read all"))
    model = jaxinfer.load(str(HF / "llama_sharded"), dtype="float32", quantization="int8")
    np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(after(tokens)))
