"""kvpush's connector stats, and their families on vLLM's own ``/metrics``.

The path, all of it vLLM's connector contract:

1. After every engine step vLLM calls ``get_kv_connector_stats()`` on both
   sides of the connector: the Worker's model runner (worker side), and the
   scheduler's ``update_from_output`` (scheduler side), which aggregates the
   two into one :class:`KvPushStats`. Each side hands over what it counted
   and timed since its last call (:func:`take_stats`): the deltas of its
   :class:`~kvpush.connector.counters.Counters` and the phases of its
   :class:`~kvpush.connector.trace.Tracer`.
2. The scheduler sends ``to_dict()`` of that (plain lists and dicts) to the
   API server with its other stats.
3. There vLLM rebuilds it (``build_kv_connector_stats``, which calls
   :meth:`KvPushStats.from_payload`), aggregates it for its periodic log
   line (:meth:`KvPushStats.reduce`) and calls
   :meth:`KvPushPromMetrics.observe`, which feeds the families below. They
   are made through vLLM's ``metric_types`` (vLLM's registry, its
   ``model_name`` and ``engine`` labels, its multiprocess handling), named
   in :mod:`kvpush.telemetry.names` (``KVPUSH_*``):

=====================================  =========  ===============================
family                                 type       labels besides vLLM's
=====================================  =========  ===============================
``vllm:kvpush_events_total``           counter    ``event`` (architecture.md)
``vllm:kvpush_phase_seconds``          histogram  ``phase`` (``phases.Phase``)
``vllm:kvpush_write_bytes``            histogram  (one WRITE's bytes)
``vllm:kvpush_write_descriptors``      histogram  (one WRITE's descriptors)
``vllm:kvpush_peer_handover_seconds``  histogram  ``peer``: push / handover
``vllm:kvpush_peer_bytes_in_flight``   gauge      ``peer``: WRITE bytes not done
``vllm:kvpush_quarantined_blocks``     gauge      ``peer``: decode blocks held
                                                  past their deadline, by the
                                                  prefill they wait on
=====================================  =========  ===============================

Counts reach ``/metrics`` with the next engine step after them: an event on a
thread of an idle engine (say a rejected message) waits for the next request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import msgspec
import numpy as np
from prometheus_client import Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvpush.connector.counters import Counters
from kvpush.connector.phases import Phase, PhaseObservations
from kvpush.connector.trace import Tracer
from kvpush.telemetry import names

logger = logging.getLogger(__name__)

PHASE_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
BYTES_BUCKETS: tuple[float, ...] = tuple(float(4**k) for k in range(6, 17))  # to 4 GiB
DESCRIPTOR_BUCKETS: tuple[float, ...] = tuple(float(2**k) for k in range(17))

K = TypeVar("K", str, Phase)


class StatsData(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The payload of :class:`KvPushStats` (``data``), typed."""

    events: dict[str, int] = msgspec.field(default_factory=dict)
    phases: dict[Phase, list[float]] = msgspec.field(default_factory=dict)
    peer_handovers: dict[str, list[float]] = msgspec.field(default_factory=dict)
    write_bytes: list[int] = msgspec.field(default_factory=list)
    write_descs: list[int] = msgspec.field(default_factory=list)
    bytes_in_flight: dict[str, int] = msgspec.field(default_factory=dict)
    quarantined_blocks: dict[str, int] = msgspec.field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (
            self.events
            or self.phases
            or self.peer_handovers
            or self.write_bytes
            or self.write_descs
            or self.bytes_in_flight
            or self.quarantined_blocks
        )


def merge(a: StatsData, b: StatsData) -> StatsData:
    """``a`` then ``b``: counts summed, observations joined, gauges from
    ``b`` where it has them (it is the later one)."""
    events = dict(a.events)
    for name, n in b.events.items():
        events[name] = events.get(name, 0) + n
    return StatsData(
        events=events,
        phases=_join(a.phases, b.phases),
        peer_handovers=_join(a.peer_handovers, b.peer_handovers),
        write_bytes=a.write_bytes + b.write_bytes,
        write_descs=a.write_descs + b.write_descs,
        bytes_in_flight={**a.bytes_in_flight, **b.bytes_in_flight},
        quarantined_blocks={**a.quarantined_blocks, **b.quarantined_blocks},
    )


def _join(a: dict[K, list[float]], b: dict[K, list[float]]) -> dict[K, list[float]]:
    out = {k: list(v) for k, v in a.items()}
    for k, values in b.items():
        out.setdefault(k, []).extend(values)
    return out


def from_parts(
    events: dict[str, int],
    phases: PhaseObservations,
    quarantined: dict[str, int] | None = None,
) -> StatsData:
    return StatsData(
        events=events,
        phases=phases.phases,
        peer_handovers=phases.peer_handovers,
        write_bytes=phases.write_bytes,
        write_descs=phases.write_descs,
        bytes_in_flight=phases.bytes_in_flight,
        quarantined_blocks=dict(quarantined or {}),
    )


def summary(data: StatsData) -> dict[str, int | float]:
    """A few numbers for vLLM's periodic log line: every count, each
    phase's count and p50/p90 (ms), WRITEs and MiB written."""
    out: dict[str, int | float] = dict(sorted(data.events.items()))
    for phase, values in sorted(data.phases.items()):
        p50, p90 = np.percentile(np.asarray(values), [50, 90]) * 1000
        out[f"{phase}_n"] = len(values)
        out[f"{phase}_p50_ms"] = round(float(p50), 3)
        out[f"{phase}_p90_ms"] = round(float(p90), 3)
    if data.write_bytes:
        out["num_writes"] = len(data.write_bytes)
        out["written_mib"] = round(sum(data.write_bytes) / 2**20, 3)
    return out


@dataclass
class KvPushStats(KVConnectorStats):
    """What one or more connector sides counted and timed over an interval;
    ``data`` is a :class:`StatsData` as plain dicts and lists."""

    def __post_init__(self) -> None:
        self.payload = msgspec.convert(self.data or {}, StatsData)
        self.data = msgspec.to_builtins(self.payload)

    @classmethod
    def of(cls, payload: StatsData) -> KvPushStats:
        return cls(data=msgspec.to_builtins(payload))

    @classmethod
    def from_payload(cls, data: dict[str, Any] | None) -> KvPushStats:
        """vLLM's rebuild from ``to_dict()``; a payload that does not parse
        (a bug) is logged and read as empty, never raised into vLLM."""
        try:
            return cls(data=dict(data or {}))
        except (msgspec.ValidationError, TypeError) as e:
            logger.warning("kvpush: dropping connector stats that do not parse: %s", e)
            return cls()

    def reset(self) -> None:
        self.payload = StatsData()
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvPushStats:
        if not isinstance(other, KvPushStats):
            raise TypeError(f"cannot aggregate KvPushStats with {type(other).__name__}")
        return KvPushStats.of(merge(self.payload, other.payload))

    def reduce(self) -> dict[str, int | float]:
        return summary(self.payload)

    def is_empty(self) -> bool:
        return self.payload.is_empty

    def clone_and_reset(self) -> KvPushStats:
        """A copy of these stats; these are empty afterwards."""
        old = KvPushStats.of(self.payload)
        self.reset()
        return old


def take_stats(
    counters: Counters, tracer: Tracer, quarantined: dict[str, int] | None = None
) -> KvPushStats | None:
    """What one connector side counted and timed since its last take (None:
    nothing, so vLLM's output of this step stays empty); ``quarantined``:
    decode's quarantined blocks by prefill engine, those that changed."""
    payload = from_parts(counters.take_deltas(), tracer.take_phases(), quarantined)
    return None if payload.is_empty else KvPushStats.of(payload)


class KvPushPromMetrics(KVConnectorPromMetrics):
    """The ``vllm:kvpush_*`` families, in the API server process."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = cast(type[Counter], metric_types[Counter])
        histogram = cast(type[Histogram], metric_types[Histogram])
        gauge = cast(type[Gauge], metric_types[Gauge])
        self._events = counter(
            name=names.KVPUSH_EVENTS.name,
            documentation="kvpush connector events by name: expiries, aborts, "
            "failures by cause, fallbacks, rejected messages, lost peers, "
            "quarantined blocks (docs/architecture.md lists them).",
            labelnames=[*labelnames, *names.KVPUSH_EVENTS.labels],
        )
        self._phases = histogram(
            name=names.KVPUSH_PHASE_SECONDS.name,
            documentation="kvpush handover phases, each timed inside one "
            "process: prefill registration, write_setup, transfer, push; "
            "decode handover, decode_wait.",
            labelnames=[*labelnames, *names.KVPUSH_PHASE_SECONDS.labels],
            buckets=PHASE_BUCKETS_S,
        )
        self._write_bytes = histogram(
            name=names.KVPUSH_WRITE_BYTES.name,
            documentation="Bytes of one kvpush WRITE (prefill).",
            labelnames=labelnames,
            buckets=BYTES_BUCKETS,
        )
        self._write_descs = histogram(
            name=names.KVPUSH_WRITE_DESCRIPTORS.name,
            documentation="NIXL descriptors of one kvpush WRITE (prefill).",
            labelnames=labelnames,
            buckets=DESCRIPTOR_BUCKETS,
        )
        self._peer_handover = histogram(
            name=names.KVPUSH_PEER_HANDOVER_SECONDS.name,
            documentation="kvpush handover per peer engine: on prefill from its "
            "KV and decode's registration both there to the WRITE done, on "
            "decode the receive expected to the KV's arrival (handover).",
            labelnames=[*labelnames, *names.KVPUSH_PEER_HANDOVER_SECONDS.labels],
            buckets=PHASE_BUCKETS_S,
        )
        self._bytes_in_flight = gauge(
            name=names.KVPUSH_PEER_BYTES_IN_FLIGHT.name,
            documentation="Bytes of kvpush WRITEs posted to a peer engine and "
            "not done yet (prefill).",
            labelnames=[*labelnames, *names.KVPUSH_PEER_BYTES_IN_FLIGHT.labels],
            multiprocess_mode="mostrecent",
        )
        self._quarantined = gauge(
            name=names.KVPUSH_QUARANTINED_BLOCKS.name,
            documentation="Decode KV blocks held past their deadline, waiting "
            "for the final word of (or a proof against) the prefill engine "
            "`peer`; above 0 for minutes means that prefill is unreachable "
            "(docs/operations.md: What to alert on).",
            labelnames=[*labelnames, *names.KVPUSH_QUARANTINED_BLOCKS.labels],
            multiprocess_mode="mostrecent",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = KvPushStats.from_payload(transfer_stats_data).payload
        base = self.per_engine_labelvalues[engine_idx]
        for event, n in data.events.items():
            self._events.labels(*base, event).inc(n)
        for phase, values in data.phases.items():
            _observe(self._phases.labels(*base, phase.value), values)
        _observe(self._write_bytes.labels(*base), data.write_bytes)
        _observe(self._write_descs.labels(*base), data.write_descs)
        for peer, values in data.peer_handovers.items():
            _observe(self._peer_handover.labels(*base, peer), values)
        for peer, num_bytes in data.bytes_in_flight.items():
            self._bytes_in_flight.labels(*base, peer).set(num_bytes)
        for peer, num_blocks in data.quarantined_blocks.items():
            self._quarantined.labels(*base, peer).set(num_blocks)


def _observe(histogram: Histogram, values: list[float] | list[int]) -> None:
    for value in values:
        histogram.observe(value)
