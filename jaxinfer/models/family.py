"""What a model family is, as data: its parameters, its forward, and its checkpoint names."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """One checkpoint layout of a MoE layer's router and experts (names under the layer's
    prefix; every matrix [out, in] as torch stores it): router [E, D] (-> our "router"
    [D, E]), router_bias [E] if the family has one; per_expert: our stacked name -> a name
    with {j} for expert j, stacked to [E, in, out] as read; fused: our stacked name -> one
    [E, out, in] tensor, "experts_gate_up" being gate and up concatenated along out (the
    layout transformers 5 holds in memory)."""
    router: str
    per_expert: dict = dataclasses.field(default_factory=dict)
    fused: dict = dataclasses.field(default_factory=dict)
    router_bias: str | None = None


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """Checkpoint tensor names of a family's parameters in one format: our per-layer param
    name -> (the tensor's name under the layer's prefix, whether to transpose it to our
    [in, out] layout), and the same for the top-level params; experts: the layouts a MoE
    layer's router and experts may come in, tried in order (the first whose tensors are
    there is read)."""
    layer: dict
    top: dict
    experts: tuple = ()


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    param_specs: Callable  # (Config) -> params pytree of ParamSpec
    # (params, tokens [B, T], positions [B, T], plan, cache=None, logits_at=None, fresh=False,
    #  embeds=None, hidden=False) -> (logits float32 [B, T or 1, V], cache), and with
    #  hidden=True also the final-normed stream [B, T, D] (llama.forward's docstring)
    forward: Callable
    hf_architectures: tuple[str, ...]  # config.json `architectures` names
    hf_tensors: TensorMap  # names under "model.layers.{i}." and at the top
    gguf_architectures: tuple[str, ...]  # GGUF `general.architecture` values
    gguf_tensors: TensorMap  # names under "blk.{i}." and at the top
    # (one layer's checkpoint tensors by our names, config, where) -> the layer's params
    # (e.g. q, k, v fused into one weight); raises ValueError naming `where` on bad shapes
    assemble_layer: Callable
    # (config) -> {"layer": {name: shape}, "top": {...}}: the checkpoint tensors' shapes in
    # our [in, out] layout, before assemble_layer (for loaders that check before reading)
    checkpoint_shapes: Callable
