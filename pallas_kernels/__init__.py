"""Pallas GPU kernels, each beside its pure-jnp reference (same signature).

On CPU, pass interpret=True (tests) or call the *_reference functions (the model's CPU path).
Names are imported from their modules on first use (PEP 562): a CPU run that never calls a
kernel does not import Pallas' GPU backends.
"""

from __future__ import annotations

import importlib
import sys
import types

_MODULES = {
    "chunk_attention": ("chunk_attention", "chunk_attention_reference"),
    "decode_attention": ("DecodeBlockSizes", "decode_attention", "decode_attention_reference"),
    "decode_attention_append": ("decode_attention_append", "decode_attention_append_reference"),
    "flash_attention": ("FlashBlockSizes", "flash_attention", "flash_attention_reference"),
    "flash_attention_mgpu": ("MosaicFlashConfig",),
    "kv_quant": ("dequantize_kv", "quantize_kv"),
    "mla": ("MLABlockSizes", "mla_decode_attention", "mla_decode_attention_reference",
            "paged_mla_attention", "paged_mla_attention_reference"),
    "moe": ("MoEBlockSizes", "grouped_down", "grouped_down_reference", "grouped_swiglu",
            "grouped_swiglu_reference", "group_by_expert", "moe_decode", "moe_decode_reference",
            "moe_experts_reference", "moe_grouped", "moe_grouped_reference"),
    "moe_route": ("add_rms_norm_route", "add_rms_norm_route_reference", "moe_route",
                  "moe_route_reference"),
    "norm_matmul": ("MatmulBlockSizes", "norm_matmul", "norm_matmul_reference"),
    "paged_attention": ("paged_decode_attention", "paged_decode_attention_append",
                        "paged_decode_attention_append_reference",
                        "paged_decode_attention_reference"),
    "paged_chunk_attention": ("PagedBlockSizes", "paged_chunk_attention",
                              "paged_chunk_attention_reference"),
    "quantized": ("QuantizedWeight", "dequantize", "num_experts", "quantize_weight",
                  "stack_experts"),
    "quantized_matmul": ("quantized_matmul", "quantized_matmul_reference"),
    "quantized_mgpu": ("MgpuMatmulConfig", "nk_format", "nk_norm_unfit", "nk_unfit",
                       "quantized_matmul_mgpu",
                       "quantized_matmul_mgpu_reference", "to_nk", "to_tiles", "weight_config"),
    "rms_norm": ("add_rms_norm", "add_rms_norm_reference", "rms_norm", "rms_norm_reference"),
    "rope": ("rope", "rope_reference"),
    "swiglu": ("swiglu", "swiglu_down", "swiglu_down_reference", "swiglu_reference"),
    "verify_attention": ("paged_verify_attention", "paged_verify_attention_reference",
                         "verify_attention", "verify_attention_reference"),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(f"pallas_kernels.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'pallas_kernels' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # Importing a submodule binds it here, over its function of the same name (the
        # decode_attention module and function): keep the function.
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
