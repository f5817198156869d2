"""Helpers shared by the kernel tests: random inputs and the relative-error measure."""

import jax
import jax.numpy as jnp
import numpy as np


def normal(seed: int, shape, dtype, scale=1.0):
    """Standard normal values (times `scale`) drawn in float32, then cast to `dtype`."""
    return (scale * jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)).astype(dtype)


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; fails on a shape mismatch or a non-finite output."""
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.all(np.isfinite(out)), "kernel output has NaN/inf"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def set_boundaries(monkeypatch, mode: str) -> None:
    """The decode path's sublayer-boundary flags of jaxinfer/models/layers.py set to
    BOUNDARY_MODES[mode] for one test (monkeypatch undoes it)."""
    from jaxinfer.models import layers

    for flag, on in zip(("FUSED_ADD_NORM", "SWIGLU_ADD_NORM", "QKV_ADD_NORM"),
                        layers.BOUNDARY_MODES[mode]):
        monkeypatch.setattr(layers, flag, on)
