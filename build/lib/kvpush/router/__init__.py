"""kvpush's OpenAI-compatible router for colocated and P/D vLLM clusters.

Module map: ``config`` (RouterConfig), ``requests`` (edge parsing),
``health`` (which backends are up: pure), ``monitor`` (the health probes),
``selection`` (which backend), ``retry`` (when to try another pair: pure),
``context`` (one request in flight), ``dispatch`` (the per-mode flows and
their attempts), ``legs`` (upstream I/O), ``relay`` (the client side),
``errors`` (OpenAI error replies), ``metrics`` (its own Prometheus metrics),
``connector_stats`` (the connector events scraped from the instances),
``app`` (aiohttp app and entry points).
"""

from kvpush.router.app import RunningRouter, build_app, run_router, start_router
from kvpush.router.config import RouterConfig

__all__ = ["RouterConfig", "RunningRouter", "build_app", "run_router", "start_router"]
