"""Checkpoint formats: HF safetensors directories, GGUF files, and the registry of named models.

This package knows file formats; it returns a `Config` and a params pytree in the model's own
layout, and takes from the engine only `Config` and the model families' tensor tables
(jaxinfer/models/registry.py).
"""

from __future__ import annotations

import pathlib


def load_checkpoint(source: str | pathlib.Path):
    """(Config, params, Tokenizer | None) from a registered name, an HF directory or a .gguf file."""
    from checkpoints import registry

    path = registry.resolve(str(source))
    if path.is_dir():
        from checkpoints.hf import load_hf_dir

        return load_hf_dir(path)
    if path.suffix == ".gguf":
        from checkpoints.gguf import load_gguf

        return load_gguf(path)
    raise ValueError(f"{path}: not a checkpoint this loader knows; give an HF-layout directory "
                     "(config.json + *.safetensors), a .gguf file, or a registered model name")
