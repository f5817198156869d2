"""`jaxinfer train-draft`: an EAGLE head (jaxinfer/draft_head.py) for a model, trained with
optax on the target's features computed on the fly.

Each step takes `batch` random windows of `seq_len` tokens from the tokenized data, runs the
frozen target over them (jitted, no cache) for its features f [B, T, D] and its next-token
law p = softmax(head(f)), then the head over the pairs (t_i, f_{i-1}), and minimises EAGLE-1's
loss: smooth L1 between the head's feature estimate g_i and f_i (the regression), plus
CLS_WEIGHT x the cross-entropy of the head's logits against p (the distribution the target
draws token i+1 from: greedy drafting wants its argmax). AdamW with warmup and cosine decay,
gradients clipped to norm 1. With a draft vocabulary (`draft_vocab`: the data's most frequent
tokens, EAGLE-3's d2t) the head's own readout over them is trained too, and the
cross-entropy takes the target's law on those tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxinfer import draft_head
from jaxinfer.models import registry
from jaxinfer.plan import Plan

log = logging.getLogger(__name__)

CLS_WEIGHT = 0.1  # EAGLE-1's weight of the classification loss beside the regression


@dataclasses.dataclass
class TrainResult:
    head: draft_head.FeatureHead
    losses: list[float]  # per step: the total loss
    accuracy: list[float]  # per step: how often the head's argmax is the target's


def read_texts(path) -> list[str]:
    """A text file (one text), or JSONL whose lines are objects with a "text" field."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"--data {path}: no such file")
    raw = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".jsonl":
        return [raw]
    texts = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ValueError(f"{path}:{n}: a JSONL line must be an object with a \"text\" "
                             "string")
        texts.append(obj["text"])
    return texts


def tokenize(model, texts: list[str], seq_len: int) -> np.ndarray:
    """The texts' tokens, one stream (each text as the tokenizer encodes it, BOS included)."""
    return tokenize_texts(model, texts, seq_len)[0]


def tokenize_texts(model, texts: list[str], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(the texts' tokens as one stream, the offset [N] where each text starts in it)."""
    if model.tokenizer is None:
        raise ValueError("train-draft needs the model's tokenizer to read --data")
    encoded = [model.tokenizer.encode(text) for text in texts]
    ids = np.asarray([t for e in encoded for t in e], np.int32)
    if len(ids) < seq_len + 1:
        raise ValueError(f"--data holds {len(ids)} tokens, fewer than one window of --seq-len "
                         f"{seq_len}; give more text or a shorter --seq-len")
    starts = np.cumsum([0] + [len(e) for e in encoded[:-1]]).astype(np.int64)
    return ids, starts


@functools.partial(jax.jit, static_argnames=("plan",))
def target_features(params, tokens: jax.Array, plan: Plan):
    """The frozen target over windows [B, T]: (features f [B, T, D], its next-token law p
    [B, T, V])."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, _, f = registry.family(plan.config).forward(params, tokens, positions, plan,
                                                        hidden=True)
    return f, jax.nn.softmax(logits, axis=-1)


def teacher_forced(head_params, target_params, tokens, f, spec: draft_head.HeadSpec,
                   compact: bool = False):
    """The head over windows tokens [B, T] (from position 0) with the target's features f
    [B, T, D], each token t_i paired with f_{i-1} (f_{-1} = 0) -> (logits [B, T, V]: row i
    drafts token i + 1, g [B, T, D]: the estimates of f). What training fits; drafting must
    give the same logits at the same positions (tests/test_draft_head.py)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    before = jnp.concatenate([jnp.zeros_like(f[:, :1]), f[:, :-1]], axis=1)  # f_{i-1}
    logits, _, g = draft_head.forward(head_params, target_params, tokens, before, positions,
                                      spec, compact=compact)
    return logits, g


def head_loss(head_params, target_params, tokens, f, p, spec: draft_head.HeadSpec):
    """EAGLE-1's loss of the head over windows tokens [B, T] given the target's f [B, T, D]
    and p [B, T, V] -> (loss, (regression, classification, argmax agreement))."""
    # compact: a draft vocabulary's N columns (the -inf elsewhere would make 0 * -inf)
    logits, g = teacher_forced(head_params, target_params, tokens, f, spec,
                               compact=True)  # [B, T, N or V]
    drafted, wanted = jnp.argmax(logits, -1), jnp.argmax(p, -1)  # [B, T]
    if spec.draft_vocab:  # the target's law on the head's tokens; the ids back to the target's
        p, drafted = p[..., head_params["d2t"]], head_params["d2t"][drafted]
    reg = jnp.mean(optax.huber_loss(g.astype(jnp.float32), f.astype(jnp.float32)))  # smooth L1
    cls = -jnp.mean(jnp.sum(p * jax.nn.log_softmax(logits, axis=-1), axis=-1))
    agree = jnp.mean(drafted == wanted)
    return reg + CLS_WEIGHT * cls, (reg, cls, agree)


def optimizer(lr: float, steps: int) -> optax.GradientTransformation:
    """AdamW with warmup (a tenth of the steps, at most 100) and cosine decay to lr / 10,
    gradients clipped to norm 1."""
    warmup = max(1, min(100, steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1),
                                                  end_value=lr / 10)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


# The target's weights are an argument, not closed over: a closure would put them in the
# program as constants (an 8B model's 16 GB) and compile it afresh at every train().
@functools.partial(jax.jit, static_argnames=("plan", "spec", "lr", "steps"))
def train_step(trained: dict, opt_state, ids: dict, params: dict, tokens: jax.Array, *,
               plan: Plan, spec: draft_head.HeadSpec, lr: float, steps: int):
    """One step of the head's trained weights on windows tokens [B, T] (ids: its draft
    vocabulary's d2t, or empty; lr, steps: optimizer()'s) -> (trained, opt_state, loss,
    (regression, classification, agreement))."""
    def loss_of(trained, f, p):
        return head_loss({**trained, **ids}, params, tokens, f, p, spec)

    f, p = target_features(params, tokens, plan)
    (loss, aux), grads = jax.value_and_grad(loss_of, has_aux=True)(trained,
                                                                   f.astype(jnp.float32), p)
    updates, opt_state = optimizer(lr, steps).update(grads, opt_state, trained)
    return optax.apply_updates(trained, updates), opt_state, loss, aux


def train(model, data: np.ndarray, steps: int, *, lr: float = 1e-3, seq_len: int = 128,
          batch: int = 8, seed: int = 0, progress: bool = True,
          starts: np.ndarray | None = None, draft_vocab: int = 0) -> TrainResult:
    """Train a fresh EAGLE head for `model` on token stream `data` for `steps` steps.
    draft_vocab: the head drafts from the data's that many most frequent tokens (0, or the
    model's vocabulary or more: all of them).
    starts: the offsets windows may start at (default any). The target's features are
    computed over the window alone, so a window cut mid-text gives features without the
    text's beginning (a copy-edit answer without the passage it copies), unlike drafting's:
    windows at the texts' starts (a chat transcript per text) train on the features drafting
    reads."""
    from tqdm.auto import tqdm

    from jaxinfer.generate import run_params

    if model.sharding is not None:
        raise ValueError("train-draft runs on one device; load the model without a mesh")
    v = model.config.vocab_size
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, (int, np.integer)) \
            or draft_vocab < 0:
        raise ValueError(f"draft_vocab must be an integer >= 0, got {draft_vocab!r}")
    d2t = draft_head.frequent_tokens(data, draft_vocab, v) if 0 < draft_vocab < v else None
    head = draft_head.init_eagle(model, seed, d2t=d2t)
    spec = head.spec
    plan = model.plan
    params = run_params(model, plan)
    trained = {k: w for k, w in head.params.items() if k != "d2t"}  # the ids stay as they are
    ids = {k: w for k, w in head.params.items() if k == "d2t"}
    opt_state = optimizer(lr, steps).init(trained)

    rng = np.random.default_rng(seed)
    if starts is not None:
        starts = np.asarray(starts)[np.asarray(starts) <= len(data) - seq_len]
        if not len(starts):
            raise ValueError(f"no text starts {seq_len} tokens before the end of --data; give "
                             "more text or a shorter --seq-len")
    losses, accuracy = [], []
    with tqdm(total=steps, desc="train-draft", disable=not progress, unit="step") as bar:
        for i in range(steps):
            at = (rng.integers(0, len(data) - seq_len, size=batch) if starts is None
                  else rng.choice(starts, size=batch))
            windows = np.stack([data[s:s + seq_len] for s in at])  # [B, T]
            trained, opt_state, loss, (reg, cls, agree) = train_step(
                trained, opt_state, ids, params, jnp.asarray(windows), plan=plan, spec=spec,
                lr=lr, steps=steps)
            losses.append(float(loss))
            accuracy.append(float(agree))
            bar.set_postfix(loss=f"{losses[-1]:.3f}", reg=f"{float(reg):.3f}",
                            cls=f"{float(cls):.3f}", top1=f"{accuracy[-1]:.2f}")
            bar.update(1)
            if not progress and (i + 1) % max(1, steps // 10) == 0:  # no bar: a log line
                log.info("step %d/%d: loss %.4f, top-1 agreement %.3f", i + 1, steps,
                         losses[-1], accuracy[-1])
    return TrainResult(dataclasses.replace(head, params={**trained, **ids}), losses, accuracy)


def plot_losses(losses: list[float], accuracy: list[float], path) -> pathlib.Path:
    """The loss curve (and the head's top-1 agreement with the target) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses)
    ax.set(xlabel="step", ylabel="loss (smooth L1 + 0.1 CE)", title="train-draft loss",
           yscale="log")
    bx.plot(steps, accuracy)
    bx.set(xlabel="step", ylabel="top-1 agreement", title="head argmax == target argmax",
           ylim=(0, 1))
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
