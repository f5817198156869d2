"""Checkpoint formats: HF safetensors directories, GGUF files, and the registry of named models.

This package knows file formats; it returns a `Config` and a params pytree in the model's own
layout, and takes from the engine only `Config` and the model families' tensor tables
(jaxinfer/models/registry.py).
"""

from __future__ import annotations

import pathlib


def load_checkpoint(source: str | pathlib.Path, before_tensors=None, keep_quantized: bool = True,
                    transform=None, host: bool = False):
    """(Config, params, Tokenizer | None) from a registered name, an HF directory or a .gguf file.

    before_tensors(config, float32_staging[, stored_bytes]), when given, runs once the config
    is known and before any tensor is read: float32_staging says the loader builds float32
    host copies first (GGUF dequantization); stored_bytes, the file's bytes of a GGUF kept in
    its blocks. A memory check can then refuse a load that cannot fit.
    keep_quantized: quantized tensors (GGUF blocks) come back as QuantizedWeights in their
    codes and scales; False dequantizes them to float32. transform(name, value): applied to
    each param as it is read ("embed", "layers.3.wqkv": quantize on load, or place on a mesh,
    without holding the whole checkpoint). host=True: params reach transform on the host
    (numpy, QuantizedWeights of numpy, or an HF tensor as `hf.TensorSlices`, read by the
    slices asked for), never on a device."""
    from checkpoints import registry

    path = registry.resolve(str(source))
    if path.is_dir():
        from checkpoints.hf import load_hf_dir

        return load_hf_dir(path, before_tensors and (lambda c: before_tensors(c, False)),
                           transform, host)
    if path.suffix == ".gguf":
        from checkpoints.gguf import load_gguf

        stored = path.stat().st_size if keep_quantized else None  # the blocks, kept
        return load_gguf(path, before_tensors and (
            lambda c: before_tensors(c, not keep_quantized, stored)),
            keep_quantized=keep_quantized, transform=transform)
    raise ValueError(f"{path}: not a checkpoint this loader knows; give an HF-layout directory "
                     "(config.json + *.safetensors), a .gguf file, or a registered model name")
