"""The residual stream as the ops pass it along: the carrier of the fused decode boundary.

A pre-norm decoder layer is `x += f(norm(x))` twice. On the fused decode path no sublayer
boundary is a kernel of its own: a sublayer's output stays pending (often as a split-K
matmul's float32 chunks) and the next op adds it to the stream in its own kernel's main loop.
What a producer should emit (its output form, which of its consumer's weights to prefetch into
the L2) depends on that consumer, so producers are *deferred*: an op records the kernel call,
and the consumer emits it with its hints. A `Residual` holds the stream, the pending output and
the one-kernel MLP's spare buffers; `Projection` is a norm_linear's output for its consumer.
Family code passes these along and never looks inside.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels._common import sum_chunks


class Form(enum.Enum):
    """The forms a matmul's output can take."""
    ARRAY = "array"  # [..., *N] in the activation dtype
    PARTIALS = "partials"  # float32 split-K chunks [S, ..., *N], summed by the consumer
    NORMED = "normed"  # chunks of (x * norm_weight) @ w and the deferred norm's statistics


ARRAY_ONLY = frozenset({Form.ARRAY})
ANY_SUM = frozenset({Form.ARRAY, Form.PARTIALS})  # what a residual-add boundary takes


class Partials(NamedTuple):
    """A matmul's output left as float32 chunks [S, B, T, *N] for a consumer kernel to sum;
    norm: when the sum still has to be scaled by its input's rsqrt(mean square + eps) (a
    normed projection whose norm was deferred), (sums of squares [S, R] float32, R >= B * T
    (the first B * T columns are the rows'), K, eps),
    or (the input rows [B * T, K], eps) for the consumer to sum their squares itself."""
    parts: jax.Array
    norm: tuple | None = None

    @property
    def form(self) -> Form:
        return Form.PARTIALS if self.norm is None else Form.NORMED

    def materialize(self, dtype) -> jax.Array:
        """The finished product [B, T, *N] in dtype."""
        total = sum_chunks(self.parts)  # in chunk order, as the kernels sum them
        if self.norm is not None:
            if len(self.norm) == 2:
                x, eps = self.norm
                xf = x.astype(jnp.float32)
                ss, k = jnp.sum(xf * xf, axis=-1)[None], x.shape[-1]
            else:
                ss, k, eps = self.norm
            rows = total.shape[0] * total.shape[1]
            inv_rms = jax.lax.rsqrt(sum_chunks(ss)[:rows] / k + eps)  # [B * T]
            total = total * inv_rms.reshape(*total.shape[:2], *(1,) * (total.ndim - 2))
        return total.astype(dtype)


class Deferred:
    """A kernel call put off until its consumer is known. emit(accept, prefetch) -> a tuple
    of outputs runs once, at the first request: accept is the set of Forms the consumer's
    kernel takes, prefetch its (weight array, PrefetchPlan) pairs for the producer's L2
    prefetch (hints: a producer that cannot honour them ignores them)."""

    def __init__(self, emit: Callable[[frozenset, tuple], tuple]):
        self._emit = emit
        self._outputs = None

    def outputs(self, accept: frozenset = ARRAY_ONLY, prefetch: tuple = ()) -> tuple:
        if self._outputs is None:
            self._outputs = self._emit(accept, prefetch)
        return self._outputs

    def part(self, index: int) -> Part:
        return Part(self, index)


@dataclasses.dataclass(frozen=True)
class Part:
    """Output `index` of a Deferred call."""
    deferred: Deferred
    index: int


def resolve(value, accept: frozenset = ARRAY_ONLY, prefetch: tuple = ()):
    """A value, emitting its deferred producer with these hints if it has not run yet."""
    if isinstance(value, Part):
        return value.deferred.outputs(accept, prefetch)[value.index]
    return value


@dataclasses.dataclass(frozen=True)
class Residual:
    """The residual stream x [B, T, D] between two ops; pending: the last sublayer's output,
    not yet added to x (an array, Partials, or a deferred one); spare: a zeroed float32
    [B * T, D] buffer for the next one-kernel MLP's accumulator; dead: a float32 [B * T, D]
    buffer no op reads any more (the last one-kernel MLP's output, once added)."""

    x: jax.Array | Part
    aval: jax.ShapeDtypeStruct  # x's shape and dtype, known before any deferred call runs
    pending: jax.Array | Partials | Part | None = None
    spare: jax.Array | Part | None = None
    dead: jax.Array | Part | None = None
    post_norm: tuple | None = None

    @classmethod
    def start(cls, x: jax.Array) -> Residual:
        """The stream of the embeddings x [B, T, D]."""
        return cls(x, jax.ShapeDtypeStruct(x.shape, x.dtype))

    def take(self, accept: frozenset = ANY_SUM, prefetch: tuple = ()):
        """(x, the pending output or None): the consumer's hints go to the pending producer.
        With a post_norm the pending output comes back finished and normed (an array): the
        norm needs whole rows, so no consumer kernel can take its chunks."""
        # The pending output first: x may be a part of the same deferred call, which must
        # run with the consumer's hints, not be emitted without them by resolving x.
        if self.post_norm is None:
            delta = resolve(self.pending, accept, prefetch)
            return resolve(self.x), delta
        delta = resolve(self.pending, ARRAY_ONLY, prefetch)
        if isinstance(delta, Partials):
            delta = delta.materialize(self.aval.dtype)
        fn, weight = self.post_norm
        return resolve(self.x), fn(delta, weight)

    def with_pending(self, pending, post_norm: tuple | None = None) -> Residual:
        """The stream with a sublayer's output pending (post_norm: see the class)."""
        if self.pending is not None:
            raise ValueError("the residual stream already holds a sublayer output that no op "
                             "has added yet: a norm_linear, gated_mlp or lm_head takes it first")
        return dataclasses.replace(self, pending=pending, post_norm=post_norm)


class Projection:
    """A norm_linear's output [B, T, *N], emitted in the form its consumer asks for."""

    def __init__(self, part: Part, shape: tuple[int, ...], dtype):
        self._part = part
        self.shape = tuple(shape)  # [B, T, *N] of the finished product
        self.dtype = jnp.dtype(dtype)

    def get(self, accept: frozenset = ARRAY_ONLY):
        value = resolve(self._part, accept)
        if isinstance(value, Partials) and value.form not in accept:
            value = value.materialize(self.dtype)
        return value

    def array(self) -> jax.Array:
        return self.get(ARRAY_ONLY)
