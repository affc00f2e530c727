"""The kvpush connector's events, scraped from the instances for the
router's ``/metrics``.

Every kvpush instance's vLLM exports the connector's events on its own
``/metrics`` as ``vllm:kvpush_events_total{model_name,engine,event}``
(:mod:`kvpush.connector.stats`). In kvpush mode, each scrape of the
router's ``/metrics`` first fetches every prefill and decode instance's
``/metrics`` at once (:func:`scrape`; each bounded by
:data:`SCRAPE_TIMEOUT_S`, on the app's client session), parses them with
``prometheus_client``'s parser, sums each instance's events over vLLM's
engines and serves them as ``kvpush_connector_events_total{engine_id,role,
event}`` (:class:`ConnectorEvents`). An instance that does not answer in
time, or answers something unparsable, is left out of that scrape (logged
at debug level); one that restarted counts from 0 again (a counter reset).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence

import aiohttp
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from kvpush.topology import Backend

logger = logging.getLogger(__name__)

SOURCE = "vllm:kvpush_events"  # the counter family on each instance
METRIC = "kvpush_connector_events"  # served as kvpush_connector_events_total
SCRAPE_TIMEOUT_S = 2.0
HELP = (
    "kvpush connector events by instance, scraped from each instance's "
    "vllm:kvpush_events_total (summed over its engines)."
)

# (engine_id, role, event) -> count
Totals = dict[tuple[str, str, str], float]


def events_of(text: str) -> dict[str, float]:
    """The kvpush events in one instance's metrics text, summed over engines
    (``ValueError`` when the text does not parse)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != SOURCE:
            continue
        for sample in family.samples:
            event = sample.labels.get("event")
            if sample.name == f"{SOURCE}_total" and event:
                out[event] = out.get(event, 0.0) + sample.value
    return out


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
            METRIC, HELP, labels=["engine_id", "role", "event"]
        )
        for labels, count in sorted(self.totals.items()):
            family.add_metric(list(labels), count)
        yield family
