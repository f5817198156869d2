"""The decode workload of `jaxinfer bench` through HF transformers, the peer, on the same GPU.

Random weights with a preset's real shapes, bf16, greedy, a static cache (transformers compiles
the decode step for it: its fast path). Prints one JSON line per batch size with the same field
names as `jaxinfer bench --json`, so the two can be put side by side.

    python benchmarks/peer_hf.py --preset llama3-8b --batch 1 --prompt-len 128 --gen-len 256
    # the embedded model on CPU (transformers dequantizes the GGUF to float32); -P keeps this
    # folder off sys.path, where benchmarks/kernels.py would shadow the `kernels` package that
    # transformers probes for:
    python -P benchmarks/peer_hf.py --device cpu --cache dynamic --prompt-len 64 --gen-len 64 \
        --gguf ~/.cache/jaxinfer/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

PRESETS = {  # HF LlamaConfig kwargs for the presets of jaxinfer/configs.py
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
}


def main() -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default="static", choices=("static", "dynamic"))
    ap.add_argument("--gguf", default=None, help="a real GGUF file instead of random weights")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()

    torch.manual_seed(0)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    if args.gguf:
        import pathlib

        path = pathlib.Path(args.gguf).expanduser()
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32).to(args.device).eval()
        cfg, name = model.config, path.name
    else:
        cfg, name = AutoConfig.for_model("llama", **PRESETS[args.preset]), args.preset
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    for b in args.batch:
        ids = torch.randint(0, cfg.vocab_size, (b, args.prompt_len), device=args.device)
        kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
        if args.cache == "static":
            kw["cache_implementation"] = "static"

        def run(n):
            sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            sync()
            assert out.shape[1] == args.prompt_len + n
            return time.perf_counter() - t0

        run(args.gen_len)  # warm-up: compiles the static-cache decode step
        run(args.gen_len)
        prefill = statistics.median(run(1) for _ in range(args.repeats))
        total = statistics.median(run(args.gen_len) for _ in range(args.repeats))
        decode_s = (total - prefill) / (args.gen_len - 1)
        print(json.dumps({
            "model": name, "device": args.device, "peer": f"transformers {__import__('transformers').__version__} "
                                          f"({args.cache} cache)",
            "batch": b, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
            "prefill_tokens_per_s": b * args.prompt_len / prefill,
            "decode_ms_per_token": decode_s * 1e3, "decode_tokens_per_s": b / decode_s,
        }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
