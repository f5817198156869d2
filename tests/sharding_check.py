"""The sharding checks on 8 fake CPU devices, run as a subprocess by tests/test_sharding.py.

XLA's host device count is fixed when jax starts, so these run in their own process (the rest of
the suite keeps one CPU device). One process computes every check and prints one JSON object;
the tests assert on it. `python tests/sharding_check.py [check ...]` runs some of them.

    models      per fixture and mesh: logits against the single-device ones, greedy tokens
                (from the same compiled forward; generate itself on GENERATE_CASES),
                per-device parameter bytes
    int4        an int4-quantized model: the same, and its codes sharded like the float weights
    quantized_moe  Mixtral with int8 / int4 experts (stacked QuantizedWeights): the same
    hlo         the compiled decode step: collectives per layer, no all-gather of a weight
    interpret   the Pallas kernels (interpret mode, bf16) under shard_map: logits close to one
                device's, and every pallas_call inside a shard_map
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before jax starts (imported as a module: helpers only)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
    os.environ.setdefault("JAXINFER_COMPILATION_CACHE", "0")

import importlib
import json
import pathlib
import re
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

HF = pathlib.Path(__file__).parent / "fixtures" / "data" / "hf"
FIXTURES = ("llama_gqa_tied_llama3", "qwen2", "mixtral", "deepseek_v3")
MESHES = ({"tp": 4, "dp": 2}, {"tp": 2, "ep": 4}, {"tp": 8})
NEW_TOKENS = 6


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def _logits(model, params, tokens, plan):
    from jaxinfer.model import _full_forward

    return np.asarray(_full_forward(params, jnp.asarray(tokens), plan))


def _prompts(ref) -> list[list[int]]:
    prompt = ref["greedy_prompt"] if "greedy_prompt" in ref else ref["input_ids"][:, :8]
    return [list(map(int, p)) for p in prompt]


def _greedy(params, ref, plan) -> list[list[int]]:
    """NEW_TOKENS greedy tokens per prompt from the full forward at the logits check's shape
    [B, T] (one executable for both): the prompt then the tokens so far, the rest padding that
    causal attention keeps out of the positions read."""
    from jaxinfer.model import _full_forward

    prompts = np.asarray(_prompts(ref), np.int32)  # [B, P]
    b, p = prompts.shape
    buf = np.zeros(ref["input_ids"].shape, np.int32)  # [B, T]
    assert buf.shape[0] == b and p + NEW_TOKENS <= buf.shape[1], (prompts.shape, buf.shape)
    buf[:, :p] = prompts
    for i in range(NEW_TOKENS):
        # the argmax on the host: an eager slice / argmax of the sharded logits would compile
        # a program per mesh
        logits = np.asarray(_full_forward(params, jnp.asarray(buf), plan))  # [B, T, V]
        buf[:, p + i] = logits[:, p + i - 1].argmax(-1)
    return buf[:, p:p + NEW_TOKENS].tolist()


# (fixture, mesh) pairs whose decode loop's optimized HLO the "hlo" results keep
HLO_CASES = (("llama_gqa_tied_llama3", '{"ep": 4, "tp": 2}'),
             ("llama_gqa_tied_llama3", '{"tp": 8}'), ("mixtral", '{"ep": 4, "tp": 2}'))
# (fixture, mesh) pairs whose greedy tokens also come from generate(..., mesh=) (prefill, the
# sharded cache, the decode loop): an MoE and an MLA model on every axis but dp (stream takes
# tp and dp)
GENERATE_CASES = (("mixtral", '{"ep": 4, "tp": 2}'), ("deepseek_v3", '{"ep": 4, "tp": 2}'))
_HLO = {}


def _compare(model, ref, name: str, mesh_kw, host_params) -> dict:
    """One model on one mesh against one device: logits, greedy tokens, bytes per device;
    for GENERATE_CASES generate's tokens; for HLO_CASES the decode loop's optimized HLO.
    host_params: model.params as numpy arrays (placed from the host, device_put slices them
    without compiling a program per weight shape and mesh as resharding a device array does)."""
    from jaxinfer import sharding
    from jaxinfer.models import registry
    from jaxinfer.plan import Plan

    generate = importlib.import_module("jaxinfer.generate")
    mesh = sharding.make_mesh(**mesh_kw)
    plan = Plan(model.config, model.policy, sharding.Sharding.create(mesh, model.config))
    specs = registry.family(model.config).param_specs(model.config)
    params = sharding.shard_params(host_params, specs, plan.sharding)
    key = json.dumps(mesh_kw, sort_keys=True)
    got = {}
    if (name, key) in GENERATE_CASES:
        out = generate.generate(model, _prompts(ref), max_new_tokens=NEW_TOKENS, mesh=mesh)
        got["generate_tokens"] = [c.token_ids for c in out]
    if (name, key) in HLO_CASES:
        req = generate._prepare(model, _prompts(ref), NEW_TOKENS, None, 0, None, None, None,
                                None, None, mesh)
        hlo = generate.decode_loop.lower(req.params, req.state, req.plan).compile().as_text()
        config = model.config
        _HLO[f"{name} {key}"] = {
            "collectives": collectives(hlo), "layers": config.num_layers,
            "moe_layers": sum(config.is_moe_layer(i) for i in range(config.num_layers)),
            "weight_shapes": sorted({str(list(a.shape)) for a in jax.tree.leaves(model.params)
                                     if a.ndim >= 2})}
    per_device = sharding.per_device_bytes(params)
    return {**got, "logits": _logits(model, params, ref["input_ids"], plan),
            "tokens": _greedy(params, ref, plan),
            "bytes_max": max(per_device.values()), "bytes_min": min(per_device.values()),
            "rules": dict(plan.sharding.rules)}


def check_models(names=FIXTURES, meshes=MESHES, quantization=None) -> dict:
    import jaxinfer
    from jaxinfer.plan import KernelPolicy
    from jaxinfer.weights import param_bytes

    results = {}
    for name in names:
        ref = np.load(HF / name / "ref.npz")
        model = jaxinfer.load(str(HF / name), dtype="float32", quantization=quantization,
                              policy=KernelPolicy.reference())
        base = _logits(model, model.params, ref["input_ids"], model.plan)
        entry = {"total_bytes": param_bytes(model.params),
                 "tokens": _greedy(model.params, ref, model.plan),
                 "hf_rel": _rel(base, ref["logits"]), "meshes": {}}
        if "greedy_new" in ref and quantization is None:
            # transformers' greedy tokens (one device's generate gives them: tests/test_moe.py,
            # tests/test_deepseek.py)
            entry["hf_tokens"] = ref["greedy_new"][:, :NEW_TOKENS].tolist()
        host_params = jax.tree.map(np.asarray, model.params)
        for kw in meshes:
            got = _compare(model, ref, name, kw, host_params)
            logits = got.pop("logits")
            got["rel"] = _rel(logits, base)
            got["argmax_equal"] = bool((logits.argmax(-1) == base.argmax(-1)).all())
            entry["meshes"][json.dumps(kw, sort_keys=True)] = got
        results[name] = entry
    return results


def check_int4() -> dict:
    """int4 weights (quantized on load) shard as the float ones: the same results on
    (tp=4, dp=2) as on one device, and the codes split (per-device bytes)."""
    return check_models(names=("llama_gqa_tied_llama3",), meshes=({"tp": 4, "dp": 2},),
                        quantization="int4")


def check_quantized_moe() -> dict:
    """Mixtral's experts quantized on load (stacked QuantizedWeights) on (tp=2, ep=2, dp=2):
    int8 splits down's rows over tp, int4 (one byte row per two tiles: this fixture's F 32
    cannot split) keeps F whole; both give one device's results. "interpret": the int8
    model's prefill and a decode step through the Pallas experts (interpret mode) on
    (tp=2, ep=2), each shard's weights cut to its own K / N, against one device."""
    import jaxinfer
    from jaxinfer.cache import KVCache
    from jaxinfer.models import llama
    from jaxinfer.plan import KernelPolicy, Plan
    from jaxinfer.sharding import Sharding, make_mesh, shard_params

    out = {how: check_models(names=("mixtral",), meshes=({"tp": 2, "ep": 2, "dp": 2},),
                             quantization=how) for how in ("int8", "int4")}
    model = jaxinfer.load(str(HF / "mixtral"), dtype="float32", quantization="int8",
                          group_size=32)
    config = model.config
    ids = jnp.asarray(np.load(HF / "mixtral" / "ref.npz")["input_ids"][:2, :9])
    b, t = 2, 8
    # built on the host: eager iota / broadcast would each compile a program
    pos = jnp.asarray(np.broadcast_to(np.arange(t + 1, dtype=np.int32), (b, t + 1)))

    def run(params, plan, cache):
        logits, cache = llama.forward(params, ids[:, :t], pos[:, :t], plan, cache, fresh=True)
        step, _ = llama.forward(params, ids[:, t:], pos[:, t:], plan, cache)
        return jnp.concatenate([logits, step], axis=1)

    one = jax.jit(run, static_argnums=1)(model.params, Plan(config, KernelPolicy.reference()),
                                         KVCache.init(config, b, 16))
    sharding = Sharding.create(make_mesh(tp=2, ep=2), config)
    plan = Plan(config, KernelPolicy(interpret=True), sharding)
    params = shard_params(jax.tree.map(np.asarray, model.params), llama.param_specs(config),
                          sharding)
    cache = KVCache.init(config, b, 16)
    # one trace for both the jaxpr the pallas_calls are counted in and the executable
    traced = jax.jit(run, static_argnums=1).trace(params, plan, cache)
    found = pallas_calls(traced.jaxpr)
    two = np.asarray(traced.lower().compile()(params, cache))
    one = np.asarray(one)
    out["interpret"] = {"rel": _rel(two, one), "pallas": found,
                        "argmax_equal": bool((one.argmax(-1) == two.argmax(-1)).all())}
    return out


_COLLECTIVE = re.compile(r"= (\S+) (all-reduce|all-gather|all-to-all|reduce-scatter|"
                         r"collective-permute)(?:-start)?\(")


def collectives(hlo: str) -> list[tuple[str, str]]:
    """(kind, result shape) of every collective in an optimized HLO module's text."""
    return [(kind, shape) for shape, kind in _COLLECTIVE.findall(hlo)]


def check_hlo() -> dict:
    """The decode loops' collectives and the weights' global shapes (HLO_CASES; filled in by
    check_models, which compiles them), and a decode step with int4 weights kept quantized
    (as the GPU holds them: XLA dequantizes the codes where the fused kernels are off)."""
    from jaxinfer.model import from_params
    from jaxinfer.models import llama
    from jaxinfer.plan import KernelPolicy
    from jaxinfer.sharding import make_mesh, shard_params
    from kernel_testing import init_params  # the package's bits, fewer compiles

    if not _HLO:
        check_models(names=sorted({n for n, _ in HLO_CASES}))
    out = dict(_HLO)
    generate = importlib.import_module("jaxinfer.generate")
    # K a whole number of int4 byte-row tiles per device (no padding past K): rows can split
    config = _tiny_config(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                          head_dim=64)
    model = from_params(config, init_params(llama.param_specs(config), jax.random.key(0),
                                            jnp.float32), quantization="int4",
                        policy=KernelPolicy.reference())
    req = generate._prepare(model, [[1, 2, 3, 4], [5, 6, 7]], 4, None, 0, None, None, None,
                            None, None, make_mesh(tp=2))
    params = shard_params(jax.tree.map(np.asarray, model.params), llama.param_specs(config),
                          req.plan.sharding)
    hlo = generate.decode_step.lower(params, req.state, req.plan).compile().as_text()
    out["int4 kept quantized"] = {
        "collectives": collectives(hlo), "layers": 2, "hidden": 256, "vocab": 512,
        "w_down rows": str(params["layers"][0]["w_down"].planes[0].sharding.spec[0]),
        "weight_shapes": sorted({str(list(a.shape)) for a in jax.tree.leaves(params)
                                 if a.ndim >= 2})}
    return out


def pallas_calls(jaxpr, inside: bool = False, found: dict | None = None) -> dict:
    """{"inside": n, "outside": m}: the pallas_calls of a jaxpr with and without a shard_map
    around them."""
    found = {"inside": 0, "outside": 0} if found is None else found
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "pallas_call":
            found["inside" if inside else "outside"] += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            pallas_calls(sub, inside or name == "shard_map", found)
    return found


def check_interpret() -> dict:
    """A tiny bf16 Llama with the Pallas kernels in interpret mode, tp=2: prefill (flash
    attention, SwiGLU) and a decode step (decode attention) against one device."""
    from jaxinfer.cache import KVCache
    from jaxinfer.configs import Config
    from jaxinfer.model import from_params
    from jaxinfer.models import llama, registry
    from jaxinfer.plan import KernelPolicy, Plan
    from jaxinfer.sharding import Sharding, make_mesh, shard_params
    from kernel_testing import init_params  # the package's bits, fewer compiles

    config = Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64,
                    dtype="bfloat16")
    params = init_params(llama.param_specs(config), jax.random.key(0), jnp.float32)
    model = from_params(config, params, dtype="bfloat16",
                        policy=KernelPolicy(interpret=True))
    b, t, s = 2, 16, 32
    tokens = jax.random.randint(jax.random.key(1), (b, t + 1), 0, config.vocab_size)
    pos = jnp.asarray(np.broadcast_to(np.arange(t + 1, dtype=np.int32), (b, t + 1)))
    forward = registry.family(config).forward

    def run(params, plan, cache):
        logits, cache = forward(params, tokens[:, :t], pos[:, :t], plan, cache, fresh=True)
        step, _ = forward(params, tokens[:, t:], pos[:, t:], plan, cache)
        return jnp.concatenate([logits, step], axis=1)

    # one device with the jnp references: the same sums up to bf16 rounding, and one
    # interpret-mode compile fewer
    reference = Plan(config, KernelPolicy.reference())
    one = jax.jit(run, static_argnums=1)(model.params, reference, KVCache.init(config, b, s))
    sharding = Sharding.create(make_mesh(tp=2), config)
    plan = Plan(config, model.policy, sharding)
    params = shard_params(jax.tree.map(np.asarray, model.params), llama.param_specs(config),
                          sharding)
    cache = KVCache.init(config, b, s)
    # one trace for both the jaxpr the pallas_calls are counted in and the executable
    traced = jax.jit(run, static_argnums=1).trace(params, plan, cache)
    found = pallas_calls(traced.jaxpr)
    two = traced.lower().compile()(params, cache)
    one, two = np.asarray(one, np.float32), np.asarray(two, np.float32)
    return {"rel": _rel(two, one), "argmax_agree": float((one.argmax(-1) == two.argmax(-1))
                                                         .mean()), "pallas": found}


def _tiny_config(**changes):
    from jaxinfer.configs import Config

    return Config(**{"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                     "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                     "max_position_embeddings": 64, **changes})


def _moe_config():
    from jaxinfer.configs import MoEConfig

    return _tiny_config(moe=MoEConfig(num_experts=4, experts_per_token=2,
                                      expert_intermediate_size=32))


def check_errors() -> dict:
    """The message of each bad mesh (ValueError expected)."""
    import jaxinfer
    from jaxinfer.model import from_params
    from jaxinfer.models import llama
    from jaxinfer.sharding import Sharding, check_mesh, make_mesh
    from kernel_testing import init_params  # the package's bits, fewer compiles

    config = _tiny_config()
    model = from_params(config, init_params(llama.param_specs(config), jax.random.key(0),
                                            jnp.float32))
    cases = {
        "mesh_too_large": lambda: make_mesh(tp=16),
        "tp_heads": lambda: Sharding.create(make_mesh(tp=3), config),
        "ep_experts": lambda: Sharding.create(make_mesh(ep=3), _moe_config()),
        "foreign_axes": lambda: check_mesh(config, jax.make_mesh((2,), ("x",))),
        "generate_tp_heads": lambda: jaxinfer.generate(model, [[1, 2]], max_new_tokens=2,
                                                       mesh=make_mesh(tp=3)),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


def check_rules() -> dict:
    """Resolved rules for a few meshes, a declared parameter's spec and the KV cache's."""
    from jaxinfer.cache import KVCache
    from jaxinfer.models import llama
    from jaxinfer.sharding import Sharding, cache_shardings, make_mesh, spec_for

    config = _tiny_config()
    out = {f"llama {k}={v}": dict(Sharding.create(make_mesh(**{k: v}), config).rules)
           for k, v in (("tp", 2), ("tp", 8), ("dp", 2))}
    out["mixtral ep=4"] = dict(Sharding.create(make_mesh(ep=4), _moe_config()).rules)
    tp2 = Sharding.create(make_mesh(tp=2), config)
    out["wqkv tp=2"] = list(spec_for(llama.param_specs(config)["layers"][0]["wqkv"], tp2))
    cache = jax.eval_shape(lambda: KVCache.init(config, 4, 32))
    tp2dp4 = Sharding.create(make_mesh(tp=2, dp=4), config)
    out["kv cache tp=2 dp=4"] = list(cache_shardings(cache, tp2dp4).k[0].spec)
    return out


def check_stream() -> dict:
    """stream(..., mesh=) against generate(..., mesh=) on tp=2, dp=2: a 2-layer random Llama
    with the tiny byte-level tokenizer (the suite's tiny_chat)."""
    import jaxinfer
    from checkpoints.tokenizer import Tokenizer
    from jaxinfer.model import from_params
    from jaxinfer.models import llama
    from jaxinfer.sharding import make_mesh
    from kernel_testing import init_params  # the package's bits, fewer compiles

    tokenizer = Tokenizer.from_hf_dir(HF.parent / "tokenizer" / "tiny_hf")
    config = _tiny_config(vocab_size=tokenizer.vocab_size, num_layers=2,
                          tie_word_embeddings=True, eos_token_ids=tokenizer.eos_token_ids)
    params = init_params(llama.param_specs(config), jax.random.key(7), jnp.float32)
    params = jax.tree.map(lambda a: 4 * a if a.ndim > 1 else a, params)  # peaked logits
    model = from_params(config, params, tokenizer, dtype="float32")
    mesh = make_mesh(tp=2, dp=2)
    (whole,) = jaxinfer.generate(model, ["Hello there"], max_new_tokens=12, mesh=mesh)
    pieces = jaxinfer.stream(model, "Hello there", max_new_tokens=12, mesh=mesh)
    text = "".join(pieces)
    return {"generate": whole.token_ids, "stream": pieces.completion.token_ids,
            "text_equal": text == whole.text}


CHECKS = {"errors": check_errors, "stream": check_stream, "rules": check_rules, "models": check_models,
          "int4": check_int4, "quantized_moe": check_quantized_moe, "hlo": check_hlo,
          "interpret": check_interpret}


def main(names: list[str]) -> None:
    out = {name: CHECKS[name]() for name in (names or CHECKS)}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
