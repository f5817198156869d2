"""Streaming speed: `jaxinfer.stream` (one jitted step per token, read by the host) against
`generate`'s device loop, per token, on one prompt of a model with real shapes and random
weights (the vocabulary cut to the tiny test tokenizer's, so every sampled id decodes).

    PYTHONPATH=. python benchmarks/stream.py --preset llama3-8b -n 128

Prints one JSON line: ms/token of both and the stream's overhead over the loop.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax

from checkpoints.tokenizer import Tokenizer
from jaxinfer.configs import PRESETS
from jaxinfer.model import Model, default_dtype
from jaxinfer.models import registry
from jaxinfer.weights import init_params

TOKENIZER = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "data" \
    / "tokenizer" / "tiny_hf"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("-n", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    tok = Tokenizer.from_hf_dir(TOKENIZER)
    dtype = default_dtype()
    config = PRESETS[args.preset].replace(vocab_size=tok.vocab_size, dtype=dtype,
                                          eos_token_ids=())
    params = init_params(registry.family(config).param_specs(config), jax.random.key(0), dtype)
    model = Model(config=config, params=params, tokenizer=tok)
    import jaxinfer

    prompt = list(range(3, 131))  # 128 token ids; no EOS in the model: every run is n long

    def timed(fn) -> float:
        fn()  # compile
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3 / args.n

    def one_stream():
        n = sum(1 for _ in jaxinfer.stream(model, prompt, max_new_tokens=args.n))
        assert n > 0

    loop = timed(lambda: jaxinfer.generate(model, [prompt], max_new_tokens=args.n))
    stream = timed(one_stream)
    print(json.dumps({"preset": args.preset, "dtype": dtype, "n": args.n,
                      "generate_ms_per_token": round(loop, 3),
                      "stream_ms_per_token": round(stream, 3),
                      "stream_over_generate": round(stream / loop, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
