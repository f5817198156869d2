"""`jaxinfer bench`: prefill and decode speed against the memory-bandwidth floor.

Bytes a decode step must move: every weight once (the embedding table only for the B rows
looked up; a tied head reads it whole), the valid K/V positions of every layer, and the new K/V
written. Floor = bytes / HBM bandwidth (a device-to-device copy measured on the card: 4.27 TB/s
on the H200, 3.0 on the H100 80GB; none on other cards); the fraction of the floor is floor
time / measured time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import statistics
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxinfer import memory
from jaxinfer.configs import PRESETS, Config
from jaxinfer.generate import (CACHE_ROUND, PROMPT_BUCKETS, bucket, decode_loop, decode_step,
                               fitting_state, init_state, int_layout_params, prefill,
                               prefill_chunk_size, prefill_prompts, run_params)
from jaxinfer.model import Model, default_dtype, load
from jaxinfer.models import registry
from jaxinfer.ops.blocked import dequant_block_bytes
from jaxinfer.plan import KernelPolicy, Plan
from jaxinfer.sampling import SamplingParams
from jaxinfer.sharding import Sharding, cache_shardings, param_shardings, shard_params
from jaxinfer.weights import (
    BYTES_PER_PARAM,
    ParamSpec,
    QuantizedWeight,
    abstract_params,
    array_bytes,
    init_params,
    param_bytes,
    quantize_params,
)
from pallas_kernels import cpu_quantized

log = logging.getLogger(__name__)

# Measured ceilings by the device kind's name (a device-to-device copy, read + write); on CPU
# and on cards not listed (the PCIe and NVL H100s have other memory) no floor is reported.
HBM_BYTES_PER_S = types.MappingProxyType({"H200": 4.27e12, "H100 80GB HBM3": 3.0e12})


def hbm_bytes_per_s(device_kind: str) -> float | None:
    """The copy bandwidth of the card named device_kind ("NVIDIA H100 80GB HBM3"), or None."""
    return next((bw for name, bw in HBM_BYTES_PER_S.items() if name in device_kind), None)


@dataclasses.dataclass
class BenchResult:
    model: str
    policy: str
    backend: str
    dtype: str
    batch: int
    prompt_len: int
    gen_len: int
    compile_s: float
    prefill_tokens_per_s: float
    decode_ms_per_token: float
    decode_tokens_per_s: float
    host_overhead_ms_per_step: float
    bytes_per_step: float
    achieved_gb_per_s: float
    floor_fraction: float | None
    peak_memory_gb: float | None
    # On CPU: memory.cpu_peak_bytes' estimate of the peak (what the refusals budget), in GB
    estimated_peak_gb: float | None = None
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "int8" or "fp8"
    kv_cache_bytes: int = 0  # the whole cache as allocated
    weights: str = "dense"  # the matmul weights' formats ("int4", "q4_k+q6_k", ...)
    param_bytes: int = 0
    mesh: str = "1 device"  # "8 devices (tp=8)"
    param_bytes_per_device: int = 0  # the most any one device holds
    kv_cache_bytes_per_device: int = 0

    @staticmethod
    def table_header() -> str:
        return (f"{'model':22s} {'polic':5s} {'batch':6s} {'context':10s} {'decode':>15s} "
                f"{'throughput':>15s} {'achieved':>13s} of the HBM floor")

    def table_row(self) -> str:
        frac = f"{self.floor_fraction:.1%}" if self.floor_fraction is not None else "n/a"
        kv = "" if self.kv_cache_dtype == "auto" else f" kv={self.kv_cache_dtype}"
        kv += "" if self.weights == "dense" else f" w={self.weights}"
        kv += "" if self.mesh == "1 device" else f" {self.mesh}"
        if self.backend == "cpu":  # no floor here: the prompt's speed and the memory instead
            kv += f" prefill {self.prefill_tokens_per_s:.1f} tok/s"
            if self.peak_memory_gb is not None:
                kv += f" peak RSS {self.peak_memory_gb:.2f} GB"
            if self.estimated_peak_gb is not None:
                kv += f" (estimate {self.estimated_peak_gb:.2f} GB)"
        return (f"{self.model:22s} {self.policy[:5]:5s} B={self.batch:<4d} "
                f"ctx={self.prompt_len + self.gen_len:<6d} "
                f"{self.decode_ms_per_token:8.3f} ms/tok {self.decode_tokens_per_s:9.1f} tok/s "
                f"{self.achieved_gb_per_s:8.1f} GB/s floor {frac}{kv}")


def decode_bytes_per_step(config: Config, batch: int, context: int,
                          kv_dtype: str | None = None, params=None) -> float:
    """Bytes one decode step must move at an average context of `context` tokens per row
    (kv_dtype "int8" / "fp8": 1-byte codes and a float32 scale per token and KV head).
    params, when given: their real bytes (quantized weights' codes and scales)."""
    itemsize = jnp.dtype(config.dtype).itemsize
    embed = config.vocab_size * config.hidden_size * itemsize
    total = config.num_params() * itemsize
    if params is not None:
        embed, total = param_bytes(params["embed"]), param_bytes(params)
    weights = total - embed  # everything but the embedding table...
    if config.moe is not None:  # ...less the experts no row routes to (uniform routing)
        m = config.moe
        unused = m.num_experts * (1 - m.experts_per_token / m.num_experts) ** batch
        expert = 3 * config.hidden_size * m.expert_intermediate_size * itemsize
        if params is not None:  # one expert's real bytes (quantized: its codes and scales)
            expert = _expert_bytes(params, m.num_experts) or expert
        weights -= sum(map(config.is_moe_layer, range(config.num_layers))) * unused * expert
    weights += batch * config.hidden_size * itemsize  # ...of which B rows are read
    if config.tie_word_embeddings:
        weights += embed  # the tied head reads the whole table
    kv_row = memory.kv_bytes_per_token(config, kv_dtype)
    return weights + batch * (context + 1) * kv_row


def _expert_bytes(params, num_experts: int) -> float:
    """The bytes of one routed expert (gate, up and down) of the params' first MoE layer, as
    held (a quantized expert's codes and scales); 0 without one."""
    for layer in params.get("layers", ()):
        if "experts_gate" in layer:
            names = ("experts_gate", "experts_up", "experts_down")
            return sum(param_bytes(layer[n]) for n in names) / num_experts
    return 0


POLICIES = types.MappingProxyType({"default": KernelPolicy,
                                   "deterministic": KernelPolicy.deterministic,
                                   "reference": KernelPolicy.reference})


def _preset(preset: str, dtype: str, num_layers: int | None = None) -> Config:
    """A preset's config in dtype; num_layers: its first layers only (a quick compile)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    config = PRESETS[preset].replace(dtype=dtype)
    if num_layers is not None and num_layers != config.num_layers:
        if num_layers > config.num_layers:
            raise ValueError(f"--num-layers {num_layers}: {preset} has {config.num_layers}")
        config = config.replace(num_layers=num_layers,
                                layer_windows=config.layer_windows[:num_layers])
    return config


def random_model(preset: str, dtype: str, seed: int = 0,
                 policy: KernelPolicy | None = None, quantization: str | None = None,
                 group_size: int | None = None, mesh=None, num_layers: int | None = None
                 ) -> Model:
    """Real shapes, random values, initialized on the device (no download); quantization
    int8 / int4 / fp8 quantizes them there, one weight at a time. mesh (make_mesh): each
    weight is created in its shards (never whole on one device) and the model runs sharded.
    num_layers: the preset's first layers only."""
    config = _preset(preset, dtype, num_layers)
    specs = registry.family(config).param_specs(config)
    quantize = quantization not in (None, "none")
    if mesh is None:
        memory.check_load(config, dtype, host_float32_copy=False, stored_bytes=int(
            memory.params_bytes(config, "bfloat16") / 2 * BYTES_PER_PARAM[quantization])
            if quantize else None)
        # each weight quantized as it is drawn: Mixtral's 93 GB of bf16 beside its int4 codes
        # did not fit an H200
        params = init_params(specs, jax.random.key(seed), dtype, functools.partial(
            _quantize_one_param, how=quantization, group_size=group_size) if quantize else None)
        sharding = None
    else:
        sharding = Sharding.create(mesh, config)
        memory.check_sharded_load(config, dtype, sharding)
        params = _sharded_random_params(specs, jax.random.key(seed), dtype, sharding)
        if quantize:  # each weight's codes and scales on their own shards
            params = shard_params(quantize_params(params, quantization, group_size, specs),
                                  specs, sharding)
    policy = policy or KernelPolicy()
    if quantize:  # int4 weights in the layout the model's kernels read (as a load does)
        params = int_layout_params(params, Plan(config, policy, sharding))
    return Model(config=config, params=params, tokenizer=None, policy=policy,
                 sharding=sharding)


def _quantize_one_param(spec: ParamSpec, value, *, how: str, group_size: int | None):
    return quantize_params([value], how, group_size, specs=[spec])[0]


def _sharded_random_params(specs, key: jax.Array, dtype: str, sharding: Sharding):
    """init_params' values made directly in their shards: one jit per distinct declaration
    (a layer's weights repeat), its output sharded as the rules say, so each device draws
    only its own part (jax's partitionable threefry)."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    keys = jax.random.split(key, len(leaves))
    made = {}
    out = []
    for spec, k in zip(leaves, keys):
        if spec not in made:
            made[spec] = jax.jit(functools.partial(_initialize, spec, dtype=dtype),
                                 out_shardings=param_shardings(spec, sharding))
        out.append(made[spec](k))
    return jax.tree.unflatten(treedef, out)


def _initialize(spec: ParamSpec, key: jax.Array, dtype: str):
    return spec.initialize(key, dtype)


def _abstract(tree, shardings):
    """ShapeDtypeStructs of a tree's arrays carrying these shardings (lowering without data)."""
    def one(a, where):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where)
    return jax.tree.map(one, tree, shardings)


def _shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded arrays or ShapeDtypeStructs (the most any
    device holds: shards are even, replicas whole)."""
    total = 0
    for a in jax.tree.leaves(tree):
        shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
        total += array_bytes(shape, a.dtype)
    return total


def _total_bytes(tree) -> int:
    return sum(array_bytes(a.shape, a.dtype) for a in jax.tree.leaves(tree))


def compile_only(preset: str, dtype: str, batch: int, prompt_len: int, gen_len: int,
                 policy: KernelPolicy, mesh=None, quantization: str | None = None,
                 group_size: int | None = None, kv_cache_dtype: str | None = None,
                 num_layers: int | None = None) -> dict:
    """Lower and compile the prefill and the decode step of a preset at batch x (prompt_len +
    gen_len) with abstract weights and cache carrying the mesh's shardings: nothing is
    allocated, so a 70B model compiles on fake CPU devices. Returns each device's bytes
    (params, KV cache) from the shardings, and the compile time. num_layers: the preset's
    first layers only (every op of a layer compiled, in a fraction of the time)."""
    config = _preset(preset, dtype, num_layers)
    specs = registry.family(config).param_specs(config)
    sharding = None if mesh is None else Sharding.create(mesh, config)
    params = abstract_params(specs, dtype)
    if quantization not in (None, "none"):
        params = jax.eval_shape(functools.partial(quantize_params, how=quantization,
                                                  group_size=group_size, specs=specs), params)
    if sharding is not None:
        params = _abstract(params, param_shardings(specs, sharding, params))
    model = Model(config=config, params=params, tokenizer=None, policy=policy,
                  sharding=sharding)
    plan = model.plan
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, config.vocab_size, (batch, prompt_len)).tolist()
    greedy = [SamplingParams(temperature=0.0)] * batch

    def state():  # the real request's state, as shapes: the checks are for allocations
        with memory.shapes_only():
            return init_state(model, prompts, gen_len, greedy, 0, stop_ids=[],
                              kv_cache_dtype=kv_cache_dtype, sharding=sharding)

    state_shapes, tokens, lengths = jax.eval_shape(state)
    if sharding is not None:
        state_shapes = state_shapes.replace(cache=_abstract(
            state_shapes.cache, cache_shardings(state_shapes.cache, sharding)))
    t0 = time.perf_counter()
    run = jax.eval_shape(lambda p: run_params(dataclasses.replace(model, params=p), plan),
                         params)  # on CPU quantized weights run dequantized
    if sharding is not None:
        run = _abstract(run, param_shardings(specs, sharding, run))
    prefill.lower(run, tokens, lengths, state_shapes, plan).compile()
    decode_step.lower(run, state_shapes, plan).compile()
    compile_s = time.perf_counter() - t0
    return {"model": preset, "layers": config.num_layers, "dtype": dtype, "batch": batch,
            "context": prompt_len + gen_len, "mesh": _mesh_text(sharding),
            "weights": weight_formats(params),
            "param_bytes": param_bytes(params),
            "param_bytes_per_device": _shard_bytes(params),
            "kv_cache_bytes": _total_bytes(state_shapes.cache),
            "kv_cache_bytes_per_device": _shard_bytes(state_shapes.cache),
            "compile_s": round(compile_s, 2)}


def _mesh_text(sharding) -> str:
    return "1 device" if sharding is None else memory.mesh_text(sharding)


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclasses.dataclass(frozen=True)
class _strict:
    """A compiled executable that, on a mesh, first puts its arguments on the shardings it
    was compiled for: an executable's outputs may come back sharded otherwise than its
    inputs went in (the state's per-row arrays over dp), and executables refuse that (jit
    would recompile). On one device, the executable itself."""
    compiled: object
    plan: object

    def __call__(self, *args):
        if self.plan.sharding is not None:
            args = jax.device_put(args, self.compiled.input_shardings[0])
        return self.compiled(*args)


def run(model: Model, name: str, batch: int, prompt_len: int, gen_len: int,
        repeats: int = 3, seed: int = 0, dump_hlo: str | None = None,
        policy_name: str = "default", kv_cache_dtype: str | None = None) -> BenchResult:
    config, plan = model.config, model.plan
    if prompt_len + gen_len > config.max_position_embeddings:
        raise ValueError(f"prompt_len + gen_len = {prompt_len + gen_len} exceeds the model's "
                         f"context of {config.max_position_embeddings}")
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, config.vocab_size, (batch, prompt_len)).tolist()
    greedy = [SamplingParams(temperature=0.0)] * batch

    def fresh_state():
        # No stop ids: every row runs its whole budget, so the step count is known. One
        # shot, or in chunks where that would not fit (fitting_state).
        return fitting_state(model, prompts, gen_len, greedy, seed, [], model.plan,
                             kv_cache_dtype=kv_cache_dtype, one_shot=True)

    progress = tqdm(total=4, desc=f"bench {name}", leave=False, disable=None)  # terminals only
    state, tokens, lengths, plan = fresh_state()
    params = run_params(model, plan)  # what generate runs (on CPU: dequantized per request)
    t0 = time.perf_counter()
    chunk = prefill_chunk_size(plan)
    if chunk and prompt_len > chunk:  # chunk by chunk, compiled at the first call
        prefill_exe = functools.partial(prefill_prompts, plan=plan, longest=prompt_len)
    else:
        prefill_exe = _strict(prefill.lower(params, tokens, lengths, state, plan).compile(), plan)
    state = jax.block_until_ready(prefill_exe(params, tokens, lengths, state))
    loop_exe = _strict(decode_loop.lower(params, state, plan).compile(), plan)
    step_exe = _strict(decode_step.lower(params, state, plan).compile(), plan)
    compile_s = time.perf_counter() - t0
    del state  # each timing below makes its own: never two KV caches alive at once
    if dump_hlo:  # the optimized decode step, to count its kernels and spot copies
        with open(f"{dump_hlo}.b{batch}.hlo.txt", "w") as f:
            f.write(step_exe.compiled.as_text())
    progress.update()

    def prefill_once():
        s, t, ln, _ = fresh_state()
        return jax.block_until_ready(prefill_exe(params, t, ln, s))

    prefill_s = _median_time(prefill_once, repeats)
    progress.update()

    loop_times = []
    for _ in range(repeats):
        s = prefill_once()
        t0 = time.perf_counter()
        s = jax.block_until_ready(loop_exe(params, s))
        loop_times.append(time.perf_counter() - t0)
        assert int(s.step) == gen_len, "decode loop stopped early"
        del s
    decode_s = statistics.median(loop_times) / (gen_len - 1)
    progress.update()

    # Host overhead: the same steps dispatched one by one from Python, minus the device loop.
    s = prefill_once()
    steps = min(gen_len - 1, 32)
    t0 = time.perf_counter()
    for _ in range(steps):
        s = step_exe(params, s)
    jax.block_until_ready(s)
    python_step_s = (time.perf_counter() - t0) / steps
    progress.update()
    progress.close()

    backend = jax.default_backend()
    context = prompt_len + gen_len // 2
    nbytes = decode_bytes_per_step(config, batch, context, kv_cache_dtype, params)
    bw = hbm_bytes_per_s(jax.devices()[0].device_kind) if backend == "gpu" else None
    peak = None
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        peak = stats["peak_bytes_in_use"] / 1e9
    elif backend == "cpu":  # the process's peak resident memory (Linux: KiB)
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    estimate = None
    if backend == "cpu" and plan.sharding is None:
        estimate = cpu_peak_estimate(model, plan, batch, prompt_len, gen_len,
                                     kv_cache_dtype) / 1e9
    return BenchResult(
        model=name, policy=policy_name, backend=backend, dtype=config.dtype, batch=batch, prompt_len=prompt_len,
        gen_len=gen_len, compile_s=compile_s,
        prefill_tokens_per_s=batch * prompt_len / prefill_s,
        decode_ms_per_token=decode_s * 1e3, decode_tokens_per_s=batch / decode_s,
        host_overhead_ms_per_step=max(python_step_s - decode_s, 0.0) * 1e3,
        bytes_per_step=nbytes, achieved_gb_per_s=nbytes / decode_s / 1e9,
        floor_fraction=(nbytes / bw) / decode_s if bw else None, peak_memory_gb=peak,
        estimated_peak_gb=estimate,
        kv_cache_dtype=kv_cache_dtype or "auto", kv_cache_bytes=s.cache.nbytes(),
        weights=weight_formats(model.params), param_bytes=param_bytes(model.params),
        mesh=_mesh_text(plan.sharding), param_bytes_per_device=_shard_bytes(model.params),
        kv_cache_bytes_per_device=_shard_bytes(s.cache))


def cpu_peak_estimate(model: Model, plan, batch: int, prompt_len: int, gen_len: int,
                      kv_cache_dtype: str | None = None) -> int:
    """memory.cpu_peak_bytes for this bench's load and request: the params as held, a load
    that kept quantized weights in their codes (a GGUF's blocks, or quantized as read)."""
    config = model.config
    held = param_bytes(model.params)
    quantized = weight_formats(model.params) != "dense"
    load = memory.load_parts(config, config.dtype, host_float32_copy=False,
                             stored_bytes=held if quantized else None,
                             blocked=dequant_block_bytes(plan.policy) > 0)
    # as init_state pads them for run(): the prompt to its bucket, prefilled in one shot
    padded = bucket(prompt_len, PROMPT_BUCKETS)
    cache = max(bucket(prompt_len + gen_len, (CACHE_ROUND,)), padded)
    request = memory.request_parts(config, batch, padded, cache, padded, kv_cache_dtype,
                                   quantized=quantized)
    # run() compiles the decode step beside generate's two (the prefill and the decode loop);
    # where the CPU kernel takes the decode rows (KernelPolicy.cpu_quantized_rows) only the
    # prefill holds a layer's dequantization code
    weights = [w for w in jax.tree.leaves(model.params,
                                          is_leaf=lambda a: isinstance(a, QuantizedWeight))
               if isinstance(w, QuantizedWeight)]
    kquants = any(w.super_scale is not None for w in weights)
    kernel = (weights and plan.policy.cpu_quantized_rows >= batch
              and all(cpu_quantized.unfit(w) is None for w in weights))
    return memory.cpu_peak_bytes(config, held, load, request, model.tokenizer is not None,
                                 executables=1 if kernel else 3, kquants=kquants)


def llama_cpp_peer(model: Model, args, ours: BenchResult | None) -> str | None:
    """On a CPU with a GGUF file: llama.cpp's figures on the same file and cores beside ours
    (jaxinfer/llama_cpp_peer.py), or why there are none; None elsewhere (GPU peers are
    benchmarks/ scripts)."""
    from jaxinfer import llama_cpp_peer

    if jax.default_backend() != "cpu" or not str(model.source or "").endswith(".gguf") \
            or args.peer == "none":
        return None
    if llama_cpp_peer.available() is None:
        return ("llama.cpp: llama-cpp-python is not installed (pip install llama-cpp-python "
                "builds it for this machine; then bench runs it on the same file and cores)")
    try:
        r = llama_cpp_peer.measure(model.source, args.prompt_len, args.gen_len, args.repeats)
    except (RuntimeError, OSError, ValueError) as exc:
        return f"llama.cpp: no figures ({exc})"
    if args.json:
        return json.dumps(r)
    return llama_cpp_peer.row_text(r, ours)


def weight_formats(params) -> str:
    """The quantized formats among params' matmul weights ("dense" when none is)."""
    names = sorted({w.name for w in jax.tree.leaves(
        params, is_leaf=lambda a: isinstance(a, QuantizedWeight)) if isinstance(w, QuantizedWeight)})
    return "+".join(names) or "dense"


def compile_row(r: dict) -> str:
    """A compile_only report as one line: what each device holds."""
    per = r["param_bytes_per_device"] + r["kv_cache_bytes_per_device"]
    return (f"{r['model']} ({r['layers']} layers) {r['dtype']} B={r['batch']} ctx={r['context']} on {r['mesh']}: "
            f"compiled in {r['compile_s']:.1f} s; per device {memory.gib(per)} = params "
            f"{memory.gib(r['param_bytes_per_device'])} (of {memory.gib(r['param_bytes'])}) "
            f"+ KV cache {memory.gib(r['kv_cache_bytes_per_device'])} "
            f"(of {memory.gib(r['kv_cache_bytes'])})")


def main(args) -> int:
    dtype = args.dtype or default_dtype()
    kv_cache_dtype = None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    policy = POLICIES[args.policy]()
    if args.steps_per_sync is not None:
        policy = policy.replace(steps_per_sync_no_stop=args.steps_per_sync)
    if getattr(args, "int8_activations", False):
        policy = policy.replace(cpu_int8_activations=True)
    for setting in getattr(args, "policy_field", None) or ():
        policy = policy.with_text(setting)
    mesh = getattr(args, "mesh", None)
    if args.preset and not args.random_weights:
        raise ValueError("--preset needs --random-weights (presets carry shapes, not weights)")
    if getattr(args, "compile_only", False):
        for b in args.batch:
            r = compile_only(args.preset, dtype, b, args.prompt_len, args.gen_len, policy,
                             mesh, args.quantization, args.group_size, kv_cache_dtype,
                             args.num_layers)
            print(json.dumps(r) if args.json else compile_row(r), flush=True)
        return 0
    if args.preset:
        model, name = random_model(args.preset, dtype, policy=policy,
                                   quantization=args.quantization,
                                   group_size=args.group_size, mesh=mesh,
                                   num_layers=args.num_layers), args.preset
    else:
        model, name = load(args.model, dtype=dtype, quantization=args.quantization,
                           policy=policy, group_size=args.group_size, mesh=mesh), args.model
    if getattr(args, "speculative", None) is not None:
        from jaxinfer import speculative_bench

        return speculative_bench.main(args, model, name)
    if getattr(args, "engine", False):
        from jaxinfer.engine import bench as engine_bench

        return engine_bench.main(args, model, name)
    results = []
    print(BenchResult.table_header(), flush=True)
    for b in args.batch:
        r = run(model, name, b, args.prompt_len, args.gen_len, repeats=args.repeats,
                dump_hlo=args.dump_hlo, policy_name=args.policy, kv_cache_dtype=kv_cache_dtype)
        results.append(r)
        print(r.table_row(), flush=True)  # each row as it is measured, once
    if args.json:
        for r in results:
            print(json.dumps(dataclasses.asdict(r)))
    peer = llama_cpp_peer(model, args, next((r for r in results if r.batch == 1), None))
    if peer is not None:
        print(peer, flush=True)
    return 0
