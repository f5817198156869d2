"""Mixture-of-experts GGUFs: the tiny HF fixtures of Mixtral, Qwen3-MoE and DeepSeek-V2 / V3
(tests/fixtures/data/hf) written as llama.cpp's convert_hf_to_gguf.py writes them (experts
stacked [E, out, in], DeepSeek's kv_b split into attn_k_b / attn_v_b, and the older layouts:
per-expert Mixtral tensors, one attn_kv_b), checked against transformers' golden logits, the
HF loader's params, and gguf.quants for the kept-quantized stacked experts."""

from __future__ import annotations

import json
import os
import pathlib

import gguf
import jax
import numpy as np
import pytest
from test_gguf import HF, rel_err, run_forward

from checkpoints import gguf as G
from checkpoints.hf import load_hf_dir
from jaxinfer.weights import QuantizedWeight, dequantize

QT = gguf.GGMLQuantizationType
EXPERT_NAMES = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
                "down_proj": "down"}


def hf_to_gguf(variant: str, dst: pathlib.Path, arch: str, qtype=None, legacy: bool = False,
               meta: dict | None = None, drop=()) -> pathlib.Path:
    """tests/fixtures/data/hf/<variant> as convert_hf_to_gguf.py writes it for `arch` (no
    tokenizer). qtype: matmul weights and experts whose rows are whole blocks of it in that
    type (gguf.quants.quantize), the others F16 (llama.cpp's fallback for such rows); None: F32.
    legacy: Mixtral's per-expert tensors / DeepSeek's one attn_kv_b (older converters).
    meta: extra or replaced `{arch}.` keys (value None: left out); drop: GGUF names left out."""
    from safetensors.numpy import load_file

    cfg = json.loads((HF / variant / "config.json").read_text())
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv_heads = cfg["num_key_value_heads"]
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items()
                                          if n == arch), layers)
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    keys = {"block_count": layers, "context_length": cfg["max_position_embeddings"],
            "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": heads, "attention.head_count_kv": kv_heads,
            "rope.freq_base": float(theta), "attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
            "vocab_size": cfg["vocab_size"],
            "expert_count": cfg.get("num_local_experts") or cfg.get("n_routed_experts"),
            "expert_used_count": cfg["num_experts_per_tok"]}
    if cfg.get("n_group"):
        keys["expert_group_count"] = cfg["n_group"]
    if cfg.get("topk_group"):
        keys["expert_group_used_count"] = cfg["topk_group"]
    mla = arch == "deepseek2"
    if arch == "llama":
        keys["rope.dimension_count"] = cfg["head_dim"]
    if arch == "qwen3moe":
        keys.update({"attention.key_length": cfg["head_dim"],
                     "attention.value_length": cfg["head_dim"],
                     "expert_feed_forward_length": cfg["moe_intermediate_size"]})
    if mla:  # DeepseekV2Model.set_gguf_parameters
        r, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        keys.update({"leading_dense_block_count": cfg["first_k_dense_replace"],
                     "attention.kv_lora_rank": r, "rope.dimension_count": rope,
                     "expert_feed_forward_length": cfg["moe_intermediate_size"],
                     "expert_shared_count": cfg["n_shared_experts"],
                     "expert_weights_scale": float(cfg["routed_scaling_factor"])})
        if legacy:  # before the kv_b split: per-head sizes, all heads as KV heads
            keys.update({"attention.key_length": nope + rope, "attention.value_length": v})
        else:
            keys.update({"attention.head_count_kv": 1, "attention.key_length": r + rope,
                         "attention.value_length": r, "attention.key_length_mla": nope + rope,
                         "attention.value_length_mla": v})
        if cfg.get("q_lora_rank"):
            keys["attention.q_lora_rank"] = cfg["q_lora_rank"]
        if cfg.get("norm_topk_prob"):
            keys["expert_weights_norm"] = True
        if cfg["model_type"] == "deepseek_v3":
            keys["expert_gating_func"] = gguf.ExpertGatingFuncType.SIGMOID
            rope_cfg = cfg["rope_parameters"]
            keys.update({"rope.scaling.type": "yarn", "rope.scaling.factor": rope_cfg["factor"],
                         "rope.scaling.original_context_length":
                             rope_cfg["original_max_position_embeddings"],
                         "rope.scaling.yarn_log_multiplier": 0.1 * rope_cfg["mscale_all_dim"]})
    keys.update(meta or {})

    w = gguf.GGUFWriter(str(dst), arch)
    for key, value in keys.items():
        if value is None:
            continue
        full = f"{arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        elif isinstance(value, str):
            w.add_string(full, value)
        else:
            w.add_uint32(full, int(value))

    def add(name: str, t: np.ndarray):
        if name in drop:
            return
        t = np.ascontiguousarray(t, dtype=np.float32)
        block = gguf.GGML_QUANT_SIZES[qtype][0] if qtype is not None else 0
        if qtype is None or t.ndim == 1 or name.endswith("ffn_gate_inp.weight"):
            w.add_tensor(name, t)  # the converter keeps norms and routers F32
        elif t.shape[-1] % block == 0:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t.astype(np.float16))

    def permute(t, n_head):  # LlamaModel.permute
        return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2) \
            .reshape(t.shape)

    experts: dict = {}
    tensors = load_file(HF / variant / "model.safetensors")
    for hf_name, t in tensors.items():
        if hf_name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        parts = hf_name.split(".")
        if "experts" in parts and "shared_experts" not in parts:
            i, j, kind = int(parts[2]), int(parts[parts.index("experts") + 1]), parts[-2]
            experts.setdefault((i, EXPERT_NAMES[kind]), {})[j] = t
            continue
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            t = permute(t, heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            t = permute(t, kv_heads)
        if mla and hf_name.endswith("kv_b_proj.weight") and not legacy:
            i = int(parts[2])
            nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            kv_b = t.reshape(heads, nope + v, -1)
            add(f"blk.{i}.attn_k_b.weight", kv_b[:, :nope].transpose(0, 2, 1))  # [H, R, Dn]
            add(f"blk.{i}.attn_v_b.weight", kv_b[:, nope:])  # [H, Dv, R]
            continue
        if hf_name.endswith("e_score_correction_bias"):
            add(f"blk.{parts[2]}.exp_probs_b.bias", t)
            continue
        # gguf's qwen3moe names have no dense MLP (the converter cannot write the fixture's
        # mlp_only_layers): the llama names, which the loader reads for such layers.
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias")) \
            or dense_names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        add(name, t)
    for (i, kind), per_expert in sorted(experts.items()):
        stacked = [per_expert[j] for j in range(len(per_expert))]
        if legacy and arch == "llama":
            for j, t in enumerate(stacked):
                add(f"blk.{i}.ffn_{kind}.{j}.weight", t)
        else:
            add(f"blk.{i}.ffn_{kind}_exps.weight", np.stack(stacked))  # [E, out, in]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


VARIANTS = [("mixtral", "llama", False), ("mixtral", "llama", True),
            ("qwen3_moe", "qwen3moe", False), ("deepseek_v2", "deepseek2", False),
            ("deepseek_v2", "deepseek2", True), ("deepseek_v2_qlora", "deepseek2", False)]
IDS = [f"{v}{'-legacy' if legacy else ''}" for v, _, legacy in VARIANTS]


@pytest.fixture(scope="module")
def hf_models():
    cache = {}

    def get(variant):
        if variant not in cache:
            cache[variant] = load_hf_dir(HF / variant)[:2]
        return cache[variant]
    return get


def without_windows(config):
    """Mixtral's sliding window is not in its GGUF (llama.cpp runs it with full attention)."""
    return config.replace(layer_windows=())


@pytest.mark.parametrize("variant,arch,legacy", VARIANTS, ids=IDS)
def test_f32_matches_transformers(tmp_path, hf_models, variant, arch, legacy):
    path = hf_to_gguf(variant, tmp_path / "m.gguf", arch, legacy=legacy)
    config, params, _ = G.load_gguf_params(path)
    hf_config, hf_params = hf_models(variant)
    assert config == without_windows(hf_config).replace(
        max_position_embeddings=config.max_position_embeddings,
        bos_token_id=None, eos_token_ids=(), rms_norm_eps=config.rms_norm_eps)
    assert config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps)  # float32 in GGUF
    # The HF loader's params, bit for bit: experts stacked, q / k unpermuted, kv_b joined.
    assert jax.tree.structure(params) == jax.tree.structure(hf_params)
    for ours, theirs in zip(jax.tree.leaves(params), jax.tree.leaves(hf_params)):
        np.testing.assert_array_equal(ours, np.asarray(theirs))
    ref = np.load(HF / variant / "ref.npz")
    logits = run_forward(config, params, ref["input_ids"])
    # Mixtral's fixture slides a window of 8 that its GGUF does not carry: the positions it
    # does not cut yet are transformers' own.
    seen = 8 if hf_config.layer_windows else logits.shape[1]
    assert rel_err(logits[:, :seen], ref["logits"][:, :seen]) <= 1e-4
    np.testing.assert_array_equal(logits[:, :seen].argmax(-1), ref["logits"][:, :seen].argmax(-1))


def test_deepseek_v3_config_and_params(tmp_path, hf_models):
    """Sigmoid routing, groups scored by their best two, the score bias (exp_probs_b), and YaRN's
    mscale_all_dim from yarn_log_multiplier. The fixture's own mscale (1.0, not mscale_all_dim)
    has no GGUF key: llama.cpp takes mscale = mscale_all_dim, so no golden logits here."""
    path = hf_to_gguf("deepseek_v3", tmp_path / "v3.gguf", "deepseek2")
    config, params, _ = G.load_gguf_params(path)
    hf_config, hf_params = hf_models("deepseek_v3")
    assert config.architecture == "DeepseekV3ForCausalLM"
    assert config.moe == hf_config.moe and config.mla == hf_config.mla
    rs = config.rope_scaling
    assert (rs.kind, rs.factor, rs.original_max_position_embeddings) == ("yarn", 4.0, 16)
    assert rs.mscale_all_dim == pytest.approx(0.8) and rs.mscale == rs.mscale_all_dim
    for ours, theirs in zip(jax.tree.leaves(params), jax.tree.leaves(hf_params)):
        np.testing.assert_array_equal(ours, np.asarray(theirs))


def test_kv_b_join_is_needed(tmp_path):
    """v_b's columns taken in k_b's place (the transposes undone the wrong way) are far off."""
    path = hf_to_gguf("deepseek_v2", tmp_path / "m.gguf", "deepseek2")
    config, params, _ = G.load_gguf_params(path)
    mla = config.mla
    for lp in params["layers"]:
        w = lp["wkv_b"]  # [R, H, Dn + Dv]
        lp["wkv_b"] = np.concatenate([w[..., mla.qk_nope_head_dim:], w[..., :mla.v_head_dim]],
                                     axis=-1)
    ref = np.load(HF / "deepseek_v2" / "ref.npz")
    assert rel_err(run_forward(config, params, ref["input_ids"]), ref["logits"]) > 1e-2


# ---------------------------------------------------------------------------------------------
# Quantized files: Q8_0 where rows are whole blocks, F16 elsewhere
# ---------------------------------------------------------------------------------------------


def dequantized_copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """src with every tensor dequantized by gguf.quants and written F32 (same metadata)."""
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        w.add_key_value(name, field.contents(), kind,
                        sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        w.add_tensor(t.name, np.asarray(gguf.quants.dequantize(t.data, t.tensor_type),
                                        np.float32).reshape(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("variant,arch", [("mixtral", "llama"), ("qwen3_moe", "qwen3moe"),
                                          ("deepseek_v2", "deepseek2")])
def test_q8_0_matches_dequantized_weights(tmp_path, variant, arch):
    path = hf_to_gguf(variant, tmp_path / "q8.gguf", arch, qtype=QT.Q8_0)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert {t for n, t in types.items() if "gate_exps" in n} == {QT.Q8_0}  # quantized experts
    config, params, _ = G.load_gguf_params(path, keep_quantized=False)
    ref_config, ref_params, _ = G.load_gguf_params(
        dequantized_copy(path, tmp_path / "f32.gguf"))
    assert config == ref_config
    for ours, theirs in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_array_equal(ours, theirs)
    ref = np.load(HF / variant / "ref.npz")
    logits = run_forward(config, params, ref["input_ids"])
    # Q8_0's rounding moves the logits a few percent from transformers' float32 ones (these
    # random tiny weights; a misread tensor is off by about 100%).
    seen = 8 if variant == "mixtral" else logits.shape[1]
    assert rel_err(logits[:, :seen], ref["logits"][:, :seen]) <= 0.1


def test_kept_quantized_experts_are_stacked(tmp_path):
    """keep_quantized=True: each Q8_0 expert tensor is one QuantizedWeight with a leading expert
    axis on every array, static fields of one expert's [K, N], each expert's slice equal to
    gguf.quants' dequantization of its blocks; the F16 experts stay float [E, in, out]."""
    path = hf_to_gguf("qwen3_moe", tmp_path / "q8.gguf", "qwen3moe", qtype=QT.Q8_0)
    config, params, _ = G.load_gguf_params(path)  # keep_quantized=True
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    e, d, f = config.moe.num_experts, config.hidden_size, config.moe.expert_intermediate_size
    for i in (0, 2):  # layer 1 is a dense MLP (mlp_only_layers)
        lp = params["layers"][i]
        assert isinstance(lp["router"], np.ndarray) and lp["router"].shape == (d, e)
        assert lp["experts_down"].shape == (e, f, d) and lp["experts_down"].dtype == np.float32
        for ours in ("experts_gate", "experts_up"):
            qw = lp[ours]
            assert isinstance(qw, QuantizedWeight) and qw.name == "q8_0"
            assert (qw.k, qw.out_shape, qw.bits, qw.group) == (d, (f,), (8,), 32)
            assert qw.planes[0].shape == (e, d, f) and qw.planes[0].dtype == np.int8
            assert qw.scale.shape == (e, d // 32, f) and qw.scale.dtype == np.float16
            raw = tensors[f"blk.{i}.ffn_{ours.split('_')[1]}_exps.weight"].data  # [E, F, bytes]
            for j in range(e):
                one = jax.tree.map(lambda a, j=j: a[j], qw)
                np.testing.assert_array_equal(
                    np.asarray(dequantize(one, np.float32)),
                    gguf.quants.dequantize(raw[j], QT.Q8_0).T)
    assert isinstance(params["layers"][1]["w_gate"], QuantizedWeight)  # dense: kept as before


# Each case compiles two models (~10-20 s on CPU): the K-quants (two-level scales) by default,
# the Q8_0 fixtures too with GGUF_MOE_ALL_RUNS=1 in the environment.
KEPT_RUNS = [("k-quants", "qwen3moe")] + ([
    ("mixtral", "llama"), ("qwen3_moe", "qwen3moe"), ("deepseek_v2", "deepseek2")]
    if os.environ.get("GGUF_MOE_ALL_RUNS") else [])


@pytest.mark.parametrize("variant,arch", KEPT_RUNS)
def test_kept_experts_run_as_dequantized(tmp_path, variant, arch):
    """The model on the kept experts (Q4_K / Q5_K / Q6_K; Q8_0 in the wider run) computes what
    it computes on their dequantized values. Skipped where the model side still refuses
    quantized experts (jaxinfer/weights.py); it runs once the quantized-experts kernels are
    merged."""
    if variant == "k-quants":
        path, tokens = tmp_path / "kq.gguf", np.arange(1, 9).reshape(1, 8)
        k_quant_moe(path)
    else:
        path = hf_to_gguf(variant, tmp_path / "q8.gguf", arch, qtype=QT.Q8_0)
        tokens = np.load(HF / variant / "ref.npz")["input_ids"]
    config, kept, _ = G.load_gguf_params(path)
    _, floats, _ = G.load_gguf_params(path, keep_quantized=False)
    try:
        logits = run_forward(config, kept, tokens)
    except ValueError as e:
        if "quantized experts are not supported" not in str(e):
            raise
        pytest.skip("the model side does not take quantized experts on this branch")
    assert rel_err(logits, run_forward(config, floats, tokens)) <= 1e-5


def test_legacy_mixtral_experts_kept_quantized(tmp_path):
    """Per-expert Q8_0 tensors of older Mixtral files stack into the same QuantizedWeight."""
    new = G.load_gguf_params(hf_to_gguf("mixtral", tmp_path / "n.gguf", "llama", QT.Q8_0))[1]
    old = G.load_gguf_params(hf_to_gguf("mixtral", tmp_path / "o.gguf", "llama", QT.Q8_0,
                                        legacy=True))[1]
    assert jax.tree.structure(new) == jax.tree.structure(old)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old)):
        np.testing.assert_array_equal(a, b)
    assert isinstance(new["layers"][0]["experts_down"], QuantizedWeight)  # F = 32: whole blocks


# ---------------------------------------------------------------------------------------------
# Clear errors
# ---------------------------------------------------------------------------------------------


def test_expert_count_without_expert_tensors(tmp_path):
    path = hf_to_gguf("mixtral", tmp_path / "no-experts.gguf", "llama",
                      drop=("blk.1.ffn_up_exps.weight",))
    with pytest.raises(ValueError, match=r"no-experts\.gguf: tensor 'blk\.1\.ffn_up_exps\.weight' "
                                         r"is missing \(the metadata has 4 experts"):
        G.load_gguf_params(path)


def test_unknown_gating_func(tmp_path):
    path = hf_to_gguf("deepseek_v2", tmp_path / "gating.gguf", "deepseek2",
                      meta={"expert_gating_func": 7})
    with pytest.raises(ValueError, match=r"gating\.gguf: GGUF metadata "
                                         r"deepseek2\.expert_gating_func = 7 is not supported"):
        G.load_gguf_params(path)
    path = hf_to_gguf("qwen3_moe", tmp_path / "sigmoid.gguf", "qwen3moe",
                      meta={"expert_gating_func": 2})
    with pytest.raises(ValueError, match=r"qwen3moe\.expert_gating_func = 2 is not supported "
                                         r"for 'qwen3moe' \(supported: 1 \(softmax\)\)"):
        G.load_gguf_params(path)


def test_expert_shapes_disagree_with_metadata(tmp_path):
    path = hf_to_gguf("qwen3_moe", tmp_path / "ff.gguf", "qwen3moe",
                      meta={"expert_feed_forward_length": 32})
    with pytest.raises(ValueError, match=r"ff\.gguf: tensor 'blk\.0\.ffn_gate_exps\.weight' has "
                                         r"shape \[8, 16, 64\] \(numpy order\) but the metadata "
                                         r"implies \[8, 32, 64\]"):
        G.load_gguf_params(path)


@pytest.mark.parametrize("meta,message", [
    ({"expert_shared_count": 2}, r"llama\.expert_shared_count = 2 is not supported"),
    ({"expert_used_count": None}, r"'llama\.expert_used_count' is missing"),
    ({"expert_used_count": 5}, r"experts_per_token \(5\) must be at most num_experts \(4\)"),
    ({"expert_group_scale": 2.0}, r"llama\.expert_group_scale = 2\.0 asks for a MoE variant "
                                  r"that is not supported"),
], ids=["shared", "no-top-k", "top-k", "group-scale"])
def test_bad_moe_metadata(tmp_path, meta, message):
    path = hf_to_gguf("mixtral", tmp_path / "bad.gguf", "llama", meta=meta)
    with pytest.raises(ValueError, match=message):
        G.load_gguf_params(path)


def test_experts_in_a_dense_architecture(tmp_path):
    path = hf_to_gguf("qwen3_moe", tmp_path / "qwen3.gguf", "qwen3moe")
    meta = G.read_metadata(path)
    meta = {k.replace("qwen3moe.", "qwen3."): v for k, v in meta.items()}
    meta["general.architecture"] = "qwen3"
    with pytest.raises(ValueError, match=r"qwen3\.expert_count = 8, but llama\.cpp's 'qwen3' has "
                                         r"no experts; .* supported as: llama, qwen3moe, "
                                         r"deepseek2"):
        G.config_from_metadata(meta, tmp_path / "qwen3.gguf")


def test_deepseek2_key_lengths_must_be_per_head(tmp_path):
    """A split-kv_b file without key_length_mla cannot say the per-head sizes."""
    path = hf_to_gguf("deepseek_v2", tmp_path / "no-mla.gguf", "deepseek2",
                      meta={"attention.key_length_mla": None})
    with pytest.raises(ValueError, match=r"key_length_mla / value_length_mla are missing.*"
                                         r"re-convert the model"):
        G.load_gguf_params(path)


def test_mixtral_config_from_metadata_alone():
    """Without the tensor names (metadata only) every layer has experts; Mixtral's experts are
    feed_forward_length wide and renormalised, as llama.cpp runs them."""
    meta = {"general.architecture": "llama", "llama.expert_count": 8,
            "llama.expert_used_count": 2, "llama.block_count": 2, "llama.context_length": 64,
            "llama.embedding_length": 64, "llama.feed_forward_length": 96,
            "llama.attention.head_count": 4, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "llama.vocab_size": 32}
    config = G.config_from_metadata(meta, "mixtral.gguf")
    assert config.architecture == "MixtralForCausalLM"
    assert (config.moe.num_experts, config.moe.experts_per_token,
            config.moe.expert_intermediate_size, config.moe.norm_topk_prob) == (8, 2, 96, True)
    assert all(config.is_moe_layer(i) for i in range(2))


# Byte offsets of the fp16 fields (d, dmin) in the K-quant blocks; every other byte is valid.
K_FP16 = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}


def k_quant_experts(qtype, e: int, rows: int, cols: int, rng) -> np.ndarray:
    """uint8 [E, rows, row bytes]: random blocks of qtype with small positive fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (e * rows * cols // block, size), dtype=np.uint8)
    for off in K_FP16[qtype]:
        scales = rng.uniform(1e-3, 2e-3, raw.shape[0]).astype(np.float16)
        raw[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(e, rows, -1)


K_EXPERTS = {"gate": (QT.Q4_K, 256, 256), "up": (QT.Q5_K, 256, 256), "down": (QT.Q6_K, 256, 256)}


def k_quant_moe(path: pathlib.Path) -> dict:
    """A one-layer qwen3moe of hidden 256 whose 2 experts are random K-quant blocks (K_EXPERTS:
    kind -> (type, rows, row elements)), the rest F32; returns kind -> the experts' raw blocks."""
    rng = np.random.default_rng(0)
    d, e, hd, vocab = 256, 2, 128, 16
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": d,
                       "feed_forward_length": d, "attention.head_count": 2,
                       "attention.head_count_kv": 1, "attention.key_length": hd,
                       "attention.value_length": hd, "expert_count": e, "expert_used_count": 1,
                       "expert_feed_forward_length": d, "vocab_size": vocab}.items():
        w.add_uint32(f"qwen3moe.{key}", value)
    w.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
    floats = {"token_embd.weight": (vocab, d), "output.weight": (vocab, d),
              "output_norm.weight": (d,), "blk.0.attn_norm.weight": (d,),
              "blk.0.ffn_norm.weight": (d,), "blk.0.attn_q.weight": (2 * hd, d),
              "blk.0.attn_k.weight": (hd, d), "blk.0.attn_v.weight": (hd, d),
              "blk.0.attn_output.weight": (d, 2 * hd), "blk.0.attn_q_norm.weight": (hd,),
              "blk.0.attn_k_norm.weight": (hd,), "blk.0.ffn_gate_inp.weight": (e, d)}
    for name, shape in floats.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    raws = {}
    for kind, (qtype, rows, cols) in K_EXPERTS.items():
        raws[kind] = k_quant_experts(qtype, e, rows, cols, rng)
        w.add_tensor(f"blk.0.ffn_{kind}_exps.weight", raws[kind], raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return raws


def test_k_quant_experts_stack_their_repacks(tmp_path):
    """Two-level K-quant scales (rows of 256): each stacked QuantizedWeight is exactly
    jax.tree.map(np.stack) of gguf_blocks.repack of each expert's blocks (the contract with the
    quantized experts kernels), and each expert dequantizes to gguf.quants' values."""
    from checkpoints import gguf_blocks

    path = tmp_path / "kq.gguf"
    raws = k_quant_moe(path)
    config, params, _ = G.load_gguf_params(path)
    e, lp = config.moe.num_experts, params["layers"][0]
    for kind, (qtype, rows, cols) in K_EXPERTS.items():
        qw = lp[f"experts_{kind}"]
        per_expert = [gguf_blocks.repack(raws[kind][j], qtype.name, cols, rows) for j in range(e)]
        assert jax.tree.structure(qw) == jax.tree.structure(per_expert[0])  # static fields
        assert (qw.k, qw.out_shape) == (cols, (rows,))
        for ours, theirs in zip(jax.tree.leaves(qw),
                                jax.tree.leaves(jax.tree.map(lambda *a: np.stack(a),
                                                             *per_expert))):
            assert ours.shape[0] == e
            np.testing.assert_array_equal(ours, theirs)
        for j in range(e):
            one = jax.tree.map(lambda a, j=j: a[j], qw)
            np.testing.assert_array_equal(np.asarray(dequantize(one, np.float32)),
                                          gguf.quants.dequantize(raws[kind][j], qtype).T)
