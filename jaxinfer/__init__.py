"""jaxinfer: a JAX/Pallas functional inference stack for LLMs on NVIDIA GPUs.

The names below are imported on first use (PEP 562), so `import jaxinfer` and the command line's
`--help` or argument errors do not pay for importing jax.
"""

from __future__ import annotations

import importlib
import sys
import types

__version__ = "0.1.0"

_EXPORTS = {
    "Completion": "jaxinfer.generate", "generate": "jaxinfer.generate",
    "stream": "jaxinfer.generate", "KVCache": "jaxinfer.cache", "Config": "jaxinfer.configs",
    "PRESETS": "jaxinfer.configs", "RopeScaling": "jaxinfer.configs", "Model": "jaxinfer.model",
    "load": "jaxinfer.model", "KernelPolicy": "jaxinfer.plan", "Plan": "jaxinfer.plan",
    "SamplingParams": "jaxinfer.sampling", "sample": "jaxinfer.sampling",
    "make_mesh": "jaxinfer.sharding", "Engine": "jaxinfer.engine",
    "RequestOutput": "jaxinfer.engine", "PagedKVCache": "jaxinfer.cache",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later look-ups skip this hook
        return value
    raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # Importing the submodule jaxinfer.generate binds it here, over the function of the same
        # name: keep the function (what `jaxinfer.generate(...)` means).
        if name == "generate" and isinstance(value, types.ModuleType):
            value = value.generate
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
