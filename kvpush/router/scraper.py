"""Background reads of every instance's ``/metrics``: the adapter that
feeds the :class:`~kvpush.router.signals.SignalBoard`.

``routing.py`` starts one :class:`SignalScraper` with the app's HTTP client
(kvpush mode only) and closes it before the client. It runs one task per
instance, named ``signals-<engine id>``, that reads ``GET /metrics``, asking
for :data:`~kvpush.router.signals.SCRAPED_SAMPLES` only (each read
bounded by ``timeout_s``), every ``interval_s`` and records a good read on
the board with its time. A failed or unparsable read records nothing: the
previous read ages out (``signal_max_age_s``) and the instance's load becomes
unknown, never idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import aiohttp

from kvpush.router.signals import SCRAPED_SAMPLES, SignalBoard, parse_scrape
from kvpush.router.tasks import cancel_all
from kvpush.topology import Backend

logger = logging.getLogger(__name__)

STOP_WAIT_S = 2.0  # how long closing waits for the tasks to unwind


async def read_metrics(
    session: aiohttp.ClientSession, backend: Backend, timeout_s: float
) -> str | None:
    """``backend``'s ``/metrics`` text, or None (logged at debug level)."""
    url = backend.url.rstrip("/") + "/metrics"
    query = [("name[]", sample) for sample in SCRAPED_SAMPLES]
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(url, params=query) as resp:
                if resp.status != 200:
                    logger.debug("signals of %s: %d", backend.engine_id, resp.status)
                    return None
                return await resp.text()
    except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError) as e:
        logger.debug("signals of %s: %s", backend.engine_id, e)
        return None


class SignalScraper:
    """Owns the scrape tasks of one router."""

    def __init__(
        self,
        backends: Sequence[Backend],
        board: SignalBoard,
        interval_s: float,
        timeout_s: float,
    ) -> None:
        self.board = board
        self._backends = tuple(backends)
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, session: aiohttp.ClientSession) -> None:
        """Start reading every instance (the first read at once)."""
        if self._tasks:
            raise RuntimeError("signal scraping already started")
        self._tasks = [
            asyncio.create_task(self._watch(session, b), name=f"signals-{b.engine_id}")
            for b in self._backends
        ]

    async def close(self) -> None:
        """Stop reading; waits at most ``STOP_WAIT_S`` for the tasks to end."""
        await cancel_all(self._tasks, STOP_WAIT_S)
        self._tasks = []

    async def read_once(self, session: aiohttp.ClientSession, backend: Backend) -> bool:
        """One read of ``backend`` onto the board; whether it was good."""
        text = await read_metrics(session, backend, self._timeout_s)
        if text is None:
            return False
        try:
            scrape = parse_scrape(text, backend.dp_rank)
        except ValueError as e:
            logger.debug("signals of %s do not parse: %s", backend.engine_id, e)
            return False
        self.board.record(backend.engine_id, scrape, time.monotonic())
        return True

    async def _watch(self, session: aiohttp.ClientSession, backend: Backend) -> None:
        while True:
            try:
                await self.read_once(session, backend)
            except Exception:  # the loop must outlive any one read
                logger.exception("signal read of %s failed", backend.engine_id)
            await asyncio.sleep(self._interval_s)
