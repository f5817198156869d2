"""DeepSeek-V2 / V3: MLA with the latent cache and MoE, against transformers' golden outputs
(tests/fixtures/data/hf/deepseek_*), and the latent cache's own contracts."""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxinfer
import pallas_kernels as pk
from benchmarks.kv_cache import first_difference, forced_logits
from jaxinfer import memory
from jaxinfer.cache import KVCache, LatentCache, LatentLayer, QuantizedLatentLayer
from jaxinfer.configs import PRESETS, Config, MLAConfig
from jaxinfer.models import registry
from jaxinfer.ops import mla
from jaxinfer.plan import KernelPolicy, MoEImpl, Plan
from jaxinfer.weights import QuantizedWeight
from pallas_kernels.kv_quant import quantize_latent
from kernel_inputs import put
from kernel_testing import pallas_kernels_in

HF = pathlib.Path(__file__).parent / "fixtures" / "data" / "hf"
VARIANTS = ("deepseek_v2", "deepseek_v2_qlora", "deepseek_v3")


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request):
    d = HF / request.param
    return d, jaxinfer.load(str(d), dtype="float32"), np.load(d / "ref.npz")


def test_fixtures_exercise_the_features():
    cfgs = {v: json.loads((HF / v / "config.json").read_text()) for v in VARIANTS}
    assert cfgs["deepseek_v2"]["q_lora_rank"] is None
    assert cfgs["deepseek_v2"]["topk_method"] == "group_limited_greedy"
    assert cfgs["deepseek_v2_qlora"]["q_lora_rank"] and cfgs["deepseek_v2_qlora"]["tie_word_embeddings"]
    v3 = cfgs["deepseek_v3"]
    assert v3["n_group"] > 1 and v3["topk_group"] < v3["n_group"]
    assert v3["routed_scaling_factor"] != 1 and v3["n_shared_experts"] >= 1
    assert v3["rope_parameters"]["rope_type"] == "yarn" and v3["rope_parameters"]["mscale_all_dim"]
    assert all(c["first_k_dense_replace"] == 1 for c in cfgs.values())


def test_logits_match_transformers(variant):
    d, model, ref = variant
    logits = np.asarray(model(ref["input_ids"]))
    assert logits.shape == ref["logits"].shape
    assert rel_err(logits, ref["logits"]) <= 1e-4
    np.testing.assert_array_equal(logits.argmax(-1), ref["logits"].argmax(-1))


def test_greedy_generation_matches_transformers(variant):
    d, model, ref = variant
    prompts = [list(map(int, p)) for p in ref["greedy_prompt"]]
    out = jaxinfer.generate(model, prompts, max_new_tokens=ref["greedy_new"].shape[1])
    assert [c.token_ids for c in out] == ref["greedy_new"].tolist()
    if d.name == "deepseek_v3":  # a chunked prefill: chunks of 3 absorbed against the cache
        out = jaxinfer.generate(model, prompts, max_new_tokens=ref["greedy_new"].shape[1],
                                policy=KernelPolicy(prefill_chunk=3))
        assert [c.token_ids for c in out] == ref["greedy_new"].tolist()


def test_incremental_decoding_matches_full_forward(variant):
    """A prefill of 8 tokens, then one token at a time and a chunk of 3 (absorbed, Tq > 1)
    against the latent cache: every position's logits are the full forward's (transformers'),
    over the first 16 positions."""
    d, model, ref = variant
    t = 16
    tokens = jnp.asarray(ref["input_ids"][:, :t])  # [B, T]
    b = tokens.shape[0]
    plan = model.plan
    forward = jax.jit(registry.family(model.config).forward, static_argnames=("plan", "fresh"))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cache = KVCache.init(model.config, b, t)
    assert isinstance(cache, LatentCache)
    p = 8
    logits, cache = forward(model.params, tokens[:, :p], positions[:, :p], plan, cache=cache,
                            fresh=True)
    steps = [np.asarray(logits)]
    while p < t:
        n = 3 if p == 12 else 1
        logits, cache = forward(model.params, tokens[:, p:p + n], positions[:, p:p + n], plan,
                                cache=cache)
        steps.append(np.asarray(logits))
        p += n
    inc = np.concatenate(steps, axis=1)  # [B, T, V]
    for i in range(t):
        assert rel_err(inc[:, i], ref["logits"][:, i]) <= 1e-4, f"position {i}"
    np.testing.assert_array_equal(inc.argmax(-1), ref["logits"][:, :t].argmax(-1))


# ----------------------------------------------------------------------------- MLA itself


def _tiny(q_lora=None, **mla_changes):
    m = MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                  q_lora_rank=q_lora, **mla_changes)
    return Config(vocab_size=64, hidden_size=32, intermediate_size=32, num_layers=1,
                  num_heads=3, num_kv_heads=3, head_dim=16, family="deepseek", mla=m)


def _mla_inputs(config, b, s, t, key=0):
    """(q, latent, a LatentLayer of s slots, w_kv_b): standard normal float32 (w_kv_b / 4),
    made in numpy (jax.random compiles a program per shape)."""
    m, h = config.mla, config.num_heads
    rng = np.random.default_rng(key)
    from jaxinfer.weights import Dense

    def normal(*shape):
        return rng.standard_normal(shape, np.float32)

    w_kv_b = put(normal(m.kv_lora_rank, h, m.qk_nope_head_dim + m.v_head_dim) / 4)
    cache = LatentLayer(put(normal(b, s, m.latent_dim)))
    q = put(normal(b, t, h, m.qk_head_dim))
    latent = put(normal(b, t, m.latent_dim))
    return q, latent, cache, Dense(w_kv_b)


@pytest.mark.parametrize("t", [1, 3])
def test_absorbed_equals_expanded(t):
    """The absorbed decode (latent query, attention over the latent, W_UV after) against K/V
    expanded per head from the same cache, rows at different positions."""
    config = _tiny()
    plan = Plan(config)
    b, s = 2, 11
    q, latent, cache, w = _mla_inputs(config, b, s, t)
    start = np.array([[5], [7]])  # the rows' first new positions
    positions = put((start + np.arange(t)).astype(np.int32))  # [B, T]
    cache = cache.append(latent, positions)
    kw = dict(positions=positions, w_kv_b=w)
    assert mla.MLA_ATTEND.pick(q, latent, cache, plan, **kw).name == "absorbed"
    absorbed_fn = jax.jit(lambda *a, **k: mla.MLA_ATTEND.get("absorbed").run(*a, plan, **k))
    absorbed = absorbed_fn(q, latent, cache, **kw)
    expanded = jax.jit(lambda *a, **k: mla.MLA_ATTEND.get("expanded").run(*a, plan, **k))(
        q, latent, cache, **kw)
    assert absorbed.shape == (b, t, config.num_heads, config.mla.v_head_dim)
    np.testing.assert_allclose(absorbed, expanded, rtol=1e-5, atol=1e-5)
    # Slots past the last new token are not read: changing them changes nothing.
    poked = LatentLayer(cache.latent.at[:, 10:].set(100.0))
    again = absorbed_fn(q, latent, poked, **kw)
    np.testing.assert_array_equal(again, absorbed)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantized_latent_append_and_absorbed_equals_expanded(kind):
    """A QuantizedLatentLayer: append writes codes and the two scales (c_kv's, k_rope's) at
    the given slots and drops positions past the end; the absorbed path over the codes equals
    the expanded one over the same codes dequantized, and both stay near the float latent's."""
    config = _tiny()
    plan = Plan(config)
    b, s, t = 2, 11, 3
    q, latent, float_cache, w = _mla_inputs(config, b, s, t)
    r = config.mla.kv_lora_rank
    cache = LatentCache.init(config, b, s, kv_dtype=kind).layer(0)
    assert isinstance(cache, QuantizedLatentLayer) and cache.scale.shape == (b, s, 2)
    fill = put(np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)))
    cache = jax.jit(cache.append)(float_cache.latent, fill)
    positions = put(np.array([[5], [9]]) + np.arange(t), np.int32)  # row 1: 11 dropped
    cache = jax.jit(cache.append)(latent, positions)
    float_cache = float_cache.append(latent, positions)
    codes_max = {"int8": 127.0, "fp8": 448.0}[kind]
    for part in (slice(0, r), slice(r, None)):
        want = np.abs(np.asarray(float_cache.latent[..., part])).max(-1) / codes_max
        np.testing.assert_allclose(cache.scale[..., 0 if part.start == 0 else 1], want,
                                   rtol=1e-6)
    err = rel_err(cache.values(), float_cache.latent)
    assert err < (1e-2 if kind == "int8" else 4e-2), err
    kw = dict(positions=positions, w_kv_b=w)
    assert mla.MLA_ATTEND.pick(q, latent, cache, plan, **kw).name == "absorbed"
    run = jax.jit(lambda name, *a, **k: mla.MLA_ATTEND.get(name).run(*a, plan, **k),
                  static_argnums=0)
    absorbed = run("absorbed", q, latent, cache, **kw)
    np.testing.assert_allclose(absorbed, run("expanded", q, latent, cache, **kw), rtol=1e-5,
                               atol=1e-5)
    exact = run("absorbed", q, latent, float_cache, **kw)
    assert rel_err(absorbed, exact) < (2e-2 if kind == "int8" else 8e-2)
    assert rel_err(absorbed, exact[::-1]) > 0.3  # a wrong answer is far away


@pytest.mark.parametrize("name, kind", [("deepseek_v2", "int8"), ("deepseek_v3", "fp8")])
def test_quantized_latent_cache_logits_and_greedy_tokens(name, kind):
    """The tiny checkpoints (float32) with an int8 / fp8 latent cache (one kind per checkpoint,
    to keep the test short). Along transformers' greedy tokens, teacher-forced (the prefill,
    then decode steps reading the codes), the logits' relative error to the float model's
    stays under 2% with int8 and 6% with fp8 at every position: the dense families' bounds
    (test_kv_cache_quant.py; measured max: 0.8% V2 int8, 4.7% V3 fp8), and their argmax is
    transformers' token except on a near tie of the float logits; greedy generation through
    the API gives transformers' tokens, rows parting only on such a tie (measured: V2 int8
    never; V3 fp8 both rows, at gaps of 1.8% and 2.5% of the largest logit)."""
    model = jaxinfer.load(str(HF / name), dtype="float32")
    ref = np.load(HF / name / "ref.npz")
    prompt, want = ref["greedy_prompt"], ref["greedy_new"]  # [B, P], [B, N]
    p, n = prompt.shape[1], want.shape[1]
    # the float model's logits before each of want's tokens (one forward, no cache)
    exact = np.asarray(model(np.concatenate([prompt, want], axis=1)))[:, p - 1:p - 1 + n]
    bound, tie = {"int8": (2e-2, 1e-2), "fp8": (6e-2, 3e-2)}[kind]

    def near_tie(row, i, token) -> bool:
        gap = exact[row, i, want[row, i]] - exact[row, i, token]
        return gap <= tie * np.abs(exact[row, i]).max()

    args = (model.params, jnp.asarray(prompt), jnp.full((len(prompt),), p, jnp.int32),
            jnp.asarray(want), model.plan)
    quant = np.asarray(forced_logits(*args, kind))  # [B, N, V]
    rel = np.linalg.norm(quant - exact, axis=-1) / np.linalg.norm(exact, axis=-1)  # [B, N]
    print(f"{name} {kind}: logits relative error max {rel.max():.2e}, mean {rel.mean():.2e}")
    assert rel.max() < bound, rel.max()
    assert rel[:, 1:].min() > 1e-4  # the decode steps really read the codes
    for row, i in zip(*np.nonzero(quant.argmax(-1) != want)):
        assert near_tie(row, i, quant[row, i].argmax()), (row, i)
    got = jaxinfer.generate(model, prompt.tolist(), max_new_tokens=n, kv_cache_dtype=kind)
    for row, (g, w) in enumerate(zip((c.token_ids for c in got), want.tolist())):
        i = first_difference(g, w)
        if i is not None and i < min(len(g), len(w)):
            assert near_tie(row, i, g[i]), (row, i)


def test_mla_decode_attention_causal_among_new_tokens():
    """Query t of Tq sees slots < lengths - (Tq - 1 - t): against one query at a time."""
    b, s, h, c, r = 2, 9, 2, 12, 8
    # inputs and their slices in numpy (eagerly each jax.random draw, slice and subtraction
    # compiled a program of its own)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((b, 3, h, c), np.float32)
    latent = rng.standard_normal((b, s, c), np.float32)
    lengths = np.array([6, 9], np.int32)
    attend = jax.jit(lambda q, lengths: pk.mla_decode_attention_reference(
        q, latent, lengths, sm_scale=0.3, rope_dim=c - r))
    out = np.asarray(attend(put(q), put(lengths)))
    assert out.shape == (b, 3, h, r)
    for t in range(3):
        one = attend(put(q[:, t:t + 1]), put(lengths - (2 - t)))
        np.testing.assert_allclose(out[:, t:t + 1], one, rtol=1e-6, atol=1e-6)
    # Length 1: the one visible slot's latent comes back.
    first = np.asarray(attend(put(q[:, :1]), put(np.ones((b,), np.int32))))
    np.testing.assert_allclose(first[:, 0, 0], latent[:, 0, :r], rtol=1e-6)


def test_fresh_prefill_takes_expanded_and_flash_padded_matches_reference():
    """A fresh prefill expands K/V; with the kernels on (interpret, bf16) the flash path, its
    head dims zero-padded (16 / 12 -> 16), matches the masked reference."""
    config = _tiny().replace(dtype="bfloat16")
    plan = Plan(config, KernelPolicy(interpret=True))
    b, t = 2, 5
    q, latent, _, w = _mla_inputs(config, b, t, t, key=1)
    # bf16 inputs made in numpy, the kernel and its reference one jitted program (eagerly each
    # op around the interpret-mode kernel compiled alone)
    q, latent = (put(np.asarray(x).astype(ml_dtypes.bfloat16)) for x in (q, latent))
    positions = put(np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)))
    assert mla.MLA_ATTEND.pick(q, latent, None, plan, positions=positions,
                               w_kv_b=w).name == "expanded"
    rng = np.random.default_rng(5)
    k = put(rng.standard_normal((b, t, 3, 16)).astype(ml_dtypes.bfloat16))
    v = put(rng.standard_normal((b, t, 3, 12)).astype(ml_dtypes.bfloat16))
    assert mla.MLA_PREFILL.pick(q, k, v, plan, positions=positions,
                                sm_scale=0.25).name == "flash_padded"

    @jax.jit
    def run(q, k, v, positions):
        f32 = jnp.float32
        return (mla.MLA_PREFILL.get("flash_padded").run(q, k, v, plan, positions=positions,
                                                        sm_scale=0.25),
                mla.attention_reference(q.astype(f32), k.astype(f32), v.astype(f32), positions,
                                        positions, sm_scale=0.25))

    assert sum(pallas_kernels_in(run, q, k, v, positions).values()) == 1  # the flash kernel
    got, want = run(q, k, v, positions)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2, rtol=3e-2)


def test_softmax_scale_has_yarn_mscale():
    config = PRESETS["deepseek-v3"]
    m = 0.1 * 1.0 * np.log(40.0) + 1.0
    assert mla.softmax_scale(config) == pytest.approx(192 ** -0.5 * m * m)
    assert mla.softmax_scale(config.replace(rope_scaling=type(config.rope_scaling)())) \
        == pytest.approx(192 ** -0.5)


def test_latent_cache_bytes_per_token():
    """DeepSeek-V2-Lite: 576 latent values per token and layer, against 16 x (192 + 128) =
    5120 for the same heads' K/V."""
    config = PRESETS["deepseek-v2-lite"]
    m = config.mla
    assert m.latent_dim == 576
    mha = config.num_heads * (m.qk_head_dim + m.v_head_dim)
    assert mha == 5120
    per_token = memory.kv_bytes_per_token(config)
    assert per_token == config.num_layers * 576 * 2  # bf16
    cache = jax.eval_shape(lambda: KVCache.init(config, 2, 256))
    assert isinstance(cache, LatentCache)
    assert cache.nbytes() == 2 * 256 * per_token == memory.kv_cache_bytes(config, 2, 256)
    print(f"latent {576 * 2} B/token/layer vs MHA-equivalent {mha * 2} B "
          f"({mha / 576:.2f}x)")
    assert mha / 576 == pytest.approx(8.89, abs=0.01)
    # int8 / fp8: 576 one-byte codes and two float32 scales (c_kv's, k_rope's)
    for kind in ("int8", "fp8"):
        quant = jax.eval_shape(lambda kind=kind: KVCache.init(config, 2, 256, kv_dtype=kind))
        assert quant.quantized and not cache.quantized
        assert memory.kv_bytes_per_token(config, kind) == config.num_layers * (576 + 8)
        assert quant.nbytes() == 2 * 256 * config.num_layers * 584 \
            == memory.kv_cache_bytes(config, 2, 256, kind)


def test_presets_param_counts():
    assert PRESETS["deepseek-v3"].num_params() == pytest.approx(671e9, rel=0.01)
    assert PRESETS["deepseek-v3"].num_params(active=True) == pytest.approx(37.5e9, rel=0.02)
    assert PRESETS["deepseek-v2-lite"].num_params() == pytest.approx(15.7e9, rel=0.01)


# ----------------------------------------------------------------------------- checkpoints


def _copy(tmp_path, name="deepseek_v3"):
    dst = tmp_path / name
    shutil.copytree(HF / name, dst)
    return dst


def test_fused_expert_layout_loads_the_same(tmp_path, variant):
    """Experts stored fused (mlp.experts.gate_up_proj [E, 2F, D], down_proj [E, D, F], the
    layout transformers 5 holds in memory) give the per-expert layout's logits."""
    d, model, ref = variant
    dst = tmp_path / "fused"
    shutil.copytree(d, dst)
    tensors = load_file(dst / "model.safetensors")
    e = model.config.moe.num_experts
    for i in range(model.config.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        if p + "0.gate_proj.weight" not in tensors:
            continue
        pop = {n: [tensors.pop(f"{p}{j}.{n}.weight") for j in range(e)]
               for n in ("gate_proj", "up_proj", "down_proj")}
        tensors[p + "gate_up_proj"] = np.stack(
            [np.concatenate([g, u]) for g, u in zip(pop["gate_proj"], pop["up_proj"])])
        tensors[p + "down_proj"] = np.stack(pop["down_proj"])
    save_file(tensors, dst / "model.safetensors")
    logits = np.asarray(jaxinfer.load(str(dst), dtype="float32")(ref["input_ids"]))
    np.testing.assert_allclose(logits, model(ref["input_ids"]), rtol=1e-6, atol=1e-6)


def _fp8_blocks(w, block):
    """w [out, in] float32 -> (fp8 codes, scale_inv [ceil(out/b), ceil(in/b)]) per block."""
    o, k = w.shape
    go, gk = -(-o // block), -(-k // block)
    padded = np.zeros((go * block, gk * block), np.float32)
    padded[:o, :k] = w
    blocks = padded.reshape(go, block, gk, block)
    scale = np.abs(blocks).max(axis=(1, 3)) / 448.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    codes = (blocks / scale[:, None, :, None]).reshape(go * block, gk * block)[:o, :k]
    return codes.astype(ml_dtypes.float8_e4m3fn), scale


def test_fp8_block_checkpoint_kept_in_fp8(tmp_path):
    """A DeepSeek-V3 checkpoint block-quantized to fp8 (weights + weight_scale_inv, as the
    release stores them, here with 16 x 16 blocks so that blocks are partial): loaded kept in
    fp8, its logits equal a float32 load of the same dequantized values."""
    src = HF / "deepseek_v3"
    fp8, deq = tmp_path / "fp8", tmp_path / "dequantized"
    shutil.copytree(src, fp8)
    shutil.copytree(src, deq)
    tensors = load_file(src / "model.safetensors")
    block = 16
    q_out, d_out = {}, {}
    for name, w in tensors.items():
        quantized = (w.ndim == 2 and name.endswith(".weight") and "layernorm" not in name
                     and "embed_tokens" not in name and not name.startswith("lm_head")
                     and not name.endswith("mlp.gate.weight"))
        if not quantized:
            q_out[name] = d_out[name] = w
            continue
        codes, scale = _fp8_blocks(w, block)
        q_out[name], q_out[name + "_scale_inv"] = codes, scale
        full = np.repeat(np.repeat(scale, block, 0), block, 1)[:w.shape[0], :w.shape[1]]
        d_out[name] = codes.astype(np.float32) * full
    save_file(q_out, fp8 / "model.safetensors")
    save_file(d_out, deq / "model.safetensors")
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
                                  "dynamic", "weight_block_size": [block, block]}
    (fp8 / "config.json").write_text(json.dumps(cfg))

    ref = np.load(src / "ref.npz")
    kept = jaxinfer.load(str(fp8), dtype="float32")
    layer = kept.params["layers"][1]
    assert isinstance(layer["wq_kv_a"], QuantizedWeight) and layer["wq_kv_a"].float8
    assert isinstance(layer["wkv_b"], QuantizedWeight) and isinstance(layer["wo"],
                                                                      QuantizedWeight)
    for name in ("experts_gate", "experts_up", "experts_down"):  # routed experts kept fp8
        w = layer[name]
        assert isinstance(w, QuantizedWeight) and w.float8 and w.planes[0].shape[0] == 8, name
    logits = np.asarray(kept(ref["input_ids"]))
    want = np.asarray(jaxinfer.load(str(deq), dtype="float32")(ref["input_ids"]))
    assert rel_err(logits, want) <= 1e-4
    np.testing.assert_array_equal(logits.argmax(-1), want.argmax(-1))
    assert rel_err(logits, ref["logits"]) > 1e-3  # fp8 really moved the weights


def _edit(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("name, changes, match", [
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method='greedy'"),
    ("deepseek_v2", {"topk_method": "random"}, "topk_method='random'"),
    ("deepseek_v2", {"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob=True"),
    ("deepseek_v2", {"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ("deepseek_v2", {"attention_bias": True}, "attention_bias=True"),
    ("deepseek_v2", {"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
    ("deepseek_v3", {"n_group": 3}, r"n_group \(3\) must divide num_experts \(8\)"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "awq"}}, "quant_method='awq'"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8", "weight_block_size":
                                             [128, 64]}}, "weight_block_size"),
])
def test_bad_configs(tmp_path, name, changes, match):
    d = _copy(tmp_path, name)
    _edit(d, **changes)
    with pytest.raises(ValueError, match=match):
        jaxinfer.load(str(d), dtype="float32")


def test_bad_config_objects():
    with pytest.raises(ValueError, match="kv_lora_rank must be an integer >= 1"):
        MLAConfig(kv_lora_rank=0, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    with pytest.raises(ValueError, match="q_lora_rank must be None or an integer"):
        MLAConfig(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                  q_lora_rank=0)
    with pytest.raises(ValueError, match=r"num_kv_heads \(1\) must equal num_heads \(3\)"):
        _tiny().replace(num_kv_heads=1)
    with pytest.raises(ValueError, match=r"head_dim \(24\) must be qk_nope_head_dim \+ "):
        _tiny().replace(head_dim=24)
    with pytest.raises(ValueError, match="kv_dtype must be None"):
        KVCache.init(_tiny(), 1, 8, kv_dtype="int4")
    with pytest.raises(ValueError, match="LatentCache scale_dtype must be float32 or float16"):
        KVCache.init(_tiny(), 1, 8, kv_dtype="int8", scale_dtype=jnp.bfloat16)


def test_wrong_tensor_shape_names_it(tmp_path):
    d = _copy(tmp_path, "deepseek_v2")
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.0: wkv_b has shape"):
        jaxinfer.load(str(d), dtype="float32")


def test_mtp_layers_are_ignored(tmp_path):
    """DeepSeek-V3 checkpoints carry the multi-token-prediction module as a layer past
    num_hidden_layers; it is not part of the model and not read."""
    d = _copy(tmp_path, "deepseek_v3")
    tensors = load_file(d / "model.safetensors")
    extra = {k.replace("model.layers.2.", "model.layers.3."): v for k, v in tensors.items()
             if k.startswith("model.layers.2.")}
    save_file({**tensors, **extra}, d / "model.safetensors")
    ref = np.load(d / "ref.npz")
    logits = np.asarray(jaxinfer.load(str(d), dtype="float32")(ref["input_ids"]))
    assert rel_err(logits, ref["logits"]) <= 1e-4


# ----------------------------------------------------------------------------- GPU lowering


@pytest.mark.parametrize("preset", ["deepseek-v2-lite", "deepseek-v3"])
def test_real_shapes_lower_for_h200(preset):
    """A two-layer (one dense, one MoE) model at the preset's real shapes, bf16, with the ops
    forced onto the kernels, lowered for an H200 on the CPU: a fresh prefill of 128 tokens
    (flash attention on q/k/v padded 192 / 128 -> 256) and a decode step (the fused decode
    matmuls, the absorbed MLA kernel), also against an int8 latent cache (its quantized form)."""
    from test_gpu_lowering import ON_GPU, kernel_names, lower_for_h200

    from jaxinfer.models import deepseek
    from jaxinfer.weights import abstract_params

    base = PRESETS[preset]
    config = base.replace(num_layers=2, moe=base.moe.replace(first_dense_layers=1))
    params = abstract_params(deepseek.param_specs(config), jnp.bfloat16)
    # The experts gather: ragged_dot does not lower under the abstract mesh (explicit sharding
    # inference for ragged_dot_general is not implemented in jax 0.11).
    plan = Plan(config, ON_GPU.replace(moe=MoEImpl.GATHER))

    def run(params, tokens, positions, cache, fresh):
        return deepseek.forward(params, tokens, positions, plan, cache, fresh=fresh)

    for batch, t, fresh, kind in ((1, 128, True, None), (4, 1, False, None),
                                  (4, 1, False, "int8")):
        cache = jax.eval_shape(lambda: KVCache.init(config, batch, 256, kv_dtype=kind))
        tokens = jax.ShapeDtypeStruct((batch, t), jnp.int32)
        module = lower_for_h200(lambda p, x, c: run(p, x, x, c, fresh), params, tokens, cache)
        names = kernel_names(module)
        if fresh:
            assert any("flash" in n for n in names), names
        else:
            assert any(n.startswith("norm_matmul") or n.startswith("add_norm_matmul")
                       for n in names), names
            mla_kernel = "mla_decode_attention_quantized" if kind else "mla_decode_attention"
            assert mla_kernel in names, names


@pytest.mark.gpu
def test_quantized_latent_cache_through_the_kernel_gpu():
    """bf16 on the GPU, kernels wired in, latent dims the MLA kernel tiles (R 64, Dr 16; the
    fixtures' Dr 8 takes the reference): random weights, a 12-token prefill, then 24 decode
    steps teacher-forced; the int8 / fp8 latent cache's logits within 5% / 15% of the bf16
    cache's at every step (these random weights are touchier than the fixtures': on the CPU,
    the reference core, max 2.3% / 8.1%), and the absorbed core is the Pallas kernel on the
    codes."""
    from jaxinfer.models import deepseek
    from jaxinfer.weights import init_params

    m = MLAConfig(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    config = Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                    num_heads=8, num_kv_heads=8, head_dim=48, family="deepseek", mla=m,
                    dtype="bfloat16")
    plan = Plan(config)
    params = init_params(deepseek.param_specs(config), jax.random.key(0), jnp.bfloat16)
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, 256, (3, 12)), jnp.int32)
    new = jnp.asarray(rng.integers(0, 256, (3, 24)), jnp.int32)
    args = (params, prompt, jnp.full((3,), 12, jnp.int32), new, plan)
    ref = np.asarray(forced_logits(*args, None))  # [B, N, V]
    for kind, bound in (("int8", 5e-2), ("fp8", 1.5e-1)):
        cache = jax.eval_shape(lambda kind=kind: KVCache.init(config, 3, 36, kv_dtype=kind))
        layer = cache.layer(0)
        q = jax.ShapeDtypeStruct((3, 1, 8, 80), jnp.bfloat16)
        assert mla.MLA_CORE.pick(q, layer.latent, cache.lengths, plan, sm_scale=0.1,
                                 kv_lora_rank=64, latent_scale=layer.scale).name == "pallas"
        quant = np.asarray(forced_logits(*args, kind))
        rel = np.linalg.norm(quant - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
        print(f"{kind}: logits relative error max {rel.max():.2e}, mean {rel.mean():.2e}")
        assert rel.max() < bound and rel[:, 1:].min() > 0, (kind, rel.max())


def test_absorbed_core_takes_the_kernel_where_its_tiles_fit():
    """MLA_CORE and MLA_PAGED_CORE: the Pallas kernels (interpret, bf16) where R and Dr are
    powers of two >= 16 (and pages hold >= 16 slots), matching their references; the
    fixtures' Dr = 8 falls back to the reference."""
    from jaxinfer.configs import PRESETS
    from jaxinfer.plan import KernelPolicy, Plan

    plan = Plan(PRESETS["deepseek-v2-lite"], KernelPolicy(interpret=True))
    b, s, h, r, dr = 2, 40, 4, 32, 16
    # Inputs made in numpy and the kernels with their references run as one jitted program
    # (run eagerly, each op around the interpret-mode kernels compiled alone: ~100 compiles);
    # the dispatchers' picks are checked on the same shapes, which the jitted calls take.
    rng = np.random.default_rng(5)
    q = put(rng.standard_normal((b, 1, h, r + dr)).astype(ml_dtypes.bfloat16))
    latent = put(rng.standard_normal((b, s, r + dr)).astype(ml_dtypes.bfloat16))
    lengths = put(np.array([17, 40], np.int32))
    positions = put(np.array([[16], [31]], np.int32))
    kw = dict(sm_scale=0.2, kv_lora_rank=r)
    assert mla.MLA_CORE.pick(q, latent, lengths, plan, **kw).name == "pallas"
    # an int8 latent: the kernel reads the codes and their scales [B, S, 2]
    codes, scale = jax.eval_shape(lambda x: quantize_latent(x.astype(jnp.float32), r, jnp.int8),
                                  latent)
    qkw = dict(kw, latent_scale=scale)
    assert mla.MLA_CORE.pick(q, codes, lengths, plan, **qkw).name == "pallas"
    small = jax.ShapeDtypeStruct((b, s, 16 + 8), latent.dtype)
    assert mla.MLA_CORE.pick(jax.ShapeDtypeStruct((b, 1, h, 24), q.dtype), small, lengths,
                             plan, sm_scale=0.2, kv_lora_rank=16).name == "reference"
    # the engine's pages: the paged kernel from pages of 16 slots (its tiles), as its reference
    rows = jax.ShapeDtypeStruct((b, 32, r + dr), latent.dtype)  # latent[:, :32]
    pages = jax.ShapeDtypeStruct((8, 8, r + dr), latent.dtype)
    tables = jax.ShapeDtypeStruct((b, 4), jnp.int32)
    assert mla.MLA_PAGED_CORE.pick(q, pages, tables, positions, plan, **kw).name == "reference"
    pages = jax.ShapeDtypeStruct((4, 16, r + dr), latent.dtype)
    tables = jax.ShapeDtypeStruct((b, 2), jnp.int32)
    assert mla.MLA_PAGED_CORE.pick(q, pages, tables, positions, plan, **kw).name == "pallas"

    @jax.jit
    def run(q, latent, lengths, positions):
        f32 = jnp.float32
        codes, scale = quantize_latent(latent.astype(f32), r, jnp.int8)
        rows = latent[:, :32]
        pages, tables = rows.reshape(4, 16, r + dr), jnp.arange(4, dtype=jnp.int32).reshape(b, 2)
        return [(mla.MLA_CORE(q, latent, lengths, plan, **kw).astype(f32),
                 pk.mla_decode_attention_reference(q, latent, lengths, sm_scale=0.2,
                                                   rope_dim=dr).astype(f32)),
                (mla.MLA_CORE(q, codes, lengths, plan, **kw, latent_scale=scale).astype(f32),
                 pk.mla_decode_attention_reference(q, codes, lengths, sm_scale=0.2, rope_dim=dr,
                                                   latent_scale=scale).astype(f32)),
                (mla.MLA_PAGED_CORE(q, pages, tables, positions, plan, **kw).astype(f32),
                 pk.mla_decode_attention_reference(q, rows, positions[:, 0] + 1, sm_scale=0.2,
                                                   rope_dim=dr).astype(f32))]

    kernels = pallas_kernels_in(run, q, latent, lengths, positions)
    assert sum(kernels.values()) == 3, kernels  # each of the three is the Pallas kernel
    for got, want in run(q, latent, lengths, positions):
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
