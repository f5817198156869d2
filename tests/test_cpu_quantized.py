"""The CPU's quantized matmul kernel (pallas_kernels/cpu_quantized.cc) against x @ the weights'
values (and, with int8_x, round_to_int8(x) @ them): gguf.quants' for every GGUF block type,
`dequantize` for our int8 / int4 formats; a row's result whatever the batch and thread count;
the formats it leaves to XLA's tiles."""

from __future__ import annotations

import functools

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import gguf_blocks
from jaxinfer.ops import blocked
from jaxinfer.plan import KernelPolicy, Plan
from pallas_kernels import cpu_quantized as cq
from pallas_kernels.quantized import dequantize, quantize_weight
from test_gguf_blocks import random_blocks
from test_kernel_wiring import tiny_config

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's kernel")
QT = gguf.GGMLQuantizationType
matmul = jax.jit(cq.quantized_matmul_cpu, static_argnames=("threads", "int8_x"))


def _check(qw, want: np.ndarray, m: int, seed: int = 1) -> None:
    """The kernel's x [m, K] @ qw against x @ want in float64, and with int8_x against
    round_to_int8(x) @ want (which is not x @ want)."""
    x = np.random.default_rng(seed).standard_normal((m, qw.k)).astype(np.float32)
    rounded = np.asarray(cq.round_to_int8(jnp.asarray(x)))
    assert np.abs(rounded - x).max() > 1e-3  # far from x's own products at this bound
    for int8_x, xs in ((False, x), (True, rounded)):
        got = np.asarray(matmul(jnp.asarray(x), qw, int8_x=int8_x))
        ref = xs.astype(np.float64) @ want.astype(np.float64)
        assert got.shape == ref.shape
        assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max() * np.sqrt(qw.k), int8_x


@pytest.mark.parametrize("type_name", gguf_blocks.BLOCK_TYPES)
def test_gguf_blocks_match_gguf_quants(type_name):
    """Every GGUF block type: x @ gguf.quants' values, at 1 and 5 rows (a decode step, a
    verification), over N = 600 columns (whole blocks of 64, in panels, and a narrower
    last one) and K = 512 (two K-quant super-blocks)."""
    assert cq.available()
    n, k = 600, 512
    raw = random_blocks(type_name, n, k, np.random.default_rng(0))
    want = gguf.quants.dequantize(raw, QT[type_name]).reshape(n, k).T
    qw = jax.tree.map(jnp.asarray, gguf_blocks.repack(raw, type_name, k, n))
    assert cq.fits(qw) is None
    for m in (1, 5):
        _check(qw, want, m)


@pytest.mark.parametrize("bits, group, symmetric", [
    (4, 32, True), (4, 64, False), (4, 128, True), (8, 128, True), (8, 64, False),
    (8, None, True), (4, None, False)])
def test_our_formats_match_dequantize(bits, group, symmetric):
    """int4 / int8 from quantize_weight (float16 scales, zero points or not, groups of 32-128
    or one per column at a K that is no multiple of 16): x @ dequantize(qw), 1 and 3 rows."""
    k = 208 if group is None else 256
    w = np.random.default_rng(2).standard_normal((k, 130)).astype(np.float32)
    qw = jax.tree.map(jnp.asarray, quantize_weight(w, bits=bits, group_size=group,
                                                   symmetric=symmetric))
    assert cq.fits(qw) is None
    want = np.asarray(dequantize(qw))
    for m in (1, 3):
        _check(qw, want, m)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("int8_x", [False, True])
def test_a_rows_result_is_the_same_bits_in_any_batch_and_thread_count(type_name, int8_x):
    """Each row runs the same operations whatever M (speculative verification, the engine's
    batches: with int8_x one row's codes are paired in registers, several rows' once into a
    buffer) and whichever thread takes its columns."""
    raw = random_blocks(type_name, 1000, 256, np.random.default_rng(3))
    qw = jax.tree.map(jnp.asarray, gguf_blocks.repack(raw, type_name, 256, 1000))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((7, 256)), jnp.float32)
    batch = np.asarray(matmul(x, qw, int8_x=int8_x))
    for i in (0, 3, 6):
        np.testing.assert_array_equal(np.asarray(matmul(x[i:i + 1], qw, int8_x=int8_x))[0],
                                      batch[i])
    np.testing.assert_array_equal(np.asarray(matmul(x, qw, threads=1, int8_x=int8_x)), batch)


def test_the_formats_it_leaves_to_the_tiles():
    """fp8 values are not the kernel's: fits says why, and blocked.linear gives them XLA's
    tiles (the same product as dequantize's; with cpu_int8_activations of x rounded as the
    kernel would round it)."""
    w = np.random.default_rng(5).standard_normal((128, 64)).astype(np.float32)
    fp8 = jax.tree.map(jnp.asarray, quantize_weight(w, bits=8, float8=True))
    assert "fp8" in cq.fits(fp8)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 128)), jnp.float32)
    for xs, policy in ((x, KernelPolicy()),
                       (cq.round_to_int8(x), KernelPolicy(cpu_int8_activations=True))):
        plan = Plan(tiny_config(dtype="float32"), policy)
        got = np.asarray(jax.jit(functools.partial(blocked.linear, plan=plan))(x, fp8))
        np.testing.assert_allclose(got, np.asarray(xs) @ np.asarray(dequantize(fp8)), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_stacked_experts_take_each_rows_expert(type_name):
    """Stacked experts (a MoE layer's): row m of x through expert experts[m], each expert's
    product gguf.quants' values; ids out of place are refused before any call."""
    from pallas_kernels.quantized import stack_experts

    n, k, e = 200, 256, 3
    raws = [random_blocks(type_name, n, k, np.random.default_rng(10 + i)) for i in range(e)]
    want = [gguf.quants.dequantize(r, QT[type_name]).reshape(n, k).T for r in raws]
    qw = jax.tree.map(jnp.asarray, stack_experts([gguf_blocks.repack(r, type_name, k, n)
                                                  for r in raws]))
    assert cq.fits(qw) is None
    ids = np.array([2, 0, 2, 1, 0], np.int32)
    x = np.random.default_rng(7).standard_normal((5, k)).astype(np.float32)
    rounded = np.asarray(cq.round_to_int8(jnp.asarray(x)))
    for int8_x, xs in ((False, x), (True, rounded)):
        got = np.asarray(matmul(jnp.asarray(x), qw, jnp.asarray(ids), int8_x=int8_x))
        for m, i in enumerate(ids):
            ref = xs[m].astype(np.float64) @ want[i].astype(np.float64)
            assert np.abs(got[m] - ref).max() <= 1e-5 * np.abs(ref).max(), (m, int8_x)
    with pytest.raises(ValueError, match="one expert id a row"):
        cq.quantized_matmul_cpu(jnp.asarray(x), qw)


def test_a_failed_build_names_the_command_and_the_compiler_output(tmp_path, monkeypatch):
    """No working compiler: the build raises with the command and its error output (which
    available() logs once, leaving the tiles)."""
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="false .*failed"):
        cq._build(str(tmp_path / "k.so"))
    assert not list(tmp_path.iterdir())  # no half-written library left
