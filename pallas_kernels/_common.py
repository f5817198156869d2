"""Helpers shared by the Pallas kernels: input validation and small in-kernel utilities.

Everything here runs at trace time (validation) or inside a kernel body (the dot helper); nothing
holds state.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

# Masked scores are set to this finite value rather than -inf: a row whose first visited tile is
# fully masked then gets m = MASK_VALUE instead of -inf, so exp2(m_prev - m_next) never computes
# (-inf) - (-inf) = NaN. The garbage such a tile adds to l and acc is multiplied by
# exp2(MASK_VALUE - real_max) = 0 as soon as the row meets a visible key (every valid row does).
MASK_VALUE = -1e30

LOG2_E = math.log2(math.e)

NUM_SMS_H200 = 132  # streaming multiprocessors: the default grids aim at a few programs per SM

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


GATE_ACTIVATIONS = ("silu", "gelu_tanh")


def gate_activation(gate, activation: str):
    """The gated MLP's gate, in a kernel or a reference (float32 in, float32 out): silu for
    SwiGLU, tanh-approximated GELU (HF's gelu_pytorch_tanh) for GeGLU."""
    if activation == "silu":
        return gate * jax.nn.sigmoid(gate)
    if activation == "gelu_tanh":
        inner = math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate * gate * gate)
        return 0.5 * gate * (1.0 + jnp.tanh(inner))
    raise ValueError(f"gate activation must be one of {GATE_ACTIVATIONS}, got {activation!r}")


def check_softcap(op: str, softcap) -> float | None:
    """A positive finite soft-cap as a float, or None."""
    if softcap is None:
        return None
    cap = float(softcap)
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"{op}: softcap must be a positive number or None, got {softcap!r}")
    return cap


def softcap_log2(s, softcap: float | None):
    """Scores already in log2 units (s = q.k * sm_scale * log2 e) soft-capped as HF's
    softcap * tanh(scores / softcap) does in natural units, before any mask; s for None."""
    if softcap is None:
        return s
    cap = softcap * LOG2_E
    return jnp.tanh(s * (1.0 / cap)) * cap


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_array(op: str, name: str, x, ndim: int, dtypes=FLOAT_DTYPES) -> None:
    """Raise ValueError unless `x` is an array of rank `ndim` with one of `dtypes`."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{op}: {name} must be an array, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{op}: {name} must have rank {ndim}, got shape {tuple(x.shape)}")
    if jnp.dtype(x.dtype) not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{op}: {name} has dtype {x.dtype}, expected one of {names}")


def check_same_dtype(op: str, **arrays) -> None:
    dts = {n: jnp.dtype(a.dtype) for n, a in arrays.items()}
    if len(set(dts.values())) > 1:
        desc = ", ".join(f"{n} {d}" for n, d in dts.items())
        raise ValueError(f"{op}: inputs must share one dtype, got {desc}")


def check_head_dim(op: str, d: int) -> None:
    # Triton tiles must have power-of-two sides, and tl.dot needs each side >= 16.
    if not is_pow2(d) or not 16 <= d <= 256:
        raise ValueError(f"{op}: head dim {d} is not supported by the Pallas kernel "
                         f"(need a power of two in [16, 256]); use the *_reference function")


def dot_f32(a: jax.Array, b: jax.Array, *, trans_b: bool = False) -> jax.Array:
    """a [M, K] @ b [K, N] (or b [N, K] with trans_b) accumulated in float32.

    float32 operands use IEEE precision: Triton's default for float32 would be tf32, which loses
    three decimal digits; bf16/fp16 operands use the tensor cores' native path.
    """
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    contract = ((1,), (1,)) if trans_b else ((1,), (0,))
    return lax.dot_general(a, b, (contract, ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def sum_chunks(parts: jax.Array) -> jax.Array:
    """parts [S, ...] summed over S in chunk order, ((p0 + p1) + p2) + ..., as the kernels that
    take split-K chunks sum them (add_rms_norm, a consumer matmul's deltas). Elementwise adds
    keep that order at any shape; a reduce's order over S is XLA's choice by shape (a row's
    sum could then depend on the other rows: batch invariance). One fused pass either way."""
    total = parts[0]
    for i in range(1, parts.shape[0]):
        total = total + parts[i]
    return total


def ref_precision(dtype):
    """Matmul precision for the references: IEEE float32 for float32 inputs (the GPU default would
    be tf32), the native tensor-core path for 16-bit inputs (exact products, float32 sums)."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def multiple_of(x, n: int):
    """`pl.multiple_of` for traced offsets; a Python int (a loop index the kernel fixed at trace
    time, e.g. the masked tail step) is returned as is: Triton's lowering rejects the hint on a
    constant ("'TypedInt' object has no attribute 'owner'", seen on the H200 with jax 0.11.2)."""
    from jax.experimental import pallas as pl

    return x if isinstance(x, int) else pl.multiple_of(x, n)


def check_tiles(sizes, *names: str) -> None:
    """Raise ValueError unless each named tile side of the block-size dataclass `sizes` is a
    power of two >= 16 (Triton's dot needs that)."""
    for name in names:
        val = getattr(sizes, name)
        if not is_pow2(val) or val < 16:
            raise ValueError(f"{type(sizes).__name__}.{name}={val}: must be a power of two >= 16")


def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (the Mosaic GPU kernels' target)."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and any(n in dev.device_kind
                                         for n in ("H100", "H200", "H800", "GH200"))
