"""The chat page at `/`: one static HTML file (jaxinfer/server/static/chat.html, no build step)
whose script talks to the server's own streaming `/v1/chat/completions`.

The page itself holds nothing secret, so it is served without the API key (as `/health` is);
the page asks for the key when `/v1/models` answers 401 and sends it on every API call.
"""

from __future__ import annotations

import functools
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

PAGE_PATHS = ("/",)


@functools.cache
def chat_html() -> str:
    return resources.files("jaxinfer.server").joinpath("static/chat.html").read_text("utf-8")


def add_chat_page(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def chat_page():
        # Only this origin's scripts and API; no framing by other sites.
        return HTMLResponse(chat_html(), headers={
            "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
                                       "style-src 'unsafe-inline'; img-src data:; "
                                       "frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})
