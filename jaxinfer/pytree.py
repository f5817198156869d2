"""Frozen dataclasses registered as JAX pytrees (the state types: caches, sampler, weights).

JAX's own `register_dataclass` instead of flax.struct: the same semantics for what we use, and
importing flax cost ~0.2 s of every CLI start.
"""

from __future__ import annotations

import dataclasses


def dataclass(cls):
    """A frozen dataclass whose fields are pytree children, except `static_field`s (part of the
    tree structure, hence of jit cache keys); `.replace(**changes)` returns a copy."""
    import jax

    cls = dataclasses.dataclass(frozen=True)(cls)
    cls.replace = lambda self, **changes: dataclasses.replace(self, **changes)
    return jax.tree_util.register_dataclass(cls)


def static_field(default=dataclasses.MISSING):
    return dataclasses.field(default=default, metadata={"static": True})
