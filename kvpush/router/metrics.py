"""The router's own metrics, on ``prometheus_client``.

The request handlers (``app.py``), the flows (``dispatch.py``, ``legs.py``)
and the health monitor (``monitor.py``) record into one
:class:`RouterMetrics` owned by the app, which keeps its families in a
registry of its own (two routers in one process never share a series).
``GET /metrics`` serves :meth:`RouterMetrics.render`: these families, then
the connector's events scraped from the instances (``connector_stats.py``).
Every series carries the router's ``mode``; the families are named in
:mod:`kvpush.telemetry.names` (``ROUTER_*``).
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.registry import Collector

from kvpush.telemetry import names
from kvpush.telemetry.names import Family

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
)  # fmt: skip
HANDOVER_BUCKETS_S: tuple[float, ...] = (
    0.0, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 30.0, 60.0,
)  # fmt: skip

prometheus_client.disable_created_metrics()  # no *_created series: noise here


class RouterMetrics:
    """Counters, gauges and latency histograms of one router."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self._binding = _counter(
            reg, names.ROUTER_BINDING, "kvpush mode: binding of each attempt "
            "(early: both legs at once; skip: no prefill leg) and why.",
        )  # fmt: skip
        self._decode_choice = _counter(
            reg, names.ROUTER_DECODE_CHOICE, "kvpush mode: why each attempt's "
            "decode was chosen (affinity, spill: the session's decode was too "
            "busy, prefix, load).",
        )  # fmt: skip
        self._requests = _counter(
            reg, names.ROUTER_REQUESTS, "Client requests by result."
        )
        self._errors = _counter(reg, names.ROUTER_ERRORS, "Errors by cause.")
        self._failures = _counter(
            reg, names.ROUTER_FAILURES,
            "Failed attempts and requests by kind (a retried attempt counts too).",
        )  # fmt: skip
        self._retries = _counter(
            reg, names.ROUTER_RETRIES, "Attempts retried on other instances."
        )
        self._transitions = _counter(
            reg, names.ROUTER_HEALTH_TRANSITIONS, "Instances marked down or back up."
        )
        self._instance_healthy = _gauge(
            reg, names.ROUTER_INSTANCE_HEALTHY,
            "1 if the router routes to the instance, 0 if marked down.",
        )  # fmt: skip
        self._in_flight = _gauge(
            reg, names.ROUTER_REQUESTS_IN_FLIGHT, "Client requests being served."
        ).labels(mode)
        self._latency = _histogram(
            reg, names.ROUTER_REQUEST_LATENCY, "Client request latency seen by the "
            "router.",
        )  # fmt: skip
        self._ttft = _histogram(
            reg, names.ROUTER_TTFT, "Time to the first byte or SSE event the "
            "client got (from decode, or from prefill with the first token "
            "from prefill).",
        )  # fmt: skip
        self._prefill = _histogram(
            reg, names.ROUTER_PREFILL_LEG, "Duration of the prefill leg."
        )
        self._handover = _histogram(
            reg, names.ROUTER_HANDOVER,
            "P/D modes: from the prefill leg's whole answer to decode's first "
            "byte or SSE event relayed (with the first token from prefill: "
            "the second token), as the router sees them; 0 when decode's came "
            "first (concurrent legs), so the decode-side wait after prefill.",
            HANDOVER_BUCKETS_S,
        ).labels(mode)  # fmt: skip
        self._first_token = _counter(
            reg, names.ROUTER_FIRST_TOKEN, "kvpush mode, first token from "
            "prefill: streamed requests by how their first token was served "
            "(prefill, ended: the request ended there, continued: decode "
            "diverged or failed after it, unavailable: decode's).",
        )  # fmt: skip
        self._kv_events = _counter(
            reg, names.ROUTER_KV_EVENTS, "kvpush mode: KV cache events read from "
            "each decode by what became of them (stored, removed, cleared, "
            "unplaced, skipped, unknown, lost; unbound: the router could not "
            "listen for them).",
        )  # fmt: skip

    def kv_event(self, instance: str, outcome: str) -> None:
        """kvpush mode: one KV cache event of a decode (``kv_events.py``'s
        outcomes, plus ``lost``: a gap or restart of its publisher)."""
        self._kv_events.labels(self.mode, instance, outcome).inc()

    def first_token(self, outcome: str) -> None:
        """kvpush mode: how one streamed request's first token was served."""
        self._first_token.labels(self.mode, outcome).inc()

    def binding(self, binding: str, reason: str) -> None:
        """kvpush mode: one attempt's binding (early, skip) and its reason."""
        self._binding.labels(self.mode, binding, reason).inc()

    def decode_choice(self, reason: str) -> None:
        """kvpush mode: why one attempt's decode was chosen."""
        self._decode_choice.labels(self.mode, reason).inc()

    def request_started(self) -> None:
        self._in_flight.inc()

    def request_finished(self, endpoint: str, status: str, latency_s: float) -> None:
        """One client request ended with HTTP ``status`` (``"499"``: client left)."""
        self._in_flight.dec()
        self._requests.labels(self.mode, endpoint, status).inc()
        self._latency.labels(self.mode, endpoint).observe(latency_s)

    def rejected(self, endpoint: str, status: str, cause: str) -> None:
        """A request refused before any backend was asked (bad input)."""
        self._requests.labels(self.mode, endpoint, status).inc()
        self.error(cause)

    def error(self, cause: str) -> None:
        self._errors.labels(self.mode, cause).inc()

    def failed(self, cause: str) -> None:
        """An attempt (retried or not) or a request failed; ``cause`` is a
        coarse kind: unreachable, upstream_error, timeout, client_gone, ..."""
        self._failures.labels(self.mode, cause).inc()

    def retried(self) -> None:
        """A failed attempt is being tried again on other instances."""
        self._retries.labels(self.mode).inc()

    def set_instance_healthy(self, instance: str, role: str, is_healthy: bool) -> None:
        self._instance_healthy.labels(self.mode, instance, role).set(int(is_healthy))

    def health_transition(self, instance: str, role: str, is_healthy: bool) -> None:
        """An instance went down or came back (also sets its health gauge)."""
        to = "up" if is_healthy else "down"
        self._transitions.labels(self.mode, instance, role, to).inc()
        self.set_instance_healthy(instance, role, is_healthy)

    def observe_ttft(self, endpoint: str, seconds: float) -> None:
        """Router-observed time to the first byte/SSE event from decode."""
        self._ttft.labels(self.mode, endpoint).observe(seconds)

    def observe_prefill(self, seconds: float, outcome: str) -> None:
        """Duration of one prefill leg; ``outcome`` is ok, error or aborted."""
        self._prefill.labels(self.mode, outcome).observe(seconds)

    def observe_handover(self, seconds: float) -> None:
        """Prefill's answer to decode's first byte (negative: clamped to 0)."""
        self._handover.observe(max(0.0, seconds))

    def register(self, collector: Collector) -> None:
        """Serve ``collector``'s families too (the scraped connector events)."""
        self.registry.register(collector)

    def render(self) -> str:
        """The whole exposition (Prometheus text format 0.0.4)."""
        return prometheus_client.generate_latest(self.registry).decode()


def _counter(registry: CollectorRegistry, family: Family, help_text: str) -> Counter:
    return Counter(family.name, help_text, family.label_names, registry=registry)


def _gauge(registry: CollectorRegistry, family: Family, help_text: str) -> Gauge:
    return Gauge(family.name, help_text, family.label_names, registry=registry)


def _histogram(
    registry: CollectorRegistry,
    family: Family,
    help_text: str,
    buckets: tuple[float, ...] = LATENCY_BUCKETS_S,
) -> Histogram:
    return Histogram(
        family.name, help_text, family.label_names, buckets=buckets, registry=registry
    )
