"""Background health checks: the thin adapter around :class:`HealthBoard`.

The app starts one :class:`HealthMonitor` with its HTTP client and closes it
before the client (``app.py``). It runs one task per backend, named
``health-<engine id>``, that probes ``GET /health`` (each probe bounded by
``health_timeout_s``) every ``health_interval_s`` and records the result on
the board. ``legs.py`` calls :meth:`HealthMonitor.mark_unreachable` when a leg
cannot connect. Each transition is logged once (warning down, info up) and
counted in the metrics. :func:`probe` also serves the router's own
``GET /health``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from kvpush.router.config import RouterConfig
from kvpush.router.health import HealthBoard, Transition
from kvpush.router.metrics import RouterMetrics
from kvpush.router.tasks import cancel_all
from kvpush.topology import Backend

logger = logging.getLogger(__name__)

STOP_WAIT_S = 2.0  # how long closing waits for the probe tasks to unwind


@dataclass(frozen=True)
class ProbeResult:
    """One ``GET /health`` of a backend: its HTTP status, or why none came."""

    status: int | None
    error: str | None = None

    @property
    def is_ok(self) -> bool:
        return self.status == 200

    @property
    def detail(self) -> str:
        return self.error or f"HTTP {self.status}"


async def probe(
    session: aiohttp.ClientSession, backend: Backend, timeout_s: float
) -> ProbeResult:
    """Ask ``backend``'s ``/health`` once, within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(backend.url.rstrip("/") + "/health") as resp:
                return ProbeResult(status=resp.status)
    except TimeoutError:
        return ProbeResult(status=None, error=f"no answer within {timeout_s}s")
    except aiohttp.ClientError as e:
        return ProbeResult(status=None, error=f"{type(e).__name__}: {e}")


class HealthMonitor:
    """Owns the health board and the probe tasks of one router."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics) -> None:
        self._config = config
        self._metrics = metrics
        self.board = HealthBoard(config.topology.backends, config.unhealthy_after)
        self._tasks: list[asyncio.Task[None]] = []
        # Called with the engine id of each instance marked down (routing
        # forgets what it held).
        self.down_listeners: list[Callable[[str], None]] = []
        for backend in config.topology.backends:
            metrics.set_instance_healthy(backend.engine_id, backend.role, True)

    def start(self, session: aiohttp.ClientSession) -> None:
        """Start probing every backend (the first probe at once)."""
        if self._tasks:
            raise RuntimeError("health checks already started")
        self._tasks = [
            asyncio.create_task(
                self._watch(session, backend), name=f"health-{backend.engine_id}"
            )
            for backend in self.board.backends
        ]

    async def close(self) -> None:
        """Stop probing; waits at most ``STOP_WAIT_S`` for the tasks to end."""
        await cancel_all(self._tasks, STOP_WAIT_S)
        self._tasks = []

    def mark_unreachable(self, backend: Backend, detail: str) -> None:
        """A leg to ``backend`` failed to connect: route around it now."""
        self._apply(self.board.mark_unreachable(backend.engine_id, detail))

    async def _watch(self, session: aiohttp.ClientSession, backend: Backend) -> None:
        while True:
            try:
                result = await probe(session, backend, self._config.health_timeout_s)
            except Exception as e:  # the loop must outlive any one probe
                logger.exception("health probe of %s failed", backend.engine_id)
                result = ProbeResult(status=None, error=f"{type(e).__name__}: {e}")
            self.record(backend, result)
            await asyncio.sleep(self._config.health_interval_s)

    def record(self, backend: Backend, result: ProbeResult) -> None:
        """The outcome of any probe of ``backend`` (the router's own
        ``/health`` probes too, so that a 200 there means routable now)."""
        self._apply(
            self.board.record_probe(backend.engine_id, result.is_ok, result.detail)
        )

    def _apply(self, transition: Transition | None) -> None:
        if transition is None:
            return
        backend = transition.backend
        self._metrics.health_transition(
            backend.engine_id, backend.role, transition.is_healthy
        )
        if transition.is_healthy:
            logger.info(
                "instance %s (%s) healthy again: %s",
                backend.engine_id,
                backend.role,
                transition.reason,
            )
        else:
            logger.warning(
                "instance %s (%s) marked unhealthy: %s",
                backend.engine_id,
                backend.role,
                transition.reason,
            )
            for listener in self.down_listeners:
                listener(backend.engine_id)
