"""The absorbed MLA decode attention kernel (pallas_kernels/mla.py) and its reference.

CPU: the kernel in interpret mode against the reference at shapes that are not block
multiples (ragged lengths, 0, 1 and S; Tq 1 and 3; several row and R blocks; split-K on and
off; float32 and bfloat16; int8 and fp8 latents); the reference against an independent
formulation (non-absorbed MLA: K and V expanded from the latent per head with random W_UK /
W_UV, in numpy float64); stale slots never read; bad input refused before compiling; the
kernel lowered for an H200. The paged form likewise (shuffled page tables over the null page,
padding queries, page sizes 16 and 32), its reference against the contiguous one on the rows
laid end to end. GPU (marked `gpu`): the compiled kernel against the reference at
DeepSeek-V2-Lite and V3 head counts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_testing import rel_err
from pallas_kernels import (MLABlockSizes, mla_decode_attention, mla_decode_attention_reference,
                            paged_mla_attention, paged_mla_attention_reference)
from pallas_kernels.kv_quant import quantize_kv, quantize_latent
from test_gpu_lowering import BF16, F32, I32, S, lower_for_h200
from test_gpu_lowering import verify_triton_modules  # noqa: F401 -- autouse: verify lowerings

gpu = pytest.mark.gpu
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2}  # the other decode kernels' (test_kernels.py)
GPU_TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1.5e-2}


def inputs(b, s, tq, h, rank, rope, dtype, seed=0):
    """Random absorbed queries [B, Tq, H, R + Dr] and latent rows [B, S, R + Dr] (numpy draws:
    eager jax ops would each compile)."""
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((b, tq, h, rank + rope), np.float32), dtype),
            jnp.asarray(rng.standard_normal((b, s, rank + rope), np.float32), dtype))


# One compiled program each (their eager ops would each compile).
reference = jax.jit(mla_decode_attention_reference,
                    static_argnames=("sm_scale", "rope_dim", "interpret", "block_sizes"))
quantize = jax.jit(quantize_latent, static_argnums=(1, 2, 3))  # (latent, R, codes, scales)


# ---------------------------------------------------------------------------------------------
# Kernel (interpret mode) vs reference
# ---------------------------------------------------------------------------------------------

# (B, S, Tq, H, R, Dr, lengths, blocks): S never a multiple of block_s
F32_, BF16_ = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
CASES = {
    "tq1 h4 unsplit bf16": (3, 100, 1, 4, 64, 16, [100, 1, 57], MLABlockSizes(), BF16_),
    "tq3 h4 split f32": (4, 300, 3, 4, 64, 16, [300, 3, 1, 0],
                         MLABlockSizes(block_s=32, num_splits=3), F32_),
    "tq3 h16 row and R blocks, split bf16": (
        2, 200, 3, 16, 64, 16, [200, 77],
        MLABlockSizes(block_s=16, block_m=16, block_r=32, num_splits=4), BF16_),
    "tq1 h16 R512 Dr64 default blocks f32": (2, 40, 1, 16, 512, 64, [40, 17], None, F32_),
    "tq1 h16 R512 Dr64 default blocks bf16": (2, 40, 1, 16, 512, 64, [40, 17], None, BF16_),
    "tq3 h4 split, bf16 partials": (3, 250, 3, 4, 64, 16, [250, 2, 100],
                                    MLABlockSizes(block_s=16, num_splits=4,
                                                  q_dtype_partials=True), BF16_),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference_interpret(case):
    b, s, tq, h, rank, rope, lengths, blocks, dtype = CASES[case]
    q, latent = inputs(b, s, tq, h, rank, rope, dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    kw = dict(sm_scale=0.125, rope_dim=rope)
    out = mla_decode_attention(q, latent, lengths, interpret=True, block_sizes=blocks, **kw)
    ref = reference(q, latent, lengths, **kw)
    assert out.shape == (b, tq, h, rank) and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype.type]
    # Queries that see no slot (length 0; query t < Tq - 1 at length 1) get zeros.
    limits = np.asarray(lengths)[:, None] - (tq - 1 - np.arange(tq))[None, :]  # [B, Tq]
    assert np.all(np.asarray(out, np.float32)[limits <= 0] == 0)
    assert np.all(np.abs(np.asarray(ref, np.float32)[limits > 0]).sum(-1) > 0)


def test_split_and_unsplit_agree_and_stale_slots_are_never_read():
    """Split-K on and off give one answer; NaN in the slots past lengths changes nothing (they
    are masked at load, not after); moving one valid slot's value does (the check can fail)."""
    b, s, tq, h, rank, rope = 2, 150, 3, 4, 64, 16
    q, latent = inputs(b, s, tq, h, rank, rope, jnp.float32, seed=3)
    lengths = jnp.asarray([150, 90], jnp.int32)
    stale = latent.at[1, 90:].set(jnp.nan)
    kw = dict(sm_scale=0.2, rope_dim=rope, interpret=True)
    one = mla_decode_attention(q, stale, lengths, block_sizes=MLABlockSizes(num_splits=1), **kw)
    four = mla_decode_attention(q, stale, lengths, block_sizes=MLABlockSizes(num_splits=4), **kw)
    # q_dtype_partials is a no-op for float32 queries (their partials are float32 already)
    four_p = mla_decode_attention(q, stale, lengths, block_sizes=MLABlockSizes(
        num_splits=4, q_dtype_partials=True), **kw)
    ref = reference(q, latent, lengths, sm_scale=0.2, rope_dim=rope)
    for out in (one, four, four_p):
        assert rel_err(out, ref) < TOL[jnp.float32]
    moved = latent.at[1, 89].multiply(3.0)  # the last slot the last query of row 1 sees
    other = mla_decode_attention(q, moved, lengths, block_sizes=MLABlockSizes(num_splits=4), **kw)
    assert rel_err(other[1, -1], ref[1, -1]) > 1e-3
    assert rel_err(other[1, 0], ref[1, 0]) < TOL[jnp.float32]  # query 0 sees slots < 88


def test_default_stages_fit_shared_memory():
    """The default stage count drops where the latent tiles and the query block would not fit
    in 227 KiB (48 bf16 query rows at R 512 asked 233472 bytes with 3 stages on the H200); it
    stays 3 at DeepSeek-V2-Lite's 16 rows, and an explicit count is left alone."""
    assert MLABlockSizes().resolve(5, 16, 512, 3000).num_stages == 3
    wide = MLABlockSizes().resolve(5, 48, 512, 3000)  # block_m 64, block_r 256
    assert (wide.block_m, wide.block_r, wide.num_stages) == (64, 256, 2)
    assert MLABlockSizes(num_stages=3).resolve(5, 48, 512, 3000).num_stages == 3
    assert not MLABlockSizes(q_dtype_partials=True).resolve(5, 16, 512, 3000,
                                                           q_bytes=4).q_dtype_partials


@pytest.mark.parametrize("code, dtype, scale_dtype",
                         [(jnp.int8, jnp.float32, jnp.float32),
                          (jnp.float8_e4m3fn, jnp.bfloat16, jnp.float16)],
                         ids=["int8-f32", "fp8-bf16-f16scales"])
def test_quantized_latent_matches_reference_interpret(code, dtype, scale_dtype):
    """The kernel on int8 / fp8 codes with per-token scales (c_KV's and k_rope's; float32 or
    float16) against the reference on the same codes (dequantized to float32), split and
    unsplit and with R in two column blocks, with k_rope at 20x c_KV's magnitude (a shared
    scale would show); and the quantized result near the float latent's (within the format's
    error, far from a wrong answer)."""
    b, s, tq, h, rank, rope = 3, 130, 3, 4, 64, 16
    q, latent = inputs(b, s, tq, h, rank, rope, dtype, seed=5)
    latent = latent.at[..., rank:].multiply(20.0)
    codes, scale = quantize(latent.astype(jnp.float32), rank, code,
                            scale_dtype)  # [B, S, 80], [B, S, 2]
    lengths = jnp.asarray([130, 64, 3], jnp.int32)
    kw = dict(sm_scale=0.125, rope_dim=rope, latent_scale=scale)
    ref = reference(q, codes, lengths, **kw)
    for blocks in (MLABlockSizes(block_s=16, num_splits=1), MLABlockSizes(block_s=16,
                                                                          num_splits=3),
                   MLABlockSizes(block_s=16, block_r=32, num_splits=2)):  # R in two blocks
        out = mla_decode_attention(q, codes, lengths, interpret=True, block_sizes=blocks, **kw)
        assert rel_err(out, ref) < TOL[dtype], blocks
    exact = reference(q.astype(jnp.float32), latent.astype(jnp.float32), lengths,
                      sm_scale=0.125, rope_dim=rope)
    err = rel_err(ref, exact)
    assert err < (0.03 if code == jnp.int8 else 0.15)
    assert rel_err(exact[:, :, ::-1], exact) > 0.5  # a wrong answer is far away


def test_latent_parts_take_their_own_scales():
    """quantize_latent: c_KV and k_rope each scaled by their own absmax, so a k_rope 30x larger
    costs c_KV nothing (one scale for all R + Dr loses c_KV in int8 rounding); the round trip
    is within int8's half step of each part."""
    from pallas_kernels.kv_quant import dequantize_kv, dequantize_latent

    rank = 64
    _, latent = inputs(2, 40, 1, 1, rank, 16, jnp.float32, seed=8)
    latent = latent.at[..., rank:].multiply(30.0)
    codes, scale = quantize(latent, rank, jnp.int8)
    assert codes.dtype == jnp.int8 and scale.shape == (2, 40, 2)
    back = dequantize_latent(codes, scale, rank)
    for part in (slice(0, rank), slice(rank, None)):
        step = np.abs(np.asarray(latent[..., part])).max(-1, keepdims=True) / 127
        assert np.all(np.abs(np.asarray(back - latent)[..., part]) <= step / 2 + 1e-6)
    one = dequantize_kv(*quantize_kv(latent, jnp.int8))
    assert rel_err(one[..., :rank], latent[..., :rank]) > 5 * rel_err(back[..., :rank],
                                                                       latent[..., :rank])


# ---------------------------------------------------------------------------------------------
# The reference against non-absorbed MLA
# ---------------------------------------------------------------------------------------------


def expanded_mla(q_nope, q_rope, latent, lengths, w_uk, w_uv, sm_scale):
    """Non-absorbed MLA in numpy float64, per query and head: K_h = [c_KV @ W_UK_h ; k_rope],
    V_h = c_KV @ W_UV_h, softmax over slots < lengths[b] - (Tq - 1 - t).
    q_nope [B, Tq, H, Dn], q_rope [B, Tq, H, Dr], latent [B, S, R + Dr], w_uk [R, H, Dn],
    w_uv [R, H, Dv] -> [B, Tq, H, Dv]."""
    q_nope, q_rope, latent, w_uk, w_uv = (np.asarray(x, np.float64)
                                          for x in (q_nope, q_rope, latent, w_uk, w_uv))
    b, tq, h, _ = q_nope.shape
    rank = w_uk.shape[0]
    out = np.zeros((b, tq, h, w_uv.shape[-1]))
    for i in range(b):
        c_kv, k_rope = latent[i, :, :rank], latent[i, :, rank:]  # [S, R], [S, Dr]
        for head in range(h):
            k = np.concatenate([c_kv @ w_uk[:, head], k_rope], axis=-1)  # [S, Dn + Dr]
            v = c_kv @ w_uv[:, head]  # [S, Dv]
            for t in range(tq):
                n = int(lengths[i]) - (tq - 1 - t)
                if n <= 0:
                    continue
                qt = np.concatenate([q_nope[i, t, head], q_rope[i, t, head]])
                sc = k[:n] @ qt * sm_scale
                p = np.exp(sc - sc.max())
                out[i, t, head] = (p / p.sum()) @ v[:n]
    return out


def test_reference_matches_non_absorbed_mla():
    """Absorbed (q_nope folded through W_UK, the output through W_UV after attention) equals
    attention over K/V expanded from the latent per head: the reference checked against a
    formulation it shares no code with."""
    b, s, tq, h, rank, rope, nope, vdim = 2, 37, 3, 3, 32, 16, 24, 20
    rng = np.random.default_rng(11)
    q_nope = rng.standard_normal((b, tq, h, nope)).astype(np.float32)
    q_rope = rng.standard_normal((b, tq, h, rope)).astype(np.float32)
    latent = rng.standard_normal((b, s, rank + rope)).astype(np.float32)
    w_uk = (rng.standard_normal((rank, h, nope)) / np.sqrt(rank)).astype(np.float32)
    w_uv = (rng.standard_normal((rank, h, vdim)) / np.sqrt(rank)).astype(np.float32)
    lengths = jnp.asarray([37, 20], jnp.int32)
    sm_scale = (nope + rope) ** -0.5
    q_abs = np.einsum("bthd,rhd->bthr", q_nope, w_uk)  # W_UK absorbed into the query
    q = jnp.asarray(np.concatenate([q_abs, q_rope], axis=-1))  # [B, Tq, H, R + Dr]
    lat_out = reference(q, jnp.asarray(latent), lengths, sm_scale=sm_scale,
                        rope_dim=rope)  # [B, Tq, H, R]
    absorbed = np.einsum("bthr,rhd->bthd", np.asarray(lat_out, np.float64),
                         np.asarray(w_uv, np.float64))  # W_UV after attention
    want = expanded_mla(q_nope, q_rope, latent, lengths, w_uk, w_uv, sm_scale)
    assert rel_err(absorbed, want) < 1e-5
    # and the masks matter: the full cache for every query is a different answer
    full = reference(q, jnp.asarray(latent), jnp.asarray([37, 37], jnp.int32),
                     sm_scale=sm_scale, rope_dim=rope)
    assert rel_err(np.einsum("bthr,rhd->bthd", np.asarray(full, np.float64),
                             np.asarray(w_uv, np.float64)), want) > 1e-2


# ---------------------------------------------------------------------------------------------
# Block sizes, bad input, lowering
# ---------------------------------------------------------------------------------------------


def test_default_blocks_fit_the_deepseek_shapes():
    """V2-Lite (16 heads): one row block, all of R, unsplit at 512 slots, split at 32k so that
    B = 1 fills the SMs; V3 (128 heads x Tq 2): row blocks of 64 and R in two halves."""
    blocks = MLABlockSizes()
    short = blocks.resolve(8, 16, 512, 512)
    assert (short.block_m, short.block_r, short.num_splits, short.num_warps) == (16, 512, 1, 4)
    long = blocks.resolve(1, 16, 512, 32768)
    assert long.num_splits >= 64 and long.chunk * long.num_splits >= 32768
    assert long.chunk % long.block_s == 0
    v3 = blocks.resolve(4, 256, 512, 8192)
    assert (v3.block_m, v3.block_r, v3.num_warps) == (64, 256, 8)
    assert blocks.resolve(4, 256, 512, 8192, q_bytes=4, latent_bytes=4).block_m == 32
    assert [blocks.resolve(4, 16, 512, 8192, latent_bytes=n).num_stages
            for n in (1, 2, 4)] == [4, 3, 2]


@pytest.mark.parametrize("fn", [mla_decode_attention, mla_decode_attention_reference],
                         ids=["kernel", "reference"])
def test_bad_input_is_refused_before_compiling(fn):
    q, latent = inputs(2, 64, 1, 4, 64, 16, jnp.float32)
    lens = jnp.asarray([64, 3], jnp.int32)
    kw = dict(sm_scale=0.1, rope_dim=16)
    codes, scale = quantize(latent, 64, jnp.int8)
    cases = [
        (lambda: fn(q[0], latent, lens, **kw), "q must have rank 4"),
        (lambda: fn(q, latent[..., :72], lens, **kw), "q's last dim"),
        (lambda: fn(q, latent[:1], lens, **kw), "batch sizes differ"),
        (lambda: fn(q, latent, lens.astype(jnp.float32), **kw), "lengths has dtype"),
        (lambda: fn(q, latent, jnp.asarray([65, 3], jnp.int32), **kw), r"lengths must lie in"),
        (lambda: fn(q, latent.astype(jnp.bfloat16), lens, **kw), "share one dtype"),
        (lambda: fn(q, latent, lens, sm_scale=0.0, rope_dim=16), "sm_scale"),
        (lambda: fn(q, latent, lens, sm_scale=0.1, rope_dim=80), "rope_dim=80"),
        (lambda: fn(q, codes, lens, **kw), "latent has dtype int8"),
        (lambda: fn(q, codes, lens, latent_scale=scale[:, :10], **kw), r"latent_scale must"),
        (lambda: fn(q, codes, lens, latent_scale=scale[..., 0], **kw),
         r"latent_scale must be \[B, S, 2\]"),
        (lambda: fn(q, latent, lens, latent_scale=scale, **kw), "latent has dtype float32"),
        (lambda: fn(q, codes, lens, latent_scale=scale.astype(jnp.bfloat16), **kw),
         "latent_scale has dtype"),
    ]
    if fn is mla_decode_attention:  # what only the kernel cannot tile
        q48, lat48 = inputs(2, 64, 1, 4, 48, 16, jnp.float32)
        q8, lat8 = inputs(2, 64, 1, 4, 64, 8, jnp.float32)
        cases += [(lambda: fn(q48, lat48, lens, **kw), r"R \(latent rank\) = 48"),
                  (lambda: fn(q8, lat8, lens, sm_scale=0.1, rope_dim=8), r"Dr \(rope_dim\) = 8"),
                  (lambda: fn(q, latent, lens, block_sizes=MLABlockSizes(block_r=128), **kw),
                   "exceeds the latent rank 64")]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    with pytest.raises(ValueError, match="block_s=24"):
        MLABlockSizes(block_s=24)
    with pytest.raises(ValueError, match="num_splits=0"):
        MLABlockSizes(num_splits=0)
    with pytest.raises(ValueError, match="num_warps=3"):
        MLABlockSizes(num_warps=3)


LOWERING_CASES = {
    # name: (abstract args, block sizes): DeepSeek-V2-Lite and V3 shapes, bf16
    "v2-lite B8 S4k": ((S((8, 1, 16, 576), BF16), S((8, 4096, 576), BF16), S((8,), I32)), None),
    "v2-lite B1 S32k split": ((S((1, 1, 16, 576), BF16), S((1, 32768, 576), BF16),
                               S((1,), I32)), None),
    "v3 Tq2 H128 row and R blocks": ((S((4, 2, 128, 576), BF16), S((4, 8192, 576), BF16),
                                      S((4,), I32)), None),
    "v2-lite fp8 latent": ((S((8, 1, 16, 576), BF16), S((8, 4096, 576), jnp.float8_e4m3fn),
                            S((8,), I32), S((8, 4096, 2), F32)), None),
    "v2-lite int8 latent unsplit": ((S((8, 1, 16, 576), BF16), S((8, 300, 576), jnp.int8),
                                     S((8,), I32), S((8, 300, 2), F32)), None),
    "v3 Tq2 H128 int8 latent, f16 scales": ((S((4, 2, 128, 576), BF16),
                                             S((4, 8192, 576), jnp.int8), S((4,), I32),
                                             S((4, 8192, 2), jnp.float16)), None),
    "bs64 w8 st2": ((S((8, 1, 16, 576), BF16), S((8, 4096, 576), BF16), S((8,), I32)),
                    MLABlockSizes(block_s=64, num_warps=8, num_stages=2)),
    "bf16 partials, R split": ((S((8, 1, 16, 576), BF16), S((8, 4096, 576), BF16),
                                S((8,), I32)), MLABlockSizes(block_r=256, q_dtype_partials=True)),
}


@pytest.mark.parametrize("name", list(LOWERING_CASES))
def test_kernel_lowers_for_h200(name):
    args, blocks = LOWERING_CASES[name]

    def call(q, latent, lengths, scale=None):
        return mla_decode_attention(q, latent, lengths, sm_scale=0.1, latent_scale=scale,
                                    block_sizes=blocks)

    module = lower_for_h200(call, *args)
    assert "mla_decode_attention" in module  # the kernel, not an XLA fallback


# ---------------------------------------------------------------------------------------------
# Paged latent (paged_mla_attention)
# ---------------------------------------------------------------------------------------------


def paged_pool(latent, positions, page_size, pages, seed=0, fill=None):
    """Contiguous latent rows [B, W * page_size, D] (numpy) scattered into a pool
    [pages, page_size, D]: the pages of row b holding a slot <= its largest position go to
    distinct pool pages >= 1 in shuffled order, its other table entries to the null page 0.
    Pool slots nothing was scattered to hold `fill` (None: random draws). -> (pool, tables)."""
    rng = np.random.default_rng(seed)
    b, s, d = latent.shape
    w = s // page_size
    pool = rng.standard_normal((pages, page_size, d)).astype(np.float32)  # drawn either way:
    if fill is not None:  # one seed gives one table
        pool[:] = fill
    free = list(rng.permutation(np.arange(1, pages)))
    tables = np.zeros((b, w), np.int32)
    for i in range(b):
        for j in range(-(-(int(positions[i].max()) + 1) // page_size)):
            tables[i, j] = free.pop()
            pool[tables[i, j]] = latent[i, j * page_size:(j + 1) * page_size]
    return pool, jnp.asarray(tables)


paged_reference = jax.jit(paged_mla_attention_reference,
                          static_argnames=("sm_scale", "rope_dim", "interpret", "block_sizes"))

# (B, Tq, H, R, Dr, page_size, W, pages, positions, blocks, dtype): -1 a padding query; row
# 2 of the Tq-3 cases all padding (its table all null page)
PAGED_CASES = {
    "ps16 tq1 unsplit bf16": (3, 1, 4, 64, 16, 16, 5, 12, [[70], [0], [-1]], None, BF16_),
    "ps32 tq3 split f32": (3, 3, 4, 64, 16, 32, 4, 10, [[100, 101, -1], [5, 6, 7],
                                                         [-1, -1, -1]],
                           MLABlockSizes(num_splits=3), F32_),
    "ps32 tq3 two tiles a page, row and R blocks, split bf16": (
        3, 3, 16, 64, 16, 32, 4, 10, [[50, 51, 52], [127, -1, -1], [-1, -1, -1]],
        MLABlockSizes(block_s=16, block_m=16, block_r=32, num_splits=2), BF16_),
    "ps16 tq3 block_s clamped, unsplit f32": (2, 3, 4, 64, 16, 16, 6, 10,
                                              [[93, 94, 95], [17, 18, -1]],
                                              MLABlockSizes(block_s=64, num_splits=1), F32_),
}


@pytest.mark.parametrize("case", list(PAGED_CASES))
def test_paged_kernel_matches_reference_interpret(case):
    """Shuffled page tables, unused entries on the null page, padding queries (and a row all
    padding) get zeros."""
    b, tq, h, rank, rope, ps, w, pages, positions, blocks, dtype = PAGED_CASES[case]
    positions = np.asarray(positions, np.int32)
    q, latent = inputs(b, w * ps, tq, h, rank, rope, jnp.float32, seed=7)
    pool, tables = paged_pool(np.asarray(latent), positions, ps, pages)
    q, pool = q.astype(dtype), jnp.asarray(pool, dtype)
    kw = dict(sm_scale=0.125, rope_dim=rope)
    out = paged_mla_attention(q, pool, tables, jnp.asarray(positions), interpret=True,
                              block_sizes=blocks, **kw)
    ref = paged_reference(q, pool, tables, jnp.asarray(positions), **kw)
    assert out.shape == (b, tq, h, rank) and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype.type]
    assert np.all(np.asarray(out, np.float32)[positions < 0] == 0)
    assert np.all(np.abs(np.asarray(ref, np.float32)[positions >= 0]).sum(-1) > 0)


def test_paged_quantized_latent_matches_reference_interpret():
    """int8 codes with per-slot scales read through the table (split, R in two blocks, page
    of two tiles), k_rope at 20x c_KV's magnitude (a shared or misplaced scale would show)."""
    b, tq, h, rank, rope, ps, w = 3, 3, 4, 64, 16, 32, 4
    positions = np.asarray([[90, 91, 92], [3, -1, -1], [-1, -1, -1]], np.int32)
    q, latent = inputs(b, w * ps, tq, h, rank, rope, jnp.float32, seed=9)
    latent = np.asarray(latent.at[..., rank:].multiply(20.0))
    pool, tables = paged_pool(latent, positions, ps, 9)
    codes, scale = quantize(jnp.asarray(pool), rank, jnp.int8)  # [P, ps, 80], [P, ps, 2]
    kw = dict(sm_scale=0.125, rope_dim=rope, latent_scale=scale)
    ref = paged_reference(q, codes, tables, jnp.asarray(positions), **kw)
    for blocks in (MLABlockSizes(num_splits=1),
                   MLABlockSizes(block_s=16, block_r=32, num_splits=3)):
        out = paged_mla_attention(q, codes, tables, jnp.asarray(positions), interpret=True,
                                  block_sizes=blocks, **kw)
        assert rel_err(out, ref) < TOL[jnp.float32], blocks


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "int8"])
def test_paged_reference_matches_contiguous_reference(quantized):
    """The paged reference on a shuffled pool equals the contiguous one on the rows laid end
    to end (query t at position lengths[b] - Tq + t, -1 where that is < 0): the reference's
    gather and mask checked against the one whose tests are above."""
    b, tq, h, rank, rope, ps, w = 3, 3, 4, 32, 16, 16, 4
    lengths = np.asarray([64, 20, 1], np.int32)
    positions = np.maximum(lengths[:, None] - tq + np.arange(tq)[None, :], -1).astype(np.int32)
    q, latent = inputs(b, w * ps, tq, h, rank, rope, jnp.float32, seed=13)
    pool, tables = paged_pool(np.asarray(latent), positions, ps, 12)
    pool = jnp.asarray(pool)
    kw = dict(sm_scale=0.2, rope_dim=rope)
    scale = cscale = None
    if quantized:  # per-slot scales: quantizing the pool or the rows gives the same codes
        (pool, scale), (latent, cscale) = (quantize(x, rank, jnp.int8) for x in (pool, latent))
    out = paged_reference(q, pool, tables, jnp.asarray(positions), latent_scale=scale, **kw)
    want = reference(q, latent, jnp.asarray(lengths), latent_scale=cscale, **kw)
    assert rel_err(out, want) < 1e-6
    # and the table matters: the pool's pages in order are a different answer
    wrong = jnp.asarray(np.tile(np.arange(w, dtype=np.int32), (b, 1)))
    assert rel_err(paged_reference(q, pool, wrong, jnp.asarray(positions),
                                   latent_scale=scale, **kw), want) > 0.1


def test_paged_stale_slots_and_null_page_are_never_read():
    """NaN (float) or 127 codes with NaN scales (int8) in every pool slot past a row's largest
    position, in unused pages and in the null page change no bit of the output, split or not;
    moving one slot the last query sees does (the check can fail)."""
    b, tq, h, rank, rope, ps, w = 2, 3, 4, 64, 16, 16, 5
    positions = np.asarray([[36, 37, -1], [60, 61, 62]], np.int32)
    q, latent = inputs(b, w * ps, tq, h, rank, rope, jnp.float32, seed=17)
    latent = np.asarray(latent)
    clean, tables = paged_pool(latent, positions, ps, 12, seed=4)
    stale = latent.copy()
    for i in range(b):
        stale[i, positions[i].max() + 1:] = np.nan
    poisoned, same = paged_pool(stale, positions, ps, 12, seed=4, fill=np.nan)
    assert np.array_equal(tables, same) and np.isnan(poisoned[0]).all()
    pos = jnp.asarray(positions)
    kw = dict(sm_scale=0.125, rope_dim=rope, interpret=True)
    ref = paged_reference(q, jnp.asarray(clean), tables, pos, sm_scale=0.125, rope_dim=rope)
    codes, scale = quantize(jnp.asarray(clean), rank, jnp.int8)
    bad = np.isnan(poisoned[..., 0])  # [P, ps] the slots no query may read
    bad_codes = jnp.where(bad[..., None], jnp.int8(127), codes)
    bad_scale = jnp.where(bad[..., None], jnp.nan, scale)
    for blocks in (MLABlockSizes(num_splits=1), MLABlockSizes(num_splits=3)):
        out = paged_mla_attention(q, jnp.asarray(poisoned), tables, pos, block_sizes=blocks,
                                  **kw)
        assert np.array_equal(out, paged_mla_attention(q, jnp.asarray(clean), tables, pos,
                                                       block_sizes=blocks, **kw))
        assert rel_err(out, ref) < TOL[jnp.float32]
        qout = paged_mla_attention(q, bad_codes, tables, pos, block_sizes=blocks,
                                   latent_scale=bad_scale, **kw)
        assert np.array_equal(qout, paged_mla_attention(q, codes, tables, pos,
                                                        block_sizes=blocks,
                                                        latent_scale=scale, **kw))
        assert np.all(np.isfinite(np.asarray(qout)))
    page, slot = int(tables[1, 61 // ps]), 61 % ps  # row 1's query 1 sees it, query 0 not
    moved = jnp.asarray(clean).at[page, slot].multiply(3.0)
    other = paged_mla_attention(q, moved, tables, pos, **kw)
    assert rel_err(other[1, 1], ref[1, 1]) > 1e-3
    assert rel_err(other[1, 0], ref[1, 0]) < TOL[jnp.float32]


@pytest.mark.parametrize("fn", [paged_mla_attention, paged_mla_attention_reference],
                         ids=["kernel", "reference"])
def test_paged_bad_input_is_refused_before_compiling(fn):
    q, latent = inputs(2, 64, 2, 4, 64, 16, jnp.float32)
    pool = latent.reshape(8, 16, 80)  # [P, page_size, R + Dr]
    tables = jnp.asarray([[1, 2, 0], [3, 0, 0]], jnp.int32)
    pos = jnp.asarray([[5, 6], [7, -1]], jnp.int32)
    kw = dict(sm_scale=0.1, rope_dim=16)
    cases = [
        (lambda: fn(q, pool, tables, pos[:, :1], **kw), r"positions \(2, 1\) \[B, Tq\]"),
        (lambda: fn(q, pool, tables, pos[0], **kw), "positions must have rank 2"),
        (lambda: fn(q, latent[:, :48].reshape(4, 24, 80), tables, pos, **kw),
         "page_size 24 .* power of two"),
        (lambda: fn(q, pool, tables.at[0, 0].set(8), pos, **kw), r"entries must lie in \[0, 8\)"),
        (lambda: fn(q, pool, tables, pos.at[0, 1].set(48), **kw), r"positions must lie in"),
        (lambda: fn(q, pool, tables, pos.at[0, 1].set(-2), **kw), r"positions must lie in"),
    ]
    if fn is paged_mla_attention:  # what only the kernel cannot tile
        q48, lat48 = inputs(2, 64, 2, 4, 48, 16, jnp.float32)
        cases.append((lambda: fn(q48, lat48.reshape(8, 16, 64), tables, pos, **kw),
                      r"R \(latent rank\) = 48 .* use paged_mla_attention_reference"))
        cases.append((lambda: fn(q, latent.reshape(16, 8, 80), tables, pos, **kw),
                      "page_size 8 .* >= 16"))
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


PAGED_LOWERING_CASES = {
    # name: abstract (q, latent_pages, block_tables, positions[, latent_scale]), bf16 queries
    "v2-lite B8 ps64 4k slots": (S((8, 1, 16, 576), BF16), S((600, 64, 576), BF16),
                                 S((8, 64), I32), S((8, 1), I32)),
    "v2-lite B1 ps16 32k slots split, Tq3": (S((1, 3, 16, 576), BF16),
                                             S((2100, 16, 576), BF16), S((1, 2048), I32),
                                             S((1, 3), I32)),
    "v3 Tq2 H128 int8 ps32 row and R blocks": (S((4, 2, 128, 576), BF16),
                                               S((1100, 32, 576), jnp.int8), S((4, 256), I32),
                                               S((4, 2), I32), S((1100, 32, 2), F32)),
    "v2-lite fp8 ps16, f16 scales": (S((8, 1, 16, 576), BF16),
                                     S((2100, 16, 576), jnp.float8_e4m3fn), S((8, 256), I32),
                                     S((8, 1), I32), S((2100, 16, 2), jnp.float16)),
}


@pytest.mark.parametrize("name", list(PAGED_LOWERING_CASES))
def test_paged_kernel_lowers_for_h200(name):
    def call(q, pool, tables, positions, scale=None):
        return paged_mla_attention(q, pool, tables, positions, sm_scale=0.1,
                                   latent_scale=scale)

    module = lower_for_h200(call, *PAGED_LOWERING_CASES[name])
    assert "paged_mla_attention" in module  # the kernel, not an XLA fallback


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("dtype, tq, h", [
    (jnp.float32, 1, 16), (jnp.bfloat16, 1, 16), (jnp.float32, 3, 16), (jnp.bfloat16, 3, 16),
    (jnp.bfloat16, 2, 128),  # DeepSeek-V3: row blocks of 64, R in two halves
], ids=["v2-tq1-f32", "v2-tq1-bf16", "v2-tq3-f32", "v2-tq3-bf16", "v3-tq2-bf16"])
def test_kernel_matches_reference_gpu(dtype, tq, h):
    b, s = 5, 3000
    q, latent = inputs(b, s, tq, h, 512, 64, dtype, seed=21)
    lengths = jnp.asarray([3000, 1, 1234, 0, 2049], jnp.int32)
    kw = dict(sm_scale=0.07)
    ref = mla_decode_attention_reference(q, latent, lengths, **kw)
    for blocks in (None, MLABlockSizes(block_r=256, q_dtype_partials=True)):
        out = mla_decode_attention(q, latent, lengths, block_sizes=blocks, **kw)
        assert rel_err(out, ref) < GPU_TOL[dtype], blocks


@gpu
@pytest.mark.parametrize("dtype, tq, h", [(jnp.bfloat16, 1, 16), (jnp.bfloat16, 3, 128)],
                         ids=["v2-tq1", "v3-tq3"])
def test_paged_kernel_matches_reference_gpu(dtype, tq, h):
    """The engine's shapes: pages of 64, shuffled tables, 3000-slot rows split."""
    positions = np.asarray([[2999 - tq + 1 + t for t in range(tq)], [-1] * tq,
                            [1233 - tq + 1 + t for t in range(tq)]], np.int32)
    q, latent = inputs(3, 3008, tq, h, 512, 64, jnp.float32, seed=22)
    pool, tables = paged_pool(np.asarray(latent), positions, 64, 80)
    q, pool = q.astype(dtype), jnp.asarray(pool, dtype)
    kw = dict(sm_scale=0.07, rope_dim=64)
    ref = paged_reference(q, pool, tables, jnp.asarray(positions), **kw)
    out = paged_mla_attention(q, pool, tables, jnp.asarray(positions), **kw)
    assert rel_err(out, ref) < GPU_TOL[dtype]


@gpu
@pytest.mark.parametrize("code", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("s, tq, h", [(400, 1, 16), (5000, 1, 16), (5000, 2, 128)],
                         ids=["v2-unsplit", "v2-split", "v3-tq2"])
def test_quantized_latent_matches_reference_gpu(code, s, tq, h):
    """The compiled kernel on codes at DeepSeek-V2-Lite shapes (H 16, R 512, Dr 64) and V3's
    128 heads x Tq 2 (row blocks of 64, R in two halves) against the reference."""
    q, latent = inputs(4, s, tq, h, 512, 64, jnp.bfloat16, seed=31)
    codes, scale = quantize(latent.astype(jnp.float32), 512, code)
    lengths = jnp.asarray([s, 1, s // 3, s - 7], jnp.int32)
    kw = dict(sm_scale=0.07, latent_scale=scale)
    out = mla_decode_attention(q, codes, lengths, **kw)
    ref = mla_decode_attention_reference(q, codes, lengths, **kw)
    assert rel_err(out, ref) < GPU_TOL[jnp.bfloat16]
