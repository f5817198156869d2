"""Test inputs made on the host and sent once: no XLA program compiled for them.

In jax 0.11 `jnp.asarray(numpy_array)` stages the array through a one-op program (`stage`,
or `convert_element_type` with a dtype) compiled per shape and dtype, tens of ms each on this
CPU, hundreds of them per kernel test file. `jnp.asarray(a, dtype)` of a numpy / Python
value casts on the host (`np.asarray(a, dtype)`) and then converts to the dtype it already
has: `put` does the same cast and `jax.device_put`s the result, the same bits."""

from __future__ import annotations

import math

import jax
import numpy as np

import kernel_testing


def put(a, dtype=None) -> jax.Array:
    """jnp.asarray(a, dtype) for host values (numpy arrays, lists, scalars), bit for bit."""
    a = np.asarray(a) if dtype is None else np.asarray(a, dtype)
    canonical = jax.dtypes.canonicalize_dtype(a.dtype)
    return jax.device_put(a if canonical == a.dtype else a.astype(canonical))


def put_tree(tree):
    """jax.tree.map(jnp.asarray, tree) of a tree of numpy arrays (a QuantizedWeight)."""
    return jax.tree.map(put, tree)


def host_normal(seed: int, shape, dtype, scale=1.0) -> np.ndarray:
    """kernel_testing.normal's values as a numpy array (its float32 draw, then the cast)."""
    n = math.prod(shape)
    assert 0 <= seed < 2**31, seed
    flat = np.asarray(kernel_testing._seed_draw(np.int32(seed), kernel_testing._length(n)))
    return (np.float32(scale) * flat[:n]).astype(np.dtype(jax.numpy.dtype(dtype))).reshape(shape)


def normal(seed: int, shape, dtype, scale=1.0) -> jax.Array:
    """kernel_testing.normal(seed, shape, dtype, scale), bit for bit, sent without a compile."""
    return jax.device_put(host_normal(seed, shape, dtype, scale))
