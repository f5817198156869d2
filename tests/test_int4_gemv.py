"""pallas_kernels/int4_gemv.py (the paired-nibble int4 decode matmul) in interpret mode, against
x @ dequantize(qw) in float32; and its Triton lowering for an abstract H200 (no GPU needed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels._jax_private import triton_lowering
from pallas_kernels.int4_gemv import Int4Blocks, int4_matmul, int4_matmul_reference
from pallas_kernels.quantized import quantize_weight


def _case(m, k, n, group, x_dtype=jnp.bfloat16, seed=0):
    w = jax.random.normal(jax.random.key(seed), (k, n), jnp.float32) * 0.02
    x = jax.random.normal(jax.random.key(seed + 1), (m, k), jnp.float32).astype(x_dtype)
    return x, quantize_weight(w, bits=4, group_size=group)


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("m, k, n, group, blocks", [
    # K = 3 tiles of 128 (the last byte unit's high nibbles are padding), N not a multiple of 64
    (1, 384, 200, 128, Int4Blocks()),
    (5, 384, 200, 128, Int4Blocks(block_n=64, split_k=2)),
    # 5 tiles = 3 units over 2 chunks: the last chunk steps past the last unit
    (1, 640, 72, 128, Int4Blocks(block_n=32, split_k=2, depth=3)),
    (5, 640, 72, 128, Int4Blocks(block_n=16, split_k=2, depth=4)),
    # groups of 32 (tile 32), 3 tiles; one scale per column with K not a multiple of the tile
    (5, 96, 40, 32, Int4Blocks(block_n=32, depth=1)),
    (1, 200, 48, None, Int4Blocks(block_n=16)),
    # M = 1 without the tensor cores
    (1, 640, 72, 128, Int4Blocks(block_n=32, split_k=2, mode="fma")),
    (1, 384, 200, 128, Int4Blocks(block_n=64, mode="fma", depth=1)),
], ids=["m1", "m5-split2", "m1-ragged-chunk", "m5-ragged-chunk-d4", "g32-m5",
        "per-column-m1", "fma-ragged-chunk", "fma-m1"])
def test_int4_matmul_matches_dequantize(m, k, n, group, blocks):
    x, qw = _case(m, k, n, group)
    ref = int4_matmul_reference(x, qw)
    out = int4_matmul(x, qw, blocks=blocks, interpret=True)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    assert _rel_err(out, ref) < 5e-3  # one bf16 rounding of the output
    # float32 x and output: the codes and scales are exact, so only summation order differs
    x32 = x.astype(jnp.float32)
    out32 = int4_matmul(x32, qw, blocks=blocks, interpret=True)
    np.testing.assert_allclose(np.asarray(out32), np.asarray(int4_matmul_reference(x32, qw)),
                               rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(ref))))


def test_int4_matmul_rejects_other_formats():
    x, qw = _case(3, 128, 32, 32)
    with pytest.raises(ValueError, match="symmetric int4"):
        int4_matmul(x, quantize_weight(np.ones((128, 32), np.float32), bits=8), interpret=True)
    with pytest.raises(ValueError, match="symmetric int4"):
        int4_matmul(x, quantize_weight(np.ones((128, 32), np.float32), bits=4,
                                       symmetric=False), interpret=True)
    with pytest.raises(ValueError, match="M = 1"):
        int4_matmul(x, qw, blocks=Int4Blocks(mode="fma"), interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        Int4Blocks(block_n=48)


H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
    device_kind="NVIDIA H200", num_cores=132, platform="gpu"))


@pytest.mark.parametrize("m, blocks", [
    (1, Int4Blocks()), (1, Int4Blocks(block_n=128, split_k=2, depth=3, num_warps=8)),
    (1, Int4Blocks(split_k=2, mode="fma")), (16, Int4Blocks(block_n=128, split_k=2))])
def test_int4_matmul_lowers_for_h200(m, blocks, monkeypatch):
    """Lowered to Triton IR for CUDA at the benchmark's shape, each module MLIR-verified (what
    XLA's parser checks on the GPU); Triton's own passes only run there."""
    real = triton_lowering.lower_jaxpr_to_triton_module
    seen = []

    def lower_and_verify(*args, **kwargs):
        result = real(*args, **kwargs)
        result.module.operation.verify()
        seen.append(str(result.module))
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    k, n = 4096, 14336
    qw = jax.eval_shape(lambda w: quantize_weight(w, bits=4, group_size=128),
                        jax.ShapeDtypeStruct((k, n), jnp.bfloat16))
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    with jax.sharding.use_abstract_mesh(H200):
        export.export(jax.jit(lambda x, q: int4_matmul(x, q, blocks=blocks)),
                      platforms=("cuda",),
                      disabled_checks=[export.DisabledSafetyCheck.custom_call(
                          "__gpu$xla.gpu.triton")])(x, qw)
    assert len(seen) == 1
    assert seen[0].count("tt.dot") == (0 if blocks.mode == "fma" else 2)
