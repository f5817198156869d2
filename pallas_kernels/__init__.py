"""Pallas GPU kernels, each beside its pure-jnp reference (same signature).

On CPU, pass interpret=True (tests) or call the *_reference functions (the model's CPU path).
"""

from pallas_kernels.decode_attention import (
    DecodeBlockSizes, decode_attention, decode_attention_reference)
from pallas_kernels.decode_attention_append import (
    decode_attention_append, decode_attention_append_reference)
from pallas_kernels.flash_attention import (
    FlashBlockSizes, flash_attention, flash_attention_reference)
from pallas_kernels.flash_attention_mgpu import MosaicFlashConfig
from pallas_kernels.norm_matmul import (
    MatmulBlockSizes, norm_matmul, norm_matmul_reference)
from pallas_kernels.rms_norm import (
    add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference)
from pallas_kernels.rope import rope, rope_reference
from pallas_kernels.swiglu import (
    swiglu, swiglu_down, swiglu_down_reference, swiglu_reference)

__all__ = [
    "add_rms_norm", "add_rms_norm_reference",
    "DecodeBlockSizes", "FlashBlockSizes", "MatmulBlockSizes", "MosaicFlashConfig",
    "decode_attention", "decode_attention_reference",
    "decode_attention_append", "decode_attention_append_reference",
    "flash_attention", "flash_attention_reference",
    "norm_matmul", "norm_matmul_reference",
    "rms_norm", "rms_norm_reference",
    "rope", "rope_reference",
    "swiglu", "swiglu_down", "swiglu_down_reference", "swiglu_reference",
]
