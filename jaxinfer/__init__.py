"""jaxinfer: a JAX/Pallas functional inference stack for LLMs on NVIDIA GPUs."""

from jaxinfer.cache import KVCache
from jaxinfer.configs import PRESETS, Config, RopeScaling
from jaxinfer.generate import Completion, generate, stream
from jaxinfer.model import Model, load
from jaxinfer.plan import KernelPolicy, Plan
from jaxinfer.sampling import SamplingParams, sample

__all__ = ["Completion", "Config", "KVCache", "KernelPolicy", "Model", "PRESETS", "Plan",
           "RopeScaling", "SamplingParams", "generate", "load", "sample", "stream"]
