"""Typed weights and their declaration: every parameter declared once by a `ParamSpec`.

A spec gives a parameter's shape, logical axes (mapped to mesh axes by the sharding rules),
initializer and kind: a plain array (norm weights, biases) or a matmul weight, held as a
`Dense` pytree. The ops dispatch on the weight's type, so the quantized and expert weights of
the next issues plug in as new types beside `Dense` without touching the model families.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types

import jax
import jax.numpy as jnp

from jaxinfer import pytree
from pallas_kernels.quantized import (
    QuantizedWeight,
    check_quantized_experts,
    dequantize,
    num_experts,
    quantize_weight,
    weight_format,
)

__all__ = ["Dense", "Kind", "ParamSpec", "Parts", "QuantizedWeight", "as_array", "dequantize",
           "kernel_operand", "weight_format"]


@pytree.dataclass
class Dense:
    """A matmul weight kept as stored: w [K, *N] ([in, out]), or with `transposed` w [N, K]
    (rows are the output features: an embedding table, which a tied LM head reuses)."""

    w: jax.Array
    transposed: bool = pytree.static_field(False)

    @property
    def dtype(self):
        return self.w.dtype

    @property
    def in_features(self) -> int:
        return self.w.shape[-1] if self.transposed else self.w.shape[0]

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The output feature dims [*N] of x @ w."""
        return tuple(self.w.shape[:1]) if self.transposed else tuple(self.w.shape[1:])


@pytree.dataclass
class Parts:
    """One matmul weight held as parts of different types along its output columns (a GGUF
    Q4_K_M layer's q and k in Q4_K beside v in Q6_K: one fused kernel reads one layout, so
    each part runs its own). Part i's columns are [groups, widths[i], inner]; the product is
    the parts' products concatenated along the widths axis: [..., groups, sum(widths), inner],
    seen as out_shape (for q/k/v: groups = KV heads, widths = (G, 1, 1), inner = head_dim)."""

    parts: tuple  # QuantizedWeight / Dense [K, groups * widths[i] * inner] each
    groups: int = pytree.static_field(1)
    widths: tuple = pytree.static_field(())
    inner: int = pytree.static_field(1)
    out_shape: tuple = pytree.static_field(())

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.in_features, *self.out_shape)

    @property
    def transposed(self) -> bool:
        return False

    def combine(self, ys):
        """The parts' outputs [..., N_i] -> [..., *out_shape] (numpy stays numpy)."""
        import numpy as np

        xp = np if all(isinstance(y, np.ndarray) for y in ys) else jnp
        lead = ys[0].shape[:-1]
        cat = xp.concatenate([y.reshape(*lead, self.groups, w, self.inner)
                              for y, w in zip(ys, self.widths)], axis=-2)
        return cat.reshape(*lead, *self.out_shape)


def kernel_operand(w):
    """What a kernel takes for a matmul weight: a Dense's array, a QuantizedWeight itself."""
    return w.w if isinstance(w, Dense) else w


def as_array(w, dtype):
    """A matmul weight as a plain array [K, *N] (a Dense [N, K] as stored) in dtype: the
    references' view (a QuantizedWeight dequantized; the kernels never do this)."""
    if isinstance(w, Dense):
        return w.w
    if isinstance(w, Parts):  # [K, *out_shape]: the parts' columns interleaved
        return w.combine([as_array(p, dtype).reshape(p.in_features, -1) for p in w.parts])
    return dequantize(w, dtype)


def is_transposed(w) -> bool:
    return isinstance(w, Dense) and w.transposed


class Kind(enum.Enum):
    ARRAY = "array"  # a plain array: norm weights, biases
    DENSE = "dense"  # a matmul weight [in, *out], held as Dense
    DENSE_T = "dense_t"  # a matmul weight [out, in] (an embedding table), held as Dense
    # stacked per-expert matmul weights [E, in, out] (MoE), held as a plain array or a
    # QuantizedWeight whose every array is [E, ...] (stack_experts): the experts op indexes
    # the expert axis itself (a grouped matmul, or the chosen experts' slices)
    EXPERTS = "experts"


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names
    init: str = "normal"  # "normal" (fan-in scaled), "ones", "zeros"
    kind: Kind = Kind.ARRAY
    # A dtype the parameter keeps whatever the model's (a MoE router in float32, so the
    # choice of experts does not move with the activations' precision); None: the model's.
    dtype: str | None = None

    @property
    def init_std(self) -> float:
        """The normal init's scale: 1/sqrt(fan-in) (the first axis, or the second of stacked
        experts [E, in, out]) for matrices, 0.02 for vectors."""
        fan_in = self.shape[1] if self.kind is Kind.EXPERTS else self.shape[0]
        return 1.0 / math.sqrt(fan_in) if len(self.shape) >= 2 else 0.02

    def initialize(self, key: jax.Array, dtype):
        dtype = self.dtype or dtype
        if self.init == "ones":
            value = jnp.ones(self.shape, dtype)
        elif self.init == "zeros":
            value = jnp.zeros(self.shape, dtype)
        else:
            value = (self.init_std * jax.random.normal(key, self.shape, jnp.float32)).astype(dtype)
        return self.wrap(value)

    def wrap(self, value):
        """A loaded array as this parameter's type (a Dense is returned as is; a
        QuantizedWeight [K, N] takes the declared output dims)."""
        if self.kind is Kind.EXPERTS and isinstance(value, Parts | Dense):
            raise ValueError(f"expert weights {list(self.shape)} arrived as a "
                             f"{type(value).__name__}: stacked experts are an array [E, in, "
                             f"out] or a QuantizedWeight stacked per expert (stack_experts)")
        if self.kind in (Kind.ARRAY, Kind.EXPERTS) or isinstance(value, Dense):
            return value
        if isinstance(value, QuantizedWeight | Parts):
            out = self.shape[1:] if self.kind is Kind.DENSE else self.shape[:1]
            if isinstance(value, Parts):
                return value.replace(out_shape=out)
            return value if value.out_shape == out else value.with_out_shape(out)
        return Dense(value, transposed=self.kind is Kind.DENSE_T)

    def abstract(self, dtype):
        """The parameter as a shape/dtype struct of its type (for lowering without weights)."""
        return self.wrap(jax.ShapeDtypeStruct(self.shape, self.dtype or dtype))


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def _is_weight(x) -> bool:
    return isinstance(x, Dense | QuantizedWeight | Parts)


def quantized_shape(spec: ParamSpec) -> tuple[int, ...]:
    """The [K, *N] a QuantizedWeight of this matmul spec has (a [V, D] table: [D, V], the
    LM head's orientation, whose columns the embedding gathers); stacked experts: [E, K, N]
    (what dequantize gives)."""
    if spec.kind in (Kind.DENSE, Kind.EXPERTS):
        return spec.shape
    return (spec.shape[1], spec.shape[0])


def init_params(specs, key: jax.Array, dtype, each=None):
    """Random params with the declared shapes and types (benchmarks, tests). each(spec,
    value) -> value, when given, is applied to each param as soon as it is drawn (a
    quantization, so the float model is never whole on the device)."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    keys = jax.random.split(key, len(leaves))
    out = []
    for spec, k in zip(leaves, keys):
        value = spec.initialize(k, dtype)
        out.append(value if each is None else each(spec, value))
    return jax.tree.unflatten(treedef, out)


def abstract_params(specs, dtype):
    return jax.tree.map(lambda s: s.abstract(dtype), specs, is_leaf=_is_spec)


def check_params(params, specs) -> None:
    """Raise ValueError naming every param whose presence, type or shape differs from the
    declaration (plain arrays where a spec wants a Dense are accepted: `typed` wraps them)."""
    want = {jax.tree_util.keystr(p): s for p, s in
            jax.tree_util.tree_leaves_with_path(specs, is_leaf=_is_spec)}
    have = {jax.tree_util.keystr(p): a for p, a in
            jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_weight)}
    problems = [f"missing {k} (expected shape {s.shape})" for k, s in want.items() if k not in have]
    problems += [f"unexpected {k}" for k in have if k not in want]
    for k, s in want.items():
        if k not in have:
            continue
        a = have[k]
        if isinstance(a, Parts):
            want_n = math.prod(s.shape[1:])
            n = a.groups * sum(a.widths) * a.inner
            if s.kind is not Kind.DENSE or a.in_features != s.shape[0] or n != want_n:
                problems.append(f"{k} is parts of [{a.in_features}, {n}], expected "
                                f"{list(s.shape)} ([in, out])")
            continue
        if isinstance(a, QuantizedWeight):
            if s.kind is Kind.EXPERTS:
                e, kk, n = s.shape
                if (num_experts(a), a.k, a.n) != (e, kk, n):
                    problems.append(f"{k} is quantized ({a.name}) experts [{num_experts(a)}, "
                                    f"{a.k}, {a.n}], expected {list(s.shape)} ([E, in, out])")
                    continue
                try:
                    check_quantized_experts(k, a, e, kk)
                except ValueError as err:
                    problems.append(str(err))
            elif s.kind is Kind.ARRAY:
                problems.append(f"{k} is quantized ({a.name}), expected a plain array")
            elif (a.k, a.n) != (quantized_shape(s)[0], math.prod(quantized_shape(s)[1:])):
                problems.append(f"{k} is a quantized {list(a.shape)} ({a.name}), expected "
                                f"{list(quantized_shape(s))} ([in, out])")
            continue
        if isinstance(a, Dense):
            if s.kind is Kind.ARRAY or a.transposed != (s.kind is Kind.DENSE_T):
                problems.append(f"{k} is a Dense(transposed={a.transposed}), expected {s.kind}")
            a = a.w
        if tuple(getattr(a, "shape", ())) != s.shape:
            problems.append(f"{k} has shape {tuple(getattr(a, 'shape', ()))}, expected {s.shape}")
    if problems:
        raise ValueError("params do not match the model config: " + "; ".join(problems[:10])
                         + (f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""))


def typed(params, specs):
    """params with every matmul weight as its declared type (call check_params first)."""
    return jax.tree.map(lambda s, p: s.wrap(p), specs, params, is_leaf=_is_spec)


def cast_floating(params, dtype, specs=None):
    """Floating leaves cast to dtype, on the device; a QuantizedWeight's arrays (codes and
    scales) and integer leaves are moved as they are. specs, when given (the params' own
    declaration): a parameter declared with a dtype keeps that one."""
    if specs is not None:
        return jax.tree.map(lambda s, p: cast_floating(p, s.dtype or dtype), specs, params,
                            is_leaf=_is_spec)

    def cast(a):
        if isinstance(a, QuantizedWeight):
            return jax.tree.map(jnp.asarray, a)
        if isinstance(a, Dense):
            return Dense(cast(a.w), a.transposed)
        floating = jnp.issubdtype(jnp.asarray(a).dtype if not hasattr(a, "dtype") else a.dtype,
                                  jnp.floating)
        return jnp.asarray(a, dtype=dtype) if floating else jnp.asarray(a)
    return jax.tree.map(cast, params, is_leaf=lambda a: isinstance(a, QuantizedWeight | Dense))


def array_bytes(shape, dtype) -> int:
    """Bytes an array of this shape and dtype takes on the device (int4: half a byte)."""
    n = math.prod(shape)
    return n // 2 if jnp.dtype(dtype) == jnp.int4 else n * jnp.dtype(dtype).itemsize


def param_bytes(params) -> int:
    """Bytes the params hold (codes and scales for quantized weights)."""
    return sum(array_bytes(a.shape, a.dtype) for a in jax.tree.leaves(params))


# ---------------------------------------------------------------------------------------------
# Quantize on load
# ---------------------------------------------------------------------------------------------

QUANTIZATIONS = ("none", "int8", "int4", "fp8")  # and None: as the checkpoint stores it
DEFAULT_GROUP = 128


# A device weight is quantized in one program a shape (eagerly each of its ~20 ops compiled a
# program of its own, ~90 for a model's few shapes, and held float32 temporaries of the whole
# weight); the same ops, the same codes and scales. Host (numpy) weights stay in numpy.
_quantize_on_device = jax.jit(quantize_weight,
                              static_argnames=("bits", "group_size", "symmetric", "float8"))


def _quantize_one(w, how: str, group_size: int | None, where: str) -> QuantizedWeight:
    """One Dense matmul weight -> a QuantizedWeight [K, *N] (a [V, D] table: [D, V])."""
    a = w.w.T if w.transposed else w.w  # [K, *N]
    k = a.shape[0]
    if how == "fp8" or group_size is not None:
        group = group_size  # fp8 default None: one scale per column
        if group is not None and k % group:
            raise ValueError(f"{where}: group size {group_size} does not divide its K={k} "
                             f"(weight {list(a.shape)}); give a group size that divides K")
    else:  # the default: the largest of 128, 64, 32 that divides K, else one per column
        group = next((g for g in (DEFAULT_GROUP, 64, 32) if k % g == 0), None)
    try:
        quantize = _quantize_on_device if isinstance(a, jax.Array) else quantize_weight
        return quantize(a, bits=4 if how == "int4" else 8, group_size=group, float8=how == "fp8")
    except ValueError as e:
        raise ValueError(f"{where} {list(a.shape)}: {e}") from None


def _quantize_experts(w, how: str, group_size: int | None, where: str) -> QuantizedWeight:
    """Stacked experts w [E, K, N] (host or device) -> one QuantizedWeight stacked per expert
    (each expert quantized as a dense weight is, on the default device, one at a time)."""
    from pallas_kernels.quantized import stack_experts

    return stack_experts([_quantize_one(Dense(jnp.asarray(w[i])), how, group_size,
                                        f"{where} expert {i}") for i in range(w.shape[0])])


def _quantizable(spec: ParamSpec) -> bool:
    """Whether a quantization on load applies to this param: matmul weights and stacked
    experts, except one declared with its own dtype (a MoE router stays float32, so the
    choice of experts does not move)."""
    return spec.kind in (Kind.DENSE, Kind.DENSE_T, Kind.EXPERTS) and spec.dtype is None


def _check_group(group_size) -> None:
    if group_size is not None and (not isinstance(group_size, int) or group_size < 16
                                   or group_size % 16):
        raise ValueError(f"group_size={group_size!r}: a multiple of 16 (32, 64, 128 ...)")


def quantize_params(params, how: str, group_size: int | None = None, specs=None):
    """Every Dense matmul weight of typed params quantized (`how`: int8 | int4 | fp8), one
    tensor at a time on its device (each float weight is released as its codes are made);
    weights already quantized and plain arrays are kept. specs, when given: the params'
    declaration, whose stacked experts (plain arrays [E, K, N]) are quantized too, per
    expert, and whose params declared with a dtype (a router) are kept (without specs:
    experts stay as they are)."""
    _check_group(group_size)
    if specs is not None:
        def one(path, spec, p):
            if not _quantizable(spec):
                return p
            if spec.kind is Kind.EXPERTS and not isinstance(p, QuantizedWeight):
                return _quantize_experts(p, how, group_size, jax.tree_util.keystr(path))
            return quantize_params(p, how, group_size)
        return jax.tree_util.tree_map_with_path(one, specs, params, is_leaf=_is_spec)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_weight)
    out = []
    for path, leaf in flat:
        if isinstance(leaf, Dense):
            leaf = Dense(jnp.asarray(leaf.w), leaf.transposed)
            leaf = _quantize_one(leaf, how, group_size, jax.tree_util.keystr(path))
        out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def dequantize_params(params, specs):
    """Every QuantizedWeight of typed params back to a float32 Dense of its declared kind."""
    def one(spec, p):
        if not isinstance(p, QuantizedWeight | Parts):
            return p
        a = as_array(p, jnp.float32).reshape(quantized_shape(spec))
        return spec.wrap(a.T if spec.kind is Kind.DENSE_T else a)
    return jax.tree.map(one, specs, params, is_leaf=_is_spec)


# Bytes per parameter of our formats at group 128 with float16 scales (fp8: one float32 per
# column): what a quantize-on-load will hold, for the memory check before reading.
BYTES_PER_PARAM = types.MappingProxyType({"int8": 1.02, "int4": 0.52, "fp8": 1.0})


def _at(tree, name: str):
    """The node of a params-shaped tree (dicts and lists) at a dotted name ("layers.3.wqkv")."""
    for part in name.split("."):
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    return tree


def quantize_on_read(specs, how: str, group_size: int | None = None):
    """A loader's transform(name, value) ("layers.3.wqkv", "embed"): each matmul weight
    quantized as it is read, so the float checkpoint is never held whole (stacked experts
    one expert at a time)."""
    _check_group(group_size)

    def transform(name: str, value):
        try:
            spec = _at(specs, name)
        except (KeyError, IndexError):
            return value  # not declared: check_params names it
        # Plain arrays, weights already quantized, and shapes check_params will refuse by
        # name, pass as they are.
        if (not _quantizable(spec) or isinstance(value, QuantizedWeight | Parts)
                or tuple(getattr(value, "shape", ())) != spec.shape):
            return value
        if spec.kind is Kind.EXPERTS:
            return _quantize_experts(value, how, group_size, f"['{name}']")
        return _quantize_one(spec.wrap(jnp.asarray(value)), how, group_size, f"['{name}']")
    return transform


# ---------------------------------------------------------------------------------------------
# Sharded loading: every param put on its shards as it is read
# ---------------------------------------------------------------------------------------------


def put_sharded(host, sharding, dtype=None) -> jax.Array:
    """A host array (numpy, or anything indexed by slices such as checkpoints.hf.TensorSlices)
    as a global jax.Array on `sharding`: each addressable device gets its own shard, read
    (and cast to dtype) by itself, so no device and no host buffer holds the whole array
    beyond the tensor the loader already has. Devices holding the same shard share one read.
    A jax.Array (a weight quantized on the default device) is spread from its device (over
    several processes, each takes its own devices' shards from its own copy)."""
    import numpy as np

    if isinstance(host, jax.Array) and sharding.is_fully_addressable:
        return jax.device_put(host if dtype is None else host.astype(dtype), sharding)
    read = {}

    def shard(index):
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in read:
            part = np.asarray(host[index])
            read[key] = part if dtype is None else part.astype(dtype)
        return read[key]
    return jax.make_array_from_callback(tuple(host.shape), sharding, shard)


def place_on_read(specs, sharding, dtype, quantization: str | None = None,
                  group_size: int | None = None):
    """A loader's transform(name, value) for a sharded load (`sharding`: a
    jaxinfer.sharding.Sharding): each param, as it is read, is dequantized ("none") or
    quantized (int8 / int4 / fp8) on the default device, one tensor at a time, then put on
    the shards `param_shardings` gives its type, its floating arrays cast to dtype (or the
    param's declared dtype) shard by shard."""
    import numpy as np

    from jaxinfer.sharding import param_shardings

    quantizing = quantization not in (None, "none")
    if quantizing:
        _check_group(group_size)

    def transform(name: str, value):
        try:
            spec = _at(specs, name)
        except (KeyError, IndexError):
            return value  # not declared: check_params names it
        quantized = isinstance(value, QuantizedWeight | Parts)
        if not quantized and tuple(getattr(value, "shape", ())) != spec.shape:
            return value  # check_params names the shape
        # (De)quantized as a single-device load does it, on the default device (the same
        # codes; one tensor there at a time), then spread from there
        if quantized and quantization == "none":
            a = as_array(jax.tree.map(jnp.asarray, value), jnp.float32)
            a = a.reshape(quantized_shape(spec))
            value = a.T if spec.kind is Kind.DENSE_T else a
        elif quantizing and not quantized and _quantizable(spec):
            value = (_quantize_experts(value, quantization, group_size, f"['{name}']")
                     if spec.kind is Kind.EXPERTS else
                     _quantize_one(spec.wrap(jnp.asarray(np.asarray(value))), quantization,
                                   group_size, f"['{name}']"))
        typed = spec.wrap(value)
        keep = isinstance(typed, QuantizedWeight | Parts)  # codes and scales as stored
        floating = jnp.dtype(spec.dtype or dtype)

        def put(host, where):
            cast = jnp.issubdtype(host.dtype, jnp.floating) and not keep
            return put_sharded(host, where, floating if cast else None)
        return jax.tree.map(put, typed, param_shardings(spec, sharding, typed))
    return transform


def declared_bytes_per_device(specs, sharding, dtype) -> int:
    """Bytes one device holds of the params declared by specs, in dtype (a param's own dtype
    where it declares one), each on its declared shards (`sharding`: a Sharding)."""
    from jaxinfer.sharding import spec_for

    total = 0
    for spec in jax.tree.leaves(specs, is_leaf=_is_spec):
        shard = sharding.named(spec_for(spec, sharding)).shard_shape(spec.shape)
        total += math.prod(shard) * jnp.dtype(spec.dtype or dtype).itemsize
    return total
