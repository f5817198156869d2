"""Per-shard layouts of ops whose implementations live where another change owns them.

`experts_layout` (the EXPERTS registry's, ops/moe.py): expert parallelism over "ep" and the
experts' F over "tp". Each device holds E / ep experts (their F / tp columns) and runs the
op's chosen implementation on every token of its dp rows with the routing restricted to its
own experts: an assignment to an expert held elsewhere gets weight 0 (and a local expert id,
so every implementation takes it unchanged); the partial outputs are summed over ep and tp
(one all-reduce of [B, T, D] float32 per MoE layer). A first version of the dispatch: tokens
are not sent to their experts' devices (no all-to-all), each device looks at all of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.ops.dispatch import Layout, batch_axis


def experts_layout(sharding, x, weights, experts, w_gate, w_up, w_down, plan):
    """x [B, T, D], weights / experts [N, k] (N = B * T), w_gate / w_up [E, D, F], w_down
    [E, F, D] -> [B, T, D] float32."""
    b = batch_axis(sharding, x.shape[0])
    gate = sharding.spec(("experts", "embed", "mlp"), w_gate.shape)
    up = sharding.spec(("experts", "embed", "mlp"), w_up.shape)
    down = sharding.spec(("experts", "mlp", "embed"), w_down.shape)
    if gate != up or (gate[0], gate[2]) != (down[0], down[1]):
        return None
    ep, tp = gate[0], gate[2]
    rows = P(b, None, None)

    def local(args, kwargs):
        if ep is not None:
            args[1], args[2] = _local_routing(args[1], args[2], args[3].shape[0], ep)
        return args, kwargs
    return Layout({0: rows, 1: P(b, None), 2: P(b, None), 3: gate, 4: up, 5: down}, rows,
                  reduce=tuple(a for a in (ep, tp) if a is not None), local=local)


def _local_routing(weights, experts, held: int, axis: str):
    """weights, experts [N, k] with global expert ids -> this device's view: ids of the `held`
    experts it holds (shard i of `axis` holds i * held ...) made local, others weight 0."""
    ids = experts - jax.lax.axis_index(axis) * held
    mine = (ids >= 0) & (ids < held)
    return jnp.where(mine, weights, 0.0), jnp.where(mine, ids, 0)
