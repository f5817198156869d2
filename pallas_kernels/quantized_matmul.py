"""quantized_matmul: x @ a QuantizedWeight, dequantized in registers (never written back).

The kernel is the shared fused matmul of norm_matmul.py: each step reads one tile of codes
(and one scale row) per column band, dequantizes it in registers (quantized.tile_dot) and
feeds the tensor cores, so the norm prologue, split-K partials and SwiGLU of the bf16 decode
path hold for every weight type. The layout and the formats: pallas_kernels/quantized.py.
"""

from __future__ import annotations

from pallas_kernels.norm_matmul import MatmulBlockSizes, norm_matmul, norm_matmul_reference
from pallas_kernels.quantized import QuantizedWeight


def quantized_matmul(x, qw: QuantizedWeight, *, out_dtype=None, interpret: bool = False,
                     block_sizes: MatmulBlockSizes | None = None):
    """x [M, K] @ dequantize(qw) [K, *N] -> [M, *N] in out_dtype (default x's dtype); float32
    accumulation. Any M, K, N (edge tiles masked)."""
    return norm_matmul(x, None, qw, out_dtype=out_dtype, interpret=interpret,
                       block_sizes=block_sizes)


def quantized_matmul_reference(x, qw: QuantizedWeight, *, out_dtype=None,
                               interpret: bool = False):
    """x @ dequantize(qw) in plain jnp (the weight rounded once to x's dtype)."""
    return norm_matmul_reference(x, None, qw, out_dtype=out_dtype, interpret=interpret)
