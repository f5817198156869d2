"""Text <-> token ids, giving the ids HF transformers gives for the same checkpoint.

Two sources:

- `Tokenizer.from_hf_dir(path)`: an HF-layout directory with `tokenizer.json` (the `tokenizers` library's own
  serialization, used as is), `tokenizer_config.json` (special tokens, chat template) and optionally
  `chat_template.jinja`, `additional_chat_templates/*.jinja`, `generation_config.json`, `config.json`.
- `Tokenizer.from_gguf_metadata(meta)`: the key/value metadata of a GGUF file as plain python values. A GGUF has
  no tokenizer.json, only llama.cpp's `tokenizer.ggml.*` keys; we build the `tokenizers.Tokenizer` that
  transformers builds when it loads the same file (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`).

The reference is transformers 5.x; the fixtures in tests/fixtures/data/tokenizer/ record its ids, and
tests/test_tokenizer.py compares ours with them token for token.

Streaming: `tokenizer.incremental_decoder()` returns an `IncrementalDecoder`; feed it ids one at a time with
`step(id)`, which returns only text that is complete (a character split over several byte-level tokens is held
back until its last byte arrives), then call `flush()` once at the end:

    dec = tokenizer.incremental_decoder()
    for token_id in stream_of_ids:
        print(dec.step(token_id), end="", flush=True)
    print(dec.flush())
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

__all__ = ["Tokenizer", "IncrementalDecoder", "ChatTemplateError"]

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # pragma: no cover - depends on the installed tokenizers
    _DecodeStream = None


class ChatTemplateError(ValueError):
    """The chat template is missing, or failed while rendering (it may call raise_exception itself)."""


# Names of the special tokens transformers exposes to chat templates (its `special_tokens_map`).
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Strings chat templates close a turn with. When one of them is a special token of the vocabulary and appears in
# the template, generation should stop on it even if the checkpoint names another token as EOS (llama.cpp stops on
# these too, as "end of generation" tokens).
_END_OF_TURN_MARKERS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<｜end▁of▁sentence｜>",
    "<|return|>",
    "<|call|>",
)

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4

# Pre-tokenizer split patterns for GGUF byte-level vocabularies, by `tokenizer.ggml.pre`. These are the patterns
# the vocabularies were trained with; transformers maps the same names. A name missing here (e.g. "smollm",
# "gpt-2", "starcoder") gets GPT-2's own pattern, the one built into the ByteLevel pre-tokenizer.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek's vocabularies split in stages, each pattern applied to the pieces the previous left
# (a tuple: one isolating Split per pattern, in order): DeepSeek-LLM / V2 ("deepseek-llm"),
# V3 / R1 ("deepseek-v3"), DeepSeek-Coder ("deepseek-coder"), as their tokenizer.json files.
_DEEPSEEK_LLM_SPLITS = (  # written as escapes: editors may NFC-normalize some of these letters
    r"[\r\n]",
    ("\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"),
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}+",
)
_DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
     r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
)
_DEEPSEEK_CODER_SPLITS = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+",
                          "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}")
_GGUF_PRE_SPLITS = {
    "deepseek-llm": _DEEPSEEK_LLM_SPLITS,
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense"), _DEEPSEEK_V3_SPLITS),
    "deepseek-coder": _DEEPSEEK_CODER_SPLITS,
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano",
         "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
# Architectures whose sentencepiece ("llama") GGUF vocabularies transformers rebuilds differently; not supported.
_SPM_UNSUPPORTED_ARCHS = ("gemma", "gemma4", "phi3")
# Gemma 2 / 3 sentencepiece vocabularies: built as transformers' GemmaTokenizer from the file.
_GEMMA_SPM_ARCHS = ("gemma2", "gemma3")


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the spelling of byte-level BPE vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what transformers keeps beside it: special tokens, chat template, EOS set.

    Build it with `from_hf_dir` or `from_gguf_metadata`. The `tokenizers` backend does all BPE work; this class
    adds the chat template rendering (sandboxed jinja2, transformers' globals) and checks on the inputs.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str | None],
        chat_template: str | None,
        extra_eos_ids: Iterable[int] = (),
        clean_up_tokenization_spaces: bool = False,
        source: str = "<tokenizer>",
    ):
        self._backend = backend
        # Encoding must never truncate or pad: transformers turns both off for a default `tok(text)` too.
        self._backend.no_truncation()
        self._backend.no_padding()
        self._special = {name: tok for name, tok in special_tokens.items() if tok is not None}
        self.chat_template = chat_template
        self._source = source
        # transformers' "clean up" drops spaces before punctuation; it skips it for BPE models, as do we.
        self._clean_up = clean_up_tokenization_spaces and not isinstance(backend.model, models.BPE)
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        eos += [int(i) for i in extra_eos_ids]
        eos += self._template_end_of_turn_ids()
        self._eos_ids = tuple(dict.fromkeys(i for i in eos if 0 <= i < self._vocab_size))

    # ------------------------------------------------------------------------------------------------ loading

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json`, chat templates, generation config) from a directory."""
        path = Path(path)
        if path.is_file() and path.name == "tokenizer.json":
            path = path.parent
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: not a directory; pass the HF model directory holding tokenizer.json")
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{path}: no tokenizer.json. This loader needs the fast-tokenizer file; a directory with only "
                "vocab.json/merges.txt or tokenizer.model can be converted once with transformers: "
                f"AutoTokenizer.from_pretrained('{path}').save_pretrained('{path}')"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as err:
            raise ValueError(f"{tokenizer_file}: not a readable tokenizers file ({err})") from err
        config = _read_json(path / "tokenizer_config.json") or {}

        special: dict[str, str | None] = {}
        to_add: list[AddedToken] = []
        for name in _NAMED_SPECIALS:
            token = _added_token(config.get(name), f"{path / 'tokenizer_config.json'}: {name}")
            if token is not None:
                special[name] = token.content
                to_add.append(token)
        extras = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if isinstance(extras, Mapping):  # transformers also accepts {"name": token}
            extras = list(extras.values())
        for i, value in enumerate(extras):
            token = _added_token(value, f"{path / 'tokenizer_config.json'}: extra_special_tokens[{i}]")
            if token is not None:
                to_add.append(token)
        # transformers adds the named special tokens to the backend when tokenizer.json lacks them (an id already in
        # the vocabulary keeps its id; it only becomes matched whole and skippable in decode).
        present = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = [t for t in to_add if t.content not in present]
        if missing:
            backend.add_special_tokens(missing)

        # Like transformers: add_bos_token/add_eos_token in tokenizer_config.json are ignored when tokenizer.json
        # exists; its post-processor decides. One without a post-processor adds nothing.
        chat_template = _read_hf_chat_template(path, config)
        extra_eos = []
        for name in ("generation_config.json", "config.json"):
            found = _read_json(path / name)
            if found is not None and found.get("eos_token_id") is not None:
                value = found["eos_token_id"]
                extra_eos += list(value) if isinstance(value, list) else [value]
                break  # generate() reads generation_config.json, and config.json only when that file is absent
        return cls(
            backend,
            special_tokens=special,
            chat_template=chat_template,
            extra_eos_ids=extra_eos,
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
            source=str(path),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, object], source: str = "<gguf>") -> Tokenizer:
        """Build the tokenizer a GGUF file describes, from its metadata as plain python values.

        Supports `tokenizer.ggml.model` "gpt2" (byte-level BPE) and "llama" (sentencepiece-style BPE with byte
        fallback). The result gives the ids transformers gives for `AutoTokenizer.from_pretrained(dir,
        gguf_file=...)`.
        """
        kind = meta.get("tokenizer.ggml.model")
        if kind is None or "tokenizer.ggml.tokens" not in meta:
            raise ValueError(
                f"{source}: the GGUF metadata has no tokenizer ('tokenizer.ggml.model' / 'tokenizer.ggml.tokens' "
                "missing), so the file carries no vocabulary. Load the tokenizer from the model's HF directory "
                "instead: Tokenizer.from_hf_dir(path)."
            )
        kind = _as_str(kind)
        tokens = [_as_str(t) for t in meta["tokenizer.ggml.tokens"]]
        types = meta.get("tokenizer.ggml.token_type")
        token_type = [int(t) for t in types] if types is not None else []
        arch = _as_str(meta.get("general.architecture", ""))
        if kind == "gpt2":
            backend = _gguf_byte_level_backend(meta, tokens, source)
            add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
            # GPT2Tokenizer's default special token, marked special when the vocabulary has it.
            class_defaults = ["<|endoftext|>"]
        elif kind == "llama" and arch in _GEMMA_SPM_ARCHS:
            backend = _gguf_gemma_backend(tokens, source)
            add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
            class_defaults = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]  # GemmaTokenizer's
        elif kind == "llama" and arch not in _SPM_UNSUPPORTED_ARCHS:
            backend = _gguf_sentencepiece_backend(meta, tokens, source)
            # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise; transformers follows.
            add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
            class_defaults = ["<unk>", "<s>", "</s>"]
        else:
            what = f"tokenizer.ggml.model={kind!r}" + (f" with general.architecture={arch!r}" if arch else "")
            raise NotImplementedError(
                f"{source}: GGUF tokenizer {what} is not supported; supported tokenizer.ggml.model values are "
                "'gpt2' (byte-level BPE) and 'llama' (sentencepiece BPE, not for gemma/phi3). Load the tokenizer "
                "from the model's HF directory instead: Tokenizer.from_hf_dir(path)."
            )
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))

        vocab = backend.get_vocab(with_added_tokens=False)
        present = set(vocab)
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in class_defaults if t in present]
        )
        # Control tokens (like <|im_end|>) become special tokens: matched whole in text, skipped by decode. In a
        # byte-level vocabulary every real token is spelled in the byte alphabet; a control token that is not is a
        # mislabel transformers skips (adding it would grow the vocabulary past the model's).
        alphabet = set(_byte_alphabet().values()) if kind == "gpt2" else None
        control = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, token_type)
            if ty == _GGUF_CONTROL and (alphabet is None or set(t) <= alphabet)
        ]
        if control:
            backend.add_special_tokens(control)
        # User-defined tokens (like <think>) are matched whole too, but are ordinary text for decode.
        present = set(backend.get_vocab(with_added_tokens=True))
        user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, token_type)
                if ty == _GGUF_USER_DEFINED and t in present]
        if user:
            backend.add_tokens(user)

        special: dict[str, str | None] = {}
        for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
            index = meta.get(f"tokenizer.ggml.{key}")
            if index is None:
                continue
            index = int(index)
            if not 0 <= index < len(tokens):
                raise ValueError(
                    f"{source}: tokenizer.ggml.{key}={index} is outside the vocabulary of {len(tokens)} tokens"
                )
            special[name] = tokens[index]
        present = {t.content for t in backend.get_added_tokens_decoder().values()}
        named = [AddedToken(t, special=True, normalized=False) for t in special.values() if t not in present]
        if named:
            backend.add_special_tokens(named)
        backend.post_processor = _bos_eos_processor(
            backend, special.get("bos_token") if add_bos else None, special.get("eos_token") if add_eos else None
        )

        extra_eos = [int(meta[k]) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
        template = meta.get("tokenizer.chat_template")
        return cls(
            backend,
            special_tokens=special,
            chat_template=_as_str(template) if template is not None else None,
            extra_eos_ids=extra_eos,
            source=source,
        )

    # ------------------------------------------------------------------------------------------------ properties

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """How many ids this tokenizer knows (transformers' `len(tokenizer)`: base vocabulary + added tokens).

        The model's embedding may have more rows (padding); ids at or past this size cannot be decoded.
        """
        return self._vocab_size

    def _special_id(self, name: str) -> int | None:
        token = self._special.get(name)
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self._special.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The checkpoint's own EOS token (transformers' `tokenizer.eos_token_id`)."""
        return self._special_id("eos_token")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id generation should stop on, EOS first.

        The EOS token; for HF dirs the `eos_token_id` of generation_config.json (or config.json without it),
        which is what transformers' `generate` stops on; for GGUF the `tokenizer.ggml.eot_token_id` /
        `eom_token_id` keys; and any end-of-turn special token the chat template writes (`<|im_end|>`,
        `<|eot_id|>`, `<end_of_turn>`, ...), so a chat reply stops at the end of its turn even where the
        checkpoint names another EOS.
        """
        return self._eos_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id("unk_token")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named special tokens, as transformers passes them to chat templates (bos_token, eos_token, ...)."""
        return dict(self._special)

    def id_to_token(self, token_id: int) -> str:
        """The token's text as the vocabulary spells it (e.g. "Ġthe" in a byte-level vocabulary)."""
        self._check_ids([token_id])
        return self._backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        """The id of a token spelled as in the vocabulary, or None if it has none."""
        return self._backend.token_to_id(token)

    def __len__(self) -> int:
        return self._vocab_size

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self._source!r}, vocab_size={self._vocab_size}, bos={self.bos_token_id}, "
            f"eos={self._eos_ids}, chat_template={'yes' if self.chat_template else 'no'})"
        )

    # ------------------------------------------------------------------------------------------------ encode/decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, as transformers' `tok(text)["input_ids"]` (BOS/EOS per the checkpoint)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}; use encode_batch for several texts")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` over several texts (run in parallel by the backend)."""
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`, as transformers' `tok.decode(ids, skip_special_tokens=...)`.

        Bytes that do not form complete UTF-8 characters decode to U+FFFD, as in transformers; to decode a
        stream of ids without that, use `incremental_decoder()`.
        """
        ids = self._check_ids(ids)
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self._clean_up else text

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A decoder for ids arriving one at a time (streaming generation)."""
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        if hasattr(ids, "tolist"):  # numpy / jax arrays
            ids = ids.tolist()
        ids = [ids] if isinstance(ids, int) else list(ids)
        bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < self._vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:8]}{' ...' if len(bad) > 8 else ''} are outside this tokenizer's vocabulary "
                f"(ids 0..{self._vocab_size - 1}, source {self._source}). The model's embedding can have more rows "
                f"than the tokenizer has tokens: mask logits at or past {self._vocab_size} before sampling."
            )
        return ids

    # ------------------------------------------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, object]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        *,
        chat_template: str | None = None,
        **template_kwargs: object,
    ) -> list[int] | str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the chat template, then tokenize.

        The rendered text already holds every special token the template wants, so it is tokenized without adding
        BOS/EOS again, as transformers does. `tokenize=False` returns the text. Extra keyword arguments reach the
        template as variables (e.g. `enable_thinking=False`, `tools=[...]`).
        """
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ChatTemplateError(
                f"{self._source}: this tokenizer has no chat template (looked for chat_template.jinja, "
                "'chat_template' in tokenizer_config.json, or 'tokenizer.chat_template' in the GGUF). Pass "
                "chat_template='...' or build the prompt yourself and call encode()."
            )
        if isinstance(messages, Mapping) or not messages:
            raise ValueError("apply_chat_template() needs a non-empty list of {'role': ..., 'content': ...} dicts")
        chat = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise TypeError(f"messages[{i}] is a {type(message).__name__}; each message must be a dict")
            # Like transformers: keys whose value is None are dropped (templates test for presence), and a
            # message's reasoning is visible under each name templates read it by.
            message = {k: v for k, v in message.items() if v is not None}
            reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)
        variables = {**self._special, "tools": None, "documents": None, **template_kwargs}
        try:
            text = _compile_template(template).render(
                messages=chat, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"{self._source}: the chat template failed: {err}") from err
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template_end_of_turn_ids(self) -> list[int]:
        if not self.chat_template:
            return []
        special = {t.content: i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
        return [special[m] for m in _END_OF_TURN_MARKERS if m in special and m in self.chat_template]


class IncrementalDecoder:
    """Turns ids arriving one at a time into text, never emitting half of a multi-byte character.

    `step(id)` returns the new text (possibly ""); the concatenation of all `step` results and `flush()` equals
    `tokenizer.decode(all_ids)`. Uses `tokenizers.decoders.DecodeStream` when the installed tokenizers has it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, *, use_decode_stream: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._emitted: list[str] = []
        self._stream = _DecodeStream(skip_special_tokens=skip_special_tokens) if use_decode_stream and _DecodeStream else None
        # Fallback state: text of ids[prefix:read] was already emitted; decoding from `prefix` keeps the decoder's
        # view of the previous token (leading-space stripping, byte merging) the same as in a full decode.
        self._prefix = 0
        self._read = 0

    def step(self, token_id: int) -> str:
        (token_id,) = self._tok._check_ids([token_id])
        self._ids.append(token_id)
        if self._stream is not None:
            piece = self._stream.step(self._tok.backend, token_id) or ""
        else:
            piece = self._fallback_step()
        self._emitted.append(piece)
        return piece

    def _fallback_step(self) -> str:
        backend = self._tok.backend
        before = backend.decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        after = backend.decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """The text still held back at the end of the stream (an incomplete character decodes to U+FFFD)."""
        full = self._tok.decode(self._ids, skip_special_tokens=self._skip)
        emitted = "".join(self._emitted)
        rest = full[len(emitted):] if full.startswith(emitted) else ""
        self._emitted.append(rest)
        return rest

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)


# ---------------------------------------------------------------------------------------------------- helpers


def _as_str(value: object) -> str:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    return str(value)


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: invalid JSON ({err})") from err


def _added_token(value: object, where: str) -> AddedToken | None:
    """A special token from tokenizer_config.json: a string, or a serialized AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return AddedToken(
            value["content"],
            single_word=bool(value.get("single_word", False)),
            lstrip=bool(value.get("lstrip", False)),
            rstrip=bool(value.get("rstrip", False)),
            normalized=bool(value.get("normalized", False)),
            special=True,
        )
    raise ValueError(f"{where}: expected a token string or an AddedToken dict with 'content', got {value!r}")


def _read_hf_chat_template(path: Path, config: Mapping) -> str | None:
    """The default chat template: chat_template.jinja wins over tokenizer_config.json, as in transformers."""
    templates: dict[str, str] = {}
    main = path / "chat_template.jinja"
    if main.is_file():
        templates["default"] = main.read_text(encoding="utf-8")
    extra_dir = path / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if not templates:
        value = config.get("chat_template")
        if isinstance(value, str):
            return value
        if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
            templates = {t["name"]: t["template"] for t in value}
        elif isinstance(value, Mapping):
            templates = dict(value)
    # transformers picks "default" when it is not told a name; without one it has no template either.
    return templates.get("default")


def _clean_up(text: str) -> str:
    """transformers' `clean_up_tokenization` (for non-BPE models whose config asks for it)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def _bos_eos_processor(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> processors.PostProcessor:
    """BOS/EOS around each sequence, the way transformers' `update_post_processor` lays it out."""
    head = f"{bos}:0 " if bos else ""
    tail = f" {eos}:0" if eos else ""
    single = f"{head}$A:0{tail}"
    pair = f"{single}{f' {bos}:1' if bos else ''} $B:1{f' {eos}:1' if eos else ''}"
    specials = [(t, backend.token_to_id(t)) for t in (bos, eos) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _merge_list(meta: Mapping[str, object], source: str) -> list[tuple[str, str]]:
    merges = []
    for i, merge in enumerate(meta["tokenizer.ggml.merges"]):
        parts = _as_str(merge).split(" ")
        if len(parts) != 2:
            raise ValueError(f"{source}: tokenizer.ggml.merges[{i}]={merge!r} is not two tokens joined by a space")
        merges.append((parts[0], parts[1]))
    return merges


def _bpe(source: str, **kwargs) -> models.BPE:
    try:
        return models.BPE(**kwargs)
    except Exception as err:  # the tokenizers library raises a bare Exception, e.g. for a merge of unknown tokens
        raise ValueError(f"{source}: tokenizer.ggml.tokens/merges do not form a BPE vocabulary: {err}") from err


def _gguf_byte_level_backend(meta: Mapping[str, object], tokens: list[str], source: str) -> tokenizers.Tokenizer:
    """Byte-level BPE ("gpt2"): GPT-2's byte alphabet, the file's merges, a split pattern by tokenizer.ggml.pre."""
    if "tokenizer.ggml.merges" not in meta:
        raise ValueError(f"{source}: tokenizer.ggml.model='gpt2' but tokenizer.ggml.merges is missing")
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        # Tokens are stored in the byte alphabet; one that is not (e.g. a special token with a space) is respelled
        # from its UTF-8 bytes. A later duplicate takes the spelling over, as in transformers' dict.
        if not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index
    backend = tokenizers.Tokenizer(_bpe(source, vocab=vocab, merges=_merge_list(meta, source), dropout=None,
                                        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = _GGUF_PRE_SPLITS.get(_as_str(meta.get("tokenizer.ggml.pre", "")))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        stages = (split,) if isinstance(split, str) else split
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [*(pre_tokenizers.Split(Regex(p), behavior="isolated") for p in stages),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _gguf_sentencepiece_backend(meta: Mapping[str, object], tokens: list[str], source: str) -> tokenizers.Tokenizer:
    """Sentencepiece-style BPE ("llama"): ▁ for spaces, a ▁ prepended to the text, byte-fallback tokens."""
    vocab = {token: index for index, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = _merge_list(meta, source)
    elif "tokenizer.ggml.scores" in meta:
        scores = [float(s) for s in meta["tokenizer.ggml.scores"]]
        if len(scores) != len(tokens):
            raise ValueError(f"{source}: {len(scores)} tokenizer.ggml.scores for {len(tokens)} tokens")
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    else:
        raise ValueError(f"{source}: tokenizer.ggml.model='llama' needs tokenizer.ggml.merges or tokenizer.ggml.scores")
    backend = tokenizers.Tokenizer(_bpe(source, vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return backend


def _gguf_gemma_backend(tokens: list[str], source: str) -> tokenizers.Tokenizer:
    """Gemma's sentencepiece BPE as transformers' GemmaTokenizer builds it from a GGUF: spaces
    normalized to ▁ (no prefix space), byte fallback, unknown pieces fused into <unk>. Tokens
    made of spaces only are stored as real spaces and looked up as ▁s; the file has no merges
    and its scores do not follow the merge order, the token order does (earlier merges first)."""
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = _merges_from_scores(vocab, {t: -float(i) for i, t in enumerate(tokens)})
    unk = "<unk>" if "<unk>" in vocab else None
    backend = tokenizers.Tokenizer(_bpe(source, vocab=vocab, merges=merges, fuse_unk=True,
                                        unk_token=unk, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous",
                                                 invert=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _merges_from_scores(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """Merges a sentencepiece vocabulary implies: every split of a token into two tokens, best score first.

    Ties keep a fixed order: the longer left piece first, then the longer right piece, then the merged token's
    position in `scores`; this is the order transformers derives, so the same merge wins.
    """
    found = []  # (score, len(left), len(right), order, left, right)
    for token, score in scores.items():
        for k in range(1, len(token)):
            left, right = token[:k], token[k:]
            if left in vocab and right in vocab:
                found.append((score, k, len(right), len(found), left, right))
    # Descending on (score, lengths) but stable for equal keys: sort by the key negated, then by arrival order.
    found.sort(key=lambda m: (-m[0], -m[1], -m[2], m[3]))
    return [(m[4], m[5]) for m in found]


# ---------------------------------------------------------------------------------------------------- jinja


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _SafeDict:
    """`dict(...)` for templates without handing them the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace(), refusing underscore names (no reaching interpreter internals)."""

    def __init__(*args, **kwargs):  # first positional is self, as in jinja's Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates may not set underscore attribute {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Compile with the environment transformers renders chat templates in (sandboxed, trimmed blocks)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _SafeDict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(f"the chat template does not parse: {err} (line {err.lineno})") from err
