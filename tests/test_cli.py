"""The `jaxinfer` command: generate (text and JSON), chat, and clear errors."""

import io
import json
import sys

import pytest

from jaxinfer import cli


def test_generate_json(capsys):
    assert cli.main(["generate", "What is the capital of France?", "--json",
                     "--max-new-tokens", "16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "Paris" in out["text"] and out["finish_reason"] == "stop"


def test_generate_streams_text(capsys):
    assert cli.main(["generate", "What is the capital of France?", "--max-new-tokens", "16"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_chat_two_turns(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\nAnd of Italy?\n\n"))
    assert cli.main(["chat", "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "Rome" in out


@pytest.mark.parametrize("argv, match", [
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--top-p", "0"], "top_p"),
    (["generate", "hi", "--model", "no-such-model"], "no-such-model"),
    (["generate", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
])
def test_errors_are_clear(argv, match, capsys):
    assert cli.main(argv) == 2
    assert match in capsys.readouterr().err
