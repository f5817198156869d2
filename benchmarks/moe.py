"""The MoE experts on the GPU, in one run: correctness, then speed, per implementation.

    PYTHONPATH=. python3 benchmarks/moe.py --json out.jsonl [--quick]

For Mixtral-8x7B's experts (D 4096, F 14336, E 8, top-2) and Qwen3-30B-A3B's (D 2048,
F 768, E 128, top-8), bf16, at prefill (B4 T2k = 8192 tokens) and decode (1, 4 and 32
tokens), with real routing (softmax top-k of random router logits):

    ours_ragged      jaxinfer.ops.moe's ragged_dot path: sort by expert, gather the rows, three
                     jax.lax.ragged_dot, weighted scatter-add back (the model's on a GPU
                     before the Pallas kernels)
    ragged_dot_only  the three jax.lax.ragged_dot calls alone, on rows already sorted (prefill)
    dense_loop       a Python loop over the experts: each a dense matmul of its sorted rows
                     (group sizes fixed at trace time)
    gather           jaxinfer.ops.moe's gather path (1 and 4 tokens: the chosen experts'
                     weights taken per token)
    pallas_decode    pallas_kernels.moe_decode: a kernel row per token-expert assignment, the
                     expert indexed inside the kernel (decode shapes; at one token also at
                     other tiles, DECODE_TILES below)
    pallas_grouped   pallas_kernels.moe_grouped: sort and pad by expert (XLA), the grouped
                     SwiGLU and down kernels, the weighted combine (XLA); default tiles
    grouped_only     its two kernels alone, on rows already grouped (the sort's cost apart)
    pallas_grouped_<tiles>   the same at other tiles (prefill shapes; TILES below)
    pallas_decode_<q>,       with --quant int8,int4 (decode shapes): the same kernels on the
    pallas_grouped_<q>       experts quantized per expert (group 128; int4 symmetric), each
                             checked against the float math on its dequantized experts, its
                             TB/s and floor counted on the chosen experts' quantized bytes
                             (codes and scales); quant_err: that reference against the bf16 one

Each is checked against a float32 reference at full precision (relative L2 error); its time
is the median of repeated calls (benchmarks/kernels.py time_fn) rotating over two copies of
the weights, so a decode step cannot hit the L2. Reported: ms, TFLOP/s of the routed work
(N * k * 3 * 2 * D * F), TB/s of the expert bytes actually needed (the distinct chosen
experts' weights: all of them at prefill, only the chosen ones at decode), the fraction of
the floor max(flops / 790 TFLOP/s, bytes / 4.8 TB/s) that the time reaches, and the dense
loop's time over this one (vs_loop > 1: faster than the ceiling). JSON lines, then a table.
--quick: tiny shapes on the CPU, the kernels in interpret mode, one timed call each (checks
that the script runs and every variant meets the reference).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks.kernels import time_fn
from jaxinfer.configs import Config, MoEConfig
from jaxinfer.ops import moe as moe_ops
from jaxinfer.plan import Plan
from jaxinfer.weights import Kind, ParamSpec, param_bytes, quantize_params
from pallas_kernels.moe import default_block_sizes
from pallas_kernels.quantized import dequantize

FLOOR_TFLOPS = 790.0  # H200 bf16 dense
FLOOR_TBS = 4.8  # H200 HBM3e
MODELS = {"mixtral-8x7b": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8)}
QUICK_MODELS = {"tiny-e8k2": (64, 32, 8, 2), "tiny-e16k4": (64, 16, 16, 4)}
TOKENS = {"prefill_b4_t2k": 8192, "decode_1": 1, "decode_4": 4, "decode_32": 32}
QUICK_TOKENS = {"prefill_64": 64, "decode_1": 1, "decode_4": 4}
# Grouped GEMM tiles tried beside the defaults at prefill (block_m, SwiGLU block_n, down
# block_n, block_k, warps, stages).
TILES = {
    "m128n128": pk.MoEBlockSizes(block_m=128, block_n=128, block_n_down=128, block_k=64,
                                 num_warps=8, num_stages=3),
    "m64n128": pk.MoEBlockSizes(block_m=64, block_n=128, block_n_down=128, block_k=64,
                                num_warps=4, num_stages=4),
    "m128k32s4": pk.MoEBlockSizes(block_m=128, block_n=64, block_n_down=128, block_k=32,
                                  num_warps=8, num_stages=4),
}
# The decode kernel's tiles tried beside its defaults at one token (fields changed).
DECODE_TILES = {"n128": {"block_n": 128}, "k256": {"block_k": 256},
                "down128": {"block_n_down": 128}}
QUICK_TILES = {"m16n16": pk.MoEBlockSizes(block_m=16, block_n=16, block_n_down=16, block_k=16,
                                          num_warps=4, num_stages=2)}


def plan_for(d: int, f: int, e: int, k: int) -> Plan:
    config = Config(vocab_size=16, hidden_size=d, intermediate_size=f, num_layers=1,
                    num_heads=1, num_kv_heads=1, head_dim=2, dtype="bfloat16",
                    moe=MoEConfig(num_experts=e, experts_per_token=k, expert_intermediate_size=f,
                                  norm_topk_prob=True))
    return Plan(config)


def _swiglu_down(xs, wg, wu, wd, matmul):
    g, u = matmul(xs, wg), matmul(xs, wu)
    act = (jax.nn.silu(g.astype(xs.dtype)) * u.astype(xs.dtype)).astype(xs.dtype)
    return matmul(act, wd)


def ragged_only(xs, sizes, wg, wu, wd):
    """xs [M, D] sorted by expert, sizes [E] -> [M, D] float32."""
    def mm(a, w):
        return jax.lax.ragged_dot(a, w, sizes, preferred_element_type=jnp.float32)
    return _swiglu_down(xs, wg, wu, wd, mm)


def dense_loop(xs, wg, wu, wd, *, sizes: tuple):
    """The same product as one dense matmul per expert over its rows (sizes static)."""
    outs, start = [], 0
    for j, n in enumerate(sizes):
        if n:
            def mm(a, w, j=j):
                return jnp.dot(a, w[j], preferred_element_type=jnp.float32)
            outs.append(_swiglu_down(xs[start:start + n], wg, wu, wd, mm))
        start += n
    return jnp.concatenate(outs)


@jax.jit
def reference(x, weights, experts, wg, wu, wd):
    """float32 at full precision, independent of the sort: every expert on every token (a
    scan over the experts), weighted by the token's routing weight for it (0 if unchosen)."""
    x32 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    n, e = x32.shape[0], wg.shape[0]
    combine = jnp.zeros((n, e), jnp.float32).at[jnp.arange(n)[:, None], experts].add(weights)

    def one(out, expert):
        g, u, dn, c = expert
        with jax.default_matmul_precision("highest"):
            g = x32 @ g.astype(jnp.float32)
            u = x32 @ u.astype(jnp.float32)
            y = (jax.nn.silu(g) * u) @ dn.astype(jnp.float32)
        return out + c[:, None] * y, None

    out, _ = jax.lax.scan(one, jnp.zeros_like(x32), (wg, wu, wd, combine.T))
    return out


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def random_experts(key, d: int, f: int, e: int):
    """Fan-in scaled normal gate, up [E, D, F] and down [E, F, D] weights in bf16."""
    kg, ku, kd = jax.random.split(key, 3)
    return ((jax.random.normal(kg, (e, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16),
            (jax.random.normal(ku, (e, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16),
            (jax.random.normal(kd, (e, f, d), jnp.float32) / np.sqrt(f)).astype(jnp.bfloat16))


@functools.partial(jax.jit, static_argnums=(1, 2))
def random_x(key, n: int, d: int):
    return jax.random.normal(key, (1, n, d), jnp.float32).astype(jnp.bfloat16)


def quantized_experts(weights, how: str, group: int | None):
    """(gate, up, down) [E, K, N] -> stacked QuantizedWeights, each expert quantized as a
    model's experts are on load (jaxinfer.weights.quantize_params; group None: the largest
    of 128, 64, 32 that divides K)."""
    specs = {n: ParamSpec(tuple(w.shape), ("experts", None, None), kind=Kind.EXPERTS)
             for n, w in zip("gud", weights)}
    q = quantize_params(dict(zip("gud", weights)), how, group, specs)
    return tuple(q[n] for n in "gud")


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float32).reshape(-1), np.asarray(b, np.float32).reshape(-1)
    if not np.all(np.isfinite(a)):
        return float("nan")
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run_case(model: str, dims, tokens_name: str, n: int, quick: bool, rows: list,
             only: tuple = (), quant: tuple = ()):
    d, f, e, k = dims
    plan = plan_for(d, f, e, k)
    rng = np.random.default_rng(0)
    # two copies, so repeated decode calls do not read from the L2
    weights_sets = [random_experts(jax.random.key(c), d, f, e) for c in range(2)]
    xs_in = [random_x(jax.random.key(2 + c), n, d) for c in range(2)]
    logits = jnp.asarray(rng.standard_normal((n, e)).astype(np.float32))
    weights, experts = jax.jit(moe_ops.route, static_argnums=1)(logits, plan.config.moe)
    counts = np.bincount(np.asarray(experts).reshape(-1), minlength=e)
    used = int((counts > 0).sum())
    flops = n * k * 3 * 2 * d * f
    nbytes = used * 3 * d * f * 2 + 2 * n * d * 2  # chosen experts' weights, x in, y out
    shape = f"{model} {tokens_name} N={n} D={d} F={f} E={e} k={k}"
    ref = reference(xs_in[0], weights, experts, *weights_sets[0])

    order = np.argsort(np.asarray(experts).reshape(-1), stable=True)
    token = jnp.asarray(order // k, jnp.int32)
    sorted_x = [x.reshape(n, d)[token] for x in xs_in]
    sizes = jnp.asarray(counts, jnp.int32)

    @jax.jit
    def unsort(y):  # [N * k, D] sorted rows -> [N, D], weighted
        y = y * weights.reshape(-1)[order][:, None]
        return jnp.zeros((n, d), jnp.float32).at[token].add(y)

    interpret = jax.default_backend() == "cpu"
    blocks = default_block_sizes(n, d, f, e, k, decode=False)
    groups = pk.group_by_expert(experts, e, blocks.block_m)
    grouped_x = [x.reshape(n, d)[groups.row_token] for x in xs_in]

    def grouped_only(xs, wg, wu, wd):
        act = pk.grouped_swiglu(xs, groups.tile_experts, wg, wu, interpret=interpret,
                                block_sizes=blocks)
        return pk.grouped_down(act, groups.tile_experts, wd, interpret=interpret,
                               block_sizes=blocks)

    @jax.jit
    def ungroup(y):  # [R, D] grouped rows -> [N, D], weighted
        return jnp.sum(y[groups.dest].reshape(n, k, d) * weights[:, :, None], axis=1)

    def kernel(fn, tiles=None):
        return jax.jit(functools.partial(fn, interpret=interpret, block_sizes=tiles))

    routed = [(x.reshape(n, d), weights, experts, *w) for x, w in zip(xs_in, weights_sets)]
    impls = {
        "pallas_grouped": (kernel(pk.moe_grouped), routed, None),
        "grouped_only": (jax.jit(grouped_only),
                         [(gx, *w) for gx, w in zip(grouped_x, weights_sets)], ungroup),
    }
    decode = tokens_name.startswith("decode")
    if decode:
        impls["pallas_decode"] = (kernel(pk.moe_decode), routed, None)
        if n == 1 and not quick:  # the decode kernel's tiles, one change each
            own = default_block_sizes(n, d, f, e, k, decode=True)
            for name, change in DECODE_TILES.items():
                impls[f"pallas_decode_{name}"] = (
                    kernel(pk.moe_decode, dataclasses.replace(own, **change)), routed, None)
    else:
        for name, tiles in (QUICK_TILES if quick else TILES).items():
            impls[f"pallas_grouped_{name}"] = (kernel(pk.moe_grouped, tiles), routed, None)
    impls.update({
        "ours_ragged": (jax.jit(functools.partial(
            moe_ops.EXPERTS.get("ragged_dot").run, plan=plan)),
            [(x, weights, experts, *w) for x, w in zip(xs_in, weights_sets)], None),
        "dense_loop": (jax.jit(functools.partial(dense_loop, sizes=tuple(int(c) for c in counts))),
                       [(sx, *w) for sx, w in zip(sorted_x, weights_sets)], unsort),
    })
    if not decode:  # at decode it times as ours_ragged (benchmarks/DECISIONS.md)
        impls["ragged_dot_only"] = (
            jax.jit(ragged_only), [(sx, sizes, *w) for sx, w in zip(sorted_x, weights_sets)],
            unsort)
    checks = {}  # impl -> (its reference, its bytes, the quantization's own error)
    for how in quant if decode else ():
        if only and not {f"pallas_decode_{how}", f"pallas_grouped_{how}"} & set(only):
            continue
        q_sets = [quantized_experts(w, how, None if quick else 128) for w in weights_sets]
        q_ref = reference(xs_in[0], weights, experts,
                          *(dequantize(w, jnp.bfloat16) for w in q_sets[0]))
        q_bytes = used * sum(param_bytes(w) for w in q_sets[0]) / e + 2 * n * d * 2
        q_routed = [(x.reshape(n, d), weights, experts, *w) for x, w in zip(xs_in, q_sets)]
        for fn_name, fn in (("decode", pk.moe_decode), ("grouped", pk.moe_grouped)):
            impls[f"pallas_{fn_name}_{how}"] = (kernel(fn), q_routed, None)
            checks[f"pallas_{fn_name}_{how}"] = (q_ref, q_bytes, rel(q_ref, ref))
    if n <= 4:  # 32 tokens' gathered copies took 15.8 ms at Mixtral's shapes
        impls["gather"] = (jax.jit(functools.partial(moe_ops.EXPERTS.get("gather").run,
                                                     plan=plan)),
                           [(x, weights, experts, *w) for x, w in zip(xs_in, weights_sets)],
                           None)
    case_rows = []
    for name, (fn, arg_sets, post) in impls.items():
        if only and name not in only:
            continue
        own_ref, own_bytes, quant_err = checks.get(name, (ref, nbytes, None))
        own_floor = max(flops / (FLOOR_TFLOPS * 1e12), own_bytes / (FLOOR_TBS * 1e12))
        try:
            out = fn(*arg_sets[0])
            err = rel(post(out) if post is not None else out, own_ref)
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*arg_sets[1]))
            guess = time.perf_counter() - t0  # ~0.25 s of calls per repeat
            if quick:  # interpret mode on a CPU: one more call is the time (no chained calls)
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*arg_sets[0]))
                seconds = time.perf_counter() - t0
            else:
                seconds = time_fn(fn, arg_sets, iters=int(min(50, max(3, 0.25 / guess))),
                                  repeats=5)
        except Exception as exc:  # report and go on: one failing path must not hide the rest
            row = dict(shape=shape, impl=name, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            print(json.dumps(row), flush=True)
            rows.append(row)
            continue
        row = dict(model=model, tokens=tokens_name, n=n, d=d, f=f, e=e, k=k, impl=name,
                   experts_read=used, ms=seconds * 1e3, tflops=flops / seconds / 1e12,
                   tbs=own_bytes / seconds / 1e12, floor_fraction=own_floor / seconds,
                   rel_err=err, bytes=own_bytes)
        if quant_err is not None:
            row["quant_err"] = quant_err
        case_rows.append(row)
    loop = next((r["ms"] for r in case_rows if r["impl"] == "dense_loop"), None)
    for row in case_rows:
        row["vs_loop"] = loop / row["ms"] if loop else None
        print(json.dumps(row), flush=True)
        rows.append(row)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the JSON lines here too")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU)")
    parser.add_argument("--models", default=None, help="comma-separated subset of the models")
    parser.add_argument("--tokens", default=None, help="comma-separated subset of the token "
                        "counts (their names: prefill_b4_t2k, decode_1, ...)")
    parser.add_argument("--impls", default=None, help="comma-separated subset of the "
                        "implementations (dense_loop is needed for vs_loop)")
    parser.add_argument("--quant", default="", help="comma-separated weight quantizations "
                        "(int8, int4: group 128) whose Pallas experts also run at the decode "
                        "shapes (pallas_decode_<q>, pallas_grouped_<q>)")
    args = parser.parse_args(argv)
    models = QUICK_MODELS if args.quick else MODELS
    tokens = QUICK_TOKENS if args.quick else TOKENS
    if args.models:
        models = {m: models[m] for m in args.models.split(",")}
    if args.tokens:
        tokens = {t: tokens[t] for t in args.tokens.split(",")}
    only = tuple(args.impls.split(",")) if args.impls else ()
    quant = tuple(q for q in args.quant.split(",") if q)
    if any(q not in ("int8", "int4") for q in quant):
        parser.error(f"--quant {args.quant}: int8 and / or int4")
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    rows: list[dict] = []
    for model, dims in models.items():
        for tokens_name, n in tokens.items():
            run_case(model, dims, tokens_name, n, args.quick, rows, only, quant)
    if args.json:
        with open(args.json, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"\n{'shape':34s} {'impl':26s} {'ms':>9s} {'TFLOP/s':>8s} {'TB/s':>7s} "
          f"{'floor':>6s} {'vs_loop':>7s} {'experts':>7s} {'rel err':>8s}")
    bad = 0
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:34s} {r['impl']:26s} FAILED {r['error'][:80]}")
            bad += 1
            continue
        shape = f"{r['model']} {r['tokens']}"
        vs = f"{r['vs_loop']:7.2f}" if r["vs_loop"] else f"{'':7s}"
        print(f"{shape:34s} {r['impl']:26s} {r['ms']:9.3f} {r['tflops']:8.1f} {r['tbs']:7.3f} "
              f"{r['floor_fraction']:6.1%} {vs} {r['experts_read']:7d} {r['rel_err']:8.1e}"
              + (f" (quantization {r['quant_err']:.1e})" if "quant_err" in r else ""))
        bad += not r["rel_err"] <= 2e-2
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
