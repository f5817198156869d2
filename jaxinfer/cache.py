"""KV caches as explicit pytrees that own their append.

Slot i of a sequence's cache row holds the key/value of that sequence's token at position i, so
a query at position p sees exactly the slots <= p (and, with a sliding window, > p - window):
stale slots past a sequence's length are masked by causality and never need clearing.
Per-layer arrays (a tuple, not one stacked [L, ...] array) keep the decode step free of the
per-layer slice copies that indexing a stacked array makes XLA emit (benchmarks/DECISIONS.md).
`attend` dispatches on the layer cache's type: `KVLayer` (16-bit or float32 values) or
`QuantizedKVLayer` (int8 / fp8 codes with a scale per token and head, about half the bytes of
a 16-bit cache: the decode kernels read the codes and dequantize in registers), or for MLA
models (config.mla) `LatentLayer`: one latent per token instead of per-head K/V (`LatentCache`,
which `KVCache.init` builds for those configs), or `QuantizedLatentLayer`: its int8 / fp8 codes
with a scale per token for each of its two parts. The serving engine's caches are page pools
shared by its requests, slot i of a row at (block_tables[i // page_size], i % page_size):
`PagedKVCache`, and `PagedLatentCache` for MLA models (which `PagedKVCache.init` builds).
"""

from __future__ import annotations

import math
import types
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxinfer import pytree
from jaxinfer.configs import Config
from pallas_kernels.kv_quant import (SCALE_DTYPES, dequantize_kv, dequantize_latent,
                                     quantize_kv, quantize_latent)

# kv_dtype names -> code dtypes (None: the activations' dtype, unquantized)
KV_DTYPES = types.MappingProxyType({"int8": jnp.dtype(jnp.int8),
                                    "fp8": jnp.dtype(jnp.float8_e4m3fn)})


def check_kv_dtype(kv_dtype, name: str = "kv_dtype") -> str | None:
    """kv_dtype as given if it is one of None, "int8", "fp8"; else ValueError naming them."""
    if kv_dtype is not None and (not isinstance(kv_dtype, str) or kv_dtype not in KV_DTYPES):
        raise ValueError(f"{name} must be None (the model's dtype), 'int8' or 'fp8', "
                         f"got {kv_dtype!r}")
    return kv_dtype


def _scale_dtype(scale_dtype, cls: str):
    scale_dtype = jnp.dtype(scale_dtype)
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"{cls} scale_dtype must be float32 or float16, got {scale_dtype}")
    return scale_dtype


def _scatter(cache: jax.Array, rows: jax.Array, positions: jax.Array, x: jax.Array):
    """cache [B, S, ...] with x [B, T, ...] at slots positions [B, T]; past the end: dropped."""
    return cache.at[rows, positions].set(x.astype(cache.dtype), mode="drop")


@pytree.dataclass
class KVLayer:
    """One layer's contiguous cache."""

    k: jax.Array  # [B, S, Hkv, D]
    v: jax.Array  # [B, S, Hkv, D]

    def append(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> KVLayer:
        """New keys/values k, v [B, T, Hkv, D] written to slots `positions` [B, T]. Positions
        past the end of the cache are dropped (callers check lengths on the host first)."""
        rows = jnp.arange(k.shape[0])[:, None]  # [B, 1]
        return KVLayer(_scatter(self.k, rows, positions, k), _scatter(self.v, rows, positions, v))


@pytree.dataclass
class QuantizedKVLayer:
    """One layer's contiguous cache of codes: value = code * scale per (token, head), the
    scale absmax / qmax of that token's head vector (pallas_kernels/kv_quant.py)."""

    k: jax.Array  # [B, S, Hkv, D] int8 or float8_e4m3fn
    v: jax.Array  # [B, S, Hkv, D]
    k_scale: jax.Array  # [B, S, Hkv] float32 or float16
    v_scale: jax.Array  # [B, S, Hkv]

    def append(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> QuantizedKVLayer:
        """New keys/values k, v [B, T, Hkv, D] quantized and written to slots `positions`
        [B, T] (past the end: dropped, as KVLayer.append)."""
        rows = jnp.arange(k.shape[0])[:, None]  # [B, 1]
        (kc, ks), (vc, vs) = (quantize_kv(x, self.k.dtype, self.k_scale.dtype) for x in (k, v))
        return QuantizedKVLayer(_scatter(self.k, rows, positions, kc),
                                _scatter(self.v, rows, positions, vc),
                                _scatter(self.k_scale, rows, positions, ks),
                                _scatter(self.v_scale, rows, positions, vs))


@pytree.dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # per layer [B, S, Hkv, D]: values, or codes when quantized
    v: tuple[jax.Array, ...]  # per layer [B, S, Hkv, D]
    lengths: jax.Array  # [B] int32: valid slots per sequence (= next write position)
    k_scale: tuple[jax.Array, ...] = ()  # per layer [B, S, Hkv] when quantized, else empty
    v_scale: tuple[jax.Array, ...] = ()

    @classmethod
    def init(cls, config: Config, batch_size: int, max_seq_len: int, dtype=None,
             kv_dtype: str | None = None, scale_dtype=jnp.float32) -> KVCache:
        """Zeroed cache for `batch_size` sequences of up to `max_seq_len` tokens: values in
        `dtype` (default the model's), or with kv_dtype "int8" / "fp8" codes with
        `scale_dtype` (float32 or float16) scales per token and KV head."""
        if batch_size < 1 or max_seq_len < 1:
            raise ValueError(f"KVCache needs batch_size >= 1 and max_seq_len >= 1, "
                             f"got {batch_size} and {max_seq_len}")
        check_kv_dtype(kv_dtype)
        if config.mla is not None:  # MLA caches its latent, not per-head K/V
            return LatentCache.init(config, batch_size, max_seq_len, dtype, kv_dtype,
                                    scale_dtype)
        shape = (batch_size, max_seq_len, config.num_kv_heads, config.head_dim)
        dtype = KV_DTYPES[kv_dtype] if kv_dtype else jnp.dtype(dtype or config.dtype)
        k = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
        v = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
        scales = {}
        if kv_dtype:
            scale_dtype = _scale_dtype(scale_dtype, "KVCache")
            scales = {name: tuple(jnp.zeros(shape[:3], scale_dtype)
                                  for _ in range(config.num_layers))
                      for name in ("k_scale", "v_scale")}
        return cls(k=k, v=v, lengths=jnp.zeros((batch_size,), jnp.int32), **scales)

    @property
    def quantized(self) -> bool:
        return bool(self.k_scale)

    def layer(self, i: int) -> KVLayer | QuantizedKVLayer:
        if self.quantized:
            return QuantizedKVLayer(self.k[i], self.v[i], self.k_scale[i], self.v_scale[i])
        return KVLayer(self.k[i], self.v[i])

    def with_layers(self, layers: Sequence[KVLayer | QuantizedKVLayer]) -> KVCache:
        new = self.replace(k=tuple(c.k for c in layers), v=tuple(c.v for c in layers))
        if self.quantized:
            new = new.replace(k_scale=tuple(c.k_scale for c in layers),
                              v_scale=tuple(c.v_scale for c in layers))
        return new

    def nbytes(self) -> int:
        """Bytes the K and V arrays (and a quantized cache's scales) hold (allocated, not only
        the valid slots); also for a cache of jax.ShapeDtypeStructs (jax.eval_shape)."""
        return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
                   for a in (*self.k, *self.v, *self.k_scale, *self.v_scale))


# ---------------------------------------------------------------------------------------------
# The latent cache of multi-head latent attention (DeepSeek-V2 / V3)
# ---------------------------------------------------------------------------------------------


@pytree.dataclass
class LatentLayer:
    """One MLA layer's cache: per token the RMS-normed c_kv [kv_lora_rank] and the roped
    shared key k_pe [qk_rope_head_dim], concatenated (what the absorbed decode reads)."""

    latent: jax.Array  # [B, S, R + Dr]

    def append(self, latent: jax.Array, positions: jax.Array) -> LatentLayer:
        """New latents [B, T, R + Dr] written to slots `positions` [B, T] (past the end:
        dropped, as KVLayer.append)."""
        rows = jnp.arange(latent.shape[0])[:, None]  # [B, 1]
        return LatentLayer(_scatter(self.latent, rows, positions, latent))

    def values(self) -> jax.Array:
        """The latent as stored [B, S, R + Dr]."""
        return self.latent


@pytree.dataclass
class QuantizedLatentLayer:
    """One MLA layer's latent as int8 / fp8 codes: value = code * scale, one scale per token
    for its c_kv and one for its k_rope, each absmax / qmax of its part (kv_quant.py)."""

    latent: jax.Array  # [B, S, R + Dr] int8 or float8_e4m3fn
    scale: jax.Array  # [B, S, 2] float32 or float16: c_kv's, then k_rope's
    rank: int = pytree.static_field()  # R: where c_kv ends and k_rope begins

    def append(self, latent: jax.Array, positions: jax.Array) -> QuantizedLatentLayer:
        """New latents [B, T, R + Dr] quantized and written to slots `positions` [B, T] (past
        the end: dropped, as KVLayer.append)."""
        rows = jnp.arange(latent.shape[0])[:, None]  # [B, 1]
        codes, scale = quantize_latent(latent, self.rank, self.latent.dtype, self.scale.dtype)
        return QuantizedLatentLayer(_scatter(self.latent, rows, positions, codes),
                                    _scatter(self.scale, rows, positions, scale), self.rank)

    def values(self) -> jax.Array:
        """The latent dequantized, float32 [B, S, R + Dr]."""
        return dequantize_latent(self.latent, self.scale, self.rank)


@pytree.dataclass
class LatentCache:
    """The latent cache of an MLA model: kv_lora_rank + qk_rope_head_dim values per token and
    layer (DeepSeek-V2-Lite: 576, against 16 heads x (192 + 128) = 5120 for per-head K/V), or
    with kv_dtype "int8" / "fp8" as many 1-byte codes and two scales."""

    latent: tuple[jax.Array, ...]  # per layer [B, S, R + Dr]: values, or codes when quantized
    lengths: jax.Array  # [B] int32: valid slots per sequence (= next write position)
    scale: tuple[jax.Array, ...] = ()  # per layer [B, S, 2] when quantized, else empty
    rank: int = pytree.static_field(0)  # R (kv_lora_rank): c_kv's width in the latent

    @classmethod
    def init(cls, config: Config, batch_size: int, max_seq_len: int, dtype=None,
             kv_dtype: str | None = None, scale_dtype=jnp.float32) -> LatentCache:
        """Zeroed cache: latents in `dtype` (default the model's), or with kv_dtype "int8" /
        "fp8" codes with `scale_dtype` (float32 or float16) scales per token and part."""
        if config.mla is None:
            raise ValueError("LatentCache is the cache of MLA models (config.mla)")
        if batch_size < 1 or max_seq_len < 1:
            raise ValueError(f"LatentCache needs batch_size >= 1 and max_seq_len >= 1, "
                             f"got {batch_size} and {max_seq_len}")
        shape = (batch_size, max_seq_len, config.mla.latent_dim)
        kv_dtype = check_kv_dtype(kv_dtype)
        dtype = KV_DTYPES[kv_dtype] if kv_dtype else jnp.dtype(dtype or config.dtype)
        scale = ()
        if kv_dtype:
            scale_dtype = _scale_dtype(scale_dtype, "LatentCache")
            # Two scales per token, not one for all R + Dr: k_rope is not RMS-normed as c_kv
            # is, so its range may differ; the fixtures measured the same error either way.
            scale = tuple(jnp.zeros((*shape[:2], 2), scale_dtype)
                          for _ in range(config.num_layers))
        return cls(latent=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
                   lengths=jnp.zeros((batch_size,), jnp.int32), scale=scale,
                   rank=config.mla.kv_lora_rank)

    @property
    def quantized(self) -> bool:
        return bool(self.scale)

    def layer(self, i: int) -> LatentLayer | QuantizedLatentLayer:
        if self.quantized:
            return QuantizedLatentLayer(self.latent[i], self.scale[i], self.rank)
        return LatentLayer(self.latent[i])

    def with_layers(self, layers: Sequence[LatentLayer | QuantizedLatentLayer]) -> LatentCache:
        new = self.replace(latent=tuple(c.latent for c in layers))
        if self.quantized:
            new = new.replace(scale=tuple(c.scale for c in layers))
        return new

    def nbytes(self) -> int:
        """Bytes the latent arrays (and a quantized cache's scales) hold (allocated, not only
        the valid slots); also for a cache of jax.ShapeDtypeStructs (jax.eval_shape)."""
        return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
                   for a in (*self.latent, *self.scale))


# ---------------------------------------------------------------------------------------------
# The paged cache of the serving engine (jaxinfer/engine)
# ---------------------------------------------------------------------------------------------


def _page_slots(block_tables: jax.Array, positions: jax.Array, page_size: int,
                pages: int) -> jax.Array:
    """Flat pool slots [B, T] (page * page_size + offset) of positions [B, T] through
    block_tables [B, W]; a negative position (a padding token) or one past the table maps to
    pages * page_size, past the end, where a mode="drop" scatter discards it."""
    w = block_tables.shape[1]
    logical = positions // page_size  # [B, T]
    ok = (positions >= 0) & (logical < w)
    page = jnp.take_along_axis(block_tables, jnp.clip(logical, 0, w - 1), axis=1)  # [B, T]
    return jnp.where(ok, page * page_size + positions % page_size, pages * page_size)


def _scatter_pages(pool: jax.Array, slots: jax.Array, x: jax.Array) -> jax.Array:
    """pool [P, ps, ...] with x [B, T, ...] written at flat slots [B, T] (past the end: dropped)."""
    p, ps = pool.shape[:2]
    flat = pool.reshape(p * ps, *pool.shape[2:])
    flat = flat.at[slots.reshape(-1)].set(x.reshape(-1, *x.shape[2:]).astype(pool.dtype),
                                          mode="drop")
    # The written pool as one value: for one row (a dynamic-update-slice) XLA's CPU backend
    # otherwise fused the write into each reader (the output, the references' gather), each on
    # a copy of the whole pool: ~2 s a decode step for the embedded model's 3 GB of pages
    return jax.lax.optimization_barrier(flat.reshape(pool.shape))


def gather_pages(pool: jax.Array, block_tables: jax.Array) -> jax.Array:
    """The rows' pages laid end to end: pool [P, ps, ...] -> [B, W * ps, ...] (slot i holds
    position i; what the references attend over)."""
    b, w = block_tables.shape
    pages = pool[block_tables]  # [B, W, ps, ...]
    return pages.reshape(b, w * pool.shape[1], *pool.shape[2:])


@pytree.dataclass
class PagedKVLayer:
    """One layer's page pools and the rows' block tables: position p of row b lives at
    (block_tables[b, p // page_size], p % page_size). Page 0 is the null page (padding rows
    and unused table entries point at it; never attended to at a valid position)."""

    k: jax.Array  # [P, page_size, Hkv, D]
    v: jax.Array  # [P, page_size, Hkv, D]
    block_tables: jax.Array  # [B, W] int32

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    def append(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> PagedKVLayer:
        """New keys/values k, v [B, T, Hkv, D] written at positions [B, T] (negative: a
        padding token, dropped)."""
        slots = _page_slots(self.block_tables, positions, self.page_size, self.k.shape[0])
        return self.replace(k=_scatter_pages(self.k, slots, k), v=_scatter_pages(self.v, slots, v))

    def contiguous(self) -> tuple[jax.Array, jax.Array]:
        """(k, v) [B, W * page_size, Hkv, D] in position order (the references' view)."""
        return gather_pages(self.k, self.block_tables), gather_pages(self.v, self.block_tables)


@pytree.dataclass
class QuantizedPagedKVLayer:
    """PagedKVLayer of int8 / fp8 codes with a scale per (token, head), as QuantizedKVLayer."""

    k: jax.Array  # [P, page_size, Hkv, D] int8 or float8_e4m3fn
    v: jax.Array  # [P, page_size, Hkv, D]
    k_scale: jax.Array  # [P, page_size, Hkv] float32 or float16
    v_scale: jax.Array  # [P, page_size, Hkv]
    block_tables: jax.Array  # [B, W] int32

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    def append(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> QuantizedPagedKVLayer:
        """New keys/values k, v [B, T, Hkv, D] quantized and written at positions [B, T]."""
        slots = _page_slots(self.block_tables, positions, self.page_size, self.k.shape[0])
        (kc, ks), (vc, vs) = (quantize_kv(x, self.k.dtype, self.k_scale.dtype) for x in (k, v))
        return self.replace(k=_scatter_pages(self.k, slots, kc), v=_scatter_pages(self.v, slots, vc),
                            k_scale=_scatter_pages(self.k_scale, slots, ks),
                            v_scale=_scatter_pages(self.v_scale, slots, vs))

    def contiguous(self) -> tuple[jax.Array, jax.Array]:
        """(k, v) [B, W * page_size, Hkv, D] dequantized to float32, in position order."""
        k, v = gather_pages(self.k, self.block_tables), gather_pages(self.v, self.block_tables)
        return (dequantize_kv(k, gather_pages(self.k_scale, self.block_tables)),
                dequantize_kv(v, gather_pages(self.v_scale, self.block_tables)))


@pytree.dataclass
class PagedKVCache:
    """Page pools per layer shared by every request of the engine, and the block tables of the
    rows of one step. Implements KVCache's interface (layer, with_layers, nbytes), so the
    families run on it unchanged; which pages a row owns is the host's business
    (jaxinfer/engine/pages.py)."""

    k: tuple[jax.Array, ...]  # per layer [P, page_size, Hkv, D]: values, or codes
    v: tuple[jax.Array, ...]  # per layer [P, page_size, Hkv, D]
    block_tables: jax.Array  # [B, W] int32: the step's rows' pages (0: the null page)
    k_scale: tuple[jax.Array, ...] = ()  # per layer [P, page_size, Hkv] when quantized
    v_scale: tuple[jax.Array, ...] = ()

    @classmethod
    def init(cls, config: Config, num_pages: int, page_size: int, dtype=None,
             kv_dtype: str | None = None, scale_dtype=jnp.float32) -> PagedKVCache:
        """Zeroed pools of num_pages pages (page 0, the null page, included) of page_size
        tokens, in `dtype` (default the model's), or int8 / fp8 codes with scales; for an MLA
        config a PagedLatentCache."""
        if config.mla is not None:  # MLA pages its latent, not per-head K/V
            return PagedLatentCache.init(config, num_pages, page_size, dtype, kv_dtype,
                                         scale_dtype)
        _check_pages("PagedKVCache", num_pages, page_size)
        check_kv_dtype(kv_dtype)
        shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
        dtype = KV_DTYPES[kv_dtype] if kv_dtype else jnp.dtype(dtype or config.dtype)
        n = config.num_layers
        scales = {}
        if kv_dtype:
            scale_dtype = _scale_dtype(scale_dtype, "PagedKVCache")
            scales = {name: tuple(jnp.zeros(shape[:3], scale_dtype) for _ in range(n))
                      for name in ("k_scale", "v_scale")}
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(n)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(n)),
                   block_tables=jnp.zeros((1, 1), jnp.int32), **scales)

    quantized = KVCache.quantized
    with_layers = KVCache.with_layers  # the same fields per layer (the tables are shared)
    nbytes = KVCache.nbytes  # every page's bytes, allocated or not

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    def with_tables(self, block_tables: jax.Array) -> PagedKVCache:
        return self.replace(block_tables=block_tables)

    def layer(self, i: int) -> PagedKVLayer | QuantizedPagedKVLayer:
        if self.quantized:
            return QuantizedPagedKVLayer(self.k[i], self.v[i], self.k_scale[i], self.v_scale[i],
                                         self.block_tables)
        return PagedKVLayer(self.k[i], self.v[i], self.block_tables)


def _check_pages(cls: str, num_pages: int, page_size: int) -> None:
    if num_pages < 2 or page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"{cls} needs num_pages >= 2 (page 0 is the null page) and a "
                         f"power-of-two page_size, got {num_pages} and {page_size}")


@pytree.dataclass
class PagedLatentLayer:
    """One MLA layer's latent page pool and the rows' block tables (PagedKVLayer's layout,
    one latent row per slot instead of per-head K/V)."""

    latent: jax.Array  # [P, page_size, R + Dr]
    block_tables: jax.Array  # [B, W] int32

    def append(self, latent: jax.Array, positions: jax.Array) -> PagedLatentLayer:
        """New latents [B, T, R + Dr] written at positions [B, T] (negative: dropped)."""
        slots = _page_slots(self.block_tables, positions, self.latent.shape[1],
                            self.latent.shape[0])
        return self.replace(latent=_scatter_pages(self.latent, slots, latent))


@pytree.dataclass
class QuantizedPagedLatentLayer:
    """PagedLatentLayer of int8 / fp8 codes with two scales per slot, as QuantizedLatentLayer."""

    latent: jax.Array  # [P, page_size, R + Dr] int8 or float8_e4m3fn
    scale: jax.Array  # [P, page_size, 2]: c_kv's, then k_pe's
    block_tables: jax.Array  # [B, W] int32
    rank: int = pytree.static_field(0)

    def append(self, latent: jax.Array, positions: jax.Array) -> QuantizedPagedLatentLayer:
        """New latents [B, T, R + Dr] quantized and written at positions [B, T]."""
        slots = _page_slots(self.block_tables, positions, self.latent.shape[1],
                            self.latent.shape[0])
        codes, scale = quantize_latent(latent, self.rank, self.latent.dtype, self.scale.dtype)
        return self.replace(latent=_scatter_pages(self.latent, slots, codes),
                            scale=_scatter_pages(self.scale, slots, scale))


@pytree.dataclass
class PagedLatentCache:
    """An MLA model's latent page pools (the serving engine's cache for DeepSeek V2 / V3):
    PagedKVCache's pages and tables with LatentCache's per-slot contents."""

    latent: tuple[jax.Array, ...]  # per layer [P, page_size, R + Dr]: values, or codes
    block_tables: jax.Array  # [B, W] int32: the step's rows' pages (0: the null page)
    scale: tuple[jax.Array, ...] = ()  # per layer [P, page_size, 2] when quantized
    rank: int = pytree.static_field(0)  # R (kv_lora_rank)

    @classmethod
    def init(cls, config: Config, num_pages: int, page_size: int, dtype=None,
             kv_dtype: str | None = None, scale_dtype=jnp.float32) -> PagedLatentCache:
        """Zeroed latent pools (page 0, the null page, included), as LatentCache.init."""
        if config.mla is None:
            raise ValueError("PagedLatentCache is the paged cache of MLA models (config.mla)")
        _check_pages("PagedLatentCache", num_pages, page_size)
        kv_dtype = check_kv_dtype(kv_dtype)
        shape = (num_pages, page_size, config.mla.latent_dim)
        dtype = KV_DTYPES[kv_dtype] if kv_dtype else jnp.dtype(dtype or config.dtype)
        scale = ()
        if kv_dtype:
            scale_dtype = _scale_dtype(scale_dtype, "PagedLatentCache")
            scale = tuple(jnp.zeros((*shape[:2], 2), scale_dtype)
                          for _ in range(config.num_layers))
        return cls(latent=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
                   block_tables=jnp.zeros((1, 1), jnp.int32), scale=scale,
                   rank=config.mla.kv_lora_rank)

    quantized = LatentCache.quantized
    nbytes = LatentCache.nbytes

    @property
    def num_pages(self) -> int:
        return self.latent[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.latent[0].shape[1]

    def with_tables(self, block_tables: jax.Array) -> PagedLatentCache:
        return self.replace(block_tables=block_tables)

    def layer(self, i: int) -> PagedLatentLayer | QuantizedPagedLatentLayer:
        if self.quantized:
            return QuantizedPagedLatentLayer(self.latent[i], self.scale[i], self.block_tables,
                                             self.rank)
        return PagedLatentLayer(self.latent[i], self.block_tables)

    def with_layers(self, layers) -> PagedLatentCache:
        new = self.replace(latent=tuple(c.latent for c in layers))
        if self.quantized:
            new = new.replace(scale=tuple(c.scale for c in layers))
        return new
