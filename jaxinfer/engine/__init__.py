"""The serving engine: continuous batching over a paged KV cache (jaxinfer/engine/engine.py)."""

from jaxinfer.engine.engine import Engine, RequestOutput

__all__ = ["Engine", "RequestOutput"]
