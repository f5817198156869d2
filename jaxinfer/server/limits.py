"""Per-request checks as one plain ASGI middleware: the API key, the request body's size and
the request's time.

- API key: when set, every path but the public ones (/health, the chat page) needs
  `Authorization: Bearer KEY`, else 401 (checked before the body is read).

- Body: past `max_body_bytes` a request gets 413 with OpenAI's error body, whether it said its
  size (Content-Length, refused before a byte is read) or streamed it in chunks (counted as it
  comes; the body is read whole before the endpoint runs, which the JSON endpoints do anyway).
- Time: a request still running after `timeout` seconds (queued, prefilling or decoding) is
  cancelled, which aborts its engine requests and frees their pages (the endpoint's cleanup
  runs on cancellation). Before its response started it gets 408; a stream already under way
  gets a last event `data: {"error": {...}}` (what the openai client raises as an APIError)
  and ends without `[DONE]`.
"""

from __future__ import annotations

import asyncio
import hmac
import json

TIMEOUT_CODE = "timeout"


def _error_body(message: str, kind: str, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code}}).encode()


async def _send_error(send, status: int, message: str, kind: str, code=None) -> None:
    body = _error_body(message, kind, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class RequestLimits:
    """ASGI middleware: `app` behind an API key (None: none), with a body size limit and a
    per-request timeout (None: none)."""

    def __init__(self, app, max_body_bytes: int, timeout: float | None = None,
                 api_key: str | None = None, public: tuple[str, ...] = ("/health",),
                 exempt: tuple[str, ...] = ("/health", "/metrics")):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.timeout = timeout
        self.authorization = None if api_key is None else f"Bearer {api_key}".encode()
        self.public = public
        self.exempt = exempt

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.authorization is not None and scope["path"] not in self.public and \
                not hmac.compare_digest(headers.get(b"authorization", b""), self.authorization):
            return await _send_error(send, 401, "a valid API key is required (Authorization: "
                                     "Bearer ...)", "authentication_error", "invalid_api_key")
        limit = self.max_body_bytes
        too_large = f"the request body is larger than {limit} bytes"
        size = headers.get(b"content-length")
        if size is not None and size.isdigit() and int(size) > limit:
            return await _send_error(send, 413, too_large, "invalid_request_error")
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body, more = bytearray(), True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > limit:
                    return await _send_error(send, 413, too_large, "invalid_request_error")
            receive = _replay(bytes(body), receive)
        if self.timeout is None or scope["path"] in self.exempt:
            return await self.app(scope, receive, send)

        started = {"response": False, "stream": False, "ended": False}

        async def tracked_send(message):
            if message["type"] == "http.response.start":
                started["response"] = True
                ctype = dict(message.get("headers", [])).get(b"content-type", b"")
                started["stream"] = ctype.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                started["ended"] = True
            await send(message)

        try:
            async with asyncio.timeout(self.timeout):
                await self.app(scope, receive, tracked_send)
        except TimeoutError:
            message = f"the request took longer than this server's limit of {self.timeout:g} s"
            if not started["response"]:
                await _send_error(send, 408, message, "timeout_error", TIMEOUT_CODE)
            elif started["stream"] and not started["ended"]:
                event = b"data: " + _error_body(message, "timeout_error", TIMEOUT_CODE) \
                    + b"\r\n\r\n"
                await send({"type": "http.response.body", "body": event, "more_body": False})


def _replay(body: bytes, receive):
    """A receive() that hands the app the body already read, then the connection's events
    (a disconnect) as they come."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
