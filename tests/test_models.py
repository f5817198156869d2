"""The Llama-family forward against HF transformers' golden logits (tests/fixtures/data/hf)."""

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest

import jaxinfer

HF = pathlib.Path(__file__).parent / "fixtures" / "data" / "hf"
VARIANTS = sorted(p for p in HF.iterdir() if (p / "ref.npz").exists()) if HF.exists() else []


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_every_family_has_a_fixture():
    names = {p.name for p in VARIANTS}
    for required in ("llama_mha_untied", "llama_gqa_tied_llama3", "llama_linear", "llama_dynamic",
                     "llama_yarn", "mistral_sliding", "qwen2", "qwen3", "llama_sharded"):
        assert required in names, f"missing fixture {required}; run tests/fixtures/make_fixtures.py"


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda p: p.name)
def test_logits_match_transformers(variant):
    ref = np.load(variant / "ref.npz")
    model = jaxinfer.load(str(variant), dtype="float32")
    logits = np.asarray(model(ref["input_ids"]))
    assert logits.shape == ref["logits"].shape
    assert rel_err(logits, ref["logits"]) <= 1e-4
    np.testing.assert_array_equal(logits.argmax(-1), ref["logits"].argmax(-1))


def test_bfloat16_forward_is_close():
    variant = HF / "llama_gqa_tied_llama3"
    ref = np.load(variant / "ref.npz")
    model = jaxinfer.load(str(variant), dtype="bfloat16")
    logits = np.asarray(model(ref["input_ids"]))
    assert logits.dtype == np.float32  # logits stay float32 whatever the params dtype
    assert rel_err(logits, ref["logits"]) < 3e-2
    assert (logits.argmax(-1) == ref["logits"].argmax(-1)).mean() > 0.9


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def llama_dir(tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(HF / "llama_mha_untied", dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def test_unknown_architecture(llama_dir):
    _edit_config(llama_dir, architectures=["GPTBigCodeForCausalLM"])
    with pytest.raises(ValueError, match="unsupported architecture.*GPTBigCode.*supported"):
        jaxinfer.load(str(llama_dir))


def test_config_missing_field(llama_dir):
    _edit_config(llama_dir, hidden_size=None)
    with pytest.raises(ValueError, match="config.json has no 'hidden_size'"):
        jaxinfer.load(str(llama_dir))


def test_tensor_with_wrong_shape(llama_dir):
    _edit_config(llama_dir, intermediate_size=96)
    with pytest.raises(ValueError, match=r"w_gate.*shape .* expected \(64, 96\)"):
        jaxinfer.load(str(llama_dir))


def test_truncated_safetensors(llama_dir):
    (f,) = llama_dir.glob("*.safetensors")
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        jaxinfer.load(str(llama_dir))


def test_missing_weights(llama_dir):
    for f in llama_dir.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        jaxinfer.load(str(llama_dir))


def test_missing_shard(tmp_path):
    dst = tmp_path / "sharded"
    shutil.copytree(HF / "llama_sharded", dst)
    shard = sorted(dst.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        jaxinfer.load(str(dst))


def test_extra_layers_in_weights(llama_dir):
    _edit_config(llama_dir, num_hidden_layers=1)
    with pytest.raises(ValueError, match="model.layers.1"):
        jaxinfer.load(str(llama_dir))


def test_token_ids_outside_vocab(llama_dir):
    model = jaxinfer.load(str(llama_dir))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(np.array([[1, 2, model.config.vocab_size]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(np.array([[-1, 2]]))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        model(np.array([1, 2, 3]))


def test_bad_dtype(llama_dir):
    with pytest.raises(ValueError, match="dtype must be one of"):
        jaxinfer.load(str(llama_dir), dtype="int8")


def test_from_params_casts_only_floating_leaves():
    """Integer leaves (quantized codes, to come) keep their dtype; floating ones take the
    model's; matmul weights come back as their declared type."""
    import jax.numpy as jnp

    from jaxinfer.model import from_params
    from jaxinfer.weights import Dense, cast_floating

    tree = {"codes": np.arange(6, dtype=np.int8), "scale": np.ones(3, np.float32),
            "w": Dense(np.ones((2, 2), np.float32))}
    cast = cast_floating(tree, "bfloat16")
    assert cast["codes"].dtype == jnp.int8 and cast["scale"].dtype == jnp.bfloat16
    assert isinstance(cast["w"], Dense) and cast["w"].w.dtype == jnp.bfloat16
    model = jaxinfer.load(str(HF / "llama_mha_untied"), dtype="float32")
    plain = jax.tree.map(lambda x: np.asarray(x.w if isinstance(x, Dense) else x),
                         model.params, is_leaf=lambda x: isinstance(x, Dense))  # as loaders give
    again = from_params(model.config, plain, dtype="bfloat16")
    assert isinstance(again.params["layers"][0]["wqkv"], Dense)
    assert again.params["layers"][0]["wqkv"].w.dtype == jnp.bfloat16
