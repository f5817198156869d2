"""Tensor, data and expert parallelism on 8 fake CPU devices (jaxinfer/sharding.py).

XLA's host device count is fixed when jax starts, so the checks run in one subprocess
(tests/sharding_check.py, which prints its results as JSON) and the tests here assert on
them; the suite's own process keeps its one device. XLA's backend optimizations are off in
that process: the checks compare results and read the partitioned HLO, and LLVM's passes were
most of its compile time.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
FIXTURES = ("llama_gqa_tied_llama3", "qwen2", "mixtral", "deepseek_v3")


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (
        str(ROOT), os.environ.get("PYTHONPATH")))),
        XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "sharding_check.py")], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_and_greedy_tokens_equal_one_device(results, name):
    """Greedy tokens from the compiled forward on every mesh; the MoE and MLA fixtures' also
    from generate(..., mesh=) on (tp=2, ep=4), and transformers' where the fixture has them."""
    entry = results["models"][name]
    assert entry["hf_rel"] <= 1e-4  # the single-device model itself is the right one
    assert entry.get("hf_tokens", entry["tokens"]) == entry["tokens"]
    assert len(entry["tokens"]) == 2 and all(len(t) == 6 for t in entry["tokens"])
    assert set(entry["meshes"]) == {'{"dp": 2, "tp": 4}', '{"ep": 4, "tp": 2}', '{"tp": 8}'}
    for mesh, got in entry["meshes"].items():
        assert got["rel"] <= 1e-5, f"{name} on {mesh}: relative error {got['rel']}"
        assert got["argmax_equal"], f"{name} on {mesh}"
        assert got["tokens"] == entry["tokens"], f"{name} on {mesh}"
    generated = {mesh for mesh, got in entry["meshes"].items() if "generate_tokens" in got}
    assert generated == ({'{"ep": 4, "tp": 2}'} if name in ("mixtral", "deepseek_v3") else set())
    for mesh in generated:
        assert entry["meshes"][mesh]["generate_tokens"] == entry["tokens"], f"{name} on {mesh}"


@pytest.mark.parametrize("name", FIXTURES)
def test_parameters_are_split(results, name, record_property):
    """Every device holds the same share, well under the whole (the tiny fixtures keep their
    attention whole where tp does not divide the KV heads, and the hidden axis is never
    split, so not exactly total / tp); the shares are recorded (junit properties, -s)."""
    entry = results["models"][name]
    total = entry["total_bytes"]
    shares = {mesh: round(got["bytes_max"] / total, 3) for mesh, got in entry["meshes"].items()}
    record_property("per_device_share", shares)
    print(f"{name}: {total} parameter bytes; per device: {shares}")
    for mesh, got in entry["meshes"].items():
        assert got["bytes_max"] == got["bytes_min"], f"{name} on {mesh}: unbalanced"
        assert got["bytes_max"] <= 0.6 * total, f"{name}: per-device share of total {shares}"
    if name == "mixtral":  # experts over ep and tp, split 8 ways (whole: 0.73 of the total)
        assert shares['{"ep": 4, "tp": 2}'] < 0.35, shares


def test_int4_model_shards_the_same_way(results):
    entry = results["int4"]["llama_gqa_tied_llama3"]
    (got,) = entry["meshes"].values()
    assert got["rel"] <= 1e-5 and got["argmax_equal"]
    assert got["tokens"] == entry["tokens"]
    assert got["bytes_max"] == got["bytes_min"] <= 0.6 * entry["total_bytes"]


@pytest.mark.parametrize("how", ["int8", "int4"])
def test_quantized_experts_shard(results, how):
    """Quantized experts (every array's expert axis over ep, F over tp where the rows split)
    give one device's logits and tokens, each device an equal share."""
    entry = results["quantized_moe"][how]["mixtral"]
    (got,) = entry["meshes"].values()
    assert got["rel"] <= 1e-5 and got["argmax_equal"]
    assert got["tokens"] == entry["tokens"]
    assert got["bytes_max"] == got["bytes_min"] <= 0.6 * entry["total_bytes"]


def test_quantized_experts_through_the_kernels_per_shard(results):
    """int8 experts through the Pallas experts kernels (interpret mode) under shard_map on
    (tp=2, ep=2): prefill and a decode step as one device's references give them; the four
    experts kernels of each of the two layers run inside the shard_map."""
    got = results["quantized_moe"]["interpret"]
    assert got["rel"] <= 1e-5 and got["argmax_equal"]
    assert got["pallas"]["inside"] >= 8 and got["pallas"]["outside"] == 0, got["pallas"]


def _count(collectives, kind):
    return sum(k == kind for k, _ in collectives)


def _elements(shape: str) -> int:
    n = 1
    for part in shape.split("[", 1)[1].split("]", 1)[0].split(","):
        n *= int(part) if part else 1
    return n


@pytest.mark.parametrize("case,all_reduces", [
    # an all-reduce after the attention's o projection and the MLP's down projection of
    # every layer, and one for the vocabulary-parallel embedding
    ('llama_gqa_tied_llama3 {"ep": 4, "tp": 2}', lambda h: 2 * h["layers"] + 1),
    # tp=8 over 2 KV heads: the attention is replicated, the MLP split
    ('llama_gqa_tied_llama3 {"tp": 8}', lambda h: h["layers"] + 1),
    # the experts' combined output summed once over ep and tp per MoE layer
    ('mixtral {"ep": 4, "tp": 2}', lambda h: h["layers"] + h["moe_layers"] + 1),
])
def test_decode_step_collectives(results, case, all_reduces):
    """In the optimized HLO of the decode loop (B=2; its body is one step): the expected
    all-reduces and nothing that moves a weight (every collective is at most the batch's
    logits, [2, 256])."""
    h = results["hlo"][case]
    ops = [(k, s) for k, s in h["collectives"]]
    assert _count(ops, "all-reduce") == all_reduces(h), ops
    assert _count(ops, "all-to-all") == 0 and _count(ops, "collective-permute") == 0, ops
    for kind, shape in ops:
        assert _elements(shape) <= 2 * 256, f"{kind} of {shape}: moves more than activations"
        assert shape.split("]")[0] + "]" not in h["weight_shapes"], (kind, shape)


def test_quantized_weights_stay_on_their_shards(results):
    """int4 codes kept on the device (the GPU's form; XLA dequantizes them per step where the
    fused kernels are off): an all-reduce after each row-parallel projection and none of a
    weight; the row-parallel down projection's codes split by rows."""
    h = results["hlo"]["int4 kept quantized"]
    ops = h["collectives"]
    assert h["w_down rows"] == "tp"
    assert _count(ops, "all-to-all") == 0 and _count(ops, "collective-permute") == 0, ops
    assert sum(k == "all-reduce" and s.startswith(f"f32[2,1,{h['hidden']}]")
               for k, s in ops) == 2 * h["layers"], ops
    for kind, shape in ops:  # the embedding's token columns, the sampler's: the batch's
        assert _elements(shape) <= 2 * h["vocab"], f"{kind} of {shape}"


def test_pallas_kernels_run_per_shard(results):
    """Interpret-mode kernels in bf16 on tp=2: every pallas_call inside a shard_map, the
    logits as one device's (with the jnp references) up to bf16 rounding."""
    got = results["interpret"]
    assert got["pallas"]["inside"] >= 4 and got["pallas"]["outside"] == 0, got
    assert got["rel"] <= 2e-2 and got["argmax_agree"] >= 0.9, got


def test_stream_takes_a_mesh(results):
    got = results["stream"]
    assert got["stream"] == got["generate"] and len(got["generate"]) > 1 and got["text_equal"]


@pytest.mark.parametrize("case,match", [
    ("mesh_too_large", r"tp=16 x dp=1 x ep=1 = 16 devices, but only 8"),
    ("tp_heads", r"tp=3 neither divides the model's 4 attention heads"),
    ("ep_experts", r"ep=3 does not divide the model's 4 experts"),
    ("foreign_axes", r"are not ours"),
    ("generate_tp_heads", r"tp=3 neither divides"),
])
def test_bad_meshes_are_refused(results, case, match):
    import re

    assert re.search(match, results["errors"][case]), results["errors"][case]


def test_rules_replicate_what_does_not_divide(results):
    rules = results["rules"]
    # tp=2 divides the 2 KV heads: attention by heads; tp=8 does not: attention whole
    assert rules["llama tp=2"]["kv_heads"] == rules["llama tp=2"]["q_heads"] == "tp"
    assert rules["llama tp=8"]["kv_heads"] is None and rules["llama tp=8"]["q_heads"] is None
    assert rules["llama tp=8"]["mlp"] == rules["llama tp=8"]["vocab"] == "tp"
    assert rules["mixtral ep=4"]["experts"] == "ep" and rules["llama dp=2"]["batch"] == "dp"
    assert rules["llama dp=2"]["mlp"] is None  # a size-1 axis maps to nothing
    # the spec of a declared parameter, and the cache's: heads over tp, rows over dp
    assert rules["wqkv tp=2"] == [None, "tp", None, None]
    assert rules["kv cache tp=2 dp=4"] == ["dp", None, "tp", None]


@pytest.mark.gpu
def test_gpu_kernels_per_shard():
    """On 2 GPUs, tp=2 with the default policy (Pallas kernels): every kernel under shard_map,
    the logits as one GPU's up to bf16 rounding, and mostly the same greedy tokens (a near tie
    may break either way in another summation order). Prints the decode speed of both."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from sharding_check import pallas_calls

    import jaxinfer
    from jaxinfer.configs import Config
    from jaxinfer.model import _full_forward, from_params
    from jaxinfer.models import llama
    from jaxinfer.plan import Plan
    from jaxinfer.sharding import Sharding, make_mesh, shard_params
    from jaxinfer.weights import init_params

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 GPUs")
    config = Config(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_layers=2,
                    num_heads=16, num_kv_heads=4, head_dim=64, max_position_embeddings=512,
                    dtype="bfloat16")
    params = init_params(llama.param_specs(config), jax.random.key(0), jnp.float32)
    model = from_params(config, jax.tree.map(lambda a: 4 * a if a.ndim > 1 else a, params),
                        dtype="bfloat16")
    prompts = np.asarray(jax.random.randint(jax.random.key(1), (2, 64), 0, 4096)).tolist()
    mesh = make_mesh(tp=2)
    sharding = Sharding.create(mesh, config)
    plan = Plan(config, model.policy, sharding)
    sharded = shard_params(model.params, llama.param_specs(config), sharding)
    found = pallas_calls(jax.make_jaxpr(_full_forward, static_argnums=2)(
        sharded, jnp.asarray(prompts), plan).jaxpr)
    assert found["inside"] >= 2 and found["outside"] == 0, found
    one = np.asarray(model(prompts))
    two = np.asarray(_full_forward(sharded, jnp.asarray(prompts), plan))
    assert np.linalg.norm(two - one) / np.linalg.norm(one) < 2e-2
    assert (one.argmax(-1) == two.argmax(-1)).mean() > 0.95
    n = 64
    times, tokens = {}, {}
    for name, m in (("1 GPU", None), ("tp=2", mesh)):
        jaxinfer.generate(model, prompts, max_new_tokens=n, mesh=m)  # compile
        t0 = time.perf_counter()
        out = jaxinfer.generate(model, prompts, max_new_tokens=n, mesh=m)
        times[name] = (time.perf_counter() - t0) / n * 1e3
        tokens[name] = [c.token_ids for c in out]
    print(f"decode ms/token (B=2, incl. prefill): {times}")
    same = np.mean([a == b for r1, r2 in zip(tokens["1 GPU"], tokens["tp=2"])
                    for a, b in zip(r1, r2)])
    assert same > 0.8, tokens
