"""Typed weights and their declaration: every parameter declared once by a `ParamSpec`.

A spec gives a parameter's shape, logical axes (mapped to mesh axes by the sharding rules),
initializer and kind: a plain array (norm weights, biases) or a matmul weight, held as a
`Dense` pytree. The ops dispatch on the weight's type, so the quantized and expert weights of
the next issues plug in as new types beside `Dense` without touching the model families.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax
import jax.numpy as jnp

from jaxinfer import pytree


@pytree.dataclass
class Dense:
    """A matmul weight kept as stored: w [K, *N] ([in, out]), or with `transposed` w [N, K]
    (rows are the output features: an embedding table, which a tied LM head reuses)."""

    w: jax.Array
    transposed: bool = pytree.static_field(False)

    @property
    def dtype(self):
        return self.w.dtype

    @property
    def in_features(self) -> int:
        return self.w.shape[-1] if self.transposed else self.w.shape[0]

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The output feature dims [*N] of x @ w."""
        return tuple(self.w.shape[:1]) if self.transposed else tuple(self.w.shape[1:])


class Kind(enum.Enum):
    ARRAY = "array"  # a plain array: norm weights, biases
    DENSE = "dense"  # a matmul weight [in, *out], held as Dense
    DENSE_T = "dense_t"  # a matmul weight [out, in] (an embedding table), held as Dense


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names
    init: str = "normal"  # "normal" (fan-in scaled), "ones", "zeros"
    kind: Kind = Kind.ARRAY

    def initialize(self, key: jax.Array, dtype):
        if self.init == "ones":
            value = jnp.ones(self.shape, dtype)
        elif self.init == "zeros":
            value = jnp.zeros(self.shape, dtype)
        else:
            std = 1.0 / math.sqrt(self.shape[0]) if len(self.shape) >= 2 else 0.02  # fan-in first
            value = (std * jax.random.normal(key, self.shape, jnp.float32)).astype(dtype)
        return self.wrap(value)

    def wrap(self, value):
        """A loaded array as this parameter's type (a Dense is returned as is)."""
        if self.kind is Kind.ARRAY or isinstance(value, Dense):
            return value
        return Dense(value, transposed=self.kind is Kind.DENSE_T)

    def abstract(self, dtype):
        """The parameter as a shape/dtype struct of its type (for lowering without weights)."""
        return self.wrap(jax.ShapeDtypeStruct(self.shape, dtype))


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def _is_weight(x) -> bool:
    return isinstance(x, Dense)


def init_params(specs, key: jax.Array, dtype):
    """Random params with the declared shapes and types (benchmarks, tests)."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [s.initialize(k, dtype) for s, k in zip(leaves, keys)])


def abstract_params(specs, dtype):
    return jax.tree.map(lambda s: s.abstract(dtype), specs, is_leaf=_is_spec)


def check_params(params, specs) -> None:
    """Raise ValueError naming every param whose presence, type or shape differs from the
    declaration (plain arrays where a spec wants a Dense are accepted: `typed` wraps them)."""
    want = {jax.tree_util.keystr(p): s for p, s in
            jax.tree_util.tree_leaves_with_path(specs, is_leaf=_is_spec)}
    have = {jax.tree_util.keystr(p): a for p, a in
            jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_weight)}
    problems = [f"missing {k} (expected shape {s.shape})" for k, s in want.items() if k not in have]
    problems += [f"unexpected {k}" for k in have if k not in want]
    for k, s in want.items():
        if k not in have:
            continue
        a = have[k]
        if isinstance(a, Dense):
            if s.kind is Kind.ARRAY or a.transposed != (s.kind is Kind.DENSE_T):
                problems.append(f"{k} is a Dense(transposed={a.transposed}), expected {s.kind}")
            a = a.w
        if tuple(getattr(a, "shape", ())) != s.shape:
            problems.append(f"{k} has shape {tuple(getattr(a, 'shape', ()))}, expected {s.shape}")
    if problems:
        raise ValueError("params do not match the model config: " + "; ".join(problems[:10])
                         + (f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""))


def typed(params, specs):
    """params with every matmul weight as its declared type (call check_params first)."""
    return jax.tree.map(lambda s, p: s.wrap(p), specs, params, is_leaf=_is_spec)


def cast_floating(params, dtype):
    """Floating leaves cast to dtype; integer leaves (quantized codes, indices) kept as they are."""
    def cast(a):
        floating = jnp.issubdtype(jnp.asarray(a).dtype if not hasattr(a, "dtype") else a.dtype,
                                  jnp.floating)
        return jnp.asarray(a, dtype=dtype) if floating else jnp.asarray(a)
    return jax.tree.map(cast, params)
