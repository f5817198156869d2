"""paged_decode_attention and paged_decode_attention_append vs their references and vs the
contiguous kernels on the same data laid out contiguously.

CPU: interpret mode at tiny shapes that are not tile multiples, pages placed in a random
permutation of the pool, two rows sharing their first physical pages, idle / length-0 rows
and unused table entries on the null page 0, which is filled with NaN: a valid result that
read it would be NaN (the references get a zeroed null page: their masked p = 0 times NaN
would be NaN). With equal block sizes the paged kernels equal the contiguous ones on the
gathered rows bit for bit in interpret mode (same tiles, same chunks, same merge). Also the
kernels lowered for an H200 (test_gpu_lowering.py's check) and, marked `gpu`, run on one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_inputs import one_program, put
from kernel_testing import normal, rel_err
from pallas_kernels.decode_attention import DecodeBlockSizes, decode_attention
from pallas_kernels.decode_attention_append import decode_attention_append
from pallas_kernels.kv_quant import quantize_kv
from pallas_kernels.paged_attention import (
    gather_pages, paged_decode_attention, paged_decode_attention_append,
    paged_decode_attention_append_reference, paged_decode_attention_reference)
from test_decode_attention_append import rope_tables, split_chunks

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2}
GPU_TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1.5e-2}
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
F32, BF16 = jnp.float32, jnp.bfloat16
CODES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def block_tables(seed, lengths, page_size, *, extra=1, share=0):
    """[B, max_pages] int32 and the pool size: each row gets cdiv(length, page_size) pages
    drawn from a random permutation of pages 1..P-1 (one spare page stays unused), `extra`
    unused entries past the longest row, row 2 reuses row 0's first `share` pages; unused
    entries point at the null page 0."""
    need = [-(-int(n) // page_size) for n in np.asarray(lengths)]
    max_pages = max(need) + extra
    pool = sum(need) + 2
    free = iter(np.random.default_rng(seed).permutation(np.arange(1, pool)))
    bt = np.zeros((len(lengths), max_pages), np.int32)
    for b, n in enumerate(need):
        for j in range(n):
            bt[b, j] = bt[0, j] if b == 2 and j < share else next(free)
    return put(bt), pool


# Inputs are made in numpy and references run as one jitted program each (kernel_inputs):
# eagerly, every .at[].set, cast, gather and reference op compiled a program per shape.


def replaced(x, index, value):
    """x.at[index].set(value), made in numpy."""
    a = np.array(x)
    a[index] = value
    return put(a)


def pools(seed, pool, page_size, hkv, d, dtype, code=None):
    """k, v pools [P, page_size, Hkv, D] (codes and scales [P, page_size, Hkv] for a code
    dtype) with the null page 0 NaN (codes: NaN scales)."""
    out = []
    for i in (0, 1):
        x = normal(seed + i, (pool, page_size, hkv, d), F32)
        if code is None:
            out.append(replaced(np.asarray(x).astype(dtype), 0, np.nan))
        else:
            codes, scale = quantize(x, code)
            out.append((codes, replaced(scale, 0, np.nan)))
    return out


def clean(x):
    """The pool with a zeroed null page (what the references get)."""
    return None if x is None else replaced(x, 0, 0)


def gathered(pages, block_tables, to_device=True):
    """gather_pages(pages, block_tables) in numpy: each row's pages as one contiguous view
    [B, max_pages * page_size, ...] (pure data movement: the same bits)."""
    p, bt = np.asarray(pages), np.asarray(block_tables)
    rows = p[bt].reshape(bt.shape[0], bt.shape[1] * p.shape[1], *p.shape[2:])
    return put(rows) if to_device else rows


quantize = one_program(quantize_kv)
paged_ref = one_program(paged_decode_attention_reference)
paged_append_ref = one_program(paged_decode_attention_append_reference)


def assert_same(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------

# (dtype, page_size, block sizes, D, Hq, Hkv): a tile over 4 pages (gather), a page of two
# tiles, one tile per page in 3 splits, and D 256 at GQA 2.
DECODE_CASES = [
    (F32, 16, DecodeBlockSizes(block_k=64), 64, 8, 2),
    (BF16, 32, DecodeBlockSizes(block_k=16), 64, 4, 2),
    (F32, 16, DecodeBlockSizes(block_k=16, num_splits=3), 64, 2, 2),
    (BF16, 16, None, 256, 2, 1),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{jnp.dtype(c[0]).name}-p{c[1]}-"
                         f"{c[2].block_k if c[2] else 'default'}-d{c[3]}-g{c[4] // c[5]}")
def test_paged_decode_matches_reference_and_contiguous(case):
    dtype, page_size, blocks, d, hq, hkv = case
    lengths = put([45, 0, 77, 17], np.int32)
    bt, pool = block_tables(1, lengths, page_size, share=1)
    k, v = pools(2, pool, page_size, hkv, d, dtype)
    q = normal(4, (4, hq, d), dtype)
    out = paged_decode_attention(q, k, v, bt, lengths, block_sizes=blocks, interpret=True)
    ref = paged_ref(q, clean(k), clean(v), bt, lengths)
    assert rel_err(out, ref) < TOL[dtype]
    assert not np.asarray(out)[1].any()  # length 0: zeros
    contiguous = decode_attention(q, gathered(k, bt), gathered(v, bt), lengths,
                                  block_sizes=blocks, interpret=True)
    assert_same(out, contiguous)


def test_paged_decode_window_and_softcap_read_only_the_window():
    """A sliding window skips whole pages below it: those pages are NaN here and the result is
    still the reference's (the one tile straddling the window's start is masked)."""
    page_size, hkv, d, window = 16, 2, 64, 20
    lengths = put([70, 9, 33], np.int32)
    bt, pool = block_tables(5, lengths, page_size)
    k, v = pools(6, pool, page_size, hkv, d, F32)
    q = normal(8, (3, 4, d), F32, scale=3.0)
    call = functools.partial(paged_decode_attention, sliding_window=window, softcap=2.0,
                             block_sizes=DecodeBlockSizes(block_k=16), interpret=True)
    ref = paged_ref(q, clean(k), clean(v), bt, lengths, sliding_window=window, softcap=2.0)
    unseen = np.asarray(bt)[0, :(70 - window) // page_size]  # row 0's pages below its window
    k_hidden, v_hidden = (replaced(x, unseen, np.nan) for x in (k, v))
    out = call(q, k_hidden, v_hidden, bt, lengths)
    assert rel_err(out, ref) < TOL[F32]
    assert rel_err(out, paged_ref(q, clean(k), clean(v), bt, lengths)) > 1e-2  # the window matters
    assert_same(out, decode_attention(q, gathered(k_hidden, bt), gathered(v_hidden, bt),
                                      lengths, sliding_window=window, softcap=2.0,
                                      block_sizes=DecodeBlockSizes(block_k=16), interpret=True))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_paged_decode_quantized(kind):
    page_size, hkv, d = 16, 2, 64
    lengths = put([50, 3, 0], np.int32)
    bt, pool = block_tables(9, lengths, page_size)
    (k, ks), (v, vs) = pools(10, pool, page_size, hkv, d, None, CODES[kind])
    q = normal(12, (3, 4, d), BF16)
    blocks = DecodeBlockSizes(block_k=32)
    out = paged_decode_attention(q, k, v, bt, lengths, k_scale=ks, v_scale=vs,
                                 block_sizes=blocks, interpret=True)
    ref = paged_ref(q, k, v, bt, lengths, k_scale=clean(ks), v_scale=clean(vs))
    assert rel_err(out, ref) < TOL[BF16]
    g = functools.partial(gathered, block_tables=bt)
    assert_same(out, decode_attention(q, g(k), g(v), lengths, k_scale=g(ks), v_scale=g(vs),
                                      block_sizes=blocks, interpret=True))


def test_split_keys_make_a_row_independent_of_the_batch_and_the_table():
    """Fixed-size chunks merged in order: a row's bits do not depend on the other rows, the
    table's width (max_pages) or where its pages sit in the pool."""
    page_size, hkv, d = 16, 1, 64
    blocks = DecodeBlockSizes(block_k=16, split_keys=32)
    lengths = np.asarray([61, 100, 5], np.int32)
    bt, pool = block_tables(13, lengths, page_size, extra=3)
    k, v = pools(14, pool, page_size, hkv, d, F32)
    q = normal(16, (3, 2, d), F32)
    out = paged_decode_attention(q, k, v, bt, put(lengths), block_sizes=blocks,
                                 interpret=True)
    # Row 0 alone, its pages moved to other pool slots, a table just wide enough.
    moved = np.random.default_rng(17).permutation(pool - 1) + 1
    # old page i now at moved[i - 1]
    k2, v2 = (replaced(x, moved, np.asarray(x)[1:]) for x in (k, v))
    bt0 = put(moved[np.asarray(bt)[:1, :4] - 1], np.int32)
    alone = paged_decode_attention(put(np.asarray(q)[:1]), k2, v2, bt0, put(lengths[:1]),
                                   block_sizes=blocks, interpret=True)
    assert_same(alone, np.asarray(out)[:1])


def test_bad_inputs_raise():
    import pallas_kernels as pk

    assert pk.paged_decode_attention is paged_decode_attention  # exported
    assert "paged_decode_attention_append_reference" in pk.__all__
    # The bad operands are made in numpy: an eager slice, cast or .at[].set compiles a program.
    qn, kn = np.zeros((2, 4, 64), np.float32), np.zeros((5, 16, 2, 64), np.float32)
    q, k = put(qn), put(kn)
    bt = put(np.zeros((2, 3), np.int32))
    n = put([3, 48], np.int32)
    call = functools.partial(paged_decode_attention, interpret=True)
    for args, message in (((q, put(kn[:, :8]), put(kn[:, :8]), bt, n), "page_size 8"),
                          ((q, k, k, replaced(bt, (0, 0), 5), n), r"block_tables entries"),
                          ((q, k, k, bt, replaced(n, 1, 49)), r"lengths must lie in \[0, 48\]"),
                          ((q, k, put(kn, BF16), bt, n), "one shape|differ"),
                          ((put(qn[:1]), k, k, bt, n), "batch sizes differ")):
        with pytest.raises(ValueError, match=message):
            call(*args)
    qkv = put(np.zeros((2, 2, 4, 64), np.float32))
    with pytest.raises(ValueError, match="positions must lie"):
        paged_decode_attention_append(qkv, k, k, bt, put([0, 48], np.int32),
                                      interpret=True)


# ---------------------------------------------------------------------------------------------
# Append
# ---------------------------------------------------------------------------------------------


def append_case(seed, page_size, hq, hkv, d, dtype, positions, code=None, share=1):
    """qkv [B, Hkv, G + 2, D], the pools (NaN null page), the table for slots [0, pos]."""
    bt, pool = block_tables(seed, np.maximum(np.asarray(positions) + 1, 0), page_size,
                            share=share)
    qkv = normal(seed + 1, (len(positions), hkv, hq // hkv + 2, d), dtype)
    return qkv, pools(seed + 2, pool, page_size, hkv, d, dtype, code), bt


def check_append(got, want, contiguous, given, bt, positions, dtype):
    """got vs the reference (out to tolerance, the pools bit for bit, the null page as given)
    and vs the contiguous kernel on the gathered rows (bit for bit, active rows)."""
    out, *new = got
    ref, *ref_new = want
    assert rel_err(out, ref) < TOL[dtype]
    active = np.asarray(positions) >= 0
    assert not np.asarray(out)[~active].any()  # idle rows: zeros
    for x, r, x0 in zip(new, ref_new, given):
        x, r, x0 = np.asarray(x), np.asarray(r), np.asarray(x0)
        assert_same(x[1:], r[1:])
        assert_same(x[0], x0[0])
    c_out, *c_new = contiguous
    assert_same(np.asarray(out)[active], np.asarray(c_out)[active])
    for x, c in zip(new, c_new):
        assert_same(gathered(x, bt, to_device=False)[active], np.asarray(c)[active])

def test_paged_layer_append_writes_its_donated_pool_in_place():
    """The references' step (append, then gather the rows' pages) on a donated pool holds no
    copy of it. One row is the case: its scatter is a dynamic-update-slice, which XLA's CPU
    backend fused into each reader on a copy of the whole pool (the embedded model's engine
    decode step, one request, 3 GB of pages: ~2 s, against 28 ms without the copies)."""
    from jaxinfer.cache import PagedKVLayer

    p, ps, h, d, b, w = 2048, 16, 2, 16, 1, 8
    pool = np.zeros((p, ps, h, d), np.float32)
    layer = PagedKVLayer(k=put(pool), v=put(pool),
                         block_tables=put(np.arange(1, 1 + b * w, dtype=np.int32).reshape(b, w)))

    def step(layer, q, k, v, positions):
        layer = layer.append(k, v, positions)
        keys, values = layer.contiguous()  # [B, W * ps, H, D]
        scores = jnp.einsum("bthd,bshd->bths", q, keys)
        return layer, jnp.einsum("bths,bshd->bthd", jax.nn.softmax(scores, -1), values)

    x = jax.ShapeDtypeStruct((b, 1, h, d), jnp.float32)
    positions = jax.ShapeDtypeStruct((b, 1), jnp.int32)
    compiled = jax.jit(step, donate_argnums=0).lower(layer, x, x, x, positions).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < pool.nbytes // 8


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_paged_append_matches_reference_and_contiguous(dtype):
    """RoPE, GQA 4, page 16 under 64-key tiles: new slots at a page's first row, at 0, mid-page;
    an idle row (-1); rows 0 and 2 share their first page (read, never written)."""
    positions = put([32, -1, 69, 0], np.int32)
    qkv, (k, v), bt = append_case(20, 16, 8, 2, 64, dtype, positions)
    rope = rope_tables(np.maximum(positions, 0), 64)
    call = functools.partial(paged_decode_attention_append, rope=rope, interpret=True)
    got = call(qkv, k, v, bt, positions)
    want = paged_append_ref(qkv, clean(k), clean(v), bt, positions, rope=rope)
    contiguous = decode_attention_append(qkv, gathered(k, bt), gathered(v, bt),
                                         put(np.maximum(positions, 0)), rope=rope,
                                         interpret=True)
    check_append(got, want, contiguous, (k, v), bt, positions, dtype)


def test_paged_append_window_softcap_split():
    """Split-K with a window and a soft-cap: 6 chunks of 16 slots, each half a page of 32."""
    positions = put([47, 20, -1], np.int32)
    qkv, (k, v), bt = append_case(30, 32, 4, 2, 64, F32, positions, share=0)
    kw = dict(sliding_window=24, softcap=3.0,
              block_sizes=DecodeBlockSizes(block_k=16, num_splits=6))
    got = paged_decode_attention_append(qkv, k, v, bt, positions, interpret=True, **kw)
    want = paged_append_ref(qkv, clean(k), clean(v), bt, positions, **kw)
    contiguous = decode_attention_append(qkv, gathered(k, bt), gathered(v, bt),
                                         put(np.maximum(positions, 0)), interpret=True, **kw)
    check_append(got, want, contiguous, (k, v), bt, positions, F32)


def test_paged_append_quantized_split_keys_d256():
    """int8 codes at D 256 (GQA 2), fixed-size chunks of two pages, a page of two tiles."""
    positions = put([40, -1, 63], np.int32)
    qkv, ((k, ks), (v, vs)), bt = append_case(40, 32, 2, 1, 256, BF16, positions, CODES["int8"])
    blocks = DecodeBlockSizes(block_k=16, split_keys=64)
    got = paged_decode_attention_append(qkv, k, v, bt, positions, k_scale=ks, v_scale=vs,
                                        block_sizes=blocks, interpret=True)
    want = paged_append_ref(qkv, k, v, bt, positions, k_scale=clean(ks), v_scale=clean(vs))
    g = functools.partial(gathered, block_tables=bt)
    contiguous = decode_attention_append(qkv, g(k), g(v), put(np.maximum(positions, 0)),
                                         k_scale=g(ks), v_scale=g(vs), block_sizes=blocks,
                                         interpret=True)
    check_append(got, want, contiguous, (k, v, ks, vs), bt, positions, BF16)


def test_paged_append_partials_with_deferred_norm():
    """qkv as a normed projection's float32 split-K chunks with their sums of squares."""
    positions = put([16, 50], np.int32)
    qkv, (k, v), bt = append_case(50, 16, 4, 2, 64, BF16, positions, share=0)
    parts = split_chunks(qkv, 53)  # float32 chunks
    norm = (put([[3.0, 50.0], [4.0, 30.0]], np.float32), 96, 1e-5)  # [S, B]
    call = functools.partial(paged_decode_attention_append, norm=norm, interpret=True)
    got = call(parts, k, v, bt, positions)
    want = paged_append_ref(parts, clean(k), clean(v), bt, positions, norm=norm)
    contiguous = decode_attention_append(parts, gathered(k, bt), gathered(v, bt),
                                         positions, norm=norm, interpret=True)
    check_append(got, want, contiguous, (k, v), bt, positions, BF16)


# ---------------------------------------------------------------------------------------------
# Lowered for an H200 (no GPU needed), and run on one
# ---------------------------------------------------------------------------------------------

S = jax.ShapeDtypeStruct
I32 = jnp.int32
LOWERING_CASES = {
    # page 16 (a gather per tile), 64 (one page per tile) and 128 (two tiles per page) at the
    # benchmark's 64 rows x 16k slots, GQA 4, D 128
    **{f"decode p{p}": (
        lambda q, k, v, bt, n: paged_decode_attention(q, k, v, bt, n),
        (S((64, 32, 128), BF16), S((8192 * 16 // p, p, 8, 128), BF16),
         S((8192 * 16 // p, p, 8, 128), BF16), S((64, 16384 // p), I32), S((64,), I32)))
       for p in (16, 64, 128)},
    "decode int8 window softcap d256": (
        lambda q, k, v, ks, vs, bt, n: paged_decode_attention(
            q, k, v, bt, n, k_scale=ks, v_scale=vs, sliding_window=1000, softcap=50.0),
        (S((4, 16, 256), BF16), S((600, 16, 8, 256), jnp.int8), S((600, 16, 8, 256), jnp.int8),
         S((600, 16, 8), F32), S((600, 16, 8), F32), S((4, 150), I32), S((4,), I32))),
    "append rope split": (
        lambda qkv, k, v, bt, p, c, s: paged_decode_attention_append(qkv, k, v, bt, p,
                                                                     rope=(c, s)),
        (S((64, 8, 6, 128), BF16), S((4096, 32, 8, 128), BF16), S((4096, 32, 8, 128), BF16),
         S((64, 64), I32), S((64,), I32), S((64, 128), F32), S((64, 128), F32))),
    "append partials norm unsplit": (
        lambda qkv, ss, k, v, bt, p: paged_decode_attention_append(qkv, k, v, bt, p,
                                                                   norm=(ss, 4096, 1e-5)),
        (S((2, 1, 8, 6, 128), F32), S((2, 1), F32), S((40, 16, 8, 128), BF16),
         S((40, 16, 8, 128), BF16), S((1, 32), I32), S((1,), I32))),
    "append fp8 split_keys d256": (
        lambda qkv, k, v, ks, vs, bt, p: paged_decode_attention_append(
            qkv, k, v, bt, p, k_scale=ks, v_scale=vs,
            block_sizes=DecodeBlockSizes(block_k=64, num_warps=8, num_stages=2,
                                         split_keys=512)),
        (S((4, 8, 4, 256), BF16), S((512, 64, 8, 256), jnp.float8_e4m3fn),
         S((512, 64, 8, 256), jnp.float8_e4m3fn), S((512, 64, 8), F32), S((512, 64, 8), F32),
         S((4, 128), I32), S((4,), I32))),
}


@pytest.mark.parametrize("name", list(LOWERING_CASES))
def test_paged_kernels_lower_for_h200(name, monkeypatch):
    from test_gpu_lowering import lower_for_h200
    from pallas_kernels._jax_private import triton_lowering

    real, seen = triton_lowering.lower_jaxpr_to_triton_module, []

    def lower_and_verify(*args, **kwargs):  # as test_gpu_lowering's verify_triton_modules
        result = real(*args, **kwargs)
        result.module.operation.verify()
        seen.append(result)
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    fn, args = LOWERING_CASES[name]
    module = lower_for_h200(fn, *args)
    assert "custom_call" in module and len(seen) == 1


def gpu_case(seed, lengths, page_size, hkv, d, dtype):
    bt, pool = block_tables(seed, lengths, page_size, share=2)
    k, v = pools(seed + 1, pool, page_size, hkv, d, dtype)
    return bt, clean(k), clean(v)


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("window", [None, 700])
def test_paged_decode_gpu(dtype, page_size, window):
    lengths = jnp.asarray([3000, 1, 1234, 0, 2049], jnp.int32)
    bt, k, v = gpu_case(60, lengths, page_size, 8, 128, dtype)
    q = normal(63, (5, 32, 128), dtype)
    out = paged_decode_attention(q, k, v, bt, lengths, sliding_window=window)
    ref = paged_decode_attention_reference(q, k, v, bt, lengths, sliding_window=window)
    assert rel_err(out, ref) < GPU_TOL[dtype]
    contiguous = decode_attention(q, gather_pages(k, bt), gather_pages(v, bt), lengths,
                                  sliding_window=window)
    assert rel_err(out, contiguous) < GPU_TOL[dtype]  # bit for bit in interpret mode


@gpu
@needs_gpu
@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_split_keys_batch_invariant_gpu(page_size):
    """Compiled, fixed-size chunks: a row's bits alone equal its bits in a batch of others."""
    lengths = jnp.asarray([2500, 700, 4000, 1], jnp.int32)
    bt, k, v = gpu_case(90, lengths, page_size, 8, 128, BF16)
    q = normal(93, (4, 32, 128), BF16)
    blocks = DecodeBlockSizes(split_keys=512)
    out = paged_decode_attention(q, k, v, bt, lengths, block_sizes=blocks)
    alone = paged_decode_attention(q[2:3], k, v, bt[2:3, :4000 // page_size + 1],
                                   lengths[2:3], block_sizes=blocks)
    assert_same(alone, out[2:3])


@gpu
@needs_gpu
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_paged_decode_quantized_gpu(kind):
    lengths = jnp.asarray([3000, 1, 1234, 0], jnp.int32)
    bt, pool = block_tables(70, lengths, 16, share=2)
    (k, ks), (v, vs) = pools(71, pool, 16, 8, 128, None, CODES[kind])
    q = normal(73, (4, 32, 128), BF16)
    out = paged_decode_attention(q, k, v, bt, lengths, k_scale=ks, v_scale=vs)
    ref = paged_decode_attention_reference(q, k, v, bt, lengths, k_scale=clean(ks),
                                           v_scale=clean(vs))
    assert rel_err(out, ref) < GPU_TOL[BF16]


@gpu
@needs_gpu
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("context", [300, 3000])
def test_paged_append_gpu(page_size, context):
    positions = jnp.asarray([context, -1, context // 2, 0], jnp.int32)
    qkv, (k, v), bt = append_case(80, page_size, 32, 8, 128, BF16, positions, share=0)
    k, v = clean(k), clean(v)
    rope = rope_tables(np.maximum(positions, 0), 128)
    out, k2, v2 = paged_decode_attention_append(qkv, k, v, bt, positions, rope=rope)
    ref, k_ref, v_ref = paged_decode_attention_append_reference(qkv, k, v, bt, positions,
                                                                rope=rope)
    assert rel_err(out, ref) < GPU_TOL[BF16]
    assert rel_err(k2, k_ref) < 1e-2 and rel_err(v2, v_ref) < 1e-6
