"""`mla_attend`: multi-head latent attention (DeepSeek-V2 / V3) and its latent cache.

    mla_attend(q, kv_a, cache, plan, *, positions, rope, kv_norm, w_kv_b)
        -> (out [B, T, H, Dv], the layer's cache with the new tokens' latents)
    MLA_CORE(q, latent, lengths, plan, *, sm_scale, kv_lora_rank, latent_scale=None)
        the absorbed core: pallas_kernels.mla_decode_attention (the kernel) or its reference
    MLA_PAGED_CORE(q, pages, block_tables, positions, plan, *, sm_scale, kv_lora_rank, ...)
        the same over the engine's latent pages (pallas_kernels.paged_mla_attention)
    softmax_scale(config)                                qk_head_dim^-0.5, YaRN's mscale^2 in

Per token, kv_a = [c_kv (R), k_pe (Dr)] (kv_a_proj_with_mqa's output): c_kv is RMS-normed, k_pe
roped once (one RoPE key shared by all heads); the cache keeps their concatenation, the latent.
kv_b_proj, w_kv_b [R, H, Dn + Dv], expands c_kv per head into W_UK (its first Dn columns: the
non-rotary key) and W_UV (the value).

Dispatch (MLA_ATTEND) is on the cache and whether it held earlier tokens:
- "expanded" (no cache, or a fresh prefill): K/V rebuilt per head from the new tokens' latents
  and ordinary causal attention (MLA_PREFILL: flash attention with q/k/v zero-padded to a
  power-of-two head dim, 192 / 128 -> 256 for DeepSeek's shapes, when the kernels are on;
  otherwise the masked reference, which takes Dqk != Dv as it is);
- "absorbed" (T >= 1 new tokens against the cache): q_nope @ W_UK^T is the latent query,
  concatenated with the roped q_pe; attention over the latent itself (MLA_CORE: the Pallas
  kernel where the kernels are on and its tiles fit, else its reference), the latent output
  times W_UV.
  K/V are never rebuilt, and the cache is read once for all heads.

A quantized cache (`QuantizedLatentLayer`: int8 / fp8 codes, per token a scale for c_kv and one
for k_pe) quantizes the new latents as they are written (its append); the absorbed core reads
the codes (the kernel dequantizes in registers, the reference to float32 first). A fresh
prefill attends with the float latents it just computed, not the written codes, as the other
families' prefill does with its K/V: nothing to dequantize, and no quantization error in the
prompt's own attention; the decode steps after it see the codes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxinfer.cache import (LatentLayer, PagedLatentLayer, QuantizedLatentLayer,
                            QuantizedPagedLatentLayer)
from jaxinfer.configs import Config
from jaxinfer.ops import reference
from jaxinfer.ops.dispatch import Layout, Registry, always, kernels_on
from jaxinfer.plan import Plan
from jaxinfer.sharding import latent_spec
from jaxinfer.weights import as_array


def _core_layout(sharding, q, latent, lengths, plan, *, latent_scale=None, **_):
    """The heads over tp, the latent whole on every device of a row's dp group: q
    [B, T, H, R + Dr], latent [B, S, R + Dr] (and its scales [B, S, 2]), lengths [B]
    -> [B, T, H, R]; no collective."""
    q_spec = sharding.spec(("batch", None, "q_heads", None), q.shape)
    inputs = {0: q_spec, 1: latent_spec(latent.shape, sharding),
              2: sharding.spec(("batch",), lengths.shape)}
    if latent_scale is not None:
        inputs["latent_scale"] = latent_spec(latent_scale.shape, sharding)
    return Layout(inputs, q_spec)


def _prefill_layout(sharding, q, k, v, plan, *, positions, **_):
    """Expanded attention by heads: q, k, v [B, T, H, D], positions [B, T]."""
    q_spec = sharding.spec(("batch", None, "q_heads", None), q.shape)
    return Layout({0: q_spec, 1: q_spec, 2: q_spec,
                   "positions": sharding.spec(("batch", None), positions.shape)}, q_spec)


MLA_ATTEND = Registry("mla_attend")
MLA_PREFILL = Registry("mla_prefill", layout=_prefill_layout)
MLA_CORE = Registry("mla_core", layout=_core_layout)
# The engine's paged latent (one device: no layout, so the kernel never runs sharded).
MLA_PAGED_CORE = Registry("mla_paged_core")


def softmax_scale(config: Config) -> float:
    """transformers' DeepSeek softmax scale: qk_head_dim^-0.5, times mscale(factor,
    mscale_all_dim)^2 when the rope scaling (any type but default) has mscale_all_dim: YaRN's
    correction of the attention temperature, which the cos/sin factor alone does not carry."""
    scale = config.mla.qk_head_dim ** -0.5
    rs = config.rope_scaling
    if rs.kind != "default" and rs.mscale_all_dim:
        m = 1.0 if rs.factor <= 1 else 0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1.0
        scale *= m * m
    return scale


def apply_rope_pairs(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE on interleaved pairs: dims (2i, 2i + 1) of x [B, T, H, Dr] rotate by frequency i
    (cos/sin [B, T, Dr] hold [freqs, freqs], as rope_tables makes them), in float32.

    The result is de-interleaved ([even outputs, odd outputs], transformers' DeepSeek-V3
    layout; its V2 writes the pairs back interleaved). q_pe and k_pe take the same layout, so
    their dot products, the only thing attention reads of them, are the same either way."""
    half = x.shape[-1] // 2
    c, s = cos[:, :, None, :half], sin[:, :, None, :half]  # [B, T, 1, Dr / 2]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def _rope(x, rope, interleave: bool):
    return apply_rope_pairs(x, *rope) if interleave else reference.apply_rope(x, *rope)


# ---------------------------------------------------------------------------------------------
# The absorbed core: attention of latent queries over the latent cache
# ---------------------------------------------------------------------------------------------


def _kernel_supports(q, latent, lengths, plan, *, sm_scale, kv_lora_rank,
                     latent_scale=None) -> str | None:
    if not kernels_on(plan, q.dtype):
        return "kernels off for these dtypes"
    dims = (kv_lora_rank, latent.shape[-1] - kv_lora_rank)
    if not all(16 <= d <= 1024 and d & (d - 1) == 0 for d in dims):
        return f"latent rank / RoPE dims {dims} are not powers of two in 16..1024 (kernel tiles)"
    return None


@MLA_CORE.register("pallas", _kernel_supports, kernel=True)
def _kernel_core(q, latent, lengths, plan, *, sm_scale, kv_lora_rank, latent_scale=None):
    import pallas_kernels as pk

    return pk.mla_decode_attention(q, latent, lengths, sm_scale=sm_scale,
                                   rope_dim=latent.shape[-1] - kv_lora_rank,
                                   latent_scale=latent_scale,
                                   block_sizes=plan.policy.mla_blocks,
                                   interpret=plan.policy.interpret)


@MLA_CORE.register("reference", always)
def _reference_core(q, latent, lengths, plan, *, sm_scale, kv_lora_rank, latent_scale=None):
    import pallas_kernels as pk

    return pk.mla_decode_attention_reference(q, latent, lengths, sm_scale=sm_scale,
                                             rope_dim=latent.shape[-1] - kv_lora_rank,
                                             latent_scale=latent_scale)


def _paged_kernel_supports(q, pages, block_tables, positions, plan, *, sm_scale,
                           kv_lora_rank, latent_scale=None) -> str | None:
    if pages.shape[1] < 16:
        return f"page_size {pages.shape[1]}: the kernel's tiles are >= 16 slots of one page"
    return _kernel_supports(q, pages, None, plan, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank)


@MLA_PAGED_CORE.register("pallas", _paged_kernel_supports, kernel=True)
def _paged_kernel_core(q, pages, block_tables, positions, plan, *, sm_scale, kv_lora_rank,
                       latent_scale=None):
    import pallas_kernels as pk

    return pk.paged_mla_attention(q, pages, block_tables, positions, sm_scale=sm_scale,
                                  rope_dim=pages.shape[-1] - kv_lora_rank,
                                  latent_scale=latent_scale, block_sizes=plan.policy.mla_blocks,
                                  interpret=plan.policy.interpret)


@MLA_PAGED_CORE.register("reference", always)
def _paged_reference_core(q, pages, block_tables, positions, plan, *, sm_scale, kv_lora_rank,
                          latent_scale=None):
    import pallas_kernels as pk

    return pk.paged_mla_attention_reference(q, pages, block_tables, positions,
                                            sm_scale=sm_scale,
                                            rope_dim=pages.shape[-1] - kv_lora_rank,
                                            latent_scale=latent_scale)


# ---------------------------------------------------------------------------------------------
# Expanded attention: K/V per head (prefill)
# ---------------------------------------------------------------------------------------------


def attention_reference(q, k, v, q_pos, kv_pos, *, sm_scale: float):
    """Masked causal attention whose value head dim may differ from the query/key one: q
    [B, T, H, Dqk], k [B, S, H, Dqk], v [B, S, H, Dv]; a key is visible when kv_pos <= q_pos.
    Softmax in float32, probabilities cast to v's dtype (transformers' eager path).
    -> [B, T, H, Dv] in q's dtype."""
    s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * sm_scale
    visible = kv_pos[:, None, :] <= q_pos[:, :, None]  # [B, T, S]
    s = jnp.where(visible[:, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    o = jnp.einsum("bhts,bshd->bthd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.astype(q.dtype)


def _padded_dim(q, v) -> int:
    d = max(q.shape[-1], v.shape[-1])
    return max(16, 1 << (d - 1).bit_length())


def _flash_supports(q, k, v, plan, *, positions, sm_scale) -> str | None:
    if not kernels_on(plan, q.dtype):
        return "kernels off for these dtypes"
    if _padded_dim(q, v) > 256:
        return f"head dims {q.shape[-1]} / {v.shape[-1]} pad past the kernel's 256"
    return None


@MLA_PREFILL.register("flash_padded", _flash_supports, kernel=True)
def _flash_padded(q, k, v, plan, *, positions, sm_scale):
    """Flash attention among the T new tokens (positions 0..T-1) with q, k and v zero-padded
    to one power-of-two head dim: zero q/k columns add nothing to the scores, and the padded
    value columns are sliced off."""
    import pallas_kernels as pk

    d = _padded_dim(q, v)

    def pad(x):
        return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, d - x.shape[-1])))
    out = pk.flash_attention(pad(q), pad(k), pad(v), causal=True, sm_scale=sm_scale,
                             backend=plan.policy.flash.value, interpret=plan.policy.interpret)
    return out[..., :v.shape[-1]]


MLA_PREFILL.register("reference", always)(
    lambda q, k, v, plan, *, positions, sm_scale: attention_reference(
        q, k, v, positions, positions, sm_scale=sm_scale))


def _split_w_kv_b(w_kv_b, dn: int, dtype):
    w = as_array(w_kv_b, dtype)  # [R, H, Dn + Dv]
    return w[..., :dn], w[..., dn:]  # W_UK [R, H, Dn], W_UV [R, H, Dv]


def _expanded_supports(q, latent, cache, plan, *, fresh=False, **_) -> str | None:
    return None if cache is None or fresh else "the queries attend to earlier cache slots"


@MLA_ATTEND.register("expanded", _expanded_supports)
def _expanded(q, latent, cache, plan, *, positions, w_kv_b, fresh=False):
    """K/V rebuilt per head from latents, then ordinary attention: the new tokens' own (no
    cache, or a fresh prefill), or with a cache holding earlier tokens the whole cache's (the
    non-absorbed form the absorbed one is tested against)."""
    mla = plan.config.mla
    r, dn = mla.kv_lora_rank, mla.qk_nope_head_dim
    sm_scale = softmax_scale(plan.config)
    w_uk, w_uv = _split_w_kv_b(w_kv_b, dn, q.dtype)
    if cache is not None and not fresh:
        s = cache.latent.shape[1]
        kv_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), cache.latent.shape[:2])
        # [B, S, R + Dr] (float32 from a quantized cache), slot i = position i
        latent, k_positions = cache.values(), kv_pos
    else:
        k_positions = positions
    c_kv, k_pe = latent[..., :r], latent[..., r:]
    k_nope = jnp.einsum("bsr,rhn->bshn", c_kv, w_uk,
                        preferred_element_type=jnp.float32).astype(q.dtype)
    v = jnp.einsum("bsr,rhv->bshv", c_kv, w_uv, preferred_element_type=jnp.float32).astype(q.dtype)
    k_pe = jnp.broadcast_to(k_pe[:, :, None, :], (*k_nope.shape[:3], k_pe.shape[-1]))
    k = jnp.concatenate([k_nope, k_pe.astype(q.dtype)], axis=-1)  # [B, S, H, Dn + Dr]
    if cache is not None and not fresh:
        return attention_reference(q, k, v, positions, k_positions, sm_scale=sm_scale)
    return MLA_PREFILL(q, k, v, plan, positions=positions, sm_scale=sm_scale)


_LATENT_LAYERS = LatentLayer | QuantizedLatentLayer
_PAGED_LAYERS = PagedLatentLayer | QuantizedPagedLatentLayer


@MLA_ATTEND.register("absorbed", lambda q, latent, cache, plan, **_: None
                     if isinstance(cache, _LATENT_LAYERS | _PAGED_LAYERS)
                     else "needs a (paged) LatentLayer or QuantizedLatentLayer")
def _absorbed(q, latent, cache, plan, *, positions, w_kv_b, fresh=False):
    """W_UK folded into the query, attention over the latent cache, W_UV after it. A
    contiguous cache's T new tokens are consecutive per row (the decode step, a chunk of a
    prefill); a paged cache's queries each see the slots through their own position (the
    engine's rows: padding queries at -1)."""
    mla = plan.config.mla
    r, dn = mla.kv_lora_rank, mla.qk_nope_head_dim
    w_uk, w_uv = _split_w_kv_b(w_kv_b, dn, q.dtype)
    q_lat = jnp.einsum("bthn,rhn->bthr", q[..., :dn], w_uk,
                       preferred_element_type=jnp.float32).astype(q.dtype)  # [B, T, H, R]
    q_abs = jnp.concatenate([q_lat, q[..., dn:]], axis=-1)  # [B, T, H, R + Dr]
    scale = getattr(cache, "scale", None)  # codes' scales [B, S, 2] / [P, page_size, 2]
    sm_scale = softmax_scale(plan.config)
    if isinstance(cache, _PAGED_LAYERS):
        o_lat = MLA_PAGED_CORE(q_abs, cache.latent, cache.block_tables, positions, plan,
                               sm_scale=sm_scale, kv_lora_rank=r,
                               latent_scale=scale)  # [B, T, H, R]
    else:
        lengths = positions[:, -1] + 1  # [B]: the last new token's slot, plus one
        o_lat = MLA_CORE(q_abs, cache.latent, lengths, plan, sm_scale=sm_scale,
                         kv_lora_rank=r, latent_scale=scale)  # [B, T, H, R]
    return jnp.einsum("bthr,rhv->bthv", o_lat, w_uv,
                      preferred_element_type=jnp.float32).astype(q.dtype)  # [B, T, H, Dv]


def mla_attend(q: jax.Array, kv_a: jax.Array,
               cache: LatentLayer | QuantizedLatentLayer | None, plan: Plan, *,
               positions: jax.Array, rope, kv_norm, w_kv_b, fresh: bool = False):
    """MLA of the new tokens -> (out [B, T, H, Dv], the layer's cache with their latents).

    q [B, T, H, Dn + Dr] (q_proj / q_b_proj's output, RoPE not applied yet); kv_a [B, T, R + Dr]
    (kv_a_proj_with_mqa's); positions [B, T] int32; rope (cos, sin) [B, T, Dr]; kv_norm [R]:
    kv_a_layernorm's weight; w_kv_b: kv_b_proj [R, H, Dn + Dv]. cache: the layer's LatentLayer
    (or QuantizedLatentLayer) or None (the T tokens attend among themselves at positions
    0..T-1); fresh: the cache held nothing before them."""
    config = plan.config
    mla = config.mla
    r, dn = mla.kv_lora_rank, mla.qk_nope_head_dim
    c_kv = reference.rms_norm(kv_a[..., :r], kv_norm, config.rms_norm_eps)  # [B, T, R]
    k_pe = _rope(kv_a[:, :, None, r:], rope, mla.rope_interleave)[:, :, 0]  # [B, T, Dr]
    q = jnp.concatenate([q[..., :dn], _rope(q[..., dn:], rope, mla.rope_interleave)], axis=-1)
    latent = jnp.concatenate([c_kv, k_pe.astype(c_kv.dtype)], axis=-1)  # [B, T, R + Dr]
    if cache is not None:
        cache = cache.append(latent, positions)
    out = MLA_ATTEND(q, latent, cache, plan, positions=positions, w_kv_b=w_kv_b, fresh=fresh)
    return out, cache
