"""The decode matmuls' L2 prefetch of the next kernel's weight (pallas_kernels/l2_prefetch.py).

A prefetch is a cache hint, so what can be checked is: the plan covers exactly the rows the
consumer reads first, every chunk of it is some program's, the kernels give bit-identical
results with and without it (interpret mode on the CPU, and compiled on the GPU), the lowering
holds one bulk prefetch per program thread, and bad arguments get clear errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.configs import PRESETS
from jaxinfer.ops.linear import prefetch_pairs
from jaxinfer.plan import At, KernelPolicy, Plan, Prefetch
from jaxinfer.weights import Dense
from pallas_kernels.l2_prefetch import PrefetchPlan, l2_prefetch, plan_programs, program_offsets
from pallas_kernels.norm_matmul import (MatmulBlockSizes, _chunking, default_block_sizes,
                                        first_rows_plan, norm_matmul)
from pallas_kernels.swiglu import swiglu

SPLIT = MatmulBlockSizes(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=1,
                         split_k=3)


def covered(plan: PrefetchPlan, programs: int, threads: int, itemsize: int) -> np.ndarray:
    """Element coverage count of the plan's prefetches over all programs, flat [max end]."""
    _, chunk, _ = plan_programs(plan, programs, threads, itemsize)
    hits = np.zeros(max(plan.starts) + plan.length, np.int32)
    for p in range(programs):
        offsets, nbytes = program_offsets(plan, jnp.int32(p), programs, threads, itemsize)
        assert nbytes == chunk * itemsize and nbytes % 16 == 0
        for o in set(np.asarray(offsets).tolist()):  # duplicates are the clamped last chunk
            hits[o:o + chunk] += 1
    return hits


@pytest.mark.parametrize("m,k,n,n_weights", [(1, 4096, 6144, 1), (1, 14336, 4096, 1),
                                             (1, 4096, 14336, 2), (1, 4096, 4096, 1)])
def test_first_rows_plan_is_the_consumers_first_tiles(m, k, n, n_weights):
    # Llama-3-8B's decode consumers: q/k/v, down, SwiGLU, o.
    blocks = default_block_sizes(m, n, k, 2, n_weights=n_weights)
    split, k_chunk = _chunking(k, blocks)
    plan = first_rows_plan(m, k, n, n_weights=n_weights)
    assert plan.starts == tuple(s * k_chunk * n for s in range(split))
    assert plan.length == blocks.block_k * n
    assert first_rows_plan(m, k, n, n_weights=n_weights, rows=10 ** 9).length == k_chunk * n


@pytest.mark.parametrize("starts", [(0, 3 * 4096 * 64), (0, 2 * 4096 * 64, 3 * 4096 * 64)],
                         ids=["even", "uneven"])
@pytest.mark.parametrize("programs,threads", [(128, 128), (112, 128), (7, 32)])
def test_every_planned_element_is_prefetched_by_some_program(programs, threads, starts):
    plan = PrefetchPlan(starts=starts, length=64 * 4096)
    hits = covered(plan, programs, threads, 2)
    want = np.zeros_like(hits)
    for s in plan.starts:
        want[s:s + plan.length] = 1
    np.testing.assert_array_equal(hits > 0, want > 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernels_give_the_same_results_with_prefetch(dtype):
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    x = jax.random.normal(keys[0], (1, 200), dtype)
    nw = (1 + 0.1 * jax.random.normal(keys[1], (200,))).astype(dtype)
    w = (jax.random.normal(keys[2], (200, 96)) / 14).astype(dtype)
    nxt = jax.random.normal(keys[3], (96, 64), dtype)
    deltas = jax.random.normal(keys[4], (2, 1, 200), jnp.float32)
    pf = tuple((nxt, first_rows_plan(1, 96, 64, itemsize=nxt.dtype.itemsize, at=at))
               for at in ("start", "end"))
    for fn in (lambda **kw: norm_matmul(x, nw, w, eps=1e-5, partials=True, deltas=deltas,
                                        interpret=True, block_sizes=SPLIT, **kw),
               lambda **kw: swiglu(x, w, w, norm_weight=nw, eps=1e-5, deltas=deltas,
                                   interpret=True, block_sizes=SPLIT, **kw)):
        plain, hinted = fn(), fn(prefetch=pf)
        for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(hinted)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_prefetch_pairs_follow_the_policy():
    plan = Plan(PRESETS["llama3-8b"], KernelPolicy())
    wg = Dense(jax.ShapeDtypeStruct((4096, 14336), jnp.bfloat16))
    assert prefetch_pairs(None, (wg, wg), 1, plan) == ()
    pairs = prefetch_pairs(Prefetch(64, At.START), (wg, wg), 1, plan)
    assert [p[0] for p in pairs] == [wg.w, wg.w]
    assert pairs[0][1] == first_rows_plan(1, 4096, 14336, n_weights=2, rows=64, at="start")
    assert pairs[0][1].length == 64 * 14336 and pairs[0][1].at == "start"
    odd = Dense(jax.ShapeDtypeStruct((70, 3), jnp.bfloat16))  # 3 columns: not 16-byte rows
    assert prefetch_pairs(Prefetch(128), (odd,), 1, plan) == ()
    table = Dense(jax.ShapeDtypeStruct((96, 64), jnp.bfloat16), transposed=True)
    assert prefetch_pairs(Prefetch(128), (table,), 1, plan) == ()  # the kernels read [K, N]


def test_bad_prefetch_arguments_raise_clear_errors():
    x = jnp.zeros((1, 64), jnp.bfloat16)
    w = jnp.zeros((64, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="reads past the end"):
        norm_matmul(x, None, w, prefetch=((w, PrefetchPlan(starts=(0,), length=4096)),))
    with pytest.raises(ValueError, match=r"\(array, PrefetchPlan\) pairs"):
        swiglu(x, w, w, prefetch=(w,))
    with pytest.raises(ValueError, match="multiple of 16"):
        l2_prefetch(None, None, nbytes=24)
    with pytest.raises(ValueError, match="'start', 'end'"):
        PrefetchPlan(starts=(0,), length=64, at="middle")
    with pytest.raises(ValueError, match="not a multiple"):
        plan_programs(PrefetchPlan(starts=(0,), length=7), 4, 32, 2)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
def test_prefetch_changes_no_result_on_the_gpu():
    # Llama-3-8B at batch 1: the o projection prefetching SwiGLU's first rows at its end,
    # SwiGLU down's at its start, compiled and run; bit-identical to the same kernels without.
    keys = jax.random.split(jax.random.PRNGKey(3), 6)
    bf = jnp.bfloat16
    a = jax.random.normal(keys[0], (1, 4096), bf)
    wo = (jax.random.normal(keys[1], (4096, 4096)) / 64).astype(bf)
    wg, wu = ((jax.random.normal(k, (4096, 14336)) / 64).astype(bf) for k in keys[2:4])
    wd = (jax.random.normal(keys[4], (14336, 4096)) / 120).astype(bf)
    nw = jnp.ones((4096,), bf)
    mlp = first_rows_plan(1, 4096, 14336, n_weights=2, rows=64, at="end")
    down = first_rows_plan(1, 14336, 4096, rows=128, at="start")
    for kw_o, kw_s in (({}, {}), (dict(prefetch=((wg, mlp), (wu, mlp))),
                                  dict(prefetch=((wd, down),)))):
        parts = norm_matmul(a, None, wo, partials=True, **kw_o)
        out = swiglu(a, wg, wu, norm_weight=nw, eps=1e-5, deltas=parts, **kw_s)
        if not kw_o:
            ref = jax.tree.map(np.asarray, (parts, out))
        else:
            for r, o in zip(jax.tree.leaves(ref), jax.tree.leaves((parts, out))):
                np.testing.assert_array_equal(r, np.asarray(o))
