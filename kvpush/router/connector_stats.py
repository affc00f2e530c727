"""The kvpush connector's events, scraped from the instances for the
router's ``/metrics``.

Every kvpush instance's vLLM exports the connector's events on its own
``/metrics`` as ``vllm:kvpush_events_total{model_name,engine,event}``
(:mod:`kvpush.connector.stats`; ``names.KVPUSH_EVENTS``). In kvpush mode,
each scrape of the router's ``/metrics`` first fetches every prefill and
decode instance's ``/metrics`` at once (:func:`scrape`; each bounded by
:data:`SCRAPE_TIMEOUT_S`, on the app's client session), reads them
(:mod:`kvpush.telemetry.reader`), sums each instance's events over vLLM's
engines and serves them as ``kvpush_connector_events_total{engine_id,role,
event}`` (:class:`ConnectorEvents`; ``names.CONNECTOR_EVENTS``). An
instance that does not answer in time, or answers something unparsable, is
left out of that scrape (logged at debug level); one that restarted counts
from 0 again (a counter reset).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence

import aiohttp
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpush.telemetry import names
from kvpush.telemetry.reader import Exposition
from kvpush.topology import Backend

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0
HELP = (
    "kvpush connector events by instance, scraped from each instance's "
    f"{names.KVPUSH_EVENTS.total} (summed over its engines)."
)

# (engine_id, role, event) -> count
Totals = dict[tuple[str, str, str], float]


def events_of(text: str) -> dict[str, float]:
    """The kvpush events in one instance's metrics text, summed over engines
    (``ValueError`` when the text does not parse)."""
    return Exposition.parse(text).by_label(names.KVPUSH_EVENTS, "event")


async def scrape(
    session: aiohttp.ClientSession,
    backends: Sequence[Backend],
    timeout_s: float = SCRAPE_TIMEOUT_S,
) -> Totals:
    """Every backend's kvpush events (those that answered in time)."""
    found = await asyncio.gather(
        *(_scrape_one(session, b, timeout_s) for b in backends)
    )
    totals: Totals = {}
    for backend, events in zip(backends, found, strict=True):
        for event, count in events.items():
            totals[(backend.engine_id, backend.role, event)] = count
    return totals


async def _scrape_one(
    session: aiohttp.ClientSession, backend: Backend, timeout_s: float
) -> dict[str, float]:
    url = backend.url.rstrip("/") + "/metrics"
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(url, timeout=timeout) as resp:
            resp.raise_for_status()
            return events_of(await resp.text())
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        logger.debug("connector events of %s: %s", backend.engine_id, e)
        return {}


class ConnectorEvents(Collector):
    """Serves the totals of the latest scrape (set by the ``/metrics`` handler
    just before it renders; everything runs on the router's loop)."""

    def __init__(self) -> None:
        self.totals: Totals = {}

    def collect(self) -> Iterator[Metric]:
        if not self.totals:
            return
        family = CounterMetricFamily(
            names.CONNECTOR_EVENTS.name,
            HELP,
            labels=list(names.CONNECTOR_EVENTS.label_names),
        )
        for labels, count in sorted(self.totals.items()):
            family.add_metric(list(labels), count)
        yield family
