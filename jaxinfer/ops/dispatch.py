"""How an op picks its implementation: a registry per op, each entry with a `supports()` check.

An op's implementations are tried in order; the first whose `supports(...)` returns None runs
(any other return value is the reason it does not apply, for errors and tests), and the
reference, last, takes anything. New weight types, caches and kernels register here beside
the existing ones without touching the model families. The checks read only static facts
(shapes, dtypes, weight and cache types, the plan), so the choice is made at trace time and is
part of the compile key through the plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxinfer.plan import Kernels, Plan

KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str
    supports: Callable[..., str | None]  # None: takes these arguments; else why not
    run: Callable


class Registry:
    """An op's implementations in order of preference."""

    def __init__(self, op: str):
        self.op = op
        self.impls: list[Implementation] = []

    def register(self, name: str, supports: Callable[..., str | None], *, before: str = None):
        """Decorator: register fn as the implementation `name` (last, or before another)."""
        def add(fn):
            impl = Implementation(name, supports, fn)
            at = len(self.impls) if before is None else [i.name for i in self.impls].index(before)
            self.impls.insert(at, impl)
            return fn
        return add

    def get(self, name: str) -> Implementation:
        for impl in self.impls:
            if impl.name == name:
                return impl
        raise KeyError(f"{self.op}: no implementation named {name!r}")

    def reasons(self, *args, **kwargs) -> dict[str, str | None]:
        """Each implementation's answer for these arguments (None: it applies)."""
        return {i.name: i.supports(*args, **kwargs) for i in self.impls}

    def pick(self, *args, **kwargs) -> Implementation:
        for impl in self.impls:
            if impl.supports(*args, **kwargs) is None:
                return impl
        raise ValueError(f"{self.op}: no implementation takes these inputs: "
                         f"{self.reasons(*args, **kwargs)}")

    def __call__(self, *args, **kwargs):
        return self.pick(*args, **kwargs).run(*args, **kwargs)


def always(*args, **kwargs) -> None:
    """supports() of an implementation that takes anything (the references)."""
    return None


def kernels_on(plan: Plan, dtype) -> bool:
    """Whether the Pallas kernels serve activations of this dtype under the plan: on an NVIDIA
    GPU (or in interpret mode, or when the plan asks for them) and for 16-bit activations
    (float32 stays on the references: IEEE float32 dots, not measured against XLA's)."""
    policy = plan.policy
    if policy.kernels is Kernels.REFERENCE or jnp.dtype(dtype) not in KERNEL_DTYPES:
        return False
    return (policy.kernels is Kernels.PALLAS or policy.interpret
            or jax.default_backend() == "gpu")


def rows(x) -> int:
    """The rows of x [B, T, ..., K] seen as a matrix [M, K]."""
    return math.prod(x.shape[:-1])


def decode_path(x, plan: Plan) -> bool:
    """Whether x [B, T, K] takes the fused small-M kernels (the decode path): at most
    fused_rows rows, and with batch_invariant one token per row (the choice then depends on
    the query length, not on the batch)."""
    if not kernels_on(plan, x.dtype) or rows(x) > plan.policy.fused_rows:
        return False
    return not plan.policy.batch_invariant or x.shape[1] == 1
