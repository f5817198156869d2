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
and LM head (shared, frozen), or with a draft vocabulary (EAGLE-3's d2t) its own readout over the N
tokens it drafts from, initialized from the target's LM head columns and trained: drafting
then reads D x N head weights per draft instead of D x V (Llama-3: 32k of 128k tokens, 0.27
of 1.05 GB a draft), and its logits elsewhere are -inf (a draft law q without those tokens:
exact under rejection sampling, and the coupled rule only compares tokens). MTP: enorm,
hnorm, eh_proj, the checkpoint's block (an MoE layer in V3), shared_head.norm and
shared_head.head, the target's embedding; its slot i holds the pair vLLM puts at slot i - 1
(RoPE attention depends on position differences only).

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
from jaxinfer.weights import (Dense, Kind, ParamSpec, as_array, cast_floating, check_params,
                              init_params, is_transposed, typed)


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """The static part of a head (a jit key): which kind, and the plan of its one layer (the
    target's config with one layer)."""

    kind: str  # "eagle" | "mtp"
    plan: Plan
    rejection: bool = False  # rejection sampling for sampled rows (speculative.py)
    adaptive: bool = True  # plain steps while its drafts are mostly rejected (speculative.py)
    min_gain: float | None = None  # ... below this many accepted (None: speculative.MIN_GAIN)
    draft_vocab: int = 0  # tokens it drafts from (params "vocab_head", "d2t"); 0: all V


@dataclasses.dataclass(frozen=True, eq=False)
class FeatureHead:
    """A draft head (module docstring): spec and params. params: {"fc": [2D, D], "layer": the
    family's layer params}, with a draft vocabulary also "vocab_head" [D, N] and "d2t" [N]
    int32 (the target's ids of its N tokens, ascending), and for MTP "enorm", "hnorm", "norm"
    [D] and "head" [D, V]."""

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


def head_config(config: Config, kind: str, draft_vocab: int = 0) -> Config:
    """The one-layer config of a head over a target with `config`: EAGLE's layer is dense
    with full attention; MTP's block is an MoE layer where the target's layer at its index
    (num_layers) would be one. A draft vocabulary's readout is the head's own (untied)."""
    moe = None
    if kind == "mtp" and config.is_moe_layer(config.num_layers):
        moe = config.moe.replace(first_dense_layers=0, dense_layers=(), sparse_step=1)
    tied = config.tie_word_embeddings and kind == "eagle" and not draft_vocab
    return config.replace(num_layers=1, layer_windows=(), moe=moe, tie_word_embeddings=tied)


def _layer_specs(spec: HeadSpec) -> dict:
    config = spec.plan.config
    return registry.family(config).param_specs(config)["layers"][0]


def head_specs(spec: HeadSpec) -> dict:
    """The head's params as ParamSpecs (a fan-in scaled fc, the family's layer)."""
    d, v = spec.plan.config.hidden_size, spec.plan.config.vocab_size
    specs = {"fc": ParamSpec((2 * d, d), (None, "embed"), kind=Kind.DENSE),
             "layer": _layer_specs(spec)}
    if spec.draft_vocab:
        n = spec.draft_vocab
        specs.update(vocab_head=ParamSpec((d, n), ("embed", None), kind=Kind.DENSE),
                     d2t=ParamSpec((n,), (None,), "zeros", dtype="int32"))
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


def spec_for(model, kind: str, draft_vocab: int = 0) -> HeadSpec:
    """The HeadSpec of a `kind` head over `model` (its plan, one layer)."""
    config = head_config(model.config, kind, draft_vocab)
    return HeadSpec(kind, dataclasses.replace(model.plan, config=config),
                    draft_vocab=draft_vocab)


def check_d2t(d2t, vocab_size: int, where: str) -> np.ndarray:
    """A draft vocabulary: distinct target token ids in [0, V), ascending -> int32 [N]."""
    d2t = np.asarray(d2t)
    if d2t.ndim != 1 or not len(d2t) or not np.issubdtype(d2t.dtype, np.integer):
        raise ValueError(f"{where}: a draft vocabulary is a non-empty 1-D list of token ids")
    if d2t.min() < 0 or d2t.max() >= vocab_size or np.any(np.diff(d2t) <= 0):
        raise ValueError(f"{where}: a draft vocabulary's ids must be distinct, ascending and "
                         f"in [0, {vocab_size})")
    return d2t.astype(np.int32)


def frequent_tokens(tokens: np.ndarray, n: int, vocab_size: int) -> np.ndarray:
    """The n most frequent ids of a token stream (ties and unseen ids by id), ascending: a
    draft vocabulary, as EAGLE-3 picks its d2t from its training data."""
    counts = np.bincount(np.asarray(tokens, np.int64), minlength=vocab_size)[:vocab_size]
    return np.sort(np.argsort(-counts, kind="stable")[:n]).astype(np.int32)


def _readout_columns(model, d2t: np.ndarray) -> jax.Array:
    """The target's LM head columns of the ids d2t [N] -> [D, N] float32 (its tied embedding
    rows, or the head dequantized)."""
    ids = jnp.asarray(d2t)
    if model.config.tie_word_embeddings:
        return ops.embed(model.params["embed"], ids[None], model.plan)[0].T.astype(jnp.float32)
    w = model.params["lm_head"]
    full = as_array(w, jnp.float32)  # [D, V], or a transposed Dense's [V, D]
    full = full.T if is_transposed(w) else full
    return jnp.take(full.astype(jnp.float32), ids, axis=1)


def init_eagle(model, key: jax.Array | int = 0, d2t=None) -> FeatureHead:
    """A fresh EAGLE head for `model` in float32 (random fc and layer, fan-in scaled); with a
    draft vocabulary d2t (target ids, ascending) its readout starts as the target's LM head
    columns of those ids."""
    if model.sharding is not None:
        raise ValueError("draft heads run on one device; load the model without a mesh")
    if d2t is not None:
        d2t = check_d2t(d2t, model.config.vocab_size, "init_eagle")
    spec = spec_for(model, "eagle", 0 if d2t is None else len(d2t))
    spec = dataclasses.replace(spec, plan=dataclasses.replace(
        spec.plan, config=spec.plan.config.replace(dtype="float32")))
    key = jax.random.key(key) if isinstance(key, int) else key
    params = init_params(head_specs(spec), key, jnp.float32)
    if d2t is not None:
        params.update(vocab_head=Dense(_readout_columns(model, d2t)), d2t=jnp.asarray(d2t))
    return FeatureHead(spec, params, target_fingerprint(model))


def for_model(head: FeatureHead, model) -> FeatureHead:
    """The head with its plan's policy and dtype those of `model`'s plan (a head trained in
    float32 runs in a bf16 model's dtype; its fc and layer are cast)."""
    config = head.spec.plan.config.replace(dtype=model.config.dtype)
    spec = dataclasses.replace(head.spec, plan=dataclasses.replace(model.plan, config=config))
    params = cast_floating(head.params, config.dtype, head_specs(spec))
    return dataclasses.replace(head, spec=spec, params=params)


# ---------------------------------------------------------------------------------------------
# The forward (jit-traced by its callers)
# ---------------------------------------------------------------------------------------------


def forward(head_params: dict, target_params: dict, tokens: jax.Array, feats: jax.Array,
            positions: jax.Array, spec: HeadSpec, cache=None, logits_at=None,
            fresh: bool = False, compact: bool = False):
    """The head at tokens [B, T] with the features before them feats [B, T, D] (f_{i-1} for
    token t_i) at positions [B, T] -> (logits [B, T or 1, V] float32, cache, g [B, T, D]);
    with a draft vocabulary -inf past its tokens, or with compact its N columns only."""
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
        if spec.draft_vocab:
            wired["lm_head"] = head_params["vocab_head"]  # [D, N]
        elif not config.tie_word_embeddings:
            wired["lm_head"] = target_params["lm_head"]
    logits, cache, g = registry.family(config).forward(
        wired, tokens, positions, plan, cache, logits_at=logits_at, fresh=fresh, embeds=x,
        hidden=True)
    if spec.draft_vocab and not compact:  # [B, T, N] -> [B, T, V]
        full = jnp.full((*logits.shape[:-1], config.vocab_size), -jnp.inf, logits.dtype)
        logits = full.at[..., head_params["d2t"]].set(logits)
    return logits, cache, g


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
    if head.spec.draft_vocab:
        tensors.update(vocab_head=_raw(head.params["vocab_head"]),
                       d2t=np.asarray(head.params["d2t"], np.int32))
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
    d2t = tensors.pop("d2t", None)
    if d2t is not None:
        d2t = check_d2t(d2t, model.config.vocab_size, str(path))
    spec = spec_for(model, "eagle", 0 if d2t is None else len(d2t))
    params = {"fc": tensors.pop("fc"),
              "layer": {k[len("layer."):]: v for k, v in tensors.items()
                        if k.startswith("layer.")}}
    if d2t is not None:
        params.update(vocab_head=tensors.pop("vocab_head", None), d2t=d2t)
        if params["vocab_head"] is None:
            raise ValueError(f"{path}: a draft vocabulary (d2t) without its vocab_head")
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
