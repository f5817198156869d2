"""The Mosaic GPU quantized matmul (pallas_kernels/quantized_mgpu.py: int4 / int8 / fp8, groups of
16 to 128, zero points, GGUF's block types): its "nk" layout against the tiles layout (and
gguf.quants) bit for bit, the kernel against its reference in interpret mode, and the model's
decode path taking it (policy quant_matmul="mosaic") against the reference path."""

from __future__ import annotations

import collections
import dataclasses
import functools

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jaxinfer.plan import KernelPolicy, Plan
from jaxinfer.generate import int_layout_params
from jaxinfer.model import from_params
from jaxinfer.models import llama
from jaxinfer.weights import quantize_params, typed
from jaxinfer.cache import KVCache
from checkpoints import gguf as G
from checkpoints import gguf_blocks
from kernel_inputs import put, put_tree
from kernel_testing import _count_jits, _jaxprs, host_normal, jitted_calls_in, normal, rel_err
from pallas_kernels.quantized import dequantize, quantize_weight
from pallas_kernels.quantized_mgpu import MgpuMatmulConfig, default_config
from test_gguf_blocks import QT, assert_bits_equal, mixed, random_blocks, tiny_llama
from test_kernel_wiring import (INTERPRET, assert_close, assert_close_to_reference, decode_steps,
                                random_params, tiny_config)

GGUF = gguf_blocks.BLOCK_TYPES  # Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K
# The kernels' pure-jnp reference (x @ dequantize(w), float32 at HIGHEST precision) as one
# program: eager, each of its ops compiled for each shape and format.
_reference = jax.jit(pk.quantized_matmul_mgpu_reference,
                     static_argnames=("cfg", "interpret", "out_dtype"))


@functools.partial(jax.jit, static_argnames="eps")
def _normed_reference(x, nw, nk, eps):
    """The reference product of rms_norm_reference(x, nw) (one program, as _reference)."""
    return _reference(pk.rms_norm_reference(x, nw, eps=eps), nk, out_dtype=jnp.float32)


@functools.cache  # a weight is immutable: each (seed, shape, format) made once a process
def _int4(seed, k, n, bf16_scales=False, bits=4):
    """bits 4 or 8 (int, groups of 128), "fp8" (e4m3, groups of 128), "fp8_col" (e4m3, one
    scale per column), "int4_g32" / "int4_asym_g64" ... (int4 in groups of 32 / 64,
    symmetric or with zero points) or a GGUF block type (random valid blocks, repacked).
    Made on the host (numpy) and sent once: no per-shape eager programs (host_arrays)."""
    if bits in GGUF:
        raw = random_blocks(bits, n, k, np.random.default_rng(seed))
        return put_tree(gguf_blocks.repack(raw, bits, k, n))
    fp8, symmetric = bits in ("fp8", "fp8_col"), "asym" not in str(bits)
    group = None if bits == "fp8_col" else 128
    if str(bits).startswith("int4"):
        bits, group = 4, int(bits.rsplit("_g", 1)[1])
    qw = quantize_weight(host_normal(seed, (k, n), np.float32), bits=8 if fp8 else bits,
                         group_size=group, float8=fp8, symmetric=symmetric)
    if bf16_scales:  # the cast on the host: XLA's and ml_dtypes' round to nearest even agree
        qw = qw.replace(scale=np.asarray(qw.scale).astype(jnp.bfloat16))
    return put_tree(qw)


@pytest.mark.parametrize("bits", [4, 8])
def test_nk_layout_dequantizes_bit_for_bit_and_converts_back(bits):
    qw = _int4(0, 384, 192, bits=bits)
    nk = pk.to_nk(qw)
    assert nk.layout == "nk" and nk.planes[0].shape == (192, 384)
    assert nk.planes[0].dtype == {4: jnp.int4, 8: jnp.int8}[bits]
    np.testing.assert_array_equal(dequantize(nk), dequantize(qw))
    back = pk.to_tiles(nk)
    assert back.layout == "tiles" and back.planes[0].dtype == qw.planes[0].dtype
    np.testing.assert_array_equal(back.planes[0], qw.planes[0])
    assert nk.nbytes() == 192 * 384 * bits // 8 + qw.scale.nbytes
    for bad, why in ((quantize_weight(np.ones((256, 128), np.float32), bits=4, group_size=16),
                      "int4 from 32"),
                     (quantize_weight(np.ones((256, 128), np.float32), bits=8, symmetric=False),
                      "not uint8"),
                     (quantize_weight(np.ones((256, 96), np.float32), bits=4), "multiple of 64")):
        assert why in pk.nk_unfit(bad)
        with pytest.raises(ValueError, match=why):
            pk.to_nk(bad)


@pytest.mark.parametrize("fmt", ["int4_g32", "int4_asym_g32", "int4_asym_g64", *GGUF])
def test_nk_layout_takes_small_groups_offsets_and_gguf_blocks_bit_for_bit(fmt):
    """Codes centred (4-bit: int4 c - 8 beside an offset of 8 s; 5- / 6- / 8-bit: int8), the
    scales, offsets and super-scales as they were: dequantize equals the tiles weight's and
    gguf.quants' bit for bit, to_tiles gives the planes back."""
    k, n = 512, 128
    qw = _int4(0, k, n, bits=fmt)
    nk = pk.to_nk(qw)
    four = sum(qw.bits) == 4
    assert nk.planes[0].shape == (n, k) and nk.planes[0].dtype == (jnp.int4 if four
                                                                   else jnp.int8)
    assert_bits_equal(np.asarray(dequantize(nk)), np.asarray(dequantize(qw)))
    if fmt in GGUF:
        raw = random_blocks(fmt, n, k, np.random.default_rng(0))
        assert_bits_equal(np.asarray(dequantize(nk)), gguf.quants.dequantize(raw, QT[fmt]).T)
    for a, b in zip(pk.to_tiles(nk).planes, qw.planes, strict=True):
        np.testing.assert_array_equal(a, b)
    rest = sum(a.nbytes for a in (qw.scale, qw.offset, qw.super_scale, qw.super_offset)
               if a is not None)
    assert nk.nbytes() == n * k * (4 if four else 8) // 8 + rest


@pytest.mark.parametrize("fmt", ["fp8", "fp8_col"])
def test_nk_layout_takes_fp8_bit_for_bit(fmt):
    """fp8 e4m3 values [N, K] as they are; a scale per column repeated per group of 128."""
    qw = _int4(0, 384, 192, bits=fmt)
    nk = pk.to_nk(qw)
    assert nk.planes[0].dtype == jnp.float8_e4m3fn and nk.scale.shape == (3, 192)
    np.testing.assert_array_equal(dequantize(nk), dequantize(qw))
    np.testing.assert_array_equal(pk.to_tiles(nk).planes[0].view(jnp.uint8),
                                  qw.planes[0].view(jnp.uint8))


@pytest.mark.parametrize("m, bf16_scales, bits, cfg", [
    (1, False, 4, None), (3, True, 4, None), (16, False, 4, None), (2, False, 8, None),
    (1, False, "fp8", None), (5, False, "fp8_col", None),
    (3, False, 4, MgpuMatmulConfig(gps=1)), (2, False, 8, MgpuMatmulConfig(gps=2, splits=2,
                                                                            stages=2)),
    # groups of 32 / 64 with zero points (the last batch of products shorter), GGUF blocks:
    # Q4_K a super row over two steps in two splits, Q6_K two super rows a step (groups of 16)
    # from 128-code tiles sliced in registers (wide)
    (2, False, "int4_asym_g32", None), (1, False, "int4_asym_g64", MgpuMatmulConfig(batch=3)),
    (3, False, "Q4_0", None), (1, False, "Q8_0", None),
    (5, False, "Q4_K", MgpuMatmulConfig(gps=1, splits=2, stages=2)),
    (2, False, "Q6_K", MgpuMatmulConfig(gps=4, batch=5, wide=True))])
def test_kernel_matches_reference_interpret(m, bf16_scales, bits, cfg):
    nk = pk.to_nk(_int4(1, 512, 128, bf16_scales, bits))
    x = normal(2, (m, 512), jnp.bfloat16)
    want = _reference(x, nk, out_dtype=jnp.float32)
    got = pk.quantized_matmul_mgpu(x, nk, cfg=cfg, interpret=True, out_dtype=jnp.float32)
    assert got.shape == (m, 128) and got.dtype == jnp.float32
    # Exact codes, each group's float32 product times its scale: float32 rounding only; with
    # the scales before the product (int4 with offsets in small groups, cfg.pre) the weights'
    # one bf16 rounding.
    pre = (cfg or default_config(m, 512, 128, pk.nk_format(nk))).pre
    assert rel_err(got, want) < (5e-3 if pre else 1e-5)
    # The check can fail: the scales of another weight are far off.
    other = nk.replace(scale=pk.to_nk(_int4(3, 512, 128, bf16_scales, bits)).scale)
    assert rel_err(pk.quantized_matmul_mgpu(x, other, cfg=cfg, interpret=True), want) > 0.1


@pytest.mark.parametrize("interpret", [
    True, pytest.param(False, marks=[pytest.mark.gpu, pytest.mark.skipif(
        jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")])], ids=["interpret", "gpu"])
@pytest.mark.parametrize("fmt", [4, "Q4_K"])
def test_two_weights_in_one_launch(interpret, fmt):
    """Gate and up as the SwiGLU takes them: one grid over both weights' blocks (N 128 and
    192), each output against its own reference, and as unreduced K-range sums; weights of
    two formats are refused."""
    a, b = pk.to_nk(_int4(6, 512, 128, bits=fmt)), pk.to_nk(_int4(7, 512, 192, bits=fmt))
    x = normal(8, (2, 512), jnp.bfloat16)
    ya, yb = pk.quantized_matmul_mgpu(x, (a, b), interpret=interpret, out_dtype=jnp.float32)
    assert ya.shape == (2, 128) and yb.shape == (2, 192)
    tol = 5e-3 if fmt == "Q4_K" else 1e-4  # Q4_K: the weights rounded to bf16 (cfg.pre)
    for y, w in ((ya, a), (yb, b)):
        assert rel_err(y, _reference(x, w, out_dtype=jnp.float32)) < tol
    # Left as the K ranges' float32 sums [S, M, N] (for a consumer kernel): they add up to it.
    pa, pb = pk.quantized_matmul_mgpu(x, (a, b), interpret=interpret, partials=True)
    assert pa.shape[1:] == (2, 128) and pb.shape[1:] == (2, 192) and pa.dtype == jnp.float32
    np.testing.assert_array_equal(jnp.sum(pa, axis=0), ya)
    np.testing.assert_array_equal(jnp.sum(pb, axis=0), yb)
    other = pk.to_nk(_int4(7, 512, 192, bits="Q6_K" if fmt == 4 else 4))
    with pytest.raises(ValueError, match="different formats"):
        pk.quantized_matmul_mgpu(x, (a, other), interpret=interpret)


@jax.jit  # the pure-jnp reference as one program (eager, each op compiled on its own)
def _stacked_reference(x, w, ids, rows):
    dense = dequantize(w, jnp.float32)  # [E, K, N]
    return jnp.einsum("ak,akn->an", x[rows].astype(jnp.float32), dense[ids])


def test_stacked_experts_rows_and_their_k_range_sums():
    """Stacked experts (a MoE decode): assignment a multiplies x's row rows[a] by expert
    ids[a], with the sums stored as x's rows (M <= 16) and as [N, Mp] tiles (M 17); with
    partials each assignment's K-range sums [S, A, N], which add up to it."""
    w = pk.to_nk(pk.stack_experts([_int4(s, 512, 64) for s in (1, 2, 3)]))
    # M 17: past ROWS_OUT (16), x's tile 24 rows as at 20, 17 assignments' programs (not 20)
    for m in (4, 17):
        x = normal(m, (m, 512), jnp.bfloat16)
        ids = put(np.random.default_rng(m).integers(0, 3, m), jnp.int32)
        rows = put(np.arange(m, dtype=np.int32)[::-1])  # not the identity
        y = pk.quantized_matmul_mgpu(x, w, experts=(ids, rows), interpret=True,
                                     out_dtype=jnp.float32)  # [A, N]
        want = _stacked_reference(x, w, ids, rows)
        assert y.shape == (m, 64) and rel_err(y, want) < 1e-4, m
        parts = pk.quantized_matmul_mgpu(x, w, experts=(ids, rows), interpret=True,
                                         partials=True)
        assert parts.shape == (2, m, 64), parts.shape  # K 512: two ranges
        np.testing.assert_array_equal(jnp.sum(parts, axis=0), y)


@pytest.mark.parametrize("interpret", [
    True, pytest.param(False, marks=[pytest.mark.gpu, pytest.mark.skipif(
        jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")])], ids=["interpret", "gpu"])
def test_fragment_order_codes_match_reference(interpret):
    """int4 codes stored in fragment order (to_frag; MgpuMatmulConfig.frag) give the same
    product (on the GPU: the in-place conversion's registers); the unpermuted codes under the
    same config do not (the check can fail)."""
    from pallas_kernels.quantized_mgpu import from_frag, int_matmul_mgpu, to_frag
    nk = pk.to_nk(_int4(1, 512, 128))
    c = nk.planes[0]
    np.testing.assert_array_equal(from_frag(to_frag(c)), c)
    x = normal(2, (3, 512), jnp.bfloat16)
    want = _reference(x, nk, out_dtype=jnp.float32)
    cfg = MgpuMatmulConfig(gps=1, stages=2, splits=2, frag=True)
    got = int_matmul_mgpu(x, (to_frag(c),), (nk.scale,), cfg=cfg, interpret=interpret,
                          out_dtype=jnp.float32)[0]
    assert rel_err(got, want) < 1e-5
    bad = int_matmul_mgpu(x, (c,), (nk.scale,), cfg=cfg, interpret=interpret,
                          out_dtype=jnp.float32)[0]
    assert rel_err(bad, want) > 0.1
    with pytest.raises(ValueError, match="fragment order"):
        int_matmul_mgpu(x, (c.astype(jnp.int8),), (nk.scale,), cfg=cfg, interpret=interpret)
    # The weight stored so (to_nk(frag=True), KernelPolicy.int4_fragment_order): the kernel
    # takes the order from it; its codes read back, and its tiles, are the weight's.
    qw = _int4(1, 512, 128)
    fr = pk.to_nk(qw, frag=True)
    assert fr.frag and not (fr.planes[0] == c).all()
    np.testing.assert_array_equal(dequantize(fr), dequantize(qw))
    np.testing.assert_array_equal(pk.to_tiles(fr).planes[0], qw.planes[0])
    np.testing.assert_array_equal(pk.to_nk(fr, frag=False).planes[0], c)
    assert rel_err(pk.quantized_matmul_mgpu(x, fr, interpret=interpret, out_dtype=jnp.float32),
                   want) < 1e-5
    assert not pk.to_nk(_int4(1, 512, 128, bits=8), frag=True).frag  # int4 codes only
    with pytest.raises(ValueError, match="fragment order and in K order"):
        pk.quantized_matmul_mgpu(x, (fr, nk), interpret=interpret)
    with pytest.raises(ValueError, match="stored in K order"):  # a config against its codes
        pk.quantized_matmul_mgpu(x, nk, cfg=cfg, interpret=interpret)


@functools.cache
def _norm_weight(seed, k):
    """(1 + 0.2 * normal(seed, (k,), float32)).astype(bfloat16) on the host: float32 products
    and sums, then one round to nearest even, as XLA's ops give them (the same bits)."""
    return put((1 + 0.2 * host_normal(seed, (k,), np.float32)).astype(jnp.bfloat16))


@jax.jit
def _boundary_reference(x, deltas, nw, nk):
    """(x + sum(deltas) rounded once (x without deltas), the reference product of its
    rms_norm, its rows' float32 sums of squares, its inverse RMS [M, 1]) as one program (op by
    op: ~20-50 eager compiles a case)."""
    x_new = x if deltas is None else pk.add_rms_norm_reference(x, deltas, nw, eps=1e-5)[0]
    xf = x_new.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(xf * xf, axis=1) + 1e-5)[:, None]
    return x_new, _normed_reference(x_new, nw, nk, eps=1e-5), jnp.sum(xf * xf, 1), inv_rms


@pytest.mark.parametrize("interpret", [
    True, pytest.param(False, marks=[pytest.mark.gpu, pytest.mark.skipif(
        jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")])], ids=["interpret", "gpu"])
@pytest.mark.parametrize("m, n_deltas, bits", [(1, 4, 4), (3, 2, 8), (2, 0, 4)])
def test_boundary_in_the_kernel_matches_reference(interpret, m, n_deltas, bits):
    """norm_weight (and deltas): the residual add and RMSNorm in the kernel's main loop. The
    residual stream bit for bit the reference's (the deltas summed in chunk order, then x,
    rounded once), the product the reference's rms_norm(x') @ w within float32 and one bf16
    rounding of x' * norm_weight, as partials and finished; the check can fail (another norm
    weight); too many rows and formats whose offsets need x's group sums are refused (Q4_K's
    boundary, with cfg.pre: test_scales_before_the_product)."""
    # N 128: two 64-wide blocks, so the first block's stores (nb == 0: x + deltas, the sums
    # of squares) and a later block's skipping them both run (N 256's four blocks took no
    # other branch and twice the interpreter's time); K 1024 in two splits of two steps (cfg)
    # and in four splits of one step (the default config)
    k, n = 1024, 128
    nk = pk.to_nk(_int4(11, k, n, bits=bits))
    x = normal(12, (m, k), jnp.bfloat16)
    deltas = normal(13, (n_deltas, m, k), jnp.float32) if n_deltas else None
    nw = _norm_weight(14, k)
    x_new, want, sumsq, inv_rms = _boundary_reference(x, deltas, nw, nk)
    cfg = MgpuMatmulConfig(gps=2, stages=2, splits=2)
    y, got_x, ss = pk.quantized_matmul_mgpu(x, nk, cfg=cfg, interpret=interpret,
                                            out_dtype=jnp.float32, norm_weight=nw, eps=1e-5,
                                            deltas=deltas)
    np.testing.assert_array_equal(got_x, x_new)
    assert ss.shape == (2, 8) and rel_err(np.asarray(ss, np.float64).sum(0)[:m], sumsq) < 1e-5
    assert rel_err(y, want) < 5e-3
    # the default config with the boundary (three stages where it fits)
    y, _, _ = pk.quantized_matmul_mgpu(x, nk, interpret=interpret, out_dtype=jnp.float32,
                                       norm_weight=nw, eps=1e-5, deltas=deltas)
    assert rel_err(y, want) < 5e-3
    parts, _, _ = pk.quantized_matmul_mgpu(x, nk, cfg=cfg, interpret=interpret, partials=True,
                                           norm_weight=nw, eps=1e-5, deltas=deltas)
    assert rel_err(np.asarray(parts, np.float64).sum(0) * inv_rms, want) < 5e-3
    other, _, _ = pk.quantized_matmul_mgpu(x, nk, cfg=cfg, interpret=interpret,
                                           out_dtype=jnp.float32,
                                           norm_weight=put(np.asarray(nw)[::-1].copy()),
                                           eps=1e-5, deltas=deltas)
    assert rel_err(other, want) > 0.05
    assert "rows" in pk.nk_norm_unfit(9, nk)
    assert pk.nk_norm_unfit(1, pk.to_nk(_int4(11, k, n, bits="Q4_K"))) is None  # cfg.pre
    assert "offsets" in pk.nk_norm_unfit(1, pk.to_nk(_int4(11, k, n, bits="Q5_1")))
    # by default three stages with the boundary (its staging would cap programs an SM), four
    # without (Llama-3-8B's q/k/v)
    assert default_config(1, 4096, 6144, norm=True).stages == 3
    assert default_config(1, 4096, 6144).stages == 4
    with pytest.raises(ValueError, match="at most 8 rows"):
        pk.quantized_matmul_mgpu(normal(12, (9, k), jnp.bfloat16), nk, interpret=interpret,
                                 norm_weight=nw)


@jax.jit
def _bf16_weight_reference(x, nk):
    """x @ dequantize(nk) rounded to bf16, in float32: one program (op by op: ~10 eager
    compiles a format)."""
    w16 = dequantize(nk, jnp.bfloat16).reshape(nk.k, nk.n).astype(jnp.float32)
    return x.astype(jnp.float32) @ w16


@pytest.mark.parametrize("interpret", [
    True, pytest.param(False, marks=[pytest.mark.gpu, pytest.mark.skipif(
        jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")])], ids=["interpret", "gpu"])
def test_scales_before_the_product(interpret):
    """cfg.pre (groups under 128): each group's codes times its scale plus its offset in bf16,
    the step's groups in one accumulator, no x sums: against x @ dequantize(w) rounded to bf16
    (the weights' one rounding: an error of bf16's order against the float32 reference, which
    a wrong scale or offset passes by far), for one-level, two-level and 6-bit formats, two
    weights in one launch, and the boundary in the main loop on a format with offsets."""
    # K 512: the default configs split it in two K ranges of one 256-wide step each (K 1024:
    # four of the same step), a K-quant's super-group one step; two N blocks
    k, n = 512, 128
    for fmt, m in (("Q4_K", 1), ("Q4_1", 3), ("int4_asym_g32", 2), ("Q6_K", 1), ("Q8_0", 2)):
        nk = pk.to_nk(_int4(21, k, n, bits=fmt), frag=True)
        x = normal(22, (m, k), jnp.bfloat16)
        cfg = dataclasses.replace(default_config(m, k, n, pk.nk_format(nk)), frag=nk.frag,
                                  pre=True, batch=0)
        assert cfg.splits == 2 and k // cfg.splits == cfg.gps * 128, cfg
        want = _bf16_weight_reference(x, nk)
        got = pk.quantized_matmul_mgpu(x, nk, cfg=cfg, interpret=interpret,
                                       out_dtype=jnp.float32)
        assert rel_err(got, want) < 4e-3, fmt
        other = dataclasses.replace(nk, scale=put(np.asarray(nk.scale)[::-1].copy()))
        assert rel_err(pk.quantized_matmul_mgpu(x, other, cfg=cfg, interpret=interpret,
                                                out_dtype=jnp.float32), want) > 0.05, fmt
    # two weights, one launch (gate and up)
    a, b = (pk.to_nk(_int4(s, k, n, bits="Q4_K"), frag=True) for s in (23, 24))
    cfg = dataclasses.replace(default_config(1, k, 2 * n, pk.nk_format(a)), frag=True,
                              pre=True, batch=0)
    x = normal(25, (1, k), jnp.bfloat16)
    ga, gb = pk.quantized_matmul_mgpu(x, (a, b), cfg=cfg, interpret=interpret,
                                      out_dtype=jnp.float32)
    for got, w in ((ga, a), (gb, b)):
        want = _reference(x, w, out_dtype=jnp.float32)
        assert rel_err(got, want) < 4e-3
    # the boundary on Q4_K: offsets in the codes, so no x sums of the un-normed x (the
    # default config with the boundary: nk_norm_unfit lets the model's path take it)
    nk = pk.to_nk(_int4(26, k, n, bits="Q4_K"), frag=True)
    nw = _norm_weight(27, k)
    deltas = normal(28, (2, 1, k), jnp.float32)
    xf = pk.add_rms_norm_reference(x, deltas, nw, eps=1e-5)[0]
    want = _normed_reference(xf, nw, nk, eps=1e-5)
    cfg = dataclasses.replace(default_config(1, k, n, pk.nk_format(nk), norm=True), frag=True)
    assert cfg.pre and pk.nk_norm_unfit(1, nk) is None
    got, x_new, _ = pk.quantized_matmul_mgpu(x, nk, interpret=interpret, out_dtype=jnp.float32,
                                             norm_weight=nw, eps=1e-5, deltas=deltas)
    np.testing.assert_array_equal(x_new, xf)
    assert rel_err(got, want) < 6e-3
    with pytest.raises(ValueError, match="cfg.pre"):
        pk.quantized_matmul_mgpu(x, nk, cfg=dataclasses.replace(cfg, pre=False),
                                 interpret=interpret, norm_weight=nw, eps=1e-5, deltas=deltas)


def test_decode_path_takes_the_mosaic_kernel_and_matches_reference():
    """int4 g128 everywhere (q/k/v, o, gate/up, down, the LM head): each decode-path product
    through the kernel (counted in the traced step); logits against the reference path."""
    config = tiny_config(hidden_size=128, intermediate_size=256, num_layers=1, vocab_size=128)
    # quantized in one program (op by op: ~60 eager compiles); the same codes and scales
    params = jax.jit(quantize_params, static_argnums=(1, 2))(
        typed(random_params(config), llama.param_specs(config)), "int4", 128)
    # the boundaries apart first (add_rms_norm before each matmul; the default below)
    plan = Plan(config, INTERPRET.replace(quant_matmul="mosaic", dequant_block_bytes=0,
                                          int4_fragment_order=False, mosaic_norm_rows=0))
    nk = int_layout_params(params, plan)
    assert not nk["layers"][0]["w_down"].frag
    assert nk["embed"].layout == "tiles"  # a table's columns are gathered, not multiplied
    layouts = {w.layout for w in jax.tree.leaves(
        {k: v for k, v in nk.items() if k != "embed"},
        is_leaf=lambda a: isinstance(a, pk.QuantizedWeight)) if isinstance(w, pk.QuantizedWeight)}
    assert layouts == {"nk"}, layouts
    ids = jax.random.randint(jax.random.key(2), (2, 5), 0, config.vocab_size)
    # decode_steps' cache length (T + 3): the single steps below reuse its compiled decode step
    cache = KVCache.init(config, 2, 8)
    tokens = put(np.ones((2, 1), np.int32))
    # the step traced once for both counts below (a trace runs the five kernels' Python)
    step_jaxpr = jax.make_jaxpr(lambda p, c: llama.forward(p, tokens, tokens, plan, c))(
        nk, cache).jaxpr
    calls = _count_jits(step_jaxpr, collections.Counter())  # = jitted_calls_in
    # one decode step through the kernel: q/k/v, o, gate and up (one launch), down, the head
    assert calls["int_matmul_mgpu"] == 5, calls
    # q/k/v, o and down hand their K ranges' float32 sums [S, M, N] to the kernels after them
    # (attention, add_rms_norm); gate / up and the head return [M, N]
    outs = collections.Counter()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("jit", "pjit") and eqn.params["name"] == "int_matmul_mgpu":
                outs[tuple(v.aval.ndim for v in eqn.outvars)] += 1
            for sub in _jaxprs(tuple(eqn.params.values())):
                walk(sub)
    walk(step_jaxpr)
    assert outs == {(3,): 3, (2, 2): 1, (2,): 1}, outs
    # Each forward one jitted program, awaited: op-by-op dispatch beside the GPU interpreter's
    # callbacks hung twice on this 2-core machine (the main thread on a lock in the next op's
    # dispatch), once a session.
    forward = jax.jit(llama.forward, static_argnames=("plan", "fresh"))

    def step(*args, **kwargs):
        return jax.block_until_ready(forward(*args, **kwargs))
    ref, _ = decode_steps(params, Plan(config, KernelPolicy.reference()), ids, forward=step)
    assert_close(decode_steps(nk, plan, ids, forward=step)[0], ref)
    # The boundary before q/k/v in the kernel (KernelPolicy.mosaic_norm_rows, on by default):
    # down's sums go to q/k/v's launch, which adds them with the norm in its main loop and
    # returns its sums, the residual stream and the sums of squares (for attention). The
    # logits as close to the reference.
    assert KernelPolicy().mosaic_norm_rows == 8  # NORM_ROWS, all the kernel takes
    other = Plan(config, plan.policy.replace(mosaic_norm_rows=8))
    outs.clear()
    walk(jax.make_jaxpr(lambda p, c: llama.forward(p, tokens, tokens, other, c))(
        nk, cache).jaxpr)
    assert outs == {(3, 2, 2): 1, (3,): 2, (2, 2): 1, (2,): 1}, outs
    assert_close(decode_steps(nk, other, ids, forward=step)[0], ref)
    # With the int4 codes in fragment order: the same kernels, the same logits.
    fplan = Plan(config, plan.policy.replace(int4_fragment_order=True))
    frag = int_layout_params(params, fplan)
    assert frag["layers"][0]["w_down"].frag
    np.testing.assert_allclose(step(frag, tokens, tokens, fplan, cache)[0],
                               step(nk, tokens, tokens, plan, cache)[0], rtol=0, atol=0)
    # And back: a Triton plan gets the tiles layout again.
    tiles = int_layout_params(nk, Plan(config, INTERPRET.replace(quant_matmul="triton")))
    np.testing.assert_array_equal(tiles["layers"][0]["w_down"].planes[0],
                                  params["layers"][0]["w_down"].planes[0])


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("bits", [4, 8, "fp8", "int4_g32", "int4_asym_g32", "int4_asym_g64",
                                  *GGUF])
@pytest.mark.parametrize("m, k, n, cfg", [
    (1, 4096, 1024, None), (16, 2048, 512, None), (64, 1024, 256, None),
    (3, 1024, 256, MgpuMatmulConfig(gps=1, stages=3, splits=2)),
    (5, 2048, 256, MgpuMatmulConfig(gps=4, stages=2, splits=2, batch=3)),
    (10, 2048, 512, None)])
def test_kernel_matches_reference_gpu(bits, m, k, n, cfg):
    """The compiled kernel on the H200 (default configurations, 128-code tiles for groups
    under 128; a one-unit step with K-quants' super rows over two steps and a four-unit step
    in batches of 3 groups, both group-wide tiles; 10 rows: x padded to 16 for TMA)."""
    nk = pk.to_nk(_int4(4, k, n, bits=bits))
    x = normal(5, (m, k), jnp.bfloat16)
    want = pk.quantized_matmul_mgpu_reference(x, nk, out_dtype=jnp.float32)
    if nk.group == 64 and cfg is not None and cfg.gps == 1:  # refused: it crashed here
        with pytest.raises(ValueError, match="groups of 64"):
            pk.quantized_matmul_mgpu(x, nk, cfg=cfg)
        return
    pre = (cfg or default_config(m, k, n, pk.nk_format(nk))).pre  # the weights in bf16
    assert rel_err(pk.quantized_matmul_mgpu(x, nk, cfg=cfg, out_dtype=jnp.float32),
                   want) < (5e-3 if pre else 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
def test_decode_path_takes_the_mosaic_kernel_gpu():
    """On the H200 the default policy repacks int4 g128 weights and decodes through the
    kernel; logits against the reference path."""
    config = tiny_config(hidden_size=128, intermediate_size=256, num_layers=2, vocab_size=128)
    params = quantize_params(typed(random_params(config), llama.param_specs(config)), "int4", 128)
    plan = Plan(config)
    nk = int_layout_params(params, plan)
    assert nk["layers"][0]["w_down"].layout == "nk"
    ids = jax.random.randint(jax.random.key(2), (2, 13), 0, config.vocab_size)
    fused, _ = decode_steps(nk, plan, ids)
    assert_close_to_reference(params, config, ids, fused)


@pytest.mark.parametrize("on_gpu", [False, pytest.param(True, marks=[
    pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu",
                                        reason="needs an NVIDIA GPU")])], ids=["traced", "gpu"])
def test_gguf_model_takes_the_mosaic_kernel(tmp_path, on_gpu):
    """A GGUF of Q4_K_M's mix (Q4_K; attn_v in Q6_K: q, k, v as Parts) loaded kept quantized:
    every matmul weight (each part) goes nk on load, and each decode-path product takes the
    kernel (counted in the traced step: per layer q, k, v, o, gate and up in one launch,
    down; the head). On the H200, with the default policy: logits against the reference
    path."""
    config, params, _ = G.load_gguf(tiny_llama(tmp_path / "q4_k_m.gguf", mixed))
    policy = None if on_gpu else INTERPRET.replace(quant_matmul="mosaic", dequant_block_bytes=0)
    model = from_params(config, params, dtype="bfloat16", policy=policy)
    plan = Plan(model.config, model.policy)
    layer = model.params["layers"][0]
    assert [p.layout for p in layer["wqkv"].parts] == ["nk"] * 3
    assert {layer[w].layout for w in ("wo", "w_gate", "w_up", "w_down")} == {"nk"}
    assert model.params["lm_head"].layout == "nk" and model.params["embed"].layout == "tiles"
    tokens = put(np.ones((2, 1), np.int32))
    calls = jitted_calls_in(lambda p, c: llama.forward(p, tokens, tokens, plan, c),
                            model.params, KVCache.init(model.config, 2, 16))
    assert calls["int_matmul_mgpu"] == 6 * config.num_layers + 1, calls
    if on_gpu:
        # Random K-quant blocks make weights up to ~9 in size: a chaotic model where one
        # position's rounding order can move an attention peak (interpret mode: one position
        # of five at 0.19, every product exact to 3e-7), so the median position is checked.
        ids = jax.random.randint(jax.random.key(2), (2, 13), 0, config.vocab_size)
        fused, _ = decode_steps(model.params, plan, ids)
        ref, _ = decode_steps(model.params, Plan(model.config, KernelPolicy.reference()), ids)
        assert np.median([rel_err(fused[:, i], ref[:, i]) for i in range(13)]) < 3e-2
        assert np.mean(fused.argmax(-1) == ref.argmax(-1)) >= 0.9


def test_groups_of_64_refuse_one_unit_steps():
    """Groups of 64 with one 128-wide unit a step crashed on the H200: such a config is
    refused before the launch, and a K of an odd number of units keeps the tiles layout."""
    nk = pk.to_nk(_int4(1, 512, 128, bits="int4_asym_g64"))
    with pytest.raises(ValueError, match="groups of 64"):
        pk.quantized_matmul_mgpu(normal(2, (1, 512), jnp.bfloat16), nk,
                                 cfg=MgpuMatmulConfig(gps=1), interpret=True)
    assert "odd number" in pk.nk_unfit(_int4(1, 384, 128, bits="int4_asym_g64"))
