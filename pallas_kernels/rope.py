"""Rotary position embedding (HF rotate-half convention) over x [B, T, H, D].

out[..., :D/2] = x1 * cos - x2 * sin and out[..., D/2:] = x2 * cos + x1 * sin, with
x1 = x[..., :D/2], x2 = x[..., D/2:], angle = position * inv_freq. One program handles a tile of
`block_t` tokens of one sequence: the cos/sin tables of the tile are computed once (float32) and
reused for every head, so the kernel reads x once and writes it once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import check_array, is_pow2, next_pow2


def rope_kernel(pos_ref, inv_freq_ref, x_ref, o_ref, *, seq_len: int, num_heads: int,
                block_t: int, attention_factor: float):
    # pos_ref [block_t] int32; inv_freq_ref [D/2] float32
    # x_ref, o_ref [block_t, H, D]: one token tile of one sequence (rows past seq_len are padding)
    rows = pl.program_id(1) * block_t + jnp.arange(block_t)  # [block_t]
    row_ok = rows < seq_len
    pos = plgpu.load(pos_ref, mask=row_ok, other=0).astype(jnp.float32)  # [block_t]
    inv_freq = inv_freq_ref[...]  # [half]
    half = inv_freq.shape[0]
    angle = pos[:, None] * inv_freq[None, :]  # [block_t, half], float32 as in HF
    # HF casts cos/sin to x's dtype before the products; do the same so bf16 results agree.
    cos = (jnp.cos(angle) * attention_factor).astype(x_ref.dtype).astype(jnp.float32)
    sin = (jnp.sin(angle) * attention_factor).astype(x_ref.dtype).astype(jnp.float32)
    mask = row_ok[:, None]

    def head(h, _):
        lo_ref = x_ref.at[:, h, pl.ds(0, half)]
        hi_ref = x_ref.at[:, h, pl.ds(half, half)]
        x1 = plgpu.load(lo_ref, mask=mask, other=0).astype(jnp.float32)  # [block_t, half]
        x2 = plgpu.load(hi_ref, mask=mask, other=0).astype(jnp.float32)
        plgpu.store(o_ref.at[:, h, pl.ds(0, half)], (x1 * cos - x2 * sin).astype(o_ref.dtype),
                    mask=mask)
        plgpu.store(o_ref.at[:, h, pl.ds(half, half)], (x2 * cos + x1 * sin).astype(o_ref.dtype),
                    mask=mask)
        return 0

    lax.fori_loop(0, num_heads, head, 0)


def _validate(x, positions, inv_freq):
    op = "rope"
    check_array(op, "x", x, 4)
    check_array(op, "positions", positions, 2, dtypes=(jnp.dtype(jnp.int32),))
    check_array(op, "inv_freq", inv_freq, 1, dtypes=(jnp.dtype(jnp.float32),))
    b, t, _, d = x.shape
    if tuple(positions.shape) != (b, t):
        raise ValueError(f"{op}: positions has shape {tuple(positions.shape)}, expected (B, T) = "
                         f"{(b, t)} from x {tuple(x.shape)}")
    if d % 2 or inv_freq.shape[0] * 2 != d:
        raise ValueError(f"{op}: inv_freq has {inv_freq.shape[0]} entries, expected D/2 = "
                         f"{d / 2} for head dim {d} (partial rotary is not supported here)")


def rope(x, positions, inv_freq, *, interpret: bool = False, block_t: int | None = None,
         attention_factor: float = 1.0):
    """HF rotate-half RoPE; x [B, T, H, D], positions [B, T] int32, inv_freq [D/2] float32.

    attention_factor scales cos and sin (HF's `attention_scaling`, e.g. YaRN's mscale)."""
    _validate(x, positions, inv_freq)
    half = x.shape[-1] // 2
    if not is_pow2(half):
        raise ValueError(f"rope: head dim {x.shape[-1]} is not supported by the Pallas kernel "
                         f"(D/2 must be a power of two); use rope_reference")
    if block_t is None:
        block_t = min(next_pow2(x.shape[1]), 16)
    return _rope_triton(x, positions, inv_freq, block_t=block_t,
                        attention_factor=float(attention_factor), interpret=interpret)


@functools.partial(jax.jit, static_argnames=("block_t", "attention_factor", "interpret"))
def _rope_triton(x, positions, inv_freq, *, block_t, attention_factor, interpret):
    b, t, h, d = x.shape
    kernel = functools.partial(rope_kernel, seq_len=t, num_heads=h, block_t=block_t,
                               attention_factor=attention_factor)
    return pl.pallas_call(
        kernel,
        grid=(b, pl.cdiv(t, block_t)),
        in_specs=[pl.BlockSpec((None, block_t), lambda i, j: (i, j)),
                  pl.BlockSpec((d // 2,), lambda i, j: (0,)),
                  pl.BlockSpec((None, block_t, h, d), lambda i, j: (i, j, 0, 0))],
        out_specs=pl.BlockSpec((None, block_t, h, d), lambda i, j: (i, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="rope",
    )(positions, inv_freq, x)


def rope_reference(x, positions, inv_freq, *, interpret: bool = False,
                   attention_factor: float = 1.0):
    """HF `apply_rotary_pos_emb` in plain jnp (interpret is ignored)."""
    del interpret
    _validate(x, positions, inv_freq)
    angle = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = jnp.concatenate([angle, angle], axis=-1)  # [B, T, D]
    cos = (jnp.cos(emb) * attention_factor).astype(x.dtype)[:, :, None, :]  # [B, T, 1, D]
    sin = (jnp.sin(emb) * attention_factor).astype(x.dtype)[:, :, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
