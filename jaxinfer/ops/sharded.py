"""Per-shard layouts of ops whose implementations live where another change owns them.

`experts_layout` (the EXPERTS registry's, ops/moe.py): expert parallelism over "ep" and the
experts' F over "tp". Each device holds E / ep experts (their F / tp columns) and runs the
op's chosen implementation on every token of its dp rows with the routing restricted to its
own experts: an assignment to an expert held elsewhere gets weight 0 (and a local expert id,
so every implementation takes it unchanged); the partial outputs are summed over ep and tp
(one all-reduce of [B, T, D] float32 per MoE layer). A first version of the dispatch: tokens
are not sent to their experts' devices (no all-to-all), each device looks at all of them.
Quantized experts (stacked QuantizedWeights) split the same way: every array's expert axis
over "ep", gate's and up's columns and down's rows (F) over "tp" (down's only where each
device's rows are whole scale groups of every expert: else F stays whole, see
sharding.experts_weight_specs); each shard's static K / N are its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.ops.dispatch import Layout, batch_axis
from pallas_kernels.quantized import QuantizedWeight

GATE_AXES = ("experts", "embed", "mlp")
DOWN_AXES = ("experts", "mlp", "embed")


def _axes(spec, quantized: bool, down: bool) -> tuple:
    """(expert axis, F's axis) of a weight's spec: a PartitionSpec, or a QuantizedWeight of
    them (F: gate / up's columns, down's rows; the scales' one-row arrays aside)."""
    if not quantized:
        return spec[0], spec[1 if down else 2]
    first = spec.planes[0]
    return first[0], first[1 if down else 2]


def _weight_spec(sharding, w, axes, split_rows: bool = True):
    from jaxinfer.sharding import experts_weight_specs

    if isinstance(w, QuantizedWeight):
        return experts_weight_specs(w, axes, sharding, split_rows)
    return sharding.spec(axes, w.shape)


def _local_weight(w, tp_size: int, down: bool):
    """A QuantizedWeight's shard with its static K (down) or N (gate / up) cut to its F / tp
    (its arrays are cut by shard_map); others as they are."""
    if not isinstance(w, QuantizedWeight) or tp_size == 1:
        return w
    if down:
        return w.replace(k=w.k // tp_size)
    return w.replace(out_shape=(w.out_shape[0] // tp_size, *w.out_shape[1:]))


def experts_layout(sharding, x, weights, experts, w_gate, w_up, w_down, plan):
    """x [B, T, D], weights / experts [N, k] (N = B * T), w_gate / w_up [E, D, F], w_down
    [E, F, D] (arrays, or stacked QuantizedWeights) -> [B, T, D] float32."""
    b = batch_axis(sharding, x.shape[0])
    ws = (w_gate, w_up, w_down)
    quantized = [isinstance(w, QuantizedWeight) for w in ws]
    axes = (GATE_AXES, GATE_AXES, DOWN_AXES)
    specs = [_weight_spec(sharding, w, a) for w, a in zip(ws, axes)]
    found = {_axes(s, q, i == 2) for i, (s, q) in enumerate(zip(specs, quantized))}
    if len(found) > 1 and any(quantized):  # F split one way and not the other: keep F whole
        specs = [_weight_spec(sharding, w, (a[0], None, None), False) for w, a in zip(ws, axes)]
        found = {_axes(s, q, i == 2) for i, (s, q) in enumerate(zip(specs, quantized))}
    if len(found) > 1 or (not any(quantized) and specs[0] != specs[1]):
        return None
    ((ep, tp),) = found
    rows = P(b, None, None)
    tp_size = sharding.size(tp)

    def local(args, kwargs):
        if ep is not None:
            args[1], args[2] = _local_routing(args[1], args[2], _experts_held(args[3]), ep)
        for i in (3, 4, 5):
            args[i] = _local_weight(args[i], tp_size, i == 5)
        return args, kwargs
    return Layout({0: rows, 1: P(b, None), 2: P(b, None), 3: specs[0], 4: specs[1],
                   5: specs[2]}, rows,
                  reduce=tuple(a for a in (ep, tp) if a is not None), local=local)


def _experts_held(w) -> int:
    """The experts a shard's stacked weight holds (its arrays' leading axis)."""
    return (w.planes[0] if isinstance(w, QuantizedWeight) else w).shape[0]


def _local_routing(weights, experts, held: int, axis: str):
    """weights, experts [N, k] with global expert ids -> this device's view: ids of the `held`
    experts it holds (shard i of `axis` holds i * held ...) made local, others weight 0."""
    ids = experts - jax.lax.axis_index(axis) * held
    mine = (ids >= 0) & (ids < held)
    return jnp.where(mine, weights, 0.0), jnp.where(mine, ids, 0)
