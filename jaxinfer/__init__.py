"""jaxinfer: a JAX/Pallas functional inference stack for LLMs on NVIDIA GPUs."""

from jaxinfer.cache import KVCache
from jaxinfer.configs import PRESETS, Config, RopeScaling
from jaxinfer.model import Model, load

__all__ = ["Config", "KVCache", "Model", "PRESETS", "RopeScaling", "load"]
