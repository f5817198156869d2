"""benchmarks/persistent_mgpu_probe.py (persistent Mosaic GPU chains with a semaphore grid
barrier, and the transposed-form weight stream): the stream kernel matches jnp under the Mosaic
GPU interpreter; every variant the probe times lowers for an H200. The persistent chains take a
global semaphore, which the interpreter does not model, so their numbers come from the probe's
own check against jnp on the GPU (`bash benchmarks/run_h200.sh persist`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import benchmarks.persistent_mgpu_probe as probe
from kernel_testing import rel_err
from pallas_kernels.decode_matmul_mgpu import DecodeMatmulConfig
from test_gpu_lowering import S, lower_for_h200

BF16 = jnp.bfloat16


@pytest.mark.parametrize("split, programs", [(1, 4), (2, 4), (2, 8)],
                         ids=["unsplit-1unit", "split2-2units", "split2-1unit"])
def test_stream_wa_interpret(split, programs):
    """Units dealt round-robin, the ring running from one unit into the next, K parts summed."""
    k, n = 512, 256
    x = jax.random.normal(jax.random.key(0), (probe.MP, k), jnp.float32).astype(BF16)
    w = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) / k ** 0.5).astype(BF16)
    got = probe.stream_wa(x, w, cfg=DecodeMatmulConfig(block_n=64, block_k=64, stages=3),
                          split=split, programs=programs, interpret=True)
    assert got.shape == (probe.MP, n)
    assert rel_err(got, jnp.dot(x, w, preferred_element_type=jnp.float32)) < 1e-2


CHAINS = {
    "padded x, ring drained": functools.partial(
        probe.chain_persistent, cfg=DecodeMatmulConfig(32, 128, 6), ring=False),
    "padded x, ring": functools.partial(
        probe.chain_persistent, cfg=DecodeMatmulConfig(32, 128, 6), ring=True),
    "transposed": functools.partial(
        probe.chain_persistent_wa, cfg=DecodeMatmulConfig(64, 256, 4), split=1),
    "transposed, split 2, whole x": functools.partial(
        probe.chain_persistent_wa, cfg=DecodeMatmulConfig(64, 256, 4), split=2, whole_x=True),
    "transposed, no barrier": functools.partial(
        probe.chain_persistent_wa, cfg=DecodeMatmulConfig(64, 128, 8), split=2, barrier=False),
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_persistent_chains_lower(name):
    module = lower_for_h200(CHAINS[name], S((probe.MP, 4096), BF16), [S((4096, 4096), BF16)] * 2)
    assert module.count("custom_call @mosaic_gpu") == 1  # the whole chain is one kernel


def test_stream_wa_lowers():
    fn = functools.partial(probe.stream_wa, cfg=DecodeMatmulConfig(64, 256, 4), split=1,
                           programs=112)
    module = lower_for_h200(fn, S((probe.MP, 4096), BF16), S((4096, 14336), BF16))
    assert module.count("custom_call @mosaic_gpu") == 1


def test_stream_wa_rejects_uneven_units():
    """7 programs cannot share 4 column tiles x 2 K parts evenly: an error, not a short result."""
    x = jnp.zeros((probe.MP, 512), BF16)
    w = jnp.zeros((512, 256), BF16)
    with pytest.raises(ValueError, match="multiple of programs"):
        probe.stream_wa(x, w, cfg=DecodeMatmulConfig(block_n=64, block_k=64, stages=3), split=2,
                        programs=7, interpret=True)
