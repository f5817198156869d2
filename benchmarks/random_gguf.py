"""Write a GGUF file of a real model's shapes with random weights in llama.cpp's block types.

    PYTHONPATH=. python3 benchmarks/random_gguf.py OUT.gguf [--shapes llama3-8b|qwen2.5-1.5b|tiny]
        [--types q4_k_m|q4_k|q6_k|q8_0|q4_0|q5_k|...] [--layers L]

What `jaxinfer bench --model OUT.gguf` and `jaxinfer generate` then load exactly as a downloaded
file (the loader, the repack, the GPU layouts, the CPU's per-layer dequantization): random
blocks whose fp16 scales are set so each weight's values have a std of 1 / sqrt(fan-in).
`q4_k_m` is llama.cpp's Q4_K_M choice (Q4_K, with Q6_K for attn_v and ffn_down in the first
and last eighth of the layers and every third between, and for the output / tied embedding);
another name puts every matmul weight and the embedding in that one type. The tokenizer is
byte-level (256 byte tokens, padded to the vocabulary with unused ones): the bench draws random
token ids, and text through it is one token per byte.
"""

from __future__ import annotations

import argparse
import sys

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

# arch, hidden, intermediate, heads, kv heads, head dim, vocab, layers, rope base, tied, biases
SHAPES = {
    "llama3-8b": ("llama", 4096, 14336, 32, 8, 128, 128256, 32, 500000.0, False, False),
    "qwen2.5-1.5b": ("qwen2", 1536, 8960, 12, 2, 128, 151936, 28, 1e6, True, True),
    "tiny": ("llama", 256, 512, 4, 2, 64, 512, 2, 10000.0, False, False),  # for tests
}
# Byte offsets of each block's fp16 fields (d, and dmin / m) in ggml's block structs.
FP16_AT = {QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2),
           QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}


def blocks(rng, qtype, rows: int, cols: int) -> np.ndarray:
    """[rows, cols] of random blocks of qtype ([rows, bytes] uint8), values of std ~ cols^-1/2."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)

    def put(value):
        for off in FP16_AT[qtype]:
            raw[:, off:off + 2] = np.full(raw.shape[0], value, np.float16).view(
                np.uint8).reshape(-1, 2)
    put(1.0)  # then scale d / dmin so the values' std is the fan-in's
    put(cols ** -0.5 / gguf.quants.dequantize(raw[:4096], qtype).std())
    return raw.reshape(rows, -1)


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M gives Q6_K attn_v and ffn_down."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    ap.add_argument("--types", default="q4_k_m")
    ap.add_argument("--layers", type=int, default=None, help="the first L layers only")
    args = ap.parse_args(argv)
    arch, hid, inter, heads, kv, hd, vocab, layers, rope, tied, biases = SHAPES[args.shapes]
    layers = args.layers or layers
    mix = args.types.lower() == "q4_k_m"
    one = QT.Q4_K if mix else QT[args.types.upper()]
    rng = np.random.default_rng(0)

    w = gguf.GGUFWriter(args.out, arch)
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(hid)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(rope)
    w.add_layer_norm_rms_eps(1e-5)
    # GPT-2's byte-to-unicode map: the byte-level tokens; one merge (the format needs some).
    chars = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)] + \
        [chr(c) for c in range(174, 256)]
    chars += [chr(256 + i) for i in range(256 - len(chars))]
    tokens = chars + ["\u0120t"] + [f"<|unused_{i}|>" for i in range(vocab - len(chars) - 1)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(chars) + 1) + [5] * (vocab - len(chars) - 1))
    w.add_token_merges(["\u0120 t"])
    w.add_bos_token_id(len(chars) + 2)
    w.add_eos_token_id(len(chars) + 3)

    def quantized(name, qtype, rows, cols):
        w.add_tensor(name, blocks(rng, qtype, rows, cols), raw_dtype=qtype)

    quantized("token_embd.weight", QT.Q6_K if mix and tied else one, vocab, hid)
    for i in range(layers):
        p = f"blk.{i}."
        big = QT.Q6_K if mix and more_bits(i, layers) else one
        w.add_tensor(p + "attn_norm.weight", np.ones(hid, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hid, np.float32))
        for n, rows, qt in (("attn_q", heads * hd, one), ("attn_k", kv * hd, one),
                            ("attn_v", kv * hd, big)):
            quantized(p + n + ".weight", qt, rows, hid)
            if biases:
                w.add_tensor(p + n + ".bias", (0.02 * rng.standard_normal(rows)).astype(
                    np.float32))
        quantized(p + "attn_output.weight", one, hid, heads * hd)
        quantized(p + "ffn_gate.weight", one, inter, hid)
        quantized(p + "ffn_up.weight", one, inter, hid)
        quantized(p + "ffn_down.weight", big, hid, inter)
    w.add_tensor("output_norm.weight", np.ones(hid, np.float32))
    if not tied:
        quantized("output.weight", QT.Q6_K if mix else one, vocab, hid)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
