"""An OpenAI-compatible HTTP API over the engine (FastAPI; server-sent events for streams).

    POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics

Errors have OpenAI's body, {"error": {"message", "type", "param", "code"}}, with 400 for a bad
parameter, 401 without the API key, 404 for an unknown model, 408 past the request timeout,
413 for a body too large, 429 (with Retry-After) when the queue is full; never a traceback. A
client that disconnects from a stream aborts its request (its pages go back at once).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask

from jaxinfer.generate import StreamText
from jaxinfer.sampling import SamplingParams
from jaxinfer.server.idtext import IdText
from jaxinfer.server.limits import RequestLimits
from jaxinfer.server.metrics import Metrics
from jaxinfer.server.page import PAGE_PATHS, add_chat_page
from jaxinfer.server.runner import EngineRunner

MAX_BODY_BYTES = 4 << 20
RETRY_AFTER_S = 1  # what a 429 asks a client to wait (the openai client honours it)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (status, message, param,
                                                                       kind, code)
        self.headers = headers


def _error(status: int, message: str, param=None, kind="invalid_request_error", code=None,
           headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status, headers=headers)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """The parameters both endpoints take (unknown fields are ignored, as OpenAI does)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0, lt=1)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0)
    seed: int | None = Field(default=None, ge=0, lt=2**32)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict | None = None


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False


def _messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages -> the template's {"role", "content"} (text parts joined)."""
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise APIError(400, f"messages[{i}].role must be system, user, assistant or tool, "
                                f"got {role!r}", f"messages[{i}].role")
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            if any(p.get("type") != "text" for p in content if isinstance(p, dict)) or \
                    not all(isinstance(p, str) for p in parts):
                raise APIError(400, f"messages[{i}].content: only text parts are supported",
                               f"messages[{i}].content")
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or text parts",
                           f"messages[{i}].content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def create_app(runner: EngineRunner, model_name: str, api_key: str | None = None,
               max_tokens_limit: int | None = None, request_timeout: float | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The API over `runner`'s engine, serving the model as `model_name`. max_tokens_limit:
    the most a request may ask for (default the engine's max_model_len); request_timeout:
    seconds a request may take, queue included (None: no limit)."""
    app = FastAPI(title="jaxinfer", docs_url=None, redoc_url=None)
    # The API key, body size and timeout in one plain ASGI middleware: a BaseHTTPMiddleware
    # (@app.middleware) would pass every streamed event through a task and a memory stream.
    app.add_middleware(RequestLimits, max_body_bytes=max_body_bytes, timeout=request_timeout,
                       api_key=api_key, public=("/health", *PAGE_PATHS))
    engine = runner.engine
    tokenizer = engine.model.tokenizer or IdText()  # random weights: token ids only
    metrics = Metrics(runner)
    max_tokens_limit = max_tokens_limit or engine.max_model_len

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return _error(e.status, e.message, e.param, e.kind, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg, loc = "the body is not valid JSON", None
        return _error(400, f"{loc + ': ' if loc else ''}{msg}", loc)

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):  # never a traceback to the client
        return _error(500, f"internal error: {type(e).__name__}", kind="server_error")

    add_chat_page(app)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "jaxinfer"}]}

    def check(req: _Common) -> tuple[SamplingParams, int]:
        if req.model != model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                                f"{model_name!r}", "model", code="model_not_found")
        if req.response_format is not None and req.response_format.get("type") != "text":
            raise APIError(400, "response_format json_object / json_schema is not supported "
                                "yet", "response_format")
        max_tokens = req.max_completion_tokens or req.max_tokens or 256
        if max_tokens > max_tokens_limit:
            raise APIError(400, f"max_tokens {max_tokens} exceeds this server's limit of "
                                f"{max_tokens_limit}", "max_tokens")
        try:
            sp = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                min_p=req.min_p, presence_penalty=req.presence_penalty,
                                frequency_penalty=req.frequency_penalty,
                                repetition_penalty=req.repetition_penalty,
                                logprobs=bool(req.logprobs is not None and req.logprobs
                                              is not False))
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return sp, max_tokens

    async def submit_all(prompt, req: _Common, sp: SamplingParams, max_tokens: int):
        subs = []
        try:
            for i in range(req.n):
                seed = None if req.seed is None else (req.seed + i) % 2**32
                subs.append(await runner.submit(prompt, sampling=sp, max_tokens=max_tokens,
                                                stop=req.stop, seed=seed, chat=False))
        except OverflowError as e:
            for s in subs:
                runner.abort(s.request_id)
            raise APIError(429, f"the server is busy ({e}); retry later",
                           kind="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except asyncio.CancelledError:  # the client went away, or the request timed out
            for s in subs:
                runner.abort(s.request_id)
            raise
        except ValueError as e:
            for s in subs:
                runner.abort(s.request_id)
            raise APIError(400, str(e), "messages" if isinstance(prompt, list) and prompt
                           and isinstance(prompt[0], dict) else "prompt") from None
        return subs

    async def choice_events(sub, stops):
        """(piece, token ids, logprobs, finish_reason or None) per output of one choice."""
        shown = StreamText(tokenizer, sub.stop_ids, stops)
        while True:
            out = await sub.queue.get()
            if out is None:
                return
            piece, stopped = "", False
            for i, t in enumerate(out.new_token_ids):
                last = out.finished and i == len(out.new_token_ids) - 1
                p, stopped = shown.feed(t, last)
                piece += p
                if stopped:
                    break
            yield piece, out.new_token_ids, out.new_logprobs, out.finish_reason \
                if out.finished else None

    def token_logprobs(ids, lps):
        return [{"token": tokenizer.decode([t]), "logprob": lp,
                 "bytes": list(tokenizer.decode([t]).encode()), "top_logprobs": []}
                for t, lp in zip(ids, lps or [])]

    async def run(kind: str, req: _Common, prompt):
        sp, max_tokens = check(req)
        if getattr(req, "top_logprobs", None) or (kind == "text" and (req.logprobs or 0) > 0):
            raise APIError(400, "top logprobs (alternatives per token) are not supported yet; "
                                "ask for the chosen tokens' logprobs only", "top_logprobs")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        subs = await submit_all(prompt, req, sp, max_tokens)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if kind == "chat" else "text_completion"
        t0 = time.perf_counter()

        def usage(completion_tokens):
            prompt_tokens = sum(s.prompt_tokens for s in subs) // len(subs)
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens}

        if not req.stream:
            texts, ids, lps, reasons = [""] * len(subs), [[] for _ in subs], \
                [[] for _ in subs], [None] * len(subs)
            try:
                for i, sub in enumerate(subs):
                    async for piece, toks, lp, reason in choice_events(sub, stops):
                        texts[i] += piece
                        ids[i] += toks
                        lps[i] += lp or []
                        reasons[i] = reason or reasons[i]
            finally:
                for sub in subs:
                    runner.abort(sub.request_id)
            metrics.finished(len(subs), t0, sum(map(len, ids)))
            choices = []
            for i in range(len(subs)):
                if kind == "chat":
                    c = {"index": i, "message": {"role": "assistant", "content": texts[i]},
                         "finish_reason": reasons[i],
                         "logprobs": {"content": token_logprobs(ids[i], lps[i])}
                         if req.logprobs else None}
                else:
                    c = {"index": i, "text": texts[i], "finish_reason": reasons[i],
                         "logprobs": {"tokens": [tokenizer.decode([t]) for t in ids[i]],
                                      "token_logprobs": lps[i], "top_logprobs": None,
                                      "text_offset": None}
                         if req.logprobs is not None else None}
                choices.append(c)
            return {"id": rid, "object": obj, "created": created, "model": model_name,
                    "choices": choices, "usage": usage(sum(map(len, ids)))}

        async def events():
            merged: asyncio.Queue = asyncio.Queue()

            async def pump(i, sub):
                async for event in choice_events(sub, stops):
                    await merged.put((i, event))
                await merged.put((i, None))

            tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(subs)]
            done, generated, first = 0, 0, True
            chunk_obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
            try:
                if kind == "chat":
                    for i in range(len(subs)):
                        yield json.dumps({"id": rid, "object": chunk_obj, "created": created,
                                          "model": model_name, "choices": [
                                              {"index": i, "delta": {"role": "assistant",
                                                                     "content": ""},
                                               "finish_reason": None}]})
                while done < len(subs):
                    i, event = await merged.get()
                    if event is None:
                        done += 1
                        continue
                    piece, toks, lp, reason = event
                    generated += len(toks)
                    if first:
                        metrics.first_token(t0)
                        first = False
                    if kind == "chat":
                        c = {"index": i, "delta": {"content": piece} if piece else {},
                             "finish_reason": reason,
                             "logprobs": {"content": token_logprobs(toks, lp)}
                             if req.logprobs else None}
                    else:
                        c = {"index": i, "text": piece, "finish_reason": reason,
                             "logprobs": {"tokens": [tokenizer.decode([t]) for t in toks],
                                          "token_logprobs": lp or [], "top_logprobs": None,
                                          "text_offset": None}
                             if req.logprobs is not None else None}
                    yield json.dumps({"id": rid, "object": chunk_obj, "created": created,
                                      "model": model_name, "choices": [c]})
                if req.stream_options and req.stream_options.include_usage:
                    yield json.dumps({"id": rid, "object": chunk_obj, "created": created,
                                      "model": model_name, "choices": [],
                                      "usage": usage(generated)})
                metrics.finished(len(subs), t0, generated)
                yield "[DONE]"
            finally:  # a disconnect cancels this generator: the requests go at once
                for task in tasks:
                    task.cancel()
                for sub in subs:
                    runner.abort(sub.request_id)

        async def abort_all():  # also when the client left before the stream's first event
            for sub in subs:
                runner.abort(sub.request_id)

        return EventSourceResponse(events(), ping=15, background=BackgroundTask(abort_all))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions")
        return await run("chat", req, _messages(req.messages))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "give one prompt per request (a string or token ids)",
                               "prompt")
            prompt = prompt[0]
        if req.echo:
            raise APIError(400, "echo is not supported", "echo")
        return await run("text", req, prompt)

    return app

