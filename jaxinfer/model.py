"""`jaxinfer.load` and the `Model` it returns: config, params pytree, tokenizer, full forward."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.configs import DTYPES, Config
from jaxinfer.models import layers, llama

DEFAULT_MODEL = "smollm2-135m-instruct"


def default_dtype() -> str:
    """bfloat16 on accelerators, float32 on CPU (where bf16 matmuls are slow and inexact)."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


@functools.partial(jax.jit, static_argnames=("config",))
def _full_forward(params, tokens, config: Config):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logits, _ = llama.forward(params, tokens, positions, config)
    return logits


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: `model(token_ids)` is the full causal forward [B, T] -> [B, T, V] float32."""

    config: Config
    params: dict
    tokenizer: object | None = None

    def __call__(self, token_ids) -> jax.Array:
        tokens = self.check_tokens(token_ids)
        return _full_forward(self.params, jnp.asarray(tokens), self.config)

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


def from_params(config: Config, params, tokenizer=None, dtype: str | None = None) -> Model:
    """Check params against the model's declaration and cast them to `dtype` (default: config's)."""
    dtype = dtype or config.dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    config = config.replace(dtype=dtype)
    layers.check_params(params, llama.param_specs(config))
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype=dtype), params)
    return Model(config=config, params=params, tokenizer=tokenizer)


def load(source: str = DEFAULT_MODEL, dtype: str | None = None) -> Model:
    """Load a model from a registered name, an HF-layout directory or a .gguf file.

    dtype: "float32" | "bfloat16" | "float16" for params and activations (logits stay float32);
    None picks bfloat16 on GPU and float32 on CPU.
    """
    from checkpoints import load_checkpoint

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    config, params, tokenizer = load_checkpoint(source)
    return from_params(config, params, tokenizer, dtype or default_dtype())
