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

from pallas_kernels._common import (GATE_ACTIVATIONS, check_array, check_same_dtype,
                                     gate_activation, ref_precision)
from pallas_kernels.norm_matmul import (MatmulBlockSizes, check_prefetch, default_block_sizes,
                                        fused_matmul)
from pallas_kernels.quantized import QuantizedWeight, check_quantized, dequantize
from pallas_kernels.rms_norm import add_deltas_reference, check_deltas, rms_norm_reference


def _validate(x, w_gate, w_up, norm_weight=None, deltas=None, activation="silu"):
    op = "swiglu"
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {GATE_ACTIVATIONS}, got "
                         f"{activation!r}")
    check_array(op, "x", x, 2)
    if deltas is not None:
        check_deltas(op, x, deltas, float32_only=True)
    if isinstance(w_gate, QuantizedWeight) or isinstance(w_up, QuantizedWeight):
        for name, w in (("w_gate", w_gate), ("w_up", w_up)):
            check_quantized(op, w, x.shape[1])
        if w_gate.tile != w_up.tile or w_gate.shape != w_up.shape:
            raise ValueError(f"{op}: quantized w_gate {w_gate.shape} ({w_gate.name}) and w_up "
                             f"{w_up.shape} ({w_up.name}) need one shape and one K tile")
        w_gate = w_up = jax.ShapeDtypeStruct(w_gate.shape, x.dtype)
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
           block_sizes: MatmulBlockSizes | None = None, activation: str = "silu"):
    """silu(h @ w_gate) * (h @ w_up); x [M, K], w_* [K, N] -> [M, N] in x's dtype, where h is x,
    or rms_norm(x, norm_weight, eps) (HF semantics) fused into the main loop when norm_weight
    [K] is given.
    deltas [S, M, K] float32 (a split-K producer's chunks): x is first replaced by
    x + sum(deltas) (rounded once to x's dtype), the decoder's residual add done in the same
    pass; returns (x + sum(deltas), the SwiGLU output) then.
    prefetch: (array, PrefetchPlan) pairs for the next kernel, as in norm_matmul.
    activation: the gate's, "silu" (SwiGLU) or "gelu_tanh" (GeGLU: tanh-approximated GELU)."""
    _validate(x, w_gate, w_up, norm_weight, deltas, activation)
    check_prefetch("swiglu", prefetch)
    blocks = block_sizes or default_block_sizes(x.shape[0], w_gate.shape[1], x.shape[1],
                                                x.dtype.itemsize, n_weights=2,
                                                quantized=isinstance(w_gate, QuantizedWeight))
    return fused_matmul(x, norm_weight, (w_gate, w_up), None, eps=float(eps), blocks=blocks,
                        epilogue="swiglu", activation=activation, interpret=interpret,
                        deltas=deltas,
                        prefetch=tuple(a for a, _ in prefetch),
                        prefetch_plans=tuple(p for _, p in prefetch))


def swiglu_reference(x, w_gate, w_up, *, norm_weight=None, eps: float = 1e-6, deltas=None,
                     interpret: bool = False, activation: str = "silu"):
    """silu(h @ w_gate) * (h @ w_up) with float32 accumulation, in plain jnp (h and the
    deltas' residual add as in swiglu)."""
    del interpret
    _validate(x, w_gate, w_up, norm_weight, deltas, activation)
    if deltas is not None:
        x = add_deltas_reference(x, deltas)
        return x, swiglu_reference(x, w_gate, w_up, norm_weight=norm_weight, eps=eps,
                                   activation=activation)
    if norm_weight is not None:
        x = rms_norm_reference(x, norm_weight, eps=eps)
    if isinstance(w_gate, QuantizedWeight):
        w_gate, w_up = dequantize(w_gate, x.dtype), dequantize(w_up, x.dtype)
    hp = ref_precision(x.dtype)
    gate = jnp.dot(x, w_gate, preferred_element_type=jnp.float32, precision=hp)
    up = jnp.dot(x, w_up, preferred_element_type=jnp.float32, precision=hp)
    return (gate_activation(gate, activation) * up).astype(x.dtype)


def _validate_down(x, w_gate, w_down, acc, clear):
    op = "swiglu_down"
    check_array(op, "w_down", w_down, 2)
    check_same_dtype(op, x=x, w_down=w_down)
    if w_down.shape[0] != w_gate.shape[1]:
        raise ValueError(f"{op}: w_down {tuple(w_down.shape)} must have {w_gate.shape[1]} rows "
                         f"(the SwiGLU's width; weights are [in, out])")
    want = (x.shape[0], w_down.shape[1])
    for name, a in (("acc", acc), ("clear", clear)):
        check_array(op, name, a, 2, dtypes=(jnp.dtype(jnp.float32),))
        if tuple(a.shape) != want:
            raise ValueError(f"{op}: {name} has shape {tuple(a.shape)}, expected {want} "
                             f"([M, D] float32)")


def swiglu_down(x, w_gate, w_up, w_down, acc, clear, *, norm_weight=None, eps: float = 1e-6,
                deltas=None, prefetch: tuple = (), interpret: bool = False,
                block_sizes: MatmulBlockSizes | None = None, block_d: int = 256,
                down_prefetch: bool = True, stagger: bool = True, activation: str = "silu"):
    """The whole SwiGLU MLP in one kernel: acc + (silu(h @ w_gate) * (h @ w_up)) @ w_down.
    x [M, K]; w_gate, w_up [K, F]; w_down [F, D]; acc, clear [M, D] float32 (donated: their
    buffers are the outputs'). Each program owns F columns of the SwiGLU: it streams its gate
    and up slabs, rounds silu(gate) * up to x's dtype (as the two-kernel path does), then
    streams the same rows of w_down and adds act @ rows into acc with float32 atomics, so
    the down projection's reduction over F needs no kernel (and no boundary) of its own.
    The order of those additions varies from run to run: the result can differ in the last
    bits between two runs (not between interpret runs). `clear` comes back zeroed: a buffer
    the caller is done with, to be the next call's `acc` (jaxinfer's decoder ping-pongs two).
    norm_weight, eps, deltas: as in swiglu (deltas: returns (x + sum(deltas), acc, clear)).
    prefetch: (array, PrefetchPlan) pairs for the next kernel, issued after w_down's stream.
    block_d: w_down's columns per step; down_prefetch: each program asks the L2 for its
    first w_down tile while it streams gate and up; stagger: program j starts w_down's loop
    at column tile j (mod the tiles), so the programs' atomics spread over the columns. One K
    chunk (block_sizes.split_k = 1). activation: as in swiglu."""
    _validate(x, w_gate, w_up, norm_weight, deltas, activation)
    _validate_down(x, w_gate, w_down, acc, clear)
    check_prefetch("swiglu_down", prefetch)
    blocks = block_sizes or default_block_sizes(x.shape[0], w_gate.shape[1], x.shape[1],
                                                x.dtype.itemsize, n_weights=2)
    if blocks.split_k != 1:
        raise ValueError(f"swiglu_down: block_sizes.split_k={blocks.split_k}: the SwiGLU "
                         f"needs all of K in one program (split_k=1)")
    if block_d < 16 or block_d & (block_d - 1):
        raise ValueError(f"swiglu_down: block_d={block_d} must be a power of two >= 16")
    d = w_down.shape[1]
    if d % 16:
        raise ValueError(f"swiglu_down: w_down has D={d} columns; the kernel needs a multiple "
                         f"of 16 (use swiglu, then a matmul)")
    while d % block_d:  # a power of two that divides D: no column masks in the down loop
        block_d //= 2
    x_new, acc, clear = fused_matmul(
        x, norm_weight, (w_gate, w_up), None, eps=float(eps), blocks=blocks,
        epilogue="swiglu_down", activation=activation, interpret=interpret, deltas=deltas,
        prefetch=tuple(a for a, _ in prefetch), prefetch_plans=tuple(p for _, p in prefetch),
        down=(w_down, acc, clear), block_d=block_d, down_prefetch=down_prefetch,
        stagger=stagger)
    return (acc, clear) if x_new is None else (x_new, acc, clear)


def swiglu_down_reference(x, w_gate, w_up, w_down, acc, clear, *, norm_weight=None,
                          eps: float = 1e-6, deltas=None, interpret: bool = False,
                          activation: str = "silu"):
    """swiglu_down in plain jnp: the SwiGLU (rounded to x's dtype), its float32 product with
    w_down added to acc; clear zeroed."""
    del interpret
    _validate(x, w_gate, w_up, norm_weight, deltas, activation)
    _validate_down(x, w_gate, w_down, acc, clear)
    x_new = None
    if deltas is not None:
        x_new, act = swiglu_reference(x, w_gate, w_up, norm_weight=norm_weight, eps=eps,
                                      deltas=deltas, activation=activation)
    else:
        act = swiglu_reference(x, w_gate, w_up, norm_weight=norm_weight, eps=eps,
                               activation=activation)
    y = jnp.dot(act, w_down, preferred_element_type=jnp.float32,
                precision=ref_precision(x.dtype))
    out = (acc + y, jnp.zeros_like(clear))
    return out if x_new is None else (x_new, *out)
