"""norm_matmul (RMSNorm fused into a matmul prologue, residual in the epilogue) vs its references.

CPU: interpret mode with 16-wide blocks at shapes that are not block multiples, so edge tiles in
M, N and K and multi-tile K loops all occur. Interpret mode pads out-of-range block reads with
NaN, so a missing mask shows up as NaN in the output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops import reference
from pallas_kernels.norm_matmul import (MatmulBlockSizes, apply_norm_partials, norm_matmul,
                                        norm_matmul_reference)
from pallas_kernels.rms_norm import add_rms_norm_reference
from pallas_kernels.swiglu import (swiglu, swiglu_down, swiglu_down_reference,
                                   swiglu_reference)
from kernel_testing import _key_normal, random_normal, rel_err  # jax.random.normal's bits

EPS = 1e-5
SMALL = MatmulBlockSizes(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=1)
# Relative error ||out - ref|| / ||ref||: float32 lands near 2e-7; bf16 near 2e-4 against the
# reference (summation order) and 2.5e-3 against the unfused model path, which rounds the
# matmul to bf16 before adding the residual.
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.5e-2}


def inputs(seed: int, m: int, k: int, n_dims: tuple[int, ...], dtype):
    """x, the norm weight, w and a residual: jax.random.normal draws, scaled and cast on the
    host in float32 (numpy's products and round-to-nearest-even casts are XLA's: the same
    bits, without a compile per eager op, shape and dtype) and sent once."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    dt = jnp.dtype(dtype)
    # Rows at different scales: a kernel that normalises with the wrong row's (or the block's)
    # statistics is off by the scale ratio.
    scale = np.exp(np.linspace(-2.0, 2.0, m, dtype=np.float32))[:, None]
    x = (scale * _key_normal(keys[0], (m, k))).astype(dt)
    nw = (np.float32(1.0) + np.float32(0.3) * _key_normal(keys[1], (k,))).astype(dt)
    w = (_key_normal(keys[2], (k, *n_dims)) / np.float32(np.sqrt(k))).astype(dt)
    res = _key_normal(keys[3], (m, *n_dims)).astype(dt)
    return tuple(jax.device_put(a) for a in (x, nw, w, res))


def _host_weight(key, shape, dtype):
    """(random_normal(key, shape) / sqrt(K)).astype(dtype), scaled and cast on the host."""
    return jax.device_put((_key_normal(key, shape) / np.float32(np.sqrt(shape[0])))
                          .astype(jnp.dtype(dtype)))


CASES = [(1, 64, (96,)), (3, 200, (2, 6, 16)), (37, 200, (96,)), (37, 64, (2, 6, 16))]


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("m,k,n_dims", CASES)
def test_norm_matmul_interpret(m, k, n_dims, dtype, with_residual):
    x, nw, w, res = inputs(m * 1000 + k, m, k, n_dims, dtype)
    residual = res if with_residual else None
    out = norm_matmul(x, nw, w, eps=EPS, residual=residual, interpret=True, block_sizes=SMALL)
    ref = norm_matmul_reference(x, nw, w, eps=EPS, residual=residual)
    assert out.shape == (m, *n_dims) and out.dtype == x.dtype
    assert rel_err(out, ref) < TOL[dtype]
    # The model's unfused path: reference.rms_norm then reference.linear (+ the residual).
    unfused = reference.linear(reference.rms_norm(x, nw, EPS), w)
    if with_residual:
        unfused = (unfused.astype(jnp.float32) + res.astype(jnp.float32)).astype(dtype)
    assert rel_err(out, unfused) < TOL[dtype]


# K split in 3 chunks of 2 tiles (K = 200: the last chunk is ragged, with fully masked tiles).
SPLIT = MatmulBlockSizes(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=1,
                             split_k=3)


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("blocks", [SMALL, SPLIT], ids=["one_chunk", "split_k"])
def test_norm_matmul_split_k_and_plain(blocks, dtype, norm):
    x, nw, w, res = inputs(11, 3, 200, (2, 24), dtype)
    nw = nw if norm else None
    out = norm_matmul(x, nw, w, eps=EPS, residual=res, interpret=True, block_sizes=blocks)
    ref = norm_matmul_reference(x, nw, w, eps=EPS, residual=res)
    assert out.shape == (3, 2, 24) and out.dtype == x.dtype
    assert rel_err(out, ref) < TOL[dtype]
    h = reference.rms_norm(x, nw, EPS) if norm else x
    unfused = (reference.linear(h, w).astype(jnp.float32) + res.astype(jnp.float32)).astype(dtype)
    assert rel_err(out, unfused) < TOL[dtype]


@pytest.mark.parametrize("blocks", [SMALL, SPLIT], ids=["one_chunk", "split_k"])
def test_partials_sum_to_the_product(blocks):
    x, _, w, _ = inputs(13, 3, 200, (2, 24), jnp.bfloat16)
    parts = norm_matmul(x, None, w, partials=True, interpret=True, block_sizes=blocks)
    assert parts.dtype == jnp.float32 and parts.shape == (blocks.split_k, 3, 2, 24)
    ref = norm_matmul_reference(x, None, w, out_dtype=jnp.float32)
    assert rel_err(parts.sum(0), ref) < 1e-5
    with pytest.raises(ValueError, match="partials=True is for a plain or normed matmul"):
        norm_matmul(x, None, w, residual=ref.astype(x.dtype), partials=True, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("blocks", [SMALL, SPLIT], ids=["one_chunk", "split_k"])
def test_swiglu_with_norm_prologue(blocks, dtype):
    # The pre-MLP RMSNorm fused into SwiGLU, against the model's unfused path.
    x, nw, _, _ = inputs(12, 5, 200, (1,), dtype)
    keys = jax.random.split(jax.random.PRNGKey(3), 2)
    wg, wu = (_host_weight(kk, (200, 40), dtype) for kk in keys)
    out = swiglu(x, wg, wu, norm_weight=nw, eps=EPS, interpret=True, block_sizes=blocks)
    ref = swiglu_reference(x, wg, wu, norm_weight=nw, eps=EPS)
    assert out.shape == (5, 40) and out.dtype == x.dtype
    assert rel_err(out, ref) < TOL[dtype]
    h = reference.rms_norm(x, nw, EPS)
    unfused = reference.swiglu(h, wg, wu)
    assert rel_err(out, unfused) < TOL[dtype]
    assert rel_err(out, swiglu_reference(x, wg, wu)) > 0.1  # the norm matters here


def test_default_blocks_and_norm_matters():
    # Default block sizes (the decode path: block_k 256 > K, so only the masked tail runs), and a
    # check that the test can fail: the result without the norm is far from the fused one.
    x, nw, w, _ = inputs(7, 2, 200, (40,), jnp.float32)
    out = norm_matmul(x, nw, w, eps=EPS, interpret=True)
    assert rel_err(out, norm_matmul_reference(x, nw, w, eps=EPS)) < TOL[jnp.float32]
    assert rel_err(out, reference.linear(x, w)) > 0.1


def deltas_for(seed, x, chunks=2):
    """float32 partial sums [S, *x.shape] at x's scale (a split-K producer's chunks)."""
    return jax.device_put(np.float32(0.5) * _key_normal(jax.random.PRNGKey(seed),
                                                        (chunks, *x.shape)))


# Each of the blocks, the dtype and m (one row: the operand math runs on that row alone) takes
# both its values, in four combinations.
@pytest.mark.parametrize("blocks, dtype, m", [(SMALL, jnp.float32, 1), (SPLIT, jnp.float32, 5), (SMALL, jnp.bfloat16, 5),
    (SPLIT, jnp.bfloat16, 1)], ids=["one_chunk-f32-m1", "split_k-f32-m5", "one_chunk-bf16-m5",
                                      "split_k-bf16-m1"])
def test_swiglu_adds_deltas_to_the_residual_in_its_main_loop(blocks, dtype, m):
    # The decoder's attention -> MLP boundary in the SwiGLU kernel: x + sum(deltas) written
    # out (by the first N tile's programs, whole), its RMSNorm and SwiGLU, against the model's
    # boundary (add_norm's reference) followed by the unfused MLP.
    x, nw, _, _ = inputs(14, m, 200, (1,), dtype)
    deltas = deltas_for(15, x, chunks=3)
    keys = jax.random.split(jax.random.PRNGKey(4), 2)
    wg, wu = (_host_weight(kk, (200, 72), dtype) for kk in keys)
    x_new, out = swiglu(x, wg, wu, norm_weight=nw, eps=EPS, deltas=deltas, interpret=True,
                        block_sizes=blocks)
    x_ref, ref = swiglu_reference(x, wg, wu, norm_weight=nw, eps=EPS, deltas=deltas)
    np.testing.assert_array_equal(np.asarray(x_new), np.asarray(x_ref))  # one rounding, same order
    assert out.shape == (m, 72) and out.dtype == x.dtype
    assert rel_err(out, ref) < TOL[dtype]
    x_model, h = add_rms_norm_reference(x, deltas, nw, eps=EPS)  # the model's boundary
    np.testing.assert_array_equal(np.asarray(x_new), np.asarray(x_model))
    assert rel_err(out, reference.swiglu(h, wg, wu)) < TOL[dtype]
    assert rel_err(out, swiglu_reference(x, wg, wu, norm_weight=nw, eps=EPS)) > 0.1


@pytest.mark.parametrize("blocks, dtype, m", [(SMALL, jnp.float32, 1), (SPLIT, jnp.float32, 3), (SMALL, jnp.bfloat16, 3),
    (SPLIT, jnp.bfloat16, 1)], ids=["one_chunk-f32-m1", "split_k-f32-m3", "one_chunk-bf16-m3",
                                      "split_k-bf16-m1"])
def test_normed_partials_with_deltas(blocks, dtype, m):
    # The MLP -> attention boundary in the q/k/v matmul: x + sum(deltas), and the chunks of
    # (x_new * norm_weight) @ w with their sums of squares, finished by apply_norm_partials
    # (what the decode attention kernel does) = the model's boundary, then the projection.
    x, nw, w, _ = inputs(16, m, 200, (2, 24), dtype)
    deltas = deltas_for(17, x)
    x_new, (parts, ss) = norm_matmul(x, nw, w, eps=EPS, partials=True, deltas=deltas,
                                     interpret=True, block_sizes=blocks)
    assert parts.shape == (blocks.split_k, m, 2, 24) and ss.shape == (blocks.split_k, m)
    x_model, h = add_rms_norm_reference(x, deltas, nw, eps=EPS)  # the model's boundary
    np.testing.assert_array_equal(np.asarray(x_new), np.asarray(x_model))
    y = apply_norm_partials(parts, ss, 200, EPS)
    assert rel_err(y, reference.linear(h, w)) < TOL[dtype]
    x_ref, ref = norm_matmul_reference(x, nw, w, eps=EPS, deltas=deltas)
    np.testing.assert_array_equal(np.asarray(x_new), np.asarray(x_ref))
    assert rel_err(y, ref) < TOL[dtype]
    # Unnormed chunks differ: the scale is left to the consumer.
    assert rel_err(parts.sum(0), ref) > 0.1
    # No deltas: the same chunks of x itself.
    parts0, ss0 = norm_matmul(x, nw, w, eps=EPS, partials=True, interpret=True,
                              block_sizes=blocks)
    assert rel_err(apply_norm_partials(parts0, ss0, 200, EPS),
                   norm_matmul_reference(x, nw, w, eps=EPS)) < TOL[dtype]


def test_bad_deltas_raise_clear_errors():
    x, nw, w, _ = inputs(0, 3, 64, (8,), jnp.float32)
    d = deltas_for(1, x)
    for bad, needle in ((d[0], "must have rank 3"), (d[:, :2], "must be [S, *x.shape]"),
                        (d.astype(jnp.bfloat16), "float32 partial sums")):
        with pytest.raises(ValueError, match="norm_matmul") as err:
            norm_matmul(x, nw, w, deltas=bad, interpret=True)
        assert needle in str(err.value)
        with pytest.raises(ValueError, match="swiglu"):
            swiglu(x, w, w, deltas=bad, interpret=True)


def mlp_weights(seed, k, f, d, dtype):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    dt = jnp.dtype(dtype)  # scaled and cast on the host, as inputs()
    wg, wu = (jax.device_put((_key_normal(kk, (k, f)) / np.float32(np.sqrt(k))).astype(dt))
              for kk in keys[:2])
    wd = jax.device_put((_key_normal(keys[2], (f, d)) / np.float32(np.sqrt(f))).astype(dt))
    return wg, wu, wd


# one row: one atomic per column (the rows summed); the decode case (bf16, one row, deltas)
@pytest.mark.parametrize("dtype, m, deltas", [
    (jnp.bfloat16, 1, True), (jnp.float32, 3, True), (jnp.float32, 1, False),
    (jnp.bfloat16, 3, False)], ids=["bf16-1-x+deltas", "f32-3-x+deltas", "f32-1-x", "bf16-3-x"])
def test_swiglu_down_is_the_two_kernel_mlp(dtype, m, deltas):
    # The one-kernel MLP: acc + swiglu(...) @ w_down, F (72) not a multiple of block_n (16:
    # 5 programs, the last one's w_down rows masked), D (96) several block_d steps; clear
    # comes back zeroed. Against the reference, the model's two kernels (swiglu, then the
    # split-K matmul's chunks summed) and without the accumulator's start value.
    x, nw, _, _ = inputs(20 + m, m, 200, (1,), dtype)
    wg, wu, wd = mlp_weights(21, 200, 72, 96, dtype)
    acc = random_normal(jax.random.PRNGKey(22), (m, 96))
    clear = random_normal(jax.random.PRNGKey(23), (m, 96))
    dl = deltas_for(24, x, chunks=2) if deltas else None
    out = swiglu_down(x, wg, wu, wd, acc, clear, norm_weight=nw, eps=EPS, deltas=dl,
                      interpret=True, block_sizes=SMALL, block_d=32)
    ref = swiglu_down_reference(x, wg, wu, wd, acc, clear, norm_weight=nw, eps=EPS, deltas=dl)
    assert len(out) == (3 if deltas else 2)
    if deltas:
        np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ref[0]))
    got_acc, got_clear = out[-2:]
    assert got_acc.shape == (m, 96) and got_acc.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got_clear), np.zeros((m, 96), np.float32))
    assert rel_err(got_acc, ref[-2]) < TOL[dtype] / 5
    if deltas:
        _, act = swiglu(x, wg, wu, norm_weight=nw, eps=EPS, deltas=dl, interpret=True,
                        block_sizes=SMALL)
    else:
        act = swiglu(x, wg, wu, norm_weight=nw, eps=EPS, interpret=True, block_sizes=SMALL)
    parts = norm_matmul(act, None, wd, partials=True, interpret=True, block_sizes=SPLIT)
    assert rel_err(got_acc - acc, parts.sum(0)) < TOL[dtype] / 5
    assert rel_err(got_acc, parts.sum(0)) > 0.1  # the accumulator's start value counts


def test_swiglu_down_bad_inputs_raise_clear_errors():
    x, nw, _, _ = inputs(0, 2, 64, (1,), jnp.float32)
    wg, wu, wd = mlp_weights(1, 64, 32, 48, jnp.float32)
    acc = jnp.zeros((2, 48), jnp.float32)
    cases = [
        ((x, wg, wu, wd[:16], acc, acc), {}, "w_down (16, 48) must have 32 rows"),
        ((x, wg, wu, wd.astype(jnp.bfloat16), acc, acc), {}, "share one dtype"),
        ((x, wg, wu, wd, acc[:1], acc), {}, "acc has shape (1, 48), expected (2, 48)"),
        ((x, wg, wu, wd, acc, acc.astype(jnp.bfloat16)), {}, "clear has dtype bfloat16"),
        ((x, wg, wu, wd[:, :40], acc[:, :40], acc[:, :40]), {}, "D=40 columns"),
        ((x, wg, wu, wd, acc, acc), {"block_d": 24}, "block_d=24"),
        ((x, wg, wu, wd, acc, acc), {"block_sizes": SPLIT}, "split_k=3"),
    ]
    for args, kwargs, needle in cases:
        with pytest.raises(ValueError, match="swiglu_down") as err:
            swiglu_down(*args, eps=EPS, interpret=True, **kwargs)
        assert needle in str(err.value), (needle, str(err.value))


@pytest.mark.parametrize("blocks", [SMALL, SPLIT], ids=["one_chunk", "split_k"])
def test_transposed_weight_with_norm_and_deltas(blocks):
    """w stored [N, K] (an embedding table as a tied LM head): the residual add and the norm
    in the loop, float32 logits out, ragged N and K; and with single_row=False a row's output
    is the same bits alone and in a batch of 3 (the batch-invariant form)."""
    m, k, n = 3, 200, 75
    x, nw, w, _ = inputs(7, m, k, (n,), jnp.bfloat16)
    w_t = w.T  # [N, K]
    deltas = random_normal(jax.random.PRNGKey(8), (2, m, k))
    kw = dict(eps=EPS, deltas=deltas, transposed=True, out_dtype=jnp.float32)
    x_new, out = norm_matmul(x, nw, w_t, interpret=True, block_sizes=blocks, **kw)
    x_ref, ref = norm_matmul_reference(x, nw, w_t, **kw)
    assert out.dtype == jnp.float32 and out.shape == (m, n)
    np.testing.assert_array_equal(np.asarray(x_new), np.asarray(x_ref))
    assert rel_err(out, ref) < TOL[jnp.bfloat16]
    plain = norm_matmul(x, nw, w, eps=EPS, deltas=deltas, out_dtype=jnp.float32,
                        interpret=True, block_sizes=blocks)[1]
    assert rel_err(out, plain) < 1e-3  # the same product as the [K, N] weight's
    one = norm_matmul(x[:1], nw, w_t, interpret=True, block_sizes=blocks, single_row=False,
                      **dict(kw, deltas=deltas[:, :1]))[1]
    many = norm_matmul(x, nw, w_t, interpret=True, block_sizes=blocks, single_row=False, **kw)[1]
    np.testing.assert_array_equal(np.asarray(one[0]), np.asarray(many[0]))
    with pytest.raises(ValueError, match="transposed=True gives the finished product"):
        norm_matmul(x, nw, w_t, transposed=True, partials=True)
    with pytest.raises(ValueError, match=r"is not \[N, K\]"):
        norm_matmul(x, nw, w, transposed=True)


@pytest.mark.parametrize("fn", [norm_matmul, norm_matmul_reference], ids=["kernel", "reference"])
def test_bad_inputs_raise_clear_errors(fn):
    x, nw, w, res = inputs(0, 3, 64, (2, 8), jnp.float32)
    cases = [
        ((x[0], nw, w), {}, "x must have rank 2"),
        ((x, nw[None], w), {}, "norm_weight must have rank 1"),
        ((x, nw, w[:, 0, 0]), {}, "w must be an array of rank >= 2"),
        ((x, nw[:32], w), {}, "norm_weight has 32 entries"),
        ((x, nw, w[:32]), {}, "w (32, 2, 8) has 32 rows"),
        ((x, nw, w), {"residual": res[:, 0]}, "residual has shape (3, 8)"),
        ((x.astype(jnp.bfloat16), nw, w), {}, "share one dtype"),
        ((x, nw, w), {"residual": res.astype(jnp.float16)}, "residual float16"),
        ((x.astype(jnp.int32), nw, w), {}, "x has dtype int32"),
    ]
    for args, kwargs, needle in cases:
        with pytest.raises(ValueError, match="norm_matmul") as err:
            fn(*args, eps=EPS, **kwargs)
        assert needle in str(err.value), (needle, str(err.value))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_norm_matmul_gpu_decode_shape(with_residual):
    # Llama-3-8B's fused q/k/v projection at batch 1: wqkv [4096, Hkv 8, G + 2 = 6, hd 128].
    x, nw, w, res = inputs(1, 1, 4096, (8, 6, 128), jnp.bfloat16)
    residual = res if with_residual else None
    out = norm_matmul(x, nw, w, eps=EPS, residual=residual)
    ref = norm_matmul_reference(x, nw, w, eps=EPS, residual=residual)
    assert rel_err(out, ref) < TOL[jnp.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
def test_boundaries_in_the_consumers_gpu_decode_shapes():
    # Llama-3-8B at batch 1, default blocks: SwiGLU (K 4096, N 14336) adding o's 2 chunks, and
    # the q/k/v projection adding down's 8 chunks, with the norm deferred to the consumer.
    x, nw, w, _ = inputs(2, 1, 4096, (8, 6, 128), jnp.bfloat16)
    keys = jax.random.split(jax.random.PRNGKey(5), 2)
    wg, wu = ((jax.random.normal(kk, (4096, 14336)) / 64).astype(jnp.bfloat16) for kk in keys)
    d2, d8 = deltas_for(3, x, 2), deltas_for(4, x, 8)
    x_new, out = swiglu(x, wg, wu, norm_weight=nw, eps=EPS, deltas=d2)
    x_ref, ref = swiglu_reference(x, wg, wu, norm_weight=nw, eps=EPS, deltas=d2)
    np.testing.assert_array_equal(np.asarray(x_new), np.asarray(x_ref))
    assert rel_err(out, ref) < TOL[jnp.bfloat16]
    x_new, (parts, ss) = norm_matmul(x, nw, w, eps=EPS, partials=True, deltas=d8)
    x_ref, ref = norm_matmul_reference(x, nw, w, eps=EPS, deltas=d8)
    np.testing.assert_array_equal(np.asarray(x_new), np.asarray(x_ref))
    assert rel_err(apply_norm_partials(parts, ss, 4096, EPS), ref) < TOL[jnp.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("m", [1, 4])
def test_swiglu_down_gpu_decode_shapes(m):
    # Llama-3-8B's MLP at decode batch m, default blocks, o's 2 chunks added first: the
    # atomics' sum against the reference and against the two-kernel path.
    x, nw, _, _ = inputs(6, m, 4096, (1,), jnp.bfloat16)
    wg, wu, wd = mlp_weights(7, 4096, 14336, 4096, jnp.bfloat16)
    d2 = deltas_for(8, x, 2)
    acc = jnp.zeros((m, 4096), jnp.float32)
    clear = jnp.ones((m, 4096), jnp.float32)
    x_new, got, cleared = swiglu_down(x, wg, wu, wd, acc, clear, norm_weight=nw, eps=EPS,
                                      deltas=d2)
    x_ref, ref, _ = swiglu_down_reference(x, wg, wu, wd, acc, clear, norm_weight=nw, eps=EPS,
                                          deltas=d2)
    np.testing.assert_array_equal(np.asarray(x_new), np.asarray(x_ref))
    np.testing.assert_array_equal(np.asarray(cleared), np.zeros((m, 4096), np.float32))
    assert rel_err(got, ref) < TOL[jnp.bfloat16]  # the SwiGLU's bf16 rounding, summed apart
    _, act = swiglu(x, wg, wu, norm_weight=nw, eps=EPS, deltas=d2)
    two = norm_matmul(act, None, wd, partials=True).sum(0)
    assert rel_err(got, two) < 1e-5  # the same products, summed in another order
