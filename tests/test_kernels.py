"""Every Pallas kernel against its pure-jnp reference.

CPU (CI): interpret mode at tiny shapes that are not multiples of the block sizes, float32 and
bfloat16, with small blocks so that edge tiles, skipped tiles and multi-tile loops all occur.
Interpret mode pads out-of-range block reads with NaN, so a kernel that reads past an array
or leaves an output element unwritten fails the comparison.
GPU (marked `gpu`): the compiled kernels with their default block sizes at moderate shapes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    DecodeBlockSizes, FlashBlockSizes, MosaicFlashConfig, MatmulBlockSizes, decode_attention,
    decode_attention_reference, flash_attention, flash_attention_reference, rms_norm,
    rms_norm_reference, rope, rope_reference, swiglu, swiglu_reference, add_rms_norm,
    add_rms_norm_reference)
from pallas_kernels.flash_attention_mgpu import default_config as mosaic_default_config
from kernel_inputs import one_program, put
from kernel_testing import normal, rel_err

ON_GPU = jax.devices()[0].platform == "gpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")

# Relative error ||out - ref|| / ||ref||: float32 kernels land near 1e-7; bf16 operands and
# bf16 outputs (rounding of p before the PV product, of the result) near 3e-3.
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2}
# On the GPU, float32 dots run in IEEE mode, but exp2 and rsqrt are approximate.
GPU_TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1.5e-2}


def qkv(seed, b, tq, tk, hq, hkv, d, dtype):
    return (normal(seed, (b, tq, hq, d), dtype), normal(seed + 1, (b, tk, hkv, d), dtype),
            normal(seed + 2, (b, tk, hkv, d), dtype))


# The CPU tests' references, each run as one jitted program of its jnp code (kernel_inputs):
# op by op, a reference call compiled ~20 single-op programs for each new shape.
flash_ref = one_program(flash_attention_reference)
decode_ref = one_program(decode_attention_reference)
rope_ref = one_program(rope_reference)
rms_norm_ref = one_program(rms_norm_reference)
swiglu_ref = one_program(swiglu_reference)


def plus_one(x):
    """x + 1 in x's dtype, computed in numpy (in float32, rounded once to x's dtype: what
    XLA's CPU add does for bfloat16)."""
    a = np.asarray(x)
    return put((a.astype(np.float32) + np.float32(1)).astype(a.dtype))


# ---------------------------------------------------------------------------------------------
# flash attention
# ---------------------------------------------------------------------------------------------

SMALL_FLASH = FlashBlockSizes(block_q=16, block_k=16, num_warps=4, num_stages=1)

FLASH_CASES = [
    # b, tq, tk, hq, hkv, d, causal, window
    (2, 37, 37, 4, 2, 16, True, None),  # GQA 2:1, causal, ragged last tile
    (1, 21, 50, 2, 1, 32, True, None),  # Tq < Tk (chunked prefill), MQA
    (1, 21, 50, 2, 2, 16, False, None),  # non-causal, Tq < Tk
    (2, 45, 45, 4, 1, 16, True, 7),  # sliding window narrower than a tile
    (1, 13, 70, 2, 1, 16, True, 20),  # window + Tq < Tk: leading tiles skipped
    (1, 5, 5, 1, 1, 16, True, None),  # a single partial tile
]


@pytest.mark.parametrize("case, dtype", [(c, jnp.float32) for c in FLASH_CASES]
                         + [(c, jnp.bfloat16) for c in FLASH_CASES[::2]],
                         ids=lambda v: "b{}_q{}_k{}_h{}/{}_d{}_c{}_w{}".format(*v)
                         if isinstance(v, tuple) else jnp.dtype(v).name)
def test_flash_attention_interpret(case, dtype):
    b, tq, tk, hq, hkv, d, causal, window = case
    q, k, v = qkv(tq * 7 + tk, b, tq, tk, hq, hkv, d, dtype)
    out = flash_attention(q, k, v, causal=causal, sliding_window=window, interpret=True,
                          block_sizes=SMALL_FLASH)
    ref = flash_ref(q, k, v, causal=causal, sliding_window=window)
    assert out.dtype == q.dtype
    assert rel_err(out, ref) < TOL[dtype]


MOSAIC_CASES = [
    # b, tq, tk, hq, hkv, d, causal, window, pingpong
    # 3 row blocks (last ragged), GQA, pingpong, two KV-group sections in the causal block order
    (1, 300, 300, 4, 2, 64, True, None, True),
    (2, 130, 272, 1, 1, 64, True, None, False),  # Tq < Tk, ragged keys, batch 2, no pingpong
    (1, 200, 200, 2, 1, 128, False, None, True),  # non-causal, head dim 128
    (1, 100, 333, 1, 1, 64, True, 150, True),  # sliding window + Tq < Tk: leading tiles skipped
    (1, 128, 256, 2, 1, 64, False, None, True),  # non-causal, whole tiles: no masked tile at all
    (1, 50, 50, 2, 2, 64, True, None, True),  # a single KV tile (qk_pv: prologue + last step only)
]
# At block_kv = block_q = 64 the two warpgroups' own KV ranges (wg_ranges) differ by a tile in
# every causal block (warpgroup 0 ends a tile early) and in the window case (warpgroup 1 starts
# a tile late), so the cases above also run the skipped-tile barrier protocol.
MOSAIC_VARIANTS = [
    # overlap, wg_ranges
    ("none", False), ("qk_pv", False), ("qk_pv_intra", False),
    ("none", True), ("qk_pv", True), ("qk_pv_intra", True),
]
# Every case under the default variant (qk_pv, the tiles' union), every variant on the two
# cases whose tile ranges differ most (ragged keys past the queries, the window).
MOSAIC_MATRIX = ([(c, "qk_pv", False) for c in MOSAIC_CASES]
                 + [(c, o, w) for c in (MOSAIC_CASES[1], MOSAIC_CASES[3])
                    for o, w in MOSAIC_VARIANTS if (o, w) != ("qk_pv", False)])


@pytest.mark.parametrize("case,overlap,wg_ranges", MOSAIC_MATRIX, ids=lambda v: (
    "b{}_q{}_k{}_h{}/{}_d{}_c{}_w{}_pp{}".format(*v) if isinstance(v, tuple)
    else v if isinstance(v, str) else ("wgr" if v else "union")))
def test_flash_attention_mosaic_interpret(case, overlap, wg_ranges):
    """The Hopper kernel under the Mosaic GPU interpreter (simulated warpgroups, TMA, barriers).

    The interpreter runs the P @ V product from shared memory instead of registers (and keeps
    "qk_pv_intra"'s O in registers, not in an accumulator); everything else (the producer ring,
    barriers, masks, tile ranges, pingpong) is the GPU kernel's code. For the `overlap` and
    `wg_ranges` variants that covers the barrier protocol (a missing arrival or wait hangs or
    leaves a phase out of step), the pipelined carry of S across the masked / full / last tile
    ranges and the masks; not the order of the asynchronous wgmma issues and waits (the
    interpreter runs each at once).
    """
    b, tq, tk, hq, hkv, d, causal, window, pingpong = case
    q, k, v = qkv(tq + tk, b, tq, tk, hq, hkv, d, jnp.bfloat16)
    cfg = MosaicFlashConfig(block_q=64, block_kv=64, stages=2, pingpong=pingpong, overlap=overlap,
                            wg_ranges=wg_ranges)
    out = flash_attention(q, k, v, causal=causal, sliding_window=window, interpret=True,
                          backend="mosaic", mosaic_config=cfg)
    ref = flash_ref(q, k, v, causal=causal, sliding_window=window)
    assert rel_err(out, ref) < TOL[jnp.bfloat16]


@pytest.mark.parametrize("overlap", ["none", "qk_pv_intra"])
@pytest.mark.parametrize("case", [
    # b, tq, tk, hq, hkv, causal, window, pingpong (one head: the heads do not move the ranges)
    (1, 256, 320, 1, 1, True, None, True),  # Tk - Tq = 64: warpgroup 0 ends 2 tiles early
    (1, 200, 450, 1, 1, True, 100, False),  # window: warpgroup 1 starts 2 tiles late
], ids=lambda c: "b{}_q{}_k{}_h{}/{}_c{}_w{}_pp{}".format(*c))
def test_flash_attention_mosaic_wg_ranges_interpret(case, overlap):
    """wg_ranges when a warpgroup skips as many tiles as the ring has slots (block_q 128 over
    block_kv 64, 2 stages): its releases of a slot must not run ahead of the other warpgroup's
    use of the tile before in that slot (the skipped tiles' loads are waited for)."""
    b, tq, tk, hq, hkv, causal, window, pingpong = case
    q, k, v = qkv(tq + tk, b, tq, tk, hq, hkv, 64, jnp.bfloat16)
    cfg = MosaicFlashConfig(block_q=128, block_kv=64, stages=2, pingpong=pingpong,
                            overlap=overlap, wg_ranges=True)
    out = flash_attention(q, k, v, causal=causal, sliding_window=window, interpret=True,
                          backend="mosaic", mosaic_config=cfg)
    ref = flash_ref(q, k, v, causal=causal, sliding_window=window)
    assert rel_err(out, ref) < TOL[jnp.bfloat16]


def test_flash_attention_sm_scale_and_window_matter():
    q, k, v = qkv(3, 1, 20, 20, 2, 1, 16, jnp.float32)
    kw = dict(interpret=True, block_sizes=SMALL_FLASH)
    base = flash_attention(q, k, v, **kw)
    scaled = flash_attention(q, k, v, sm_scale=0.05, **kw)
    windowed = flash_attention(q, k, v, sliding_window=4, **kw)
    assert rel_err(scaled, flash_ref(q, k, v, sm_scale=0.05)) < TOL[jnp.float32]
    # The options must change the result, or the tests above could pass on a kernel ignoring them.
    assert rel_err(scaled, base) > 1e-2 and rel_err(windowed, base) > 1e-2


def test_flash_reference_matches_model_attention():
    """Cross-check our reference against the model's HF-semantics attention (independent code)."""
    from jaxinfer.ops.reference import attention_reference
    q, k, v = qkv(5, 2, 9, 23, 4, 2, 16, jnp.float32)
    q_pos = put(np.broadcast_to(np.arange(14, 23, dtype=np.int32), (2, 9)))
    kv_pos = put(np.broadcast_to(np.arange(23, dtype=np.int32), (2, 23)))
    want = one_program(attention_reference)(q, k, v, q_pos, kv_pos, window=6)
    got = flash_ref(q, k, v, causal=True, sliding_window=6)
    assert rel_err(got, want) < 1e-5


# ---------------------------------------------------------------------------------------------
# decode attention
# ---------------------------------------------------------------------------------------------

DECODE_CASES = [
    # b, s, hq, hkv, d, lengths, num_splits
    (3, 70, 8, 2, 16, (70, 1, 33), 3),  # GQA 4:1, full / single / ragged lengths
    (2, 45, 4, 4, 32, (0, 45), 2),  # MHA, an empty sequence gets zeros
    (2, 50, 6, 2, 16, (17, 49), None),  # G = 3 (not a power of two), automatic splits
    (1, 40, 2, 1, 16, (40,), 5),  # more splits than full tiles: empty chunks
]


@pytest.mark.parametrize("case, dtype", [(c, jnp.float32) for c in DECODE_CASES]
                         + [(c, jnp.bfloat16) for c in DECODE_CASES[::2]],
                         ids=lambda v: "b{}_s{}_h{}/{}_d{}_l{}_n{}".format(*v)
                         if isinstance(v, tuple) else jnp.dtype(v).name)
def test_decode_attention_interpret(case, dtype):
    b, s, hq, hkv, d, lengths, splits = case
    q = normal(s, (b, hq, d), dtype)
    k_cache = normal(s + 1, (b, s, hkv, d), dtype)
    v_cache = normal(s + 2, (b, s, hkv, d), dtype)
    lengths = put(lengths, np.int32)
    out = decode_attention(q, k_cache, v_cache, lengths, interpret=True,
                           block_sizes=DecodeBlockSizes(block_k=16, num_splits=splits,
                                                        num_stages=1))
    ref = decode_ref(q, k_cache, v_cache, lengths)
    assert out.dtype == q.dtype
    empty = np.asarray(lengths) == 0
    if empty.any():
        assert np.all(np.asarray(out, np.float32)[empty] == 0)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("window", [1, 5, 20])
def test_decode_attention_sliding_window_interpret(window):
    """Window edges inside a tile, across a chunk boundary, and wider than some sequences."""
    b, s, hq, hkv, d = 3, 60, 4, 2, 16
    q = normal(7, (b, hq, d), jnp.float32)
    k_cache = normal(8, (b, s, hkv, d), jnp.float32)
    v_cache = normal(9, (b, s, hkv, d), jnp.float32)
    lengths = put([60, 13, 37], np.int32)
    blocks = DecodeBlockSizes(block_k=16, num_splits=3, num_stages=1)
    out = decode_attention(q, k_cache, v_cache, lengths, interpret=True, block_sizes=blocks,
                           sliding_window=window)
    ref = decode_ref(q, k_cache, v_cache, lengths, sliding_window=window)
    assert rel_err(out, ref) < TOL[jnp.float32]
    full = decode_ref(q, k_cache, v_cache, lengths)
    assert rel_err(ref, full) > 1e-2  # the window changed the result


def test_decode_attention_ignores_stale_cache_slots():
    """Positions >= length must not be read: poisoning them with NaN must not change the output."""
    q = normal(1, (2, 4, 16), jnp.float32)
    k_cache = normal(2, (2, 40, 2, 16), jnp.float32)
    v_cache = normal(3, (2, 40, 2, 16), jnp.float32)
    lengths = np.asarray([23, 7], np.int32)
    stale = np.arange(40)[None, :, None, None] >= lengths[:, None, None, None]
    k_bad = put(np.where(stale, np.float32(np.nan), np.asarray(k_cache)))
    v_bad = put(np.where(stale, np.float32(np.nan), np.asarray(v_cache)))
    lengths = put(lengths)
    blocks = DecodeBlockSizes(block_k=16, num_splits=2, num_stages=1)
    out = decode_attention(q, k_bad, v_bad, lengths, interpret=True, block_sizes=blocks)
    ref = decode_ref(q, k_cache, v_cache, lengths)
    assert rel_err(out, ref) < TOL[jnp.float32]


# ---------------------------------------------------------------------------------------------
# RoPE, RMSNorm, SwiGLU
# ---------------------------------------------------------------------------------------------


def inv_freq(d: int, theta: float = 10000.0):
    return (1.0 / theta ** (np.arange(0, d, 2, dtype=np.float32) / d)).astype(np.float32)


@jax.jit
def _rope_positions():
    """test_rope_interpret's positions, one program for both dtypes."""
    return jax.random.randint(jax.random.PRNGKey(1), (2, 19), 0, 5000, jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_rope_interpret(dtype):
    x = normal(0, (2, 19, 3, 32), dtype)
    positions = _rope_positions()
    out = rope(x, positions, put(inv_freq(32)), interpret=True, block_t=8,
               attention_factor=1.2)
    ref = rope_ref(x, positions, put(inv_freq(32)), attention_factor=1.2)
    assert out.dtype == x.dtype
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(out, x) > 0.1  # rotation happened


def test_rope_reference_matches_model_rope():
    from jaxinfer.ops.reference import apply_rope
    x = normal(4, (1, 6, 2, 16), jnp.float32)
    positions = put(np.arange(6, dtype=np.int32)[None] + 100)

    @jax.jit
    def model_rope(x, positions, inv):
        angle = positions[..., None].astype(jnp.float32) * inv
        emb = jnp.concatenate([angle, angle], axis=-1)
        return apply_rope(x, 1.3 * jnp.cos(emb), 1.3 * jnp.sin(emb))

    want = model_rope(x, positions, put(inv_freq(16)))
    got = rope_ref(x, positions, put(inv_freq(16)), attention_factor=1.3)
    assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(3, 7, 40), (5, 24)], ids=["3d_d40", "2d_d24"])
def test_rms_norm_interpret(shape, dtype):
    x = normal(0, shape, dtype, scale=3.0)
    w = plus_one(normal(1, shape[-1:], dtype, scale=0.2))
    out = rms_norm(x, w, eps=1e-6, interpret=True, block_m=4)
    ref = rms_norm_ref(x, w, eps=1e-6)
    assert out.dtype == ref.dtype and out.shape == x.shape
    assert rel_err(out, ref) < TOL[dtype]


@jax.jit
def _add_rms_norm_refs(x, deltas, w):
    """add_rms_norm_reference; the model's unfused path (the sum rounded once to x's dtype)
    and its rms_norm_reference; rms_norm_reference of x without the add: one program."""
    x_ref, h_ref = add_rms_norm_reference(x, deltas, w, eps=1e-6)
    unfused = (x.astype(jnp.float32) + deltas.sum(0)).astype(x.dtype)
    return (x_ref, h_ref, unfused, rms_norm_reference(unfused, w, eps=1e-6),
            rms_norm_reference(x, w, eps=1e-6))


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_add_rms_norm_interpret(dtype, splits):
    """x + sum(deltas) and its norm in one kernel, deltas as float32 split-K partials."""
    x = normal(0, (5, 40), dtype, scale=2.0)
    deltas = normal(1, (splits, 5, 40), jnp.float32)
    w = plus_one(normal(2, (40,), dtype, scale=0.2))
    x_new, h = add_rms_norm(x, deltas, w, eps=1e-6, interpret=True, block_m=2)
    x_ref, h_ref, unfused, h_unfused, h_no_add = _add_rms_norm_refs(x, deltas, w)
    assert x_new.dtype == x.dtype and h.dtype == x.dtype and h.shape == x.shape
    assert rel_err(x_new, x_ref) < TOL[dtype] and rel_err(h, h_ref) < TOL[dtype]
    # The model's unfused path: the sum rounded once to x's dtype, then rms_norm.
    assert rel_err(x_new, unfused) < TOL[dtype]
    assert rel_err(h, h_unfused) < TOL[dtype]
    assert rel_err(h, h_no_add) > 0.1  # the add matters


def test_add_rms_norm_bad_inputs():
    x = normal(0, (4, 24), jnp.float32)
    w = put(np.ones((24,), np.float32))
    for deltas, needle in ((put(np.ones((4, 24), np.float32)), "deltas must have rank 3"),
                           (put(np.ones((2, 4, 20), np.float32)), "must be [S, *x.shape]"),
                           (put(np.ones((2, 4, 24), np.int32)), "deltas has dtype int32")):
        for fn in (add_rms_norm, add_rms_norm_reference):
            with pytest.raises(ValueError, match="add_rms_norm") as err:
                fn(x, deltas, w, eps=1e-6)
            assert needle in str(err.value)


def test_rms_norm_float32_weight_promotes():
    x = normal(0, (4, 24), jnp.bfloat16)
    w = plus_one(normal(1, (24,), jnp.float32))
    out = rms_norm(x, w, eps=1e-5, interpret=True, block_m=2)
    assert out.dtype == jnp.float32
    assert rel_err(out, rms_norm_ref(x, w, eps=1e-5)) < TOL[jnp.float32]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mkn", [(21, 40, 37), (3, 64, 32)], ids=["ragged", "decode_like"])
def test_swiglu_interpret(mkn, dtype):
    m, k, n = mkn
    x = normal(0, (m, k), dtype)
    w_gate = normal(1, (k, n), dtype, scale=k ** -0.5 * 2)
    w_up = normal(2, (k, n), dtype, scale=k ** -0.5)
    out = swiglu(x, w_gate, w_up, interpret=True,
                 block_sizes=MatmulBlockSizes(16, 16, 16, num_warps=4, num_stages=1))
    ref = swiglu_ref(x, w_gate, w_up)
    assert out.dtype == x.dtype
    assert rel_err(out, ref) < TOL[dtype]


# ---------------------------------------------------------------------------------------------
# Bad input: clear ValueErrors before lowering
# ---------------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    # The bad operands are made in numpy (`d`): an eager slice or cast compiles a program.
    f32, d = jnp.float32, put
    q, k, v = qkv(0, 1, 8, 8, 4, 2, 16, f32)
    qn, kn, vn = (np.asarray(a) for a in (q, k, v))
    cases = [
        (lambda: flash_attention(q, d(kn[..., :8]), d(vn[..., :8])), "head dim"),
        (lambda: flash_attention(d(qn[:, :, :3]), k, v), "multiple of KV heads"),
        (lambda: flash_attention(d(qn, np.int32), k, v), "dtype"),
        (lambda: flash_attention(q, d(kn, jnp.bfloat16), v), "one dtype"),
        (lambda: flash_attention(d(qn[0]), k, v), "rank 4"),
        (lambda: flash_attention(d(np.concatenate([qn, qn], 1)), k, v), "Tq <= Tk"),
        (lambda: flash_attention(q, k, v, causal=False, sliding_window=4), "causal"),
        (lambda: flash_attention(*qkv(0, 1, 8, 8, 2, 1, 24, f32)), "power of two"),
        (lambda: flash_attention(q, k, v, backend="mosaic"), "bfloat16 or float16"),
        (lambda: flash_attention(q, k, v, backend="cuda"), "backend must be"),
        (lambda: MosaicFlashConfig(overlap="qk"), "overlap='qk'"),
    ]
    qd = normal(0, (2, 4, 16), f32)
    kc = normal(1, (2, 10, 2, 16), f32)
    qdn, ok_n = np.asarray(qd), np.asarray([3, 10], np.int32)
    ok_len = d(ok_n)
    cases += [
        (lambda: decode_attention(qd, kc, kc, d([3, 11], np.int32)), "lengths must lie"),
        (lambda: decode_attention(qd, kc, kc, d(ok_n, np.float32)), "lengths has dtype"),
        (lambda: decode_attention(d(qdn[:, :3]), kc, kc, ok_len), "multiple of KV heads"),
        (lambda: decode_attention(d(qdn[..., :8]), kc, kc, ok_len), "head dim"),
        (lambda: decode_attention(d(qdn[None]), kc, kc, ok_len), "rank 3"),
        (lambda: decode_attention(qd, kc, kc, d(ok_n[:1])), "batch sizes differ"),
    ]
    x = normal(0, (1, 3, 2, 16), f32)
    xn, pos_n = np.asarray(x), np.zeros((1, 3), np.int32)
    pos = d(pos_n)

    def ones(*shape):
        return d(np.ones(shape, np.float32))

    cases += [
        (lambda: rope(x, pos, d(inv_freq(8))), "inv_freq"),
        (lambda: rope(x, d(pos_n[:, :2]), d(inv_freq(16))), "positions"),
        (lambda: rope(x, d(pos_n, np.float32), d(inv_freq(16))), "positions has dtype"),
        (lambda: rms_norm(x, ones(8), eps=1e-6), "weight has 8"),
        (lambda: swiglu(d(xn[0, 0, 0]), ones(16, 4), ones(16, 4)), "rank 2"),
        (lambda: swiglu(d(xn[0, 0]), ones(8, 4), ones(8, 4)), "K=16"),
        (lambda: swiglu(d(xn[0, 0]), ones(16, 4), ones(16, 5)), "one shape"),
    ]
    for fn, message in cases:
        with pytest.raises(ValueError, match=message):
            fn()


# ---------------------------------------------------------------------------------------------
# GPU: compiled kernels, default block sizes
# ---------------------------------------------------------------------------------------------


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", [
    (2, 300, 300, 8, 2, 128, True, None),
    (1, 200, 777, 4, 1, 64, True, None),
    (1, 333, 333, 4, 4, 128, False, None),
    (2, 500, 500, 4, 2, 128, True, 100),
    (1, 129, 129, 2, 1, 256, True, None),
], ids=str)
@pytest.mark.parametrize("backend", ["triton", "mosaic"])
def test_flash_attention_gpu(case, dtype, backend):
    b, tq, tk, hq, hkv, d, causal, window = case
    if backend == "mosaic" and dtype == jnp.float32:
        pytest.skip("the Mosaic path is 16-bit only")
    q, k, v = qkv(11, b, tq, tk, hq, hkv, d, dtype)
    out = flash_attention(q, k, v, causal=causal, sliding_window=window, backend=backend)
    ref = flash_attention_reference(q, k, v, causal=causal, sliding_window=window)
    assert rel_err(out, ref) < GPU_TOL[dtype]


@gpu
@needs_gpu
@pytest.mark.parametrize("overlap,pingpong", [("none", False), ("qk_pv", True),
                                              ("qk_pv", False)])
@pytest.mark.parametrize("case", [
    (2, 300, 300, 8, 2, 128, True, None),
    (1, 200, 777, 4, 1, 64, True, None),
    (1, 333, 333, 4, 4, 128, False, None),
    (1, 256, 512, 4, 4, 128, False, None),
    (2, 500, 500, 4, 2, 128, True, 100),
], ids=str)
def test_flash_attention_mosaic_overlap_gpu(case, overlap, pingpong):
    """The opt-in wgmma overlaps (MosaicFlashConfig.overlap) compiled: interpret mode cannot
    check the order of the asynchronous products against the barriers that release their
    operands."""
    cfg = dataclasses.replace(mosaic_default_config(case[5]), overlap=overlap, pingpong=pingpong)
    _check_mosaic_gpu(case, cfg)


def _check_mosaic_gpu(case, cfg):
    """The Mosaic kernel under `cfg` against the reference at case = (B, Tq, Tk, Hq, Hkv, D,
    causal, window), bfloat16, on the GPU."""
    b, tq, tk, hq, hkv, d, causal, window = case
    q, k, v = qkv(11, b, tq, tk, hq, hkv, d, jnp.bfloat16)
    out = flash_attention(q, k, v, causal=causal, sliding_window=window, backend="mosaic",
                          mosaic_config=cfg)
    ref = flash_attention_reference(q, k, v, causal=causal, sliding_window=window)
    assert rel_err(out, ref) < GPU_TOL[jnp.bfloat16]


@gpu
@needs_gpu
@pytest.mark.parametrize("cfg", [
    MosaicFlashConfig(64, 128, 2, False, "qk_pv_intra"),
    MosaicFlashConfig(64, 128, 2, True, "qk_pv_intra"),
    MosaicFlashConfig(64, 128, 2, False, "qk_pv", wg_ranges=True),
    MosaicFlashConfig(64, 128, 2, False, "qk_pv_intra", wg_ranges=True),
    MosaicFlashConfig(64, 64, 2, True, "none", wg_ranges=True),
    MosaicFlashConfig(64, 64, 2, False, "qk_pv_intra", wg_ranges=True),
], ids=str)
@pytest.mark.parametrize("case", [
    (2, 300, 300, 8, 2, 128, True, None),
    (1, 333, 333, 4, 4, 128, False, None),
    (2, 500, 500, 4, 2, 128, True, 100),
    (1, 448, 512, 4, 2, 128, True, None),  # Tk - Tq = 64: per-warpgroup ranges differ at kv128
    (1, 2048, 2048, 4, 1, 128, True, None),  # long loops: the steady state of the pipeline
], ids=str)
def test_flash_attention_mosaic_intra_wg_ranges_gpu(case, cfg):
    """overlap="qk_pv_intra" and wg_ranges compiled: interpret mode runs neither the
    accumulator kept across the loop nor the wait for all but the newest wgmma group (P V still
    running during the softmax), nor the timing of a warpgroup's skipped-tile releases."""
    _check_mosaic_gpu(case, cfg)


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [None, 700])
def test_decode_attention_gpu(dtype, window):
    b, s, hq, hkv, d = 5, 3000, 32, 8, 128
    q = normal(1, (b, hq, d), dtype)
    k_cache = normal(2, (b, s, hkv, d), dtype)
    v_cache = normal(3, (b, s, hkv, d), dtype)
    lengths = jnp.asarray([3000, 1, 1234, 0, 2049], jnp.int32)
    out = decode_attention(q, k_cache, v_cache, lengths, sliding_window=window)
    ref = decode_attention_reference(q, k_cache, v_cache, lengths, sliding_window=window)
    assert rel_err(out, ref) < GPU_TOL[dtype]


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_small_ops_gpu(dtype):
    x = normal(0, (2, 77, 8, 128), dtype)
    positions = jax.random.randint(jax.random.PRNGKey(1), (2, 77), 0, 30000, jnp.int32)
    freqs = jnp.asarray(inv_freq(128, 500000.0))
    assert rel_err(rope(x, positions, freqs), rope_reference(x, positions, freqs)) < GPU_TOL[dtype]
    h = normal(2, (3, 37, 576), dtype, scale=2.0)
    w = normal(3, (576,), dtype, scale=0.1) + 1
    assert rel_err(rms_norm(h, w, eps=1e-5), rms_norm_reference(h, w, eps=1e-5)) < GPU_TOL[dtype]
    for splits in (1, 4):  # the decode step's residual add + norm over split-K partials
        xr = normal(7, (1, 4096), dtype)
        deltas = normal(8 + splits, (splits, 1, 4096), jnp.float32)
        wn = normal(9, (4096,), dtype, scale=0.1) + 1
        for got, want in zip(add_rms_norm(xr, deltas, wn, eps=1e-5),
                             add_rms_norm_reference(xr, deltas, wn, eps=1e-5)):
            assert rel_err(got, want) < GPU_TOL[dtype]
    for m in (1, 7, 300):
        x2 = normal(4 + m, (m, 576), dtype)
        wg = normal(5, (576, 1536), dtype, scale=576 ** -0.5)
        wu = normal(6, (576, 1536), dtype, scale=576 ** -0.5)
        assert rel_err(swiglu(x2, wg, wu), swiglu_reference(x2, wg, wu)) < GPU_TOL[dtype]
