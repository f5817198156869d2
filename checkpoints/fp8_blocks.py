"""HF checkpoints with block-scaled fp8 weights (`quantization_config` {quant_method: "fp8",
weight_block_size: [b, b]}: DeepSeek-V3's release, and others in the same format).

Each quantized `X.weight` [out, in] is float8_e4m3fn beside `X.weight_scale_inv`
[ceil(out / b), ceil(in / b)] float32: the true weight is w * scale_inv per b x b block. They
come out of `Fp8BlockTensors` as `Fp8Weight`s whose transpose is a `QuantizedWeight` kept in
fp8 (`from_fp8_blocks`, one scale per b rows of K and column). Routed experts stay fp8 too:
the loader (checkpoints/hf.py `_read_experts`) stacks each weight's per-expert QuantizedWeights
(host numpy, `Fp8Weight.host_T`) into one whose arrays are [E, ...], which the MoE kernels read
as they are. safetensors' numpy / flax readers do not know fp8, so fp8 tensors are read from
the file itself (the format is an 8-byte header length, a JSON header, raw data).
Blocks at the edges may be partial (V3's kv_a_proj_with_mqa has 576 = 4.5 x 128 rows): the
last scale row / column covers what is left.
"""

from __future__ import annotations

import json
import pathlib
import struct
from collections.abc import Mapping

import numpy as np

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = ("F8_E4M3",)


def block_size(cfg: dict, path) -> int | None:
    """The fp8 block size of a config.json's quantization_config, None without one; other
    quantization methods or block shapes raise ValueError naming the field."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(f"{path}: quantization_config.quant_method={method!r} is not "
                         f"supported (block-scaled 'fp8' is)")
    blocks = q.get("weight_block_size")
    if (not isinstance(blocks, list | tuple) or len(blocks) != 2 or blocks[0] != blocks[1]
            or not isinstance(blocks[0], int) or blocks[0] < 1):
        raise ValueError(f"{path}: quantization_config.weight_block_size={blocks!r}: square "
                         f"blocks [b, b] only (per-tensor fp8 scales are not supported)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{path}: quantization_config.fmt={fmt!r}: e4m3 only")
    return int(blocks[0])


def _header(f: pathlib.Path) -> tuple[dict, int]:
    with open(f, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n)), 8 + n


class Fp8BlockTensors(Mapping):
    """The tensors of safetensors files by name (each read when asked for), with block-scaled
    fp8 weights as QuantizedWeights [in, out] behind `.T` (the loaders transpose torch's
    [out, in]; routed experts' included). The scale tensors are consumed here and not
    listed."""

    def __init__(self, files: list[pathlib.Path], block: int):
        from safetensors import safe_open

        self.block = block
        self._open, self._where, self._raw = {}, {}, {}
        for f in files:
            try:
                header, base = _header(f)
                st = safe_open(f, framework="flax")
            except Exception as e:
                raise ValueError(f"{f}: cannot read safetensors weights ({e}); the file is "
                                 "truncated or corrupt, download it again") from e
            self._open[f] = st
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                self._where[name] = f
                if info["dtype"] in FP8_DTYPES:
                    begin, end = info["data_offsets"]
                    self._raw[name] = (base + begin, end - begin, tuple(info["shape"]))

    def _read(self, name: str):
        f = self._where[name]
        try:
            if name in self._raw:
                import ml_dtypes

                offset, count, shape = self._raw[name]
                data = np.fromfile(f, dtype=np.uint8, count=count, offset=offset)
                return data.view(ml_dtypes.float8_e4m3fn).reshape(shape)
            return self._open[f].get_tensor(name)
        except Exception as e:
            raise ValueError(f"{f}: cannot read tensor {name!r} ({e}); the file is truncated "
                             "or corrupt, download it again") from e

    def __getitem__(self, name: str):
        w = self._read(name)
        if name + SCALE_SUFFIX not in self._where:
            if name in self._raw:
                raise ValueError(f"{self._where[name]}: {name} is fp8 without a "
                                 f"{name + SCALE_SUFFIX}")
            return w
        scale = np.asarray(self._read(name + SCALE_SUFFIX), np.float32)
        out, k = w.shape
        b = self.block
        want = (-(-out // b), -(-k // b))
        if scale.shape != want:
            raise ValueError(f"{self._where[name]}: {name + SCALE_SUFFIX} has shape "
                             f"{scale.shape}, expected {want} for {name} {w.shape} in "
                             f"{b} x {b} blocks")
        return Fp8Weight(w, scale, b)

    def __iter__(self):
        return (n for n in self._where if not n.endswith(SCALE_SUFFIX))

    def __len__(self) -> int:
        return sum(1 for _ in self)


class Fp8Weight:
    """A torch-layout fp8 weight [out, in] and its block scales; `.T` is our [in, out]
    QuantizedWeight (from_fp8_blocks), as the loaders' transpose asks."""

    def __init__(self, w, scale_inv, block: int):
        self.w, self.scale_inv, self.block = w, scale_inv, block
        self.shape = tuple(w.shape)

    @property
    def T(self):  # noqa: N802 (the loaders' array protocol)
        import jax.numpy as jnp

        from pallas_kernels.quantized import from_fp8_blocks

        return from_fp8_blocks(jnp.asarray(self.w).T, jnp.asarray(self.scale_inv).T, self.block)

    @property
    def host_T(self):  # noqa: N802
        """`.T` with numpy arrays (an expert's, stacked on the host with the others)."""
        from pallas_kernels.quantized import from_fp8_blocks

        return from_fp8_blocks(np.ascontiguousarray(np.asarray(self.w).T),
                               np.asarray(self.scale_inv).T, self.block)
