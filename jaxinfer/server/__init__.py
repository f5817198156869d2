"""`jaxinfer serve`: an OpenAI-compatible server over the engine (jaxinfer/server/app.py), the
engine in a process of its own (jaxinfer/server/runner.py)."""

from jaxinfer.server.app import create_app
from jaxinfer.server.runner import EngineClient, start_engine

__all__ = ["EngineClient", "create_app", "start_engine"]
