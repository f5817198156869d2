"""Helpers shared by the kernel tests: random inputs, the relative-error measure, and the
Pallas kernels a function runs (read from its jaxpr)."""

import collections
import functools
import math

import jax
import jax.extend  # the jaxpr types below (jax itself does not import jax.extend)
import jax.numpy as jnp
import numpy as np


@functools.partial(jax.jit, static_argnums=1)
def _normal_draw(seed: jax.Array, length: int) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), (length,), jnp.float32)


def normal(seed: int, shape, dtype, scale=1.0):
    """Standard normal values (times `scale`) drawn in float32, then cast to `dtype`: the
    values of (scale * jax.random.normal(PRNGKey(seed), shape)).astype(dtype), bit for bit.
    Threefry's counters make a shape's draw the first values of a longer flat draw of the
    same key, so one sampler per power-of-two length is compiled (not one per shape, with a
    multiply and a cast each); the scale and the cast are numpy's (the same IEEE float32
    product, the same round-to-nearest-even cast)."""
    n = math.prod(shape)
    if not 0 <= seed < 2**31:
        return (scale * jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)
                ).astype(dtype)
    flat = np.asarray(_normal_draw(np.int32(seed), max(1024, 1 << max(n - 1, 0).bit_length())))
    return jnp.asarray((np.float32(scale) * flat[:n]).astype(jnp.dtype(dtype)).reshape(shape))


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; fails on a shape mismatch or a non-finite output."""
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.all(np.isfinite(out)), "kernel output has NaN/inf"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _jaxprs(value):
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _jaxprs(v)


def _count(jaxpr, counts: collections.Counter) -> collections.Counter:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            counts[eqn.params["name"]] += 1
            continue
        for v in eqn.params.values():
            for sub in _jaxprs(v):
                _count(sub, counts)
    return counts


def _count_jits(jaxpr, counts: collections.Counter) -> collections.Counter:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("jit", "pjit"):
            counts[eqn.params["name"]] += 1
        for v in eqn.params.values():
            for sub in _jaxprs(v):
                _count_jits(sub, counts)
    return counts


def jitted_calls_in(fn, *args) -> collections.Counter:
    """Names of the jitted functions fn(*args) calls, nested ones included (traced, not run):
    what a kernel whose lowering is not a pallas_call here (Mosaic GPU) is counted by."""
    return _count_jits(jax.make_jaxpr(fn)(*args).jaxpr, collections.Counter())


def pallas_kernels_in(fn, *args) -> collections.Counter:
    """Names of the Pallas kernels fn(*args) calls, one count per call (traced, not run)."""
    return _count(jax.make_jaxpr(fn)(*args).jaxpr, collections.Counter())
