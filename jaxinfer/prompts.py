"""What `generate` and `stream` accept as prompts, and their token ids.

One prompt is any of
    "text"                                        a string
    [1, 2, 3]                                     token ids (ints, or a 1-D integer numpy array)
    [{"role": "user", "content": "..."}, ...]     chat messages (system turns included)
and a batch is a list of prompts (a 2-D integer array is a batch of token-id rows). Strings go
through the chat template as one user message when `chat` is on (`chat=None`: on when the
tokenizer has a template, as the CLI does); message lists always do; token ids never do.
Anything else is refused with what was given and what is accepted: bytes are not token ids,
floats and bools are not token ids, a lone surrogate is not text.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence

import numpy as np

ACCEPTED = ("a string, a list of token ids, a list of chat messages "
            "([{'role': ..., 'content': ...}]), or a list of those (a batch)")
ROLES = ("system", "user", "assistant", "tool", "developer")


def _describe(x) -> str:
    if isinstance(x, (str, bytes)):
        return f"{type(x).__name__} {x[:40]!r}{'...' if len(x) > 40 else ''}"
    if isinstance(x, np.ndarray):
        return f"a numpy array of dtype {x.dtype} and shape {x.shape}"
    r = repr(x)
    return f"{type(x).__name__} {r[:60]}{'...' if len(r) > 60 else ''}"


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_text(text: str, where: str) -> str:
    """Text the tokenizer can take: encodable as UTF-8 (no lone surrogates, which is what
    undecodable bytes in a command-line argument or a file read with errors='surrogateescape'
    become)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where} is not valid Unicode: character {e.start} is a lone "
                         f"surrogate ({text[e.start]!r}), as undecodable (non-UTF-8) bytes "
                         "become; pass UTF-8 text") from None
    return text


def _kind(p, where: str) -> str:
    """'text', 'ids' or 'messages'; raises ValueError for anything else."""
    if isinstance(p, str):
        return "text"
    if isinstance(p, (bytes, bytearray, memoryview)):
        raise ValueError(f"{where} is {_describe(bytes(p))}: bytes are neither text nor token "
                         "ids; decode it first (e.g. prompt.decode('utf-8')). Accepted: "
                         f"{ACCEPTED}")
    if isinstance(p, np.ndarray):
        if p.ndim == 1 and np.issubdtype(p.dtype, np.integer):
            return "ids"
        raise ValueError(f"{where} is {_describe(p)}; token ids must be a 1-D integer array")
    if isinstance(p, Mapping):
        raise ValueError(f"{where} is a single dict; chat messages go in a list: "
                         "[{'role': 'user', 'content': ...}]")
    if isinstance(p, Sequence) and p and all(isinstance(m, Mapping) for m in p):
        return "messages"
    if isinstance(p, Sequence) and p and all(_is_int(t) for t in p):
        return "ids"
    if isinstance(p, Sequence) and not p:
        raise ValueError(f"{where} is empty; give it some text, token ids or messages")
    if isinstance(p, Sequence):
        bad = next(t for t in p if not _is_int(t))
        raise ValueError(f"{where} is a list holding {_describe(bad)}; a prompt list must hold "
                         "only token ids (ints, not floats or bools) or only message dicts. "
                         f"Accepted: {ACCEPTED}")
    raise ValueError(f"{where} is {_describe(p)}. Accepted: {ACCEPTED}")


def check_messages(messages: Sequence[Mapping], where: str = "messages") -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"{where}: message {i} has role {role!r}; roles are "
                             f"{', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"{where}: message {i} ({role}) has content {_describe(content)}; "
                             "content must be a string")
        check_text(content, f"{where}: the content of message {i}")
        out.append(dict(m))
    return out


def as_batch(prompts) -> list:
    """A prompt or a batch of prompts -> a non-empty list of prompts (each checked later)."""
    if isinstance(prompts, np.ndarray):
        return list(prompts) if prompts.ndim == 2 else [prompts]
    if isinstance(prompts, (str, bytes, bytearray, memoryview, Mapping)) \
            or not isinstance(prompts, Sequence):
        return [prompts]
    if not prompts:
        raise ValueError(f"prompts is an empty list. Accepted: {ACCEPTED}")
    first = prompts[0]
    # A list that starts with a number or a message is one prompt (ids or a conversation).
    if isinstance(first, (numbers.Number, np.generic, Mapping)):
        return [prompts]
    return list(prompts)


def encode(tokenizer, prompts, chat: bool | None, vocab_size: int) -> list[list[int]]:
    """Token ids of every prompt of `prompts` (a prompt or a batch), checked against the
    vocabulary."""
    batch = as_batch(prompts)
    ids = []
    for i, p in enumerate(batch):
        where = "the prompt" if len(batch) == 1 else f"prompt {i}"
        kind = _kind(p, where)
        if kind in ("text", "messages") and tokenizer is None:
            raise ValueError(f"{where} is {kind} but this model was loaded without a tokenizer; "
                             "pass token ids, or load a checkpoint with tokenizer files")
        use_chat = chat if chat is not None else bool(getattr(tokenizer, "chat_template", None))
        if kind == "messages":
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(f"{where} is a list of chat messages but the tokenizer has no "
                                 "chat template; pass text or token ids instead")
            toks = tokenizer.apply_chat_template(check_messages(p, where),
                                                 add_generation_prompt=True)
        elif kind == "text":
            check_text(p, where)
            if use_chat:
                toks = tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                     add_generation_prompt=True)
            else:
                toks = tokenizer.encode(p)
        else:
            toks = [int(t) for t in p]
        if not toks:
            raise ValueError(f"{where} is empty (no tokens); give it some text or token ids")
        bad = [t for t in toks if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{where}: token id {bad[0]} is outside the vocabulary "
                             f"[0, {vocab_size})")
        ids.append(toks)
    return ids
