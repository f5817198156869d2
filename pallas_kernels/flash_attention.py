"""Flash attention (prefill): online-softmax tiled attention over [B, T, H, D] tensors.

Portable path on the Pallas Triton backend (runs in interpret mode on CPU). One program handles
one tile of `block_q` queries of one query head and walks the key/value tiles of that head's KV
group (GQA without repeating K/V in memory). The key range of a tile is split into three loops:
tiles every query sees in full (no mask arithmetic), and the masked edge tiles (the causal
diagonal, the sliding-window edge, the ragged end of the sequence). Tiles no query of the tile
can see are never visited.

Mask semantics (HF): queries are the last Tq of Tk positions, so query row r sits at position
p = r + Tk - Tq; with `causal` it sees keys k <= p, with `sliding_window=w` also k > p - w.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    LOG2_E, MASK_VALUE, check_array, check_head_dim, check_same_dtype, check_softcap, check_tiles,
    dot_f32, multiple_of, on_hopper, ref_precision, softcap_log2)


@dataclasses.dataclass(frozen=True)
class FlashBlockSizes:
    """Tile shape and Triton launch parameters; block sides must be powers of two >= 16."""
    block_q: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        check_tiles(self, "block_q", "block_k")


def default_block_sizes(head_dim: int, itemsize: int = 2) -> FlashBlockSizes:
    """Per-head-dim defaults for the Triton path, the fastest of benchmarks/kernels.py's sweep
    on the H200 (benchmarks/DECISIONS.md, "Prefill"). float32 tiles take twice the shared
    memory (the 16-bit D128 tiles would need ~450 KB of the 227 KB a block may use): halved
    tiles and 2 stages fit."""
    if itemsize >= 4:
        return FlashBlockSizes(block_q=64, block_k=32 if head_dim > 64 else 64, num_warps=4,
                               num_stages=2)
    if head_dim <= 64:
        return FlashBlockSizes(block_q=128, block_k=64, num_warps=4, num_stages=3)
    if head_dim <= 128:
        return FlashBlockSizes(block_q=128, block_k=128, num_warps=8, num_stages=3)
    return FlashBlockSizes(block_q=64, block_k=32, num_warps=4, num_stages=2)


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------


def flash_attention_kernel(q_ref, k_ref, v_ref, o_ref, *, sm_scale: float, causal: bool,
                           window: int | None, tq: int, tk: int, block_q: int, block_k: int,
                           num_q_blocks: int, softcap: float | None = None):
    # q_ref, o_ref [block_q, D]: one query tile of one head (rows past tq are padding)
    # k_ref, v_ref [tk_pad, D]: the whole key/value sequence of this head's KV group (rows >= tk
    # are out of range and only read under a mask)
    qi = pl.program_id(0)
    if causal:
        qi = num_q_blocks - 1 - qi  # the index map reverses too: longest tiles launch first
    offset = tk - tq
    rows = qi * block_q + jnp.arange(block_q)  # [block_q] query index
    pos = rows + offset  # [block_q] absolute position of each query
    row_ok = rows < tq
    q = plgpu.load(q_ref, mask=row_ok[:, None], other=0)  # [block_q, D]
    d = q.shape[-1]
    qk_scale = sm_scale * LOG2_E  # softmax in base 2: exp(x) = exp2(x * log2 e)

    p_first = qi * block_q + offset  # position of the tile's first / last row
    p_last = p_first + block_q - 1
    n_kv = pl.cdiv(tk, block_k)
    hi = jnp.minimum(pl.cdiv(jnp.minimum(p_last + 1, tk), block_k), n_kv) if causal else n_kv
    if window is not None:
        lo = jnp.maximum(p_first - window + 1, 0) // block_k
        full_lo = jnp.clip(pl.cdiv(jnp.maximum(p_last - window + 1, 0), block_k), lo, hi)
    else:
        lo = full_lo = 0
    full_hi = (jnp.minimum(p_first + 1, tk) if causal else tk) // block_k
    full_hi = jnp.clip(full_hi, full_lo, hi)

    def step(j, carry, masked: bool):
        acc, m, l = carry  # [block_q, D], [block_q], [block_q] (float32)
        start = multiple_of(j * block_k, block_k)
        cols = start + jnp.arange(block_k)  # [block_k] key index
        if masked:
            kv_ok = (cols < tk)[:, None]
            k = plgpu.load(k_ref.at[pl.ds(start, block_k), :], mask=kv_ok, other=0)
            v = plgpu.load(v_ref.at[pl.ds(start, block_k), :], mask=kv_ok, other=0)
        else:
            k = k_ref[pl.ds(start, block_k), :]  # [block_k, D]
            v = v_ref[pl.ds(start, block_k), :]  # [block_k, D]
        # [block_q, block_k] in log2 units, soft-capped before the mask
        s = softcap_log2(dot_f32(q, k, trans_b=True) * qk_scale, softcap)
        if masked:
            visible = cols[None, :] < tk
            if causal:
                visible &= cols[None, :] <= pos[:, None]
            if window is not None:
                visible &= cols[None, :] > pos[:, None] - window
            s = jnp.where(visible, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])  # [block_q, block_k]
        l = l * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[:, None] + dot_f32(p.astype(v.dtype), v)
        return acc, m_new, l

    carry = (jnp.zeros((block_q, d), jnp.float32),
             jnp.full((block_q,), MASK_VALUE, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
    masked_step = functools.partial(step, masked=True)
    if window is not None:
        carry = lax.fori_loop(lo, full_lo, masked_step, carry)
    carry = lax.fori_loop(full_hi, hi, masked_step, carry)
    acc, _, l = carry
    # Every valid row saw at least one key (itself, when causal), so l > 0 there.
    o = acc / jnp.where(l > 0, l, 1.0)[:, None]
    plgpu.store(o_ref, o.astype(o_ref.dtype), mask=row_ok[:, None])


# ---------------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------------


def _validate(q, k, v, causal, sliding_window):
    op = "flash_attention"
    check_array(op, "q", q, 4)
    check_array(op, "k", k, 4)
    check_array(op, "v", v, 4)
    check_same_dtype(op, q=q, k=k, v=v)
    b, tq, hq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape")
    bk, tk, hkv, dk = k.shape
    if bk != b:
        raise ValueError(f"{op}: batch of q ({b}) and k/v ({bk}) differ")
    if dk != d:
        raise ValueError(f"{op}: head dim of q ({d}) and k/v ({dk}) differ")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{op}: query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if tq > tk:
        raise ValueError(f"{op}: more queries ({tq}) than keys ({tk}); queries are the last Tq "
                         f"of the Tk positions, so Tq <= Tk")
    if tq == 0 or tk == 0:
        raise ValueError(f"{op}: empty sequence (Tq={tq}, Tk={tk})")
    if sliding_window is not None:
        if not causal:
            raise ValueError(f"{op}: sliding_window needs causal=True (HF sliding-window "
                             f"attention is causal)")
        if int(sliding_window) < 1:
            raise ValueError(f"{op}: sliding_window must be >= 1, got {sliding_window}")


BACKENDS = ("auto", "triton", "mosaic")


def flash_attention(q, k, v, *, causal: bool = True, sm_scale: float | None = None,
                    sliding_window: int | None = None, interpret: bool = False,
                    block_sizes: FlashBlockSizes | None = None, backend: str = "auto",
                    mosaic_config=None, softcap: float | None = None):
    """Attention of q [B, Tq, Hq, D] over k, v [B, Tk, Hkv, D] -> [B, Tq, Hq, D] in q's dtype.

    Hq % Hkv == 0 (GQA: query head h reads KV head h // (Hq // Hkv)); Tq <= Tk, the queries being
    the last Tq positions. `sm_scale` defaults to 1/sqrt(D). Softmax statistics in float32.

    backend: "triton" (portable; the only one for float32), "mosaic" (Hopper: wgmma, TMA,
    warp-specialized; bf16/fp16, D a multiple of 64; see flash_attention_mgpu.py), or "auto":
    mosaic on a Hopper GPU when the inputs allow it and need no padding (Tq a multiple of 128,
    Tk of the KV tile: the mosaic wrapper would otherwise copy q/k/v into padded arrays), else
    triton. With interpret=True, "auto" means triton; "mosaic" runs the Mosaic GPU interpreter.
    softcap: scores = softcap * tanh(scores / softcap) before the mask (Gemma 2); the Triton
    path only ("auto" takes it).
    """
    _validate(q, k, v, causal, sliding_window)
    softcap = check_softcap("flash_attention", softcap)
    if backend not in BACKENDS:
        raise ValueError(f"flash_attention: backend must be one of {BACKENDS}, got {backend!r}")
    if softcap is not None and backend == "mosaic":
        raise ValueError("flash_attention: backend 'mosaic' has no softcap; use 'triton' or "
                         "'auto'")
    # Imported here: Mosaic GPU's import is ~0.2 s that a CPU or Triton-only run need not pay.
    from pallas_kernels import flash_attention_mgpu

    if backend == "auto":
        backend = "mosaic" if (not interpret and softcap is None and on_hopper()
                               and flash_attention_mgpu.supports(q, k, v, mosaic_config) is None
                               and flash_attention_mgpu.is_aligned(q, k, mosaic_config)) \
            else "triton"
    if backend == "mosaic":
        return flash_attention_mgpu.flash_attention_mgpu(
            q, k, v, causal=causal, sm_scale=sm_scale, sliding_window=sliding_window,
            interpret=interpret, config=mosaic_config)
    d = q.shape[-1]
    check_head_dim("flash_attention", d)
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(d)
    window = int(sliding_window) if sliding_window is not None else None
    blocks = block_sizes or default_block_sizes(d, q.dtype.itemsize)
    return _flash_attention_triton(q, k, v, causal=causal, sm_scale=sm_scale, window=window,
                                   blocks=blocks, softcap=softcap, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "window", "blocks", "softcap",
                                             "interpret"))
def _flash_attention_triton(q, k, v, *, causal, sm_scale, window, blocks, softcap, interpret):
    b, tq, hq, d = q.shape
    _, tk, hkv, _ = k.shape
    group = hq // hkv
    nq = pl.cdiv(tq, blocks.block_q)
    # K/V blocks span the whole sequence, rounded up to whole tiles so that every tile slice lies
    # inside the block (interpret mode pads the arrays; on the GPU the masked loads stop at tk).
    tk_pad = pl.cdiv(tk, blocks.block_k) * blocks.block_k

    def q_index(i, h, bb):
        return (bb, nq - 1 - i if causal else i, h, 0)

    def kv_index(i, h, bb):
        return (bb, 0, h // group, 0)

    kernel = functools.partial(
        flash_attention_kernel, sm_scale=sm_scale, causal=causal, window=window, tq=tq, tk=tk,
        block_q=blocks.block_q, block_k=blocks.block_k, num_q_blocks=nq, softcap=softcap)
    return pl.pallas_call(
        kernel,
        grid=(nq, hq, b),  # q tiles fastest: neighbouring programs share K/V in L2
        in_specs=[pl.BlockSpec((None, blocks.block_q, None, d), q_index),
                  pl.BlockSpec((None, tk_pad, None, d), kv_index),
                  pl.BlockSpec((None, tk_pad, None, d), kv_index)],
        out_specs=pl.BlockSpec((None, blocks.block_q, None, d), q_index),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                             num_stages=blocks.num_stages),
        interpret=interpret,
        name="flash_attention",
    )(q, k, v)


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def flash_attention_reference(q, k, v, *, causal: bool = True, sm_scale: float | None = None,
                              sliding_window: int | None = None, interpret: bool = False,
                              softcap: float | None = None):
    """Plain-jnp attention with the same signature and semantics (interpret is ignored)."""
    del interpret
    _validate(q, k, v, causal, sliding_window)
    softcap = check_softcap("flash_attention", softcap)
    b, tq, hq, d = q.shape
    _, tk, hkv, _ = k.shape
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    qg = q.reshape(b, tq, hkv, hq // hkv, d)  # [B, Tq, Hkv, G, D]
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32,
                   precision=ref_precision(q.dtype)) * scale  # [B, Hkv, G, Tq, Tk]
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    q_pos = jnp.arange(tq)[:, None] + (tk - tq)  # [Tq, 1]
    k_pos = jnp.arange(tk)[None, :]  # [1, Tk]
    visible = jnp.ones((tq, tk), bool)
    if causal:
        visible &= k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    s = jnp.where(visible, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32,
                   precision=ref_precision(q.dtype))
    return o.reshape(b, tq, hq, d).astype(q.dtype)
