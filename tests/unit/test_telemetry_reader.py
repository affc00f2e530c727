"""The one reader of a ``/metrics`` text: samples by family or name and labels,
summed over vLLM's engines; prometheus_client's parser details (a counter's
``_total`` and ``_created``, escaped label values, NaN) handled once; a text
that does not parse is a clear ValueError."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvpush.telemetry import names
from kvpush.telemetry.reader import Exposition
from tests.fakes.fake_vllm import Load, vllm_metrics_text

# Two engines of one vLLM instance, as vLLM writes them (see the file header).
VLLM_TEXT = (Path(__file__).parent.parent / "fakes" / "vllm_metrics.txt").read_text()
METRICS = Exposition.parse(VLLM_TEXT)


def test_a_gauge_is_summed_over_the_engines_or_its_highest_taken() -> None:
    assert METRICS.total(names.NUM_REQUESTS_WAITING) == 7
    assert METRICS.total(names.NUM_REQUESTS_RUNNING, engine="1") == 1
    assert METRICS.highest(names.KV_CACHE_USAGE) == 0.5
    assert METRICS.by_label(names.NUM_REQUESTS_WAITING, "engine") == {"0": 3, "1": 4}


def test_a_counter_is_read_by_its_family_name_or_its_total_sample() -> None:
    success = names.REQUEST_SUCCESS
    assert METRICS.kinds[success.name] == "counter"  # the parser drops _total
    assert METRICS.total(success) == 10  # its *_created samples are not counted
    assert METRICS.total(success.name) == 10
    assert METRICS.total(success.total, finished_reason="stop") == 8
    assert METRICS.total("vllm:request_success_created") == pytest.approx(3 * 1.7649e9)


def test_a_counter_without_total_in_the_text_still_has_its_total_sample() -> None:
    text = '# TYPE vllm:kvpush_events counter\nvllm:kvpush_events{event="x"} 3\n'
    assert Exposition.parse(text).total(names.KVPUSH_EVENTS, event="x") == 3


def test_label_values_come_unescaped() -> None:
    events = METRICS.by_label(names.KVPUSH_EVENTS, "event")
    assert events == {"fallback": 3, 'rejected."odd" \\ cause\nhere': 1}
    odd = 'rejected."odd" \\ cause\nhere'
    assert METRICS.total(names.KVPUSH_EVENTS, event=odd) == 1


def test_labels_group_and_filter_samples() -> None:
    info = METRICS.samples(names.CACHE_CONFIG_INFO, engine="1")
    assert [s.labels["num_gpu_blocks"] for s in info] == ["2048"]
    by_pair = METRICS.by_labels(names.KVPUSH_PEER_HANDOVER_SECONDS.count,
                                ("engine", "peer"))  # fmt: skip
    assert by_pair == {("0", "decode0"): 2, ("1", "decode0"): 1, ("1", "decode1"): 1}


def test_a_histogram_is_read_by_its_count_sum_and_buckets() -> None:
    handover = names.KVPUSH_PEER_HANDOVER_SECONDS
    assert METRICS.by_label(handover.count, "peer") == {"decode0": 3, "decode1": 1}
    assert METRICS.total(handover.sum, peer="decode0") == pytest.approx(0.55)
    assert METRICS.buckets(handover, peer="decode0") == {0.01: 1, math.inf: 3}
    assert METRICS.buckets(handover) == {0.01: 2, math.inf: 4}


def test_nan_samples_are_listed_but_never_summed() -> None:
    in_flight = names.KVPUSH_PEER_BYTES_IN_FLIGHT
    assert len(METRICS.samples(in_flight)) == 3
    assert METRICS.total(in_flight) == 4096
    assert METRICS.by_label(in_flight, "peer") == {"decode0": 4096}
    assert METRICS.total(in_flight, peer="decode1") is None  # only NaN: unknown
    assert METRICS.highest(in_flight, engine="0") is None


def test_what_is_missing_is_none_or_empty() -> None:
    for metrics in (METRICS, Exposition.parse(""), Exposition.parse("# HELP x y\n")):
        assert metrics.total(names.ROUTER_REQUESTS_IN_FLIGHT) is None
        assert metrics.highest(names.NIXL_XFER_TIME.count) is None
        assert metrics.by_label(names.ROUTER_BINDING, "binding") == {}
        assert metrics.samples(names.ROUTER_INSTANCE_HEALTHY) == []
        assert metrics.buckets(names.NIXL_BYTES_TRANSFERRED) == {}
    assert METRICS.total(names.NUM_REQUESTS_WAITING, engine="7") is None


def test_a_sample_without_type_lines_is_read_by_its_name() -> None:
    text = 'kvpush_router_requests_in_flight{mode="kvpush"} 3\n'
    assert Exposition.parse(text).total(names.ROUTER_REQUESTS_IN_FLIGHT) == 3.0


def test_the_fake_vllm_metrics_read_as_vllm_s() -> None:
    text = vllm_metrics_text({"fallback": 2}, Load(num_waiting=1, kv_usage=0.5))
    metrics = Exposition.parse(text)
    assert metrics.total(names.NUM_REQUESTS_WAITING) == 1
    assert metrics.total(names.NUM_REQUESTS_RUNNING) is None  # left out
    assert metrics.highest(names.KV_CACHE_USAGE) == 0.5
    assert metrics.by_label(names.KVPUSH_EVENTS, "event") == {"fallback": 2}


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ('vllm:num_requests_waiting{engine="0" 3\n', 1),
        ("# HELP a b\nnot metrics at all\n", 2),
        ('ok 1\nbad{le="1"} two\n', 2),
        ('x{a="1", ="2"} 3\n', 1),  # an IndexError inside the parser
        ("# TYPE x\n", 1),
    ],
)
def test_a_text_that_does_not_parse_is_a_value_error_naming_its_line(
    text: str, line: int
) -> None:
    with pytest.raises(
        ValueError, match=f"not a Prometheus text exposition: line {line}"
    ):
        Exposition.parse(text)


def test_a_family_lookup_checks_its_labels() -> None:
    with pytest.raises(ValueError, match="has no label evnt"):
        METRICS.total(names.KVPUSH_EVENTS, evnt="fallback")
    with pytest.raises(ValueError, match="has no label engine_id"):
        METRICS.by_label(names.KVPUSH_EVENTS, "engine_id")
    with pytest.raises(ValueError, match="is a histogram"):
        METRICS.total(names.KVPUSH_PEER_HANDOVER_SECONDS)
    with pytest.raises(ValueError, match="is a gauge, it has no _count"):
        _ = names.KV_CACHE_USAGE.count
