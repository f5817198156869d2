"""The quantized KV caches (int8, fp8 e4m3) against the model's dtype: speed, bytes, fidelity.

    PYTHONPATH=. python3 benchmarks/kv_cache.py [--json F]     # the H200: Llama-3-8B shapes
    PYTHONPATH=. python3 benchmarks/kv_cache.py --small        # any CPU, tiny shapes, seconds
    PYTHONPATH=. python3 benchmarks/kv_cache.py --preset deepseek-v2-lite --context 8192
                                            # the MLA latent cache (int8 / fp8 codes + 2 scales)

Part 1: batch-1 decode at a long context (32k) through `jaxinfer bench`'s measurement
(jaxinfer/bench.py: random weights of the preset's shapes), one run per cache dtype in one
process: ms/token, the fraction of the bandwidth floor and the cache's bytes. Part 2: the
embedded model's greedy tokens (4 prompts, 32 new tokens) with each quantized cache beside the
model-dtype cache, and the relative error of the logits along the unquantized run's tokens
(teacher-forced, so one early flip does not hide the rest); where a row's tokens part, the
unquantized logits' gap between the two choices (a near tie is the expected cause). One JSON
line per result (--json: also to a file), then a table.

An MLA preset (DeepSeek) runs the same parts on its latent cache; part 2's model is then the
tiny DeepSeek-V2 test checkpoint (MLA + MoE, random weights: no download), and --small takes
that checkpoint's shapes for part 1 too.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer
from jaxinfer import bench
from jaxinfer.cache import KVCache
from jaxinfer.configs import PRESETS
from jaxinfer.model import Model, default_dtype
from jaxinfer.models import registry
from jaxinfer.plan import Plan
from jaxinfer.prompts import encode
from jaxinfer.weights import init_params

HF_FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "data" / "hf"
FIXTURE = HF_FIXTURES / "llama_gqa_tied_llama3"
MLA_FIXTURE = HF_FIXTURES / "deepseek_v2"  # the tiny checkpoint of MLA presets
PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
           "Explain in one sentence why the sky is blue.", "Name three prime numbers.")


@functools.partial(jax.jit, static_argnames=("plan", "kv_cache_dtype"))
def forced_logits(params, prompt, lengths, new, plan: Plan, kv_cache_dtype: str | None):
    """The logits before each of `new` [B, N] (fed after the right-padded prompt [B, T] of
    lengths [B]): the prefill's at the last prompt token, then one decode step per fed token,
    with a cache of kv_cache_dtype. -> float32 [B, N, V]."""
    forward = registry.family(plan.config).forward
    b, t = prompt.shape
    cache = KVCache.init(plan.config, b, t + new.shape[1], kv_dtype=kv_cache_dtype)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    first, cache = forward(params, prompt, pos, plan, cache, logits_at=lengths - 1, fresh=True)

    def step(cache, i):
        logits, cache = forward(params, new[:, i, None], (lengths + i)[:, None], plan, cache)
        return cache, logits[:, 0]

    _, rest = jax.lax.scan(step, cache, jnp.arange(new.shape[1] - 1))  # [N - 1, B, V]
    return jnp.concatenate([first, jnp.moveaxis(rest, 0, 1)], axis=1)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (one ending first counts), or None."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return min(len(a), len(b)) if i is None and len(a) != len(b) else i


def greedy_fidelity(model: Model, prompts, new_tokens: int, kv_cache_dtype: str) -> dict:
    """Greedy tokens with the quantized cache vs the model-dtype cache, and the logits'
    relative error along the latter's tokens (see the module docstring)."""
    ids = encode(model.tokenizer, list(prompts), None, model.config.vocab_size)
    want = [c.token_ids for c in jaxinfer.generate(model, ids, max_new_tokens=new_tokens)]
    got = [c.token_ids for c in jaxinfer.generate(model, ids, max_new_tokens=new_tokens,
                                                  kv_cache_dtype=kv_cache_dtype)]
    lengths = np.array([len(p) for p in ids], np.int32)
    prompt = np.zeros((len(ids), lengths.max()), np.int32)
    new = np.zeros((len(ids), max(len(w) for w in want)), np.int32)  # rows stopped: padded
    for i, (p, w) in enumerate(zip(ids, want)):
        prompt[i, :len(p)], new[i, :len(w)] = p, w
    args = (model.params, jnp.asarray(prompt), jnp.asarray(lengths), jnp.asarray(new),
            model.plan)
    ref = np.asarray(forced_logits(*args, None), np.float64)  # [B, N, V]
    quant = np.asarray(forced_logits(*args, kv_cache_dtype), np.float64)
    rel = np.linalg.norm(quant - ref, axis=-1) / np.linalg.norm(ref, axis=-1)  # [B, N]
    rel = rel[np.arange(new.shape[1])[None, :] < np.array([len(w) for w in want])[:, None]]
    parts, gaps = [], []
    for row, (g, w) in enumerate(zip(got, want)):
        i = first_difference(g, w)
        parts.append(i)
        if i is not None and i < min(len(g), len(w)):  # the model-dtype logits' margin
            logits = ref[row, i]
            gaps.append(float((logits[w[i]] - logits[g[i]]) / np.abs(logits).max()))
    return {"part": "greedy", "kv_cache_dtype": kv_cache_dtype, "prompts": len(ids),
            "new_tokens": new_tokens, "identical": sum(g == w for g, w in zip(got, want)),
            "first_divergence": parts, "relative_gap_at_divergence": gaps,
            "logits_rel_err_max": float(rel.max()), "logits_rel_err_mean": float(rel.mean())}


def decode_speed(model: Model, name: str, context: int, gen_len: int, repeats: int,
                 kv_cache_dtype: str | None) -> dict:
    """One `jaxinfer bench` run at batch 1 (prompt context - gen_len, then gen_len tokens)."""
    r = bench.run(model, name, 1, context - gen_len, gen_len, repeats=repeats,
                  kv_cache_dtype=kv_cache_dtype)
    return {"part": "decode", "model": name, "kv_cache_dtype": r.kv_cache_dtype,
            "context": context, "decode_ms_per_token": round(r.decode_ms_per_token, 4),
            "kv_cache_bytes": r.kv_cache_bytes, "bytes_per_step": r.bytes_per_step,
            "floor_fraction": r.floor_fraction, "compile_s": round(r.compile_s, 1)}


def small_random_model(config) -> Model:
    """Random weights of a shrunk preset (bench.random_model takes the preset's shapes)."""
    specs = registry.family(config).param_specs(config)
    return Model(config=config, params=init_params(specs, jax.random.key(0), config.dtype))


def table(rows: list[dict]) -> str:
    lines = ["| part | cache | ms/token | cache bytes | vs auto | identical | logits rel err |",
             "|---|---|---|---|---|---|---|"]
    auto = {r["context"]: r for r in rows if r["part"] == "decode"
            and r["kv_cache_dtype"] == "auto"}
    for r in rows:
        if r["part"] == "decode":
            base = auto.get(r["context"])
            ratio = (f"{r['decode_ms_per_token'] / base['decode_ms_per_token']:.3f}x time, "
                     f"{r['kv_cache_bytes'] / base['kv_cache_bytes']:.3f}x bytes") if base else ""
            lines.append(f"| decode {r['model']} ctx {r['context']} | {r['kv_cache_dtype']} | "
                         f"{r['decode_ms_per_token']:.3f} | {r['kv_cache_bytes'] / 2**20:.1f} MiB "
                         f"| {ratio} | | |")
        else:
            lines.append(f"| greedy {r['model']} | {r['kv_cache_dtype']} | | | | "
                         f"{r['identical']}/{r['prompts']} (first divergence "
                         f"{r['first_divergence']}) | max {r['logits_rel_err_max']:.2e}, "
                         f"mean {r['logits_rel_err_mean']:.2e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model", default=None,
                   help="the model of part 2 (greedy fidelity; default smollm2-135m-instruct, "
                        "for an MLA preset or --small a tiny test checkpoint)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--kv-cache-dtypes", default="auto,int8,fp8")
    p.add_argument("--skip", choices=("decode", "greedy"), default=None)
    p.add_argument("--small", action="store_true",
                   help="tiny shapes (a 2-layer preset, a tiny test checkpoint): for a CPU")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the JSON lines here")
    args = p.parse_args(argv)
    kinds = args.kv_cache_dtypes.split(",")
    for kind in kinds:
        if kind not in ("auto", "int8", "fp8"):
            p.error(f"--kv-cache-dtypes takes auto, int8, fp8; got {kind!r}")
    dtype = default_dtype()
    rows = []
    mla = PRESETS[args.preset].mla is not None
    fixture = MLA_FIXTURE if mla else FIXTURE

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    if args.skip != "decode":
        name, context, gen_len = args.preset, args.context, args.gen_len
        if args.small and mla:  # the tiny checkpoint's shapes (MLA and MoE sized together)
            config = jaxinfer.load(str(fixture), dtype=dtype).config
            name, context, gen_len = f"{args.preset} ({fixture.name} shapes)", 256, 16
            model = small_random_model(config)
        elif args.small:
            config = PRESETS[args.preset].replace(
                dtype=dtype, num_layers=2, hidden_size=256, intermediate_size=512, num_heads=4,
                num_kv_heads=2, head_dim=64, vocab_size=512)
            name, context, gen_len = f"{args.preset} (2 layers, small)", 256, 16
            model = small_random_model(config)
        else:
            model = bench.random_model(args.preset, dtype)
        for kind in kinds:
            emit(decode_speed(model, name, context, gen_len, args.repeats,
                              None if kind == "auto" else kind))
        del model
    if args.skip != "greedy":
        source = args.model or (str(fixture) if args.small or mla
                                else "smollm2-135m-instruct")
        model = jaxinfer.load(source, dtype=dtype)
        prompts = PROMPTS
        if model.tokenizer is None:  # the tiny fixture: token-id prompts of four lengths
            rng = np.random.default_rng(0)
            prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (5, 9, 12, 16)]
        new = min(args.new_tokens, model.config.max_position_embeddings - 16)
        for kind in kinds:
            if kind != "auto":
                emit({"model": pathlib.Path(source).name, "dtype": dtype,
                      **greedy_fidelity(model, prompts, new, kind)})
    if args.json:
        pathlib.Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
