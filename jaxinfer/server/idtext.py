"""The text of a model served without a tokenizer (`jaxinfer serve --preset P
--random-weights`): each token as " <id>", so token-id prompts through /v1/completions stream
something a client can count and read back; text prompts are refused by the engine (400)."""

from __future__ import annotations


class _Decoder:
    def step(self, token: int) -> str:
        return f" {token}"

    def flush(self) -> str:
        return ""


class IdText:
    chat_template = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" {int(t)}" for t in ids)

    def incremental_decoder(self) -> _Decoder:
        return _Decoder()
