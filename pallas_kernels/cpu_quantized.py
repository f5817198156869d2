"""The CPU's quantized matmul for decode rows: x [M, K] @ dequantize(qw) in one pass over the codes.

    available()                 whether the kernel is built and loaded here (built on first use)
    fits(qw)                    None if the kernel takes qw's format, else why not
    unfit(qw)                   None if it runs qw here (the CPU, fits, built), else why not
    quantized_matmul_cpu(x, qw, experts=None, threads=0, int8_x=False)
                                x [M, K] float32 -> [M, *N] float32; stacked experts
                                (arrays [E, ...]): row m through expert experts[m]
    round_to_int8(x)            x [..., K] as int8_x takes it: each 16 values rounded to
                                steps of their largest magnitude / 127 (the reference)

`cpu_quantized.cc` is an XLA FFI handler: the calling thread and XLA's intra-op pool share
panels of the weight's columns, turn a slab of its codes at a time into floats in registers and
multiply them into every row, scaling each group's sums once. XLA's own CPU path
(`jaxinfer/ops/blocked.py`) writes each float32 tile to the cache and reads it back: its dot
takes no integer or half-precision weights at speed.

With int8_x, x is rounded to int8 per 16 values of K, as llama.cpp rounds its activations to
Q8 blocks, and a slab's products are integer dot products (with AVX2 32 codes a maddubs; else
a column at a time) scaled once: 1.2-1.6x faster at one row on a Zen 1, and the result is round_to_int8(x) @ the
weights' values, within ~0.5% of x's own (the weights' 4-6-bit codes are far coarser).

The handler is compiled on first use with the machine's C++ compiler (`$CXX`, else `c++`) for
the machine's own instruction set, against the FFI headers jaxlib ships, into a cache folder
(`$JAXINFER_CACHE`, else `~/.cache/jaxinfer`) keyed by the source, jaxlib's version, the CPU and
the flags; a failed build is reported once and the XLA path stays.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quantized import QuantizedWeight

log = logging.getLogger(__name__)

TARGET = "jaxinfer_quantized_matmul_cpu"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_quantized.cc")
_FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w"]
_SCALE_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16, jnp.int8, jnp.uint8)  # the source's DType


def _cpu_name() -> str:
    """The CPU's model and instruction-set flags (what -march=native compiles for)."""
    seen = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part") and key not in seen:
                    seen[key] = line
    except OSError:
        pass
    return "".join(seen.values()) or platform.processor() or platform.machine()


def _library_path() -> str:
    with open(_SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(b"\0".join([source, jax.lib.__version__.encode(), _cpu_name().encode(),
                                     " ".join(_FLAGS).encode()])).hexdigest()[:16]
    root = os.environ.get("JAXINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "jaxinfer")
    return os.path.join(root, f"cpu_quantized-{key}.so")


def _build(path: str) -> None:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (install g++, or set $CXX)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        cmd = [compiler, *_FLAGS, "-I", jax.ffi.include_dir(), _SOURCE, "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, path)  # atomic: concurrent first uses each build, one wins
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def available() -> bool:
    """Whether the kernel is built (now, if need be) and registered with XLA's CPU backend."""
    try:
        path = _library_path()
        if not os.path.exists(path):
            _build(path)
        lib = ctypes.cdll.LoadLibrary(path)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxinferQuantizedMatmul),
                                    platform="cpu")
        return True
    except (OSError, RuntimeError) as e:
        log.warning("the CPU quantized matmul kernel is unavailable, so quantized weights run "
                    "on XLA's slower tiled path: %s", e)
        return False


def fits(qw: QuantizedWeight) -> str | None:
    """None if quantized_matmul_cpu takes qw, else the reason it does not."""
    if not isinstance(qw, QuantizedWeight) or qw.layout != "tiles":
        return "not a QuantizedWeight in the tiles layout"
    if len(qw.planes[0].shape) not in (2, 3):
        return "experts stacked on more than one axis"
    if qw.float8:
        return "fp8 values"
    if qw.bits not in ((4,), (8,), (4, 1), (4, 2)):
        return f"bit planes {qw.bits}"
    if qw.tile % 16 or (qw.groups > 1 and qw.group % 16):
        return f"tile {qw.tile} / group {qw.group} not a multiple of 16 rows"
    for a in (qw.scale, qw.offset, qw.super_scale, qw.super_offset):
        if a is not None and a.dtype not in _SCALE_DTYPES:
            return f"scales of dtype {a.dtype}"
    return None


def unfit(qw) -> str | None:
    """None if quantized_matmul_cpu runs qw here: on the CPU, a format it takes (fits), the
    kernel built (available); else why not."""
    if jax.default_backend() != "cpu":
        return "not on the CPU"
    why = fits(qw)
    if why is None and not available():
        why = "the CPU kernel could not be built here"
    return why


def round_to_int8(x: jax.Array) -> jax.Array:
    """x [..., K] as the kernel's int8_x takes it, in float32: each 16 values of K rounded (half
    to even) to multiples of their largest magnitude / 127; x unchanged where K % 16 != 0 (the
    kernel then keeps float products)."""
    k = x.shape[-1]
    if k % 16:
        return x.astype(jnp.float32)
    b = x.astype(jnp.float32).reshape(*x.shape[:-1], k // 16, 16)
    amax = jnp.max(jnp.abs(b), axis=-1, keepdims=True)
    inv = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
    return (jnp.round(b * inv) * (amax / 127.0)).reshape(x.shape)


def quantized_matmul_cpu(x: jax.Array, qw: QuantizedWeight, experts: jax.Array | None = None,
                         threads: int = 0, int8_x: bool = False) -> jax.Array:
    """x [M, K] float32 @ dequantize(qw) [K, *N] -> [M, *N] float32 (fits(qw) must hold); for
    stacked experts (qw's arrays [E, ...]) row m of x through expert experts[m] (experts [M]
    int). threads: how many of XLA's intra-op threads share the work (0: all of them).
    int8_x: round_to_int8(x) @ the weights, as integer dot products (x itself where K % 16 != 0,
    as round_to_int8 leaves it)."""
    m, k = x.shape
    if k != qw.k:
        raise ValueError(f"x has K={k}, the weight {qw.name} K={qw.k}")
    stacked = len(qw.planes[0].shape) == 3
    if stacked != (experts is not None) or (stacked and experts.shape != (m,)):
        raise ValueError("stacked experts take one expert id a row of x (experts [M]); a "
                         "single weight takes none")
    why = fits(qw)
    if why:
        raise ValueError(f"quantized_matmul_cpu does not take this weight ({why})")
    if not available():
        raise RuntimeError("the CPU quantized matmul kernel could not be built (see the "
                           "warning logged); install a C++ compiler (g++) or use the tiles")
    f32 = jnp.float32
    dummy = jnp.zeros((1,), jnp.uint8)

    def given(a):
        return dummy if a is None else a
    p1 = qw.planes[1] if len(qw.planes) > 1 else dummy
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, qw.n), f32))
    ids = experts.astype(jnp.int32) if stacked else jnp.zeros((1,), jnp.int32)
    y = call(x.astype(f32), qw.planes[0], p1, qw.scale, given(qw.super_scale), given(qw.offset),
             given(qw.super_offset), ids, stacked=np.int64(stacked), bits0=np.int64(qw.bits[0]),
             bits1=np.int64(qw.bits[1] if len(qw.bits) > 1 else 0), tile=np.int64(qw.tile),
             group=np.int64(qw.group), super_group=np.int64(qw.super_group),
             code_offset=np.int64(qw.code_offset),
             has_super_scale=np.int64(qw.super_scale is not None),
             has_offset=np.int64(qw.offset is not None),
             has_super_offset=np.int64(qw.super_offset is not None), int8_x=np.int64(int8_x),
             threads=np.int64(threads))
    return y.reshape(m, *qw.out_shape)
