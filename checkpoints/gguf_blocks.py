"""GGUF quantized blocks -> `QuantizedWeight`, repacked on load instead of dequantized.

`repack(blocks, type_name, k, n)` takes a GGUF tensor's raw bytes (N rows of K elements each,
whole blocks; rows are output features) and returns a QuantizedWeight [K, N] in our [in, out]
layout: GGUF row j becomes column j. Scales and mins are kept as the file stores them (fp16 d,
dmin, m; the K-quants' 6-bit / int8 sub-scales as integers), so `dequantize` of the result
computes exactly gguf.quants' float32 products and equals `gguf.quants.dequantize(...).T`
bit for bit:

    type  bits    code_offset  scale [G, N]    offset [G, N]  super [K/256, N]  group  tile
    Q8_0  (8,)        0        fp16 d          -              -                 32     32
    Q4_0  (4,)        8        fp16 d          -              -                 32     32
    Q4_1  (4,)        0        fp16 d          fp16 m         -                 32     32
    Q5_0  (4, 1)     16        fp16 d          -              -                 32     32
    Q5_1  (4, 1)      0        fp16 d          fp16 m         -                 32     32
    Q4_K  (4,)        0        uint8 6-bit sc  uint8 6-bit m  fp16 d, dmin      32     32
    Q5_K  (4, 1)      0        uint8 6-bit sc  uint8 6-bit m  fp16 d, dmin      32     32
    Q6_K  (4, 2)     32        int8 sc         -              fp16 d            16     16

(Q8_0's one plane is the int8 codes [K, N]; the others are `pack_plane` bit planes, low bits
first.)

Byte layouts are ggml's block_* structs (as gguf/quants.py reads them). The K-quants' 4-bit
codes (and Q5_K's fifth bits) already sit in the file in our plane order (a 32-byte run holds
sub-blocks 2j and 2j + 1 in its low and high nibbles), so those planes are the file's bytes,
transposed; the other types are unpacked to codes and packed again.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.weights import QuantizedWeight

# (elements, bytes) per block: ggml's block_q8_0 ... block_q6_K.
BLOCK_SIZES = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22),
               "Q5_1": (32, 24), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
BLOCK_TYPES = tuple(BLOCK_SIZES)

_SLAB = 64  # rows per transposed copy (see _cols)


def _cols(a: np.ndarray) -> np.ndarray:
    """[N, R] in GGUF row order -> [R, N], our column layout (an owned, C-ordered copy), copied
    _SLAB GGUF rows at a time: one whole-array transpose strides through memory, about 2x
    slower on a 4096 x 14336 weight."""
    n, r = a.shape
    out = np.empty((r, n), a.dtype)
    for j in range(0, n, _SLAB):
        out[:, j:j + _SLAB] = a[j:j + _SLAB].T
    return out


def _f16(b: np.ndarray) -> np.ndarray:
    """An fp16 block field b [N, nb, 2] (bytes) -> [nb, N] float16."""
    return _cols(np.ascontiguousarray(b).view(np.float16)[..., 0])


def _plane(codes: np.ndarray, bits: int, tile: int) -> np.ndarray:
    """codes [N, K] uint8 -> pack_plane(codes.T, bits, tile), packed along the rows before one
    transpose (packing the transposed codes would stride through memory)."""
    n, k = codes.shape
    r = 8 // bits
    units = -(-k // (r * tile))
    pad = units * r * tile - k
    c = (np.pad(codes, ((0, 0), (0, pad))) if pad else codes).reshape(n, units, r, tile)
    out = c[:, :, 0].copy()
    for j in range(1, r):
        out |= c[:, :, j] << np.uint8(bits * j)
    return _cols(out.reshape(n, units * tile))


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """32-block quants qs [N, nb, 16] (byte j: element j low, j + 16 high) -> codes [N, nb, 32]."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 packed bytes [N, nb, 12] -> 6-bit (sc, m), each [N, nb, 8] uint8:
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7, sub-blocks 4-7 in the nibbles of bytes
    8-11 with their top 2 bits in the top bits of bytes 0-3 / 4-7."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & np.uint8(0x3F), (md & np.uint8(0x0F)) | ((d >> 2) & np.uint8(0x30))],
                        axis=-1)
    mn = np.concatenate([m & np.uint8(0x3F), (md >> 4) | ((m >> 2) & np.uint8(0x30))], axis=-1)
    return sc, mn


def repack(blocks: np.ndarray, type_name: str, k: int, n: int) -> QuantizedWeight:
    """GGUF blocks of a tensor of n rows of k elements -> QuantizedWeight [k, n] (numpy arrays,
    out_shape (n,)) whose dequantized values are gguf.quants.dequantize(blocks).T exactly."""
    if type_name not in BLOCK_SIZES:
        raise ValueError(f"type {type_name} cannot be kept quantized (types that can: "
                         f"{', '.join(BLOCK_TYPES)})")
    block, size = BLOCK_SIZES[type_name]
    if k < 1 or n < 1 or k % block:
        raise ValueError(f"{type_name} shape [{n}, {k}] is not rows of whole {block}-element "
                         "blocks")
    raw = np.ascontiguousarray(blocks).view(np.uint8)
    nb = k // block
    if raw.size != n * nb * size:
        raise ValueError(f"{type_name} shape [{n}, {k}] needs {n * nb * size} bytes "
                         f"({n} rows of {nb} {size}-byte blocks), got {raw.size}")
    b = raw.reshape(n, nb, size)
    common = {"k": k, "out_shape": (n,), "name": type_name.lower()}
    if type_name == "Q8_0":
        codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k)
        return QuantizedWeight((_cols(codes),), _f16(b[..., 0:2]), bits=(8,), group=32,
                               tile=32, **common)
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        offset = _f16(b[..., 2:4]) if type_name.endswith("_1") else None
        qs = b[..., size - 16:]  # the last 16 bytes; Q5's qh (4 bytes) just before them
        planes = (_plane(_nibbles32(qs).reshape(n, k), 4, 32),)
        if type_name.startswith("Q5"):
            qh = b[..., size - 20:size - 16]  # bit i (little-endian uint32) = bit 4 of element i
            planes += (_plane(np.unpackbits(qh, axis=-1, bitorder="little").reshape(n, k),
                              1, 32),)
        code_offset = 0 if offset is not None else 8 if type_name == "Q4_0" else 16
        return QuantizedWeight(planes, _f16(b[..., 0:2]), offset, bits=(4, 1)[:len(planes)],
                               group=32, tile=32, code_offset=code_offset, **common)
    if type_name in ("Q4_K", "Q5_K"):
        # d, dmin, 12 scale bytes, [Q5_K: qh 32], qs 128: qs's 32-byte run j holds sub-blocks
        # 2j / 2j + 1 in its low / high nibbles, which is our 4-bit plane at tile 32; bit s of
        # qh byte i is bit 4 of sub-block s's element i, our 1-bit plane.
        sc, mn = _k_scale_min(b[..., 4:16])
        planes = (_cols(b[..., size - 128:].reshape(n, k // 2)),)
        if type_name == "Q5_K":
            planes += (_cols(b[..., 16:48].reshape(n, k // 8)),)
        return QuantizedWeight(planes, _cols(sc.reshape(n, k // 32)), _cols(mn.reshape(n, k // 32)),
                               _f16(b[..., 0:2]), _f16(b[..., 2:4]), bits=(4, 1)[:len(planes)],
                               group=32, super_group=256, tile=32, **common)
    # Q6_K: ql 128, qh 64, int8 scales 16, d. Element 32 s + j of 128-element half h has its low
    # 4 bits in nibble s // 2 of ql[64 h + 32 (s % 2) + j], its high 2 in bits 2 s, 2 s + 1 of
    # qh[32 h + j].
    ql = (b[..., :128].reshape(n, nb, 2, 1, 64) >> np.array([[0], [4]], np.uint8)) & np.uint8(0x0F)
    qh = (b[..., 128:192].reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)
          .reshape(4, 1)) & np.uint8(0x03)
    scale = np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(n, k // 16)
    return QuantizedWeight((_plane(ql.reshape(n, k), 4, 16), _plane(qh.reshape(n, k), 2, 16)),
                           _cols(scale), super_scale=_f16(b[..., 208:210]), bits=(4, 2),
                           group=16, super_group=256, tile=16, code_offset=32, **common)
