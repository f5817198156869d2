"""The `jaxinfer` command: `generate` (one completion, streamed), `chat` (interactive), `serve`
(an OpenAI-compatible server), `quantize` (write a checkpoint quantized), `models`, `bench`.

Every argument is checked before the model loads, and jax is imported only by the commands
that need it (`--help`, `--version`, `models` and argument errors answer at once). Errors print
one line, `jaxinfer: error: ...`, and exit 2; Ctrl-C exits 130 and a closed pipe (`| head`)
141, quietly, as shell tools do. On a terminal, a wait of more than 2 s (the load, the first
token's prefill and compile) shows a line that counts the seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time

from checkpoints.registry import DEFAULT_MODEL

log = logging.getLogger("jaxinfer")
EXIT_USAGE, EXIT_SIGINT, EXIT_SIGPIPE = 2, 128 + signal.SIGINT, 128 + signal.SIGPIPE
CHAT_HELP = ("/exit, /quit or Ctrl-D ends the chat, /reset forgets the conversation, "
             "/system TEXT sets the system message, Ctrl-C stops a reply")


class UsageError(ValueError):
    """A bad argument, found before anything is loaded."""


class _Parser(argparse.ArgumentParser):
    """argparse's errors as one line (not the whole usage block), with where to look."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"jaxinfer: error: {message} (see `{self.prog} --help`)\n")


@contextlib.contextmanager
def _waiting(what: str, after: float = 2.0, stream=None):
    """On a terminal, a wait longer than `after` seconds shows `what... N s` (a tqdm line,
    erased when the wait ends); elsewhere nothing."""
    stream = stream or sys.stderr
    if not stream.isatty():
        yield
        return
    done, t0 = threading.Event(), time.perf_counter()

    def show():
        if done.wait(after):
            return
        from tqdm.auto import tqdm

        with tqdm(total=None, bar_format="{desc}", file=stream, leave=False) as bar:
            while not done.is_set():
                bar.set_description_str(f"{what}... {time.perf_counter() - t0:.0f} s")
                done.wait(0.5)

    thread = threading.Thread(target=show, name="jaxinfer-waiting", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


def _positive(name):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value
    return parse


def _seconds(name):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number of seconds, got "
                                             f"{text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {text}")
        return value
    return parse


def _seed(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seed must be an integer, got {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"--seed must be in [0, 2**32), got {value}")
    return value


def _add_verbose(p: argparse.ArgumentParser) -> None:
    # Also after the command (`jaxinfer generate "Hi" -v`); SUPPRESS keeps the top-level value.
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="log progress and timings (load, first token, tokens/s) to stderr")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    _add_verbose(p)
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"registered name (see `jaxinfer models`), HF directory or .gguf file "
                        f"(default {DEFAULT_MODEL})")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="params/activations dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--quantization", choices=("none", "int8", "int4", "fp8"), default=None,
                   help="matmul weights: as the checkpoint stores them (default: a GGUF stays "
                        "in its blocks), none (dequantized), or quantized on load to int8 / "
                        "int4 (group-wise) / fp8 (e4m3)")
    p.add_argument("--group-size", type=_positive("--group-size"), default=None, metavar="G",
                   help="rows of K per scale for --quantization int8/int4 (default 128, "
                        "or 64 / 32 where 128 does not divide K)")
    p.add_argument("--int8-activations", action="store_true",
                   help="on a CPU, quantized weights' matmuls take the activations rounded to "
                        "int8 per 16 values, as llama.cpp does: decode ~1.4x faster, outputs "
                        "llama.cpp's rather than the dequantized weights' (their logprobs move "
                        "~1%%, near-ties flip)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "int8", "fp8"), default="auto",
                   help="KV cache storage: the model's dtype (auto, default), or int8 / fp8 "
                        "(e4m3) codes with a scale per token and head: about half the bytes")
    for axis, what in (("tp", "tensor parallel: heads, MLP and vocabulary split"),
                       ("dp", "data parallel: the batch and its KV cache split"),
                       ("ep", "expert parallel: a MoE model's experts split")):
        p.add_argument(f"--{axis}", type=_positive(f"--{axis}"), default=None, metavar="N",
                       help=f"{what} over N devices (default 1; the mesh: tp x dp x ep; "
                            f"any of the three given, even 1, runs on a mesh)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--max-tokens", "--max-new-tokens", dest="max_new_tokens",
                   type=_positive("--max-tokens"), default=256, metavar="N",
                   help="most new tokens (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when the reply contains TEXT (repeatable); EOS stops too")
    p.add_argument("--logit-bias", action="append", default=None, metavar="ID=BIAS",
                   help="add BIAS (-100 to 100) to token ID's logit (repeatable)")


def _add_speculative_args(p: argparse.ArgumentParser, bench: bool = False) -> None:
    s = p.add_argument_group("speculative decoding (the same tokens, fewer target steps)")
    s.add_argument("--speculative", choices=("ngram", "draft", "head", "mtp"), default=None,
                   help="draft tokens by prompt lookup (ngram), with --draft-model, with an "
                        "EAGLE head (`jaxinfer train-draft`; --draft-head) or DeepSeek-V3's "
                        "MTP module, and verify them in one forward of the model")
    s.add_argument("--num-speculative-tokens", type=_positive("--num-speculative-tokens"),
                   default=None, metavar="K", nargs="+" if bench else None,
                   help="drafts per step (default 4)" + (", one run per K" if bench else ""))
    s.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="the draft model for --speculative draft (registered name, HF "
                        "directory or .gguf; the model's tokenizer)")
    s.add_argument("--draft-head", default=None, metavar="PATH",
                   help="the head for --speculative head (default: the one train-draft "
                        "wrote beside the model)")
    s.add_argument("--rejection-sampling", action="store_true",
                   help="sampled rows accept a draft model's or head's drafts with probability "
                        "min(1, p/q), resampling from max(0, p - q): more drafts accepted, the "
                        "model's distribution, but not plain sampling's very tokens (default: "
                        "kept while they equal them; greedy rows either way)")
    if bench:  # jaxinfer/speculative_bench.py's TASKS (not imported here: it imports jax)
        s.add_argument("--tasks", nargs="+", choices=("edit", "summarize"), default=["edit"],
                       help="input-grounded prompts the acceptance is measured on")


def build_parser() -> argparse.ArgumentParser:
    from jaxinfer import __version__

    parser = _Parser(prog="jaxinfer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"jaxinfer {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log progress and timings (load, first token, tokens/s) to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="complete one prompt, streaming the text to stdout")
    g.add_argument("prompt", nargs="?", default=None,
                   help="the prompt; '-' reads it from stdin (as does no prompt with -f)")
    g.add_argument("-f", "--file", default=None, help="read the prompt from this file")
    _add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--system", default=None, help="system message (chat template)")
    g.add_argument("--no-chat", action="store_true",
                   help="feed the prompt as plain text; by default a model whose tokenizer has "
                        "a chat template gets the prompt as a user message (as the API does)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at EOS: run to --max-tokens (or a --stop)")
    g.add_argument("--logprobs", action="store_true",
                   help="report each new token's log-probability (in --json, else on stderr)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object: text, token ids, finish reason, usage, timings")
    _add_speculative_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat (" + CHAT_HELP + ")")
    _add_model_args(c)
    _add_sampling_args(c)
    c.add_argument("--system", default=None, help="system message")
    c.set_defaults(func=cmd_chat)

    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine")
    _add_model_args(v)
    v.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1, this machine only)")
    v.add_argument("--port", type=_positive("--port"), default=8000)
    v.add_argument("--api-key", default=os.environ.get("JAXINFER_API_KEY") or None,
                   help="require this bearer token on every endpoint but /health (default "
                        "$JAXINFER_API_KEY)")
    v.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default --model)")
    v.add_argument("--max-num-seqs", type=_positive("--max-num-seqs"), default=None,
                   help="requests running at once")
    v.add_argument("--max-model-len", type=_positive("--max-model-len"), default=None,
                   help="the longest prompt + output of a request")
    v.add_argument("--kv-memory", default=None,
                   help="the KV page pool: a fraction of free memory (0.8) or bytes ('8GB')")
    v.add_argument("--max-pending", type=_positive("--max-pending"), default=256,
                   help="requests queued or running before new ones get 429")
    v.add_argument("--max-tokens-limit", type=_positive("--max-tokens-limit"), default=None,
                   metavar="N", help="the most max_tokens a request may ask for (default "
                                     "--max-model-len); more gets 400")
    v.add_argument("--request-timeout", type=_seconds("--request-timeout"), default=600.0,
                   metavar="S", help="seconds a request may take, its wait in the queue "
                                     "included (default 600); past it: aborted, 408")
    v.add_argument("--shutdown-timeout", type=_seconds("--shutdown-timeout"), default=30.0,
                   metavar="S", help="on Ctrl-C (or SIGTERM), seconds the requests under way "
                                     "may take to finish before they are cut (default 30)")
    v.add_argument("--decode-steps", type=_positive("--decode-steps"), default=1,
                   help="decode steps per engine dispatch (default 1)")
    v.add_argument("--preset", default=None,
                   help="serve a known model's shapes with --random-weights (no tokenizer: "
                        "token-id prompts through /v1/completions; for load tests)")
    v.add_argument("--random-weights", action="store_true",
                   help="random values for --preset, no download")
    v.add_argument("--num-layers", type=_positive("--num-layers"), default=None, metavar="L",
                   help="with --preset: its first L layers only")
    _add_speculative_args(v)
    v.set_defaults(func=cmd_serve)

    q = sub.add_parser("quantize", help="write a checkpoint's weights quantized (int8 / int4 / "
                                        "fp8), to load without re-quantizing")
    _add_verbose(q)
    q.add_argument("src", help="registered name or HF directory (16/32-bit weights)")
    q.add_argument("dst", help="new directory to write (config, tokenizer, model.safetensors)")
    q.add_argument("--to", choices=("int8", "int4", "fp8"), required=True)
    q.add_argument("--group-size", type=_positive("--group-size"), default=None, metavar="G",
                   help="rows of K per scale (int8/int4 default 128; fp8 default per column)")
    q.set_defaults(func=cmd_quantize)

    t = sub.add_parser("train-draft", help="train an EAGLE draft head for a model on a text "
                                           "file (then: --speculative head)")
    _add_verbose(t)
    t.add_argument("model", help="registered name, HF directory or .gguf file")
    t.add_argument("--data", required=True, metavar="FILE",
                   help="a text file, or .jsonl with a \"text\" field per line")
    t.add_argument("--steps", type=_positive("--steps"), default=500, metavar="N",
                   help="optimizer steps (default 500)")
    t.add_argument("--out", default=None, metavar="PATH",
                   help="the head's safetensors file (default beside the model; the loss "
                        "curve goes beside it as .png)")
    t.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    t.add_argument("--seq-len", type=_positive("--seq-len"), default=128,
                   help="tokens per training window (default 128)")
    t.add_argument("--batch", type=_positive("--batch"), default=8,
                   help="windows per step (default 8)")
    t.add_argument("--windows", choices=("any", "texts"), default="any",
                   help="where training windows start: anywhere in the data (default), or "
                        "where a text (a JSONL line) starts, so the model's features over a "
                        "window have the context they have when drafting (a window cut "
                        "mid-text lacks the text's beginning: an answer without its prompt)")
    t.add_argument("--draft-vocab", type=_positive("--draft-vocab"), default=32768,
                   metavar="N",
                   help="the head drafts from the data's N most frequent tokens, with a "
                        "readout of its own (EAGLE-3's d2t: Llama-3's LM head read per draft "
                        "shrinks 4x); default 32768, the whole vocabulary when it has no more")
    t.add_argument("--seed", type=_seed, default=0)
    t.set_defaults(func=cmd_train_draft)

    m = sub.add_parser("models", help="list the registered models and what is cached")
    _add_verbose(m)
    m.add_argument("--json", action="store_true", help="one JSON object per model")
    m.set_defaults(func=cmd_models)

    b = sub.add_parser("bench", help="prefill/decode speed against the memory-bandwidth floor")
    _add_model_args(b)
    b.add_argument("--preset", default=None, help="real shapes of a known model (with --random-weights)")
    b.add_argument("--random-weights", action="store_true", help="random values, no download")
    b.add_argument("--batch", type=_positive("--batch"), nargs="+", default=[1])
    b.add_argument("--prompt-len", type=_positive("--prompt-len"), default=128)
    b.add_argument("--gen-len", type=_positive("--gen-len"), default=256,
                   help="new tokens per run (>= 2: the first comes from the prefill)")
    b.add_argument("--repeats", type=_positive("--repeats"), default=3)
    b.add_argument("--json", action="store_true", help="a JSON line per run at the end")
    b.add_argument("--dump-hlo", default=None, metavar="PREFIX",
                   help="write the optimized decode step's HLO to PREFIX.b<batch>.hlo.txt")
    b.add_argument("--steps-per-sync", type=_positive("--steps-per-sync"), default=None,
                   metavar="K",
                   help="decode steps per host check of the device loop (default: the "
                        "policy's steps_per_sync_no_stop, as the bench has no stop ids)")
    b.add_argument("--num-layers", type=_positive("--num-layers"), default=None, metavar="L",
                   help="with --preset: its first L layers only (a quick compile check)")
    b.add_argument("--compile-only", action="store_true",
                   help="lower and compile the prefill and the decode step with abstract "
                        "weights and cache (nothing allocated) and report each device's "
                        "memory: a model too large for this machine, on fake devices")
    b.add_argument("--policy", choices=("default", "deterministic", "reference"),
                   default="default",
                   help="kernel policy: today's fastest, bitwise-repeatable and "
                        "batch-invariant, or the pure-jnp references")
    b.add_argument("--policy-field", action="append", default=[], metavar="FIELD=VALUE",
                   help="one KernelPolicy field on top of --policy (repeatable), e.g. "
                        "moe_route_rows=0 or mosaic_norm_rows=0: a kernel choice A/B'd "
                        "without code")
    b.add_argument("--peer", choices=("llama.cpp", "none"), default="llama.cpp",
                   help="on a CPU with a GGUF file: also run llama.cpp (llama-cpp-python, "
                        "where installed) on the same file and cores, and print the ratios")
    _add_speculative_args(b, bench=True)
    e = b.add_argument_group("serving engine (--engine)")
    e.add_argument("--engine", action="store_true",
                   help="replay a synthetic trace through the serving engine (Poisson arrivals, "
                        "a shared system prompt for some) and through static batches of "
                        "generate; report throughput, TTFT / TPOT p50 / p99, pages, hit rate")
    e.add_argument("--requests", type=_positive("--requests"), default=512)
    e.add_argument("--rate", type=float, default=16.0, help="arrivals per second (Poisson)")
    e.add_argument("--prompt-lens", type=_positive("--prompt-lens"), nargs=2, default=[32, 1024],
                   metavar=("MIN", "MAX"), help="prompt lengths, drawn uniformly")
    e.add_argument("--output-lens", type=_positive("--output-lens"), nargs=2, default=[16, 512],
                   metavar=("MIN", "MAX"), help="output lengths, drawn uniformly")
    e.add_argument("--shared-fraction", type=float, default=0.3,
                   help="fraction of requests starting with the shared system prompt")
    e.add_argument("--shared-len", type=_positive("--shared-len"), default=512)
    e.add_argument("--decode-steps", type=_positive("--decode-steps"), default=1,
                   help="decode steps per engine dispatch")
    e.add_argument("--kv-memory", default=None,
                   help="the page pool: a fraction of free memory (0.8) or bytes ('8GB')")
    e.add_argument("--no-static", action="store_true",
                   help="skip the static-batch comparison")
    b.set_defaults(func=cmd_bench)
    return parser


def _check_model_arg(source: str) -> None:
    from checkpoints.registry import MODELS, list_models

    if source in MODELS or os.path.exists(os.path.expanduser(source)):
        return
    raise UsageError(f"--model {source!r} is neither a registered name ({', '.join(list_models())})"
                     " nor an existing file or directory")


def _check_sampling_args(args):
    """SamplingParams' own checks, on the parsed values, before anything loads."""
    from jaxinfer.prompts import check_text
    from jaxinfer.sampling import SamplingParams

    bias = {}
    for entry in args.logit_bias or []:
        token, _, value = entry.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise UsageError(f"--logit-bias takes ID=BIAS (a token id and a number), got "
                             f"{entry!r}") from None
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, min_p=args.min_p,
                                repetition_penalty=args.repetition_penalty,
                                logprobs=getattr(args, "logprobs", False), logit_bias=bias)
    except ValueError as e:
        raise UsageError(str(e)) from None
    for s in args.stop or []:
        if not s:
            raise UsageError("--stop needs a non-empty string")
        check_text(s, "--stop")
    return params


def _read_prompt(args) -> str:
    from jaxinfer.prompts import check_text

    if args.file is not None and args.prompt not in (None, "-"):
        raise UsageError("give the prompt as an argument or with -f/--file, not both")
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8", errors="surrogateescape") as f:
                text = f.read()
        except OSError as e:
            raise UsageError(f"cannot read the prompt file: {e}") from None
        where = f"the prompt file {args.file}"
    elif args.prompt in (None, "-"):
        if args.prompt is None and sys.stdin.isatty():
            raise UsageError("no prompt: give one as an argument, '-' to read stdin, or -f FILE")
        text = sys.stdin.buffer.read().decode("utf-8", errors="surrogateescape")
        where = "the prompt from stdin"
    else:
        text, where = args.prompt, "the prompt"
    if not text.strip():
        raise UsageError(f"{where} is empty")
    return check_text(text, where)


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------


def _check_mesh_args(args) -> None:
    """--tp / --dp / --ep as a mesh (args.mesh; None when none is given: `--tp 1` is a
    one-device mesh), before the model loads: more devices than present is a usage error.
    Whether the model's heads and experts split that way is checked by the load, from the
    config, before any tensor is read."""
    args.mesh = None
    if args.tp is None and args.dp is None and args.ep is None:
        return
    args.tp, args.dp, args.ep = args.tp or 1, args.dp or 1, args.ep or 1
    from jaxinfer.sharding import make_mesh

    try:
        args.mesh = make_mesh(tp=args.tp, dp=args.dp, ep=args.ep)
    except ValueError as e:
        raise UsageError(f"--tp {args.tp} --dp {args.dp} --ep {args.ep}: {e}") from None


def _checkpoint_facts(args) -> dict:
    """What the checkpoint says of itself without loading it: whether it has a chat template,
    and a GGUF's file type (its quantization). {} for what cannot be read cheaply."""
    from checkpoints import registry

    try:
        path = registry.resolve(args.model)
    except ValueError:
        return {}
    if path.suffix == ".gguf" and path.is_file():
        import gguf

        from checkpoints.gguf import read_metadata

        meta = read_metadata(path)
        kind = meta.get("general.file_type")
        try:
            kind = gguf.LlamaFileType(kind).name.removeprefix("MOSTLY_") if kind is not None \
                else None
        except ValueError:
            kind = str(kind)
        return {"chat_template": bool(meta.get("tokenizer.chat_template")), "file_type": kind}
    if path.is_dir():
        from checkpoints.tokenizer import _read_hf_chat_template

        config = {}
        with contextlib.suppress(OSError, ValueError):
            config = json.loads((path / "tokenizer_config.json").read_text("utf-8"))
        return {"chat_template": bool(_read_hf_chat_template(path, config))}
    return {}


def _check_checkpoint(args, needs_chat_template: str | None = None) -> None:
    """Before the load: a chat without a template is refused; --quantization on a GGUF whose
    blocks are already quantized is said (its blocks dequantized, then quantized again)."""
    requantize = args.quantization in ("int8", "int4", "fp8")
    if not needs_chat_template and not requantize:
        return  # nothing to check: no metadata read
    facts = _checkpoint_facts(args)
    if needs_chat_template and facts.get("chat_template") is False:
        raise UsageError(f"{args.model} has no chat template; {needs_chat_template}")
    kind = facts.get("file_type")
    if requantize and kind not in (None, "ALL_F32", "F16", "BF16"):
        log.warning("%s is already quantized (%s); --quantization %s dequantizes its blocks "
                    "and quantizes them again, adding error to the file's own; leave "
                    "--quantization out to run its blocks as they are", args.model, kind,
                    args.quantization)


def _policy(args):
    """The KernelPolicy the model flags ask for (--int8-activations), or None: the default."""
    from jaxinfer.plan import KernelPolicy

    return KernelPolicy(cpu_int8_activations=True) if args.int8_activations else None


def _load(args):
    import jaxinfer

    t0 = time.perf_counter()
    with _waiting(f"loading {args.model}"):
        model = jaxinfer.load(args.model, dtype=args.dtype, quantization=args.quantization,
                              group_size=args.group_size, mesh=args.mesh,
                              policy=_policy(args))
    args.load_s = time.perf_counter() - t0
    log.info("loaded %s in %.2f s", args.model, args.load_s)
    return model


def _check_speculative_args(args) -> None:
    """--speculative, --num-speculative-tokens and --draft-model agree (before any load)."""
    if args.speculative is None:
        if args.num_speculative_tokens is not None or args.draft_model is not None \
                or args.draft_head is not None:
            raise UsageError("--num-speculative-tokens, --draft-model and --draft-head need "
                             "--speculative")
        return
    if (args.speculative == "draft") != (args.draft_model is not None):
        raise UsageError("--speculative draft needs --draft-model MODEL, and --draft-model "
                         "needs --speculative draft")
    if args.draft_head is not None and args.speculative != "head":
        raise UsageError("--draft-head needs --speculative head")
    if args.rejection_sampling and args.speculative not in ("draft", "head", "mtp"):
        raise UsageError("--rejection-sampling needs --speculative draft, head or mtp (a "
                         "drafter with a distribution over its drafts)")
    if args.mesh is not None:
        raise UsageError("--speculative runs on one device for now; drop --tp/--dp/--ep")
    if args.draft_model is not None:
        _check_model_arg(args.draft_model)
    if args.num_speculative_tokens is None:
        args.num_speculative_tokens = [4] if args.func is cmd_bench else 4


def _speculative(args, model):
    """The `speculative=` argument for generate/stream and the Engine: None, "ngram", "head"
    (beside the model), "mtp", the head at --draft-head or the draft model; with
    --rejection-sampling the head or a DraftModel that asks for it."""
    rejection = getattr(args, "rejection_sampling", False)
    if args.speculative in ("head", "mtp") and (args.draft_head is not None or rejection):
        import dataclasses

        from jaxinfer import draft_head
        from jaxinfer.speculative import resolve_drafter

        head = draft_head.load(args.draft_head, model) if args.draft_head is not None \
            else resolve_drafter(args.speculative, model)
        return dataclasses.replace(head, rejection=rejection)
    if args.speculative != "draft":
        return args.speculative
    import jaxinfer
    from jaxinfer.speculative import DraftModel

    t0 = time.perf_counter()  # its vocabulary is checked against the model's by stream()
    draft = jaxinfer.load(args.draft_model, dtype=args.dtype, quantization=args.quantization,
                          group_size=args.group_size)
    log.info("loaded the draft model %s in %.2f s", args.draft_model, time.perf_counter() - t0)
    return DraftModel(draft, rejection=True) if rejection else draft


def _kv_cache_dtype(args) -> str | None:
    """--kv-cache-dtype as the API takes it (auto: None)."""
    return None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype


def _messages(system: str | None, prompt: str) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) \
        + [{"role": "user", "content": prompt}]


def cmd_generate(args) -> int:
    sampling = _check_sampling_args(args)
    prompt = _read_prompt(args)
    if args.system is not None:
        if args.no_chat:
            raise UsageError("--system needs the chat template; drop --no-chat")
        from jaxinfer.prompts import check_text

        check_text(args.system, "--system")
    _check_model_arg(args.model)
    _check_mesh_args(args)
    _check_checkpoint(args, "drop --system (or give the prompt whole, --no-chat)"
                      if args.system is not None else None)
    _check_speculative_args(args)
    model = _load(args)
    speculative = _speculative(args, model)
    if args.system is not None or not args.no_chat and model.tokenizer is not None \
            and model.tokenizer.chat_template:
        request = _messages(args.system, prompt)
    else:
        request = prompt
    from jaxinfer.generate import stream

    spec = {} if speculative is None else {
        "speculative": speculative, "num_speculative_tokens": args.num_speculative_tokens}
    t0 = time.perf_counter()
    pieces = stream(model, request, max_new_tokens=args.max_new_tokens, sampling=sampling,
                    seed=args.seed, chat=False if args.no_chat else None, stop=args.stop,
                    progress=sys.stderr.isatty(), kv_cache_dtype=_kv_cache_dtype(args),
                    ignore_eos=args.ignore_eos, **spec)
    with _waiting("prefill (and compiles) until the first token"):
        first = next(pieces, None)
    for piece in itertools.chain([] if first is None else [first], pieces):
        if not args.json:
            sys.stdout.write(piece)
            sys.stdout.flush()
    total = time.perf_counter() - t0
    c = pieces.completion
    n = len(c.token_ids)
    # Decode speed from the second token on: the first decode step compiles (when the
    # executable is not cached), which on a short run would dominate the figure.
    times = pieces.token_times
    steady = times[-1] - times[1] if n > 2 else 0.0
    timings = {"load_s": round(args.load_s, 4),
               "time_to_first_token_s": round(pieces.time_to_first_token, 4),
               "first_decode_step_s": round(times[1] - times[0], 4) if n > 1 else None,
               "generate_s": round(total, 4),
               "decode_tokens_per_s": round((n - 2) / steady, 2) if steady > 0 else None}
    if args.json:
        out = {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
               "usage": {"prompt_tokens": c.prompt_tokens, "completion_tokens": n,
                         "total_tokens": c.prompt_tokens + n},
               "timings": timings}
        if args.logprobs:
            out["logprobs"] = c.logprobs
        if speculative is not None:
            out["speculative"] = {"draft_tokens": c.draft_tokens,
                                  "accepted_tokens": c.accepted_tokens}
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        if args.logprobs:
            tok = model.tokenizer
            for t, lp in zip(c.token_ids, c.logprobs):
                print(f"{t}\t{lp:.4f}\t{tok.decode([t], skip_special_tokens=False)!r}",
                      file=sys.stderr)
    log.info("%d prompt + %d new tokens; first token %.2f s after the load (prefill and its "
             "compile), first decode step %s s, then %s tok/s decode", c.prompt_tokens, n,
             timings["time_to_first_token_s"], timings["first_decode_step_s"],
             timings["decode_tokens_per_s"])
    if speculative is not None:
        log.info("speculative: %d of %d drafts accepted", c.accepted_tokens, c.draft_tokens)
    return 0


def _readline():
    """Line editing and a history file for `chat` where the platform has readline."""
    try:
        import readline
    except ImportError:
        return None
    from checkpoints.registry import cache_dir

    path = cache_dir() / "chat_history"
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)
    return readline, path


def cmd_chat(args) -> int:
    sampling = _check_sampling_args(args)
    if args.system is not None:
        from jaxinfer.prompts import check_text

        check_text(args.system, "--system")
    _check_model_arg(args.model)
    _check_mesh_args(args)
    _check_checkpoint(args, "use `jaxinfer generate --no-chat`")
    model = _load(args)
    if model.tokenizer is None or not model.tokenizer.chat_template:
        raise UsageError(f"{args.model} has no chat template; use `jaxinfer generate --no-chat`")
    from jaxinfer.generate import stream
    from jaxinfer.prompts import check_text

    engine = None
    if getattr(model, "sharding", None) is None:
        from jaxinfer.engine import Engine

        # One row, and the conversation's pages kept: a turn prefills only the new messages.
        engine = Engine(model, max_num_seqs=1, kv_cache_dtype=_kv_cache_dtype(args))
    history = _readline()
    system = args.system
    messages: list[dict] = []
    print(f"jaxinfer chat with {args.model}: {CHAT_HELP}", file=sys.stderr)
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                print(file=sys.stderr)
                return 0
            except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
                print("\n(Ctrl-D or /exit to quit)", file=sys.stderr)
                continue
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit", "exit", "quit"):
                return 0
            if text == "/reset":
                messages = []
                print("(conversation cleared)", file=sys.stderr)
                continue
            if text == "/system" or text.startswith("/system "):
                system = text[len("/system"):].strip() or None
                messages = []
                print(f"(system message {'set' if system else 'cleared'}; conversation "
                      "cleared)", file=sys.stderr)
                continue
            if text.startswith("/") and text.split()[0] in ("/help", "/?"):
                print(CHAT_HELP, file=sys.stderr)
                continue
            try:
                check_text(line, "the message")
            except ValueError as e:
                print(f"jaxinfer: {e}", file=sys.stderr)
                continue
            turn = ([{"role": "system", "content": system}] if system else []) + messages \
                + [{"role": "user", "content": line}]
            reply = []
            pieces = None
            try:
                if engine is not None:
                    pieces = engine.stream(turn, max_tokens=args.max_new_tokens,
                                           sampling=sampling, seed=args.seed, stop=args.stop)
                else:
                    pieces = stream(model, turn, max_new_tokens=args.max_new_tokens,
                                    sampling=sampling, seed=args.seed, stop=args.stop,
                                    kv_cache_dtype=_kv_cache_dtype(args))
                with _waiting("prefill (and compiles) until the first token"):
                    first = next(pieces, None)
                for piece in itertools.chain([] if first is None else [first], pieces):
                    reply.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            except KeyboardInterrupt:  # stops this reply (its request aborted); the session goes on
                if pieces is not None:
                    pieces.close()
                sys.stdout.write(" [stopped]")
            except ValueError as e:  # e.g. the conversation outgrew the context
                print(f"\njaxinfer: {e}; /reset starts over", file=sys.stderr)
                continue
            sys.stdout.write("\n")
            sys.stdout.flush()
            messages += [{"role": "user", "content": line},
                         {"role": "assistant", "content": "".join(reply)}]
    finally:
        if history is not None:
            try:
                history[0].write_history_file(history[1])
            except OSError:
                pass


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def check_serve_args(args) -> None:
    """`serve`'s argument checks, before anything loads."""
    if args.random_weights != bool(args.preset):
        raise UsageError("--preset and --random-weights go together (a preset carries shapes, "
                         "not weights)")
    if args.num_layers is not None and not args.preset:
        raise UsageError("--num-layers cuts a --preset; a checkpoint has its own layers")
    if not args.preset:
        _check_model_arg(args.model)
        _check_checkpoint(args)
    _check_mesh_args(args)
    if args.mesh is not None:
        raise UsageError("serve runs on one device for now; drop --tp / --dp / --ep")
    if args.max_tokens_limit and args.max_model_len and \
            args.max_tokens_limit > args.max_model_len:
        raise UsageError(f"--max-tokens-limit {args.max_tokens_limit} exceeds --max-model-len "
                         f"{args.max_model_len}")
    _check_speculative_args(args)
    if args.speculative is not None and args.decode_steps != 1:
        raise UsageError("--speculative takes --decode-steps 1 (a verification already yields "
                         "several tokens per step)")


def serve_engine(args):
    """The model and Engine that `serve` args describe (also benchmarks/serve_load.py's
    in-process comparison)."""
    if args.preset:
        from jaxinfer.bench import default_dtype, random_model

        t0 = time.perf_counter()
        model = random_model(args.preset, args.dtype or default_dtype(),
                             quantization=args.quantization, group_size=args.group_size,
                             num_layers=args.num_layers)
        args.load_s = time.perf_counter() - t0
    else:
        model = _load(args)
    from jaxinfer.engine import Engine

    speculative = _speculative(args, model)
    spec = {} if speculative is None else {
        "speculative": speculative, "num_speculative_tokens": args.num_speculative_tokens}
    return model, Engine(model, max_num_seqs=args.max_num_seqs,
                         max_model_len=args.max_model_len, kv_memory=args.kv_memory,
                         kv_cache_dtype=_kv_cache_dtype(args), decode_steps=args.decode_steps,
                         **spec)


def cmd_serve(args) -> int:
    check_serve_args(args)
    if not _is_loopback(args.host):
        log.warning("binding %s: reachable from other machines%s", args.host,
                    "" if args.api_key else " and without --api-key (anyone who can reach it "
                    "can use it)")
    import uvicorn

    from jaxinfer.server import create_app, start_engine

    # The model, the Engine and JAX live in a process of their own (jaxinfer/server/runner.py
    # says why); this one serves HTTP and never initialises a JAX backend.
    runner = start_engine(args, max_pending=args.max_pending)
    try:
        name = args.served_model_name or args.preset or args.model
        app = create_app(runner, name, api_key=args.api_key,
                         max_tokens_limit=args.max_tokens_limit,
                         request_timeout=args.request_timeout)
        i = runner.info
        url = f"http://{'[' + args.host + ']' if ':' in args.host else args.host}:{args.port}"
        print(f"jaxinfer serve: {name} ({i['num_layers']} layers, {i['dtype']}, loaded in "
              f"{i['load_s']:.1f} s) on {i['device']}\n"
              f"  memory: params {i['params']}, KV pool {i['total_pages']} pages of "
              f"{i['page_size']} tokens = {i['kv_pool']}"
              f"{'' if i['kv_cache_dtype'] is None else ' (' + i['kv_cache_dtype'] + ')'}; "
              f"{i['max_num_seqs']} rows, max_model_len {i['max_model_len']}\n"
              f"  {url}/v1 (OpenAI API), {url}/ (chat page); Ctrl-C drains and stops",
              file=sys.stderr, flush=True)
        # Ctrl-C / SIGTERM: uvicorn stops accepting, then waits for the requests under way
        # (streams included) up to --shutdown-timeout; the engine process steps on meanwhile.
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                timeout_graceful_shutdown=args.shutdown_timeout)
        server = uvicorn.Server(config)
        runner.on_death = lambda: setattr(server, "should_exit", True)
        server.run()
    finally:
        runner.close()
    return 1 if runner.error is not None else 0


def cmd_models(args) -> int:
    from checkpoints.registry import cache_dir, cached_models

    models = cached_models()
    if args.json:
        for m in models:
            print(json.dumps({"name": m.name, "description": m.description,
                              "path": str(m.path), "size": m.size, "cached": m.cached,
                              "verified": m.verified}))
        return 0
    print(f"registered models (cache: {cache_dir()}):")
    for m in models:
        state = ("cached, verified" if m.verified else "cached") if m.cached else "not cached"
        default = " (default)" if m.name == DEFAULT_MODEL else ""
        print(f"  {m.name}{default}: {m.size / 1e6:.1f} MB, {state}\n"
              f"      {m.description}\n      {m.path}")
    print("Any HF directory (config.json + *.safetensors) or .gguf file can be given to --model.")
    return 0


def cmd_quantize(args) -> int:
    import jaxinfer
    from checkpoints import registry
    from checkpoints.quantized import save_quantized

    src = registry.resolve(args.src)
    if not src.is_dir():
        raise ValueError(f"{args.src}: quantize takes an HF directory (or a registered name); a "
                         f"GGUF file is already quantized and loads as it is")
    model = jaxinfer.load(str(src), dtype="float32", quantization=args.to,
                          group_size=args.group_size)
    dst = save_quantized(args.dst, model.params, src)
    print(f"wrote {dst} ({args.to}; load it with jaxinfer.load({str(dst)!r}))")
    return 0


def cmd_train_draft(args) -> int:
    import pathlib

    if not args.lr > 0:
        raise UsageError(f"--lr must be positive, got {args.lr}")
    _check_model_arg(args.model)
    from jaxinfer import draft_head, train_draft

    texts = train_draft.read_texts(args.data)  # a bad file is refused before the load
    import jaxinfer

    model = jaxinfer.load(args.model)
    data, starts = train_draft.tokenize_texts(model, texts, args.seq_len)
    out = pathlib.Path(args.out) if args.out else draft_head.default_path(model.source)
    log.info("training on %d tokens of %s; the head goes to %s", len(data), args.data, out)
    result = train_draft.train(model, data, args.steps, lr=args.lr, seq_len=args.seq_len,
                               batch=args.batch, seed=args.seed, progress=sys.stderr.isatty(),
                               starts=starts if args.windows == "texts" else None,
                               draft_vocab=args.draft_vocab)
    draft_head.save(result.head, out)
    png = train_draft.plot_losses(result.losses, result.accuracy, out.with_suffix(".png"))
    tail = max(1, len(result.losses) // 10)
    loss, top1 = (sum(x[-tail:]) / tail for x in (result.losses, result.accuracy))
    print(f"wrote {out} (loss {result.losses[0]:.4f} -> {loss:.4f}, top-1 agreement with the "
          f"model {top1:.3f}, means of the last {tail} steps) and the loss curve {png}; use it "
          "with --speculative head")
    return 0


def cmd_bench(args) -> int:
    if args.gen_len < 2:
        raise UsageError("--gen-len must be >= 2 (the first new token comes from the prefill; "
                         "decode speed needs at least one more)")
    if args.compile_only and not (args.preset and args.random_weights):
        raise UsageError("--compile-only lowers a --preset with --random-weights (abstract "
                         "shapes, nothing allocated); give both")
    if args.num_layers is not None and not args.preset:
        raise UsageError("--num-layers cuts a --preset; a checkpoint has its own layers")
    if not args.preset:
        _check_model_arg(args.model)
        _check_checkpoint(args)
    _check_mesh_args(args)
    if args.speculative is not None and getattr(args, "engine", False):
        raise UsageError("bench --speculative measures generate()'s acceptance; drop --engine "
                         "(the Engine's speculation runs in serve --speculative)")
    if getattr(args, "rejection_sampling", False):
        raise UsageError("bench --speculative measures greedy decoding, which rejection "
                         "sampling leaves as it is; drop --rejection-sampling")
    _check_speculative_args(args)
    from jaxinfer import bench

    return bench.main(args)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # -v is for our progress and timings, not jax's ("Unable to initialize backend 'tpu'").
    logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_SIGINT
    except BrokenPipeError:
        # The reader went away (`| head`): point stdout at /dev/null so the interpreter's final
        # flush does not raise again, and exit as a process killed by SIGPIPE would.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, io.UnsupportedOperation):  # stdout is not a file
            pass
        return EXIT_SIGPIPE
    except (ValueError, FileNotFoundError, NotImplementedError, RuntimeError) as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def entry() -> None:
    """The console script: `main()`, then exit without the interpreter's teardown, which
    (jax's backends and thread pools winding down) took ~0.5 s after the answer was out."""
    code = main()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:
        code = code or EXIT_SIGPIPE
    except (OSError, ValueError):
        pass
    os._exit(code)


if __name__ == "__main__":
    entry()
