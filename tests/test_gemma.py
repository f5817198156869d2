"""Gemma 2 and Gemma 3 against HF transformers' goldens (tests/fixtures/data/hf/gemma*): the
full forward, incremental decoding past the sliding window, greedy generation, the multimodal
checkpoint's text tower, the GGUF load, and bad configs."""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer.cache import KVCache
from jaxinfer.models import gemma
from jaxinfer.plan import KernelPolicy

HF = pathlib.Path(__file__).parent / "fixtures" / "data" / "hf"
GGUF = pathlib.Path(__file__).parent / "fixtures" / "data" / "gguf"
NAMES = ("gemma2", "gemma3")


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=NAMES)
def fixture(request):
    path = HF / request.param
    return path, jaxinfer.load(str(path), dtype="float32"), np.load(path / "ref.npz")


def test_config_reads_every_gemma_switch():
    g2 = jaxinfer.load(str(HF / "gemma2"), dtype="float32").config
    assert (g2.family, g2.mlp_activation, g2.norm_offset) == ("gemma", "gelu_tanh", 1.0)
    assert g2.attn_scale == pytest.approx(24 ** -0.5) and g2.attn_softcap == 1.5
    assert g2.final_softcap == 3.0 and g2.embed_scale == pytest.approx(8.0)
    assert g2.layer_windows == (8, None, 8, None) and g2.rope_local_theta is None
    g3 = jaxinfer.load(str(HF / "gemma3"), dtype="float32").config
    assert g3.qk_norm and g3.attn_softcap is None and g3.final_softcap is None
    assert g3.layer_windows == (6,) * 5 + (None, 6)
    assert (g3.rope_theta, g3.rope_local_theta) == (1e6, 1e4)
    assert (g3.rope_scaling.kind, g3.rope_scaling.factor) == ("linear", 4.0)


def test_logits_match_transformers(fixture):
    _, model, ref = fixture
    logits = np.asarray(model(ref["input_ids"]))
    assert logits.shape == ref["logits"].shape
    assert rel_err(logits, ref["logits"]) <= 1e-4
    np.testing.assert_array_equal(logits.argmax(-1), ref["logits"].argmax(-1))


def test_incremental_decoding_past_the_window(fixture):
    """A short prefill, then one token at a time well past the sliding window: each step's
    logits equal the full forward's."""
    path, model, ref = fixture
    ids = jnp.asarray(ref["input_ids"])  # [B, T]
    b, t = ids.shape
    assert t > 2 * min(w for w in model.config.layer_windows if w)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    forward = jax.jit(gemma.forward, static_argnums=(3, 6))  # plan, fresh
    full = np.asarray(forward(model.params, ids, pos, model.plan)[0])
    cache = KVCache.init(model.config, b, t + 3)
    logits, cache = forward(model.params, ids[:, :3], pos[:, :3], model.plan, cache, None, True)
    steps = [logits]
    for i in range(3, t):
        logits, cache = forward(model.params, ids[:, i:i + 1], pos[:, i:i + 1], model.plan,
                                cache, None, False)
        steps.append(logits)
    inc = np.asarray(jnp.concatenate(steps, axis=1))
    for i in range(t):
        assert rel_err(inc[:, i], full[:, i]) <= 1e-4, f"position {i}"
    np.testing.assert_array_equal(inc.argmax(-1), full.argmax(-1))


def test_greedy_generation_matches_transformers(fixture):
    _, model, ref = fixture
    (out,) = jaxinfer.generate(model, [ref["prompt"].tolist()], max_new_tokens=len(ref["greedy"]),
                               chat=False, stop=None)
    assert out.token_ids[:len(ref["greedy"])] == ref["greedy"].tolist()


def test_kernels_in_interpret_mode_match_the_references():
    """bfloat16 on the Pallas kernels in interpret mode: a prefill takes the soft-capped flash
    attention and the GeGLU kernel (traced, not run: interpret mode is slow), and one decode
    step (the soft-capped decode attention, the small-M matmuls) matches the
    references' step within bfloat16 rounding, from the same cache."""
    from kernel_testing import pallas_kernels_in

    path = HF / "gemma2"
    ids = jnp.asarray(np.load(path / "ref.npz")["input_ids"][:1, :12])
    pos = jnp.arange(12, dtype=jnp.int32)[None]
    ref = jaxinfer.load(str(path), dtype="bfloat16", policy=KernelPolicy.reference())
    pallas = jaxinfer.load(str(path), dtype="bfloat16", policy=KernelPolicy(interpret=True))
    f32 = jaxinfer.load(str(path), dtype="float32")
    names = pallas_kernels_in(lambda p, t: gemma.forward(p, t, pos[:, :11], pallas.plan)[0],
                              pallas.params, ids[:, :11])
    assert names["flash_attention"] == 4 and names["matmul_swiglu_k64_n64"] == 4, names
    cache = KVCache.init(ref.config, 1, 16, dtype="bfloat16")
    # jitted: one program per call (op by op, each op compiles alone); the same computations
    forward = jax.jit(gemma.forward, static_argnames=("plan", "fresh"))
    _, cache = forward(ref.params, ids[:, :11], pos[:, :11], plan=ref.plan, cache=cache,
                       fresh=True)
    steps = {m: np.asarray(forward(model.params, ids[:, 11:], pos[:, 11:], plan=model.plan,
                                   cache=cache)[0]) for m, model in (("ref", ref),
                                                                     ("pallas", pallas))}
    names = pallas_kernels_in(lambda p, c: gemma.forward(p, ids[:, 11:], pos[:, 11:],
                                                         pallas.plan, c)[0], pallas.params, cache)
    # head_dim 16: RoPE halves of 8 are below the append kernel's tiles, so the split-K
    # decode kernel takes the step (test_softcap_kernels.py checks the append's softcap)
    assert names["decode_attention"] == 4 and names["matmul_none_k64_n64"] == 8, names
    want = np.asarray(f32(ids))[:, 11:]
    assert rel_err(steps["pallas"], steps["ref"]) < 2e-2
    assert rel_err(steps["pallas"], want) < 3e-2 and rel_err(steps["ref"], want) < 3e-2


# ----------------------------------------------------------------------- multimodal checkpoint


def test_conditional_generation_text_tower(tmp_path):
    """A Gemma3ForConditionalGeneration directory (transformers 5's names: the language model
    under model.language_model., a vision tower beside it) loads as its text tower."""
    from safetensors.numpy import load_file, save_file

    src = HF / "gemma3"
    tensors = load_file(src / "model.safetensors")
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    renamed["model.vision_tower.vision_model.post_layernorm.weight"] = np.ones(8, np.float32)
    renamed["model.multi_modal_projector.mm_soft_emb_norm.weight"] = np.ones(8, np.float32)
    save_file(renamed, tmp_path / "model.safetensors")
    text = json.loads((src / "config.json").read_text())
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": {k: v for k, v in text.items() if k != "architectures"},
           "vision_config": {"model_type": "siglip_vision_model"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ref = np.load(src / "ref.npz")
    model = jaxinfer.load(str(tmp_path), dtype="float32")
    assert rel_err(np.asarray(model(ref["input_ids"])), ref["logits"]) <= 1e-4


# ----------------------------------------------------------------------------------- bad input


@pytest.fixture
def gemma3_dir(tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(HF / "gemma3", dst)
    return dst


def _edit(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, match", [
    (dict(hidden_activation="silu"), "hidden_activation 'silu'"),
    (dict(layer_types=["full_attention"] * 3), "layer_types must list 7 entries"),
    (dict(layer_types=["local"] * 7), "layer_types must list 7 entries"),
    (dict(sliding_window=None), "sliding_window is None"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(query_pre_attn_scalar=-4), "query_pre_attn_scalar must be a positive number, got -4"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "yarn", "factor": 2.0},
                           "full_attention": {"rope_type": "default"}}),
     "sliding_attention.rope_type 'yarn'"),
])
def test_bad_configs(gemma3_dir, changes, match):
    _edit(gemma3_dir, **changes)
    with pytest.raises(ValueError, match=match):
        jaxinfer.load(str(gemma3_dir))


def test_conditional_generation_without_text_weights(tmp_path):
    from safetensors.numpy import save_file

    save_file({"model.vision_tower.x.weight": np.ones(4, np.float32)},
              tmp_path / "model.safetensors")
    text = json.loads((HF / "gemma3" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": text}))
    with pytest.raises(ValueError, match="without language-model weights"):
        jaxinfer.load(str(tmp_path))


# ----------------------------------------------------------------------------------------- GGUF

GEMMA3_GGUF = GGUF / "tiny-gemma3-q8_0.gguf"


def test_gguf_load_matches_transformers_gguf_load():
    """The tiny Gemma 3 GGUF (Q8_0 weights kept quantized, norms stored as 1 + w) against
    transformers' own GGUF load of the same file."""
    from jaxinfer.weights import QuantizedWeight

    ref = np.load(GGUF / "tiny_gemma3.npz")
    model = jaxinfer.load(str(GEMMA3_GGUF), dtype="float32")
    config = model.config
    assert (config.family, config.architecture, config.qk_norm) == ("gemma", "Gemma3ForCausalLM",
                                                                    True)
    assert config.layer_windows == (5,) * 5 + (None,)
    assert (config.rope_theta, config.rope_local_theta, config.attn_scale) == (1e6, 1e4, 1 / 16)
    assert isinstance(model.params["layers"][0]["w_gate"], QuantizedWeight)
    logits = np.asarray(model(ref["tokens"]))
    assert rel_err(logits, ref["logits"]) <= 1e-4
    np.testing.assert_array_equal(logits.argmax(-1), ref["logits"].argmax(-1))


def test_gguf_norms_lose_the_stored_one_exactly_once():
    import gguf as gguf_lib

    reader = gguf_lib.GGUFReader(str(GEMMA3_GGUF))
    stored = {t.name: np.asarray(t.data, np.float32) for t in reader.tensors
              if t.name.endswith("norm.weight")}
    model = jaxinfer.load(str(GEMMA3_GGUF), dtype="float32")
    lp = model.params["layers"][2]
    for ours, name in (("attn_norm", "attn_norm"), ("post_attn_norm", "post_attention_norm"),
                       ("mlp_norm", "ffn_norm"), ("post_mlp_norm", "post_ffw_norm"),
                       ("q_norm", "attn_q_norm")):
        np.testing.assert_array_equal(np.asarray(lp[ours]), stored[f"blk.2.{name}.weight"] - 1)
    np.testing.assert_array_equal(np.asarray(model.params["final_norm"]),
                                  stored["output_norm.weight"] - 1)


def test_gguf_gemma_tokenizer_and_chat_template_match_transformers():
    ref = json.loads((GGUF / "tiny_gemma3_tokenizer.json").read_text())
    model = jaxinfer.load(str(GEMMA3_GGUF), dtype="float32")
    tok = model.tokenizer
    for text, ids, decoded in zip(ref["texts"], ref["ids"], ref["decoded"]):
        assert tok.encode(text) == ids
        assert tok.decode(ids) == decoded
    assert tok.apply_chat_template([{"role": "user", "content": "the cat"}],
                                   add_generation_prompt=True) == ref["chat_ids"]
    (out,) = jaxinfer.generate(model, ["the cat"], max_new_tokens=3)  # through the template
    assert len(out.token_ids) == 3


# ---------------------------------------------------------------------------------------- bench


@pytest.mark.parametrize("preset", ["gemma3-1b", "gemma3-27b"])
def test_bench_presets_run_on_cpu_shrunken(preset, monkeypatch, capsys):
    """`jaxinfer bench --preset gemma3-* --random-weights` end to end on the CPU, at the
    preset's attention shapes with fewer layers, a narrower model and a small vocabulary (the
    H200 runs the real ones: benchmarks/run_h200.sh); layers 4 and 5: a sliding and a full one."""
    from jaxinfer import bench, cli
    from jaxinfer.configs import PRESETS

    full = PRESETS[preset]
    small = full.replace(num_layers=2, layer_windows=full.layer_windows[4:6], hidden_size=128,
                         intermediate_size=256, vocab_size=512, embed_scale=128 ** 0.5)
    monkeypatch.setattr(bench, "PRESETS", {**PRESETS, preset: small})
    assert cli.main(["bench", "--preset", preset, "--random-weights", "--prompt-len", "16",
                     "--gen-len", "4", "--repeats", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()
            if line.startswith("{")]
    assert len(rows) == 1 and rows[0]["decode_tokens_per_s"] > 0
