"""pallas_kernels.l2_prefetch (the read that leaves a weight's first rows in L2) against its
reference, in interpret mode on the CPU and on the GPU; its bad inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import l2_prefetch, l2_prefetch_reference


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape, length, programs, block", [
    ((2, 1000), 512, 4, 64),   # a prefix of each row, 2 blocks per program
    ((1, 96), 96, 3, 32),      # the whole row, one block per program
    ((3, 640), 384, 2, 64),    # 3 rows, 3 blocks per program
])
def test_matches_reference(dtype, shape, length, programs, block):
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype)
    after = jnp.ones((2, 5), jnp.float32)  # never read; only orders the kernel
    got = l2_prefetch(x, length=length, programs=programs, block=block, after=after,
                      interpret=True)
    want = l2_prefetch_reference(x, length=length, programs=programs, block=block)
    assert got.shape == (shape[0], programs) and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # a max is exact
    # The span past `length` is not read: changing it changes nothing.
    poked = x.at[:, length:].set(100) if length < shape[1] else x
    np.testing.assert_array_equal(
        np.asarray(l2_prefetch(poked, length=length, programs=programs, block=block,
                               interpret=True)), np.asarray(want))


@pytest.mark.parametrize("kw, match", [
    (dict(length=500, programs=4, block=64), "multiple of programs"),
    (dict(length=2000, programs=4, block=64), "must be in"),
    (dict(length=512, programs=0, block=64), ">= 1"),
])
def test_bad_input(kw, match):
    x = jnp.zeros((2, 1000), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        l2_prefetch(x, **kw)


def test_rejects_wrong_rank_and_dtype():
    with pytest.raises(ValueError, match="rank 2"):
        l2_prefetch(jnp.zeros((8,), jnp.bfloat16), length=8, programs=1, block=8)
    with pytest.raises(ValueError, match="dtype"):
        l2_prefetch(jnp.zeros((1, 8), jnp.int32), length=8, programs=1, block=8)


@pytest.mark.gpu
def test_gpu_matches_reference():
    """The model's use: the first half of both K chunks of a [4096, 4096] o weight."""
    w = jax.random.normal(jax.random.key(1), (4096, 4096), jnp.float32).astype(jnp.bfloat16)
    x = w.reshape(2, -1)
    length = 2048 * 4096 // 2
    got = l2_prefetch(x, length=length, programs=256, after=jnp.zeros((3,), jnp.float32))
    want = l2_prefetch_reference(x, length=length, programs=256)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
