"""`jaxinfer.load(..., mesh=)`: every tensor on its declared shards as it is read.

XLA's host device count is fixed when jax starts, so the multi-device checks run once, in one
subprocess with 8 fake CPU devices: this file run as a script (`python
tests/test_sharded_load.py` prints one JSON object), which also runs
examples/sharded_generate.py and `jaxinfer bench --compile-only` for a 70B preset. The tests
assert on its report.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
HF = ROOT / "tests" / "fixtures" / "data" / "hf"
GGUF = ROOT / "tests" / "fixtures" / "data" / "gguf"
DEVICES = 8


# ------------------------------------------------------------------ the subprocess's checks


def _compare(src: str, mesh_kw: dict, one=None, **load_kw) -> dict:
    """One checkpoint loaded on one device (or `one`, loaded so already) and onto a mesh:
    shardings, values, bytes."""
    import jax
    import numpy as np

    import jaxinfer
    from jaxinfer.models import registry
    from jaxinfer.sharding import make_mesh, param_shardings, per_device_bytes
    from jaxinfer.weights import param_bytes

    one = one or jaxinfer.load(src, **load_kw)
    model = jaxinfer.load(src, mesh=make_mesh(**mesh_kw), **load_kw)
    specs = registry.family(model.config).param_specs(model.config)
    leaves = jax.tree.leaves(model.params)
    declared = jax.tree.leaves(param_shardings(specs, model.sharding, model.params))
    per = per_device_bytes(model.params)
    wqkv = model.params["layers"][0]["wqkv"]
    return {
        "same_structure": jax.tree.structure(one.params) == jax.tree.structure(model.params),
        "declared": len(leaves) == len(declared) and all(
            a.sharding.is_equivalent_to(s, a.ndim) for a, s in zip(leaves, declared)),
        "equal": all(a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
                     for a, b in zip(jax.tree.leaves(one.params), leaves)),
        "weight": type(wqkv).__name__,
        "wqkv_spec": str(jax.tree.leaves(wqkv)[0].sharding.spec),
        "plan_has_sharding": model.plan.sharding is model.sharding is not None,
        "per_device": max(per.values()), "devices": len(per),
        "total": param_bytes(model.params), "tp": mesh_kw.get("tp", 1),
    }


def _slice_reads(src: str, tp: int) -> dict:
    """Elements of lm_head.weight read per call during a load at tp: each device's shard, once."""
    from unittest import mock

    import jaxinfer
    from checkpoints import hf
    from jaxinfer.sharding import make_mesh

    reads = []
    real = hf.TensorSlices.__getitem__

    def counting(self, index):
        out = real(self, index)
        if self.name == "lm_head.weight":
            reads.append(int(out.size))
        return out

    with mock.patch.object(hf.TensorSlices, "__getitem__", counting):
        model = jaxinfer.load(src, mesh=make_mesh(tp=tp, dp=DEVICES // tp))
    return {"reads": reads, "size": int(model.params["lm_head"].w.size)}


def _refusals(src: str, gguf: str) -> dict:
    """Bad meshes and a mesh too small for the model: the error, and how many tensors were
    read before it (every reader of the loaders counts)."""
    from unittest import mock

    import jaxinfer
    from checkpoints import gguf as gguf_reader
    from checkpoints import hf, quantized
    from jaxinfer import memory
    from jaxinfer.sharding import make_mesh

    reads = []

    def reader(real):
        def counted(*args, **kwargs):
            reads.append(real.__name__)
            return real(*args, **kwargs)
        return counted

    out = {}
    patches = [mock.patch.object(hf, "LazyTensors", reader(hf.LazyTensors)),
               mock.patch.object(hf, "read_safetensors", reader(hf.read_safetensors)),
               mock.patch.object(quantized, "load_quantized", reader(quantized.load_quantized)),
               mock.patch.object(gguf_reader, "params_from_reader",
                                 reader(gguf_reader.params_from_reader))]
    cases = {"tp_3": (src, {"tp": 3}), "gguf_tp_3": (gguf, {"tp": 3}),
             "ep_3_of_4_experts": (str(HF / "mixtral"), {"ep": 3}),
             "mesh_too_large": (src, {"tp": 16})}
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        for name, (path, mesh_kw) in cases.items():
            reads.clear()
            try:
                jaxinfer.load(path, mesh=make_mesh(**mesh_kw))
                out[name] = {"error": None}
            except ValueError as e:
                out[name] = {"error": str(e)}
            out[name]["reads"] = len(reads)
        # A limit each device's share fits but the whole model does not: the mesh loads,
        # one device is refused; below the share, the mesh is refused too.
        total = memory.params_bytes(jaxinfer.load(src).config, "float32")
        with mock.patch.dict(os.environ, {"JAXINFER_MEMORY_LIMIT": str(int(0.6 * total))}):
            reads.clear()
            jaxinfer.load(src, mesh=make_mesh(tp=4, dp=2))
            out["fits_per_device"] = {"reads": len(reads)}
            try:
                jaxinfer.load(src)
                out["one_device_at_that_limit"] = {"error": None}
            except memory.OutOfMemory as e:
                out["one_device_at_that_limit"] = {"error": str(e)}
        with mock.patch.dict(os.environ, {"JAXINFER_MEMORY_LIMIT": str(int(0.1 * total))}):
            reads.clear()
            try:
                jaxinfer.load(src, mesh=make_mesh(tp=4, dp=2))
                out["too_large_for_the_mesh"] = {"error": None}
            except memory.OutOfMemory as e:
                out["too_large_for_the_mesh"] = {"error": str(e)}
            out["too_large_for_the_mesh"]["reads"] = len(reads)
    return out


def _bench_70b() -> dict:
    """`jaxinfer bench --preset llama3-70b --random-weights --tp 8 --compile-only` at batch
    32, 8k context (one layer compiled: every op, in seconds), and the whole model's share of
    each device from its declaration."""
    from jaxinfer import cli
    from jaxinfer.configs import PRESETS
    from jaxinfer.models import registry
    from jaxinfer.sharding import Sharding, make_mesh
    from jaxinfer.weights import declared_bytes_per_device

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["bench", "--preset", "llama3-70b", "--random-weights", "--tp", "8",
                         "--compile-only", "--num-layers", "1", "--batch", "32",
                         "--prompt-len", "64", "--gen-len", "8128", "--dtype", "bfloat16",
                         "--json"])
    config = PRESETS["llama3-70b"]
    specs = registry.family(config).param_specs(config)
    whole = declared_bytes_per_device(specs, Sharding.create(make_mesh(tp=8), config), "bfloat16")
    return {"code": code, "report": json.loads(out.getvalue().strip().splitlines()[-1]),
            "params_per_device_80_layers": whole}


def _example(src: str) -> dict:
    """examples/sharded_generate.py as a user runs it, against one device's greedy tokens."""
    import re
    import runpy

    import jaxinfer

    out = io.StringIO()
    argv = sys.argv
    sys.argv = ["sharded_generate.py", src, "--tp", "4", "--dp", "2", "-n", "6"]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(ROOT / "examples" / "sharded_generate.py"), run_name="__main__")
    finally:
        sys.argv = argv
    tokens = [json.loads(m) for m in re.findall(r"tokens (\[[0-9, ]*\])", out.getvalue())]
    ref = jaxinfer.generate(jaxinfer.load(src), [[1, 2, 3, 4, 5], [6, 7, 8]], max_new_tokens=6)
    return {"output": out.getvalue(), "tokens": tokens, "one_device": [c.token_ids for c in ref]}


def run_checks() -> dict:
    import tempfile

    import jax

    import jaxinfer
    from checkpoints.quantized import save_quantized

    untied = str(HF / "llama_mha_untied")  # 4 KV heads: tp=4 splits them
    gguf, bf16 = str(GGUF / "tiny-q8_0.gguf"), str(HF / "llama_bf16")
    int4 = jaxinfer.load(bf16, quantization="int4")
    with tempfile.TemporaryDirectory() as tmp:  # a `jaxinfer quantize` output
        quantized = save_quantized(f"{tmp}/int4", int4.params, bf16)
        quantized_dir = _compare(str(quantized), {"tp": 2, "dp": 4})
    return {
        "devices": jax.device_count(),
        "hf": _compare(untied, {"tp": 4, "dp": 2}),
        "bf16": _compare(untied, {"tp": 4, "dp": 2}, dtype="bfloat16"),
        "gguf": _compare(gguf, {"tp": 2, "dp": 4}),
        "gguf_none": _compare(gguf, {"tp": 2, "dp": 4}, quantization="none"),
        "int4": _compare(bf16, {"tp": 2, "dp": 4}, one=int4, quantization="int4"),
        "quantized_dir": quantized_dir,
        "moe": _compare(str(HF / "mixtral"), {"tp": 2, "ep": 4}),
        "slices": _slice_reads(untied, 4),
        "refusals": _refusals(untied, str(GGUF / "tiny-q8_0.gguf")),
        "bench": _bench_70b(),
        "example": _example(untied),
    }


# ------------------------------------------------------------------------------ the tests


@pytest.fixture(scope="module")
def report():
    # XLA's backend optimizations off: the checks compare values and read compiled sizes, and
    # LLVM's passes were most of the compile time (the 70B layer, the example's generate)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXINFER_COMPILATION_CACHE": "0",
           "JAX_DEFAULT_MATMUL_PRECISION": "highest",
           "XLA_FLAGS": "--xla_backend_optimization_level=0 "
                        "--xla_llvm_disable_expensive_passes=true"}
    env.pop("JAXINFER_MEMORY_LIMIT", None)
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case, weight, tp", [
    ("hf", "Dense", 4),  # float32 safetensors
    ("bf16", "Dense", 4),  # cast to bfloat16 shard by shard
    ("gguf", "QuantizedWeight", 2),  # Q8_0 blocks kept
    ("gguf_none", "Dense", 2),  # dequantized
    ("int4", "QuantizedWeight", 2),  # quantized as read
    ("quantized_dir", "QuantizedWeight", 2),  # `jaxinfer quantize` output
    ("moe", "Dense", None),  # Mixtral: experts over ep=4, attention over tp=2
])
def test_every_tensor_is_on_its_declared_shards_with_one_device_values(report, case, weight,
                                                                          tp):
    r = report[case]
    assert report["devices"] == DEVICES and r["devices"] == DEVICES
    assert r["same_structure"] and r["declared"] and r["equal"] and r["plan_has_sharding"]
    assert r["wqkv_spec"].startswith("P(None, 'tp'")  # its KV heads (codes: columns) over tp
    assert r["weight"] == weight
    if tp is not None:  # each device ~1/tp (the norms, a few hundred bytes here, on all;
        # int4 codes of K=64 rows fill one kernel tile, which a device holds whole, so the
        # row-split weights (wo, w_down) are whole there: up to 1/4 of the bytes)
        slack = 1.25 if case in ("int4", "quantized_dir") else 1.05
        assert r["total"] / tp <= r["per_device"] <= slack * r["total"] / tp


def test_a_tensor_is_read_by_the_slices_its_devices_hold(report):
    r = report["slices"]
    assert r["reads"] == [r["size"] // 4] * 4  # four shards, each read once (dp shares them)


@pytest.mark.parametrize("case, match", [
    ("tp_3", "tp=3 neither divides the model's 4 attention heads"),
    ("gguf_tp_3", "tp=3 neither divides"),
    ("ep_3_of_4_experts", "ep=3 does not divide the model's 4 experts"),
    ("mesh_too_large", "16 devices, but only 8 cpu devices"),
    ("too_large_for_the_mesh", "per device"),
])
def test_bad_meshes_and_memory_are_refused_before_any_tensor_is_read(report, case, match):
    r = report["refusals"][case]
    assert r["error"] is not None and match in r["error"], r
    assert r["reads"] == 0


def test_the_memory_check_compares_each_devices_share(report):
    r = report["refusals"]
    assert r["fits_per_device"]["reads"] > 0  # the mesh's shares fit: it loaded
    assert "loading this model" in r["one_device_at_that_limit"]["error"]
    assert "on 8 devices (tp=4, dp=2)" in r["too_large_for_the_mesh"]["error"]


def test_70b_compiles_on_8_fake_devices_and_reports_each_devices_memory(report):
    r = report["bench"]
    assert r["code"] == 0
    b = r["report"]
    assert b["mesh"] == "8 devices (tp=8)" and b["batch"] == 32 and b["context"] == 8192
    # one layer: the weights and the cache (8 KV heads) split eight ways, norms replicated
    assert b["param_bytes"] / 8 <= b["param_bytes_per_device"] <= 1.01 * b["param_bytes"] / 8
    kv_layer = 2 * 32 * 8192 * 8 * 128 * 2  # K and V, batch 32, 8192 slots, bf16
    assert b["kv_cache_bytes_per_device"] - kv_layer // 8 < 1024  # + the lengths [B]
    # the whole 80-layer model: 141 GB of bf16 weights, ~17.6 GB on each of 8 devices
    assert 17.5e9 < r["params_per_device_80_layers"] < 17.8e9


def test_the_example_generates_what_one_device_does(report):
    r = report["example"]
    assert "on 8 devices (tp=4, dp=2)" in r["output"], r["output"]
    assert "(64, 1, 3, 16) per device" in r["output"]  # 4 KV heads over tp=4
    assert r["tokens"] == r["one_device"] and len(r["tokens"]) == 2


if __name__ == "__main__":
    # before jax starts (it is imported only by the checks): 8 CPU devices
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={DEVICES}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAXINFER_COMPILATION_CACHE", "0")
    sys.path.insert(0, str(ROOT))
    print(json.dumps(run_checks()))
