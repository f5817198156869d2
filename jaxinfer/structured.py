"""Structured output: grammars (JSON schema, any JSON object, regex, Lark) as token masks.

    grammar = Grammar.json_schema(model.tokenizer, {"type": "object", ...})   # ValueError if bad
    rid = engine.add_request("...", grammar=grammar)        # its tokens follow the schema

llguidance (Microsoft's grammar engine, used by vLLM, SGLang and llama.cpp) does the parsing:
a `Grammar` is a compiled, validated grammar for one tokenizer (reusable across requests);
each request gets its own matcher state (`Grammar.matcher()`), which gives the bitmask of the
tokens allowed next (`fill_bitmask`, llguidance's [W] int32 layout, bit i % 32 of word i // 32
for token i) and consumes the tokens the sampler chose. The bitmask is applied inside the
jitted sampler (`jaxinfer.sampling`, `token_bitmask`).

- EOS: the tokenizer's EOS ids (`Tokenizer.eos_token_ids`, what generation stops on) are
  allowed exactly where the grammar may end; once it can take nothing more the engine ends
  the request ("stop") without a step for the EOS.
- A model vocabulary padded past the tokenizer's (embedding rows no token has): those ids
  are never allowed (`fill_bitmask` clears their bits; the sampler also drops every id past
  the bitmask's words).
- JSON: between tokens at most one space, or a newline and up to 16 spaces or tabs
  (`JSON_WHITESPACE`): compact, `{"a": 1}` and pretty-printed output all fit. Unbounded
  whitespace (llguidance's and xgrammar's default) lets small models loop on spaces and
  newlines until max_tokens (vLLM's `disable_any_whitespace` answers the same problem);
  forbidding newlines pushed SmolLM2-135M off its preferred "{\n   " (logprob -6 instead
  of -0.6 for its first key).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import weakref

import numpy as np

# Whitespace the JSON grammars allow between tokens (see the module docstring).
JSON_WHITESPACE = r"(\x20|\n[\x20\t]{0,16})?"
_JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}

_lock = threading.Lock()
_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _llg():
    try:
        import llguidance
    except ImportError as e:  # a runtime dependency; say which package is missing
        raise ImportError("structured output needs the llguidance package "
                          "(pip install llguidance)") from e
    return llguidance


def ll_tokenizer(tokenizer):
    """The llguidance tokenizer of a `checkpoints.tokenizer.Tokenizer` (built once, ~1 s for
    a large vocabulary, then cached on the tokenizer object)."""
    with _lock:
        found = _tokenizers.get(tokenizer)
        if found is None:
            llg = _llg()
            found = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                    eos_token=list(tokenizer.eos_token_ids))
            _tokenizers[tokenizer] = found
        return found


@dataclasses.dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar for one tokenizer. Build it with the classmethods (they raise
    ValueError naming the problem for a bad schema, regex or grammar); `matcher()` gives a
    fresh parse state for one request (a cheap copy)."""

    kind: str  # "json_schema" | "json_object" | "regex" | "lark"
    source: str  # the schema (as JSON), the regex or the Lark text
    vocab_size: int  # the tokenizer's
    text: str = dataclasses.field(repr=False)  # llguidance's grammar (what it compiled)
    _template: object = dataclasses.field(repr=False)  # an llguidance.LLMatcher in its start state

    @classmethod
    def _compile(cls, tokenizer, kind: str, source: str, grammar: str) -> Grammar:
        llg = _llg()
        matcher = llg.LLMatcher(ll_tokenizer(tokenizer), grammar, log_level=0)
        if matcher.is_error():
            what = {"json_schema": "JSON schema", "json_object": "JSON grammar",
                    "regex": "regex", "lark": "grammar"}[kind]
            raise ValueError(f"invalid {what}: {matcher.get_error().strip()}")
        return cls(kind, source, tokenizer.vocab_size, grammar, matcher)

    def spec(self) -> tuple[str, str, str]:
        """What `from_spec` rebuilds this grammar from (plain strings: an llguidance matcher
        does not pickle; `jaxinfer serve` sends grammars to its engine process so)."""
        return self.kind, self.source, self.text

    @classmethod
    def from_spec(cls, tokenizer, spec: tuple[str, str, str]) -> Grammar:
        return cls._compile(tokenizer, *spec)

    @classmethod
    def json_schema(cls, tokenizer, schema: dict | str) -> Grammar:
        """JSON text valid under `schema` (a dict or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"invalid JSON schema: not JSON ({e})") from None
        if not isinstance(schema, dict):
            raise ValueError(f"invalid JSON schema: must be an object, got "
                             f"{type(schema).__name__}")
        try:
            grammar = _llg().LLMatcher.grammar_from_json_schema(schema,
                                                                defaults=_JSON_OPTIONS)
        except ValueError as e:
            raise ValueError(f"invalid JSON schema: {e}") from None
        return cls._compile(tokenizer, "json_schema", json.dumps(schema), grammar)

    @classmethod
    def json_object(cls, tokenizer) -> Grammar:
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls.json_schema(tokenizer, {"type": "object"})

    @classmethod
    def regex(cls, tokenizer, pattern: str) -> Grammar:
        """Text matching `pattern` in full (Rust regex syntax, as llguidance takes it)."""
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"invalid regex: must be a non-empty string, got {pattern!r}")
        return cls._compile(tokenizer, "regex", pattern,
                            _llg().LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def lark(cls, tokenizer, grammar: str) -> Grammar:
        """Text of a Lark grammar (llguidance's dialect: `start: ...`; regexes, %json)."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise ValueError(f"invalid grammar: must be a non-empty string, got {grammar!r}")
        return cls._compile(tokenizer, "lark", grammar,
                            _llg().LLMatcher.grammar_from_lark(grammar))

    @classmethod
    def choice(cls, tokenizer, choices: list[str]) -> Grammar:
        """Exactly one of the strings `choices`."""
        if not isinstance(choices, list) or not choices or \
                not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"invalid choice: must be a non-empty list of non-empty strings, "
                             f"got {choices!r}")
        # JSON string literals are Lark string literals (same escapes).
        return cls.lark(tokenizer, "start: " + " | ".join(json.dumps(c) for c in choices))

    def matcher(self) -> Matcher:
        return Matcher(self._template.deep_copy(), self.vocab_size)


class Matcher:
    """One request's parse state: the tokens allowed next, and the tokens it took."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)  # bitmask width for the tokenizer's ids

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into row [W] int32, W = ceil(model vocab / 32):
        bits of ids past the tokenizer's vocabulary are cleared, ids past the model's (a
        tokenizer larger than the embedding) left out."""
        row[:] = 0
        bits = np.frombuffer(self._m.compute_bitmask(), np.int32)[:min(self.words, len(row))]
        row[:len(bits)] = bits
        tail = self.vocab_size % 32
        if tail and self.words <= len(row):  # bits of ids past the tokenizer's last one
            row[self.words - 1] &= np.int32((1 << tail) - 1)

    def consume(self, token: int) -> bool:
        """Advance past a sampled token; False: the grammar does not allow it (an error
        state it never leaves)."""
        return self._m.consume_token(int(token))

    @property
    def done(self) -> bool:
        """The grammar can take no more tokens (EOS aside): the output is complete."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()


def from_response_format(tokenizer, response_format: dict | None) -> Grammar | None:
    """OpenAI's response_format -> a Grammar (None for text). ValueError for a bad one.

    {"type": "text"} | {"type": "json_object"} |
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
    (the schema is enforced whatever "strict" says)
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ValueError("response_format must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object(tokenizer)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError("response_format json_schema needs "
                             "{\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        return Grammar.json_schema(tokenizer, spec["schema"])
    raise ValueError(f"response_format type must be text, json_object or json_schema, got "
                     f"{kind!r}")
