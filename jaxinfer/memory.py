"""Will it fit? Estimates of what a load or a request allocates, checked before allocating.

The budget is the device's free memory (a GPU's bytes_limit - bytes_in_use; on CPU the host's
MemAvailable), capped by JAXINFER_MEMORY_LIMIT (bytes, or "8GB", "512MiB"). A request that
cannot fit is refused with the numbers and a remedy instead of failing halfway with
RESOURCE_EXHAUSTED; an allocation failure that still happens is reported the same way.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import re

LOAD_REMEDY = "use dtype='bfloat16' (--dtype bfloat16), or a smaller or quantized model"
_SMALLER = "use a smaller batch, a shorter prompt or max_new_tokens, or "
REMEDY = _SMALLER + LOAD_REMEDY[4:]
HALF_REMEDY = _SMALLER + "a smaller or quantized model"  # already 16-bit: no dtype advice
# On the CPU bfloat16 is no remedy (its matmuls run ~9x slower there than float32's), while a
# quantized GGUF kept in its blocks takes about its file size.
CPU_LOAD_REMEDY = ("use a smaller model, or a quantized GGUF file (Q4_K_M ...), which the CPU "
                   "runs from its blocks in about its file size")
CPU_REMEDY = _SMALLER + "a smaller or quantized (GGUF) model"

# What a CPU process holds besides the params and the KV cache, measured with RSS on the
# 2-core CPU machine (jax 0.11.2; README, "On a CPU"): Python with jax and XLA's CPU runtime
# before any model; the tokenizer's tables per vocabulary entry; a request's compiled
# executables (prefill, decode loop), a fixed part and a part per layer.
CPU_RUNTIME_BYTES = 200 * 2**20
CPU_TOKENIZER_BYTES_PER_TOKEN = 1400
CPU_COMPILED_BYTES = 140 * 2**20
CPU_COMPILED_BYTES_PER_LAYER = 12 * 2**20
# A layer whose weights have two-level scales (GGUF's K-quants) compiles to more: a 1.5B
# Q4_K_M file's three executables (bench) held 0.25 GB more than a Q4_0 file's (28 layers).
CPU_COMPILED_BYTES_PER_KQUANT_LAYER = 6 * 2**20
# Reading a GGUF kept in its blocks: the largest tensor (the embedding) is in flight as the
# file's pages, its codes unpacked one byte per element while repacked, and the repacked
# arrays with their device copy: about this many bytes per element of it.
CPU_READ_BYTES_PER_ELEMENT = 2.5
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


class OutOfMemory(ValueError):
    """A load or request that does not fit the memory budget (raised before allocating)."""


_SHAPES_ONLY = contextvars.ContextVar("jaxinfer_memory_shapes_only", default=False)


@contextlib.contextmanager
def shapes_only():
    """Inside, the checks pass: a request traced for its shapes (jax.eval_shape, lowering a
    model too large for this machine) allocates nothing. The estimates are still reported by
    whoever computes them."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"JAXINFER_MEMORY_LIMIT={text!r}: give bytes or a size like 8GB, "
                         "512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def budget(devices=None) -> tuple[int | None, str]:
    """(free bytes or None when unknown, what they are) for the default device; with devices
    (a mesh's), what each of them has: the least free of the accelerators, or on CPU the
    host's memory divided among the CPU devices (which share it). JAXINFER_MEMORY_LIMIT caps
    every device."""
    import jax

    devices = list(devices) if devices is not None else [jax.devices()[0]]
    device, free = devices[0], None
    what = f"{device.platform} device {device.device_kind}"
    if device.platform == "cpu":
        free, what = _mem_available(), "host memory (MemAvailable)"
        if free is not None and len(devices) > 1:
            free //= len(devices)
            what = f"each of the {len(devices)} CPU devices (sharing the host's MemAvailable)"
    else:
        for d in devices:
            stats = d.memory_stats() or {}
            if "bytes_limit" in stats:
                left = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
                if free is None or left < free:
                    free, what = left, f"{d.platform} device {d.id} ({d.device_kind})"
    cap = os.environ.get("JAXINFER_MEMORY_LIMIT")
    if cap:
        limit = parse_bytes(cap)
        if free is None or limit < free:
            free, what = limit, f"the JAXINFER_MEMORY_LIMIT cap ({cap})"
    return free, what


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check(parts: dict[str, int], doing: str, remedy: str = REMEDY, devices=None) -> None:
    if _SHAPES_ONLY.get():
        return
    free, what = budget(devices)
    need = sum(parts.values())
    if free is not None and need > free:
        detail = ", ".join(f"{k} {gib(v)}" for k, v in parts.items())
        raise OutOfMemory(f"{doing} needs about {gib(need)} ({detail}) but {what} has "
                          f"{gib(free)} free; {remedy}")


def itemsize(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def params_bytes(config, dtype: str) -> int:
    """The params' bytes in `dtype` (from the family's declaration: no weights needed)."""
    import jax

    from jaxinfer.models import registry
    from jaxinfer.weights import abstract_params

    specs = registry.family(config).param_specs(config)
    leaves = jax.tree.leaves(abstract_params(specs, "float32"))
    return sum(math.prod(a.shape) for a in leaves) * itemsize(dtype)


def cpu_process_parts(config, tokenizer: bool = True, executables: int = 2,
                      kquants: bool = False) -> dict[str, int]:
    """What a CPU process running this model holds besides its params and KV cache (the
    runtime, the tokenizer's tables, its compiled executables of the whole model: measured
    constants for generate's two, the prefill and the decode loop; more a layer where the
    weights are K-quants)."""
    layer = CPU_COMPILED_BYTES_PER_LAYER + CPU_COMPILED_BYTES_PER_KQUANT_LAYER * kquants
    per_layer = layer * config.num_layers * executables // 2
    return {"runtime and tokenizer": CPU_RUNTIME_BYTES
            + CPU_TOKENIZER_BYTES_PER_TOKEN * config.vocab_size * tokenizer,
            "compiled executables": CPU_COMPILED_BYTES + per_layer}


def load_parts(config, dtype: str, host_float32_copy: bool = True,
               stored_bytes: int | None = None, blocked: bool = True) -> dict[str, int]:
    """What a load takes at its peak, by part (see check_load)."""
    import jax

    on_cpu = jax.devices()[0].platform == "cpu"
    parts = {"params": params_bytes(config, dtype)}
    if stored_bytes is not None and (blocked or not on_cpu):
        parts = {"params (kept quantized)": int(1.05 * stored_bytes)}
    if stored_bytes is not None and blocked and on_cpu:
        parts["reading the largest tensor"] = int(
            CPU_READ_BYTES_PER_ELEMENT * config.vocab_size * config.hidden_size)
    if host_float32_copy and on_cpu:
        parts["float32 staging copy"] = params_bytes(config, "float32")
    return parts


def load_remedy() -> str:
    import jax

    return CPU_LOAD_REMEDY if jax.devices()[0].platform == "cpu" else LOAD_REMEDY


def check_load(config, dtype: str, host_float32_copy: bool = True,
               stored_bytes: int | None = None, blocked: bool = True) -> None:
    """Before reading a checkpoint's tensors: the params in `dtype`, plus (on CPU, where the
    device is the host) the float32 numpy copy the loaders build first. stored_bytes: a
    checkpoint kept quantized (a GGUF's blocks) takes about its file's bytes; on the CPU
    with blocked (KernelPolicy.dequant_block_bytes > 0, the default) too, plus the largest
    tensor in flight while it is read; without blocked the CPU's requests hold the weights
    dequantized, so the estimate stays `dtype`'s."""
    _check(load_parts(config, dtype, host_float32_copy, stored_bytes, blocked),
           f"loading this model ({config.num_layers} layers, hidden {config.hidden_size}) in "
           f"{dtype}", load_remedy())


def mesh_text(sharding) -> str:
    """"8 devices (tp=8)", for messages."""
    sizes = ", ".join(f"{a}={n}" for a, n in (("tp", sharding.tp), ("dp", sharding.dp),
                                             ("ep", sharding.ep)) if n > 1)
    return f"{sharding.devices} devices" + (f" ({sizes})" if sizes else "")


def check_sharded_load(config, dtype: str, sharding, stored_bytes: int | None = None,
                       quantizing: bool = False) -> None:
    """Before reading a checkpoint's tensors for a load onto a mesh (`sharding`): each
    device's shards of the params (weights.declared_bytes_per_device; a checkpoint kept quantized
    in the same proportion of stored_bytes) against each device's free memory. The host
    holds one tensor at a time (no staging copy of the model); quantizing, the first device
    holds the largest matmul weight (of stacked experts: one expert's, they are quantized one
    at a time) in float32 and its float32 working copy for a moment (counted on every device:
    the least free one decides)."""
    import jax

    from jaxinfer.models import registry
    from jaxinfer.weights import Kind, ParamSpec, declared_bytes_per_device

    specs = registry.family(config).param_specs(config)
    per = declared_bytes_per_device(specs, sharding, dtype)
    total = params_bytes(config, dtype)
    on_cpu = jax.devices()[0].platform == "cpu"
    whole = f"{gib(total)} in {dtype}"
    parts = {"params, per device": per}
    if stored_bytes is not None and not on_cpu:
        whole = f"{gib(stored_bytes)} kept quantized"
        parts = {"params kept quantized, per device": int(1.05 * stored_bytes * per / total)}
    if quantizing:
        largest = max(math.prod(s.shape[1:] if s.kind is Kind.EXPERTS else s.shape)
                      for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
                      if s.kind in (Kind.DENSE, Kind.DENSE_T, Kind.EXPERTS))
        parts["quantizing one weight at a time"] = 2 * 4 * largest
    local = [d for d in sharding.mesh.devices.flat if d.process_index == jax.process_index()]
    _check(parts, f"loading this model ({config.num_layers} layers, hidden "
                  f"{config.hidden_size}: {whole}) on {mesh_text(sharding)}",
           "use more devices (a larger tp), " + (LOAD_REMEDY[4:] if dtype == "float32"
                                                 and not on_cpu
                                                 else "or a smaller or quantized model"),
           devices=local)


def kv_bytes_per_token(config, kv_dtype: str | None = None) -> int:
    """Cache bytes one token takes over all layers: K and V in the model's dtype, or 1-byte
    codes plus a float32 scale per KV head (int8 / fp8); an MLA model's latent (c_kv and the
    shared RoPE key) in the model's dtype, or 1-byte codes plus two float32 scales."""
    if config.mla is not None:
        latent = config.mla.latent_dim
        return config.num_layers * (latent + 2 * 4 if kv_dtype
                                    else latent * itemsize(config.dtype))
    per_head = (config.head_dim + 4) if kv_dtype else config.head_dim * itemsize(config.dtype)
    return 2 * config.num_layers * config.num_kv_heads * per_head


def kv_cache_bytes(config, batch: int, cache_len: int, kv_dtype: str | None = None) -> int:
    """Bytes of a KVCache.init(config, batch, cache_len, kv_dtype=...)."""
    return batch * cache_len * kv_bytes_per_token(config, kv_dtype)


def cache_split(config, batch: int, sharding) -> int:
    """How many ways a KV cache of `batch` rows is split over a mesh: its rows over dp
    where dp divides them, its KV heads over tp where they shard (an MLA latent: rows only)."""
    if sharding is None:
        return 1
    rows = sharding.dp if batch % sharding.dp == 0 else 1
    heads = sharding.tp if config.mla is None and sharding.axis("kv_heads") is not None else 1
    return rows * heads


def request_parts(config, batch: int, prompt_len: int, cache_len: int, chunk: int,
                  kv_dtype: str | None = None, sharding=None,
                  quantized: bool = False) -> dict[str, int]:
    """What a request allocates, by part (see check_request)."""
    import jax

    from jaxinfer.ops.blocked import TILED_ROWS

    split = cache_split(config, batch, sharding)
    kv = kv_cache_bytes(config, batch, cache_len, kv_dtype) // split
    tokens = batch * min(chunk, prompt_len)
    width = (4 * config.hidden_size + (config.num_heads + 2 * config.num_kv_heads)
             * config.head_dim + 3 * config.intermediate_size)
    work = tokens * width * 4 + batch * config.vocab_size * 4 * 2
    if jax.devices()[0].platform == "cpu":
        keys = prompt_len if chunk >= prompt_len else cache_len
        work += 2 * tokens * config.num_heads * keys * 4
        if kv_dtype:  # one layer's cache dequantized: K and V, or an MLA latent
            per_slot = (config.mla.latent_dim if config.mla is not None
                        else 2 * config.num_kv_heads * config.head_dim)
            work += batch * cache_len * per_slot * 4
        if quantized and tokens > TILED_ROWS:  # a prefill's gate and up dequantized whole
            work += 2 * config.hidden_size * config.intermediate_size * 4
    if sharding is not None:
        work //= sharding.dp if batch % sharding.dp == 0 else 1  # rows over dp
    return {"KV cache": kv, "workspace": work}


def check_request(config, batch: int, prompt_len: int, cache_len: int, chunk: int,
                  kv_dtype: str | None = None, sharding=None, quantized: bool = False) -> None:
    """Before allocating a request's cache: K/V for batch x cache_len slots (kv_dtype "int8" /
    "fp8": the quantized cache), and the largest prefill step's activations (chunk tokens per
    row; on CPU the reference attention's float32 scores against the cache, and a quantized
    layer's K/V dequantized to float32). sharding (a mesh's): per device, the cache's share
    (cache_split) against each device's free memory. quantized: the params hold quantized
    weights (on CPU a prefill dequantizes a weight whole at a time)."""
    import jax

    devices = None
    if sharding is not None:
        devices = [d for d in sharding.mesh.devices.flat
                   if d.process_index == jax.process_index()]
    where = "" if sharding is None else f" on {mesh_text(sharding)}, per device"
    _check(request_parts(config, batch, prompt_len, cache_len, chunk, kv_dtype, sharding,
                         quantized),
           f"this request (batch {batch}, {prompt_len} prompt tokens padded, cache of "
           f"{cache_len} slots){where}",
           CPU_REMEDY if jax.devices()[0].platform == "cpu" else REMEDY if
           config.dtype == "float32" else HALF_REMEDY, devices=devices)


def cpu_peak_bytes(config, params: int, load: dict[str, int], request: dict[str, int],
                   tokenizer: bool = True, executables: int = 2, kquants: bool = False) -> int:
    """The resident memory a CPU process peaks at: the runtime and the params (params: their
    bytes as held), then the larger of what the load adds while reading (load_parts beyond
    the params) and what a request adds (its compiled executables, cache and workspace)."""
    extra = cpu_process_parts(config, tokenizer, executables, kquants)
    reading = sum(v for k, v in load.items() if not k.startswith("params"))
    running = extra["compiled executables"] + sum(request.values())
    return extra["runtime and tokenizer"] + params + max(reading, running)


@contextlib.contextmanager
def reporting_oom(doing: str):
    """Turn an allocation failure (RESOURCE_EXHAUSTED) into OutOfMemory with the remedy."""
    import jax

    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        free, what = budget()
        first = str(e).strip().splitlines()[0][:300]
        remedy = CPU_REMEDY if jax.devices()[0].platform == "cpu" else REMEDY
        raise OutOfMemory(f"{doing} ran out of memory ({first}); {what} has "
                          f"{'?' if free is None else gib(free)} free; {remedy}") from e
