"""Test configuration: GPU-marked tests are skipped where no GPU is present."""

import importlib.metadata
import os

# Tests compare float32 logits at 1e-4; keep XLA's CPU matmuls at full precision and quiet.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# `jaxinfer.load` turns on JAX's persistent compilation cache; tests that want it say so
# (tests/test_cli.py), the rest do not write to the user's cache.
os.environ.setdefault("JAXINFER_COMPILATION_CACHE", "0")
# Instead, one JAX compilation cache for the session, in a fresh temporary directory that the
# xdist workers and every process a test starts inherit (set before jax is imported): a
# program another process (or this one, before its programs were dropped: MAX_MAPS) compiled
# with the same HLO, flags and devices loads instead of compiling again. Nothing is read from
# an earlier run; the directory goes when the process that made it exits.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _xla_cache = tempfile.mkdtemp(prefix="jaxinfer-tests-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _xla_cache
    atexit.register(shutil.rmtree, _xla_cache, ignore_errors=True)
# Every program, however quick to compile: JAX's default (1 s) would leave out nearly every
# tiny test program, and 0.1 s still left out ~80% of the compiles (eager ops, samplers,
# small jits: ~10-50 ms each), which the other worker, and this one after MAX_MAPS drops its
# programs, compiled again. Looking a program up costs the same either way (every compile is
# looked up); writing the small ones is a few ms.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def _cuda_plugin_installed() -> bool:
    return any((d.metadata["Name"] or "").lower().startswith("jax-cuda")
               for d in importlib.metadata.distributions())


# Without a GPU, XLA's CPU backend optimizations off (read when jax starts its backends, so
# here; subprocesses inherit it): most CPU test time is compiling tiny models and interpret-mode
# kernels, whose LLVM passes cost more than they save. Not on a GPU host, where the flag would
# slow the compiled kernels that the GPU tests time.
# (A subprocess running the embedded model for many steps takes tests/xla_env.optimized_env.)
from tests.xla_env import FAST_COMPILE_FLAGS  # noqa: E402

_flags = os.environ.get("XLA_FLAGS", "")
# And each program's LLVM code made in one piece, not split across threads: the two workers
# already keep both cores busy (5% less suite time: benchmarks/DECISIONS.md, session 19).
if not _cuda_plugin_installed() and "xla_backend_optimization_level" not in _flags:
    os.environ["XLA_FLAGS"] = " ".join((_flags, *FAST_COMPILE_FLAGS,
                                        "--xla_cpu_parallel_codegen_split_count=1")).strip()

import jax  # noqa: E402
# The first interpret-mode pallas_call imports Pallas' fuser, which registers a config value
# in JAX's trace context: every program traced before (that first kernel program included)
# then misses its cache and compiles again. Registered up front, nothing is compiled twice.
import jax.experimental.pallas.fuser  # noqa: E402,F401
import pytest  # noqa: E402


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


# Each compiled XLA CPU kernel keeps three memory maps of JIT code until its executable is
# dropped. A long test process (an xdist worker runs ~500 tests) reached 44k maps, and past
# vm.max_map_count (65530 by default) the next compile segfaults. Past this many maps, the
# compiled programs are dropped after the test (later tests recompile what they need).
# Measured over a whole run: a worker's maps grow by ~95-98k in all (2 workers), one test adds
# at most ~6k (the speculative warmup with a head), so 52k leaves 13k below the limit (twice
# the largest test's) and one drop per worker: 45k dropped twice (each drop ~5 s unloaded,
# then recompiles of the programs that later tests share).
MAX_MAPS = 52_000


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:  # not Linux: no such limit to keep under
        return 0


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if _memory_maps() > MAX_MAPS:
        import gc
        jax.clear_caches()
        gc.collect()


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (runs on the lent H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_chat():
    """A 2-layer random Llama (float32) with a real tokenizer (a tiny byte-level BPE) and a
    ChatML template: the generation API's behaviour in seconds, where the embedded model's 30
    layers would spend most of the test compiling."""
    import pathlib

    import jax.numpy as jnp
    import numpy as np

    from checkpoints.tokenizer import Tokenizer
    from jaxinfer.configs import Config
    from jaxinfer.model import from_params
    from jaxinfer.models import llama
    from kernel_testing import init_params  # jaxinfer.weights.init_params's bits, fewer compiles

    tokenizer = Tokenizer.from_hf_dir(pathlib.Path(__file__).parent / "fixtures" / "data"
                                      / "tokenizer" / "tiny_hf")
    config = Config(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    max_position_embeddings=512, tie_word_embeddings=True,
                    eos_token_ids=tokenizer.eos_token_ids)
    # Weights 4x the fan-in scale: peaked logits, so greedy text varies instead of looping.
    # (Scaled in numpy: an eager multiply's bits, without a compile per weight shape.)
    params = jax.tree.map(lambda a: jax.device_put(4 * np.asarray(a)) if a.ndim > 1 else a,
                          init_params(llama.param_specs(config), jax.random.key(7), jnp.float32))
    return from_params(config, params, tokenizer, dtype="float32")


@pytest.fixture(scope="session")
def tiny_chat_dir(tiny_chat, tmp_path_factory):
    """`tiny_chat` written as an HF directory (config.json, model.safetensors, the tokenizer
    files), for what takes a path: the CLI, `jaxinfer.load`, other processes. Loading it gives
    tiny_chat's weights exactly."""
    import json
    import pathlib
    import shutil

    import numpy as np
    from safetensors.numpy import save_file

    c, p = tiny_chat.config, tiny_chat.params
    path = tmp_path_factory.mktemp("tiny_chat")
    tok_dir = pathlib.Path(__file__).parent / "fixtures" / "data" / "tokenizer" / "tiny_hf"
    for f in tok_dir.iterdir():
        shutil.copy(f, path / f.name)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "tie_word_embeddings": True, "eos_token_id": list(c.eos_token_ids)}))
    g = c.num_heads // c.num_kv_heads
    tensors = {"model.embed_tokens.weight": p["embed"].w, "model.norm.weight": p["final_norm"]}
    for i, lp in enumerate(p["layers"]):
        w = np.asarray(lp["wqkv"].w)  # [D, Hkv, G + 2, hd]: per KV head its q heads, k, v
        pre = f"model.layers.{i}."
        tensors.update({
            pre + "self_attn.q_proj.weight": w[:, :, :g].reshape(c.hidden_size, -1).T,
            pre + "self_attn.k_proj.weight": w[:, :, g].reshape(c.hidden_size, -1).T,
            pre + "self_attn.v_proj.weight": w[:, :, g + 1].reshape(c.hidden_size, -1).T,
            pre + "self_attn.o_proj.weight": lp["wo"].w.T,
            pre + "mlp.gate_proj.weight": lp["w_gate"].w.T,
            pre + "mlp.up_proj.weight": lp["w_up"].w.T,
            pre + "mlp.down_proj.weight": lp["w_down"].w.T,
            pre + "input_layernorm.weight": lp["attn_norm"],
            pre + "post_attention_layernorm.weight": lp["mlp_norm"]})
    save_file({k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in tensors.items()},
              str(path / "model.safetensors"))
    return path
