"""The server's limits, through the official `openai` client and raw HTTP on loopback: the request
timeout (408, or an error event ending a stream) with the pages given back, 429 with
Retry-After, the max_tokens limit, the body size limit (said or chunked), and Ctrl-C draining
the streams under way before the process stops.

One `jaxinfer serve --preset smollm2-135m --random-weights --num-layers 2` (random weights, no
tokenizer: token-id prompts): about 0.04 s a token on the CPU (its 49k-token head is most of
a step), so LONG tokens always outlast a 4 s timeout and 8 always fit in it; random weights
never stop early. Two layers, not the preset's 30: the engine's programs compile faster
(the head, not the layers, is most of a step)."""

import signal
import time

import httpx
import openai
import pytest

from tests.serving import serve

MODEL = "smollm2-135m"
TIMEOUT_S = 4
PROMPT = [1, 2, 3, 4]
LONG = 960  # the server's --max-tokens-limit: ~40 s of tokens here, ~10x the timeout


@pytest.fixture(scope="module")
def server():
    with serve("--preset", MODEL, "--random-weights", "--num-layers", "2", "--max-num-seqs",
               "1", "--max-pending", "1", "--max-model-len", "1024", "--kv-memory", "32MB",
               "--request-timeout", str(TIMEOUT_S), "--max-tokens-limit", str(LONG),
               "--shutdown-timeout", "30") as (url, proc, stderr):
        # The first request compiles the prefill and decode steps (tens of seconds here): it
        # times out, and the engine goes on compiling; wait until its pages are back.
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                      "max_tokens": LONG}, timeout=60)
        assert r.status_code == 408, r.text
        _wait_idle(url, 180)
        yield url, proc, stderr


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(next(line.split()[1] for line in text.splitlines()
                      if line.startswith(name + " ")))


def _wait_idle(url: str, wait: float = 30.0) -> None:
    """Until no request holds pages or a row (an abort lands at the engine's next step)."""
    deadline = time.time() + wait
    while time.time() < deadline:
        if _metric(url, "jaxinfer_pages_in_use") == 0 and \
                _metric(url, "jaxinfer_requests_running") == 0:
            time.sleep(0.3)  # the runner's own count of the request goes at that step too
            return
        time.sleep(0.2)
    pytest.fail(f"the server still held pages after {wait} s")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", timeout=60,
                         max_retries=0)


def test_timeout_ends_a_request_and_frees_its_pages(server, client):
    url = server[0]
    t0 = time.time()
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=LONG)
    assert e.value.status_code == 408 and e.value.code == "timeout"
    assert TIMEOUT_S <= time.time() - t0 < TIMEOUT_S + 3
    _wait_idle(url)
    # A stream under way: its last event is an error, which the client raises.
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=LONG,
                                       stream=True)
    pieces = []
    with pytest.raises(openai.APIError, match="longer than this server's limit"):
        for chunk in stream:
            pieces.append(chunk.choices[0].text)
    assert len(pieces) >= 2  # it streamed tokens before the cut
    _wait_idle(url)


def test_429_says_when_to_retry(server, client):
    url = server[0]
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=LONG,
                                       stream=True)
    next(iter(stream))  # the one request --max-pending allows is running
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    assert e.value.response.headers["retry-after"] == "1"
    assert e.value.body["type"] == "rate_limit_error"
    stream.close()  # a disconnect: aborted
    _wait_idle(url)


@pytest.mark.parametrize("body, headers, status, words", [
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": LONG + 1}, {}, 400, f"limit of {LONG}"),
    (b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"x" * (5 << 20) + b'"}',
     {"Content-Type": "application/json"}, 413, "larger than"),
    # the same body in chunks, without a Content-Length
    (iter([b'{"model": "', MODEL.encode(), b'", "prompt": "'] + [b"x" * (1 << 20)] * 5
          + [b'"}']), {"Content-Type": "application/json"}, 413, "larger than"),
    ({"model": MODEL, "prompt": "text needs a tokenizer", "max_tokens": 4}, {}, 400,
     "without a tokenizer"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, {}, 400,
     "no chat template"),
])
def test_limits_get_openai_errors(server, body, headers, status, words):
    url = server[0]
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body \
        else "/v1/completions"
    if isinstance(body, dict):
        r = httpx.post(url + path, json=body, timeout=30)
    else:
        r = httpx.post(url + path, content=body, headers=headers, timeout=30)
        if not isinstance(body, bytes):
            assert "content-length" not in r.request.headers
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_ctrl_c_drains_the_streams_then_stops(server, client):
    """Last in this file: it stops the server. A stream under way when SIGINT comes runs to
    its end ([DONE] and all its tokens); the process then exits 130 (as after Ctrl-C) and no
    longer accepts connections."""
    url, proc, stderr = server
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stream=True,
                                       stream_options={"include_usage": True})
    chunks = [next(iter(stream))]
    proc.send_signal(signal.SIGINT)
    chunks += list(stream)  # the openai client stops at [DONE]; a cut stream would raise
    assert chunks[-1].usage.completion_tokens == 8
    assert "".join(c.choices[0].text for c in chunks if c.choices).count(" ") == 8
    assert proc.wait(timeout=30) == 130, stderr()
    assert "Traceback" not in stderr(), stderr()
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)
