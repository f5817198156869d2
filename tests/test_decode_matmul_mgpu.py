"""The Mosaic GPU decode matmul (pallas_kernels/decode_matmul_mgpu.py) against its reference:
the kernel under the Mosaic GPU interpreter on the CPU (CI), on the H200 (GPU-marked), and the
wrapper's errors for inputs it cannot take."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from pallas_kernels.decode_matmul_mgpu import (DecodeMatmulConfig, decode_matmul_mgpu,
                                               decode_matmul_reference)
from kernel_testing import normal, rel_err

CASES = [  # (Mp, K, N, config): one and several ring laps, a ring deeper than K, 16 rows
    (8, 256, 128, DecodeMatmulConfig(block_n=64, stages=2)),
    (16, 192, 64, DecodeMatmulConfig(block_n=64, stages=4)),
    (8, 512, 128, DecodeMatmulConfig(block_n=128, stages=3)),
    (8, 256, 64, DecodeMatmulConfig(block_n=32, block_k=128, stages=2)),  # 64-byte swizzle
]


def _inputs(mp, k, n, dtype=jnp.bfloat16):
    seed = mp * k + n
    return normal(seed, (mp, k), dtype), normal(seed + 1, (k, n), dtype, scale=k ** -0.5)


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}" for c in CASES])
def test_decode_matmul_mgpu_interpret(case, pdl):
    mp, k, n, cfg = case
    x, w = _inputs(mp, k, n)
    got = decode_matmul_mgpu(x, w, config=cfg, pdl=pdl, interpret=True)
    want = decode_matmul_reference(x, w)
    assert got.shape == (mp, n) and got.dtype == x.dtype
    # float32 accumulation in both; one bf16 rounding at the end.
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("x_shape, w_shape, dtype, match", [
    ((8, 256), (128, 64), jnp.bfloat16, "want"),  # K mismatch
    ((4, 256), (256, 64), jnp.bfloat16, "multiple of 8"),  # rows not padded
    ((72, 256), (256, 64), jnp.bfloat16, "multiple of 8"),  # more rows than one wgmma
    ((8, 200), (200, 64), jnp.bfloat16, "multiples"),  # K not whole steps
    ((8, 256), (256, 64), jnp.float32, "bfloat16"),  # f32 has no path here
])
def test_decode_matmul_mgpu_bad_inputs(x_shape, w_shape, dtype, match):
    x = jnp.zeros(x_shape, dtype)
    w = jnp.zeros(w_shape, dtype)
    with pytest.raises(ValueError, match=match):
        decode_matmul_mgpu(x, w, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_decode_matmul_mgpu_gpu(pdl):
    x, w = _inputs(8, 4096, 4096)
    got = decode_matmul_mgpu(x, w, pdl=pdl)
    assert rel_err(got, decode_matmul_reference(x, w)) < 1e-2
