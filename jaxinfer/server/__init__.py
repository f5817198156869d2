"""`jaxinfer serve`: an OpenAI-compatible server over the engine (jaxinfer/server/app.py)."""

from jaxinfer.server.app import create_app
from jaxinfer.server.runner import EngineRunner

__all__ = ["EngineRunner", "create_app"]
