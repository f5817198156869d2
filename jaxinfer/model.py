"""`jaxinfer.load` and the `Model` it returns: config, typed params, tokenizer, kernel policy."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.configs import DTYPES, Config
from jaxinfer.models import registry
from jaxinfer.plan import KernelPolicy, Plan
from jaxinfer.generate import has_quantized, int_layout_params
from jaxinfer.sharding import Sharding
from jaxinfer.weights import (BYTES_PER_PARAM, QUANTIZATIONS, cast_floating, check_params,
                              dequantize_params, place_on_read, quantize_on_read,
                              quantize_params, typed)

DEFAULT_MODEL = "smollm2-135m-instruct"


def default_dtype() -> str:
    """bfloat16 on accelerators, float32 on CPU (where bf16 matmuls are slow and inexact)."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


@functools.partial(jax.jit, static_argnames=("plan",))
def _full_forward(params, tokens, plan: Plan):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits, _ = registry.family(plan.config).forward(params, tokens, positions, plan)
    return logits


@functools.partial(jax.jit, static_argnames=("plan",))
def _expert_load(params, tokens, plan: Plan):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    loads = []  # the MoE layers' expert_counts [E], in layer order
    registry.family(plan.config).forward(params, tokens, positions, plan, loads=loads)
    return jnp.stack(loads)  # [MoE layers, E]


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: `model(token_ids)` is the full causal forward [B, T] -> [B, T, V] float32.
    sharding: the mesh its params are placed on and the rules (None: one device). source: the
    checkpoint directory or file it was loaded from (where a draft head is looked for), None
    for a model made from params."""

    config: Config
    params: dict
    tokenizer: object | None = None
    policy: KernelPolicy = KernelPolicy()
    sharding: Sharding | None = None
    source: str | None = None

    @property
    def plan(self) -> Plan:
        return Plan(self.config, self.policy, self.sharding)

    def with_policy(self, policy: KernelPolicy) -> Model:
        return dataclasses.replace(self, policy=policy)

    def __call__(self, token_ids) -> jax.Array:
        tokens = self.check_tokens(token_ids)
        return _full_forward(self.params, jnp.asarray(tokens), self.plan)

    def expert_load(self, token_ids) -> np.ndarray:
        """How many of token_ids' [B, T] tokens each layer routes to each expert in the full
        forward (each token counts once per expert of its top k): int [num_layers, E], the
        rows of dense layers zero. For balancing experts over devices or checking a router."""
        moe = self.config.moe
        if moe is None:
            raise ValueError(f"expert_load: this model ({self.config.family}) has no experts")
        tokens = self.check_tokens(token_ids)
        counts = np.asarray(_expert_load(self.params, jnp.asarray(tokens), self.plan))
        out = np.zeros((self.config.num_layers, moe.num_experts), counts.dtype)
        out[[i for i in range(self.config.num_layers) if self.config.is_moe_layer(i)]] = counts
        return out

    def check_tokens(self, token_ids) -> np.ndarray:
        """Validate token ids on the host: integer [B, T] within the vocabulary."""
        tokens = np.asarray(token_ids)
        if tokens.ndim != 2 or tokens.shape[1] == 0:
            raise ValueError(f"token_ids must be a non-empty [batch, seq] array, got shape {tokens.shape}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"token_ids must be integers, got dtype {tokens.dtype}")
        bad = (tokens < 0) | (tokens >= self.config.vocab_size)
        if bad.any():
            raise ValueError(f"token id {int(tokens[bad][0])} is outside the vocabulary "
                             f"[0, {self.config.vocab_size})")
        return tokens.astype(np.int32)


def _to_device(name: str, value):
    """A loader's transform: the param (an array, or a weight's arrays) on the default device."""
    return jax.tree.map(jnp.asarray, value)


def _check_policy(policy) -> KernelPolicy:
    if policy is None:
        return KernelPolicy()
    if not isinstance(policy, KernelPolicy):
        raise ValueError(f"policy must be a jaxinfer.plan.KernelPolicy, got {type(policy).__name__}")
    return policy


def _check_quantization(quantization) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}: one of None (as the checkpoint "
                         f"stores it), {', '.join(repr(q) for q in QUANTIZATIONS)}")


def from_params(config: Config, params, tokenizer=None, dtype: str | None = None,
                policy: KernelPolicy | None = None, quantization: str | None = None,
                group_size: int | None = None, sharding: Sharding | None = None) -> Model:
    """Check params against the family's declaration, hold matmul weights as their declared
    types, quantize them if asked (int8 | int4 | fp8; "none" dequantizes quantized ones), and
    cast the floating leaves to `dtype` (default: config's). sharding: the mesh the params
    are on (a sharded load placed them as read; what they are then stays on its shards)."""
    dtype = dtype or config.dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    _check_quantization(quantization)
    config = config.replace(dtype=dtype)
    specs = registry.family(config).param_specs(config)
    check_params(params, specs)
    params = typed(params, specs)
    if quantization == "none":
        params = dequantize_params(params, specs)
    elif quantization is not None:
        params = quantize_params(params, quantization, group_size, specs)
    params = cast_floating(params, dtype, specs)
    policy = _check_policy(policy)
    if has_quantized(params):  # int4 weights once in the layout the model's kernels read
        params = int_layout_params(params, Plan(config, policy, sharding))
    return Model(config=config, params=params, tokenizer=tokenizer, policy=policy,
                 sharding=sharding)


def load(source: str = DEFAULT_MODEL, dtype: str | None = None,
         quantization: str | None = None, policy: KernelPolicy | None = None, *,
         group_size: int | None = None, mesh=None) -> Model:
    """Load a model from a registered name, an HF-layout directory or a .gguf file.

    dtype: "float32" | "bfloat16" | "float16" for params and activations (logits stay float32);
    None picks bfloat16 on GPU and float32 on CPU. quantization: None keeps what the
    checkpoint stores (a GGUF's blocks stay quantized on the device); "none" dequantizes to
    dtype; "int8" | "int4" | "fp8" quantize a 16/32-bit checkpoint's matmul weights on load
    (group-wise along K, group_size rows per scale: default the largest of 128, 64, 32 that
    divides K, else one scale per column; fp8 defaults to one scale per column). policy: the kernel
    choices (default `KernelPolicy()`, today's fastest; `.deterministic()`, `.reference()`).
    mesh: a `jaxinfer.make_mesh(tp=, dp=, ep=)`: every tensor is put on its shards as it is
    read (an HF embedding or LM head by the slices its devices hold, a layer one at a time on
    the host, a GGUF block or a quantized weight one at a time), so neither a device nor the
    host ever holds the whole model; the mesh is checked against the config, and each device's share against its
    free memory, before any tensor is read. `model(...)` and `generate` then run sharded.
    """
    from checkpoints import load_checkpoint
    from checkpoints.registry import resolve as registry_resolve
    from jaxinfer import compilation_cache, memory
    from jaxinfer.ops.blocked import dequant_block_bytes

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    _check_quantization(quantization)
    policy = _check_policy(policy)
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh (jaxinfer.make_mesh(tp=, dp=, "
                         f"ep=)), got {type(mesh).__name__}")
    compilation_cache.enable()
    dtype = dtype or default_dtype()

    quantizing = quantization not in (None, "none")
    read = {}  # the transform and the sharding, once the loader knows the config

    def fits(config, float32_staging, stored_bytes=None):
        specs = registry.family(config).param_specs(config)
        if quantizing:  # each weight quantized as it is read
            read["transform"] = quantize_on_read(specs, quantization, group_size)
            stored_bytes = int(memory.params_bytes(config, "float32") / 4
                               * BYTES_PER_PARAM[quantization])
        if mesh is not None:
            read["sharding"] = sharding = Sharding.create(mesh, config)  # check_mesh
            memory.check_sharded_load(config, dtype, sharding, stored_bytes, quantizing)
            read["transform"] = place_on_read(specs, sharding, dtype, quantization, group_size)
            return
        memory.check_load(config, dtype, host_float32_copy=float32_staging,
                          stored_bytes=stored_bytes, blocked=dequant_block_bytes(policy) > 0)

    def transform(name, value):
        return read["transform"](name, value)

    if quantizing or mesh is not None:
        on_read = transform
    elif jax.default_backend() == "cpu":
        # The device is the host: each param becomes a device array as it is read, so the
        # loader's numpy copy of the whole model never sits beside the device's.
        on_read = _to_device
    else:
        on_read = None
    config, params, tokenizer = load_checkpoint(
        source, before_tensors=fits, keep_quantized=quantization is None,
        transform=on_read, host=mesh is not None)
    with memory.reporting_oom(f"loading {source}"):
        model = from_params(config, params, tokenizer, dtype, policy, quantization, group_size,
                            read.get("sharding"))
    return dataclasses.replace(model, source=str(registry_resolve(source)))
