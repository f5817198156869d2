"""How an op picks its implementation: a registry per op, each entry with a `supports()` check.

An op's implementations are tried in order; the first whose `supports(...)` returns None runs
(any other return value is the reason it does not apply, for errors and tests), and the
reference, last, takes anything. New weight types, caches and kernels register here beside
the existing ones without touching the model families. The checks read only static facts
(shapes, dtypes, weight and cache types, the plan), so the choice is made at trace time and is
part of the compile key through the plan.

On a sharded plan (`Plan.sharding`, jaxinfer/sharding.py) the pure-jnp implementations are
partitioned by XLA from the params' and the cache's shardings; a Pallas kernel cannot be, so
it runs under `jax.shard_map` on its local shard, placed here and nowhere else: a registry's
`layout` says how its op's operands are split over the mesh (from the same rules) and which
mesh axes its outputs are summed over. A kernel of an op without a layout does not apply on a
sharded plan (its supports() answer says so), and the fused decode path (split-K partials
handed between kernels, the one-kernel MLP) is off on a sharded plan: `decode_path` is False.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.plan import Kernels, Plan

KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str
    supports: Callable[..., str | None]  # None: takes these arguments; else why not
    run: Callable
    kernel: bool = False  # a Pallas kernel: on a sharded plan it runs per shard (shard_map)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How an op runs on its shards: inputs maps a positional index or keyword name to the
    PartitionSpec pytree of that operand (P() whole on every device; operands not named are
    static, closed over); out: the outputs' PartitionSpec pytree; reduce: mesh axes the
    outputs are summed over (each shard computed a part of the sum); local: (args, kwargs)
    -> (args, kwargs), run on each shard before the op (e.g. global -> local expert ids)."""
    inputs: dict
    out: Any
    reduce: tuple = ()
    local: Callable | None = None


def plan_of(args, kwargs) -> Plan | None:
    """The Plan among an op's arguments."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, Plan):
            return a
    return None


def _local_plan(value):
    return value.local() if isinstance(value, Plan) else value


def per_shard(run: Callable, layout: Layout, plan: Plan, args: tuple, kwargs: dict):
    """run(*args, **kwargs) under jax.shard_map over the plan's mesh, as the layout says;
    inside, the plan is the shard's own (no sharding), so nested ops run locally."""
    keys = list(layout.inputs)
    values = [args[k] if isinstance(k, int) else kwargs[k] for k in keys]

    def body(*operands):
        a, kw = list(args), dict(kwargs)
        for k, v in zip(keys, operands):
            if isinstance(k, int):
                a[k] = v
            else:
                kw[k] = v
        a, kw = [_local_plan(v) for v in a], {k: _local_plan(v) for k, v in kw.items()}
        if layout.local is not None:
            a, kw = layout.local(a, kw)
        out = run(*a, **kw)
        if layout.reduce:
            out = jax.tree.map(lambda y: jax.lax.psum(y, layout.reduce), out)
        return out

    return jax.shard_map(body, mesh=plan.sharding.mesh, in_specs=tuple(layout.inputs[k]
                                                                       for k in keys),
                         out_specs=layout.out, check_vma=False)(*values)


class Registry:
    """An op's implementations in order of preference. layout: (the plan's Sharding, *args,
    **kwargs) -> a Layout, or None where the operands cannot be split (then its kernels do
    not apply on a sharded plan); every: run every implementation per shard on a sharded
    plan, not only the kernels (an op whose per-shard form XLA would not find, as the
    experts' dispatch over ep)."""

    def __init__(self, op: str, layout: Callable | None = None, every: bool = False):
        self.op = op
        self.impls: list[Implementation] = []
        self.layout = layout
        self.every = every

    def register(self, name: str, supports: Callable[..., str | None], *, before: str = None,
                 kernel: bool = False):
        """Decorator: register fn as the implementation `name` (last, or before another);
        kernel: it is a Pallas kernel (see the class)."""
        def add(fn):
            impl = Implementation(name, supports, fn, kernel)
            at = len(self.impls) if before is None else [i.name for i in self.impls].index(before)
            self.impls.insert(at, impl)
            return fn
        return add

    def _layout(self, impl: Implementation, args, kwargs) -> Layout | None | str:
        """The layout impl runs under: None on one device (or a jnp implementation XLA
        partitions), else a Layout, or a string: why it cannot run per shard."""
        plan = plan_of(args, kwargs)
        if plan is None or not plan.sharded or not (impl.kernel or self.every):
            return None
        layout = None if self.layout is None else self.layout(plan.sharding, *args, **kwargs)
        return layout if layout is not None else "no per-shard layout for these operands"

    def _supports(self, impl: Implementation, args, kwargs) -> str | None:
        why = impl.supports(*args, **kwargs)
        if why is None and isinstance(layout := self._layout(impl, args, kwargs), str):
            return f"sharded plan: {layout}"
        return why

    def get(self, name: str) -> Implementation:
        for impl in self.impls:
            if impl.name == name:
                return impl
        raise KeyError(f"{self.op}: no implementation named {name!r}")

    def reasons(self, *args, **kwargs) -> dict[str, str | None]:
        """Each implementation's answer for these arguments (None: it applies)."""
        return {i.name: self._supports(i, args, kwargs) for i in self.impls}

    def pick(self, *args, **kwargs) -> Implementation:
        for impl in self.impls:
            if self._supports(impl, args, kwargs) is None:
                return impl
        raise ValueError(f"{self.op}: no implementation takes these inputs: "
                         f"{self.reasons(*args, **kwargs)}")

    def __call__(self, *args, **kwargs):
        impl = self.pick(*args, **kwargs)
        layout = self._layout(impl, args, kwargs)
        if layout is None:
            return impl.run(*args, **kwargs)
        return per_shard(impl.run, layout, plan_of(args, kwargs), args, kwargs)


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
    fused_rows rows; with batch_invariant every x, whatever its rows and query length (one
    kernel and one set of tiles per weight shape, so that a row's bits never depend on M =
    B * T: decode at any batch and prefill in any chunking). Never on a sharded plan (first
    version): split-K partials and the one-kernel MLP's accumulators are handed between
    kernels across the sublayer boundary, which no per-shard layout expresses yet."""
    if not kernels_on(plan, x.dtype) or plan.sharded:
        return False
    return plan.policy.batch_invariant or rows(x) <= plan.policy.fused_rows


# ---------------------------------------------------------------------------------------------
# Per-shard specs the ops' layouts share
# ---------------------------------------------------------------------------------------------


def batch_axis(sharding, b: int) -> str | None:
    """The mesh axis of a batch of b rows: dp where it divides b, else None (replicated)."""
    axis = sharding.axis("batch")
    return axis if axis is not None and b % sharding.size(axis) == 0 else None
