"""benchmarks/grid_barrier_probe.py (a persistent kernel with grid barriers against one kernel
per layer): its kernels match jnp in interpret mode (one program: the interpreter runs programs
one after another, so a barrier across several would never open) and lower for an H200."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import benchmarks.grid_barrier_probe as probe
from kernel_testing import rel_err
from test_gpu_lowering import S, lower_for_h200


def _inputs(d=64, layers=3):
    x = jax.random.normal(jax.random.key(0), (1, d), jnp.float32).astype(jnp.bfloat16)
    w = [(jax.random.normal(k, (d, d), jnp.float32) / d ** 0.5).astype(jnp.bfloat16)
         for k in jax.random.split(jax.random.key(1), layers)]
    return x, w


@pytest.mark.parametrize("variant", [
    functools.partial(probe.chain_kernels, block_n=16, block_k=16),
    functools.partial(probe.chain_persistent, block_n=64, block_k=16),
    functools.partial(probe.chain_persistent, block_n=64, block_k=16, prefetch=2),
], ids=["kernels", "persistent", "persistent+prefetch2"])
def test_probe_chains_interpret(variant):
    x, w = _inputs()
    got = variant(x, w, interpret=True)
    assert rel_err(got, probe.chain_reference(x, w)) < 1e-2


@pytest.mark.parametrize("prefetch", [0, 2])
def test_persistent_kernel_lowers(prefetch):
    module = lower_for_h200(functools.partial(probe.chain_persistent, prefetch=prefetch),
                            S((1, 4096), jnp.bfloat16), [S((4096, 4096), jnp.bfloat16)] * 2)
    assert "gemv_persistent_d4096_l2" in module
