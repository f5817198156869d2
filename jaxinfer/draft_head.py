"""Draft heads over the target's features: an EAGLE-1 style head (trained in-process,
`jaxinfer train-draft`, jaxinfer/train_draft.py) and DeepSeek-V3's multi-token-prediction
(MTP) module from its checkpoint. Both are one decoder layer of the target's family:

    f_i    the target's feature at position i: its final-normed hidden state, the LM head's
           input (forward(..., hidden=True)); the target predicts token i+1 from it
    x_i    = fc([enorm(emb(t_i)), hnorm(f_{i-1})])     [B, T, 2D] @ [2D, D]; f_{-1} = 0
    g_i    = norm(layer(x_i))                          one decoder layer, its own KV cache
                                                       (slot i: the pair (t_i, f_{i-1}))
    logits = head(g_i)                                 the draft of token i+1

g_i is the head's estimate of f_i: drafting feeds it back as the feature of the next step
(the target's own f only exists for verified positions). EAGLE head: no enorm / hnorm
(EAGLE-1's fc takes the raw embedding and feature), a dense layer, the target's final norm
and LM head (shared, frozen). MTP: enorm, hnorm, eh_proj, the checkpoint's block (an MoE
layer in V3), shared_head.norm and shared_head.head, the target's embedding; its slot i holds
the pair vLLM puts at slot i - 1 (RoPE attention depends on position differences only).

A head saved here is a safetensors file whose metadata names the target it was trained on
(architecture, sizes, a fingerprint of the embedding table); loading it for another model is
refused.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

# The loader of a model's weights skips files of this format (a head saved beside them).
from checkpoints.hf import DRAFT_HEAD_FORMAT as HEAD_FORMAT
from jaxinfer import ops
from jaxinfer.configs import Config
from jaxinfer.models import registry
from jaxinfer.plan import Plan
from jaxinfer.weights import Dense, Kind, ParamSpec, cast_floating, check_params, init_params, typed


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """The static part of a head (a jit key): which kind, and the plan of its one layer (the
    target's config with one layer)."""

    kind: str  # "eagle" | "mtp"
    plan: Plan
    rejection: bool = False  # rejection sampling for sampled rows (speculative.py)
    adaptive: bool = True  # plain steps while its drafts are mostly rejected (speculative.py)
    min_gain: float | None = None  # ... below this many accepted (None: speculative.MIN_GAIN)


@dataclasses.dataclass(frozen=True, eq=False)
class FeatureHead:
    """A draft head (module docstring): spec and params. params: {"fc": [2D, D], "layer": the
    family's layer params}, and for MTP also "enorm", "hnorm", "norm" [D] and "head" [D, V]."""

    spec: HeadSpec
    params: dict
    fingerprint: dict  # target_fingerprint() of the model it belongs to
    # Sampled rows accept by rejection sampling (min(1, p/q), the head's law q) instead of
    # the coupled rule: dataclasses.replace(head, rejection=True).
    rejection: bool = False
    # generate() takes plain decode steps while the head's drafts are mostly rejected
    # (speculative.py, MIN_GAIN); False: a verification every round.
    adaptive: bool = True
    # The accepted drafts per verification (a recent average) below which rounds are plain
    # steps; None: speculative.MIN_GAIN.
    min_gain: float | None = None


def head_config(config: Config, kind: str) -> Config:
    """The one-layer config of a head over a target with `config`: EAGLE's layer is dense
    with full attention; MTP's block is an MoE layer where the target's layer at its index
    (num_layers) would be one."""
    moe = None
    if kind == "mtp" and config.is_moe_layer(config.num_layers):
        moe = config.moe.replace(first_dense_layers=0, dense_layers=(), sparse_step=1)
    return config.replace(num_layers=1, layer_windows=(), moe=moe,
                          tie_word_embeddings=config.tie_word_embeddings and kind == "eagle")


def _layer_specs(spec: HeadSpec) -> dict:
    config = spec.plan.config
    return registry.family(config).param_specs(config)["layers"][0]


def head_specs(spec: HeadSpec) -> dict:
    """The head's params as ParamSpecs (a fan-in scaled fc, the family's layer)."""
    d, v = spec.plan.config.hidden_size, spec.plan.config.vocab_size
    specs = {"fc": ParamSpec((2 * d, d), (None, "embed"), kind=Kind.DENSE),
             "layer": _layer_specs(spec)}
    if spec.kind == "mtp":
        specs.update(enorm=ParamSpec((d,), ("embed",), "ones"),
                     hnorm=ParamSpec((d,), ("embed",), "ones"),
                     norm=ParamSpec((d,), ("embed",), "ones"),
                     head=ParamSpec((d, v), ("embed", "vocab"), kind=Kind.DENSE))
    return specs


def target_fingerprint(model) -> dict:
    """What identifies the target a head belongs to: its architecture, sizes, and the sum of
    |embedding| over the dequantized table (the same for its float32, bf16 and quantized
    loads to ~1e-3; another model's differs far more)."""
    config = model.config
    total = float(_embed_abs_sum(model.params["embed"], model.plan))
    return {"architecture": config.architecture, "hidden_size": str(config.hidden_size),
            "vocab_size": str(config.vocab_size), "embed_abs_sum": f"{total:.8e}"}


@functools.partial(jax.jit, static_argnames=("plan",))
def _embed_abs_sum(embed, plan) -> jax.Array:
    """sum |E| over the dequantized table -> [] float32, in one executable (checked on every
    `generate` with a head: op by op it cost 16 host syncs a call)."""
    v = plan.config.vocab_size
    total = jnp.zeros((), jnp.float32)
    for start in range(0, v, 8192):  # a table at a time would be [V, D] float32
        ids = jnp.arange(start, min(start + 8192, v), dtype=jnp.int32)[None]
        rows = ops.embed(embed, ids, plan)  # [1, n, D]
        total += jnp.sum(jnp.abs(rows.astype(jnp.float32)))
    return total


def check_fingerprint(head_fp: dict, model, where: str) -> None:
    """Refuse a head made for another model, naming what differs."""
    mine = target_fingerprint(model)
    for key in ("architecture", "hidden_size", "vocab_size"):
        if head_fp.get(key) != mine[key]:
            raise ValueError(f"{where} was made for another model: its {key} is "
                             f"{head_fp.get(key)!r}, this model's {mine[key]!r}; train a head "
                             "for this model with `jaxinfer train-draft`")
    theirs, ours = float(head_fp.get("embed_abs_sum", "nan")), float(mine["embed_abs_sum"])
    if not abs(theirs - ours) <= 1e-3 * abs(ours):
        raise ValueError(f"{where} was made for another model of the same shape (its "
                         f"embedding table differs: sum |E| {theirs:.6e} vs this model's "
                         f"{ours:.6e}); train a head for this model with `jaxinfer train-draft`")


def spec_for(model, kind: str) -> HeadSpec:
    """The HeadSpec of a `kind` head over `model` (its plan, one layer)."""
    return HeadSpec(kind, dataclasses.replace(model.plan, config=head_config(model.config, kind)))


def init_eagle(model, key: jax.Array | int = 0) -> FeatureHead:
    """A fresh EAGLE head for `model` in float32 (random fc and layer, fan-in scaled)."""
    if model.sharding is not None:
        raise ValueError("draft heads run on one device; load the model without a mesh")
    spec = spec_for(model, "eagle")
    spec = dataclasses.replace(spec, plan=dataclasses.replace(
        spec.plan, config=spec.plan.config.replace(dtype="float32")))
    key = jax.random.key(key) if isinstance(key, int) else key
    params = init_params(head_specs(spec), key, jnp.float32)
    return FeatureHead(spec, params, target_fingerprint(model))


def for_model(head: FeatureHead, model) -> FeatureHead:
    """The head with its plan's policy and dtype those of `model`'s plan (a head trained in
    float32 runs in a bf16 model's dtype; its fc and layer are cast)."""
    config = head.spec.plan.config.replace(dtype=model.config.dtype)
    spec = HeadSpec(head.spec.kind, dataclasses.replace(model.plan, config=config))
    params = cast_floating(head.params, config.dtype, head_specs(spec))
    return dataclasses.replace(head, spec=spec, params=params)


# ---------------------------------------------------------------------------------------------
# The forward (jit-traced by its callers)
# ---------------------------------------------------------------------------------------------


def forward(head_params: dict, target_params: dict, tokens: jax.Array, feats: jax.Array,
            positions: jax.Array, spec: HeadSpec, cache=None, logits_at=None,
            fresh: bool = False):
    """The head at tokens [B, T] with the features before them feats [B, T, D] (f_{i-1} for
    token t_i) at positions [B, T] -> (logits [B, T or 1, V] float32, cache, g [B, T, D])."""
    plan = spec.plan
    config = plan.config
    e = ops.embed(target_params["embed"], tokens, plan)  # [B, T, D]
    f = feats.astype(e.dtype)
    if spec.kind == "mtp":
        e = ops.norm(e, head_params["enorm"], config.rms_norm_eps, plan)
        f = ops.norm(f, head_params["hnorm"], config.rms_norm_eps, plan)
    x = ops.linear(jnp.concatenate([e, f], axis=-1), head_params["fc"], plan)  # [B, T, D]
    if spec.kind == "mtp":
        wired = {"embed": target_params["embed"], "layers": [head_params["layer"]],
                 "final_norm": head_params["norm"], "lm_head": head_params["head"]}
    else:
        wired = {"embed": target_params["embed"], "layers": [head_params["layer"]],
                 "final_norm": target_params["final_norm"]}
        if not config.tie_word_embeddings:
            wired["lm_head"] = target_params["lm_head"]
    return registry.family(config).forward(wired, tokens, positions, plan, cache,
                                           logits_at=logits_at, fresh=fresh, embeds=x,
                                           hidden=True)


# ---------------------------------------------------------------------------------------------
# Files: an EAGLE head as safetensors; DeepSeek-V3's MTP module from its checkpoint
# ---------------------------------------------------------------------------------------------


def default_path(source) -> pathlib.Path:
    """Where a model's head lives: eagle_head.safetensors in an HF directory, <name>.eagle-
    head.safetensors beside a .gguf file."""
    path = pathlib.Path(source)
    if path.is_dir():
        return path / "eagle_head.safetensors"
    return path.with_name(path.stem + ".eagle-head.safetensors")


def _raw(w) -> np.ndarray:
    return np.asarray(w.w if isinstance(w, Dense) else w, np.float32)


def save(head: FeatureHead, path) -> pathlib.Path:
    """The head's float32 params and its target's fingerprint -> safetensors at path."""
    from safetensors.numpy import save_file

    if head.spec.kind != "eagle":
        raise ValueError("only EAGLE heads are saved (an MTP module lives in its checkpoint)")
    path = pathlib.Path(path)
    tensors = {"fc": _raw(head.params["fc"])}
    tensors.update({f"layer.{k}": _raw(v) for k, v in head.params["layer"].items()})
    meta = {"format": HEAD_FORMAT, **{f"target.{k}": v for k, v in head.fingerprint.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path


def load(path, model) -> FeatureHead:
    """An EAGLE head saved by `save`, for `model`: refused with a clear error when the file
    is not a head, or was made for another model (before anything is compiled)."""
    from safetensors import safe_open

    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"no draft head at {path}; train one with `jaxinfer train-draft MODEL "
                         "--data FILE` (or give its path)")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise ValueError(f"{path}: cannot read safetensors ({e})") from e
    if meta.get("format") != HEAD_FORMAT:
        raise ValueError(f"{path} is not a jaxinfer draft head (metadata format "
                         f"{meta.get('format')!r}, expected {HEAD_FORMAT!r})")
    check_fingerprint({k[len("target."):]: v for k, v in meta.items()
                       if k.startswith("target.")}, model, f"the draft head {path}")
    spec = spec_for(model, "eagle")
    params = {"fc": tensors.pop("fc"),
              "layer": {k[len("layer."):]: v for k, v in tensors.items()
                        if k.startswith("layer.")}}
    specs = head_specs(spec)
    try:
        check_params(params, specs)
    except ValueError as e:
        raise ValueError(f"{path}: its tensors do not fit this model's head: {e}") from None
    params = cast_floating(typed(params, specs), model.config.dtype, specs)
    return FeatureHead(spec, params, target_fingerprint(model))


def load_mtp(model) -> FeatureHead:
    """DeepSeek-V3's MTP module (the first of num_nextn_predict_layers) from the checkpoint
    the model was loaded from: `model.layers.{num_layers}.*` (enorm, hnorm, eh_proj, the
    decoder block, shared_head.norm, shared_head.head). A model without them: ValueError."""
    from checkpoints.deepseek import read_mtp

    config = model.config
    where = model.source or "this model"
    if config.family != "deepseek" or model.source is None:
        raise ValueError(f"--speculative mtp needs a DeepSeek-V3 checkpoint with MTP weights "
                         f"(num_nextn_predict_layers); {where} ({config.architecture}) has "
                         "none")
    spec = spec_for(model, "mtp")
    params = read_mtp(model.source, config, spec.plan.config)
    specs = head_specs(spec)
    check_params(params, specs)
    params = cast_floating(typed(params, specs), config.dtype, specs)
    return FeatureHead(spec, params, target_fingerprint(model))
