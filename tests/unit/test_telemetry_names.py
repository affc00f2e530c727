"""The families kvpush exports are the ones ``kvpush.telemetry.names`` names:
each exporter, made to record into every family once, serves exactly those
(prometheus_client's ``*_created`` aside), of the declared type, each sample
with the declared labels."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kvpush.connector.phases import Phase
from kvpush.connector.stats import KvPushPromMetrics, KvPushStats, StatsData
from kvpush.router.connector_stats import ConnectorEvents
from kvpush.router.metrics import RouterMetrics
from kvpush.telemetry import names
from kvpush.telemetry.names import Family, Kind
from kvpush.telemetry.reader import Exposition


def served(text: str, families: tuple[Family, ...]) -> None:
    """``text`` serves exactly ``families``, each with its type and labels."""
    metrics = Exposition.parse(text)
    kinds = {n: k for n, k in metrics.kinds.items() if not n.endswith("_created")}
    assert kinds == {f.name: str(f.kind) for f in families}
    for family in families:
        if family.kind is Kind.HISTOGRAM:
            samples, extra = metrics.samples(family.bucket), {"le"}
        else:
            samples, extra = metrics.samples(family), set()
        assert samples, family.name
        for sample in samples:
            assert set(sample.labels) == {*family.label_names, *extra}, family.name


def test_the_router_serves_its_declared_families() -> None:
    metrics = RouterMetrics("kvpush")
    metrics.binding("early", "new_tokens")
    metrics.decode_choice("affinity")
    metrics.request_started()
    metrics.observe_ttft("chat", 0.01)
    metrics.observe_prefill(0.02, "ok")
    metrics.observe_handover(0.001)
    metrics.rejected("chat", "400", "bad_request")
    metrics.request_finished("chat", "200", 0.1)
    metrics.failed("unreachable")
    metrics.retried()
    metrics.health_transition("decode0", "decode", False)
    metrics.kv_event("decode0", "stored")
    metrics.first_token("prefill")
    events = ConnectorEvents()
    events.totals = {("decode0", "decode", "fallback"): 1.0}
    metrics.register(events)
    served(metrics.render(), names.ROUTER_FAMILIES)


def test_the_connector_serves_its_declared_families_after_vllms_labels() -> None:
    registry = CollectorRegistry()
    types: dict[type, Any] = {
        cls: functools.partial(cls, registry=registry)
        for cls in (Counter, Gauge, Histogram)
    }
    prom = KvPushPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        types,
        list(names.VLLM_LABELS),
        {0: ["tiny", "0"]},
    )
    data = StatsData(
        events={"fallback": 1},
        phases={Phase("push"): [0.01]},
        peer_handovers={"decode0": [0.01]},
        write_bytes=[4096],
        write_descs=[2],
        bytes_in_flight={"decode0": 0},
        quarantined_blocks={"prefill0": 0},
    )
    prom.observe(KvPushStats.of(data).to_dict())
    served(generate_latest(registry).decode(), names.CONNECTOR_FAMILIES)
