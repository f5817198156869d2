"""The OpenAI-compatible server, driven by the official `openai` client over loopback."""

import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

import jaxinfer
from jaxinfer.engine import Engine
from jaxinfer.server import EngineRunner, create_app

KEY = "test-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CHAT = [{"role": "user", "content": "Name three painters."}]
IDS = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def refs(tiny_chat):
    """generate()'s answers, computed before the server starts: no test thread runs JAX while
    the engine's thread may (concurrent compiles were seen to crash an XLA CPU process)."""
    return (jaxinfer.generate(tiny_chat, [CHAT], max_new_tokens=12)[0],
            jaxinfer.generate(tiny_chat, [IDS], max_new_tokens=10)[0])


@pytest.fixture(scope="module")
def server(tiny_chat, refs):
    """The tiny chat model served on 127.0.0.1 (an API key required), stopped at the end."""
    engine = Engine(tiny_chat, max_num_seqs=4, page_size=8, chunk_size=32, max_model_len=256,
                    kv_memory=jaxinfer.memory.kv_bytes_per_token(tiny_chat.config) * 8 * 200)
    runner = EngineRunner(engine, max_pending=64)
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(runner, "tiny", api_key=KEY),
                                        host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    srv.should_exit = True
    thread.join(timeout=10)
    runner.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, timeout=60, max_retries=0)


def _pages_in_use(url: str) -> float:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return float(next(line.split()[1] for line in text.splitlines()
                      if line.startswith("jaxinfer_pages_in_use ")))


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
                 "response_format": {"type": "json_object"}}), 400, "response_format"),
])
def test_bad_requests_get_openai_errors(server, body, status, words):
    r = httpx.post(server[0] + "/v1/chat/completions", content=body,
                   headers={"Authorization": f"Bearer {KEY}",
                            "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_api_key_is_required_but_not_for_health(server):
    r = httpx.get(server[0] + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server[0] + "/health").json() == {"status": "ok"}


def test_disconnect_mid_stream_returns_the_pages(server, client):
    url, engine = server
    before = engine.stats["generated_tokens"]
    with httpx.stream("POST", url + "/v1/completions",
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "prompt": [5, 6, 7] * 20, "max_tokens": 150,
                            "stream": True, "temperature": 0}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # the first token is out; drop the connection
    deadline = time.time() + 20
    while _pages_in_use(url) and time.time() < deadline:
        time.sleep(0.1)
    assert _pages_in_use(url) == 0
    assert engine.stats["generated_tokens"] - before < 100  # aborted, not run to its 150
    # Everyone else is still served.
    assert client.completions.create(model="tiny", prompt=[5, 6], max_tokens=3).choices
