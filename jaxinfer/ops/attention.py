"""`attend`: q/k/v of the fused projection -> RoPE, the cache append, attention.

Dispatch is on the cache type and the query length: one new token per row against a
contiguous cache takes one kernel (pallas_kernels/decode_attention_append.py: it sums the
projection's chunks, applies the deferred norm and RoPE, writes K/V in place and attends);
otherwise the prologue runs in XLA and the attention core is picked by `ATTENTION_CORE`:
flash attention for a fresh prefill, the split-K decode kernel for one token against the
cache, the masked reference for the rest (T > 1 against a cache: speculative verification
and chunked prefill, whose kernels plug in here).

A quantized cache (`QuantizedKVLayer`: int8 / fp8 codes and scales) takes the same kernels'
quantized forms, which read the codes and dequantize in registers, and for T > 1 against it
the chunk-attention kernel; the new K/V are quantized as they are written (by the fused
kernel, or by the layer's append). A fresh prefill attends with its unquantized K/V and only
writes the codes; the reference dequantizes the cache to float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from jaxinfer.cache import KVLayer, PagedKVLayer, QuantizedKVLayer, QuantizedPagedKVLayer
from jaxinfer.ops import reference
from jaxinfer.ops.dispatch import Layout, Registry, always, kernels_on
from jaxinfer.ops.linear import norm
from jaxinfer.ops.stream import Form, Partials, Projection
from jaxinfer.plan import Plan
from jaxinfer.sharding import kv_spec
from pallas_kernels import DecodeBlockSizes, dequantize_kv


def _core_layout(sharding, q, k, v, cache, plan, *, positions, **_):
    """By heads over tp (whole GQA groups per device: the rules shard q_heads and kv_heads
    together or neither) and rows over dp: q [B, T, Hq, D], k / v [B, T, Hkv, D], the cache
    layer's [B, S, Hkv, (D)] arrays, positions [B, T]; no collective."""
    q_spec = sharding.spec(("batch", None, "q_heads", None), q.shape)
    kv = sharding.spec(("batch", None, "kv_heads", None), k.shape)
    inputs = {0: q_spec, 1: kv, 2: kv, "positions": sharding.spec(("batch", None),
                                                                  positions.shape)}
    if cache is not None:
        inputs[3] = jax.tree.map(lambda a: kv_spec(a.shape, sharding), cache)
    return Layout(inputs, q_spec)


# The fused decode kernel reads the projection's split-K chunks: no per-shard layout yet, so on
# a sharded plan attend takes the prologue and the core (which has one).
ATTEND = Registry("attend")
ATTENTION_CORE = Registry("attention_core", layout=_core_layout)


def _kernel_head_dim(d: int) -> bool:
    return 16 <= d <= 256 and d & (d - 1) == 0  # the Triton attention kernels' tiles


def decode_blocks(plan: Plan) -> DecodeBlockSizes | None:
    """The decode attention kernels' block sizes: the policy's override; with batch_invariant,
    fixed-size key chunks (split_keys), whatever the batch; None: the kernel's choice."""
    policy = plan.policy
    if policy.attention_blocks is not None:
        return policy.attention_blocks
    if policy.batch_invariant:
        chunk = policy.attention_chunk
        return DecodeBlockSizes(block_k=min(128, chunk), num_stages=3, split_keys=chunk)
    return None


def _fused_supports(qkv: Projection, cache, plan, *, positions, rope, q_norm=None,
                    fresh=False, layer_type=KVLayer, **_) -> str | None:
    b, t, hkv, rows, d = qkv.shape
    if not isinstance(cache, layer_type) or fresh:
        return f"needs a {layer_type.__name__} holding the earlier tokens"
    if t != 1:
        return "one new token per row only"
    if plan.policy.batch_invariant and _as_pages_supports(None, None, None, cache, plan) is None:
        return "batch_invariant: the paged chunk kernel serves every T (one arithmetic)"
    if not kernels_on(plan, qkv.dtype):
        return "kernels off for these dtypes"
    if q_norm is not None:
        return "q/k norm"
    if rope[0].shape[-1] != d or not (_kernel_head_dim(d) and _kernel_head_dim(d // 2)):
        return f"head dim {d} with rotary dim {rope[0].shape[-1]}"
    return None


def _one_token(qkv: Projection):
    """The fused kernels' view of a one-token projection: (value [B, Hkv, G + 2, D], None), or
    its split-K chunks [S, B, Hkv, G + 2, D] with their deferred norm's statistics."""
    value = qkv.get(frozenset({Form.ARRAY, Form.PARTIALS, Form.NORMED}))
    if isinstance(value, Partials):
        return value.parts[:, :, 0], value.norm
    return value[:, 0], None


def _decode_append(qkv: Projection, cache, plan, *, positions, rope, window=None, q_norm=None,
                   k_norm=None, fresh=False, sm_scale=None, softcap=None):
    value, norm_stats = _one_token(qkv)
    cos, sin = rope
    quantized = {}
    if isinstance(cache, QuantizedKVLayer):  # codes and scales, quantized as written
        quantized = {"k_scale": cache.k_scale, "v_scale": cache.v_scale, "dtype": qkv.dtype}
    out, *layer = pk.decode_attention_append(
        value, cache.k, cache.v, positions[:, 0], rope=(cos[:, 0], sin[:, 0]),
        sliding_window=window, norm=norm_stats, interpret=plan.policy.interpret,
        block_sizes=decode_blocks(plan), sm_scale=sm_scale, softcap=softcap, **quantized)
    return out[:, None], type(cache)(*layer)  # [B, 1, Hq, D]


def _paged_fused_supports(qkv: Projection, cache, plan, **kw) -> str | None:
    if plan.policy.batch_invariant:
        return "batch_invariant: the paged chunk kernel serves every T (one arithmetic)"
    return _fused_supports(qkv, cache, plan, **kw)


def _paged_decode_append(qkv: Projection, cache, plan, *, positions, rope, window=None,
                         q_norm=None, k_norm=None, fresh=False, sm_scale=None, softcap=None):
    """_decode_append through the rows' block tables (padding rows: position -1, no write)."""
    value, norm_stats = _one_token(qkv)
    cos, sin = rope
    quantized = {}
    if isinstance(cache, QuantizedPagedKVLayer):
        quantized = {"k_scale": cache.k_scale, "v_scale": cache.v_scale, "dtype": qkv.dtype}
    out, *pools = pk.paged_decode_attention_append(
        value, cache.k, cache.v, cache.block_tables, positions[:, 0],
        rope=(cos[:, 0], sin[:, 0]), sliding_window=window, norm=norm_stats,
        interpret=plan.policy.interpret, block_sizes=plan.policy.attention_blocks,
        sm_scale=sm_scale, softcap=softcap, **quantized)
    return out[:, None], type(cache)(*pools, cache.block_tables)  # [B, 1, Hq, D]


ATTEND.register("decode_append", _fused_supports, kernel=True)(_decode_append)
ATTEND.register("paged_decode_append", functools.partial(
    _paged_fused_supports, layer_type=PagedKVLayer), kernel=True)(_paged_decode_append)
ATTEND.register("paged_decode_append_quantized", functools.partial(
    _paged_fused_supports, layer_type=QuantizedPagedKVLayer), kernel=True)(_paged_decode_append)
ATTEND.register("decode_append_quantized", functools.partial(
    _fused_supports, layer_type=QuantizedKVLayer), kernel=True)(_decode_append)


@ATTEND.register("prologue_then_core", always)
def _prologue_then_core(qkv: Projection, cache, plan, *, positions, rope, window=None,
                        q_norm=None, k_norm=None, fresh=False, sm_scale=None, softcap=None):
    """Split q/k/v out of the projection, q/k norm, RoPE, append K/V, then the core."""
    b, t, hkv, rows, d = qkv.shape
    g = rows - 2
    value = qkv.array()  # [B, T, Hkv, G + 2, D]
    q = value[:, :, :, :g].reshape(b, t, hkv * g, d)  # head j*G + i, as HF orders them
    k, v = value[:, :, :, g], value[:, :, :, g + 1]  # [B, T, Hkv, D]
    if q_norm is not None:
        eps = plan.config.rms_norm_eps
        offset = plan.config.norm_offset  # Gemma 3's q/k norms scale by 1 + w
        if plan.policy.batch_invariant:  # the Pallas kernel: per-row arithmetic fixed
            q, k = norm(q, q_norm, eps, plan), norm(k, k_norm, eps, plan)
        else:
            q = reference.rms_norm(q, q_norm, eps, offset)
            k = reference.rms_norm(k, k_norm, eps, offset)
    q = reference.apply_rope(q, *rope)  # [B, T, Hq, D]
    k = reference.apply_rope(k, *rope)  # [B, T, Hkv, D]
    if cache is not None:
        cache = cache.append(k, v, positions)
    return ATTENTION_CORE(q, k, v, cache, plan, positions=positions, window=window,
                          fresh=fresh, sm_scale=sm_scale, softcap=softcap), cache


# Under batch_invariant a contiguous cache is read as pages by the paged chunk kernel, for every
# T and for a fresh prefill too: the engine's arithmetic, so generate() and the engine give
# the same bits for a request (the engine's default page size on a GPU, 64 positions).
AS_PAGES = 64


def _as_pages_supports(q, k, v, cache, plan, **_) -> str | None:
    if not plan.policy.batch_invariant:
        return "batch_invariant only (the contiguous kernels are faster)"
    if not isinstance(cache, KVLayer | QuantizedKVLayer):
        return "a contiguous cache only"
    if cache.k.shape[1] % AS_PAGES:
        return f"a cache of {cache.k.shape[1]} slots is not whole pages of {AS_PAGES}"
    dtype = q.dtype if q is not None else cache.k.dtype
    if not kernels_on(plan, dtype) or not _kernel_head_dim(cache.k.shape[-1]):
        return "kernels off, or a head dim the kernel lacks"
    return None


@ATTENTION_CORE.register("contiguous_as_pages", _as_pages_supports, kernel=True)
def _as_pages(q, k, v, cache, plan, *, positions, window=None, fresh=False, sm_scale=None,
              softcap=None):
    """The cache rows [B, S, Hkv, D] seen as B * S / 64 pages of 64 slots (a free reshape),
    row b's table b * S / 64 + j, through the paged chunk kernel."""
    b, s = cache.k.shape[:2]
    per_row = s // AS_PAGES

    def pages(a):  # [B, S, ...] -> [B * S / 64, 64, ...]
        return a.reshape(b * per_row, AS_PAGES, *a.shape[2:])
    tables = jnp.arange(b * per_row, dtype=jnp.int32).reshape(b, per_row)
    scales = {name: pages(a) for name, a in _scales(cache).items()}
    return pk.paged_chunk_attention(q, pages(cache.k), pages(cache.v), tables, positions,
                                    sliding_window=window, sm_scale=sm_scale, softcap=softcap,
                                    interpret=plan.policy.interpret, **scales)


def _flash_supports(q, k, v, cache, plan, *, fresh=False, **_) -> str | None:
    if cache is not None and not fresh:
        return "the queries attend to earlier cache slots"
    if not kernels_on(plan, q.dtype) or not _kernel_head_dim(q.shape[-1]):
        return "kernels off, or a head dim the kernel lacks"
    return None


@ATTENTION_CORE.register("flash", _flash_supports, kernel=True)
def _flash(q, k, v, cache, plan, *, positions, window=None, fresh=False, sm_scale=None,
           softcap=None):
    """Causal attention among the T new tokens at positions 0..T-1 (never materializes the
    [T, T] scores)."""
    return pk.flash_attention(q, k, v, causal=True, sliding_window=window, sm_scale=sm_scale,
                              softcap=softcap, backend=plan.policy.flash.value,
                              interpret=plan.policy.interpret)


def _decode_supports(q, k, v, cache, plan, *, fresh=False, layer_type=KVLayer,
                     **_) -> str | None:
    if not isinstance(cache, layer_type) or fresh or q.shape[1] != 1:
        return f"one token per row against a {layer_type.__name__} only"
    if not kernels_on(plan, q.dtype) or not _kernel_head_dim(q.shape[-1]):
        return "kernels off, or a head dim the kernel lacks"
    return None


def _scales(cache) -> dict:
    """A quantized layer's scales as the kernels take them; none for a KVLayer."""
    if isinstance(cache, QuantizedKVLayer | QuantizedPagedKVLayer):
        return {"k_scale": cache.k_scale, "v_scale": cache.v_scale}
    return {}


def _decode(q, k, v, cache, plan, *, positions, window=None, fresh=False, sm_scale=None,
            softcap=None):
    """The split-K decode kernel over the valid cache slots."""
    out = pk.decode_attention(q[:, 0], cache.k, cache.v, positions[:, 0] + 1,
                              sliding_window=window, interpret=plan.policy.interpret,
                              block_sizes=decode_blocks(plan), sm_scale=sm_scale,
                              softcap=softcap, **_scales(cache))
    return out[:, None]  # [B, 1, Hq, D]


ATTENTION_CORE.register("decode", _decode_supports, kernel=True)(_decode)
ATTENTION_CORE.register("decode_quantized", functools.partial(
    _decode_supports, layer_type=QuantizedKVLayer), kernel=True)(_decode)


def _chunk_supports(q, k, v, cache, plan, *, fresh=False, layer_type=QuantizedKVLayer,
                    **_) -> str | None:
    if not isinstance(cache, layer_type) or fresh:
        return f"T queries against the earlier tokens of a {layer_type.__name__} only"
    if not kernels_on(plan, q.dtype) or not _kernel_head_dim(q.shape[-1]):
        return "kernels off, or a head dim the kernel lacks"
    return None


def _chunk(q, k, v, cache, plan, *, positions, window=None, fresh=False, sm_scale=None,
           softcap=None):
    """T queries at their positions against the cache (values or codes): a chunked prefill,
    a speculative verification (the last token and K drafts, causal among themselves)."""
    return pk.chunk_attention(q, cache.k, cache.v, positions, sliding_window=window,
                              sm_scale=sm_scale, softcap=softcap,
                              interpret=plan.policy.interpret, **_scales(cache))


def _verify_supports(q, k, v, cache, plan, *, fresh=False, **_) -> str | None:
    if not isinstance(cache, KVLayer | QuantizedKVLayer) or fresh:
        return "T queries against the earlier tokens of a contiguous cache only"
    if not 1 < q.shape[1] <= plan.policy.verify_queries:
        return f"2..{plan.policy.verify_queries} queries per row (KernelPolicy.verify_queries)"
    if not kernels_on(plan, q.dtype) or not _kernel_head_dim(q.shape[-1]):
        return "kernels off, or a head dim the kernel lacks"
    return None


@ATTENTION_CORE.register("verify", _verify_supports, kernel=True)
def _verify(q, k, v, cache, plan, *, positions, window=None, fresh=False, sm_scale=None,
            softcap=None):
    """A few queries per row (the last token and K drafts) against a long cache, split over
    the keys as the decode kernel is."""
    return pk.verify_attention(q, cache.k, cache.v, positions, sliding_window=window,
                               sm_scale=sm_scale, softcap=softcap,
                               interpret=plan.policy.interpret,
                               block_sizes=decode_blocks(plan), **_scales(cache))


ATTENTION_CORE.register("chunk_quantized", _chunk_supports, kernel=True)(_chunk)
# Registered after "decode" and "verify": T = 1 keeps the split-K decode kernel, a few
# queries take verify_attention, more come here.
ATTENTION_CORE.register("chunk", functools.partial(_chunk_supports, layer_type=KVLayer),
                        kernel=True)(_chunk)


def _paged_supports(q, k, v, cache, plan, **_) -> str | None:
    return None if isinstance(cache, PagedKVLayer | QuantizedPagedKVLayer) else "a paged cache only"


def _paged_chunk_supports(q, k, v, cache, plan, **_) -> str | None:
    if isinstance(why := _paged_supports(q, k, v, cache, plan), str):
        return why
    if not kernels_on(plan, q.dtype) or not _kernel_head_dim(q.shape[-1]):
        return "kernels off, or a head dim the kernel lacks"
    if cache.page_size % 16:
        return f"page_size {cache.page_size}: the kernel's key tiles need a multiple of 16"
    return None


def _paged_decode_supports(q, k, v, cache, plan, **_) -> str | None:
    if isinstance(why := _paged_chunk_supports(q, k, v, cache, plan), str):
        return why
    if q.shape[1] != 1 or plan.policy.batch_invariant:
        return "one token per row (not under batch_invariant: the chunk kernel serves all T)"
    return None


@ATTENTION_CORE.register("paged_decode", _paged_decode_supports, kernel=True)
def _paged_decode(q, k, v, cache, plan, *, positions, window=None, fresh=False, sm_scale=None,
                  softcap=None):
    """The split-K decode kernel through the rows' block tables (padding rows: length 0)."""
    out = pk.paged_decode_attention(q[:, 0], cache.k, cache.v, cache.block_tables,
                                    jnp.maximum(positions[:, 0] + 1, 0), sliding_window=window,
                                    interpret=plan.policy.interpret,
                                    block_sizes=plan.policy.attention_blocks, sm_scale=sm_scale,
                                    softcap=softcap, **_scales(cache))
    return out[:, None]  # [B, 1, Hq, D]


def _paged_verify_supports(q, k, v, cache, plan, **_) -> str | None:
    if isinstance(why := _paged_chunk_supports(q, k, v, cache, plan), str):
        return why
    if not 1 < q.shape[1] <= plan.policy.verify_queries:
        return f"2..{plan.policy.verify_queries} queries per row (KernelPolicy.verify_queries)"
    if plan.policy.batch_invariant:
        return "batch_invariant: the paged chunk kernel serves every T (one arithmetic)"
    return None


@ATTENTION_CORE.register("paged_verify", _paged_verify_supports, kernel=True)
def _paged_verify(q, k, v, cache, plan, *, positions, window=None, fresh=False, sm_scale=None,
                  softcap=None):
    """A few queries per row (the engine's verification) through the rows' block tables,
    split over the keys (padding queries: position -1, zeros)."""
    return pk.paged_verify_attention(q, cache.k, cache.v, cache.block_tables, positions,
                                     sliding_window=window, sm_scale=sm_scale, softcap=softcap,
                                     interpret=plan.policy.interpret,
                                     block_sizes=plan.policy.attention_blocks,
                                     **_scales(cache))


@ATTENTION_CORE.register("paged_chunk", _paged_chunk_supports, kernel=True)
def _paged_chunk(q, k, v, cache, plan, *, positions, window=None, fresh=False, sm_scale=None,
                 softcap=None):
    """T queries per row at their positions (negative: padding) against the rows' pages: a
    prefill chunk, a prefix-cache hit's suffix; under batch_invariant also the decode step
    (one kernel whatever T, so a token's bits do not depend on how it was batched)."""
    return pk.paged_chunk_attention(q, cache.k, cache.v, cache.block_tables, positions,
                                    sliding_window=window, sm_scale=sm_scale, softcap=softcap,
                                    interpret=plan.policy.interpret, **_scales(cache))


@ATTENTION_CORE.register("paged_reference", _paged_supports)
def _paged_reference(q, k, v, cache, plan, *, positions, window=None, fresh=False, sm_scale=None,
                     softcap=None):
    """T queries at positions [B, T] (negative: padding, zeros out) against the rows' pages
    gathered end to end (float32 from a quantized pool)."""
    k_all, v_all = cache.contiguous()  # [B, W * page_size, Hkv, D], slot i = position i
    kv_pos = jnp.broadcast_to(jnp.arange(k_all.shape[1], dtype=jnp.int32), k_all.shape[:2])
    return reference.attention_reference(q, k_all, v_all, positions, kv_pos, window=window,
                                         sm_scale=sm_scale, softcap=softcap)


@ATTENTION_CORE.register("reference", always)
def _reference(q, k, v, cache, plan, *, positions, window=None, fresh=False, sm_scale=None,
               softcap=None):
    if cache is None or fresh:
        return reference.attention_reference(q, k, v, positions, positions, window=window,
                                             sm_scale=sm_scale, softcap=softcap)
    s = cache.k.shape[1]
    kv_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), cache.k.shape[:2])  # slot i = position i
    k_all, v_all = cache.k, cache.v
    if isinstance(cache, QuantizedKVLayer):  # float32, for any activation dtype
        k_all, v_all = dequantize_kv(k_all, cache.k_scale), dequantize_kv(v_all, cache.v_scale)
    return reference.attention_reference(q, k_all, v_all, positions, kv_pos, window=window,
                                         sm_scale=sm_scale, softcap=softcap)


def attend(qkv: Projection, cache, plan: Plan, *, positions: jax.Array, rope, window=None,
           q_norm=None, k_norm=None, fresh: bool = False, sm_scale: float | None = None,
           softcap: float | None = None):
    """Attention of the new tokens -> (out [B, T, Hq, hd], the layer's cache with their K/V).

    qkv: the projection [B, T, Hkv, G + 2, hd] (per KV head its G query heads, its key, its
    value); positions [B, T] int32; rope (cos, sin) [B, T, R]; window: a sliding window or
    None; q_norm, k_norm [hd]: q/k RMSNorm before RoPE (Qwen3). cache: the layer's cache or
    None (the T tokens attend among themselves at positions 0..T-1); fresh: the cache held
    nothing before them (a prefill from position 0). sm_scale: the softmax scale (None:
    hd ** -0.5); softcap: scores = softcap * tanh(scores / softcap) before the mask (Gemma 2)."""
    return ATTEND(qkv, cache, plan, positions=positions, rope=rope, window=window,
                  q_norm=q_norm, k_norm=k_norm, fresh=fresh, sm_scale=sm_scale,
                  softcap=softcap)
