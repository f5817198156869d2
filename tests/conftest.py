"""Test configuration: GPU-marked tests are skipped where no GPU is present."""

import os

# Tests compare float32 logits at 1e-4; keep XLA's CPU matmuls at full precision and quiet.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import jax  # noqa: E402
import pytest  # noqa: E402


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (runs on the lent H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
