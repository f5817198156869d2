"""Our quantized checkpoints: an HF-layout directory whose model.safetensors holds params in our
layout, quantized weights as their codes and scales, so a load needs no re-quantization.

    save_quantized(dst, config, params, src_dir)   written by `jaxinfer quantize SRC DST`
    load_quantized(path, config)                   read by checkpoints.hf.load_hf_dir

The directory keeps the source's config.json and tokenizer files (so the Config and the
tokenizer load as from the source). model.safetensors names each array by its param path
("layers.3.wqkv.planes.0", "layers.3.wqkv.scale", "final_norm", ...); its metadata (FORMAT
under "format") lists every QuantizedWeight with its static layout. fp8 codes are stored as
their uint8 bits (safetensors' numpy side has no float8).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import ml_dtypes
import numpy as np

from jaxinfer.configs import Config
from jaxinfer.weights import QuantizedWeight

FORMAT = "jaxinfer-quantized-1"
WEIGHTS_FILE = "model.safetensors"
_FIELDS = ("scale", "offset", "super_scale", "super_offset")
_STATIC = ("k", "out_shape", "bits", "group", "super_group", "tile", "code_offset", "name")


def _leaves(params, prefix=""):
    """(name, leaf) pairs of a params tree (dicts and lists), QuantizedWeights as leaves."""
    if isinstance(params, dict):
        for k, v in params.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(params, list | tuple):
        for i, v in enumerate(params):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], params


def save_quantized(dst: str | pathlib.Path, params, src_dir: str | pathlib.Path) -> pathlib.Path:
    """Write params (typed, with QuantizedWeights) to dst as our checkpoint, beside a copy of
    src_dir's config.json and tokenizer files. dst must not exist or be an empty directory."""
    from safetensors.numpy import save_file

    dst, src_dir = pathlib.Path(dst), pathlib.Path(src_dir)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{dst}: exists and is not an empty directory; give a new path")
    tensors, weights = {}, {}
    for name, leaf in _leaves(params):
        if isinstance(leaf, QuantizedWeight):
            if leaf.layout == "nk":  # the file keeps the tiles layout (the Mosaic kernel's
                from pallas_kernels.quantized_mgpu import to_tiles  # is made on load)
                leaf = to_tiles(leaf)
            weights[name] = {f: list(getattr(leaf, f)) if isinstance(getattr(leaf, f), tuple)
                             else getattr(leaf, f) for f in _STATIC}
            weights[name]["float8"] = bool(leaf.float8)
            for i, p in enumerate(leaf.planes):
                p = np.asarray(p)
                tensors[f"{name}.planes.{i}"] = p.view(np.uint8) if leaf.float8 else p
            for f in _FIELDS:
                if getattr(leaf, f) is not None:
                    tensors[f"{name}.{f}"] = np.asarray(getattr(leaf, f))
        else:
            # A Dense left unquantized is stored as its array: the spec says its orientation.
            a = np.asarray(leaf.w if hasattr(leaf, "w") else leaf)
            tensors[name] = a.astype(np.float32) if str(a.dtype) == "bfloat16" else a
    dst.mkdir(parents=True, exist_ok=True)
    for f in src_dir.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json",
                                                 ".bin", ".pt", ".gguf")):
            shutil.copy2(f, dst / f.name)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(dst / WEIGHTS_FILE),
              metadata={"format": FORMAT, "weights": json.dumps(weights)})
    return dst


def saved_format(files: list[pathlib.Path]) -> str | None:
    """The "format" metadata of a one-file checkpoint (None for HF's own files)."""
    if len(files) != 1:
        return None
    from safetensors import safe_open

    try:
        with safe_open(files[0], framework="numpy") as st:
            return (st.metadata() or {}).get("format")
    except Exception:  # unreadable: the HF reader reports it with its own message
        return None


def looks_quantized(names) -> bool:
    """Tensor names of ours (a quantized weight's codes) in a file without our metadata."""
    return any(n.endswith(".planes.0") for n in names)


def load_quantized(path: pathlib.Path, config: Config, transform=None) -> dict:
    """Our params tree (numpy arrays, QuantizedWeights) from dst's model.safetensors, read one
    param at a time; transform(name, value), when given, maps each as it is read ("embed",
    "layers.3.wqkv": a sharded load places it)."""
    from safetensors import safe_open

    f = path / WEIGHTS_FILE
    transform = transform or _as_read
    try:
        with safe_open(f, framework="numpy") as st:
            meta = st.metadata() or {}
            if meta.get("format") != FORMAT or "weights" not in meta:
                raise ValueError(f"{f}: the quantized checkpoint's metadata is missing or of "
                                 f"another version (format {meta.get('format')!r}, expected "
                                 f"{FORMAT!r}); write it again with `jaxinfer quantize`")
            weights = json.loads(meta["weights"])
            rest = set(st.keys())
            leaves = {}
            for name, info in weights.items():
                leaves[name] = transform(name, _quantized(st, f, name, info, rest))
            for name in sorted(rest):  # plain arrays: norms, biases, unquantized weights
                leaves[name] = transform(name, st.get_tensor(name))
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"{f}: cannot read the quantized checkpoint ({e}); the file is "
                         "truncated or corrupt, write it again with `jaxinfer quantize`") from e
    params: dict = {"layers": [{} for _ in range(config.num_layers)]}
    for name, leaf in leaves.items():
        parts = name.split(".")
        if parts[0] == "layers":
            params["layers"][int(parts[1])][".".join(parts[2:])] = leaf
        else:
            params[name] = leaf
    return params


def _as_read(name: str, value):
    return value


def _quantized(st, f: pathlib.Path, name: str, info: dict, rest: set) -> QuantizedWeight:
    """One QuantizedWeight read from the open file (its tensors taken out of `rest`)."""
    planes = []
    while f"{name}.planes.{len(planes)}" in rest:
        rest.discard(key := f"{name}.planes.{len(planes)}")
        p = st.get_tensor(key)
        planes.append(p.view(ml_dtypes.float8_e4m3fn) if info["float8"] else p)
    if not planes or f"{name}.scale" not in rest:
        raise ValueError(f"{f}: quantized weight {name!r} ({info.get('name')}) has no codes "
                         "or no scales; the file is incomplete")
    parts = {}
    for fld in _FIELDS:
        key = f"{name}.{fld}"
        parts[fld] = st.get_tensor(key) if key in rest else None
        rest.discard(key)
    static = {k: tuple(v) if isinstance(v, list) else v for k, v in info.items() if k in _STATIC}
    return QuantizedWeight(tuple(planes), **parts, **static)
