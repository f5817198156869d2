"""Where a decode step's time goes: GPU kernel time per kernel name, from a JAX profiler trace.

    PYTHONPATH=. python3 benchmarks/profile_decode.py --preset llama3-8b --batch 1 \
        --prompt-len 128 --steps 32 [--out DIR] [--json FILE]

Runs `steps` decode steps (the jitted while loop, as `jaxinfer bench` times it) under
`jax.profiler.trace`, reads the Perfetto trace it writes, and prints for each kernel name the
GPU time per step, the launches per step and the share of the step; then the sum of kernel time
against the wall time per step (the difference is idle GPU time: launch gaps, host syncs).
Kernel names are XLA fusion names (`fusion.123`, `loop_...`, `input_reduce_...`), cuBLAS
kernels (`*gemv*`, `*gemm*`) and our Pallas kernels (their `name=`); groups fold the numbered
XLA names together.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer
from jaxinfer.bench import random_model
from jaxinfer.generate import decode_loop, init_state, prefill, run_params
from jaxinfer.plan import At, Boundary, Impl, KernelPolicy, Prefetch
from jaxinfer.sampling import SamplingParams
from jaxinfer.speculative_bench import _forward as verification_forward
from pallas_kernels import DecodeBlockSizes, MatmulBlockSizes


def load_trace(log_dir: str) -> dict:
    paths = glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no *.trace.json.gz under {log_dir} (profiler wrote nothing)")
    with gzip.open(max(paths, key=os.path.getmtime), "rt") as f:
        return json.load(f)


def device_kernels(trace: dict) -> list[dict]:
    """Complete events ("ph": "X") on the GPU's stream threads."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pnames = {e["pid"]: e["args"].get("name", "") for e in events
              if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu_pids = {p for p, n in pnames.items() if "GPU" in n or "gpu" in n}
    if not gpu_pids:
        print("process names in the trace:", sorted(set(pnames.values())), file=sys.stderr)
    tnames = {(e["pid"], e["tid"]): e["args"].get("name", "") for e in events
              if e.get("ph") == "M" and e.get("name") == "thread_name"}
    on_gpu = [e for e in events if e.get("ph") == "X" and e["pid"] in gpu_pids]
    # The GPU process also holds XLA-op and module rows; keep the stream (kernel) rows.
    out = [e for e in on_gpu if "stream" in tnames.get((e["pid"], e["tid"]), "").lower()]
    if on_gpu and not out:
        print("GPU thread names:", sorted({tnames.get((e["pid"], e["tid"]), "") for e in on_gpu}),
              file=sys.stderr)
        out = on_gpu
    return out


def group_name(name: str) -> str:
    name = re.sub(r"\.\d+", "", name)  # fusion.123 -> fusion
    name = re.sub(r"_\d+$", "", name)
    return name[:90]


def _timeline(kernels: list[dict], n: int) -> str:
    """n kernels in start order from just before the middle decode attention kernel: start
    (us, from the first one's), duration, the trace's stream (thread) id, name."""
    ordered = sorted(kernels, key=lambda e: e["ts"])
    attn = [i for i, e in enumerate(ordered) if "decode_attention" in e["name"]]
    if not attn:
        return "no decode attention kernel in the trace"
    i0 = max(0, attn[len(attn) // 2] - 2)
    t0 = ordered[i0]["ts"]
    rows = [f"{'start':>8s} {'dur':>7s} {'end':>8s} stream  kernel"]
    for e in ordered[i0:i0 + n]:
        start = float(e["ts"]) - t0
        rows.append(f"{start:8.2f} {float(e['dur']):7.2f} {start + float(e['dur']):8.2f} "
                    f"{e['tid']!s:>6s}  {e['name'][:60]}")
    return "\n".join(rows)


def decode_setup(preset: str, dtype: str, batch: int, prompt_len: int, steps: int, *,
                 policy: KernelPolicy, logprobs: bool = False, quantization: str | None = None,
                 path: str | None = None):
    """(a random-weight model, or the checkpoint at `path`; fresh()): fresh() returns a
    prefilled DecodeState of `batch` fixed random prompts with room for `steps` greedy decode
    steps, no stop ids (as `jaxinfer bench` times the loop); a new one each call, since the
    loop donates it."""
    model = (jaxinfer.load(path, dtype=dtype, quantization=quantization, policy=policy)
             if path else random_model(preset, dtype, policy=policy, quantization=quantization))
    cfg = model.config
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (batch, prompt_len)).tolist()
    greedy = [SamplingParams(temperature=0.0, logprobs=logprobs)] * batch

    def fresh():
        state, tokens, lengths = init_state(model, prompts, steps + 1, greedy, 0, stop_ids=[])
        return jax.block_until_ready(prefill(model.params, tokens, lengths, state, model.plan))

    return model, fresh


def _loop(model, fresh):
    """(prepare, run): run(prepare()) runs `steps` decode steps (the jitted loop) from a fresh
    prefilled state, made by prepare outside the clock."""
    loop = decode_loop.lower(model.params, fresh(), model.plan).compile()
    jax.block_until_ready(loop(model.params, fresh()))  # warm up
    return fresh, lambda s: jax.block_until_ready(loop(model.params, s))


def forwards(model, state, t: int, steps: int):
    """(prepare, run): run(prepare()) runs `steps` jitted model forwards of t tokens per row
    against the state's prefilled cache (positions from each row's length: the slots a
    verification writes), as `jaxinfer bench --speculative` times a verification
    (speculative_bench.verification_cost)."""
    params = run_params(model, model.plan)
    b = state.positions.shape[0]
    tokens = jnp.ones((b, t), jnp.int32)
    positions = state.positions[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
    logits, cache = verification_forward(params, tokens, positions, state.cache, model.plan)
    jax.block_until_ready(logits)  # compiled

    def run(_):
        nonlocal cache
        for _ in range(steps):
            logits, cache = verification_forward(params, tokens, positions, cache, model.plan)
        jax.block_until_ready(logits)
    return (lambda: None), run


def policy_from_args(args) -> KernelPolicy:
    """The policy the options describe (each option one field; benchmarks/README.md)."""
    policy = KernelPolicy.deterministic() if args.policy == "deterministic" else KernelPolicy()
    changes = {}
    if args.boundaries:
        nl, mlp, head = (Boundary[b.upper()] for b in args.boundaries.split(","))
        changes.update(norm_linear_boundary=nl, gated_mlp_boundary=mlp, lm_head_boundary=head)
    for name, spec in json.loads(args.prefetch or "{}").items():
        changes[f"prefetch_{name}"] = None if spec is None else Prefetch(spec[0], At(spec[1]))
    if args.mlp_rows is not None:
        changes["one_kernel_mlp_rows"] = args.mlp_rows
    if args.mosaic_norm_rows is not None:
        changes["mosaic_norm_rows"] = args.mosaic_norm_rows
    if args.lm_head:
        changes["lm_head"] = Impl(args.lm_head)
    if args.blocks:
        changes["matmul_tiles"] = tuple(
            (tuple(int(v) for v in key.split(",")), MatmulBlockSizes(*cfg))
            for key, cfg in json.loads(args.blocks).items())
    if args.attn_blocks:
        changes["attention_blocks"] = DecodeBlockSizes(*json.loads(args.attn_blocks))
    return policy.replace(**changes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="profile this checkpoint (an HF directory or a .gguf file, e.g. "
                        "benchmarks/random_gguf.py's) instead of the preset's random weights")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--dtype", default=None)
    p.add_argument("--out", default=None, help="keep the trace directory here")
    p.add_argument("--json", default=None, help="write the per-kernel table here")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--policy", choices=("default", "deterministic"), default="default")
    p.add_argument("--boundaries", default=None, metavar="NL,MLP,HEAD",
                   help="where the norm_linear, gated_mlp and lm_head boundaries run: xla, "
                        "kernel or consumer each (KernelPolicy.*_boundary)")
    p.add_argument("--prefetch", default=None,
                   help='JSON {"norm_linear": [rows, "start"|"end"] or null, "down": ..., '
                        '"gated_mlp": ...}: the L2 prefetch of each consumer\'s first weight rows '
                        "by its producer (KernelPolicy.prefetch_*)")
    p.add_argument("--mlp-rows", type=int, default=None,
                   help="decode batches of at most this many rows run the MLP as one kernel "
                        "(KernelPolicy.one_kernel_mlp_rows; 0: SwiGLU and down apart)")
    p.add_argument("--mosaic-norm-rows", type=int, default=None,
                   help="decode batches of at most this many rows run the boundary before "
                        "q/k/v in the Mosaic quantized kernel (KernelPolicy.mosaic_norm_rows; "
                        "0: never)")
    p.add_argument("--lm-head", choices=("xla", "pallas"), default=None,
                   help="the LM head through XLA's dot or the fused matmul (KernelPolicy.lm_head)")
    p.add_argument("--blocks", default=None,
                   help='JSON {"K,N,W": [block_m, block_n, block_k, warps, stages, split_k]}: '
                        "block sizes of the fused decode matmuls (W = 1, or 2 for SwiGLU) "
                        "(KernelPolicy.matmul_tiles)")
    p.add_argument("--attn-blocks", default=None,
                   help="JSON [block_k, num_splits or null, warps, stages]: the decode "
                        "attention kernels' block sizes (KernelPolicy.attention_blocks)")
    p.add_argument("--logprobs", action="store_true",
                   help="ask for the tokens' logprobs (a logsumexp over the vocabulary and a "
                        "column write per step; left out of the step otherwise)")
    p.add_argument("--quantization", choices=("none", "int8", "int4", "fp8"), default=None,
                   help="quantize the random weights (as `jaxinfer bench --quantization`)")
    p.add_argument("--tokens", type=int, default=0,
                   help="profile `steps` model forwards of this many tokens per row (a "
                        "speculative verification's T = K + 1; 1: a decode step's forward) "
                        "against the prefilled cache instead of the decode loop: no sampler, "
                        "the same cache slots rewritten by each call")
    p.add_argument("--timeline", type=int, default=0,
                   help="print this many kernels (start, duration, stream) around a decode "
                        "attention kernel in the middle of the run: what overlaps what")
    args = p.parse_args(argv)
    policy = policy_from_args(args)
    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    model, fresh = decode_setup(args.preset, dtype, args.batch, args.prompt_len, args.steps,
                                policy=policy, logprobs=args.logprobs,
                                quantization=args.quantization, path=args.model)
    prepare, run = (forwards(model, fresh(), args.tokens, args.steps) if args.tokens
                    else _loop(model, fresh))
    wall = float("inf")
    for _ in range(3):  # the best of 3 runs (host-side noise in one run reached ~1.5%)
        s = prepare()
        t0 = time.perf_counter()
        run(s)
        wall = min(wall, (time.perf_counter() - t0) / args.steps)

    log_dir = args.out or tempfile.mkdtemp(prefix="jaxinfer-trace-")
    s = prepare()
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        run(s)
    kernels = device_kernels(load_trace(log_dir))
    if not kernels:
        print("no GPU kernel events in the trace", file=sys.stderr)
        return 1
    if args.timeline:
        print(_timeline(kernels, args.timeline))
    total = collections.Counter()
    count = collections.Counter()
    for e in kernels:
        g = group_name(e["name"])
        total[g] += float(e["dur"])  # microseconds
        count[g] += 1
    busy = sum(total.values()) / args.steps
    span = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) / args.steps
    what = f" T={args.tokens} (a step: one forward)" if args.tokens else ""
    print(f"\n{args.model or args.preset} B={args.batch} ctx={args.prompt_len}{what}: wall "
          f"{wall * 1e3:.3f} ms/step (untraced), traced span {span / 1e3:.3f} ms/step, kernel "
          f"time {busy / 1e3:.3f} ms/step, {len(kernels) / args.steps:.1f} kernels/step")
    print(f"{'us/step':>9s} {'n/step':>7s} {'share':>6s}  kernel")
    rows = []
    for g, t in total.most_common():
        rows.append(dict(kernel=g, us_per_step=t / args.steps, n_per_step=count[g] / args.steps))
    for r in rows[: args.top]:
        print(f"{r['us_per_step']:9.1f} {r['n_per_step']:7.1f} {r['us_per_step'] / busy:6.1%}  "
              f"{r['kernel']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(preset=args.preset, batch=args.batch, prompt_len=args.prompt_len,
                           tokens=args.tokens,
                           wall_ms=wall * 1e3, span_ms=span / 1e3, kernel_ms=busy / 1e3,
                           kernels_per_step=len(kernels) / args.steps, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
