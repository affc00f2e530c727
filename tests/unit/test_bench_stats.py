"""The benchmark's statistics, checked against hand-made event streams."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush_lab.bench.records import RequestRecord
from kvpush_lab.bench.stats import (
    Dist,
    percentile,
    ratio,
    summarize_point,
    tpot_s,
    ttft_s,
    ttst_s,
)


def record(
    index: int = 0,
    token_times: list[float] | None = None,
    *,
    sent_s: float = 0.0,
    end_s: float | None = None,
    error: str | None = None,
    output_len: int = 4,
    output_tokens: int | None = None,
    prompt_len: int = 10,
) -> RequestRecord:
    times = token_times if token_times is not None else []
    return RequestRecord(
        config="colocated",
        point=0,
        index=index,
        bench_id=f"kvb-0-{index}",
        prompt_len=prompt_len,
        output_len=output_len,
        scheduled_s=sent_s,
        sent_s=sent_s,
        status=200 if error is None else 500,
        error=error,
        token_times_s=times,
        end_s=end_s if end_s is not None else (times[-1] if times else 0.0),
        prompt_tokens=prompt_len if error is None else None,
        output_tokens=output_tokens,
    )


# -- percentiles -------------------------------------------------------------


def test_percentile_interpolates_between_ranks() -> None:
    values = [10.0, 20.0, 30.0, 40.0]
    assert percentile(values, 0) == 10.0
    assert percentile(values, 100) == 40.0
    assert percentile(values, 50) == 25.0  # halfway between ranks 1 and 2
    assert percentile(values, 90) == pytest.approx(37.0)


@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50),
    st.floats(0, 100),
)
def test_percentile_matches_numpy(values: list[float], p: float) -> None:
    ordered = sorted(values)
    assert percentile(ordered, p) == pytest.approx(
        float(np.percentile(ordered, p)), rel=1e-9, abs=1e-6
    )


def test_percentile_refuses_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"0\.\.100"):
        percentile([1.0], 101)


def test_dist_summarises_unsorted_values() -> None:
    dist = Dist.of([3.0, 1.0, 2.0])
    assert dist == Dist(n=3, mean=2.0, p50=2.0, p90=2.8, p99=2.98, min=1.0, max=3.0)
    assert Dist.of([]) is None


# -- per-request definitions -------------------------------------------------


def test_ttft_is_first_token_and_tpot_spreads_the_rest() -> None:
    # sent at 0; tokens at 100 ms, 110, 130, 160 ms
    rec = record(token_times=[0.100, 0.110, 0.130, 0.160], output_tokens=4)
    assert ttft_s(rec) == pytest.approx(0.100)
    assert tpot_s(rec) == pytest.approx((0.160 - 0.100) / 3)


def test_ttst_is_the_second_token_or_the_first_chunk_carrying_two() -> None:
    rec = record(token_times=[0.100, 0.110, 0.130, 0.160], output_tokens=4)
    assert ttst_s(rec) == pytest.approx(0.110)
    both = record(token_times=[0.2], output_tokens=2, output_len=2)
    assert ttst_s(both) == pytest.approx(0.2)
    one = record(token_times=[0.05], output_tokens=1, output_len=1)
    assert ttst_s(one) is None
    assert ttst_s(record(token_times=[0.1, 0.2], error="timeout")) is None
    stats = summarize_point([rec, both, one])
    assert stats.ttst_ms is not None and stats.ttst_ms.n == 2


def test_tpot_uses_the_servers_token_count_over_chunks() -> None:
    # 2 chunks but the server says 5 tokens (chunks can carry several)
    rec = record(token_times=[0.1, 0.5], output_tokens=5, output_len=5)
    assert tpot_s(rec) == pytest.approx(0.4 / 4)


def test_single_token_requests_have_a_ttft_but_no_tpot() -> None:
    rec = record(token_times=[0.05], output_tokens=1, output_len=1)
    assert ttft_s(rec) == pytest.approx(0.05)
    assert tpot_s(rec) is None


def test_failed_requests_have_no_latencies() -> None:
    rec = record(token_times=[0.1, 0.2], error="timeout")
    assert ttft_s(rec) is None and tpot_s(rec) is None


# -- per point ---------------------------------------------------------------


def test_point_counts_every_request_and_errors_by_kind() -> None:
    records = [
        record(0, [0.1, 0.2, 0.3, 0.4], output_tokens=4),
        record(1, [0.2, 0.3, 0.4, 0.5], sent_s=0.5, output_tokens=4),
        record(2, sent_s=1.0, end_s=2.0, error="timeout"),
        record(3, sent_s=1.0, end_s=0.1, error="http_500"),
        record(4, [0.1, 0.2], sent_s=1.5, output_tokens=2),  # asked 4, got 2
    ]
    st_ = summarize_point(records)
    assert st_.num_requests == 5
    assert st_.num_ok == 3 and st_.num_errors == 2
    assert st_.errors == {"timeout": 1, "http_500": 1}
    assert st_.num_short_output == 1
    assert st_.duration_s == pytest.approx(3.0)  # 0 .. 1.0 + 2.0
    assert st_.request_throughput == pytest.approx(3 / 3.0)
    assert st_.output_throughput == pytest.approx((4 + 4 + 2) / 3.0)
    assert st_.total_token_throughput == pytest.approx((30 + 10) / 3.0)
    assert st_.ttft_ms is not None and st_.ttft_ms.n == 3
    assert st_.ttft_ms.p50 == pytest.approx(100.0)
    assert st_.ttft_ms.max == pytest.approx(200.0)
    assert st_.itl_ms is not None and st_.itl_ms.n == 3 + 3 + 1
    assert st_.itl_ms.mean == pytest.approx(100.0)
    assert st_.e2e_ms is not None and st_.e2e_ms.max == pytest.approx(500.0)


def test_point_of_only_failures_has_no_latencies() -> None:
    st_ = summarize_point([record(0, error="connect"), record(1, error="connect")])
    assert st_.num_ok == 0 and st_.errors == {"connect": 2}
    assert st_.ttft_ms is None and st_.tpot_ms is None
    assert st_.request_throughput == 0.0


def test_ratio_is_missing_without_a_reference() -> None:
    assert ratio(90.0, 45.0) == 2.0
    assert ratio(90.0, None) is None
    assert ratio(None, 45.0) is None
    assert ratio(90.0, 0.0) is None


def test_a_stream_flushed_at_once_is_counted_as_one_burst() -> None:
    flushed = record(0, [0.3] * 4, output_tokens=4)
    streamed = record(1, [0.1, 0.2, 0.3, 0.4], output_tokens=4)
    single = record(2, [0.1], output_tokens=1, output_len=1)
    assert tpot_s(flushed) == 0.0
    assert summarize_point([flushed, streamed, single]).num_one_burst == 1
