"""Router metrics in the Prometheus text exposition format, written by hand.

The request handlers (``app.py``), the flows (``dispatch.py``) and the health
monitor (``monitor.py``) record into one :class:`RouterMetrics` owned by the
app; ``GET /metrics`` calls :meth:`RouterMetrics.render` (and appends the
connector's counters, ``connector_stats.py``). Everything runs on the
router's event loop, so there are no locks.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
)  # fmt: skip

LabelSet = tuple[tuple[str, str], ...]


class Histogram:
    """Cumulative-bucket histogram for one label set."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def lines(self, name: str, labels: LabelSet) -> list[str]:
        out, cumulative = [], 0
        edges = [*(_fmt(b) for b in self.buckets), "+Inf"]
        for edge, count in zip(edges, self.counts, strict=True):
            cumulative += count
            out.append(f"{name}_bucket{_labels((*labels, ('le', edge)))} {cumulative}")
        out.append(f"{name}_sum{_labels(labels)} {_fmt(self.total)}")
        out.append(f"{name}_count{_labels(labels)} {cumulative}")
        return out


class RouterMetrics:
    """Counters, an in-flight gauge and latency histograms for one router."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._requests: dict[LabelSet, int] = defaultdict(int)
        self._errors: dict[LabelSet, int] = defaultdict(int)
        self._failures: dict[LabelSet, int] = defaultdict(int)
        self._retries: dict[LabelSet, int] = defaultdict(int)
        self._transitions: dict[LabelSet, int] = defaultdict(int)
        self._instance_healthy: dict[LabelSet, int] = {}
        self._num_in_flight = 0
        self._histograms: dict[str, dict[LabelSet, Histogram]] = defaultdict(dict)

    def request_started(self) -> None:
        self._num_in_flight += 1

    def request_finished(self, endpoint: str, status: str, latency_s: float) -> None:
        """One client request ended with HTTP ``status`` (``"499"``: client left)."""
        self._num_in_flight -= 1
        self._requests[self._base(endpoint=endpoint, status=status)] += 1
        self._observe("request_latency_seconds", latency_s, endpoint=endpoint)

    def rejected(self, endpoint: str, status: str, cause: str) -> None:
        """A request refused before any backend was asked (bad input)."""
        self._requests[self._base(endpoint=endpoint, status=status)] += 1
        self.error(cause)

    def error(self, cause: str) -> None:
        self._errors[self._base(cause=cause)] += 1

    def failed(self, cause: str) -> None:
        """An attempt (retried or not) or a request failed; ``cause`` is a
        coarse kind: unreachable, upstream_error, timeout, client_gone, ..."""
        self._failures[self._base(cause=cause)] += 1

    def retried(self) -> None:
        """A failed attempt is being tried again on other instances."""
        self._retries[self._base()] += 1

    def set_instance_healthy(self, instance: str, role: str, is_healthy: bool) -> None:
        self._instance_healthy[self._base(instance=instance, role=role)] = int(
            is_healthy
        )

    def health_transition(self, instance: str, role: str, is_healthy: bool) -> None:
        """An instance went down or came back (also sets its health gauge)."""
        to = "up" if is_healthy else "down"
        self._transitions[self._base(instance=instance, role=role, to=to)] += 1
        self.set_instance_healthy(instance, role, is_healthy)

    def observe_ttft(self, endpoint: str, seconds: float) -> None:
        """Router-observed time to the first byte/SSE event from decode."""
        self._observe("ttft_seconds", seconds, endpoint=endpoint)

    def observe_prefill(self, seconds: float, outcome: str) -> None:
        """Duration of one prefill leg; ``outcome`` is ok, error or aborted."""
        self._observe("prefill_leg_seconds", seconds, outcome=outcome)

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def render(self) -> str:
        """The whole exposition, ready to serve as ``text/plain; version=0.0.4``."""
        lines = _counter(
            "kvpush_router_requests_total", "Client requests by result.", self._requests
        )
        lines += _counter(
            "kvpush_router_errors_total", "Errors by cause.", self._errors
        )
        lines += _counter(
            "kvpush_router_failures_total",
            "Failed attempts and requests by kind (a retried attempt counts too).",
            self._failures,
        )
        lines += _counter(
            "kvpush_router_retries_total",
            "Attempts retried on other instances.",
            self._retries,
        )
        lines += _counter(
            "kvpush_router_health_transitions_total",
            "Instances marked down or back up.",
            self._transitions,
        )
        lines += _gauge(
            "kvpush_router_instance_healthy",
            "1 if the router routes to the instance, 0 if marked down.",
            self._instance_healthy,
        )
        lines += _gauge(
            "kvpush_router_requests_in_flight",
            "Client requests being served.",
            {self._base(): self._num_in_flight},
        )
        for short, by_labels in sorted(self._histograms.items()):
            name = f"kvpush_router_{short}"
            lines += [
                f"# HELP {name} {_HISTOGRAM_HELP[short]}",
                f"# TYPE {name} histogram",
            ]
            for labels, hist in sorted(by_labels.items()):
                lines += hist.lines(name, labels)
        return "\n".join(lines) + "\n"

    def _base(self, **labels: str) -> LabelSet:
        return (("mode", self.mode), *sorted(labels.items()))

    def _observe(self, short: str, value: float, **labels: str) -> None:
        key = self._base(**labels)
        hist = self._histograms[short].get(key)
        if hist is None:
            hist = self._histograms[short][key] = Histogram(LATENCY_BUCKETS_S)
        hist.observe(value)


_HISTOGRAM_HELP = {
    "request_latency_seconds": "Client request latency seen by the router.",
    "ttft_seconds": "Time to first byte or SSE event from the decode backend.",
    "prefill_leg_seconds": "Duration of the prefill leg.",
}


def _counter(name: str, help_text: str, values: dict[LabelSet, int]) -> list[str]:
    return metric_lines(name, "counter", help_text, values)


def _gauge(name: str, help_text: str, values: dict[LabelSet, int]) -> list[str]:
    return metric_lines(name, "gauge", help_text, values)


def metric_lines(
    name: str, kind: str, help_text: str, values: dict[LabelSet, int]
) -> list[str]:
    """HELP, TYPE and one sample line per label set, sorted."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{_labels(k)} {v}" for k, v in sorted(values.items())]
    return lines


def _labels(labels: LabelSet) -> str:
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(value: float) -> str:
    return repr(float(value))
