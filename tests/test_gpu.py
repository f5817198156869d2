"""On the GPU (kernels wired in) the model gives the reference path's greedy tokens.

The reference runs in a subprocess pinned to the CPU (JAX_PLATFORMS=cpu), where the model
uses the pure-jnp references. Both run bfloat16 (the kernels serve 16-bit activations) with
float32 accumulation, so they differ only in summation order.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import jaxinfer

HF = pathlib.Path(__file__).parent / "fixtures" / "data" / "hf"
VARIANTS = sorted(p.name for p in HF.iterdir() if (p / "ref.npz").exists())
# Variants whose shapes take every kernel path (flash, decode, SwiGLU: power-of-two head dims,
# no MLP biases): MHA, GQA with tied embeddings, qkv bias, q/k norm. Few, to keep compiles short.
KERNEL_VARIANTS = ["llama_mha_untied", "llama_gqa_tied_llama3", "qwen2", "qwen3"]
NEW_TOKENS = 24

GREEDY_SCRIPT = """
import json, sys, pathlib, numpy as np, jaxinfer
out = {}
for name in sys.argv[2:]:
    model = jaxinfer.load(str(pathlib.Path(sys.argv[1]) / name), dtype="bfloat16")
    prompts = np.load(pathlib.Path(sys.argv[1]) / name / "ref.npz")["input_ids"][:, :12].tolist()
    n = min(%d, model.config.max_position_embeddings - 12)
    res = jaxinfer.generate(model, prompts, max_new_tokens=n)
    out[name] = [c.token_ids for c in res]
print(json.dumps(out))
""" % NEW_TOKENS


def greedy_on_cpu(names):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", GREEDY_SCRIPT, str(HF), *names], env=env,
                         capture_output=True, text=True, cwd=pathlib.Path(__file__).parent.parent)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_kernels_give_the_reference_greedy_tokens():
    import jax

    assert jax.default_backend() == "gpu"
    want = greedy_on_cpu(KERNEL_VARIANTS)
    for name in KERNEL_VARIANTS:
        model = jaxinfer.load(str(HF / name), dtype="bfloat16")
        prompts = np.load(HF / name / "ref.npz")["input_ids"][:, :12].tolist()
        n = min(NEW_TOKENS, model.config.max_position_embeddings - 12)
        got = [c.token_ids for c in jaxinfer.generate(model, prompts, max_new_tokens=n)]
        assert got == want[name], name


@pytest.mark.gpu
def test_bf16_logits_on_gpu_match_transformers():
    for name in VARIANTS:
        ref = np.load(HF / name / "ref.npz")
        model = jaxinfer.load(str(HF / name), dtype="bfloat16")
        logits = np.asarray(model(ref["input_ids"]))
        rel = np.linalg.norm(logits - ref["logits"]) / np.linalg.norm(ref["logits"])
        assert rel < 3e-2, (name, rel)
