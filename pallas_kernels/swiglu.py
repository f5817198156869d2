"""Fused SwiGLU: silu(x @ w_gate) * (x @ w_up) in one pass over x.

One program computes a [block_m, block_n] tile of the output: it walks K once, multiplying each
x tile into both the gate and the up accumulators (float32), and applies SiLU and the product in
the epilogue, so neither intermediate [M, N] matrix touches HBM. The pre-MLP RMSNorm can ride in
the same pass (`norm_weight=`), and before it the residual add of the attention's split-K
chunks (`deltas=`), so the decoder's attention -> MLP boundary has no kernel of its own. The
kernel is the shared fused matmul of norm_matmul.py. Any M, N, K: edge tiles use masked loads
and stores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import check_array, check_same_dtype, ref_precision
from pallas_kernels.norm_matmul import (MatmulBlockSizes, check_prefetch, default_block_sizes,
                                        fused_matmul)
from pallas_kernels.rms_norm import add_deltas_reference, check_deltas, rms_norm_reference


def _validate(x, w_gate, w_up, norm_weight=None, deltas=None):
    op = "swiglu"
    check_array(op, "x", x, 2)
    if deltas is not None:
        check_deltas(op, x, deltas, float32_only=True)
    check_array(op, "w_gate", w_gate, 2)
    check_array(op, "w_up", w_up, 2)
    arrays = dict(x=x, w_gate=w_gate, w_up=w_up)
    if norm_weight is not None:
        check_array(op, "norm_weight", norm_weight, 1)
        arrays["norm_weight"] = norm_weight
        if norm_weight.shape[0] != x.shape[1]:
            raise ValueError(f"{op}: norm_weight has {norm_weight.shape[0]} entries, x has "
                             f"K={x.shape[1]} features")
    check_same_dtype(op, **arrays)
    if w_gate.shape != w_up.shape:
        raise ValueError(f"{op}: w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} "
                         f"must have one shape")
    if w_gate.shape[0] != x.shape[1]:
        raise ValueError(f"{op}: x has K={x.shape[1]} features but the weights have "
                         f"{w_gate.shape[0]} rows (weights are [K, N], [in, out])")


def swiglu(x, w_gate, w_up, *, norm_weight=None, eps: float = 1e-6, deltas=None,
           prefetch: tuple = (), interpret: bool = False,
           block_sizes: MatmulBlockSizes | None = None):
    """silu(h @ w_gate) * (h @ w_up); x [M, K], w_* [K, N] -> [M, N] in x's dtype, where h is x,
    or rms_norm(x, norm_weight, eps) (HF semantics) fused into the main loop when norm_weight
    [K] is given.
    deltas [S, M, K] float32 (a split-K producer's chunks): x is first replaced by
    x + sum(deltas) (rounded once to x's dtype), the decoder's residual add done in the same
    pass; returns (x + sum(deltas), the SwiGLU output) then.
    prefetch: (array, PrefetchPlan) pairs for the next kernel, as in norm_matmul."""
    _validate(x, w_gate, w_up, norm_weight, deltas)
    check_prefetch("swiglu", prefetch)
    blocks = block_sizes or default_block_sizes(x.shape[0], w_gate.shape[1], x.shape[1],
                                                x.dtype.itemsize, n_weights=2)
    return fused_matmul(x, norm_weight, (w_gate, w_up), None, eps=float(eps), blocks=blocks,
                        epilogue="swiglu", interpret=interpret, deltas=deltas,
                        prefetch=tuple(a for a, _ in prefetch),
                        prefetch_plans=tuple(p for _, p in prefetch))


def swiglu_reference(x, w_gate, w_up, *, norm_weight=None, eps: float = 1e-6, deltas=None,
                     interpret: bool = False):
    """silu(h @ w_gate) * (h @ w_up) with float32 accumulation, in plain jnp (h and the
    deltas' residual add as in swiglu)."""
    del interpret
    _validate(x, w_gate, w_up, norm_weight, deltas)
    if deltas is not None:
        x = add_deltas_reference(x, deltas)
        return x, swiglu_reference(x, w_gate, w_up, norm_weight=norm_weight, eps=eps)
    if norm_weight is not None:
        x = rms_norm_reference(x, norm_weight, eps=eps)
    hp = ref_precision(x.dtype)
    gate = jnp.dot(x, w_gate, preferred_element_type=jnp.float32, precision=hp)
    up = jnp.dot(x, w_up, preferred_element_type=jnp.float32, precision=hp)
    return (jax.nn.silu(gate) * up).astype(x.dtype)
