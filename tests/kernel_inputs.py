"""Kernel test inputs and references without an XLA compile per eager jnp op.

On the CPU every eager jnp op on a new shape or dtype compiles a program of its own (~20-80 ms
each here): a test that builds its inputs with a few .at[].set, astype, slices and concatenates
and runs a plain-jnp reference op by op compiles dozens of them. Here inputs are made in numpy
(the same bits: data movement, IEEE float32 arithmetic, round-to-nearest-even casts) and sent
once, and a reference runs as one jitted program of the same jnp code.
"""

from __future__ import annotations

import functools

import jax
import numpy as np


def put(x, dtype=None) -> jax.Array:
    """jnp.asarray(x, dtype) for host values (numpy arrays, nested lists, scalars), bit for
    bit, without compiling anything (jnp.asarray of a numpy array compiles a program per shape
    and dtype, and one more for a cast or a list): the cast in numpy, then jax.device_put."""
    a = np.asarray(x) if dtype is None else np.asarray(x, dtype)
    canonical = jax.dtypes.canonicalize_dtype(a.dtype)
    return jax.device_put(a if canonical == a.dtype else a.astype(canonical))


def put_tree(tree):
    """jax.tree.map(jnp.asarray, tree) of a tree of numpy arrays (a QuantizedWeight)."""
    return jax.tree.map(put, tree)


def one_program(fn):
    """fn run as one jitted program: the arrays among its arguments (pytree leaves, nested in
    tuples and dicts included) traced, every other leaf (Python numbers, strings, block-size
    dataclasses) static, as fn would see them eagerly. The same jnp code as fn run op by op,
    compiled once per argument structure instead of once per op."""
    cache = {}

    @functools.wraps(fn)
    def call(*args, **kwargs):
        leaves, tree = jax.tree.flatten((args, kwargs))
        traced = tuple(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)
        static = tuple(None if t else x for t, x in zip(traced, leaves))
        key = (tree, traced, static)
        if key not in cache:
            def run(arrays):
                it = iter(arrays)
                a, kw = jax.tree.unflatten(tree, [next(it) if t else x
                                                  for t, x in zip(traced, static)])
                return fn(*a, **kw)

            cache[key] = jax.jit(run)
        return cache[key]([x for t, x in zip(traced, leaves) if t])

    return call
