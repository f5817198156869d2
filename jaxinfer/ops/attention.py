"""`attend`: q/k/v of the fused projection -> RoPE, the cache append, attention.

Dispatch is on the cache type and the query length: one new token per row against a
contiguous cache takes one kernel (pallas_kernels/decode_attention_append.py: it sums the
projection's chunks, applies the deferred norm and RoPE, writes K/V in place and attends);
otherwise the prologue runs in XLA and the attention core is picked by `ATTENTION_CORE`:
flash attention for a fresh prefill, the split-K decode kernel for one token against the
cache, the masked reference for the rest (T > 1 against a cache: speculative verification
and chunked prefill, whose kernels plug in here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from jaxinfer.cache import KVLayer
from jaxinfer.ops import reference
from jaxinfer.ops.dispatch import Registry, always, kernels_on
from jaxinfer.ops.linear import norm
from jaxinfer.ops.stream import Form, Partials, Projection
from jaxinfer.plan import Plan
from pallas_kernels import DecodeBlockSizes

ATTEND = Registry("attend")
ATTENTION_CORE = Registry("attention_core")


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
                    fresh=False, **_) -> str | None:
    b, t, hkv, rows, d = qkv.shape
    if not isinstance(cache, KVLayer) or fresh:
        return "needs a contiguous cache holding the earlier tokens"
    if t != 1:
        return "one new token per row only"
    if not kernels_on(plan, qkv.dtype):
        return "kernels off for these dtypes"
    if q_norm is not None:
        return "q/k norm"
    if rope[0].shape[-1] != d or not (_kernel_head_dim(d) and _kernel_head_dim(d // 2)):
        return f"head dim {d} with rotary dim {rope[0].shape[-1]}"
    return None


@ATTEND.register("decode_append", _fused_supports)
def _decode_append(qkv: Projection, cache, plan, *, positions, rope, window=None, q_norm=None,
                   k_norm=None, fresh=False):
    value = qkv.get(frozenset({Form.ARRAY, Form.PARTIALS, Form.NORMED}))
    norm_stats = None
    if isinstance(value, Partials):
        value, norm_stats = value.parts[:, :, 0], value.norm  # [S, B, Hkv, G + 2, D]
    else:
        value = value[:, 0]  # [B, Hkv, G + 2, D]
    cos, sin = rope
    out, k, v = pk.decode_attention_append(
        value, cache.k, cache.v, positions[:, 0], rope=(cos[:, 0], sin[:, 0]),
        sliding_window=window, norm=norm_stats, interpret=plan.policy.interpret,
        block_sizes=decode_blocks(plan))
    return out[:, None], KVLayer(k, v)  # [B, 1, Hq, D]


@ATTEND.register("prologue_then_core", always)
def _prologue_then_core(qkv: Projection, cache, plan, *, positions, rope, window=None,
                        q_norm=None, k_norm=None, fresh=False):
    """Split q/k/v out of the projection, q/k norm, RoPE, append K/V, then the core."""
    b, t, hkv, rows, d = qkv.shape
    g = rows - 2
    value = qkv.array()  # [B, T, Hkv, G + 2, D]
    q = value[:, :, :, :g].reshape(b, t, hkv * g, d)  # head j*G + i, as HF orders them
    k, v = value[:, :, :, g], value[:, :, :, g + 1]  # [B, T, Hkv, D]
    if q_norm is not None:
        eps = plan.config.rms_norm_eps
        if plan.policy.batch_invariant:  # the Pallas kernel: per-row arithmetic fixed
            q, k = norm(q, q_norm, eps, plan), norm(k, k_norm, eps, plan)
        else:
            q, k = reference.rms_norm(q, q_norm, eps), reference.rms_norm(k, k_norm, eps)
    q = reference.apply_rope(q, *rope)  # [B, T, Hq, D]
    k = reference.apply_rope(k, *rope)  # [B, T, Hkv, D]
    if cache is not None:
        cache = cache.append(k, v, positions)
    return ATTENTION_CORE(q, k, v, cache, plan, positions=positions, window=window,
                          fresh=fresh), cache


def _flash_supports(q, k, v, cache, plan, *, fresh=False, **_) -> str | None:
    if cache is not None and not fresh:
        return "the queries attend to earlier cache slots"
    if not kernels_on(plan, q.dtype) or not _kernel_head_dim(q.shape[-1]):
        return "kernels off, or a head dim the kernel lacks"
    return None


@ATTENTION_CORE.register("flash", _flash_supports)
def _flash(q, k, v, cache, plan, *, positions, window=None, fresh=False):
    """Causal attention among the T new tokens at positions 0..T-1 (never materializes the
    [T, T] scores)."""
    return pk.flash_attention(q, k, v, causal=True, sliding_window=window,
                              backend=plan.policy.flash.value, interpret=plan.policy.interpret)


def _decode_supports(q, k, v, cache, plan, *, fresh=False, **_) -> str | None:
    if not isinstance(cache, KVLayer) or fresh or q.shape[1] != 1:
        return "one token per row against a contiguous cache only"
    if not kernels_on(plan, q.dtype) or not _kernel_head_dim(q.shape[-1]):
        return "kernels off, or a head dim the kernel lacks"
    return None


@ATTENTION_CORE.register("decode", _decode_supports)
def _decode(q, k, v, cache, plan, *, positions, window=None, fresh=False):
    """The split-K decode kernel over the valid cache slots."""
    out = pk.decode_attention(q[:, 0], cache.k, cache.v, positions[:, 0] + 1,
                              sliding_window=window, interpret=plan.policy.interpret,
                              block_sizes=decode_blocks(plan))
    return out[:, None]  # [B, 1, Hq, D]


@ATTENTION_CORE.register("reference", always)
def _reference(q, k, v, cache, plan, *, positions, window=None, fresh=False):
    if cache is None or fresh:
        return reference.attention_reference(q, k, v, positions, positions, window=window)
    s = cache.k.shape[1]
    kv_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), cache.k.shape[:2])  # slot i = position i
    return reference.attention_reference(q, cache.k, cache.v, positions, kv_pos, window=window)


def attend(qkv: Projection, cache, plan: Plan, *, positions: jax.Array, rope, window=None,
           q_norm=None, k_norm=None, fresh: bool = False):
    """Attention of the new tokens -> (out [B, T, Hq, hd], the layer's cache with their K/V).

    qkv: the projection [B, T, Hkv, G + 2, hd] (per KV head its G query heads, its key, its
    value); positions [B, T] int32; rope (cos, sin) [B, T, R]; window: a sliding window or
    None; q_norm, k_norm [hd]: q/k RMSNorm before RoPE (Qwen3). cache: the layer's cache or
    None (the T tokens attend among themselves at positions 0..T-1); fresh: the cache held
    nothing before them (a prefill from position 0)."""
    return ATTEND(qkv, cache, plan, positions=positions, rope=rope, window=window,
                  q_norm=q_norm, k_norm=k_norm, fresh=fresh)
