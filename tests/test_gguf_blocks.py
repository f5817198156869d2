"""GGUF blocks kept quantized: `checkpoints.gguf_blocks.repack` of random valid blocks of every
type against gguf.quants' dequantization bit for bit, and tiny llama files loaded with
keep_quantized=True against the same files dequantized on load."""

from __future__ import annotations

import logging
import pathlib

import gguf
import jax
import numpy as np
import pytest

from checkpoints import gguf as G
from checkpoints import gguf_blocks
from test_gguf import llama_writer
from pallas_kernels import quantized as Q
from jaxinfer.weights import Parts, as_array
from pallas_kernels.quantized import QuantizedWeight, dequantize

QT = gguf.GGMLQuantizationType
TINY_F32 = pathlib.Path(__file__).parent / "fixtures" / "data" / "gguf" / "tiny-f32.gguf"
TYPES = gguf_blocks.BLOCK_TYPES
# Byte offsets of each block's fp16 fields (d, and m / dmin) in ggml's block_* structs; every
# other byte is codes or packed sub-block scales, any value of which is valid.
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,),
               "IQ4_NL": (0,)}


def random_blocks(type_name: str, rows: int, cols: int, rng) -> np.ndarray:
    """uint8 [rows, row bytes]: random codes and sub-scales, small fp16 scales of both signs
    (one in 16 exactly zero)."""
    block, size = gguf.GGML_QUANT_SIZES[QT[type_name]]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for off in FP16_FIELDS[type_name]:
        v = rng.standard_normal(raw.shape[0]) * 0.01 * (rng.integers(0, 16, raw.shape[0]) > 0)
        raw[:, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def assert_bits_equal(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.dtype == ref.dtype == np.float32 and ours.shape == ref.shape
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


# ---------------------------------------------------------------------------------------------
# repack
# ---------------------------------------------------------------------------------------------


def test_block_sizes_are_ggmls():
    assert gguf_blocks.BLOCK_SIZES == {t: gguf.GGML_QUANT_SIZES[QT[t]] for t in TYPES}


@pytest.mark.parametrize("type_name, k", [(t, k) for t in TYPES for k in (96, 256, 512)
                                           if k % gguf_blocks.BLOCK_SIZES[t][0] == 0])
def test_repack_dequantizes_as_gguf_quants(type_name, k):
    rng = np.random.default_rng(k)
    for n in (37, 1):
        raw = random_blocks(type_name, n, k, rng)
        qw = gguf_blocks.repack(raw, type_name, k, n)
        assert qw.shape == (k, n) and qw.out_shape == (n,)
        assert all(isinstance(a, np.ndarray) and a.flags.c_contiguous and a.flags.writeable
                   for a in (*qw.planes, qw.scale))
        assert_bits_equal(dequantize(qw), gguf.quants.dequantize(raw, QT[type_name]).T)


# type: (bits, code_offset, group, super_group, tile, scale, offset, super_scale, super_offset)
FORMATS = {
    "Q8_0": ((8,), 0, 32, 0, 32, np.float16, None, None, None),
    "Q4_0": ((4,), 8, 32, 0, 32, np.float16, None, None, None),
    "Q4_1": ((4,), 0, 32, 0, 32, np.float16, np.float16, None, None),
    "Q5_0": ((4, 1), 16, 32, 0, 32, np.float16, None, None, None),
    "Q5_1": ((4, 1), 0, 32, 0, 32, np.float16, np.float16, None, None),
    "Q4_K": ((4,), 0, 32, 256, 32, np.uint8, np.uint8, np.float16, np.float16),
    "Q5_K": ((4, 1), 0, 32, 256, 32, np.uint8, np.uint8, np.float16, np.float16),
    "Q6_K": ((4, 2), 32, 16, 256, 16, np.int8, None, np.float16, None),
}


@pytest.mark.parametrize("type_name", TYPES)
def test_repack_formats(type_name):
    """The static layout of each type, component shapes and dtypes, and zero codes past K."""
    bits, code_offset, group, super_group, tile, *dtypes = FORMATS[type_name]
    k, n = (96 if gguf_blocks.BLOCK_SIZES[type_name][0] == 32 else 512), 19
    qw = gguf_blocks.repack(random_blocks(type_name, n, k, np.random.default_rng(0)),
                            type_name, k, n)
    assert (qw.bits, qw.code_offset, qw.group, qw.super_group, qw.tile, qw.name) == \
        (bits, code_offset, group, super_group, tile, type_name.lower())
    parts = (qw.scale, qw.offset, qw.super_scale, qw.super_offset)
    for a, dtype, rows in zip(parts, dtypes, (k // group, k // group, k // 256, k // 256)):
        assert (a is None) if dtype is None else (a.dtype == dtype and a.shape == (rows, n))
    if bits == (8,):
        assert qw.planes[0].dtype == np.int8 and qw.planes[0].shape == (k, n)
        return
    for plane, b in zip(qw.planes, bits):
        assert plane.dtype == np.uint8 and plane.shape == (Q.plane_rows(k, tile, b), n)
        np.testing.assert_array_equal(Q.pack_plane(Q.unpack_plane(plane, b, tile, k), b, tile),
                                      plane)


def test_repack_refuses_bad_input():
    raw = random_blocks("Q4_K", 3, 256, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"type Q2_K cannot be kept quantized \(types that "
                                         r"can: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K"):
        gguf_blocks.repack(raw, "Q2_K", 256, 3)
    with pytest.raises(ValueError, match=r"Q4_K shape \[3, 256\] needs 432 bytes .* got 431"):
        gguf_blocks.repack(raw.reshape(-1)[:-1], "Q4_K", 256, 3)
    with pytest.raises(ValueError, match=r"Q4_K shape \[6, 128\] is not rows of whole "
                                         r"256-element blocks"):
        gguf_blocks.repack(raw, "Q4_K", 128, 6)
    short = type("T", (), {"data": raw[:2], "tensor_type": QT.Q4_K, "name": "blk.0.ffn_up.weight",
                           "shape": np.array([256, 3], np.uint64)})
    with pytest.raises(ValueError, match=r"x\.gguf: tensor 'blk\.0\.ffn_up\.weight' \(Q4_K, "
                                         r"shape \[3, 256\]\): Q4_K shape \[3, 256\] needs 432"):
        G._repack(short, "x.gguf")


# ---------------------------------------------------------------------------------------------
# Tiny llama files: hidden 256 (whole K-quant super-blocks), 4 heads (2 KV) of 64, q/k/v biases
# ---------------------------------------------------------------------------------------------

DIMS = {"hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "inter": 512, "layers": 2}


def tiny_llama(dst: pathlib.Path, type_of, seed: int = 0) -> pathlib.Path:
    """A llama GGUF whose matmul weights and token_embd are random blocks of type_of(name)
    (F32 norms and biases), with the tokenizer of the tiny fixtures (vocab 320)."""
    rng = np.random.default_rng(seed)
    d = DIMS
    hidden, q, kv = d["hidden"], d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    reader = gguf.GGUFReader(TINY_F32)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    w = llama_writer(dst, d)
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), vtype, sub_type=sub)
    shapes = {"token_embd.weight": (vocab, hidden)}
    for i in range(d["layers"]):
        p = f"blk.{i}."
        shapes.update({p + "attn_norm.weight": (hidden,), p + "attn_q.weight": (q, hidden),
                       p + "attn_k.weight": (kv, hidden), p + "attn_v.weight": (kv, hidden),
                       p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,),
                       p + "attn_output.weight": (hidden, q), p + "ffn_norm.weight": (hidden,),
                       p + "ffn_gate.weight": (d["inter"], hidden),
                       p + "ffn_up.weight": (d["inter"], hidden),
                       p + "ffn_down.weight": (hidden, d["inter"])})
    shapes.update({"output_norm.weight": (hidden,), "output.weight": (vocab, hidden)})
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:
            kind = type_of(name)
            w.add_tensor(name, random_blocks(kind, *shape, rng), raw_dtype=QT[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def mixed(name: str) -> str:
    """Q4_K_M's shape of mix: attn_v in Q6_K beside Q4_K q / k (their fusion falls back)."""
    return "Q6_K" if name.endswith("attn_v.weight") else "Q4_K"


def nbytes(params) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(params))


def assert_dequantizes_to(quantized: dict, plain: dict) -> None:
    """quantized's params (QuantizedWeights or float32) dequantize to plain's bit for bit; the
    embedding is a QuantizedWeight [D, V] (the LM head's orientation) of the table [V, D]."""
    assert quantized.keys() == plain.keys()
    for name, a in quantized.items():
        if name == "layers":
            assert len(a) == len(plain[name])
            for lq, lp in zip(a, plain[name]):
                assert_dequantizes_to(lq, lp)
        elif isinstance(a, QuantizedWeight | Parts):
            assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(a))
            w = as_array(a, np.float32)
            assert_bits_equal(w.T if name == "embed" else w, plain[name])
        else:
            assert_bits_equal(a, plain[name])


@pytest.mark.parametrize("type_of", [*(lambda name, t=t: t for t in TYPES), mixed],
                         ids=[*TYPES, "Q4_K+Q6_K_attn_v"])
def test_kept_quantized_load_dequantizes_as_the_float_load(tmp_path, type_of):
    path = tiny_llama(tmp_path / "tiny.gguf", type_of)
    config, params, tokenizer = G.load_gguf(path, keep_quantized=True)
    ref_config, ref_params, _ = G.load_gguf(path, keep_quantized=False)
    assert config == ref_config and config.qkv_bias and tokenizer.vocab_size == 320
    assert_dequantizes_to(params, ref_params)

    d, hkv, hd = DIMS["hidden"], DIMS["kv_heads"], DIMS["head_dim"]
    g = DIMS["heads"] // hkv
    embed, head = params["embed"], params["lm_head"]
    assert embed.shape == head.shape == (d, config.vocab_size) and embed.out_shape == (320,)
    mixed = type_of("attn_v.weight") != type_of("attn_q.weight")
    for lp in params["layers"]:
        for name in ("wo", "w_gate", "w_up", "w_down"):
            assert isinstance(lp[name], QuantizedWeight) and lp[name].out_shape == \
                ref_params["layers"][0][name].shape[1:]
        assert lp["bqkv"].dtype == np.float32 and lp["attn_norm"].dtype == np.float32
        assert lp["wqkv"].out_shape == (hkv, g + 2, hd)
        if mixed:  # q, k and v each in their own layout
            assert isinstance(lp["wqkv"], Parts)
            assert [p.name for p in lp["wqkv"].parts] == ["q4_k", "q4_k", "q6_k"]
        else:
            assert lp["wqkv"].name == type_of("").lower()
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    assert nbytes(params) <= 1.1 * file_bytes


def test_q2_k_q3_k_are_dequantized_with_one_warning(tmp_path, caplog):
    kinds = {"ffn_down.weight": "Q2_K", "attn_output.weight": "Q3_K"}
    path = tiny_llama(tmp_path / "k23.gguf",
                      lambda name: kinds.get(name.split(".", 2)[-1], "Q4_K"))
    with caplog.at_level(logging.WARNING, logger="checkpoints.gguf"):
        _, params, _ = G.load_gguf(path)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Q2_K, Q3_K weights are dequantized to float32" in \
        warnings[0].getMessage()
    _, ref_params, _ = G.load_gguf(path, keep_quantized=False)
    assert_dequantizes_to(params, ref_params)
    for lp in params["layers"]:
        assert isinstance(lp["w_down"], np.ndarray) and isinstance(lp["wo"], np.ndarray)
        assert isinstance(lp["w_up"], QuantizedWeight)


def test_bad_tensors_are_refused_by_name(tmp_path):
    path = tiny_llama(tmp_path / "ok.gguf", lambda name: "Q4_K")
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_gate.weight")
    start = int(tensor.data_offset)  # in the file; the first block's d comes first
    data = bytearray(path.read_bytes())

    bad = tmp_path / "inf.gguf"  # an infinite fp16 d in one block: refused, not kept
    data[start:start + 2] = np.array([np.inf], np.float16).tobytes()
    bad.write_bytes(data)
    with pytest.raises(ValueError, match=r"inf\.gguf: tensor 'blk\.1\.ffn_gate\.weight' \(Q4_K\) "
                                         r"contains non-finite values"):
        G.load_gguf(bad, keep_quantized=True)

    cut = tmp_path / "cut.gguf"  # the file ends inside output.weight's data
    cut.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=r"cut\.gguf: truncated.*tensor 'output\.weight' "
                                         r"\(Q4_K\)"):
        G.load_gguf(cut, keep_quantized=True)

    iq = tiny_llama(tmp_path / "iq.gguf",
                    lambda name: "IQ4_NL" if name == "blk.0.attn_k.weight" else "Q4_K")
    with pytest.raises(ValueError, match=r"iq\.gguf: tensor 'blk\.0\.attn_k\.weight' has type "
                                         r"IQ4_NL, which is not supported"):
        G.load_gguf(iq, keep_quantized=True)
