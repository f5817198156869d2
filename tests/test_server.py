"""The OpenAI-compatible server, driven by the official `openai` client over loopback."""

import json
import math
import re
import shutil
import time

import httpx
import jsonschema
import numpy as np
import openai
import pytest

import jaxinfer
from tests.serving import TINY_ENGINE, serve

KEY = "test-key"
CHAT = [{"role": "user", "content": "Name three painters."}]
IDS = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def refs(tiny_chat):
    """generate()'s answers for the model the server loads (tiny_chat_dir holds its weights)."""
    return (jaxinfer.generate(tiny_chat, [CHAT], max_new_tokens=12)[0],
            jaxinfer.generate(tiny_chat, [IDS], max_new_tokens=10)[0])


# The tiny model's ChatML template, with the tool definitions in a system turn first when a
# request has any (without tools it renders exactly as the original, so generate()'s
# references hold).
TOOLS_TEMPLATE = ("{% if tools %}{{ '<|im_start|>system\nTools: ' + (tools | tojson) + "
                  "'<|im_end|>\n' }}{% endif %}")


@pytest.fixture(scope="module")
def server(tiny_chat_dir, tmp_path_factory):
    """`jaxinfer serve` of the tiny chat model in its own process on 127.0.0.1 (an API key
    required), as a user starts it; stopped (SIGTERM, then killed) at the end. Its chat
    template also takes tools (TOOLS_TEMPLATE)."""
    model_dir = tmp_path_factory.mktemp("served") / "tiny"
    shutil.copytree(tiny_chat_dir, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_TEMPLATE + config["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with serve("--model", str(model_dir), *TINY_ENGINE, "--api-key", KEY,
               "--served-model-name", "tiny") as (url, _, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, timeout=60, max_retries=0)


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return float(next(line.split()[1] for line in text.splitlines()
                      if line.startswith(name + " ")))


def test_chat_and_completions_equal_generate(client, refs):
    ref = refs[0]
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12,
                                       temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.prompt_tokens == ref.prompt_tokens
    ref = refs[1]
    r = client.completions.create(model="tiny", prompt=IDS, max_tokens=10, temperature=0)
    assert r.choices[0].text == ref.text
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_logit_bias_equals_generate(client, tiny_chat, refs):
    """The openai client's logit_bias (string ids) gives generate()'s tokens under the same
    SamplingParams.logit_bias: greedy text with its first token banned and another pushed."""
    from jaxinfer.sampling import SamplingParams

    bias = {refs[1].token_ids[0]: -100, 9: 4.5}
    ref = jaxinfer.generate(tiny_chat, [IDS], max_new_tokens=10,
                            sampling=SamplingParams(temperature=0, logit_bias=bias))[0]
    assert ref.token_ids[0] != refs[1].token_ids[0]
    r = client.completions.create(model="tiny", prompt=IDS, max_tokens=10, temperature=0,
                                  logit_bias={str(k): v for k, v in bias.items()})
    assert r.choices[0].text == ref.text


def test_ignore_eos_runs_to_max_tokens(client, tiny_chat):
    """vLLM's ignore_eos (extra_body): EOS, made the greedy choice by logit_bias, ends the
    completion at its first token without it and does not with it: generate()'s tokens
    with ignore_eos, to max_tokens (EOS ids add no text)."""
    from jaxinfer.sampling import SamplingParams

    eos = tiny_chat.config.eos_token_ids[0]
    kw = dict(model="tiny", prompt=IDS, max_tokens=6, temperature=0,
              logit_bias={str(eos): 100})
    short = client.completions.create(**kw)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens == 1
    whole = client.completions.create(**kw, extra_body={"ignore_eos": True})
    ref = jaxinfer.generate(tiny_chat, [IDS], max_new_tokens=6, ignore_eos=True,
                            sampling=SamplingParams(temperature=0, logit_bias={eos: 100}))[0]
    assert ref.token_ids == [eos] * 6 and ref.finish_reason == "length"
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6
    assert whole.choices[0].text == ref.text == ""


def test_streaming_n_logprobs_stop_and_seed(client):
    msgs = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    two = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, n=2,
                                         temperature=0.9, seed=3, logprobs=True)
    again = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, n=2,
                                           temperature=0.9, seed=3, logprobs=True)
    assert [c.message.content for c in two.choices] == [c.message.content
                                                          for c in again.choices]
    lps = [t.logprob for t in two.choices[0].logprobs.content]
    assert 0 < len(lps) <= 8 and all(lp <= 0 for lp in lps)
    stop = whole.choices[0].message.content[3:5]
    cut = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16,
                                         temperature=0, stop=[stop])
    assert stop not in cut.choices[0].message.content
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "JSON"),
    (json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}), 404,
     "does not exist"),
    (json.dumps({"model": "tiny", "messages": []}), 400, "messages"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                 "temperature": 5}), 400, "temperature"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x " * 400}]}),
     400, "max_model_len"),
    (json.dumps({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}), 400,
     "role"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                 "response_format": {"type": "json_schema", "json_schema": {
                     "name": "x", "schema": {"type": "wat"}}}}), 400, "invalid JSON schema"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                 "guided_regex": "a(b"}), 400, "invalid regex"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                 "guided_regex": "a", "response_format": {"type": "json_object"}}), 400,
     "one output constraint"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                 "logprobs": True, "top_logprobs": 21}), 400, "top_logprobs"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                 "tools": [{"type": "function", "function": {"name": "f"}}],
                 "tool_choice": "auto"}), 400, "tool-call parser"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                 "logit_bias": {"x": 10}}), 400, "logit_bias keys must be token ids"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                 "logit_bias": {"5": 101}}), 400, "biases in [-100, 100]"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                 "logit_bias": {"99999": 1}}), 400, "outside the vocabulary"),
    # output-changing parameters the server does not implement: refused, not ignored
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                 "n": 1, "best_of": 3}), 400, "best_of is not supported"),
])
def test_bad_requests_get_openai_errors(server, body, status, words):
    r = httpx.post(server + "/v1/chat/completions", content=body,
                   headers={"Authorization": f"Bearer {KEY}",
                            "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_completions_refuse_echo_and_suffix(server):
    """Output-changing parameters the server does not implement: a 400 naming each."""
    for extra in ({"echo": True}, {"suffix": " end"}):
        r = httpx.post(server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "tiny", "prompt": [5, 6], "max_tokens": 2, **extra})
        (name,) = extra
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text


def test_api_key_is_required_but_not_for_health(server):
    r = httpx.get(server + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server + "/health").json() == {"status": "ok"}


def test_disconnect_mid_stream_returns_the_pages(server, client):
    url = server
    before = _metric(url, "jaxinfer_engine_generated_tokens")
    with httpx.stream("POST", url + "/v1/completions",
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "prompt": [5, 6, 7] * 20, "max_tokens": 150,
                            "stream": True, "temperature": 0}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # the first token is out; drop the connection
    deadline = time.time() + 20
    while _metric(url, "jaxinfer_pages_in_use") and time.time() < deadline:
        time.sleep(0.1)
    assert _metric(url, "jaxinfer_pages_in_use") == 0
    # Aborted, not run to its 150 tokens.
    assert _metric(url, "jaxinfer_engine_generated_tokens") - before < 100
    # Everyone else is still served.
    assert client.completions.create(model="tiny", prompt=[5, 6], max_tokens=3).choices


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "colour": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "colour"], "additionalProperties": False}


def test_structured_output(client):
    """json_schema (parses, validates), json_object, a regex (vLLM's extension, streamed)
    and a forced tool call: the outputs follow their grammars and end where they do."""
    r = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=150, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=150, temperature=0.8,
                                  seed=5, extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].text), dict)
    regex = r"(Monday|Friday) at [0-9]{1,2}(am|pm)"
    chunks = list(client.completions.create(model="tiny", prompt=IDS, max_tokens=20,
                                            temperature=0.7, stream=True,
                                            extra_body={"guided_regex": regex}))
    assert re.fullmatch(regex, "".join(c.choices[0].text for c in chunks))
    assert chunks[-1].choices[0].finish_reason == "stop"
    tool = {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}}}
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    r = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=120, temperature=0, tools=[tool],
        tool_choice={"type": "function", "function": {"name": "weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 10  # the tools were in it
    chunks = list(client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=120, temperature=0, tools=[tool],
        tool_choice="required", stream=True))
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["weather"] * len(calls) and calls
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), tool["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_top_logprobs(client):
    """Chat top_logprobs (streamed and not) and completions' logprobs=k: k alternatives per
    token, descending; greedy, the chosen token is the first, with its own logprob."""
    kw = dict(model="tiny", messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
              top_logprobs=4)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        lps = [a.logprob for a in t.top_logprobs]
        assert len(lps) == 4 and lps == sorted(lps, reverse=True) and lps[-1] < 0
        assert (t.top_logprobs[0].token, t.top_logprobs[0].logprob) == (t.token, t.logprob)
        assert sum(math.exp(x) for x in lps) <= 1 + 1e-4
    streamed = [t for c in client.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    # (the second request may reuse the first one's prompt pages from the prefix cache: the
    # same tokens, logprobs rounded apart outside the deterministic policy)
    assert [t.token for t in streamed] == [t.token for t in content]
    np.testing.assert_allclose([[a.logprob for a in t.top_logprobs] for t in streamed],
                               [[a.logprob for a in t.top_logprobs] for t in content],
                               rtol=1e-5, atol=1e-6)
    r = client.completions.create(model="tiny", prompt=IDS, max_tokens=5, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == len(lp.token_logprobs) == 5
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and top.get(token) == chosen == max(top.values())
    # text_offset: where each token starts in the text, the same streamed and not
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(5)]
    streamed = [o for c in client.completions.create(model="tiny", prompt=IDS, max_tokens=5,
                                                     temperature=0, logprobs=1, stream=True)
                if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert streamed == lp.text_offset
