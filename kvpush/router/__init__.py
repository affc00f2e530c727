"""kvpush's OpenAI-compatible router for colocated and P/D vLLM clusters.

Module map: ``config`` (RouterConfig), ``requests`` (edge parsing),
``selection`` (which backend), ``dispatch`` (the per-mode flows),
``errors`` (OpenAI error replies), ``metrics`` (Prometheus text),
``app`` (aiohttp app and entry points).
"""

from kvpush.router.app import RunningRouter, build_app, run_router, start_router
from kvpush.router.config import RouterConfig

__all__ = ["RouterConfig", "RunningRouter", "build_app", "run_router", "start_router"]
