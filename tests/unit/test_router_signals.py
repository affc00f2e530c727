"""The signal board: what an instance's /metrics says, and when that stops
counting (a stale read is unknown, never idle)."""

from __future__ import annotations

import prometheus_client
import pytest

from kvpush.router.signals import Scrape, SignalBoard, parse_scrape
from kvpush.telemetry import names


def _vllm_text() -> str:
    """A vLLM /metrics as vLLM writes it (prometheus_client, per-engine labels)."""
    reg = prometheus_client.CollectorRegistry()
    for family, value in (
        (names.NUM_REQUESTS_WAITING, 3),
        (names.NUM_REQUESTS_RUNNING, 5),
        (names.KV_CACHE_USAGE, 0.25),
    ):
        gauge = prometheus_client.Gauge(
            family.name, family.name, family.label_names, registry=reg
        )
        gauge.labels("m", "0").set(value)
    family = names.KVPUSH_PEER_HANDOVER_SECONDS
    handover = prometheus_client.Histogram(
        family.name, "h", family.label_names, registry=reg
    ).labels("m", "0", "decode0")
    for _ in range(4):
        handover.observe(0.02)
    family = names.KVPUSH_PEER_BYTES_IN_FLIGHT
    prometheus_client.Gauge(family.name, "b", family.label_names, registry=reg).labels(
        "m", "0", "decode0"
    ).set(2048)
    return prometheus_client.generate_latest(reg).decode()


VLLM_TEXT = _vllm_text()


def test_a_vllm_metrics_text_gives_queue_usage_and_pair_figures() -> None:
    scrape = parse_scrape(VLLM_TEXT)
    assert (scrape.num_waiting, scrape.num_running, scrape.kv_usage) == (3, 5, 0.25)
    assert scrape.handover_count == {"decode0": 4.0}
    assert scrape.handover_sum_s == {"decode0": pytest.approx(0.08)}
    assert scrape.bytes_in_flight == {"decode0": 2048.0}


def test_one_dp_rank_reads_its_own_engines_samples() -> None:
    """An instance with two DP engines serves one sample per engine; the
    router's endpoint for DP rank 1 reads engine 1's alone."""
    reg = prometheus_client.CollectorRegistry()
    for family, values in (
        (names.NUM_REQUESTS_WAITING, (3, 7)),
        (names.KV_CACHE_USAGE, (0.25, 0.5)),
    ):
        gauge = prometheus_client.Gauge(
            family.name, family.name, family.label_names, registry=reg
        )
        for engine, value in enumerate(values):
            gauge.labels("m", str(engine)).set(value)
    text = prometheus_client.generate_latest(reg).decode()
    assert (parse_scrape(text).num_waiting, parse_scrape(text).kv_usage) == (10, 0.5)
    rank1 = parse_scrape(text, engine=1)
    assert (rank1.num_waiting, rank1.kv_usage) == (7, 0.5)
    rank0 = parse_scrape(text, engine=0)
    assert (rank0.num_waiting, rank0.kv_usage) == (3, 0.25)


def test_text_without_the_families_gives_no_queue() -> None:
    assert parse_scrape("# nothing here\n") == Scrape()


def test_text_that_is_not_prometheus_raises_value_error() -> None:
    with pytest.raises(ValueError):
        parse_scrape('vllm:num_requests_waiting{engine="0" 3\n')


def test_a_fresh_read_is_known_and_a_stale_one_is_unknown() -> None:
    board = SignalBoard(max_age_s=3.0)
    assert board.signals("d0", now=0.0) is None  # never read: unknown
    board.record("d0", parse_scrape(VLLM_TEXT), now=10.0)
    known = board.signals("d0", now=12.9)
    assert known is not None and (known.num_waiting, known.num_running) == (3, 5)
    assert board.signals("d0", now=13.1) is None  # stale: unknown, not idle


def test_an_instance_without_queue_gauges_is_unknown() -> None:
    board = SignalBoard(max_age_s=3.0)
    board.record("d0", Scrape(kv_usage=0.0), now=0.0)
    assert board.signals("d0", now=0.0) is None


def test_pair_handover_is_a_moving_mean_of_the_windows_between_reads() -> None:
    board = SignalBoard(max_age_s=3.0)
    board.record("p0", _handovers(total=0.08, count=4), now=0.0)  # 20 ms each
    assert _handover(board, now=0.0) == pytest.approx(0.02)
    board.record("p0", _handovers(total=0.48, count=8), now=1.0)  # 4 of 100 ms
    assert _handover(board, now=1.0) == pytest.approx(0.5 * 0.1 + 0.5 * 0.02)
    board.record("p0", _handovers(total=0.48, count=8), now=2.0)  # none new
    assert _handover(board, now=2.0) == pytest.approx(0.06)
    board.record("p0", _handovers(total=0.01, count=1), now=3.0)  # a restart
    assert _handover(board, now=3.0) == pytest.approx(0.01)
    assert board.pair("p0", "decode0", now=10.0) is None  # stale prefill read


def test_a_prefills_typical_handover_is_the_mean_of_its_measured_pairs() -> None:
    board = SignalBoard(max_age_s=3.0)
    assert board.typical_handover("p0", now=0.0) is None  # never read
    read = Scrape(
        num_waiting=0, num_running=0,
        handover_sum_s={"d0": 0.02, "d1": 0.12}, handover_count={"d0": 2, "d1": 3},
    )  # fmt: skip
    board.record("p0", read, now=1.0)
    assert board.typical_handover("p0", now=1.0) == pytest.approx((0.01 + 0.04) / 2)
    assert board.typical_handover("p1", now=1.0) is None  # measured nothing
    assert board.typical_handover("p0", now=5.0) is None  # stale
    board.forget("d1")  # went down: its pair no longer counts
    assert board.typical_handover("p0", now=1.0) == pytest.approx(0.01)
    board.forget("d0")
    assert board.typical_handover("p0", now=1.0) is None


def test_forget_drops_reads_and_pairs() -> None:
    board = SignalBoard(max_age_s=3.0)
    board.record("p0", parse_scrape(VLLM_TEXT), now=0.0)
    board.forget("decode0")
    pair = board.pair("p0", "decode0", now=0.0)
    assert pair is not None and pair.handover_s is None  # only in-flight left
    board.forget("p0")
    assert board.signals("p0", now=0.0) is None


def test_max_age_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_age_s"):
        SignalBoard(max_age_s=0)


def _handovers(total: float, count: float) -> Scrape:
    return Scrape(
        num_waiting=0,
        num_running=0,
        handover_sum_s={"decode0": total},
        handover_count={"decode0": count},
    )


def _handover(board: SignalBoard, now: float) -> float | None:
    pair = board.pair("p0", "decode0", now)
    assert pair is not None
    return pair.handover_s
