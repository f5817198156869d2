"""Helpers shared by the kernel tests: random inputs, the relative-error measure, and the
Pallas kernels a function runs (read from its jaxpr)."""

import collections
import functools
import math

import jax
import jax.extend  # the jaxpr types below (jax itself does not import jax.extend)
import jax.numpy as jnp
import numpy as np


# Threefry's counters make a shape's draw the first values of a longer flat draw of the same
# key: the helpers below take them from one draw of a power-of-two length, so the suite
# compiles one sampler per length (not one per shape, each with a multiply and a cast), and
# scale and cast in numpy (the same IEEE float32 product, the same round-to-nearest-even
# cast): the same bits as the jax.random calls they stand for (checked over seeds, shapes,
# scales and f32 / bf16 / f16 / fp8). The results go to the device by jax.device_put: a
# jnp.asarray of a numpy array compiles a program (lax.stage) per shape and dtype.


@functools.partial(jax.jit, static_argnums=1)
def _seed_draw(seed: jax.Array, length: int) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), (length,), jnp.float32)


@functools.partial(jax.jit, static_argnums=1)
def _key_draw(key: jax.Array, length: int) -> jax.Array:
    return jax.random.normal(key, (length,), jnp.float32)


def _length(n: int) -> int:
    return max(1024, 1 << max(n - 1, 0).bit_length())


def normal(seed: int, shape, dtype, scale=1.0):
    """Standard normal values (times `scale`) drawn in float32, then cast to `dtype`: the
    values of (scale * jax.random.normal(PRNGKey(seed), shape)).astype(dtype), bit for bit."""
    if not 0 <= seed < 2**31:
        return (scale * jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)
                ).astype(dtype)
    return jax.device_put(host_normal(seed, shape, dtype, scale))


def host_normal(seed: int, shape, dtype, scale=1.0) -> np.ndarray:
    """normal's values as a numpy array (0 <= seed < 2**31)."""
    n = math.prod(shape)
    assert 0 <= seed < 2**31, seed
    flat = np.asarray(_seed_draw(np.int32(seed), _length(n)))
    return (np.float32(scale) * flat[:n]).astype(jnp.dtype(dtype)).reshape(shape)


def _key_normal(key, shape) -> np.ndarray:
    n = math.prod(shape)
    return np.asarray(_key_draw(key, _length(n)))[:n].reshape(shape)


def random_normal(key, shape) -> jax.Array:
    """jax.random.normal(key, shape) (float32), bit for bit."""
    return jax.device_put(_key_normal(key, shape))


def init_params(specs, key, dtype):
    """jaxinfer.weights.init_params(specs, key, dtype), bit for bit (ParamSpec.initialize's
    fan-in scaled normals, ones and zeros) without a compile per parameter shape."""
    from jaxinfer.weights import ParamSpec

    leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    keys = jax.random.split(key, len(leaves))
    out = []
    for i, spec in enumerate(leaves):
        dt = jnp.dtype(spec.dtype or dtype)
        if spec.init == "ones":
            value = np.ones(spec.shape, dt)
        elif spec.init == "zeros":
            value = np.zeros(spec.shape, dt)
        else:
            value = (np.float32(spec.init_std) * _key_normal(keys[i], spec.shape)).astype(dt)
        out.append(spec.wrap(jax.device_put(value)))
    return jax.tree.unflatten(treedef, out)


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; fails on a shape mismatch or a non-finite output.
    Each side is taken as float32, then float64 (the float32 cast in numpy: the values of
    jnp.asarray(x, jnp.float32) without compiling a cast per shape and dtype)."""
    out = np.asarray(out).astype(np.float32).astype(np.float64)
    ref = np.asarray(ref).astype(np.float32).astype(np.float64)
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


def _jit_outputs(jaxpr, name: str, out: list) -> list:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("jit", "pjit") and eqn.params["name"] == name:
            out.append([tuple(v.aval.shape) for v in eqn.outvars])
        for v in eqn.params.values():
            for sub in _jaxprs(v):
                _jit_outputs(sub, name, out)
    return out


def jitted_call_shapes(fn, *args, name: str) -> list:
    """The output shapes of each call of the jitted function `name` in fn(*args), in order
    (traced, not run): a list of lists of shapes."""
    return _jit_outputs(jax.make_jaxpr(fn)(*args).jaxpr, name, [])


def jitted_calls_in(fn, *args) -> collections.Counter:
    """Names of the jitted functions fn(*args) calls, nested ones included (traced, not run):
    what a kernel whose lowering is not a pallas_call here (Mosaic GPU) is counted by."""
    return _count_jits(jax.make_jaxpr(fn)(*args).jaxpr, collections.Counter())


def pallas_kernels_in(fn, *args) -> collections.Counter:
    """Names of the Pallas kernels fn(*args) calls, one count per call (traced, not run)."""
    return _count(jax.make_jaxpr(fn)(*args).jaxpr, collections.Counter())
