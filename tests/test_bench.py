"""`jaxinfer bench` on CPU: runs in CI-sized time and reports what it promises."""

import json

import pytest

from jaxinfer import bench, cli
from jaxinfer.configs import PRESETS


def test_bench_embedded_model_on_cpu(capsys):
    assert cli.main(["bench", "--model", "smollm2-135m-instruct", "--batch", "1", "2",
                     "--prompt-len", "16", "--gen-len", "8", "--repeats", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()
            if line.startswith("{")]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0
        assert r["decode_ms_per_token"] == pytest.approx(1e3 * r["batch"] / r["decode_tokens_per_s"])
        assert r["floor_fraction"] is None  # no bandwidth ceiling is claimed for a CPU
        assert r["bytes_per_step"] > 130e6 * 4  # every float32 weight of a ~135M model, at least


def test_decode_bytes_count_weights_once_and_valid_kv():
    cfg = PRESETS["llama3-8b"]
    one = bench.decode_bytes_per_step(cfg, batch=1, context=0)
    # Llama-3-8B bf16: 15.01 GB read per step (GPU.md), all weights but the embedding table.
    assert one == pytest.approx(15.01e9, rel=2e-3)
    kv_per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, head 128, bf16
    assert bench.decode_bytes_per_step(cfg, 1, 1000) - one == 1000 * kv_per_token
    assert bench.decode_bytes_per_step(cfg, 4, 0) - one == 3 * (4096 * 2 + kv_per_token)


def test_preset_needs_random_weights():
    assert cli.main(["bench", "--preset", "llama3-8b"]) == 2
