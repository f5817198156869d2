"""`gated_mlp`: the gated MLP sublayer, act(h @ w_gate) * (h @ w_up) @ w_down, h = norm(x); act
is the config's `mlp_activation` (silu: SwiGLU; gelu_tanh: Gemma's GeGLU), passed to the kernels.

On the fused decode path the attention -> MLP boundary runs in the SwiGLU kernel's main loop,
and at batch 1 the whole MLP is one kernel (swiglu_down: the down projection's rows summed by
float32 atomics into an accumulator; the buffers ping-pong through the residual stream's
spare/dead slots, so no memset runs per layer). The plan says which (benchmarks/DECISIONS.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from jaxinfer.ops import blocked, reference
from jaxinfer.ops.dispatch import (Layout, Registry, always, batch_axis, decode_path,
                                   kernels_on, rows)
from jaxinfer.ops.linear import (MATMUL, add_deltas, boundary, linear, norm, prefetch_pairs,
                                 tiles)
from jaxinfer.ops.stream import ANY_SUM, Deferred, Partials, Residual, resolve
from jaxinfer.plan import Boundary, Plan
from jaxinfer.sharding import local_weight, weight_specs
from jaxinfer.weights import Dense, QuantizedWeight, as_array, kernel_operand


def _swiglu_layout(sharding, x, w_gate, w_up, plan, *, norm_w=None, deltas=None, **_):
    """Column parallel: x [B, T, D] whole over tp, w_gate / w_up [D, F] split along F, the
    activation [B, T, F] split alike (no collective); the batch over dp."""
    if deltas is not None:
        return None
    b = batch_axis(sharding, x.shape[0])
    gate, up = (weight_specs(w, ("embed", "mlp"), sharding) for w in (w_gate, w_up))
    cols = {_columns(gate), _columns(up)}
    if len(cols) != 1:
        return None
    x_spec = P(b, None, None)  # [B, T, D]
    inputs = {0: x_spec, 1: gate, 2: up}
    if norm_w is not None:
        inputs["norm_w"] = P()

    def local(args, kwargs):
        args[1], args[2] = (local_weight(w, s, sharding)
                            for w, s in ((args[1], gate), (args[2], up)))
        return args, kwargs
    return Layout(inputs, (x_spec, P(b, None, cols.pop())), local=local)


def _columns(specs):
    """The mesh axis of a [D, F] weight's output columns, from its specs (weight_specs)."""
    return specs.w[1] if isinstance(specs, Dense) else specs.scale[1]


# (x [B, T, D], w_gate, w_up) -> (x + sum(deltas), silu(h @ w_gate + b) * (h @ w_up + b))
SWIGLU = Registry("swiglu", layout=_swiglu_layout)


def _pallas_supports(x, w_gate, w_up, plan, *, biases=(None, None), deltas=None, **_):
    quantized = all(isinstance(w, QuantizedWeight) for w in (w_gate, w_up))
    if quantized:
        if "nk" in (w_gate.layout, w_up.layout):
            return "codes laid out for the Mosaic GPU kernel (nk)"
        if w_gate.tile != w_up.tile:
            return "quantized gate and up with different K tiles"
    elif not all(isinstance(w, Dense) and not w.transposed for w in (w_gate, w_up)):
        return "not [D, F] Dense weights (or two QuantizedWeights)"
    if not kernels_on(plan, x.dtype) or (
            not quantized and jnp.dtype(w_gate.dtype) != jnp.dtype(x.dtype)):
        return "kernels off for these dtypes"
    if any(b is not None for b in biases):
        return "biases"
    if deltas is not None and not isinstance(deltas, Partials):
        return "deltas are not float32 chunks"
    return None


@SWIGLU.register("pallas", _pallas_supports, kernel=True)
def _pallas_swiglu(x, w_gate, w_up, plan, *, biases=(None, None), norm_w=None, eps=0.0,
                   deltas=None, prefetch=()):
    m, k = rows(x), x.shape[-1]
    f = w_gate.out_shape[0]
    out = pk.swiglu(x.reshape(m, k), kernel_operand(w_gate), kernel_operand(w_up),
                    norm_weight=norm_w, eps=eps, activation=plan.config.mlp_activation,
                    deltas=None if deltas is None else deltas.parts.reshape(-1, m, k),
                    prefetch=prefetch, interpret=plan.policy.interpret,
                    block_sizes=tiles(plan, m, k, f, 2, x.dtype))
    x_new, act = out if deltas is not None else (x.reshape(m, k), out)
    return x_new.reshape(x.shape), act.reshape(*x.shape[:-1], f)


def _mosaic_int_supports(x, w_gate, w_up, plan, *, deltas=None, **_):
    return MATMUL.get("mosaic_int").supports(x, w_gate, plan) or \
        MATMUL.get("mosaic_int").supports(x, w_up, plan)


def _one_launch(w_gate, w_up) -> bool:
    """Whether nk gate and up take one launch of the Mosaic kernel (one format, one dtype)."""
    return w_gate.planes[0].dtype == w_up.planes[0].dtype and \
        pk.nk_format(w_gate) == pk.nk_format(w_up)


@SWIGLU.register("mosaic_int", _mosaic_int_supports, kernel=True)
def _mosaic_int_swiglu(x, w_gate, w_up, plan, *, biases=(None, None), norm_w=None, eps=0.0,
                        deltas=None, prefetch=()):
    """Gate and up in the nk layout: both through one launch of the Mosaic GPU kernel (each
    through its own where their formats or code dtypes differ), then act * up. The boundary
    before them stays apart: in that launch's main loop each of its programs (1792 at
    Llama-3-8B's) redoes it, 7% slower a step (benchmarks/DECISIONS.md, sessions 20 and 22)."""
    x = add_deltas(x, deltas)
    h = x if norm_w is None else norm(x, norm_w, eps, plan)
    if _one_launch(w_gate, w_up):
        m, k = rows(h), h.shape[-1]
        ys = pk.quantized_matmul_mgpu(h.reshape(m, k), (w_gate, w_up),
                                      interpret=plan.policy.interpret, out_dtype=jnp.float32)
        gate, up = (y.reshape(*h.shape[:-1], *w.out_shape) for y, w in
                    zip(ys, (w_gate, w_up)))
    else:
        product = MATMUL.get("mosaic_int").run
        gate = product(h, w_gate, plan, out_dtype=jnp.float32)[1]
        up = product(h, w_up, plan, out_dtype=jnp.float32)[1]
    return x, _gate(gate, up, biases, plan).astype(x.dtype)


def _gate(gate, up, biases, plan):
    """act(gate + b_gate) * (up + b_up), float32."""
    if biases[0] is not None:
        gate = gate + biases[0].astype(jnp.float32)
    if biases[1] is not None:
        up = up + biases[1].astype(jnp.float32)
    return reference.gate_activation(gate, plan.config.mlp_activation) * up


@SWIGLU.register("reference", always)
def _reference_swiglu(x, w_gate, w_up, plan, *, biases=(None, None), norm_w=None, eps=0.0,
                      deltas=None, prefetch=()):
    x = add_deltas(x, deltas)
    h = x if norm_w is None else reference.rms_norm(x, norm_w, eps)
    if isinstance(w_gate, QuantizedWeight) or isinstance(w_up, QuantizedWeight):
        # a tile at a time where the plan says (the CPU): reference.swiglu's math
        gate = blocked.linear(h, w_gate, plan, biases[0])
        up = blocked.linear(h, w_up, plan, biases[1])
        return x, reference.gate_activation(gate, plan.config.mlp_activation) * up
    return x, reference.swiglu(h, as_array(w_gate, h.dtype), as_array(w_up, h.dtype), *biases,
                               activation=plan.config.mlp_activation)


def _one_kernel(x, w_gate, w_up, w_down, plan, biases) -> bool:
    """Whether the decode MLP of x runs as one kernel (swiglu_down) under the plan."""
    policy = plan.policy
    return (SWIGLU.pick(x, w_gate, w_up, plan, biases=biases[:2]).name == "pallas"
            and decode_path(x, plan) and rows(x) <= policy.one_kernel_mlp_rows
            and biases[2] is None
            and all(isinstance(w, Dense) for w in (w_gate, w_up, w_down))
            and not w_down.transposed
            and x.shape[-1] % 16 == 0 and policy.gated_mlp_boundary is Boundary.CONSUMER)


def _buffer(value, m: int, d: int):
    """A [M, D] float32 buffer from the stream's spare/dead slot, or a fresh zeroed one."""
    value = resolve(value)
    if value is not None and value.shape == (m, d) and value.dtype == jnp.float32:
        return value
    return jnp.zeros((m, d), jnp.float32)


def gated_mlp(stream: Residual, norm_weight, w_gate, w_up, w_down, plan: Plan, *,
              biases=None, post_norm=None) -> Residual:
    """The MLP sublayer: x + pending -> that stream, with the MLP's output on its RMSNorm
    pending. w_gate, w_up [D, F], w_down [F, D]; biases: (b_gate, b_up, b_down) or None;
    post_norm [D]: a sandwich RMSNorm of the MLP's output before it is added (Gemma)."""
    policy, eps = plan.policy, plan.config.rms_norm_eps
    biases = tuple(biases) if biases is not None else (None, None, None)
    aval = stream.aval
    m, d = rows(aval), aval.shape[-1]
    picked = SWIGLU.pick(aval, w_gate, w_up, plan, biases=biases[:2]).name
    kernel = picked == "pallas"
    hints = prefetch_pairs(policy.prefetch_gated_mlp, (w_gate, w_up), m, plan) \
        if kernel and decode_path(aval, plan) else ()
    x, delta = stream.take(ANY_SUM, hints)
    in_kernel = (kernel and policy.gated_mlp_boundary is Boundary.CONSUMER
                 and not plan.config.norm_offset and isinstance(delta, Partials))
    if in_kernel and post_norm is None and _one_kernel(aval, w_gate, w_up, w_down, plan,
                                                       biases):
        def emit(accept, prefetch):
            x_new, acc, clear = pk.swiglu_down(
                x.reshape(m, d), w_gate.w, w_up.w, w_down.w, _buffer(stream.spare, m, d),
                _buffer(stream.dead, m, d), norm_weight=norm_weight, eps=eps,
                activation=plan.config.mlp_activation,
                deltas=delta.parts.reshape(-1, m, d), prefetch=prefetch,
                interpret=policy.interpret)
            return x_new.reshape(aval.shape), Partials(acc.reshape(1, *aval.shape)), clear
        call = Deferred(emit)
        return Residual(call.part(0), aval, pending=call.part(1), spare=call.part(2))
    act_aval = jax.ShapeDtypeStruct((*aval.shape[:-1], w_gate.out_shape[0]), aval.dtype)
    down_fused = MATMUL.pick(act_aval, w_down, plan).name == "fused_small_m"
    down_hints = prefetch_pairs(policy.prefetch_down, (w_down,), m, plan) \
        if kernel and down_fused else ()
    if in_kernel:
        x, act = SWIGLU(x, w_gate, w_up, plan, norm_w=norm_weight, eps=eps, deltas=delta,
                        prefetch=down_hints)
    else:
        x, h = boundary(x, delta, norm_weight, eps, plan, policy.gated_mlp_boundary)
        _, act = SWIGLU(h, w_gate, w_up, plan, biases=biases[:2], prefetch=down_hints)
    return linear(act, w_down, plan, bias=biases[2], post_norm=post_norm,
                  into=Residual(x, aval, spare=stream.spare, dead=stream.dead))
