"""Mixture of experts: routing against transformers' routers, Mixtral and Qwen3-MoE against
transformers' logits and greedy tokens, the checkpoint layouts, the expert implementations,
and bad configs."""

import collections
import functools
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_inputs import put
from kernel_testing import host_normal, jitted_call_shapes, normal, pallas_kernels_in

import jaxinfer
from jaxinfer import ops
from jaxinfer.cache import KVCache
from jaxinfer.configs import PRESETS, Config, MoEConfig
from jaxinfer.models import llama
from jaxinfer.ops import reference
from jaxinfer.ops.moe import EXPERTS
from jaxinfer.plan import KernelPolicy, Kernels, MoEImpl, Plan
from jaxinfer.weights import init_params

DATA = pathlib.Path(__file__).parent / "fixtures" / "data"
MOE_VARIANTS = ("mixtral", "qwen3_moe")
ROUTERS = np.load(DATA / "moe_routers.npz")
ROUTER_CASES = sorted({k.split("/")[0] for k in ROUTERS})


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def by_expert(experts, weights):
    """Both [N, k] reordered by expert id per row (routers may return any order)."""
    order = np.argsort(experts, axis=-1)
    return (np.take_along_axis(experts, order, -1), np.take_along_axis(weights, order, -1))


@pytest.fixture(scope="module", params=MOE_VARIANTS)
def variant(request):
    return DATA / "hf" / request.param


# ------------------------------------------------------------------------------ routing


def _router_case(name):
    moe = MoEConfig(expert_intermediate_size=1, **json.loads(str(ROUTERS[f"{name}/moe"])))
    bias = ROUTERS[f"{name}/bias"] if f"{name}/bias" in ROUTERS else None
    return moe, put(ROUTERS[f"{name}/logits"]), bias


@pytest.mark.parametrize("name", ROUTER_CASES)
def test_route_matches_transformers_routers(name):
    moe, logits, bias = _router_case(name)
    weights, experts = jax.jit(ops.route, static_argnums=1)(logits, moe, bias)
    assert weights.dtype == jnp.float32 and experts.dtype == jnp.int32
    assert experts.shape == (logits.shape[0], moe.experts_per_token)
    got_e, got_w = by_expert(np.asarray(experts), np.asarray(weights))
    want_e, want_w = by_expert(ROUTERS[f"{name}/experts"], ROUTERS[f"{name}/weights"])
    np.testing.assert_array_equal(got_e, want_e)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-6)


def test_router_cases_exercise_their_features():
    """Each HF case would fail a route() that ignored its feature: group limits, the score
    bias, renormalisation and the scaling factor all change the result."""
    names = set(ROUTER_CASES)
    assert {"mixtral", "qwen3_moe_norm_true", "qwen3_moe_norm_false", "deepseek_v2_greedy",
            "deepseek_v2_group_limited", "deepseek_v3_g4_norm_true"} <= names
    for name in names:
        moe, logits, bias = _router_case(name)
        want_e, want_w = by_expert(ROUTERS[f"{name}/experts"], ROUTERS[f"{name}/weights"])
        ablations = []
        if moe.n_group > 1:
            ablations.append(moe.replace(n_group=1, topk_group=1))
        if moe.norm_topk_prob or moe.router == "softmax" and moe.experts_per_token > 1:
            ablations.append(moe.replace(norm_topk_prob=not moe.norm_topk_prob))
        if moe.routed_scaling_factor != 1.0:
            ablations.append(moe.replace(routed_scaling_factor=1.0))
        for ablated in ablations:
            w, e = ops.route(logits, ablated, bias)
            e, w = by_expert(np.asarray(e), np.asarray(w))
            assert not (np.array_equal(e, want_e) and np.allclose(w, want_w, atol=1e-4)), \
                (name, ablated)
        if bias is not None:
            w, e = ops.route(logits, moe, None)
            assert not np.array_equal(by_expert(np.asarray(e), np.asarray(w))[0], want_e), name


def test_expert_counts():
    experts = put(np.random.default_rng(0).integers(0, 6, (20, 3)), jnp.int32)
    counts = ops.expert_counts(experts, 8)
    assert counts.dtype == jnp.int32 and counts.shape == (8,)
    np.testing.assert_array_equal(counts, np.bincount(np.asarray(experts).ravel(), minlength=8))
    assert int(counts.sum()) == 60 and int(counts[6]) == int(counts[7]) == 0


def test_route_rejects_wrong_shapes():
    moe = MoEConfig(num_experts=4, experts_per_token=2, expert_intermediate_size=8)
    with pytest.raises(ValueError, match=r"router_logits \(3, 5\).*num_experts=4"):
        ops.route(put(np.zeros((3, 5), np.float32)), moe)
    with pytest.raises(ValueError, match=r"bias \(3,\)"):
        ops.route(put(np.zeros((3, 4), np.float32)), moe, put(np.zeros(3, np.float32)))


# ------------------------------------------------------------------- models vs transformers


# The default plan (ragged_dot at these 48 rows) is tests/test_models.py's, on every fixture.
@pytest.mark.parametrize("impl", [MoEImpl.GATHER, MoEImpl.DENSE])
def test_logits_match_transformers_each_implementation(variant, impl):
    ref = np.load(variant / "ref.npz")
    model = jaxinfer.load(str(variant), dtype="float32").with_policy(KernelPolicy(moe=impl))
    config = model.config
    assert config.moe is not None and any(config.is_moe_layer(i)
                                          for i in range(config.num_layers))
    logits = np.asarray(model(ref["input_ids"]))
    assert rel_err(logits, ref["logits"]) <= 1e-4
    np.testing.assert_array_equal(logits.argmax(-1), ref["logits"].argmax(-1))


def test_configs_read_from_config_json():
    mixtral = jaxinfer.load(str(DATA / "hf" / "mixtral"), dtype="float32").config
    assert (mixtral.moe.num_experts, mixtral.moe.experts_per_token) == (4, 2)
    assert mixtral.moe.norm_topk_prob and mixtral.layer_windows == (8, 8)
    qwen = jaxinfer.load(str(DATA / "hf" / "qwen3_moe"), dtype="float32").config
    assert (qwen.moe.num_experts, qwen.moe.experts_per_token, qwen.moe.dense_layers) == (8, 3, (1,))
    assert qwen.qk_norm and [qwen.is_moe_layer(i) for i in range(3)] == [True, False, True]


def test_prefill_takes_ragged_dot_and_decode_takes_gather():
    """Under the default plan on this CPU a prompt (16 rows) goes through ragged_dot and a
    decode step of one row through gather: tests/test_generate.py's incremental-decoding check
    on every HF fixture (qwen3_moe and mixtral included) then compares both paths with the
    full forward (tests/test_moe_kernels.py does the same through the Pallas kernels)."""
    model = jaxinfer.load(str(DATA / "hf" / "qwen3_moe"), dtype="float32")
    step = jax.ShapeDtypeStruct((1, 1, model.config.hidden_size), jnp.float32)
    prompt = jax.ShapeDtypeStruct((2, 8, model.config.hidden_size), jnp.float32)
    assert EXPERTS.pick(step, None, None, None, None, None, model.plan).name == "gather"
    assert EXPERTS.pick(prompt, None, None, None, None, None, model.plan).name == "ragged_dot"


@pytest.mark.gpu
def test_bfloat16_decode_through_the_kernels():
    """The default plan on the GPU (Pallas boundaries and matmuls around the MoE sublayer)
    against the pure-jnp references, prefill then one decode step, bf16."""
    variant = DATA / "hf" / "mixtral"
    model = jaxinfer.load(str(variant), dtype="bfloat16")
    ids = jnp.asarray(np.load(variant / "ref.npz")["input_ids"])[:, :9]
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    outs = []
    for policy in (KernelPolicy(), KernelPolicy.reference()):
        plan = model.with_policy(policy).plan
        cache = KVCache.init(model.config, b, 16)
        _, cache = llama.forward(model.params, ids[:, :-1], pos[:, :-1], plan, cache)
        logits, _ = llama.forward(model.params, ids[:, -1:], pos[:, -1:], plan, cache)
        outs.append(np.asarray(logits))
    assert rel_err(outs[0], outs[1]) < 3e-2


def test_greedy_generation_matches_transformers(variant):
    ref = np.load(variant / "ref.npz")
    model = jaxinfer.load(str(variant), dtype="float32")
    n = ref["greedy_new"].shape[1]
    out = jaxinfer.generate(model, [list(map(int, p)) for p in ref["greedy_prompt"]],
                            max_new_tokens=n)
    for got, want in zip(out, ref["greedy_new"]):
        assert got.token_ids == want.tolist()


# ----------------------------------------------------------------------- checkpoint layouts


def _fused_copy(src: pathlib.Path, dst: pathlib.Path, spell_num_experts: bool = False):
    """The checkpoint rewritten in the layout transformers 5 holds in memory:
    mlp.gate.weight, mlp.experts.gate_up_proj [E, 2F, D], mlp.experts.down_proj [E, D, F]."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    out = {}
    layers = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if "experts" in parts:  # model.layers.{i}.(block_sparse_moe|mlp).experts.{j}.{proj}
            i, j, proj = int(parts[2]), int(parts[5]), parts[6]
            layers.setdefault(i, {}).setdefault(proj, {})[j] = t
        elif name.endswith(("block_sparse_moe.gate.weight", "mlp.gate.weight")):
            out[f"model.layers.{parts[2]}.mlp.gate.weight"] = t
        else:
            out[name] = t
    for i, projs in layers.items():
        gate = projs.get("w1") or projs.get("gate_proj")
        up = projs.get("w3") or projs.get("up_proj")
        down = projs.get("w2") or projs.get("down_proj")
        e = len(gate)
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([gate[j], up[j]], axis=0) for j in range(e)])
        out[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack([down[j] for j in range(e)])
    (dst / "model.safetensors").unlink()
    save_file(out, dst / "model.safetensors")
    if spell_num_experts:  # the Hub's Qwen3-MoE config.json says num_experts
        cfg = json.loads((dst / "config.json").read_text())
        cfg["num_experts"] = cfg.pop("num_local_experts")
        (dst / "config.json").write_text(json.dumps(cfg))
    return out


def test_fused_expert_layout_gives_the_same_logits(variant, tmp_path):
    ref = np.load(variant / "ref.npz")
    written = _fused_copy(variant, tmp_path / "fused", spell_num_experts="qwen3" in variant.name)
    assert any(n.endswith("experts.gate_up_proj") for n in written)
    assert not any(".experts.0." in n for n in written)
    per_expert = np.asarray(jaxinfer.load(str(variant), dtype="float32")(ref["input_ids"]))
    fused = np.asarray(jaxinfer.load(str(tmp_path / "fused"), dtype="float32")(ref["input_ids"]))
    np.testing.assert_array_equal(fused, per_expert)


def test_missing_expert_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    dst = tmp_path / "m"
    shutil.copytree(DATA / "hf" / "mixtral", dst)
    tensors = load_file(dst / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.1.block_sparse_moe.experts.3.w2"):
        jaxinfer.load(str(dst), dtype="float32")


def test_router_stays_float32_in_bfloat16():
    model = jaxinfer.load(str(DATA / "hf" / "qwen3_moe"), dtype="bfloat16")
    lp = model.params["layers"][0]
    assert lp["router"].w.dtype == jnp.float32
    assert lp["experts_gate"].dtype == jnp.bfloat16
    ref = np.load(DATA / "hf" / "qwen3_moe" / "ref.npz")
    logits = np.asarray(model(ref["input_ids"]))
    assert rel_err(logits, ref["logits"]) < 5e-2


# int8: 0.5% off per expert weight, but one near-tie of the random router flips at position 16
# (measured 0.05 over the prompt, 0.01 before it); int4: the dense fixtures' bounds.
@pytest.fixture(scope="module")
def mixtral_float_logits():
    ref = np.load(DATA / "hf" / "mixtral" / "ref.npz")
    ids = put(ref["input_ids"][:1])  # [1, T]
    return ids, np.asarray(jaxinfer.load(str(DATA / "hf" / "mixtral"), dtype="float32")(ids))


@pytest.mark.parametrize("how, max_err, min_agree, kernels", [("int8", 0.08, 0.9, False),
                                                              ("int4", 0.45, 0.45, True)])
def test_quantize_on_load_keeps_experts_quantized(mixtral_float_logits, how, max_err,
                                                  min_agree, kernels):
    """Mixtral's fixture quantized on load (group 32, as the dense fixtures' test): every
    layer's experts one stacked QuantizedWeight (the router stays float32), logits near the
    float load's; with `kernels` a decode step through the Pallas experts (interpret mode, tiles
    dequantized in the kernels; int8's kernels: tests/test_moe_kernels.py) matches the XLA
    path's."""
    from kernel_testing import _count

    from pallas_kernels.quantized import num_experts

    path = str(DATA / "hf" / "mixtral")
    ids, want = mixtral_float_logits
    model = jaxinfer.load(path, dtype="float32", quantization=how, group_size=32)
    config = model.config
    lp = model.params["layers"][0]
    assert lp["router"].w.dtype == jnp.float32
    for name in ("experts_gate", "experts_up", "experts_down"):
        w = lp[name]
        assert type(w).__name__ == "QuantizedWeight" and w.name == how, name
        assert num_experts(w) == config.moe.num_experts and w.group == 32
    full = np.asarray(model(ids))  # [1, T, V]: XLA's experts (CPU)
    assert rel_err(full, want) < max_err
    assert np.mean(full.argmax(-1) == want.argmax(-1)) >= min_agree
    if not kernels:
        return
    # The last token as a decode step through the kernels, after an XLA prefill.
    t = ids.shape[1]
    pos = put(np.arange(t, dtype=np.int32)[None])
    cache = KVCache.init(config, 1, t)
    _, cache = jax.jit(functools.partial(llama.forward, plan=model.plan))(
        model.params, ids[:, :-1], pos[:, :-1], cache=cache)
    plan = model.with_policy(KernelPolicy(interpret=True)).plan

    def step(params, ids, pos, cache):
        return llama.forward(params, ids, pos, plan, cache)[0]

    # traced once: its kernels counted (pallas_kernels_in's count), then the same trace run
    args = (model.params, ids[:, -1:], pos[:, -1:], cache)
    traced = jax.jit(step).trace(*args)
    names = _count(traced.jaxpr.jaxpr, collections.Counter())
    assert any(n.startswith("moe_decode_swiglu") and n.endswith(f"_{how}_{how}")
               for n in names), names
    last = traced.lower().compile()(*args)
    assert rel_err(np.asarray(last), full[:, -1:]) < 1e-4


def test_bench_floor_counts_quantized_experts_bytes():
    """The decode floor's unrouted experts are taken off at their held bytes: int4 experts'
    codes and scales, not 3 * D * F elements of the model's dtype."""
    from jaxinfer import memory
    from jaxinfer.bench import decode_bytes_per_step
    from jaxinfer.weights import param_bytes

    config = tiny_config()
    assert not config.tie_word_embeddings
    specs = llama.param_specs(config)
    layer = tiny_layer(config, 5)
    floats = {"embed": put(np.zeros((64, 32), np.float32)), "layers": [layer]}
    int4 = {"embed": floats["embed"], "layers": [_quantizer(config, "int4")(layer)]}
    m = config.moe
    unused = m.num_experts * (1 - m.experts_per_token / m.num_experts)  # at batch 1
    row = config.hidden_size * jnp.dtype(config.dtype).itemsize + memory.kv_bytes_per_token(config)
    for name, p in (("float", floats), ("int4", int4)):
        expert = sum(param_bytes(p["layers"][0][n]) for n in
                     ("experts_gate", "experts_up", "experts_down")) / m.num_experts
        want = param_bytes(p) - param_bytes(p["embed"]) - unused * expert + row
        assert decode_bytes_per_step(config, 1, 0, params=p) == pytest.approx(want, rel=1e-9), name


# ---------------------------------------------------------------------- the op on its own


def tiny_layer(config, seed):
    """Layer 0's random params as declared, drawn with numpy (jax.random compiles per shape,
    seconds on a busy CPU): fan-in scaled normals, norms 1 + noise, biases zero."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, spec in llama.param_specs(config)["layers"][0].items():
        if spec.init == "normal":
            fan_in = spec.shape[1] if len(spec.shape) == 3 else spec.shape[0]
            value = rng.standard_normal(spec.shape) / np.sqrt(fan_in)
        else:
            value = np.full(spec.shape, 1.0 if spec.init == "ones" else 0.0)
            value += 0.1 * rng.standard_normal(spec.shape) * (spec.init == "ones")
        out[name] = spec.wrap(put(value, spec.dtype or jnp.float32))  # jnp.asarray's bits
    return out


@functools.cache
def _quantizer(config, how, group_size=None):
    """quantize_params(layer, how, group_size, specs=layer 0's specs) as one jitted program:
    the same codes and scales bit for bit as op by op (each of whose ops compiles per shape:
    ~90 compiles a layer), one compile per config."""
    from jaxinfer.weights import quantize_params

    specs = llama.param_specs(config)["layers"][0]
    return jax.jit(lambda lp: quantize_params(lp, how, group_size, specs=specs))


def tiny_config(**moe):
    fields = dict(num_experts=6, experts_per_token=2, expert_intermediate_size=24,
                  norm_topk_prob=True, **moe)
    return Config(vocab_size=64, hidden_size=32, intermediate_size=40, num_layers=1,
                  num_heads=4, num_kv_heads=2, head_dim=8, moe=MoEConfig(**fields))


@functools.partial(jax.jit, static_argnums=2)
def _moe_sublayer(lp, x, plan):
    return ops.moe_mlp(ops.Residual.start(x), lp["mlp_norm"], lp, plan).take()


def _moe_out(config, lp, x, policy=KernelPolicy()):
    """(the stream, the MoE sublayer's output pending on it)."""
    xs, pending = _moe_sublayer(lp, x, Plan(config, policy))
    return np.asarray(xs), np.asarray(pending)


# XLA's CPU backend optimizations off: the interpret-mode kernels' loops compile faster
@functools.partial(jax.jit, static_argnums=2, compiler_options={
    "xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True})
def _moe_array(lp, x, plan):
    """The MoE sublayer's output as one array (a decode kernel's partials summed)."""
    from jaxinfer.ops.stream import ARRAY_ONLY

    return ops.moe_mlp(ops.Residual.start(x), lp["mlp_norm"], lp, plan).take(ARRAY_ONLY)[1]


def test_quantized_experts_through_every_implementation():
    """int4 experts (quantize_params with the layer's specs: per expert, stacked; group 32
    for gate / up, per-column scales over down's ragged F 24) through each implementation,
    the Pallas ones in interpret mode at a decode row and a grouped batch: all agree with the
    dense reference on the dequantized experts, which stays near the float layer's."""
    from jaxinfer.weights import quantize_params

    config = tiny_config()
    lp = tiny_layer(config, 3)
    q = _quantizer(config, "int4")(lp)
    assert q["experts_gate"].group == 32 and q["experts_down"].groups == 1
    assert q["router"].w.dtype == jnp.float32  # declared float32: kept
    for shape in ((1, 1, 32), (2, 5, 32)):
        x = normal(4, shape, jnp.float32)  # jax.random.normal(key(4), shape)'s bits
        want = _moe_out(config, q, x, KernelPolicy(moe=MoEImpl.DENSE))[1]
        float_out = _moe_out(config, lp, x, KernelPolicy(moe=MoEImpl.DENSE))[1]
        assert rel_err(want, float_out) < 0.3  # int4 (down: one scale per column of 24)
        policies = [KernelPolicy(moe=impl) for impl in (MoEImpl.GATHER, MoEImpl.RAGGED_DOT)]
        policies.append(KernelPolicy(moe=MoEImpl.PALLAS, interpret=True))
        for policy in policies:
            w = q["experts_gate"]
            picked = EXPERTS.pick(x, None, None, w, w, q["experts_down"], Plan(config, policy))
            assert picked.name != "dense", policy
            np.testing.assert_allclose(_moe_array(q, x, Plan(config, policy)), want,
                                       rtol=1e-5, atol=1e-5, err_msg=picked.name)


@pytest.mark.parametrize("interpret", [
    True, pytest.param(False, marks=[pytest.mark.gpu, pytest.mark.skipif(
        jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")])], ids=["interpret", "gpu"])
@pytest.mark.parametrize("f", [512, 1024])
def test_int4_experts_through_the_mosaic_kernel(interpret, f):
    """int4 experts in groups of 128 in the nk layout (int_layout_params on a Mosaic plan)
    take the Mosaic GPU kernel with stacked experts at decode rows (interpret mode): gate and
    up in one launch, down in another, each assignment reading its expert; the sublayer
    matches the dense reference on the same weights, and at decode rows it routes in its
    kernels and hands the next boundary down's K-range sums with the experts weighted
    (Partials): down's K 512 in two ranges, each range's two experts added (two chunks); K
    1024 in four ranges, 2 k: two ranges an expert slot, the weights in the SwiGLU (four
    chunks, as they are). Prefill rows take ragged_dot and XLA's router."""
    from jaxinfer.generate import int_layout_params

    config = Config(vocab_size=64, hidden_size=128, intermediate_size=128, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=32, moe=MoEConfig(
                        num_experts=4, experts_per_token=2, expert_intermediate_size=f,
                        norm_topk_prob=True))
    specs = llama.param_specs(config)
    lp = _quantizer(config, "int4", 128)(tiny_layer(config, 5))
    policy = KernelPolicy(interpret=interpret, quant_matmul="mosaic", moe_decode_rows=2,
                          moe_route_rows=2)
    plan = Plan(config, policy)
    params = {name: put(np.zeros(spec.shape, np.float32)) for name, spec in specs.items()
              if name != "layers"}  # embedding, norms, head: left as they are
    nk = int_layout_params({**params, "layers": [lp]}, plan)["layers"][0]
    nk["mlp_norm"] = nk["mlp_norm"].astype(jnp.bfloat16)  # a bf16 model: h stays bf16
    assert all(nk[n].layout == "nk" for n in ("experts_gate", "experts_up", "experts_down"))
    w = nk["experts_gate"]
    for shape, impl in (((2, 1, 128), "mosaic_decode"), ((1, 3, 128), "ragged_dot")):
        # jax.random.normal(key(7), shape)'s bits, rounded to bf16 on the host (as XLA rounds)
        x = put(host_normal(7, shape, jnp.float32).astype(jnp.bfloat16))
        assert EXPERTS.pick(x, None, None, w, w, nk["experts_down"], plan).name == impl
        want = _moe_out(config, lp, x, KernelPolicy(moe=MoEImpl.DENSE))[1]
        if impl == "mosaic_decode":  # the form the next boundary takes
            names = pallas_kernels_in(lambda v: _moe_sublayer(nk, v, plan), x)
            # the router in its kernels: D in 16 blocks, then the pick
            assert names["moe_route_blocks"] == names["moe_route_pick"] == 1, names
            # gate + up, then down's K-range sums [S, A, D]: two ranges either way, so K 1024's
            # four chunks are two ranges of each expert slot (its weights applied before down)
            calls = jitted_call_shapes(lambda v: _moe_sublayer(nk, v, plan), x,
                                       name="int_matmul_mgpu")
            assert [c[0] for c in calls] == [(4, f)] + [(2, 4, 128)], calls
            _, parts = _moe_sublayer(nk, x, plan)
            assert isinstance(parts, ops.Partials) and parts.parts.shape == (
                f // 256, *shape), parts.parts.shape
            got = parts.materialize(jnp.float32)
        else:
            got = _moe_array(nk, x, plan)
        assert rel_err(np.asarray(got, np.float32), np.asarray(want, np.float32)) < 1e-2, impl


def test_shared_experts_and_score_bias():
    """Shared experts add a dense gated MLP of the normed input; the score bias changes
    which experts run; every implementation agrees."""
    config = tiny_config(num_shared_experts=2, router="sigmoid", score_bias=True,
                         n_group=3, topk_group=2, group_scoring="top2_sum")
    lp = tiny_layer(config, 1)
    assert lp["shared_gate"].w.shape == (32, 48) and lp["router_bias"].dtype == jnp.float32
    lp["router_bias"] = jnp.linspace(-0.3, 0.3, 6, dtype=jnp.float32)
    x = normal(2, (2, 5, 32), jnp.float32)  # jax.random.normal(key(2), ...)'s bits
    outs = {impl: _moe_out(config, lp, x, KernelPolicy(moe=impl))[1] for impl in MoEImpl}
    for impl, out in outs.items():
        np.testing.assert_allclose(out, outs[MoEImpl.DENSE], rtol=1e-5, atol=1e-5, err_msg=impl)
    routed = tiny_config(router="sigmoid", score_bias=True, n_group=3, topk_group=2,
                         group_scoring="top2_sum")
    no_shared = {k: v for k, v in lp.items() if not k.startswith("shared_")}
    h = reference.rms_norm(x, lp["mlp_norm"], config.rms_norm_eps)
    shared = reference.linear(reference.swiglu(h, lp["shared_gate"].w, lp["shared_up"].w),
                              lp["shared_down"].w)
    np.testing.assert_allclose(outs[MoEImpl.DENSE] - _moe_out(routed, no_shared, x)[1],
                               np.asarray(shared), rtol=1e-4, atol=1e-5)
    unbiased = _moe_out(routed, {**no_shared, "router_bias": put(np.zeros(6, np.float32))},
                        x)[1]
    assert not np.allclose(unbiased, _moe_out(routed, no_shared, x)[1], atol=1e-4)


def test_moe_matches_a_per_token_loop():
    """ragged_dot's sort / grouped matmul / scatter-add equals each token's k experts run one
    by one (numpy, float64), with tokens whose experts repeat across the batch."""
    config = tiny_config()
    lp = tiny_layer(config, 3)
    x = normal(4, (3, 7, 32), jnp.float32)  # jax.random.normal(key(4), ...)'s bits
    _, out = _moe_out(config, lp, x, KernelPolicy(moe=MoEImpl.RAGGED_DOT))
    h = np.asarray(reference.rms_norm(x, lp["mlp_norm"], config.rms_norm_eps),
                   np.float64).reshape(-1, 32)
    logits = h @ np.asarray(lp["router"].w, np.float64)
    weights, experts = ops.route(put(logits, jnp.float32), config.moe)
    weights, experts = np.asarray(weights), np.asarray(experts)  # rows read on the host
    g, u, d = (np.asarray(lp[k], np.float64) for k in ("experts_gate", "experts_up",
                                                          "experts_down"))
    want = np.zeros_like(h)
    for n in range(h.shape[0]):
        for w, e in zip(weights[n], experts[n]):
            a, b = h[n] @ g[e], h[n] @ u[e]
            want[n] += w * ((a / (1 + np.exp(-a)) * b) @ d[e])
    np.testing.assert_allclose(out.reshape(-1, 32), want, rtol=1e-4, atol=1e-5)
    assert len(np.unique(experts)) == 6  # every expert took tokens


def test_plan_picks_the_experts_implementation():
    config = tiny_config()  # E 6, k 2: moe_decode_rows defaults to max(1, 6 // 8) = 1

    def x(b, t, dtype=jnp.float32):
        return jax.ShapeDtypeStruct((b, t, 32), dtype)

    def pick(x, policy, w_dtype=None):
        w = jax.ShapeDtypeStruct((6, 32, 24), w_dtype or x.dtype)
        return EXPERTS.pick(x, None, None, w, w, w, Plan(config, policy)).name

    # On this CPU without interpret: XLA's paths, gather at most moe_decode_rows rows.
    assert pick(x(1, 1), KernelPolicy()) == "gather"
    assert pick(x(2, 1), KernelPolicy()) == "ragged_dot"
    assert pick(x(4, 1), KernelPolicy(moe_decode_rows=4)) == "gather"
    assert pick(x(1, 64), KernelPolicy(moe_decode_rows=0)) == "ragged_dot"
    assert pick(x(2, 1), KernelPolicy(moe=MoEImpl.PALLAS)) == "ragged_dot"  # no kernels here
    assert pick(x(1, 1), KernelPolicy(moe=MoEImpl.RAGGED_DOT)) == "ragged_dot"
    assert pick(x(64, 64), KernelPolicy(moe=MoEImpl.GATHER)) == "gather"
    assert pick(x(1, 1), KernelPolicy(moe=MoEImpl.DENSE)) == "dense"
    # The kernels where they run: the decode kernel at most moe_decode_rows rows.
    interpret = KernelPolicy(interpret=True)
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        assert pick(x(1, 1, dtype), interpret) == "pallas_decode"
        assert pick(x(2, 1, dtype), interpret) == "pallas_grouped"
    assert pick(x(3, 1, jnp.bfloat16), interpret.replace(moe_decode_rows=3)) == "pallas_decode"
    assert pick(x(1, 1, jnp.bfloat16), interpret, jnp.float32) == "gather"  # mixed dtypes
    assert pick(x(1, 1, jnp.bfloat16), interpret.replace(moe=MoEImpl.GATHER)) == "gather"
    assert pick(x(1, 1, jnp.bfloat16), KernelPolicy.reference()) == "gather"
    # Lowering for a GPU: float32 activations take XLA's paths unless the plan asks.
    on_gpu = KernelPolicy(kernels=Kernels.PALLAS)
    assert pick(x(1, 1, jnp.bfloat16), on_gpu) == "pallas_decode"
    assert pick(x(1, 1), on_gpu) == "gather"
    assert pick(x(1, 1), on_gpu.replace(moe=MoEImpl.PALLAS)) == "pallas_decode"
    # Batch-invariant: the decode kernel at one token per row up to fused_rows rows.
    det = KernelPolicy.deterministic(interpret=True)
    assert pick(x(16, 1, jnp.bfloat16), det) == "pallas_decode"
    assert pick(x(17, 1, jnp.bfloat16), det) == "pallas_grouped"
    assert pick(x(1, 2, jnp.bfloat16), det) == "pallas_grouped"
    with pytest.raises(ValueError, match="moe_decode_rows"):
        KernelPolicy(moe_decode_rows=-1)
    with pytest.raises(ValueError, match="moe_grouped_blocks must be a MoEBlockSizes"):
        KernelPolicy(moe_grouped_blocks=(128, 64))
    with pytest.raises(ValueError, match="KernelPolicy.moe"):
        KernelPolicy(moe="gather")
    # The default row threshold: E // (4 k), at least 1.
    assert KernelPolicy().decode_rows(8, 2) == 1 and KernelPolicy().decode_rows(128, 8) == 4
    assert KernelPolicy(moe_decode_rows=7).decode_rows(8, 2) == 7


# ----------------------------------------------------------------------- configs and counts


def test_is_moe_layer_and_param_counts():
    moe = MoEConfig(num_experts=4, experts_per_token=2, expert_intermediate_size=8,
                    sparse_step=2, dense_layers=(3,), first_dense_layers=1)
    assert [moe.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    for config in (tiny_config(num_shared_experts=1, score_bias=True),
                   tiny_config().replace(num_layers=3, moe=tiny_config().moe.replace(
                       dense_layers=(1,)))):
        params = jax.eval_shape(lambda c=config: init_params(llama.param_specs(c),
                                                             jax.random.key(0), jnp.float32))
        assert config.num_params() == sum(a.size for a in jax.tree.leaves(params))
    mixtral, qwen = PRESETS["mixtral-8x7b"], PRESETS["qwen3-30b-a3b"]
    assert round(mixtral.num_params() / 1e9, 1) == 46.7  # Mixtral-8x7B: 46.7B, 12.9B active
    assert round(mixtral.num_params(active=True) / 1e9, 1) == 12.9
    assert round(qwen.num_params() / 1e9, 1) == 30.5  # Qwen3-30B-A3B: 30.5B, 3.3B active
    assert round(qwen.num_params(active=True) / 1e9, 2) == 3.35  # with embedding and head


@pytest.mark.parametrize("fields, match", [
    (dict(experts_per_token=5), r"experts_per_token \(5\) must be at most num_experts \(4\)"),
    (dict(n_group=3), r"n_group \(3\) must divide num_experts \(4\)"),
    (dict(n_group=2, topk_group=3), r"topk_group \(3\) must be at most n_group \(2\)"),
    (dict(n_group=2, topk_group=1, experts_per_token=3),
     r"experts_per_token \(3\) does not fit in the topk_group \(1\) groups of 2"),
    (dict(n_group=4, topk_group=2, experts_per_token=2, group_scoring="top2_sum"),
     r"'top2_sum' needs at least 2 experts per group"),
    (dict(router="relu"), r"router must be 'softmax' or 'sigmoid', got 'relu'"),
    (dict(group_scoring="mean"), r"group_scoring must be"),
    (dict(routed_scaling_factor=0.0), r"routed_scaling_factor must be finite and positive"),
    (dict(experts_per_token=0), r"experts_per_token must be an integer >= 1, got 0"),
    (dict(dense_layers=[1]), r"dense_layers must be a tuple"),
])
def test_bad_moe_configs(fields, match):
    base = dict(num_experts=4, experts_per_token=2, expert_intermediate_size=8)
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**base, **fields})


def test_bad_configs_with_experts():
    moe = MoEConfig(num_experts=4, experts_per_token=2, expert_intermediate_size=8,
                    dense_layers=(0, 5))
    with pytest.raises(ValueError, match=r"moe.dense_layers \[5\] outside the 2 layers"):
        tiny_config().replace(num_layers=2, moe=moe)
    with pytest.raises(ValueError, match="none of the 1 layers has experts"):
        tiny_config().replace(moe=moe.replace(dense_layers=(0,)))


def _hf_dir(tmp_path, name, **changes):
    dst = tmp_path / name
    shutil.copytree(DATA / "hf" / name, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("name, changes, match", [
    ("mixtral", dict(num_experts_per_tok=5),
     r"experts_per_token \(5\) must be at most num_experts \(4\).*num_local_experts=4, "
     r"num_experts_per_tok=5"),
    ("mixtral", dict(topk_method="group_limited_greedy"),
     r"topk_method='group_limited_greedy' is a router setting MixtralForCausalLM does not"),
    ("qwen3_moe", dict(n_shared_experts=2), r"n_shared_experts=2 is a router setting"),
    ("qwen3_moe", dict(hidden_act="gelu"), r"hidden_act='gelu'"),
    ("qwen3_moe", dict(mlp_only_layers=[7]), r"moe.dense_layers \[7\] outside the 3 layers"),
])
def test_bad_hf_moe_configs_are_named(tmp_path, name, changes, match):
    with pytest.raises(ValueError, match=match):
        jaxinfer.load(str(_hf_dir(tmp_path, name, **changes)), dtype="float32")


def test_router_jitter_noise_is_ignored(tmp_path):
    ref = np.load(DATA / "hf" / "mixtral" / "ref.npz")
    model = jaxinfer.load(str(_hf_dir(tmp_path, "mixtral", router_jitter_noise=0.1,
                                      output_router_logits=True)), dtype="float32")
    assert rel_err(np.asarray(model(ref["input_ids"])), ref["logits"]) <= 1e-4


def test_bench_floor_counts_the_experts_a_step_reads():
    """At batch 1 a Mixtral decode step reads 2 of 8 experts per layer; at a large batch
    nearly all of them."""
    from jaxinfer.bench import decode_bytes_per_step

    config = PRESETS["mixtral-8x7b"]
    one, many = (decode_bytes_per_step(config, b, 0) for b in (1, 512))
    expert = 3 * 4096 * 14336 * 2  # one expert's bf16 bytes
    assert round((many - one) / expert / 32, 1) == 6.0  # 6 more experts in each of 32 layers
    dense = config.replace(moe=None)  # one MLP of the expert's size per layer
    assert round((one - decode_bytes_per_step(dense, 1, 0)) / expert / 32, 2) == 1.0



def test_expert_load_counts_the_routing():
    """Model.expert_load: [layers, E], the dense first layer's row zero, every MoE layer's row
    summing to tokens x k; an expert the router bias excludes gets no token; a dense model
    is refused by name."""
    model = jaxinfer.load(str(DATA / "hf" / "deepseek_v3"))
    moe = model.config.moe
    tokens = np.load(DATA / "hf" / "deepseek_v3" / "ref.npz")["input_ids"]  # [B, T]
    load = model.expert_load(tokens)
    assert load.shape == (model.config.num_layers, moe.num_experts)
    assert moe.first_dense_layers == 1 and not load[0].any()
    np.testing.assert_array_equal(load[1:].sum(-1), tokens.size * moe.experts_per_token)
    busiest = int(load[1].argmax())
    layers = [dict(lp) for lp in model.params["layers"]]
    for lp in layers[1:]:
        lp["router_bias"] = lp["router_bias"].at[busiest].set(-1e9)
    params = dict(model.params, layers=layers)
    without = jaxinfer.model.from_params(model.config, params).expert_load(tokens)
    assert not without[1:, busiest].any()
    np.testing.assert_array_equal(without[1:].sum(-1), tokens.size * moe.experts_per_token)
    dense = jaxinfer.load(str(DATA / "hf" / "qwen2"))
    with pytest.raises(ValueError, match="has no experts"):
        dense.expert_load(tokens)


def test_router_kernel_takes_the_boundary():
    """With the attention's output pending as float32 chunks, the router's kernel takes the
    residual add and the norm as well (gated_mlp_boundary CONSUMER: add_rms_norm_route, one
    launch where add_rms_norm and moe_route were two; a router in D blocks, its blocks'
    kernel): the stream is bitwise add_rms_norm's and the experts' output that of the
    separate kernels (KERNEL)."""
    from jaxinfer.ops.stream import ARRAY_ONLY
    from jaxinfer.plan import Boundary

    config = tiny_config()
    lp = tiny_layer(config, 3)
    lp["mlp_norm"] = put(np.asarray(lp["mlp_norm"]).astype(jnp.bfloat16))  # as XLA rounds
    rng = np.random.default_rng(4)
    x = put(rng.standard_normal((1, 2, 32)), jnp.bfloat16)  # [B, T, D]
    parts = put(rng.standard_normal((2, 1, 2, 32)), jnp.float32)  # [S, B, T, D]
    split = dict(moe_route_blocks=4)
    names_all = {"add_rms_norm_route", "add_rms_norm", "moe_route", "add_rms_norm_route_blocks",
                 "moe_route_blocks", "moe_route_pick"}
    out = {}
    one = dict(moe_route_blocks=1)
    for where, blocks, kernels in (
            (Boundary.CONSUMER, one, {"add_rms_norm_route"}),
            (Boundary.KERNEL, one, {"add_rms_norm", "moe_route"}),
            (Boundary.CONSUMER, split, {"add_rms_norm_route_blocks", "moe_route_pick"}),
            (Boundary.KERNEL, split, {"add_rms_norm", "moe_route_blocks", "moe_route_pick"})):
        plan = Plan(config, KernelPolicy(interpret=True, moe_route_rows=4,
                                         gated_mlp_boundary=where, **blocks))

        def sublayer(x, parts, plan=plan):
            stream = ops.Residual.start(x).with_pending(ops.Partials(parts))
            return ops.moe_mlp(stream, lp["mlp_norm"], lp, plan).take(ARRAY_ONLY)
        names = pallas_kernels_in(sublayer, x, parts)
        assert kernels <= set(names) and not (names_all - kernels) & set(names), names
        out[where, blocks["moe_route_blocks"]] = [np.asarray(a, np.float32)
                                                  for a in jax.jit(sublayer)(x, parts)]
    want = out[Boundary.KERNEL, 1]
    for key, got in out.items():
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_allclose(got[1], want[1], rtol=2e-2, atol=2e-2, err_msg=str(key))


def test_router_kernel_choice_follows_the_policy():
    """moe_route_rows picks the router kernels up to that many rows (0: never; 16 by
    default); under batch_invariant, for every row count (a row's experts then never depend
    on the batch or on T); the router in at least moe_route_blocks blocks of D rows of at most
    moe_route_block_bytes, a power of two dividing D in blocks of 8 rows or more; a score
    bias or group-limited routing keeps XLA's ops."""
    from jaxinfer.ops.moe import _route_blocks

    config = tiny_config()  # the router [32, 6]: 768 bytes in float32
    h = jax.ShapeDtypeStruct((2, 3, 32), jnp.bfloat16)  # 6 rows
    many = jax.ShapeDtypeStruct((2, 9, 32), jnp.bfloat16)  # 18 rows
    lp = {"router": None}
    for policy, x, blocks in (
            (KernelPolicy(interpret=True, moe_route_rows=8), h, 4),  # 16 blocks: 2 rows each
            (KernelPolicy(interpret=True, moe_route_rows=4), h, None),
            (KernelPolicy(interpret=True, moe_route_rows=0), h, None),
            (KernelPolicy(interpret=True), h, 4),
            (KernelPolicy(interpret=True), many, None),
            (KernelPolicy(interpret=True, moe_route_blocks=1), h, 1),
            (KernelPolicy(interpret=True, moe_route_blocks=2), h, 2),
            (KernelPolicy(interpret=True, moe_route_blocks=3), h, 4),  # a power of two
            (KernelPolicy(interpret=True, moe_route_blocks=1, moe_route_block_bytes=384), h, 2),
            (KernelPolicy.deterministic(interpret=True, moe_route_rows=4), h, 4),
            (KernelPolicy.deterministic(interpret=True), many, 4),
            (KernelPolicy.deterministic(interpret=True, moe_route_rows=0), h, None),
            (KernelPolicy(kernels=Kernels.REFERENCE, moe_route_rows=8), h, None)):
        got = _route_blocks(x, lp, Plan(config, policy))
        assert got == blocks if blocks else isinstance(got, str), (policy, got)
    on = Plan(config, KernelPolicy(interpret=True, moe_route_rows=8))
    assert "score bias" in _route_blocks(h, {"router_bias": put(np.zeros(6, np.float32))}, on)
    grouped = Plan(tiny_config(n_group=3, topk_group=2), on.policy)
    assert "group-limited" in _route_blocks(h, lp, grouped)
