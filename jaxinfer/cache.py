"""KV caches as explicit pytrees that own their append.

Slot i of a sequence's cache row holds the key/value of that sequence's token at position i, so
a query at position p sees exactly the slots <= p (and, with a sliding window, > p - window):
stale slots past a sequence's length are masked by causality and never need clearing.
Per-layer arrays (a tuple, not one stacked [L, ...] array) keep the decode step free of the
per-layer slice copies that indexing a stacked array makes XLA emit (benchmarks/DECISIONS.md).
`attend` dispatches on the layer cache's type (`KVLayer` here; the paged and quantized caches
of later issues are other types).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxinfer import pytree
from jaxinfer.configs import Config


@pytree.dataclass
class KVLayer:
    """One layer's contiguous cache."""

    k: jax.Array  # [B, S, Hkv, D]
    v: jax.Array  # [B, S, Hkv, D]

    def append(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> KVLayer:
        """New keys/values k, v [B, T, Hkv, D] written to slots `positions` [B, T]. Positions
        past the end of the cache are dropped (callers check lengths on the host first)."""
        rows = jnp.arange(k.shape[0])[:, None]  # [B, 1]
        return KVLayer(self.k.at[rows, positions].set(k.astype(self.k.dtype), mode="drop"),
                       self.v.at[rows, positions].set(v.astype(self.v.dtype), mode="drop"))


@pytree.dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # per layer [B, S, Hkv, D]
    v: tuple[jax.Array, ...]  # per layer [B, S, Hkv, D]
    lengths: jax.Array  # [B] int32: valid slots per sequence (= next write position)

    @classmethod
    def init(cls, config: Config, batch_size: int, max_seq_len: int, dtype=None) -> KVCache:
        """Zeroed cache for `batch_size` sequences of up to `max_seq_len` tokens."""
        if batch_size < 1 or max_seq_len < 1:
            raise ValueError(f"KVCache needs batch_size >= 1 and max_seq_len >= 1, "
                             f"got {batch_size} and {max_seq_len}")
        dtype = jnp.dtype(dtype or config.dtype)
        shape = (batch_size, max_seq_len, config.num_kv_heads, config.head_dim)
        k = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
        v = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
        return cls(k=k, v=v, lengths=jnp.zeros((batch_size,), jnp.int32))

    def layer(self, i: int) -> KVLayer:
        return KVLayer(self.k[i], self.v[i])

    def with_layers(self, layers: Sequence[KVLayer]) -> KVCache:
        return self.replace(k=tuple(c.k for c in layers), v=tuple(c.v for c in layers))

    def nbytes(self) -> int:
        """Bytes the K and V arrays hold (allocated, not only the valid slots)."""
        return sum(a.size * a.dtype.itemsize for a in (*self.k, *self.v))
