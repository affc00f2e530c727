"""Connector metrics: the phase clock times each phase inside one tracer,
stats carry counts and phases from a step to vLLM's API server, and the
``vllm:kvpush_*`` families show them (private registry, vLLM's labels)."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kvpush.connector.connector import KvPushConnector
from kvpush.connector.counters import Counters
from kvpush.connector.phases import MATCHED, PhaseClock, PhaseObservations
from kvpush.connector.stats import (
    KvPushPromMetrics,
    KvPushStats,
    StatsData,
    merge,
    take_stats,
)
from kvpush.connector.trace import Tracer
from kvpush.telemetry import names
from tests.fakes.metrics import metric

MIB = 2**20
VLLM_CONFIG = SimpleNamespace(kv_transfer_config=None)  # all the base class reads


def prefill_marks(clock: PhaseClock, tid: str = "t1", t0: float = 100.0) -> None:
    """A prefill whose registration came 50 ms before its KV was ready."""
    clock.mark(tid, "reg_received", t0, {})
    clock.mark(tid, "kv_ready", t0 + 0.050, {"peer": "decode0"})
    clock.mark(tid, "write_posted", t0 + 0.052,
               {"num_bytes": 3 * MIB, "num_descs": 24, "num_blocks": 3})  # fmt: skip
    clock.mark(tid, "write_done", t0 + 0.060, {})


# -- the phase clock -------------------------------------------------------------


def test_a_prefill_transfer_gives_each_of_its_phases_once() -> None:
    clock = PhaseClock()
    prefill_marks(clock)
    out = clock.take(now=100.1)
    assert {p: [round(v, 6) for v in vs] for p, vs in out.phases.items()} == {
        "registration": [0.05], "write_setup": [0.002], "transfer": [0.008],
        "push": [0.01],
    }  # fmt: skip
    assert out.peer_handovers == {"decode0": [pytest.approx(0.01)]}
    assert (out.write_bytes, out.write_descs) == ([3 * MIB], [24])
    assert out.bytes_in_flight == {"decode0": 0}  # went up, then back down
    assert clock.num_transfers == 0  # over: nothing kept
    assert clock.take(now=100.2).is_empty


def test_kv_before_registration_waits_from_the_kv() -> None:
    clock = PhaseClock()
    clock.mark("t1", "kv_ready", 10.0, {})
    clock.mark("t1", "reg_received", 10.3, {})
    assert clock.take(now=11.0).phases == {"registration": [pytest.approx(0.3)]}


def test_a_late_registration_is_not_the_pairs_transfer_time() -> None:
    """Bound late, decode registers after prefill's KV is ready (the router
    chose it only then): the pair's figure, which the router weighs as that
    pair's transfer cost, runs from the match to the WRITE done, not from
    the KV (the push phase still does)."""
    clock = PhaseClock()
    clock.mark("t1", "kv_ready", 10.0, {"peer": "decode1"})
    clock.mark("t1", "reg_received", 10.2, {})  # the late flow's wait
    clock.mark("t1", "write_posted", 10.201, {"num_bytes": 64})
    clock.mark("t1", "write_done", 10.204, {})
    out = clock.take(now=11.0)
    assert out.phases["push"] == [pytest.approx(0.204)]
    assert out.peer_handovers == {"decode1": [pytest.approx(0.004)]}


def test_bytes_stay_in_flight_until_the_write_is_done() -> None:
    clock = PhaseClock()
    clock.mark("t1", "kv_ready", 1.0, {"peer": "decode0"})
    clock.mark("t1", "reg_received", 1.0, {})
    clock.mark("t1", "write_posted", 1.1, {"num_bytes": 100, "num_descs": 2})
    clock.mark("t2", "kv_ready", 1.0, {"peer": "decode0"})
    clock.mark("t2", "write_posted", 1.2, {"num_bytes": 50})
    assert clock.take(now=1.3).bytes_in_flight == {"decode0": 150}
    clock.mark("t1", "write_done", 1.4, {})
    assert clock.take(now=1.5).bytes_in_flight == {"decode0": 50}


def test_a_write_that_ended_without_landing_leaves_the_gauge() -> None:
    clock = PhaseClock()
    clock.mark("t1", "kv_ready", 1.0, {"peer": "decode0"})
    clock.mark("t1", "reg_received", 1.0, {})
    clock.mark("t1", "write_posted", 1.1, {"num_bytes": 100})
    clock.mark("t1", "write_ended", 1.2, {})  # NIXL error, or cancelled
    assert clock.take(now=1.3).bytes_in_flight == {"decode0": 0}
    assert clock.num_transfers == 0


def test_an_unfinished_transfer_is_forgotten_after_the_maximum_age() -> None:
    clock = PhaseClock(max_age_s=10.0)
    clock.mark("t1", "kv_ready", 0.0, {"peer": "decode0"})
    clock.mark("t1", "reg_received", 0.0, {})
    clock.mark("t1", "write_posted", 0.1, {"num_bytes": 64})  # never done
    clock.mark("t2", "reg_sent", 5.0, {})
    assert clock.take(now=9.0).bytes_in_flight == {"decode0": 64}
    assert clock.take(now=10.5).bytes_in_flight == {"decode0": 0}  # t1 forgotten
    assert clock.num_transfers == 1
    assert clock.take(now=16.0).is_empty and clock.num_transfers == 0


def test_the_cap_on_transfers_drops_the_oldest() -> None:
    clock = PhaseClock(max_transfers=2)
    for i in range(3):
        clock.mark(f"t{i}", "recv_expected", float(i), {})
    assert clock.num_transfers == 2
    clock.mark("t0", "notif_received", 5.0, {})  # t0 was dropped: no phase
    clock.mark("t2", "notif_received", 5.0, {})
    assert clock.take(now=6.0).phases == {"handover": [3.0]}


def test_decode_phases_from_the_worker_and_from_the_scheduler() -> None:
    worker, scheduler = PhaseClock(), PhaseClock()
    worker.mark("t1", "recv_expected", 1.0, {"peer": "prefill0"})
    worker.mark("t1", "notif_received", 1.25, {})
    scheduler.mark("t1", "reg_sent", 0.99, {"num_blocks": 4})
    scheduler.mark("t1", "first_decode_step", 1.3, {})
    w, s = worker.take(now=2.0), scheduler.take(now=2.0)
    assert w.phases == {"handover": [0.25]}
    assert w.peer_handovers == {"prefill0": [0.25]}
    assert s.phases == {"decode_wait": [pytest.approx(0.31)]}
    assert worker.num_transfers == scheduler.num_transfers == 0


def test_a_repeated_mark_counts_once_and_a_match_is_derived_once() -> None:
    clock = PhaseClock()
    clock.mark("t1", "reg_received", 1.0, {})
    clock.mark("t1", "reg_received", 2.0, {})
    clock.mark("t1", "kv_ready", 3.0, {})
    assert clock.take(now=4.0).phases == {"registration": [2.0]}
    assert MATCHED == "matched"


def test_the_tracer_feeds_its_clock_without_a_trace_dir() -> None:
    tracer = Tracer("", "decode0")
    tracer.mark("t1", "recv_expected", peer="prefill0")
    tracer.mark("t1", "notif_received")
    out = tracer.take_phases()
    assert list(out.phases) == ["handover"] and list(out.peer_handovers) == ["prefill0"]
    with pytest.raises(ValueError, match="unknown timeline event"):
        tracer.mark("t1", "teleported")
    tracer.close()


# -- stats --------------------------------------------------------------------------


def some_stats(**events: int) -> KvPushStats:
    clock = PhaseClock()
    prefill_marks(clock)
    counters = Counters()
    for name, n in events.items():
        counters.add(name.replace("__", "."), n)
    tracer = Tracer("", "prefill0", clock)
    stats = take_stats(counters, tracer)
    assert stats is not None
    return stats


def test_a_side_with_nothing_new_gives_no_stats() -> None:
    assert take_stats(Counters(), Tracer("", "d0")) is None


def test_stats_aggregate_counts_and_observations_and_keep_the_latest_gauge() -> None:
    a = some_stats(expired__ready=1, fallback=2)
    b = KvPushStats.of(
        StatsData(events={"fallback": 1}, bytes_in_flight={"decode0": 9})
    )
    both = a.aggregate(b)
    assert both.payload.events == {"expired.ready": 1, "fallback": 3}
    assert both.payload.bytes_in_flight == {"decode0": 9}
    assert both.payload.phases == a.payload.phases
    twice = both.aggregate(a)
    assert len(twice.payload.phases["transfer"]) == 2
    assert twice.payload.write_bytes == [3 * MIB, 3 * MIB]
    assert twice.payload.bytes_in_flight == {"decode0": 0}
    assert not a.is_empty() and KvPushStats().is_empty()
    with pytest.raises(TypeError):
        a.aggregate(object())  # type: ignore[arg-type]


def test_stats_survive_the_trip_to_the_api_server() -> None:
    """to_dict() is plain data (vLLM sends it with msgpack); vLLM's rebuild
    through the connector class gives the same stats."""
    stats = some_stats(rejected__malformed=3)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(stats.to_dict()))
    rebuilt = KvPushConnector.build_kv_connector_stats(wire)
    assert isinstance(rebuilt, KvPushStats)
    assert rebuilt.payload == stats.payload
    assert KvPushConnector.build_kv_connector_stats(None).is_empty()
    assert KvPushStats.from_payload({"events": {"x": "many"}}).is_empty()


def test_reduce_summarises_for_vllms_log_line() -> None:
    stats = some_stats(fallback=1).aggregate(some_stats())
    summary = stats.reduce()
    assert summary["fallback"] == 1
    assert summary["transfer_n"] == 2 and summary["transfer_p50_ms"] == 8.0
    assert summary["num_writes"] == 2 and summary["written_mib"] == 6.0


def test_clone_and_reset_hands_over_and_empties() -> None:
    stats = some_stats(fallback=1)
    old = stats.clone_and_reset()
    assert old.payload.events == {"fallback": 1} and stats.is_empty()
    assert stats.to_dict() == {}


def test_merge_is_a_pure_function() -> None:
    a = StatsData(events={"x": 1}, phases={"push": [1.0]})  # type: ignore[dict-item]
    b = StatsData(events={"x": 2}, phases={"push": [2.0]})  # type: ignore[dict-item]
    assert merge(a, b).phases == {"push": [1.0, 2.0]} and a.phases == {"push": [1.0]}


# -- vllm:kvpush_* ----------------------------------------------------------------


def private_metric_types() -> tuple[CollectorRegistry, dict[type, Any]]:
    registry = CollectorRegistry()
    types = {
        cls: functools.partial(cls, registry=registry)
        for cls in (Counter, Gauge, Histogram)
    }
    return registry, types


def test_observe_feeds_the_vllm_kvpush_families_with_vllms_labels() -> None:
    registry, types = private_metric_types()
    prom = KvPushConnector.build_prom_metrics(
        VLLM_CONFIG,
        types,
        ["model_name", "engine"],
        {0: ["tiny", "0"], 1: ["tiny", "1"]},
    )
    assert isinstance(prom, KvPushPromMetrics)
    stats = some_stats(expired__ready=2, quarantined__blocks=5)
    prom.observe(stats.to_dict(), engine_idx=1)
    prom.observe(KvPushStats.of(StatsData(events={"expired.ready": 1})).to_dict(), 1)
    text = generate_latest(registry).decode()
    engine = {"model_name": "tiny", "engine": "1"}
    events = names.KVPUSH_EVENTS
    assert metric(text, events, **engine, event="expired.ready") == 3
    assert metric(text, events, **engine, event="quarantined.blocks") == 5
    phases = names.KVPUSH_PHASE_SECONDS.count
    for phase in ("registration", "write_setup", "transfer", "push"):
        assert metric(text, phases, **engine, phase=phase) == 1
    handover = names.KVPUSH_PEER_HANDOVER_SECONDS.count
    assert metric(text, handover, **engine, peer="decode0") == 1
    assert metric(text, names.KVPUSH_WRITE_BYTES.sum, **engine) == 3 * MIB
    assert metric(text, names.KVPUSH_WRITE_DESCRIPTORS.sum, **engine) == 24
    in_flight = names.KVPUSH_PEER_BYTES_IN_FLIGHT
    assert metric(text, in_flight, **engine, peer="decode0") == 0
    assert metric(text, events, engine="0") is None


def test_observations_reach_the_right_buckets() -> None:
    registry, types = private_metric_types()
    prom = KvPushPromMetrics(VLLM_CONFIG, types, ["engine"], {0: ["0"]})
    observed = PhaseObservations(phases={"transfer": [0.004, 0.2]})  # type: ignore[dict-item]
    data = msgspec.to_builtins(StatsData(phases=observed.phases))
    prom.observe(data)
    text = generate_latest(registry).decode()
    bucket = names.KVPUSH_PHASE_SECONDS.bucket
    assert metric(text, bucket, phase="transfer", le="0.005") == 1
    assert metric(text, bucket, phase="transfer", le="0.25") == 2


def test_decodes_quarantined_blocks_reach_their_gauge_by_prefill() -> None:
    registry, types = private_metric_types()
    prom = KvPushConnector.build_prom_metrics(
        VLLM_CONFIG, types, ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    held = take_stats(Counters(), Tracer("", "d0"), {"prefill0": 3})
    assert held is not None and held.payload.quarantined_blocks == {"prefill0": 3}
    prom.observe(held.to_dict())
    gauge = names.KVPUSH_QUARANTINED_BLOCKS
    text = generate_latest(registry).decode()
    assert metric(text, gauge, model_name="tiny", engine="0", peer="prefill0") == 3
    released = KvPushStats.of(StatsData(quarantined_blocks={"prefill0": 0}))
    prom.observe(held.aggregate(released).to_dict())
    text = generate_latest(registry).decode()
    assert metric(text, gauge, model_name="tiny", engine="0", peer="prefill0") == 0
