"""Paged chunk attention (pallas_kernels/paged_chunk_attention.py).

CPU, interpret mode at tiny shapes that are not tile multiples: pages in random order in the
pool (the null page and every unwritten slot NaN-poisoned), rows sharing prefix pages, ragged
rows padded with -1, chunks starting mid-page, T = 1, small and above a block; windows,
soft-capping, GQA 1 and 4, D 64 and 256, bf16 / float32, int8 / fp8 codes; against the
reference and against chunk_attention on the same data laid out contiguously. The bitwise
chunk invariance the engine relies on (a query's bits whatever T, its row, its neighbours and
how the earlier positions were chunked). The Triton lowering for an abstract H200 (no GPU
needed), and `gpu`-marked tests for the real H200.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh

import pallas_kernels as pk
from kernel_testing import rel_err
from pallas_kernels import FlashBlockSizes, PagedBlockSizes
from pallas_kernels._jax_private import triton_lowering
from pallas_kernels.chunk_attention import chunk_attention
from pallas_kernels.kv_quant import quantize_kv
from pallas_kernels.paged_chunk_attention import (paged_chunk_attention,
                                                  paged_chunk_attention_reference)

INT8, FP8 = jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)
CODES = {"int8": INT8, "fp8": FP8}
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2}
needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")


def make_cache(seed, lengths, page_size, max_pages, hkv, d, dtype, kind=None, shared_pages=0,
               n_pages=None):
    """A paged cache holding rows of `lengths` positions, pages drawn in random order from a
    pool whose null page 0 and unwritten slots hold NaN (fp8 codes: NaN; int8 codes: random,
    with NaN scales). Row 1 shares row 0's first `shared_pages` pages (a prefix-cache hit).
    Returns (pages dict for the kernel, block_tables, contiguous k, v [B, S, Hkv, D] (zeros
    past each row's length; dequantized float32 when quantized), with scales if any)."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    s = max_pages * page_size
    n_pages = n_pages or b * max_pages + 1
    k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    order = iter(rng.permutation(np.arange(1, n_pages)))
    bt = np.zeros((b, max_pages), np.int32)
    for i, n in enumerate(lengths):
        for p in range(-(-n // page_size)):
            bt[i, p] = bt[0, p] if (i == 1 and p < shared_pages) else next(order)
    if shared_pages:
        k[1, :shared_pages * page_size] = k[0, :shared_pages * page_size]
        v[1, :shared_pages * page_size] = v[0, :shared_pages * page_size]
    for i, n in enumerate(lengths):
        k[i, n:] = v[i, n:] = 0.0
    out = {}
    contiguous = []
    # The pools are filled in numpy and sent once: eager scatters at each row's length
    # compiled a program per length; the same values, bit for bit.
    for name, x in (("k", k), ("v", v)):
        if kind is None:
            src = x.astype(np.dtype(dtype))  # numpy's (ml_dtypes') cast: XLA's rounding
            pool = np.full((n_pages, page_size, hkv, d), np.nan, src.dtype)
            contiguous.append(jnp.asarray(src))
        else:
            codes, scale = quantize_kv(jnp.asarray(x), CODES[kind])
            fill = rng.integers(-127, 128, (n_pages, page_size, hkv, d)).astype(np.int8)
            pool = fill if kind == "int8" else np.full((n_pages, page_size, hkv, d), np.nan,
                                                       FP8)
            spool = np.full((n_pages, page_size, hkv), np.nan, np.float32)
            contiguous.append((codes, scale))
            src, scale = np.asarray(codes), np.asarray(scale)
        for i, n in enumerate(lengths):
            rows = bt[i, np.arange(n) // page_size]
            slots = np.arange(n) % page_size
            pool[rows, slots] = src[i, :n]
            if kind is not None:
                spool[rows, slots] = scale[i, :n]
        out[f"{name}_pages"] = jnp.asarray(pool)
        if kind is not None:
            out[f"{name}_scale"] = jnp.asarray(spool)
    return out, jnp.asarray(bt), contiguous


def split_pages(pages):
    """(k_pages, v_pages, {k_scale, v_scale} or {})."""
    scales = {n: pages[n] for n in ("k_scale", "v_scale") if n in pages}
    return pages["k_pages"], pages["v_pages"], scales


def query_positions(starts, counts, t):
    """[B, T] int32: row i holds counts[i] consecutive positions from starts[i], then -1."""
    pos = np.full((len(starts), t), -1, np.int32)
    for i, (s0, c) in enumerate(zip(starts, counts)):
        pos[i, :c] = np.arange(s0, s0 + c)
    return jnp.asarray(pos)


CASES = {
    # name: dtype, kind, hq, hkv, d, page_size, block_sizes, t, window, softcap
    "f32 mha d64 ps16": (jnp.float32, None, 2, 2, 64, 16, None, 5, None, None),
    "bf16 gqa4 d64 ps32 bk16 window": (jnp.bfloat16, None, 8, 2, 64, 32,
                                       PagedBlockSizes(32, 16, 4, 1), 7, 9, None),
    "f32 gqa4 d256 T1": (jnp.float32, None, 4, 1, 256, 16, None, 1, None, None),
    "int8 bf16 mha softcap T>block": (jnp.bfloat16, "int8", 2, 2, 64, 16,
                                      PagedBlockSizes(16, 16, 4, 1), 37, None, 30.0),
    "fp8 f32 gqa4 window softcap": (jnp.float32, "fp8", 4, 1, 64, 32,
                                    PagedBlockSizes(32, 32, 4, 1), 6, 20, 50.0),
    "int8 f32 gqa4 T>block window": (jnp.float32, "int8", 8, 2, 64, 16,
                                     PagedBlockSizes(16, 16, 4, 1), 11, 13, None),
    "bf16 gqa4 split window": (jnp.bfloat16, None, 8, 2, 64, 16,
                               PagedBlockSizes(32, 16, 4, 1, split_keys=32), 7, 20, None),
    "int8 f32 mha split T>block": (jnp.float32, "int8", 2, 2, 64, 32,
                                   PagedBlockSizes(16, 16, 4, 1, split_keys=32), 21, None, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_and_chunk_attention(case):
    """Three rows: row 1 shares row 0's first page; row 2 is ragged (-1 padding); chunks start
    mid-page. Kernel vs reference, and (rows without padding) vs chunk_attention on the same
    values laid out contiguously."""
    dtype, kind, hq, hkv, d, ps, blocks, t, window, softcap = CASES[case]
    max_pages = 5
    lengths = [19 + t, 16 + 3 + t, 40 + min(t, 3)]
    starts = [19, 19, 40]
    counts = [t, t, min(t, 3)]
    pages, bt, contiguous = make_cache(list(CASES).index(case), lengths, ps, max_pages, hkv, d,
                                       dtype, kind, shared_pages=1)
    k_pages, v_pages, scales = split_pages(pages)
    q = jnp.asarray(np.random.default_rng(1).standard_normal((3, t, hq, d)), dtype)
    pos = query_positions(starts, counts, t)
    kw = dict(sliding_window=window, softcap=softcap, **scales)
    out = paged_chunk_attention(q, k_pages, v_pages, bt, pos, block_sizes=blocks,
                                interpret=True, **kw)
    ref = paged_chunk_attention_reference(q, k_pages, v_pages, bt, pos, **kw)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, ref) < TOL[dtype]
    pad = np.asarray(pos) < 0
    assert pad.any() == (t > 3) and not np.asarray(out)[pad].any()  # padding: zeros

    # chunk_attention on the contiguous layout (positions must be valid there)
    if kind is None:
        kc, vc = contiguous
        cscales = {}
    else:
        (kc, ks), (vc, vs) = contiguous
        cscales = {"k_scale": ks, "v_scale": vs}
    want = chunk_attention(q, kc, vc, jnp.maximum(pos, 0), interpret=True,
                           block_sizes=FlashBlockSizes(16, 16, 4, 1), sliding_window=window,
                           softcap=softcap, **cscales)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    assert rel_err(np.asarray(out)[~pad], np.asarray(want)[~pad]) < tol


@pytest.mark.parametrize("dtype, g, window, split", [
    (jnp.float32, 1, None, None), (jnp.bfloat16, 4, 9, None), (jnp.bfloat16, 4, 9, 32)],
    ids=["f32-mha", "bf16-gqa4-window", "bf16-gqa4-window-split"])
def test_bitwise_chunk_invariance(dtype, g, window, split):
    """A 45-token prompt's attention in one call (T = 45, row 0 of 1) and in chunks of 1, 5,
    37 and 2 queries (at rows 2, 0, 1, 1 of three-row batches whose other rows hold other
    work): every query's output bit for bit the same, as is a decode-like T = 1 call."""
    hkv, d, ps = 2, 64, 16
    n = 45
    pages, bt, _ = make_cache(7, [n, 30, 50], ps, 4, hkv, d, dtype)
    k_pages, v_pages, _ = split_pages(pages)
    q_all = jnp.asarray(np.random.default_rng(2).standard_normal((n, hkv * g, d)), dtype)
    kw = dict(sliding_window=window, interpret=True,
              block_sizes=PagedBlockSizes(32, 16, 4, 1))
    whole = paged_chunk_attention(q_all[None], k_pages, v_pages, bt[:1],
                                  jnp.arange(n, dtype=jnp.int32)[None], **kw)[0]
    rng = np.random.default_rng(3)
    start = 0
    for t, row in ((1, 2), (5, 0), (37, 1), (2, 1)):
        rows = [r for r in range(3) if r != row]
        table = jnp.stack([bt[0] if r == row else bt[1 + (r % 2)] for r in range(3)])
        pos = np.full((3, t), -1, np.int32)
        q = rng.standard_normal((3, t, hkv * g, d)).astype(np.float32)
        pos[row] = np.arange(start, start + t)
        q[row] = np.asarray(q_all[start:start + t], np.float32)
        for other in rows:  # other work: a few queries of the other rows' prompts
            c = min(t, 3)
            pos[other, :c] = np.arange(20, 20 + c)
        out = paged_chunk_attention(jnp.asarray(q, dtype), k_pages, v_pages, table,
                                    jnp.asarray(pos), **kw)
        np.testing.assert_array_equal(np.asarray(out[row]).view(np.uint16 if dtype ==
                                                                jnp.bfloat16 else np.uint32),
                                      np.asarray(whole[start:start + t]).view(
                                          np.uint16 if dtype == jnp.bfloat16 else np.uint32),
                                      err_msg=f"chunk of {t} at row {row}")
        start += t
    assert start == n


def test_bad_inputs_raise():
    q = jnp.zeros((2, 3, 4, 16), jnp.float32)
    kp = jnp.zeros((5, 16, 2, 16), jnp.float32)
    bt = jnp.zeros((2, 2), jnp.int32)
    pos = jnp.zeros((2, 3), jnp.int32)
    codes, scale = jnp.zeros((5, 16, 2, 16), INT8), jnp.zeros((5, 16, 2), jnp.float32)
    cases = [
        (lambda: paged_chunk_attention(q, kp, kp, bt, pos,
                                       block_sizes=PagedBlockSizes(32, 32, 4, 1)),
         "block_k 32 must divide page_size 16"),
        (lambda: paged_chunk_attention(q, kp[:, :8], kp[:, :8], bt, pos),
         "page_size 8 is not a multiple of 16"),
        (lambda: paged_chunk_attention(q, kp, kp, bt, pos + 32), r"positions must lie in"),
        (lambda: paged_chunk_attention(q, kp, kp, bt, pos - 2), r"or be -1"),
        (lambda: paged_chunk_attention(q, kp, kp, bt[:1], pos), "block_tables must be"),
        (lambda: paged_chunk_attention(q, kp, kp, bt + 5, pos), r"entries must lie in \[0, 5\)"),
        (lambda: paged_chunk_attention(q, kp, kp, bt.astype(jnp.float32), pos), "dtype"),
        (lambda: paged_chunk_attention(q, codes, codes, bt, pos, k_scale=scale),
         "both k_scale and v_scale"),
        (lambda: paged_chunk_attention(q, codes, codes, bt, pos, k_scale=scale[:4],
                                       v_scale=scale), r"k_scale must be \[P, page_size, Hkv"),
        (lambda: paged_chunk_attention(q, kp[..., :1, :], kp[..., :1, :], bt, pos[:, :2]),
         r"positions must be \[B, T\]"),
        (lambda: paged_chunk_attention(q, kp, kp, bt, pos, sliding_window=0),
         "sliding_window must be >= 1"),
    ]
    for fn, message in cases:
        with pytest.raises(ValueError, match=message):
            fn()


def test_exported():
    names = pk.__all__
    assert "paged_chunk_attention" in names and "paged_chunk_attention_reference" in names
    assert pk.paged_chunk_attention is paged_chunk_attention


# ---------------------------------------------------------------------------------------------
# Lowering for the H200 (as tests/test_gpu_lowering.py does)
# ---------------------------------------------------------------------------------------------

S = jax.ShapeDtypeStruct
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
    device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
TRITON = "__gpu$xla.gpu.triton"

LOWERING_CASES = {
    # name: (kwargs, q [B, T, Hq, D], Hkv, pages (a float dtype, I32: int8, None: fp8),
    #        page_size)
    "prefill bf16 d128 gqa4 ps64 T512": (dict(), (4, 512, 32, 128), 8, BF16, 64),
    "verify int8 d128 gqa4 ps16 T9": (dict(), (8, 9, 32, 128), 8, I32, 16),
    "verify fp8 d256 softcap window ps32 T3": (dict(softcap=50.0, sliding_window=1024),
                                               (2, 3, 16, 256), 8, None, 32),
    "f32 d64 mha T1": (dict(), (1, 1, 8, 64), 8, F32, 16),
    "verify bf16 d128 split B1 T5": (
        dict(block_sizes=PagedBlockSizes(64, 64, 4, 3, split_keys=512)), (1, 5, 32, 128), 8,
        BF16, 64),
}


@pytest.mark.parametrize("case", list(LOWERING_CASES))
def test_lowers_for_h200(case, monkeypatch):
    """Lowered for CUDA on an abstract H200, each Triton module through the MLIR verifier."""
    kwargs, qshape, hkv, kind, ps = LOWERING_CASES[case]
    b, t, hq, d = qshape
    n_pages, max_pages = 1024, 4096 // ps
    q_dtype = F32 if kind == F32 else BF16
    if kind in (I32, None):  # codes (int8 / fp8) with float32 scales
        code = jnp.int8 if kind == I32 else jnp.float8_e4m3fn
        pages = (S((n_pages, ps, hkv, d), code),) * 2
        scales = (S((n_pages, ps, hkv), F32),) * 2
        fn = lambda q, k, v, bt, p, ks, vs: paged_chunk_attention(  # noqa: E731
            q, k, v, bt, p, k_scale=ks, v_scale=vs, **kwargs)
    else:
        pages, scales = (S((n_pages, ps, hkv, d), q_dtype),) * 2, ()
        fn = lambda q, k, v, bt, p: paged_chunk_attention(q, k, v, bt, p, **kwargs)  # noqa
    real = triton_lowering.lower_jaxpr_to_triton_module
    seen = []

    def lower_and_verify(*args, **kw):
        result = real(*args, **kw)
        result.module.operation.verify()
        seen.append(result)
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    args = (S(qshape, q_dtype), *pages, S((b, max_pages), I32), S((b, t), I32), *scales)
    with jax.sharding.use_abstract_mesh(H200):
        exported = export.export(
            jax.jit(fn), platforms=("cuda",),
            disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])(*args)
    assert "paged_chunk_attention" in exported.mlir_module() and len(seen) == 1


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind, window, split", [
    (None, None, None), ("int8", None, None), ("fp8", 1024, None), (None, 1024, 512)])
def test_gpu_matches_reference(kind, window, split):
    """Four rows of 2048-token contexts (pages in random order, 64 per page), a 512-query
    chunk at 1536.. in three rows and a 9-query verification in the fourth."""
    lengths = [2048, 2048, 2048, 1545]
    pages, bt, _ = make_cache(11, lengths, 64, 32, 8, 128, jnp.bfloat16, kind)
    k_pages, v_pages, scales = split_pages(pages)
    q = jnp.asarray(np.random.default_rng(4).standard_normal((4, 512, 32, 128)), jnp.bfloat16)
    pos = query_positions([1536, 1536, 1536, 1536], [512, 512, 512, 9], 512)
    got = paged_chunk_attention(q, k_pages, v_pages, bt, pos, sliding_window=window,
                                block_sizes=split and PagedBlockSizes(split_keys=split),
                                **scales)
    want = paged_chunk_attention_reference(q, k_pages, v_pages, bt, pos, sliding_window=window,
                                           **scales)
    assert rel_err(got, want) < TOL[jnp.bfloat16]
    assert not np.asarray(got)[3, 9:].any()


@pytest.mark.gpu
@needs_gpu
def test_gpu_bitwise_chunk_invariance():
    """On the GPU: a 300-token prompt in one call and in chunks of 1, 9, 130 and 160 (each
    chunk's row among other rows' work): the same bits."""
    n = 300
    pages, bt, _ = make_cache(12, [n, 256], 16, 20, 8, 128, jnp.bfloat16)
    k_pages, v_pages, _ = split_pages(pages)
    q_all = jnp.asarray(np.random.default_rng(5).standard_normal((n, 32, 128)), jnp.bfloat16)
    whole = paged_chunk_attention(q_all[None], k_pages, v_pages, bt[:1],
                                  jnp.arange(n, dtype=jnp.int32)[None])[0]
    start = 0
    for t in (1, 9, 130, 160):
        q = jnp.stack([jnp.ones((t, 32, 128), jnp.bfloat16), q_all[start:start + t]])
        pos = jnp.stack([jnp.minimum(jnp.arange(t, dtype=jnp.int32) + 50, 255),
                         jnp.arange(start, start + t, dtype=jnp.int32)])
        out = paged_chunk_attention(q, k_pages, v_pages, bt[::-1], pos)
        np.testing.assert_array_equal(np.asarray(out[1]).view(np.uint16),
                                      np.asarray(whole[start:start + t]).view(np.uint16))
        start += t
