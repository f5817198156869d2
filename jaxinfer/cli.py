"""The `jaxinfer` command: `generate` (streams a completion), `chat` (interactive, multi-turn)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from jaxinfer.model import DEFAULT_MODEL


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"registered name, HF directory or .gguf file (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="params/activations dtype (default: bfloat16 on GPU, float32 on CPU)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)


def _sampling(args):
    from jaxinfer.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, repetition_penalty=args.repetition_penalty)


def _load(args):
    import jaxinfer

    t0 = time.perf_counter()
    model = jaxinfer.load(args.model, dtype=args.dtype)
    logging.getLogger("jaxinfer").info("loaded %s in %.1fs", args.model, time.perf_counter() - t0)
    return model


def cmd_generate(args) -> int:
    from jaxinfer.generate import generate, stream

    sampling = _sampling(args)  # validate before loading anything
    model = _load(args)
    chat = not args.no_chat
    if args.json:
        (c,) = generate(model, [args.prompt], max_new_tokens=args.max_new_tokens,
                        sampling=sampling, seed=args.seed, chat=chat)
        print(json.dumps({"text": c.text, "token_ids": c.token_ids,
                          "finish_reason": c.finish_reason}))
        return 0
    for piece in stream(model, args.prompt, max_new_tokens=args.max_new_tokens,
                        sampling=sampling, seed=args.seed, chat=chat):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args) -> int:
    from jaxinfer.generate import stream

    sampling = _sampling(args)
    model = _load(args)
    tok = model.tokenizer
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("jaxinfer chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        reply = []
        for piece in stream(model, ids, max_new_tokens=args.max_new_tokens, sampling=sampling,
                            seed=args.seed):
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_bench(args) -> int:
    from jaxinfer import bench

    return bench.main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxinfer", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt, streaming the text to stdout")
    g.add_argument("prompt")
    _add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--no-chat", action="store_true",
                   help="feed the prompt as plain text instead of a chat-templated user message")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat")
    _add_model_args(c)
    _add_sampling_args(c)
    c.add_argument("--system", default=None, help="system message")
    c.set_defaults(func=cmd_chat)

    b = sub.add_parser("bench", help="prefill/decode speed against the memory-bandwidth floor")
    _add_model_args(b)
    b.add_argument("--preset", default=None, help="real shapes of a known model (with --random-weights)")
    b.add_argument("--random-weights", action="store_true", help="random values, no download")
    b.add_argument("--batch", type=int, nargs="+", default=[1])
    b.add_argument("--prompt-len", type=int, default=128)
    b.add_argument("--gen-len", type=int, default=256)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--json", action="store_true", help="a JSON line per run at the end")
    b.add_argument("--dump-hlo", default=None, metavar="PREFIX",
                   help="write the optimized decode step's HLO to PREFIX.b<batch>.hlo.txt")
    b.add_argument("--steps-per-sync", type=int, default=None, metavar="K",
                   help="decode steps per host check of the device loop (default: the "
                        "policy's steps_per_sync_no_stop, as the bench has no stop ids)")
    b.add_argument("--policy", choices=("default", "deterministic", "reference"),
                   default="default",
                   help="kernel policy: today's fastest, bitwise-repeatable and "
                        "batch-invariant, or the pure-jnp references")
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
