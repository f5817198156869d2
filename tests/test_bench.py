"""`jaxinfer bench` on CPU: runs in CI-sized time and reports what it promises."""

import json
import pathlib
import weakref

import pytest

from jaxinfer import bench, cli
from jaxinfer.engine import bench as engine_bench
from jaxinfer.configs import PRESETS
from jaxinfer.model import load

HF = pathlib.Path(__file__).parent / "fixtures" / "data" / "hf"


def test_bench_a_checkpoint_on_cpu(tiny_chat_dir, capsys, monkeypatch):
    """Bench reports its figures for a checkpoint on CPU (no floor there; the floor's
    bandwidth is the card's), and each timing makes its state with no earlier one alive (two
    KV caches of a B=64 2k batch would not fit the 80 GB card where one does). The checkpoint
    and shapes are test_cli's bench test's (an HF directory in float32; prompts of 16 and
    outputs of 64 padded, batches 1 and 2): the same programs, compiled once in the session."""
    import jax

    live = []  # bytes of live arrays as each state is made

    def fitting_state(*args, **kw):
        live.append(sum(a.nbytes for a in jax.live_arrays()))
        return fitting(*args, **kw)
    fitting = bench.fitting_state
    monkeypatch.setattr(bench, "fitting_state", fitting_state)
    model = str(tiny_chat_dir)
    assert cli.main(["bench", "--model", model, "--batch", "1", "2", "--prompt-len", "16",
                     "--gen-len", "8", "--repeats", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()
            if line.startswith("{")]
    assert [r["batch"] for r in rows] == [1, 2]
    config = load(model, dtype="float32").config
    for r in rows:
        assert r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0
        assert r["decode_ms_per_token"] == pytest.approx(1e3 * r["batch"] / r["decode_tokens_per_s"])
        assert r["floor_fraction"] is None  # no bandwidth ceiling is claimed for a CPU
        assert r["policy"] == "default"
        # every float32 weight (the tied head reads the embedding table whole), at least
        assert r["bytes_per_step"] >= 4 * config.num_params()
    assert len(live) == 2 * 4  # per batch: compile, prefill, decode loop, host overhead
    assert max(live) - min(live) < min(r["kv_cache_bytes"] for r in rows) / 2
    assert [bench.hbm_bytes_per_s(f"NVIDIA {card}") for card in (
        "H100 80GB HBM3", "H200", "H100 PCIe", "A100-SXM4-80GB")] == [3.0e12, 4.27e12, None, None]


def test_bench_prefills_in_chunks_where_one_shot_would_not_fit(tiny_chat_dir, capsys,
                                                               monkeypatch):
    """A batch whose one-shot prefill would not fit (JAXINFER_MEMORY_LIMIT at what chunks of
    256 need) is benched with its prompts in chunks, as generate runs it, not refused."""
    from jaxinfer import memory

    model = load(str(tiny_chat_dir))

    def need(chunk):  # 2 prompts of 300 tokens padded to 512, a cache of 512 slots
        return sum(memory.request_parts(model.config, 2, 512, 512, chunk).values())
    assert need(256) < need(512)
    monkeypatch.setenv("JAXINFER_MEMORY_LIMIT", str(need(256)))
    args = ["bench", "--model", str(tiny_chat_dir), "--batch", "2", "--prompt-len", "300",
            "--gen-len", "4", "--repeats", "1", "--json"]
    assert cli.main(args) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()
              if line.startswith("{")]
    assert row["prefill_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0
    monkeypatch.setenv("JAXINFER_MEMORY_LIMIT", str(need(256) - 1))  # no chunk fits: refused
    assert cli.main(args) != 0
    assert "needs about" in capsys.readouterr().err


def test_bench_engine_replays_a_trace_on_an_mla_model(capsys, monkeypatch):
    """`jaxinfer bench --engine` on DeepSeek-V3's fixture (latent pages; a 64-token context:
    the shared-prompt TTFT's system prompt shrinks to fit): the trace's tokens all come out,
    and the static batches and the shared-prefix TTFT are reported, the prefix cache hit.
    Each engine is gone before the next one takes its pages (on a GPU two pools of the
    default size do not fit)."""
    made = []

    class Engine(engine_bench.Engine):
        def __init__(self, *args, **kwargs):
            assert not [e for e in made if e() is not None], "an earlier engine is alive"
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(engine_bench, "Engine", Engine)
    assert cli.main(["bench", "--engine", "--model", str(HF / "deepseek_v3"), "--dtype",
                     "float32", "--requests", "4", "--rate", "50", "--prompt-lens", "8", "24",
                     "--output-lens", "4", "8", "--shared-len", "8", "--batch", "2",
                     "--json"]) == 0
    out = capsys.readouterr().out.splitlines()
    result = json.loads(out[-1])
    assert result["trace"]["requests"] == 4 and result["trace"]["output_tokens"] >= 16
    assert result["static"]["output_tokens"] == result["trace"]["output_tokens"]
    shared = result["shared_prefix"]
    assert shared["system_len"] == 48 and shared["on"]["hit_rate"] > 0.5
    assert shared["off"]["hit_rate"] == 0
    assert any(line.startswith("TTFT with a 48-token shared system prompt") for line in out)
    assert len(made) == 3


def test_decode_bytes_count_weights_once_and_valid_kv():
    cfg = PRESETS["llama3-8b"]
    one = bench.decode_bytes_per_step(cfg, batch=1, context=0)
    # Llama-3-8B bf16: 15.01 GB read per step, all weights but the embedding table.
    assert one == pytest.approx(15.01e9, rel=2e-3)
    kv_per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, head 128, bf16
    assert bench.decode_bytes_per_step(cfg, 1, 1000) - one == 1000 * kv_per_token
    assert bench.decode_bytes_per_step(cfg, 4, 0) - one == 3 * (4096 * 2 + kv_per_token)


def test_preset_needs_random_weights():
    assert cli.main(["bench", "--preset", "llama3-8b"]) == 2


def test_compare_peer_puts_ours_beside_the_peer(tmp_path, capsys):
    from benchmarks import compare_peer

    def run(batch, ms, **extra):
        return dict(model="llama3-8b", batch=batch, prompt_len=128, gen_len=256,
                    decode_ms_per_token=ms, decode_tokens_per_s=1e3 * batch / ms, **extra)

    ours = tmp_path / "ours.jsonl"
    ours.write_text("llama3-8b  B=1  a table row\n"
                    + json.dumps(run(1, 4.0, floor_fraction=0.88)) + "\n"
                    + json.dumps(run(64, 9.0, floor_fraction=0.82)) + "\n")
    peer = tmp_path / "peer.jsonl"
    peer.write_text(json.dumps(run(1, 9.0, peer="old")) + "\n"
                    + json.dumps(run(1, 8.0, peer="transformers (static cache)")) + "\n")
    assert compare_peer.main([str(ours), str(peer)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| preset | batch | context | ms/token") and len(lines) == 4
    b1, b64 = ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])
    # the peer's last run of the same workload; ours / peer = the peer's time over ours
    assert b1 == ["llama3-8b", "1", "128+256", "4.000", "250.0", "88.0%",
                  "transformers (static cache)", "8.000", "125.0", "2.00x"]
    assert b64[:6] == ["llama3-8b", "64", "128+256", "9.000", "7111.1", "82.0%"]
    assert b64[6:] == ["", "", "", ""]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("no json here\n")
    assert compare_peer.main([str(empty), str(peer)]) == 1
    assert compare_peer.main([str(ours)]) == 2


def test_llama_cpp_runs_beside_ours_on_a_gguf_file(tmp_path, capsys):
    """On a CPU with a GGUF file, bench runs llama.cpp (llama-cpp-python) on the same file and
    prints its row and our ratios; where it is not installed it says how to get it."""
    from benchmarks import random_gguf
    from jaxinfer import llama_cpp_peer

    path = tmp_path / "tiny-q4_k_m.gguf"
    assert random_gguf.main([str(path), "--shapes", "tiny"]) == 0
    assert cli.main(["bench", "--model", str(path), "--prompt-len", "8", "--gen-len", "4",
                     "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "w=q4_k+q6_k" in out
    if llama_cpp_peer.available() is None:
        assert "pip install llama-cpp-python" in out
        return
    assert "llama.cpp (llama-cpp-python" in out and "ours / llama.cpp: decode" in out
    r = llama_cpp_peer.measure(str(path), 8, 4, repeats=1)
    assert r["prefill_tokens_per_s"] > 0 and r["decode_ms_per_token"] > 0
    assert 0 < r["peak_rss_gb"] < 2 and r["threads"] == llama_cpp_peer.threads()
    assert cli.main(["bench", "--model", str(path), "--prompt-len", "8", "--gen-len", "4",
                     "--repeats", "1", "--peer", "none"]) == 0
    assert "llama.cpp" not in capsys.readouterr().out
