"""The `jaxinfer` command: generate (text and JSON), chat, and clear errors."""

import contextlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest

import jaxinfer
from jaxinfer import cli
from jaxinfer.generate import decode_step
from jaxinfer.sampling import SamplingParams

generate_module = sys.modules["jaxinfer.generate"]  # the package's name is the function


# The embedded 30-layer model answers through `cli.main` in one process of its own under XLA's
# default CPU optimizations (tests/xla_env.py): its decode steps run ~3x faster there, and the
# three commands share the load and the generate programs (in-process they took ~90 s of the
# suite on 2 cores, most of it the chat's engine compiling unoptimized).
_EMBEDDED_CLI = """
import contextlib, io, json, sys
from jaxinfer import cli
runs = {}
for name, argv, stdin in json.load(sys.stdin):
    out = io.StringIO()
    sys.stdin = io.StringIO(stdin)
    with contextlib.redirect_stdout(out):
        code = cli.main(argv)
    runs[name] = [code, out.getvalue()]
print("RESULT " + json.dumps(runs))
"""


@pytest.fixture(scope="module")
def embedded_cli():
    """{name: [exit code, stdout]} of the three commands below on the embedded model."""
    from tests.xla_env import run_optimized

    q = "What is the capital of France?"
    return run_optimized(_EMBEDDED_CLI, stdin=json.dumps([
        ["json", ["generate", q, "--json", "--max-new-tokens", "16"], ""],
        ["text", ["generate", q, "--max-new-tokens", "16"], ""],
        # The second turn's new tokens (over 32) take the first's prefill width: one program.
        ["chat", ["chat", "--max-new-tokens", "24"], q + "\nAnd what is the capital of "
         "Italy? Please answer in one short sentence, as you did for France.\n"]]))


def test_generate_json(embedded_cli):
    code, stdout = embedded_cli["json"]
    assert code == 0
    out = json.loads(stdout)
    assert "Paris" in out["text"] and out["finish_reason"] == "stop"


def test_generate_streams_text(embedded_cli):
    code, stdout = embedded_cli["text"]
    assert code == 0 and "Paris" in stdout


def test_chat_two_turns(embedded_cli):
    """Two turns through the engine (chat serves with it): the first answer is generate's
    (the same templated prompt, greedy), on the real GGUF kept quantized."""
    code, stdout = embedded_cli["chat"]
    assert code == 0 and "Paris" in stdout and "Rome" in stdout
    answer = json.loads(embedded_cli["json"][1])
    assert answer["finish_reason"] == "stop" and answer["text"].strip() in stdout


@pytest.mark.parametrize("argv, match", [
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--top-p", "0"], "top_p"),
    (["generate", "hi", "--model", "no-such-model"], "no-such-model"),
])
def test_errors_are_clear(argv, match, capsys):
    assert cli.main(argv) == 2
    assert match in capsys.readouterr().err


# ----------------------------------------------------------------------------- the tiny model
# Flags and errors on `tiny_chat_dir` (2 layers: compiles in a second); the tests above answer a
# real question with the embedded model.


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_flags_agree_with_the_api(tiny_chat, tiny_chat_dir, capsys):
    """-n, --system, --stop, --logprobs, --json usage: the same tokens as the API's call."""
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    (ref,) = jaxinfer.generate(tiny_chat, [messages], max_new_tokens=12,
                               sampling=SamplingParams(temperature=0.0, logprobs=True))
    code, out, _ = _run(capsys, "generate", "Hi", "--system", "Be terse.", "-n", "12",
                        "--model", str(tiny_chat_dir), "--logprobs", "--json")
    got = json.loads(out)
    assert code == 0 and got["token_ids"] == ref.token_ids and got["text"] == ref.text
    np.testing.assert_allclose(got["logprobs"], ref.logprobs, rtol=1e-5)
    assert got["usage"] == {"prompt_tokens": ref.prompt_tokens, "completion_tokens": 12,
                            "total_tokens": ref.prompt_tokens + 12}
    assert set(got["timings"]) == {"load_s", "time_to_first_token_s", "first_decode_step_s",
                                   "generate_s", "decode_tokens_per_s"}
    assert got["timings"]["first_decode_step_s"] > 0 and got["timings"]["decode_tokens_per_s"] > 0
    stop = ref.text[3:5]
    code, out, _ = _run(capsys, "generate", "Hi", "--system", "Be terse.", "--max-tokens",
                        "12", "--model", str(tiny_chat_dir), "--stop", "zzz", "--stop", stop)
    assert code == 0 and out == ref.text[:ref.text.index(stop)] + "\n"


def test_logit_bias_and_ignore_eos_flags(tiny_chat, tiny_chat_dir, capsys):
    """--logit-bias ID=BIAS makes EOS the greedy pick: the reply ends at it, or with
    --ignore-eos runs to -n; token ids past the vocabulary are named."""
    eos = tiny_chat.config.eos_token_ids[0]
    for extra, want, reason in (([], [eos], "stop"), (["--ignore-eos"], [eos] * 4, "length")):
        code, out, _ = _run(capsys, "generate", "Hi", "-n", "4", "--model", str(tiny_chat_dir),
                            "--logit-bias", f"{eos}=100", "--json", *extra)
        got = json.loads(out)
        assert code == 0 and (got["token_ids"], got["finish_reason"]) == (want, reason)
    code, _, err = _run(capsys, "generate", "Hi", "--model", str(tiny_chat_dir),
                        "--logit-bias", "999999=1")
    assert code != 0 and "outside the vocabulary" in err


def test_prompt_from_stdin_and_file(tiny_chat, tiny_chat_dir, capsys, monkeypatch, tmp_path):
    (ref,) = jaxinfer.generate(tiny_chat, "Tell me a story.", max_new_tokens=6)
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(
        buffer=io.BytesIO("Tell me a story.".encode()), isatty=lambda: False))
    assert _run(capsys, "generate", "-", "-n", "6", "--model", str(tiny_chat_dir))[1] \
        == ref.text + "\n"
    (tmp_path / "p.txt").write_text("Tell me a story.")
    assert _run(capsys, "generate", "-f", str(tmp_path / "p.txt"), "-n", "6", "--model",
                str(tiny_chat_dir))[1] == ref.text + "\n"
    (plain,) = jaxinfer.generate(tiny_chat, "Tell me a story.", max_new_tokens=6, chat=False)
    assert _run(capsys, "generate", "Tell me a story.", "--no-chat", "-n", "6", "--model",
                str(tiny_chat_dir))[1] == plain.text + "\n"


@pytest.mark.parametrize("argv, match", [
    (["generate", "hi", "--seed", "-1"], "--seed must be in"),
    (["generate", "hi", "--seed", "1.5"], "--seed must be an integer"),
    (["generate", "hi", "-n", "0"], "--max-tokens must be >= 1"),
    (["generate", "hi", "--stop", ""], "--stop needs a non-empty string"),
    (["generate", "hi", "--min-p", "2"], "min_p"),
    (["generate", "hi", "--logit-bias", "5"], "--logit-bias takes ID=BIAS"),
    (["generate", "hi", "--logit-bias", "5=300"], "biases in [-100, 100]"),
    (["generate", "caf\udce9"], "not valid Unicode"),
    (["generate", "   "], "the prompt is empty"),
    (["generate", "-f", "/no/such/file"], "cannot read the prompt file"),
    (["generate", "hi", "-f", "/etc/hostname"], "not both"),
    (["generate", "hi", "--system", "x", "--no-chat"], "--system needs the chat template"),
    (["generate", "hi", "--model", "/no/such/dir"], "neither a registered name"),
    (["bench", "--gen-len", "1"], "--gen-len must be >= 2"),
    (["bench", "--batch", "0"], "--batch must be >= 1"),
    (["bench", "--batch", "1", "x"], "--batch must be an integer"),
    (["generate", "hi", "--tp", "0"], "--tp must be >= 1"),
    (["generate", "hi", "--tp", "4096"], "--tp 4096 --dp 1 --ep 1: a mesh of"),
    (["chat", "--dp", "64", "--tp", "64"], "= 4096 devices, but only"),
    (["bench", "--ep", "4096"], "= 4096 devices, but only"),
    (["bench", "--compile-only"], "--compile-only lowers a --preset"),
    (["bench", "--num-layers", "2"], "--num-layers cuts a --preset"),
    (["serve", "--preset", "llama3-8b"], "--preset and --random-weights go together"),
    (["serve", "--num-layers", "2"], "--num-layers cuts a --preset"),
    (["serve", "--request-timeout", "0"], "--request-timeout must be > 0"),
    (["serve", "--shutdown-timeout", "x"], "--shutdown-timeout must be a number of seconds"),
    (["serve", "--max-tokens-limit", "600", "--max-model-len", "512"],
     "exceeds --max-model-len"),
    (["serve", "--tp", "4096"], "--tp 4096 --dp 1 --ep 1: a mesh of"),
])
def test_arguments_are_checked_before_loading(argv, match, capsys, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(jaxinfer, "load", no_load)
    with contextlib.suppress(SystemExit):  # argparse's own errors exit 2 by SystemExit
        assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


@pytest.mark.parametrize("host, warned", [("0.0.0.0", True), ("192.0.2.1", True),
                                           ("example.org", True), ("127.0.0.2", False),
                                           ("localhost", False), ("::1", False)])
def test_serve_warns_when_not_loopback(host, warned, caplog, capsys, monkeypatch):
    """The warning comes before the load (stopped here, before the engine process starts:
    nothing is bound)."""
    import jaxinfer.server

    def stop(args, **kwargs):
        raise RuntimeError("stopped before the load")

    monkeypatch.setattr(jaxinfer.server, "start_engine", stop)
    assert cli.main(["serve", "--host", host]) == 2
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert bool(said) == warned and all("reachable from other machines" in m and
                                        "without --api-key" in m for m in said)
    assert "stopped before the load" in capsys.readouterr().err


def test_version_models_and_help_do_not_import_jax(tmp_path):
    """`--help`, `--version` and `models` answer without importing jax (the start takes
    ~0.1 s instead of ~1 s)."""
    code = ("import sys, contextlib, io\n"
            "from jaxinfer import cli\n"
            "for argv in (['--version'], ['--help'], ['generate', '--help'], ['models']):\n"
            "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "        cli.main(argv)\n"
            "assert 'jax' not in sys.modules, 'jax was imported'\n"
            "print(cli.main(['models']))\n")
    env = {**os.environ, "JAXINFER_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "smollm2-135m-instruct (default)" in proc.stdout and "not cached" in proc.stdout


def test_models_json(capsys):
    code, out, _ = _run(capsys, "models", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and rows[0]["name"] == "smollm2-135m-instruct"
    assert {"path", "size", "cached", "verified"} <= set(rows[0])


def test_memory_refusal_before_allocating(capsys, monkeypatch):
    """The README's `bench --preset llama3-8b` in float32 needs ~32 GB of host memory: refused
    with the numbers and a remedy before a byte is allocated (here under a 16 GB cap, so the
    test does not depend on the machine)."""
    monkeypatch.setenv("JAXINFER_MEMORY_LIMIT", "16GB")
    monkeypatch.setattr("jaxinfer.bench.init_params", lambda *a: pytest.fail("allocated"))
    code, _, err = _run(capsys, "bench", "--preset", "llama3-8b", "--random-weights",
                        "--dtype", "float32")
    assert code == 2 and "needs about" in err and "GiB" in err
    # The remedy fits the backend: never bfloat16 on a CPU (its matmuls ~9x slower there).
    if jax.default_backend() == "cpu":
        assert "bfloat16" not in err and "quantized GGUF" in err, err
    else:
        assert "bfloat16" in err


def _spawn(args, env_extra=None, **kw):
    env = {**os.environ, "JAXINFER_COMPILATION_CACHE": "0", **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "jaxinfer.cli", *args], env=env, **kw)


def test_sigint_exits_130_quietly(tiny_chat_dir, capsys, monkeypatch):
    """Ctrl-C (a SIGINT to the process, as the terminal sends it) mid-generation: exit 130, no
    traceback. The signal goes out at the third streamed decode step: a timer's could land
    after the tiny model's 400 tokens (compiled by an earlier test) had all come."""
    steps = []

    def interrupted_step(*args, **kwargs):
        steps.append(1)
        if len(steps) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return decode_step(*args, **kwargs)

    monkeypatch.setattr(generate_module, "decode_step", interrupted_step)
    code, _, err = _run(capsys, "generate", "Tell me a long story.", "-n", "400",
                        "--no-chat", "--model", str(tiny_chat_dir))
    assert code == 130 and "Traceback" not in err, err


def test_broken_pipe_exits_141_quietly(tiny_chat_dir):
    """A reader that goes away (`| head -c 1`): exit 141 as after SIGPIPE, no traceback, also
    not from the interpreter's last flush of stdout."""
    p = _spawn(["generate", "Tell me a long story.", "-n", "400", "--no-chat",
                "--model", str(tiny_chat_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.read(1)
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=60) == 141 and b"Traceback" not in err, err.decode()


def test_chat_commands_through_a_terminal(tiny_chat_dir, tmp_path):
    """`jaxinfer chat` on a pseudo-terminal (its controlling terminal, so Ctrl-C is a SIGINT
    from the line discipline, as for a user): an empty line does not end it, Ctrl-C stops a
    reply (or clears the line) and the session goes on, /reset and /system answer, Ctrl-D
    quits with 0 and the history is saved."""
    import pty

    env = {**os.environ, "JAXINFER_COMPILATION_CACHE": "0", "JAXINFER_CACHE": str(tmp_path)}
    # A new session whose controlling terminal is the pty (no fork of this threaded process).
    takes_tty = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                 "os.execv(sys.executable, [sys.executable, '-m', 'jaxinfer.cli', *sys.argv[1:]])")
    leader, follower = pty.openpty()
    p = subprocess.Popen([sys.executable, "-c", takes_tty, "chat", "-n", "200", "--model",
                          str(tiny_chat_dir)], env=env, stdin=follower, stdout=follower,
                         stderr=follower, start_new_session=True)
    os.close(follower)
    seen = b""

    def expect(*markers: bytes, timeout=60.0) -> bytes:
        """Read until one of `markers` shows; return it and drop what came before."""
        nonlocal seen
        end = time.monotonic() + timeout
        while not any(m in seen for m in markers):
            left = end - time.monotonic()
            if left <= 0 or not select.select([leader], [], [], left)[0]:
                pytest.fail(f"none of {markers} in the chat's output: "
                            f"{seen.decode(errors='replace')}")
            seen += os.read(leader, 4096)
        found = min((m for m in markers if m in seen), key=seen.index)
        seen = seen[seen.index(found) + len(found):]
        return found

    try:
        expect(b"Ctrl-C stops a reply")
        expect(b"> ")
        os.write(leader, b"\n")  # an empty line: a new prompt, not the end
        expect(b"> ")
        os.write(leader, b"Hello there\n")
        expect(b"\r\n> ")  # the reply ended and a new prompt is up
        os.write(leader, b"Tell me everything\n")
        time.sleep(0.5)
        os.write(leader, b"\x03")  # Ctrl-C: stops the reply (or, if it ended, the line)
        expect(b"[stopped]", b"(Ctrl-D or /exit to quit)")
        os.write(leader, b"/reset\n")
        expect(b"(conversation cleared)")
        os.write(leader, b"/system You are terse.\n")
        expect(b"(system message set")
        # Ctrl-D only at the prompt: sent while the tty is still in canonical mode (before
        # readline reads), the line discipline's EOF mark can reach readline as another byte
        expect(b"> ")
        os.write(leader, b"\x04")  # Ctrl-D
        assert p.wait(timeout=60) == 0, seen.decode(errors="replace")
    finally:
        if p.poll() is None:
            p.kill()
        os.close(leader)
    assert (tmp_path / "chat_history").exists()


def test_chat_exit_words_and_empty_lines(tiny_chat_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("\nHi\n\n/quit\nnever sent\n"))
    code, out, err = _run(capsys, "chat", "-n", "4", "--model", str(tiny_chat_dir))
    # four prompts ("> "): the empty line, Hi (one reply line), the empty line, /quit
    assert code == 0 and out.count("> ") == 4 and out.count("\n") == 1
    for word in ("exit", "quit", "/exit"):
        monkeypatch.setattr(sys, "stdin", io.StringIO(f"{word}\nnever sent\n"))
        assert _run(capsys, "chat", "--model", str(tiny_chat_dir))[:2] == (0, "> ")


def test_compilation_cache_is_reused_across_processes(tiny_chat_dir, tmp_path):
    """A second process loads the executables from $JAXINFER_CACHE/xla instead of compiling:
    a new -n adds no entry (JAX keys entries on the program, jax version and device, so
    another plan compiles afresh)."""
    xla = tmp_path / "xla"

    def run(*extra):
        env = {**os.environ, "JAXINFER_CACHE": str(tmp_path), "JAXINFER_COMPILATION_CACHE": "1"}
        # the suite's own cache (tests/conftest.py) would win over $JAXINFER_CACHE/xla
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        env.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)
        proc = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "generate", "Say hi.",
                               "--model", str(tiny_chat_dir), *extra], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return {p.name for p in xla.iterdir()}

    def steps(names):  # small helpers join the cache only past JAX's compile-time threshold,
        # which a loaded machine crosses in one run and not the other: the two steps count
        return {n for n in names if n.startswith(("jit_prefill", "jit__decode_step"))}

    first = steps(run("-n", "8"))
    assert any(n.startswith("jit_prefill") for n in first)
    assert any(n.startswith("jit__decode_step") for n in first)
    assert steps(run("-n", "12")) == first


# ------------------------------------------------------------------- what a new user ran into


@pytest.mark.parametrize("argv", [["generate", "hi", "--no-such-flag"], ["no-such-command"],
                                  ["bench", "--policy", "fastest"], []])
def test_argparse_errors_are_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("jaxinfer: error: ")
    assert "--help" in err and "usage:" not in err


def test_help_names_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    summary = out[out.index("\n\n"):out.index("positional arguments")]
    for command in ("generate", "chat", "serve", "quantize", "models", "bench"):
        assert f"`{command}`" in summary, summary


def test_bench_prints_a_header_and_each_row_once(tiny_chat_dir, capsys):
    code, out, _ = _run(capsys, "bench", "--model", str(tiny_chat_dir), "--batch", "1", "2",
                        "--prompt-len", "8", "--gen-len", "4", "--repeats", "1")
    # On CPU the bench ends with one line on llama.cpp (quant-cpu's peer note), no row of its
    lines = [line for line in out.splitlines() if not line.startswith("llama.cpp:")]
    assert code == 0 and len(lines) == 3 and len(out.splitlines()) <= 4, out
    assert lines[0].startswith("model") and "decode" in lines[0]
    assert "B=1" in lines[1] and "B=2" in lines[2]
    code, out, _ = _run(capsys, "bench", "--model", str(tiny_chat_dir), "--prompt-len", "8",
                        "--gen-len", "4", "--repeats", "1", "--json")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 3 and json.loads(lines[2])["batch"] == 1, out


def test_missing_chat_template_is_found_before_the_load(tiny_chat_dir, tmp_path, capsys,
                                                         monkeypatch):
    plain = tmp_path / "no_template"
    plain.mkdir()
    for f in tiny_chat_dir.iterdir():
        if f.name == "tokenizer_config.json":
            config = json.loads(f.read_text())
            config.pop("chat_template", None)
            (plain / f.name).write_text(json.dumps(config))
        elif f.name != "chat_template.jinja":
            (plain / f.name).symlink_to(f)

    def no_load(*a, **k):
        raise AssertionError("loaded before the chat template was checked")

    monkeypatch.setattr(jaxinfer, "load", no_load)
    code, _, err = _run(capsys, "chat", "--model", str(plain))
    assert code == 2 and "has no chat template" in err and "--no-chat" in err
    code, _, err = _run(capsys, "generate", "hi", "--system", "Be terse.", "--model", str(plain))
    assert code == 2 and "has no chat template" in err
    with pytest.raises(AssertionError, match="loaded before"):  # the template is there
        cli.main(["chat", "--model", str(tiny_chat_dir)])


@pytest.mark.network
def test_requantizing_a_quantized_gguf_is_said(tiny_chat_dir, caplog, monkeypatch):
    """The embedded model is a Q4_1 GGUF: --quantization int4 re-quantizes dequantized blocks,
    which is said before the load; a 32-bit HF directory quantizes without a word."""
    monkeypatch.setattr(jaxinfer, "load", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("stopped at the load")))
    assert cli.main(["generate", "hi", "--quantization", "int4"]) == 2
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and "already quantized (Q4_1)" in said[0] and "int4" in said[0]
    caplog.clear()
    assert cli.main(["generate", "hi", "--quantization", "int4", "--model",
                     str(tiny_chat_dir)]) == 2
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_waits_show_on_a_terminal_only():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        with cli._waiting("loading a model", after=0.05, stream=stream):
            time.sleep(0.8)
    assert "loading a model... 0 s" in tty.getvalue() and pipe.getvalue() == ""
    quick = Tty()
    with cli._waiting("loading a model", after=1.0, stream=quick):
        pass  # a wait under the threshold shows nothing
    assert quick.getvalue() == ""


def test_int8_activations_flag_sets_the_policy():
    """--int8-activations (generate, chat, serve, bench) asks for KernelPolicy's
    cpu_int8_activations; without it the default policy (None) loads."""
    from jaxinfer import cli

    on = cli.build_parser().parse_args(["generate", "hi", "--int8-activations"])
    assert cli._policy(on).cpu_int8_activations
    assert cli._policy(cli.build_parser().parse_args(["generate", "hi"])) is None
