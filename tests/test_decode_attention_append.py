"""decode_attention_append (RoPE + write the new K/V + decode attention in one kernel, reading
the fused qkv projection) vs its reference and vs the model's unfused path.

CPU: interpret mode at shapes that are not block multiples, with new slots at 0, S-1 and on chunk
edges. Interpret mode pads out-of-range block reads with NaN, so a read past the cache fails.
GPU (marked `gpu`): the compiled kernel at Llama-3-8B decode shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import reference
from pallas_kernels.decode_attention import DecodeBlockSizes, decode_attention_reference
from pallas_kernels.decode_attention_append import (
    decode_attention_append as _append_qkv, decode_attention_append_reference as _append_ref)
from kernel_inputs import one_program, put
from kernel_testing import normal, rel_err


def pack(q, k_new, v_new):
    """q [B, Hq, D], k_new/v_new [B, Hkv, D] -> qkv [B, Hkv, G + 2, D] (the model's layout);
    made in numpy when the inputs are concrete (eagerly, each jnp op compiles a program)."""
    b, hq, d = q.shape
    hkv = k_new.shape[1]
    if any(isinstance(x, jax.core.Tracer) for x in (q, k_new, v_new)):
        return jnp.concatenate([q.reshape(b, hkv, hq // hkv, d), k_new[:, :, None],
                                v_new[:, :, None]], axis=2)
    q, k_new, v_new = (np.asarray(x) for x in (q, k_new, v_new))
    return put(np.concatenate([q.reshape(b, hkv, hq // hkv, d), k_new[:, :, None],
                                  v_new[:, :, None]], axis=2))


def decode_attention_append(q, k_new, v_new, *args, **kwargs):
    return _append_qkv(pack(q, k_new, v_new), *args, **kwargs)


def decode_attention_append_reference(q, k_new, v_new, *args, **kwargs):
    return _append_ref(pack(q, k_new, v_new), *args, **kwargs)


# The CPU tests' references, each run as one jitted program of its jnp code (kernel_inputs):
# op by op, a reference call compiled dozens of single-op programs for each new shape.
append_ref = one_program(decode_attention_append_reference)  # q, k_new, v_new, ...
qkv_append_ref = one_program(_append_ref)  # qkv (or its float32 chunks), ...
decode_ref = one_program(decode_attention_reference)

# Relative error ||out - ref|| / ||ref|| (as in test_kernels.py): float32 near 1e-7, bf16 near
# 3e-3 (p rounded before the PV product, the result rounded).
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2}
needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")


def inputs(seed, b, s, hq, hkv, d, dtype):
    return (normal(seed, (b, hq, d), dtype), normal(seed + 1, (b, hkv, d), dtype),
            normal(seed + 2, (b, hkv, d), dtype), normal(seed + 3, (b, s, hkv, d), dtype),
            normal(seed + 4, (b, s, hkv, d), dtype))


def check_caches(k_out, v_out, k_ref, v_ref, k_in, v_in, k_new, v_new, positions):
    """Caches equal the reference's bit for bit: the new slot written, the rest as given."""
    np.testing.assert_array_equal(np.asarray(k_out), np.asarray(k_ref))
    np.testing.assert_array_equal(np.asarray(v_out), np.asarray(v_ref))
    rows = np.arange(len(positions))
    pos = np.asarray(positions)
    for out, before, new in ((k_out, k_in, k_new), (v_out, v_in, v_new)):
        out, before = np.array(out), np.array(before)
        np.testing.assert_array_equal(out[rows, pos], np.asarray(new))
        out[rows, pos] = before[rows, pos]
        np.testing.assert_array_equal(out, before)  # nothing else changed


CASES = [
    # b, s, hq, hkv, d, positions, num_splits (block_k 16: chunks of 32 for s 45..70)
    (3, 70, 8, 2, 16, (69, 0, 32), 3),  # GQA 4:1; S-1, slot 0, first slot of chunk 1
    (3, 45, 4, 4, 32, (0, 44, 31), 2),  # MHA; last slot of chunk 0 (chunk 1 then empty)
    (2, 50, 6, 2, 16, (17, 49), None),  # G = 3 (not a power of two), automatic splits
    (2, 70, 8, 2, 16, (69, 5), 1),  # one chunk: the kernel normalizes, no merge
]


@pytest.mark.parametrize("case, dtype", [(c, jnp.float32) for c in CASES]
                         + [(c, jnp.bfloat16) for c in CASES[::2]],
                         ids=lambda v: "b{}_s{}_h{}/{}_d{}_p{}_n{}".format(*v)
                         if isinstance(v, tuple) else jnp.dtype(v).name)
def test_matches_reference(case, dtype):
    b, s, hq, hkv, d, positions, splits = case
    q, k_new, v_new, k_cache, v_cache = inputs(s, b, s, hq, hkv, d, dtype)
    positions = put(positions, np.int32)
    blocks = DecodeBlockSizes(block_k=16, num_splits=splits, num_stages=1)
    out, k_out, v_out = decode_attention_append(q, k_new, v_new, k_cache, v_cache, positions,
                                                interpret=True, block_sizes=blocks)
    ref, k_ref, v_ref = append_ref(q, k_new, v_new, k_cache, v_cache, positions)
    assert out.dtype == q.dtype and k_out.dtype == k_cache.dtype
    assert rel_err(out, ref) < TOL[dtype]
    check_caches(k_out, v_out, k_ref, v_ref, k_cache, v_cache, k_new, v_new, positions)


@pytest.mark.parametrize("window", [1, 20])
def test_sliding_window(window):
    """Window 1 sees the new token only (out = v_new); 20 starts mid-tile, crosses a chunk."""
    b, s, hq, hkv, d = 3, 60, 4, 2, 16
    q, k_new, v_new, k_cache, v_cache = inputs(7, b, s, hq, hkv, d, jnp.float32)
    positions = put([59, 12, 36], np.int32)
    blocks = DecodeBlockSizes(block_k=16, num_splits=2, num_stages=1)
    out, k_out, v_out = decode_attention_append(q, k_new, v_new, k_cache, v_cache, positions,
                                                sliding_window=window, interpret=True,
                                                block_sizes=blocks)
    ref, k_ref, v_ref = append_ref(q, k_new, v_new, k_cache, v_cache, positions,
                                   sliding_window=window)
    assert rel_err(out, ref) < TOL[jnp.float32]
    check_caches(k_out, v_out, k_ref, v_ref, k_cache, v_cache, k_new, v_new, positions)
    full, _, _ = append_ref(q, k_new, v_new, k_cache, v_cache, positions)
    assert rel_err(ref, full) > 1e-2  # the window changed the result
    if window == 1:
        expect = np.repeat(np.asarray(v_new), hq // hkv, axis=1)  # [B, Hq, D]
        assert rel_err(out, expect) < TOL[jnp.float32]


@pytest.mark.parametrize("blocks", [DecodeBlockSizes(block_k=16, num_splits=2, num_stages=1),
                                    DecodeBlockSizes(block_k=32, num_splits=1, num_stages=1)],
                         ids=["split2", "one_tile_spans_the_position"])
def test_never_reads_the_new_slot_or_stale_slots(blocks):
    """NaN at the slot being written and past it: the new K/V come from k_new/v_new, and slots
    > position are never used (the first tile is loaded before the position is known, so its
    stale rows are masked after the load), so the output stays finite and equal to the
    reference."""
    b, s, hq, hkv, d = 2, 40, 4, 2, 16
    q, k_new, v_new, k_cache, v_cache = inputs(3, b, s, hq, hkv, d, jnp.float32)
    positions = np.asarray([23, 16], np.int32)
    stale = np.arange(s)[None, :, None, None] >= positions[:, None, None, None]
    k_bad = put(np.where(stale, np.float32(np.nan), np.asarray(k_cache)))
    v_bad = put(np.where(stale, np.float32(np.nan), np.asarray(v_cache)))
    positions = put(positions)
    out, k_out, v_out = decode_attention_append(q, k_new, v_new, k_bad, v_bad, positions,
                                                interpret=True, block_sizes=blocks)
    ref, _, _ = append_ref(q, k_new, v_new, k_cache, v_cache, positions)
    assert rel_err(out, ref) < TOL[jnp.float32]
    _, k_ref, v_ref = append_ref(q, k_new, v_new, k_bad, v_bad, positions)
    check_caches(k_out, v_out, k_ref, v_ref, k_bad, v_bad, k_new, v_new, positions)


def test_jit_with_donated_caches_updates_in_place():
    b, s, hq, hkv, d = 2, 40, 4, 2, 16
    q, k_new, v_new, k_cache, v_cache = inputs(5, b, s, hq, hkv, d, jnp.float32)
    positions = put([39, 7], np.int32)
    step = jax.jit(functools.partial(
        decode_attention_append, interpret=True,
        block_sizes=DecodeBlockSizes(block_k=16, num_splits=2, num_stages=1)),
        donate_argnums=(3, 4))
    k_in, v_in = k_cache.copy(), v_cache.copy()
    k_ptr = k_in.unsafe_buffer_pointer()
    out, k_out, v_out = step(q, k_new, v_new, k_in, v_in, positions)
    assert k_in.is_deleted() and v_in.is_deleted()  # the donation was accepted
    assert k_out.unsafe_buffer_pointer() == k_ptr  # the cache was updated where it lay
    ref, k_ref, v_ref = append_ref(q, k_new, v_new, k_cache, v_cache, positions)
    assert rel_err(out, ref) < TOL[jnp.float32]
    check_caches(k_out, v_out, k_ref, v_ref, k_cache, v_cache, k_new, v_new, positions)


def rope_tables(positions, d, theta=10000.0):
    """HF rotate-half cos/sin [B, D] for integer positions [B] (float32)."""
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    f = np.asarray(positions)[:, None] * inv[None, :]
    emb = np.concatenate([f, f], axis=-1)
    return put(np.cos(emb), np.float32), put(np.sin(emb), np.float32)


@jax.jit
def _model_path(q, k_new, v_new, k_cache, v_cache, positions, cos, sin):
    """reference.apply_rope on q and k, an XLA scatter of k/v, then decode attention over the
    written cache: (the output, the written k cache)."""
    q_r = reference.apply_rope(q[:, None], cos[:, None], sin[:, None])[:, 0]
    k_r = reference.apply_rope(k_new[:, None], cos[:, None], sin[:, None])[:, 0]
    rows = jnp.arange(q.shape[0])
    k_model = k_cache.at[rows, positions].set(k_r)
    v_model = v_cache.at[rows, positions].set(v_new)
    return decode_attention_reference(q_r, k_model, v_model, positions + 1), k_model


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_rope_matches_the_model_path(dtype):
    """RoPE inside the kernel vs the model's unfused path: reference.apply_rope on q and k, an XLA
    scatter of k/v, then decode attention over the written cache."""
    b, s, hq, hkv, d = 3, 70, 8, 2, 32
    q, k_new, v_new, k_cache, v_cache = inputs(21, b, s, hq, hkv, d, dtype)
    positions = put([69, 0, 40], np.int32)
    cos, sin = rope_tables(positions, d)
    blocks = DecodeBlockSizes(block_k=16, num_splits=3, num_stages=1)
    out, k_out, v_out = decode_attention_append(q, k_new, v_new, k_cache, v_cache, positions,
                                                rope=(cos, sin), interpret=True,
                                                block_sizes=blocks)
    ref, k_ref, v_ref = append_ref(q, k_new, v_new, k_cache, v_cache, positions,
                                   rope=(cos, sin))
    assert rel_err(out, ref) < TOL[dtype]
    # The rotated key may differ from the reference's in the last bit (operation order).
    assert rel_err(k_out, k_ref) < {jnp.float32: 1e-6, jnp.bfloat16: 2e-3}[dtype]
    np.testing.assert_array_equal(np.asarray(v_out), np.asarray(v_ref))
    # The model's unfused path (rounding in x's dtype, as HF does).
    model, k_model = _model_path(q, k_new, v_new, k_cache, v_cache, positions, cos, sin)
    assert rel_err(out, model) < TOL[dtype]
    assert rel_err(k_out, k_model) < TOL[dtype] / 10
    plain, _, _ = append_ref(q, k_new, v_new, k_cache, v_cache, positions)
    assert rel_err(plain, ref) > 0.05  # RoPE changed the result: the check can fail


@pytest.mark.parametrize("kernel", ["append", "plain"])
def test_fixed_size_chunks_make_a_row_independent_of_the_batch(kernel):
    """split_keys: chunks of a fixed number of keys merged in order, so a row's output is the
    same bits alone with a short cache (2 chunks) and beside another row with a longer one (4
    chunks, the last empty for it); and it is still the right attention."""
    from pallas_kernels import decode_attention

    blocks = DecodeBlockSizes(block_k=16, num_stages=1, split_keys=32)
    b, s, hq, hkv, d, dtype = 2, 128, 4, 2, 32, jnp.bfloat16
    q, k_new, v_new, k_cache, v_cache = inputs(31, b, s, hq, hkv, d, dtype)
    positions = np.asarray([120, 50], np.int32)
    # The rows and slots cut in numpy (eager slices compile a program each).
    qn, kn, vn, kc, vc = (np.asarray(x) for x in (q, k_new, v_new, k_cache, v_cache))

    def run(rows, length):
        if kernel == "append":
            return decode_attention_append(put(qn[rows]), put(kn[rows]), put(vn[rows]),
                                           put(kc[rows, :length]), put(vc[rows, :length]),
                                           put(positions[rows]), interpret=True,
                                           block_sizes=blocks)[0]
        return decode_attention(put(qn[rows]), put(kc[rows, :length]),
                                put(vc[rows, :length]), put(positions[rows] + 1),
                                interpret=True, block_sizes=blocks)

    both, alone = run(slice(0, 2), s), run(slice(1, 2), 64)
    np.testing.assert_array_equal(np.asarray(both)[1], np.asarray(alone)[0])
    if kernel == "append":
        ref = append_ref(q, k_new, v_new, k_cache, v_cache, put(positions))[0]
    else:
        ref = decode_ref(q, k_cache, v_cache, put(positions + 1))
    assert rel_err(both, ref) < TOL[dtype]


def split_chunks(qkv, seed):
    """qkv [B, Hkv, G + 2, D] as two float32 chunks [2, ...] whose sum is exactly qkv in float32
    (as a split-K matmul's partials would be; two terms, so the order of the sum is moot).
    Made in numpy (the same float32 difference)."""
    a = np.asarray(normal(seed, qkv.shape, jnp.float32))
    return put(np.stack([a, np.asarray(qkv).astype(np.float32) - a]))


@pytest.mark.parametrize("splits", [1, 2])
def test_partials_input_is_summed_in_the_kernel(splits):
    """qkv as float32 split-K chunks [S, B, Hkv, G + 2, D]: the kernel sums and rounds them to
    the cache dtype; the result equals the kernel on the rounded sum, bit for bit in the caches."""
    b, s, hq, hkv, d, dtype = 2, 70, 8, 2, 32, jnp.bfloat16
    q, k_new, v_new, k_cache, v_cache = inputs(31, b, s, hq, hkv, d, dtype)
    positions = put([69, 20], np.int32)
    rope = rope_tables(positions, d)
    blocks = DecodeBlockSizes(block_k=16, num_splits=splits, num_stages=1)
    # float32 values between bfloat16 ones: the one rounding of the sum is exercised (made in
    # numpy: the same float32 product and sum)
    qkv = put(np.asarray(pack(q, k_new, v_new)).astype(np.float32) + np.float32(1e-3)
                 * np.asarray(normal(32, (b, hkv, hq // hkv + 2, d), jnp.float32)))
    parts = split_chunks(qkv, 33)
    summed = put(np.asarray(parts).sum(axis=0).astype(dtype))
    call = functools.partial(_append_qkv, rope=rope, interpret=True, block_sizes=blocks)
    out, k_out, v_out = call(parts, k_cache, v_cache, positions)
    want, k_want, v_want = call(summed, k_cache, v_cache, positions)
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(k_out), np.asarray(k_want))
    np.testing.assert_array_equal(np.asarray(v_out), np.asarray(v_want))
    ref, k_ref, _ = qkv_append_ref(parts, k_cache, v_cache, positions, rope=rope)
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(k_out, k_ref) < 2e-3


def test_deferred_norm_scales_the_summed_parts():
    """norm=(sums of squares, K, eps): the chunks of (x * w_norm) @ w from norm_matmul are
    summed, scaled by the rsqrt and rounded once: the same as the kernel on the projection of
    the normed x (within one bf16 rounding of the projection)."""
    from pallas_kernels.norm_matmul import apply_norm_partials, norm_matmul, MatmulBlockSizes

    b, s, hq, hkv, d, dtype = 2, 40, 4, 2, 32, jnp.bfloat16
    _, _, _, k_cache, v_cache = inputs(41, b, s, hq, hkv, d, dtype)
    positions = put([39, 7], np.int32)
    rope = rope_tables(positions, d)
    hidden = 96
    # Made in numpy: the same float32 products and sums, cast once (round to nearest even).
    f32 = np.float32
    scale = np.asarray([[0.2], [3.0]], f32)  # rows at different scales: the norm is per row
    x = put((scale * np.asarray(normal(42, (b, hidden), jnp.float32))).astype(dtype))
    nw = put((f32(1.0) + f32(0.3) * np.asarray(normal(43, (hidden,), jnp.float32)))
                .astype(dtype))
    w = put((np.asarray(normal(44, (hidden, hkv, hq // hkv + 2, d), jnp.float32))
                / f32(np.sqrt(hidden))).astype(dtype))
    blocks = MatmulBlockSizes(block_m=16, block_n=32, block_k=32, num_stages=1, split_k=2)
    parts, ss = norm_matmul(x, nw, w, eps=1e-5, partials=True, interpret=True,
                            block_sizes=blocks)
    norm = (ss, hidden, 1e-5)
    call = functools.partial(_append_qkv, rope=rope, interpret=True,
                             block_sizes=DecodeBlockSizes(block_k=16, num_stages=1))
    out, k_out, _ = call(parts, k_cache, v_cache, positions, norm=norm)
    normed = one_program(lambda p, s: apply_norm_partials(p, s, hidden, 1e-5).astype(dtype))
    want, k_want, _ = call(normed(parts, ss), k_cache, v_cache, positions)
    assert rel_err(out, want) < 1e-2 and rel_err(k_out, k_want) < 1e-2
    ref, k_ref, _ = qkv_append_ref(parts, k_cache, v_cache, positions, rope=rope, norm=norm)
    assert rel_err(out, ref) < TOL[dtype] and rel_err(k_out, k_ref) < 1e-2
    unscaled, _, _ = call(parts, k_cache, v_cache, positions)
    assert rel_err(unscaled, want) > 0.05  # the scale matters
    # Sums of squares with more columns than rows (the Mosaic kernel's 8): the first B read.
    ssn = np.asarray(ss)
    wide = put(np.pad(ssn, ((0, 0), (0, 3)), constant_values=1e9))
    np.testing.assert_array_equal(call(parts, k_cache, v_cache, positions,
                                       norm=(wide, hidden, 1e-5))[0], out)
    wide_ref = qkv_append_ref(parts, k_cache, v_cache, positions, rope=rope,
                              norm=(wide, hidden, 1e-5))[0]
    np.testing.assert_array_equal(wide_ref, ref)
    for bad, message in (((put(ssn[:1]), hidden, 1e-5), r"must be \[S, B'\]"),
                         ((put(ssn[:, :-1]), hidden, 1e-5), r"B' >= B"),
                         ((ss, 0, 1e-5), "K must be >= 1"), ((ss,), r"\(sums of squares")):
        with pytest.raises(ValueError, match=message):
            call(parts, k_cache, v_cache, positions, norm=bad)
    with pytest.raises(ValueError, match="float32 partial sums"):
        call(want, k_cache, v_cache, positions, norm=norm)
    # norm=(the input rows, eps): the kernel sums their squares itself (hidden 96: padded to
    # a 128-wide row, the tail masked); the same result as from the matmul's sums.
    rows_out, rows_k, _ = call(parts, k_cache, v_cache, positions, norm=(x, 1e-5))
    assert rel_err(rows_out, out) < 1e-2 and rel_err(rows_k, k_out) < 1e-2
    rows_ref = qkv_append_ref(parts, k_cache, v_cache, positions, rope=rope, norm=(x, 1e-5))[0]
    assert rel_err(rows_out, rows_ref) < TOL[dtype]
    with pytest.raises(ValueError, match=r"input rows must be \[B, K\]"):
        call(parts, k_cache, v_cache, positions, norm=(put(np.asarray(x)[:1]), 1e-5))


def test_bad_inputs_raise():
    # The bad operands are made in numpy (`d`): an eager slice or cast compiles a program.
    f32, d = jnp.float32, put
    q, k_new, v_new, k_cache, v_cache = inputs(0, 2, 10, 4, 2, 16, f32)
    qkv = pack(q, k_new, v_new)
    pos_n = np.asarray([3, 9], np.int32)
    pos = d(pos_n)
    cos, sin = rope_tables(pos, 16)
    qkv_n, kc, vc = (np.asarray(x) for x in (qkv, k_cache, v_cache))
    call = functools.partial(_append_qkv, interpret=True)
    cases = [
        (lambda: call(qkv, k_cache, v_cache, d([3, 10], np.int32)),
         r"positions must lie in \[0, 10\)"),
        (lambda: call(qkv, k_cache, v_cache, d([-1, 2], np.int32)),
         "positions must lie"),
        (lambda: call(qkv, k_cache, v_cache, d(pos_n, np.float32)), "positions has dtype"),
        (lambda: call(qkv, k_cache, v_cache, d(pos_n[:1])), "batch sizes differ"),
        (lambda: call(d(qkv_n[:, :1]), k_cache, v_cache, pos), "does not match the caches"),
        (lambda: call(d(qkv_n[:, :, :2]), k_cache, v_cache, pos), "G >= 1 query rows"),
        (lambda: call(d(qkv_n[0]), k_cache, v_cache, pos), "qkv must have rank 4"),
        (lambda: call(d(qkv_n, jnp.bfloat16), k_cache, v_cache, pos), "one dtype"),
        (lambda: call(qkv, k_cache, d(vc[:, :5]), pos), "one shape"),
        (lambda: call(d(qkv_n[..., :8]), d(kc[..., :8]), d(vc[..., :8]), pos), "head dim"),
        (lambda: call(qkv, k_cache, v_cache, pos, sliding_window=0), "sliding_window"),
        (lambda: call(qkv, k_cache, v_cache, pos, rope=(d(np.asarray(cos)[:, :8]), sin)),
         "rope cos must have"),
        (lambda: call(qkv, k_cache, v_cache, pos, rope=cos), r"\(cos, sin\) pair"),
        (lambda: _append_ref(qkv, k_cache, v_cache, d(pos_n + 1)), "positions must lie"),
        (lambda: call(d(qkv_n[None], jnp.bfloat16), k_cache, v_cache, pos),
         "float32 partial sums"),
        (lambda: call(d(qkv_n[None, :, :1]), k_cache, v_cache, pos), "does not match the caches"),
    ]
    for fn, message in cases:
        with pytest.raises(ValueError, match=message):
            fn()


# ---------------------------------------------------------------------------------------------
# GPU: the compiled kernel at Llama-3-8B decode shapes
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("window", [None, 4096])
@pytest.mark.parametrize("position", [0, 5000, 8191])
def test_decode_attention_append_gpu(position, window, rope):
    b, s, hq, hkv, d, dtype = 2, 8192, 32, 8, 128, jnp.bfloat16
    q, k_new, v_new, k_cache, v_cache = inputs(11, b, s, hq, hkv, d, dtype)
    positions = jnp.asarray([position, s - 1 - position], jnp.int32)
    tables = rope_tables(positions, d, 500000.0) if rope else None
    ref, k_ref, v_ref = decode_attention_append_reference(
        q, k_new, v_new, k_cache, v_cache, positions, sliding_window=window, rope=tables)
    step = jax.jit(functools.partial(_append_qkv, sliding_window=window, rope=tables),
                   donate_argnums=(1, 2))
    qkv = pack(q, k_new, v_new)
    k_in, v_in = k_cache.copy(), v_cache.copy()
    k_ptr = k_in.unsafe_buffer_pointer()
    out, k_out, v_out = step(qkv, k_in, v_in, positions)
    assert k_out.unsafe_buffer_pointer() == k_ptr  # written in place, no copy of the cache
    assert rel_err(out, ref) < TOL[dtype]
    if rope:  # the rotated key may differ from the reference's in the last bit
        assert rel_err(k_out, k_ref) < 2e-3
    else:
        np.testing.assert_array_equal(np.asarray(k_out), np.asarray(k_ref))
    np.testing.assert_array_equal(np.asarray(v_out), np.asarray(v_ref))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("s", [512, 8192])
def test_decode_attention_append_partials_gpu(s):
    """The model's B=1 decode call: the q/k/v projection's float32 chunks summed in the kernel;
    S=512 runs unsplit (the kernel normalizes), S=8192 split with the merge."""
    b, hq, hkv, d, dtype = 1, 32, 8, 128, jnp.bfloat16
    q, k_new, v_new, k_cache, v_cache = inputs(13, b, s, hq, hkv, d, dtype)
    positions = jnp.asarray([s - 100], jnp.int32)
    tables = rope_tables(positions, d, 500000.0)
    parts = split_chunks(pack(q, k_new, v_new), 14)
    ref, k_ref, v_ref = _append_ref(parts, k_cache, v_cache, positions, rope=tables)
    out, k_out, v_out = jax.jit(functools.partial(_append_qkv, rope=tables),
                                donate_argnums=(1, 2))(parts, k_cache.copy(), v_cache.copy(),
                                                       positions)
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(k_out, k_ref) < 2e-3
    np.testing.assert_array_equal(np.asarray(v_out), np.asarray(v_ref))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("s", [512, 2048])
def test_deferred_norm_gpu(s):
    """The model's B=1 call with the boundaries in the consumers (the default policy): the
    chunks' sum scaled by the deferred norm, unsplit (S=512) and split (S=2048)."""
    b, hq, hkv, d, dtype = 1, 32, 8, 128, jnp.bfloat16
    q, k_new, v_new, k_cache, v_cache = inputs(15, b, s, hq, hkv, d, dtype)
    positions = jnp.asarray([s - 100], jnp.int32)
    tables = rope_tables(positions, d, 500000.0)
    parts = split_chunks(pack(q, k_new, v_new), 16)
    ss = jnp.abs(normal(17, (2, b), jnp.float32)) * 4096
    norm = (ss, 4096, 1e-5)
    out, k_out, _ = jax.jit(functools.partial(_append_qkv, rope=tables, norm=norm))(
        parts, k_cache, v_cache, positions)
    ref, k_ref, _ = _append_ref(parts, k_cache, v_cache, positions, rope=tables, norm=norm)
    assert rel_err(out, ref) < TOL[dtype] and rel_err(k_out, k_ref) < 2e-3
