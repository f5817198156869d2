"""An OpenAI-compatible HTTP API over the engine (FastAPI; server-sent events for streams).

    POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics

Errors have OpenAI's body, {"error": {"message", "type", "param", "code"}}, with 400 for a bad
parameter, 401 without the API key, 404 for an unknown model, 408 past the request timeout,
413 for a body too large, 429 (with Retry-After) when the queue is full; never a traceback. A
client that disconnects from a stream aborts its request (its pages go back at once).

Structured output (jaxinfer/structured.py, llguidance), one constraint per request, compiled
on a worker thread (an invalid one: 400):
- OpenAI's `response_format`: {"type": "json_object"} or {"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}} (the schema is always enforced);
- vLLM's extensions, as `extra_body` of the openai client: `structured_outputs` {"json" |
  "regex" | "grammar" (Lark) | "choice": ...}, or the older `guided_json`, `guided_regex`,
  `guided_grammar`, `guided_choice`;
- chat `tool_choice` naming a function ({"type": "function", "function": {"name"}}) or
  "required": the reply is a tool call whose arguments follow the function's parameters
  schema (as vLLM does it). "none" (the default) puts `tools` in the prompt through the chat
  template and returns text; "auto" needs a tool-call parser, which this server does not
  have (400).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask

from jaxinfer import prompts as prompts_lib
from jaxinfer import structured
from jaxinfer.generate import StreamText
from jaxinfer.prompts import check_text
from jaxinfer.sampling import MAX_TOP_LOGPROBS, SamplingParams
from jaxinfer.server.idtext import IdText
from jaxinfer.server.limits import RequestLimits
from jaxinfer.server.metrics import Metrics
from jaxinfer.server.page import PAGE_PATHS, add_chat_page
from jaxinfer.server.runner import EngineClient, EngineDead

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
    # vLLM's structured-output extensions (one constraint per request; see the docstring).
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    logit_bias: dict[str, float] | None = None  # {token id as a string: bias in [-100, 100]}
    ignore_eos: bool = False  # vLLM's: EOS does not end the completion
    # Parameters that would change the output and are not implemented: refused when set
    # (`check`), never silently ignored as the unknown fields are.
    best_of: int | None = None
    min_tokens: int = 0


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None


# structured_outputs keys (vLLM) -> Grammar constructors
_CONSTRAINTS = {"json": structured.Grammar.json_schema, "regex": structured.Grammar.regex,
                "grammar": structured.Grammar.lark, "choice": structured.Grammar.choice}


def _constraint(req: _Common) -> tuple[str, Any] | None:
    """(param, how to compile it) of the request's one output constraint, or None."""
    found = []
    rf = req.response_format
    if rf is not None and rf.get("type") != "text":
        found.append(("response_format", _bind(structured.from_response_format, rf)))
    so = req.structured_outputs or {}
    for key, value in so.items():
        if key not in _CONSTRAINTS:
            raise APIError(400, f"structured_outputs.{key} is not supported (json, regex, "
                                "grammar and choice are)", f"structured_outputs.{key}")
        if value is not None:
            found.append((f"structured_outputs.{key}", _bind(_CONSTRAINTS[key], value)))
    for key in _CONSTRAINTS:
        value = getattr(req, f"guided_{key}")
        if value is not None:
            found.append((f"guided_{key}", _bind(_CONSTRAINTS[key], value)))
    if len(found) > 1:
        raise APIError(400, "give at most one output constraint; got "
                            + ", ".join(p for p, _ in found), found[1][0])
    return found[0] if found else None


def _bind(make, value):
    def compile_for(tokenizer):
        return make(tokenizer, value)
    return compile_for


def _tools(req: ChatRequest, template: str) -> tuple[list | None, tuple | None, Any]:
    """-> (tools for the chat template, tool mode: None | ("required", None) | ("named",
    function name), the JSON schema the reply must follow in that mode)."""
    tools, choice = req.tools, req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None, None, None
    names = {}
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(f, dict) or t.get("type") != "function" or \
                not isinstance(f.get("name"), str) or not f["name"] or \
                not isinstance(f.get("parameters", {}), dict):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                "{\"name\": ..., \"parameters\": {...}}}", f"tools[{i}]")
        names[f["name"]] = f.get("parameters") or {"type": "object"}
    if "tools" not in template:
        raise APIError(400, "this model's chat template does not take tool definitions",
                       "tools")
    if choice in (None, "none"):
        return tools, None, None
    if choice == "auto":
        raise APIError(400, 'tool_choice "auto" needs a tool-call parser, which this server '
                            'does not have; use "none" (tool calls come back as text), '
                            '"required", or name a function', "tool_choice")
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for n, p in names.items()]
        return tools, ("required", None), {"type": "array", "minItems": 1,
                                           "items": {"anyOf": calls}}
    f = choice.get("function") if isinstance(choice, dict) else None
    name = f.get("name") if isinstance(f, dict) else None
    if not isinstance(name, str) or choice.get("type") != "function":
        raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": '
                            '"function", "function": {"name": ...}}', "tool_choice")
    if name not in names:
        raise APIError(400, f"tool_choice names {name!r}, which is not in tools",
                       "tool_choice")
    return tools, ("named", name), names[name]


def _tool_calls(mode: tuple, text: str, reason: str | None):
    """The reply of a tool-mode choice -> (content, tool_calls, finish_reason)."""
    if reason != "stop":  # cut short: the arguments are not complete JSON
        return text, None, reason
    if mode[0] == "required":
        try:
            calls = [(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
        except (ValueError, KeyError, TypeError):
            return text, None, reason
    else:
        calls = [(mode[1], text)]
    return None, [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                   "function": {"name": n, "arguments": a}} for n, a in calls], "tool_calls"


def _messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages -> the template's {"role", "content"} (text parts joined), with
    an assistant's tool_calls (their JSON arguments as objects, as templates read them) and
    a tool reply's tool_call_id and name."""
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
        try:
            check_text(content, f"messages[{i}].content")
        except ValueError as e:
            raise APIError(400, str(e), f"messages[{i}].content") from None
        msg = {"role": "system" if role == "developer" else role, "content": content}
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    for c in calls):
                raise APIError(400, f"messages[{i}].tool_calls must be an assistant's list "
                                    "of {\"function\": {\"name\", \"arguments\"}}",
                               f"messages[{i}].tool_calls")
            msg["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(
                c["function"].get("arguments"))}} for c in calls]
        out.append(msg)
    return out


def _arguments(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def create_app(runner: EngineClient, model_name: str, api_key: str | None = None,
               max_tokens_limit: int | None = None, request_timeout: float | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The API over `runner`'s engine process, serving the model as `model_name`.
    max_tokens_limit: the most a request may ask for (default the engine's max_model_len);
    request_timeout: seconds a request may take, queue included (None: no limit)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        runner.attach()  # the engine's messages are read on the server's event loop
        yield

    app = FastAPI(title="jaxinfer", docs_url=None, redoc_url=None, lifespan=lifespan)
    # The API key, body size and timeout in one plain ASGI middleware: a BaseHTTPMiddleware
    # (@app.middleware) would pass every streamed event through a task and a memory stream.
    app.add_middleware(RequestLimits, max_body_bytes=max_body_bytes, timeout=request_timeout,
                       api_key=api_key, public=("/health", *PAGE_PATHS))
    tokenizer = runner.tokenizer or IdText()  # random weights: token ids only
    token_ids_only = runner.tokenizer is None
    vocab_size = runner.info["vocab_size"]
    metrics = Metrics(runner)
    max_tokens_limit = max_tokens_limit or runner.info["max_model_len"]

    def engine_dead() -> APIError:
        return APIError(503, f"{runner.error}; this server is stopping", kind="server_error",
                        code="engine_dead")

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
        if runner.error is not None:
            return JSONResponse({"status": runner.error}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "jaxinfer"}]}

    def check_model(req: _Common) -> None:
        if req.model != model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                                f"{model_name!r}", "model", code="model_not_found")

    def check(req: _Common) -> tuple[SamplingParams, int]:
        check_model(req)
        unsupported = {"best_of": req.best_of not in (None, req.n),
                       "min_tokens": req.min_tokens != 0,
                       "suffix": bool(getattr(req, "suffix", None)),
                       "echo": getattr(req, "echo", False)}
        for name, given in unsupported.items():
            if given:
                raise APIError(400, f"{name} is not supported by this server; send the "
                                    f"request without it", name)
        max_tokens = req.max_completion_tokens or req.max_tokens or 256
        if max_tokens > max_tokens_limit:
            raise APIError(400, f"max_tokens {max_tokens} exceeds this server's limit of "
                                f"{max_tokens_limit}", "max_tokens")
        if isinstance(req, ChatRequest):
            if req.top_logprobs and not req.logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            logprobs, top = req.logprobs, (req.top_logprobs or 0) if req.logprobs else 0
        else:
            logprobs, top = req.logprobs is not None, req.logprobs or 0
        bias = {}
        for key, value in (req.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise APIError(400, f"logit_bias keys must be token ids (integers as strings), "
                                    f"got {key!r}", "logit_bias")
            bias[int(key)] = value
        try:
            sp = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                min_p=req.min_p, presence_penalty=req.presence_penalty,
                                frequency_penalty=req.frequency_penalty,
                                repetition_penalty=req.repetition_penalty,
                                logprobs=logprobs, top_logprobs=top, logit_bias=bias)
            sp.check_vocabulary(vocab_size)  # the message names the parameter
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return sp, max_tokens

    async def compile_grammar(param: str, make):
        """A constraint's Grammar, compiled on a worker thread (llguidance builds its lexer
        and parser tables: milliseconds, up to a second for a large schema)."""
        try:
            return await asyncio.to_thread(make, tokenizer)
        except (ValueError, TypeError) as e:  # TypeError: a value of the wrong JSON type
            msg = str(e)
            raise APIError(400, msg if msg.startswith(param) else f"{param}: {msg}",
                           param) from None

    async def submit_all(prompt, req: _Common, sp: SamplingParams, max_tokens: int,
                         param: str, grammar):
        try:  # tokenized here, in the API process; the engine process checks the ids again
            (ids,) = prompts_lib.encode(runner.tokenizer, [prompt], False, vocab_size)
        except ValueError as e:
            raise APIError(400, str(e), param) from None
        spec = None if grammar is None else grammar.spec()
        subs = []
        try:
            for i in range(req.n):
                seed = None if req.seed is None else (req.seed + i) % 2**32
                subs.append(await runner.submit(ids, sampling=sp, max_tokens=max_tokens,
                                                stop=req.stop, seed=seed, grammar=spec,
                                                ignore_eos=req.ignore_eos))
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
            raise APIError(400, str(e), param) from None
        except EngineDead:
            raise engine_dead() from None
        return subs

    async def choice_events(sub, stops):
        """(piece, token ids, logprobs, top logprobs, finish_reason or None) per output of
        one choice."""
        shown = StreamText(tokenizer, sub.stop_ids, stops)
        while True:
            out = await sub.queue.get()
            if out is None:
                return
            if isinstance(out, EngineDead):
                raise out
            piece, stopped = "", False
            for i, t in enumerate(out.new_token_ids):
                last = out.finished and i == len(out.new_token_ids) - 1
                p, stopped = shown.feed(t, last)
                piece += p
                if stopped:
                    break
            yield piece, out.new_token_ids, out.new_logprobs, out.new_top_logprobs, \
                out.finish_reason if out.finished else None

    def token_text(t: int) -> tuple[str, list[int]]:
        """A token's text and its own bytes (part of a UTF-8 character for some tokens)."""
        if token_ids_only:  # IdText: no llguidance tokenizer; the text is the bytes
            text = tokenizer.decode([t])
            return text, list(text.encode())
        raw = structured.ll_tokenizer(tokenizer).decode_bytes([t])
        return tokenizer.decode([t]), list(raw)

    def chat_logprobs(ids, lps, tops):
        content = []
        for j, (t, lp) in enumerate(zip(ids, lps or [])):
            text, raw = token_text(t)
            alternatives = []
            for a, alp in (tops[j] if tops else []):
                a_text, a_raw = token_text(a)
                alternatives.append({"token": a_text, "logprob": alp, "bytes": a_raw})
            content.append({"token": text, "logprob": lp, "bytes": raw,
                            "top_logprobs": alternatives})
        return {"content": content}

    def text_logprobs(ids, lps, tops, k, start: int = 0):
        """Completions' logprobs; text_offset: each token's character offset in the choice's
        text, from `start` (the characters streamed before), as vLLM counts them."""
        tokens = [tokenizer.decode([t]) for t in ids]
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=start))
        return {"tokens": tokens, "token_logprobs": lps or [],
                "top_logprobs": [{tokenizer.decode([a]): alp for a, alp in top}
                                 for top in tops] if k and tops else None,
                "text_offset": offsets if tokens else []}

    async def run(kind: str, req: _Common, prompt, param: str, tool_mode=None,
                  tool_schema=None):
        sp, max_tokens = check(req)
        constraint = _constraint(req)
        if tool_mode is not None:
            if constraint is not None:
                raise APIError(400, f"tool_choice {req.tool_choice!r} constrains the reply; "
                                    f"{constraint[0]} cannot as well", constraint[0])
            constraint = ("tool_choice",
                          _bind(structured.Grammar.json_schema, tool_schema))
        if constraint and token_ids_only:
            raise APIError(400, f"{constraint[0]}: structured output needs the model's "
                                "tokenizer (this server has token ids only)", constraint[0])
        grammar = await compile_grammar(*constraint) if constraint else None
        if req.logprobs and not token_ids_only:  # token bytes come from llguidance's
            # tokenizer (~1 s to build once)
            await asyncio.to_thread(structured.ll_tokenizer, tokenizer)
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        subs = await submit_all(prompt, req, sp, max_tokens, param, grammar)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if kind == "chat" else "text_completion"
        t0 = time.perf_counter()
        k = sp.top_logprobs

        def usage(completion_tokens):
            prompt_tokens = sum(s.prompt_tokens for s in subs) // len(subs)
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens}

        def message(text, reason):
            if tool_mode is None:
                return {"role": "assistant", "content": text}, reason
            content, calls, reason = _tool_calls(tool_mode, text, reason)
            msg = {"role": "assistant", "content": content}
            if calls:
                msg["tool_calls"] = calls
            return msg, reason

        if not req.stream:
            n = len(subs)
            texts, ids, lps, tops, reasons = [""] * n, [[] for _ in subs], \
                [[] for _ in subs], [[] for _ in subs], [None] * n
            try:
                for i, sub in enumerate(subs):
                    async for piece, toks, lp, top, reason in choice_events(sub, stops):
                        texts[i] += piece
                        ids[i] += toks
                        lps[i] += lp or []
                        tops[i] += top or []
                        reasons[i] = reason or reasons[i]
            except EngineDead:
                raise engine_dead() from None
            finally:
                for sub in subs:
                    runner.abort(sub.request_id)
            metrics.finished(len(subs), t0, sum(map(len, ids)))
            choices = []
            for i in range(len(subs)):
                if kind == "chat":
                    msg, reason = message(texts[i], reasons[i])
                    c = {"index": i, "message": msg, "finish_reason": reason,
                         "logprobs": chat_logprobs(ids[i], lps[i], tops[i])
                         if req.logprobs else None}
                else:
                    c = {"index": i, "text": texts[i], "finish_reason": reasons[i],
                         "logprobs": text_logprobs(ids[i], lps[i], tops[i], k)
                         if req.logprobs is not None else None}
                choices.append(c)
            return {"id": rid, "object": obj, "created": created, "model": model_name,
                    "choices": choices, "usage": usage(sum(map(len, ids)))}

        async def events():
            if len(subs) == 1:  # one choice (most requests): its events as they come
                one = choice_events(subs[0], stops)
                tasks = []

                async def get():
                    try:
                        return 0, await anext(one)
                    except StopAsyncIteration:
                        return 0, None
            else:  # n > 1: a task per choice feeds one queue
                merged: asyncio.Queue = asyncio.Queue()

                async def pump(i, sub):
                    try:
                        async for event in choice_events(sub, stops):
                            await merged.put((i, event))
                    except EngineDead as e:
                        await merged.put((i, e))
                    await merged.put((i, None))

                tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(subs)]
                get = merged.get
            done, generated, first = 0, 0, True
            held = [""] * len(subs)  # tool mode: a choice's text, sent as a call at its end
            offset = [0] * len(subs)  # completions' text_offset: characters streamed so far
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
                    i, event = await get()
                    if event is None:
                        done += 1
                        continue
                    if isinstance(event, EngineDead):
                        raise event
                    piece, toks, lp, top, reason = event
                    generated += len(toks)
                    if first:
                        metrics.first_token(t0)
                        first = False
                    if kind == "chat":
                        delta = {"content": piece} if piece else {}
                        if tool_mode is not None:
                            held[i] += piece
                            delta = {}
                            if reason is not None:
                                msg, reason = message(held[i], reason)
                                delta = {"tool_calls": [{"index": j, **call} for j, call in
                                                        enumerate(msg["tool_calls"])]} \
                                    if "tool_calls" in msg else {"content": msg["content"]}
                        c = {"index": i, "delta": delta, "finish_reason": reason,
                             "logprobs": chat_logprobs(toks, lp, top)
                             if req.logprobs else None}
                    else:
                        c = {"index": i, "text": piece, "finish_reason": reason,
                             "logprobs": text_logprobs(toks, lp, top, k, offset[i])
                             if req.logprobs is not None else None}
                        if c["logprobs"] is not None:
                            offset[i] += sum(map(len, c["logprobs"]["tokens"]))
                    yield json.dumps({"id": rid, "object": chunk_obj, "created": created,
                                      "model": model_name, "choices": [c]})
                if req.stream_options and req.stream_options.include_usage:
                    yield json.dumps({"id": rid, "object": chunk_obj, "created": created,
                                      "model": model_name, "choices": [],
                                      "usage": usage(generated)})
                metrics.finished(len(subs), t0, generated)
                yield "[DONE]"
            except EngineDead:  # an error event (the openai client raises it), no [DONE]
                e = engine_dead()
                yield json.dumps({"error": {"message": e.message, "type": e.kind,
                                            "param": None, "code": e.code}})
            finally:  # a disconnect cancels this generator: the requests go at once
                for task in tasks:
                    task.cancel()
                for sub in subs:
                    runner.abort(sub.request_id)

        async def abort_all():  # also when the client left before the stream's first event
            for sub in subs:
                runner.abort(sub.request_id)

        async def sse():  # Server-sent events: one `data:` line per chunk
            async for data in events():
                yield f"data: {data}\n\n"

        # Starlette's own streaming response, as vLLM's server: it cancels the stream when the
        # client disconnects; sse-starlette's per-event send timeout and task group took about
        # half of the event loop's time per token.
        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(abort_all))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        check_model(req)
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise APIError(400, "this model has no chat template; use /v1/completions")
        tools, mode, schema = _tools(req, template)
        try:
            ids = tokenizer.apply_chat_template(_messages(req.messages),
                                                add_generation_prompt=True, tools=tools)
        except ValueError as e:  # the template's own errors (ChatTemplateError)
            raise APIError(400, str(e), "messages") from None
        return await run("chat", req, ids, "messages", mode, schema)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "give one prompt per request (a string or token ids)",
                               "prompt")
            prompt = prompt[0]
        return await run("text", req, prompt, "prompt")

    return app

