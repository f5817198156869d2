"""Sharding: one rules table from the logical axes every `ParamSpec` declares to mesh axes.

    make_mesh(tp=1, dp=1, ep=1, devices=None) -> jax.sharding.Mesh  axes ("dp", "ep", "tp")
    Sharding.create(mesh, config)     the plan's sharding part (static, hashable): the mesh and
                                      the rules resolved for one model's shapes
    check_mesh(config, mesh)          the bad-input errors, before any weight is read
    spec_for(param_spec, sharding)    a parameter's PartitionSpec
    param_shardings(specs, sharding, params=None)   NamedShardings of the typed params' arrays
    cache_shardings(cache, sharding)  NamedShardings of a KV / latent cache (a pytree alike)
    batch_sharding(shape, sharding)   inputs and per-row state [B, ...]: batch over dp

The rules (RULES): Megatron-style tensor parallelism over "tp" (attention by heads, the MLP
column then row parallel, vocabulary-parallel embedding and logits), the experts of MoE
layers over "ep", the batch (and with it the KV cache's rows) over "dp"; the hidden ("embed")
axis, the cache's sequence axis and MLA's latent are replicated.

Replication rule: a logical axis maps to its mesh axis only where that mesh axis divides
it. `Sharding.create` decides per model: the attention heads shard over tp only when tp
divides the KV heads (then the query heads too, and every device holds whole GQA groups:
their q, k and v together); otherwise the whole attention is replicated over tp (the tiny
test fixtures at tp=8, GQA models with fewer KV heads than tp devices). "mlp" and "vocab"
shard only when tp divides every dim declared with them. A mesh axis of size 1 maps to
nothing. ep must divide the experts and tp must divide the heads or be a multiple of them
(check_mesh).
"""

from __future__ import annotations

import dataclasses
import math
import types

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxinfer.configs import Config

MESH_AXES = ("dp", "ep", "tp")  # tp innermost: its devices adjacent (one NVLink island)

# logical axis -> mesh axis (None: replicated), before Sharding.create resolves them per model
RULES = types.MappingProxyType({
    "batch": "dp",
    "vocab": "tp",
    "embed": None,
    "q_heads": "tp",
    "kv_heads": "tp",
    "mlp": "tp",
    "experts": "ep",
    "cache_seq": None,
    "latent": None,
})


def _check_size(name: str, value) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}: must be an integer >= 1")
    return int(value)


def make_mesh(tp: int = 1, dp: int = 1, ep: int = 1, devices=None) -> Mesh:
    """A mesh of dp x ep x tp devices, axes ("dp", "ep", "tp"), every axis Auto (jit partitions
    what the ops do not place themselves; jax.make_mesh's default since 0.9 is Explicit).
    devices: the devices to use (default jax.devices(), the first dp * ep * tp of them)."""
    sizes = {"dp": _check_size("dp", dp), "ep": _check_size("ep", ep), "tp": _check_size("tp", tp)}
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(sizes.values())
    if need > len(devices):
        raise ValueError(f"a mesh of tp={tp} x dp={dp} x ep={ep} = {need} devices, but only "
                         f"{len(devices)} {devices[0].platform if devices else ''} devices are "
                         f"present; use fewer (on CPU, XLA_FLAGS="
                         f"--xla_force_host_platform_device_count=N before jax is imported)")
    return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                         axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices[:need])


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    return {a: int(mesh.shape.get(a, 1)) for a in MESH_AXES}


def check_mesh(config: Config, mesh: Mesh) -> None:
    """ValueError naming the numbers when the mesh cannot serve the model: a mesh without
    our axes, tp that neither divides the attention heads nor is a multiple of them, ep that
    does not divide the experts. (A model without experts takes any ep: its ep devices hold
    replicas, as the other layers of a MoE model do.)"""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh (jaxinfer.make_mesh), got "
                         f"{type(mesh).__name__}")
    unknown = [a for a in mesh.axis_names if a not in MESH_AXES]
    if unknown:
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)}: {unknown} are not ours; "
                         f"build it with jaxinfer.make_mesh(tp=, dp=, ep=) (axes {MESH_AXES})")
    sizes = mesh_sizes(mesh)
    tp, ep = sizes["tp"], sizes["ep"]
    heads, kv = config.num_heads, config.num_kv_heads
    if tp > 1 and heads % tp and tp % heads:
        raise ValueError(f"tp={tp} neither divides the model's {heads} attention heads nor is a "
                         f"multiple of them (to replicate them); use a tp that divides {heads}")
    if tp > 1 and kv % tp and tp % kv:
        raise ValueError(f"tp={tp} neither divides the model's {kv} KV heads nor is a multiple "
                         f"of them (to replicate them); use a tp that divides {kv}")
    if ep > 1 and config.moe is not None and config.moe.num_experts % ep:
        e = config.moe.num_experts
        raise ValueError(f"ep={ep} does not divide the model's {e} experts; use an ep that "
                         f"divides {e}")


def _dims(config: Config) -> dict[str, tuple[int, ...]]:
    """Every size the model declares along each sharded logical axis."""
    mlp = [config.intermediate_size]
    if config.moe is not None:
        mlp.append(config.moe.expert_intermediate_size)
        if config.moe.num_shared_experts:
            mlp.append(config.moe.shared_size)
    return {"q_heads": (config.num_heads,), "kv_heads": (config.num_kv_heads,),
            "mlp": tuple(mlp), "vocab": (config.vocab_size,),
            "experts": () if config.moe is None else (config.moe.num_experts,)}


@dataclasses.dataclass(frozen=True)
class Sharding:
    """The plan's sharding part: the mesh and the rules, resolved for one model (static and
    hashable: part of the compile key). rules: (logical axis, mesh axis or None) pairs."""

    mesh: Mesh
    rules: tuple = tuple(RULES.items())

    @classmethod
    def create(cls, mesh: Mesh, config: Config) -> Sharding:
        """The rules resolved for config's shapes (see the module docstring); check_mesh first."""
        check_mesh(config, mesh)
        sizes = mesh_sizes(mesh)
        dims = _dims(config)
        rules = {}
        for logical, axis in RULES.items():
            divides = axis is not None and not any(d % sizes[axis]
                                                   for d in dims.get(logical, ()))
            rules[logical] = axis if divides and sizes[axis] > 1 else None
        if rules["kv_heads"] is None:  # whole GQA groups per device, or none
            rules["q_heads"] = None
        return cls(mesh, tuple(rules.items()))

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise ValueError(f"Sharding.mesh must be a jax.sharding.Mesh, got "
                             f"{type(self.mesh).__name__}")

    def axis(self, logical: str | None) -> str | None:
        """The mesh axis a logical axis maps to (None: replicated)."""
        if logical is None:
            return None
        for name, axis in self.rules:
            if name == logical:
                return axis
        raise ValueError(f"no sharding rule for the logical axis {logical!r}; known: "
                         f"{', '.join(n for n, _ in self.rules)}")

    def size(self, axis: str | None) -> int:
        return 1 if axis is None else mesh_sizes(self.mesh)[axis]

    @property
    def tp(self) -> int:
        return self.size("tp")

    @property
    def dp(self) -> int:
        return self.size("dp")

    @property
    def ep(self) -> int:
        return self.size("ep")

    @property
    def devices(self) -> int:
        return self.mesh.devices.size

    def spec(self, logical_axes, shape=None) -> PartitionSpec:
        """A PartitionSpec for an array with these logical axes; with shape, a dim the mesh
        axis does not divide (or a mesh axis already used) stays replicated."""
        out, used = [], set()
        for i, logical in enumerate(logical_axes):
            axis = self.axis(logical)
            if axis is not None and (axis in used or (shape is not None
                                                      and shape[i] % self.size(axis))):
                axis = None
            used.add(axis)
            out.append(axis)
        return PartitionSpec(*out)

    def named(self, spec: PartitionSpec) -> NamedSharding:
        return NamedSharding(self.mesh, spec)


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------


def spec_for(param_spec, sharding: Sharding) -> PartitionSpec:
    """The PartitionSpec of a parameter as declared (a Dense's .w, a plain array; a
    DENSE_T table [V, D] as stored)."""
    return sharding.spec(param_spec.axes, param_spec.shape)


def weight_specs(weight, axes, sharding: Sharding):
    """PartitionSpecs of a typed matmul weight's arrays, in its pytree structure. axes: its
    logical axes as [K, *N] (the product's orientation, also for a transposed Dense [N, K]).

    A Dense's .w takes them as stored, each dim replicated where its mesh axis does not
    divide it. A QuantizedWeight's arrays are [rows, N flattened]: columns over the first
    output dim's mesh axis where it divides them (later output dims stay replicated), rows over
    K's only where every device's rows are one contiguous block of K (_rows_split): then the
    dequantization and the kernels' K loop stay local. Parts (layouts side by side) stay
    replicated (first version)."""
    from jaxinfer.weights import Dense, Parts, QuantizedWeight

    if isinstance(weight, Dense):
        stored = (axes[-1], axes[0]) if weight.transposed else tuple(axes)
        return Dense(sharding.spec(stored, weight.w.shape), weight.transposed)
    if isinstance(weight, Parts):
        return jax.tree.map(lambda a: PartitionSpec(), weight)
    if isinstance(weight, QuantizedWeight):
        k_axis, n_axis = sharding.axis(axes[0]), sharding.axis(axes[1])
        n_axis = None if n_axis == k_axis else n_axis
        if not _rows_split(weight, sharding.size(k_axis)):
            k_axis = None

        def one(a):
            cols = n_axis if a.shape[1] % sharding.size(n_axis) == 0 else None
            return PartitionSpec(k_axis if a.shape[0] > 1 else None, cols)
        return jax.tree.map(one, weight)
    return sharding.spec(axes, weight.shape)  # a plain array (stacked experts)


def experts_weight_specs(weight, axes, sharding: Sharding, split_rows: bool = True):
    """PartitionSpecs of a stacked experts' QuantizedWeight (every array [E, rows, N]), in its
    pytree structure. axes: the declared ("experts", K axis, N axis). The expert axis over
    its mesh axis where it divides E; the columns over the N axis's where it divides them;
    the rows over the K axis's only with split_rows and where every device's rows are one
    contiguous block of each expert's K (_rows_split), else replicated."""
    from pallas_kernels.quantized import expert_view, num_experts

    e_axis = sharding.spec(axes[:1], (num_experts(weight),))[0]
    k_axis, n_axis = sharding.axis(axes[1]), sharding.axis(axes[2])
    k_axis = None if k_axis in (e_axis, n_axis) or not split_rows \
        or not _rows_split(expert_view(weight), sharding.size(k_axis)) else k_axis
    n_axis = None if n_axis == e_axis else n_axis

    def one(a):
        cols = n_axis if a.shape[2] % sharding.size(n_axis) == 0 else None
        return PartitionSpec(e_axis, k_axis if a.shape[1] > 1 else None, cols)
    return jax.tree.map(one, weight)


def _rows_split(weight, n: int) -> bool:
    """Whether n devices can each hold one contiguous block of a QuantizedWeight's K: K, the
    scale groups (and super-groups) split evenly with no padding past K, and a plane of r > 1
    tiles per byte row (int4: tile t at byte rows (t // r) * tile) splits at whole byte-row
    blocks covering exactly K."""
    if n == 1:
        return True
    k = weight.k
    if k % n:
        return False
    for rows, group in ((weight.scale.shape[0], weight.group),
                        (0 if weight.super_scale is None else weight.super_scale.shape[0],
                         weight.super_group)):
        if rows > 1 and (rows % n or rows * group != k):  # one row: whole on every device
            return False
    for plane, bits in zip(weight.planes, weight.bits):
        r = 8 // bits
        rows = plane.shape[0]
        if rows * r != k or rows % n or (r > 1 and (rows // n) % weight.tile):
            return False
    return True


def local_weight(weight, specs, sharding: Sharding):
    """One device's shard of a QuantizedWeight (inside shard_map) with its static K and
    output dims cut as its arrays are (others come back as they are)."""
    from jaxinfer.weights import QuantizedWeight

    if not isinstance(weight, QuantizedWeight):
        return weight
    rows, cols = specs.planes[0]
    k = weight.k // sharding.size(rows)
    out = (weight.out_shape[0] // sharding.size(cols), *weight.out_shape[1:])
    return weight.replace(k=k, out_shape=out)


def _leaf_sharding(param_spec, leaf, sharding: Sharding):
    from jaxinfer.weights import Kind, QuantizedWeight

    axes = param_spec.axes
    if param_spec.kind is Kind.EXPERTS and isinstance(leaf, QuantizedWeight):
        return jax.tree.map(sharding.named, experts_weight_specs(leaf, axes, sharding),
                            is_leaf=lambda x: isinstance(x, PartitionSpec))
    if param_spec.kind is Kind.DENSE_T:  # declared as stored, [V, D]: the product's [K, N] is
        axes = (axes[1], axes[0])  # [D, V]
    elif param_spec.kind in (Kind.ARRAY, Kind.EXPERTS) or not hasattr(leaf, "in_features"):
        return sharding.named(sharding.spec(axes, param_spec.shape))
    return jax.tree.map(sharding.named, weight_specs(leaf, axes, sharding),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def param_shardings(specs, sharding: Sharding, params=None):
    """NamedShardings of the params' arrays, in the typed params' structure (a Dense's .w,
    a QuantizedWeight's codes and scales): for jax.device_put(params, ...) and jit's
    in_shardings. params: the typed params (their actual weight types); None: the declared
    types (Dense for matmul weights, arrays otherwise)."""
    from jaxinfer.weights import ParamSpec

    def is_spec(x):
        return isinstance(x, ParamSpec)

    if params is None:
        return jax.tree.map(lambda s: _leaf_sharding(s, s.abstract("float32"), sharding), specs,
                            is_leaf=is_spec)
    return jax.tree.map(lambda s, p: _leaf_sharding(s, p, sharding), specs, params,
                        is_leaf=is_spec)


def shard_params(params, specs, sharding: Sharding):
    """The typed params placed on the mesh (jax.device_put with param_shardings)."""
    return jax.device_put(params, param_shardings(specs, sharding, params))


def per_device_bytes(params) -> dict:
    """Bytes of the params' shards on each device: {device: bytes}."""
    out = {}
    for a in jax.tree.leaves(params):
        for shard in a.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


# ---------------------------------------------------------------------------------------------
# Caches and per-row state
# ---------------------------------------------------------------------------------------------


def batch_spec(shape, sharding: Sharding) -> PartitionSpec:
    """[B, ...]: B over dp where dp divides it, the rest replicated."""
    return sharding.spec(("batch",) + (None,) * (len(shape) - 1), shape)


def batch_sharding(shape, sharding: Sharding) -> NamedSharding:
    return sharding.named(batch_spec(shape, sharding))


def kv_spec(shape, sharding: Sharding) -> PartitionSpec:
    """A KV layer's [B, S, Hkv, D] values (or [B, S, Hkv] scales): batch over dp, heads over tp."""
    return sharding.spec(("batch", "cache_seq", "kv_heads", None)[:len(shape)], shape)


def latent_spec(shape, sharding: Sharding) -> PartitionSpec:
    """An MLA layer's latent [B, S, R + Dr]: batch over dp, the latent replicated."""
    return sharding.spec(("batch", "cache_seq", "latent"), shape)


def cache_shardings(cache, sharding: Sharding):
    """NamedShardings of a KVCache / LatentCache (or one of its layers), the same pytree."""
    from jaxinfer.cache import (KVCache, KVLayer, LatentCache, LatentLayer, QuantizedKVLayer,
                                QuantizedLatentLayer)

    def kv(a):
        return sharding.named(kv_spec(a.shape, sharding))

    def latent(a):
        return sharding.named(latent_spec(a.shape, sharding))

    if isinstance(cache, KVCache):
        return cache.replace(k=tuple(map(kv, cache.k)), v=tuple(map(kv, cache.v)),
                             k_scale=tuple(map(kv, cache.k_scale)),
                             v_scale=tuple(map(kv, cache.v_scale)),
                             lengths=batch_sharding(cache.lengths.shape, sharding))
    if isinstance(cache, LatentCache):
        return cache.replace(latent=tuple(map(latent, cache.latent)),
                             scale=tuple(map(latent, cache.scale)),
                             lengths=batch_sharding(cache.lengths.shape, sharding))
    if isinstance(cache, KVLayer | QuantizedKVLayer):
        return jax.tree.map(kv, cache)
    if isinstance(cache, LatentLayer | QuantizedLatentLayer):
        return jax.tree.map(latent, cache)
    raise ValueError(f"cache_shardings: not a cache: {type(cache).__name__}")


def constrain_cache(cache, sharding: Sharding | None):
    """The cache pinned to its shardings inside a jitted function (so a donated cache comes
    back laid out as it went in); unchanged without a sharding."""
    if sharding is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, sharding))


def replicated(tree, sharding: Sharding):
    """Every array of tree placed whole on every device of the mesh."""
    return jax.device_put(tree, sharding.named(PartitionSpec()))
