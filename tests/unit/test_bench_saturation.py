"""The saturation workload: its settings, the arrival schedule, goodput at
an SLO, the report's load table (no targets), the goodput plot, a run on
fake clusters."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import msgspec
import pytest

from kvpush.cli import main
from kvpush_lab.bench.config import make_config
from kvpush_lab.bench.goodput import Goodput, Slo, goodput
from kvpush_lab.bench.outputs import write_outputs
from kvpush_lab.bench.records import RequestRecord
from kvpush_lab.bench.report import render_report
from kvpush_lab.bench.router_legs import RouterLegs
from kvpush_lab.bench.summary import (
    BenchSummary,
    ConfigResult,
    PointResult,
    load_summary,
)
from kvpush_lab.bench.workload import Traces, build_point, sweep_points
from tests.unit.test_bench_report import stats
from tests.unit.test_bench_report import summary as sweep_summary
from tests.unit.test_bench_runner import FakeLauncher, launcher

__all__ = ["launcher"]  # the fixture, used by name
VOCAB = list(range(3, 4096))


# -- settings and arrivals -------------------------------------------------------


def test_the_saturation_workload_is_long_outputs_at_rising_poisson_rates() -> None:
    config = make_config({"workload": "saturation"})
    assert (config.prompt_len, config.output_len) == ("1000", "256")
    assert config.arrival == "poisson" and config.qps == (2.0, 4.0, 8.0, 12.0, 16.0)
    assert (config.slo_ttft_ms, config.slo_tpot_ms) == (250.0, 20.0)
    given = make_config({"workload": "saturation", "qps": [1, 3], "slo_tpot_ms": 9})
    assert given.qps == (1.0, 3.0) and given.slo_tpot_ms == 9.0
    concurrency = make_config(
        {"workload": "saturation", "arrival": "concurrency", "concurrency": [4, 16]}
    )
    assert concurrency.loads == (4.0, 16.0)  # a concurrency sweep instead
    with pytest.raises(ValueError, match="slo_ttft_ms must be positive"):
        make_config({"workload": "saturation", "slo_ttft_ms": 0})


def test_each_rate_is_a_seeded_poisson_schedule_at_that_rate() -> None:
    config = make_config(
        {"workload": "saturation", "qps": [4, 16], "num_requests": 2000,
         "prompt_len": "8", "output_len": "2"}
    )  # fmt: skip
    points = [build_point(config, p, VOCAB, Traces()) for p in sweep_points(config)]
    for workload, qps in zip(points, (4.0, 16.0), strict=True):
        arrivals = [r.arrival_s for r in workload.requests]
        assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        assert statistics.mean(gaps) == pytest.approx(1 / qps, rel=0.1)
        assert statistics.stdev(gaps) == pytest.approx(1 / qps, rel=0.15)  # exp.
    again = build_point(config, sweep_points(config)[0], VOCAB, Traces())
    assert again == points[0]  # every configuration gets the same schedule
    salted = build_point(config, sweep_points(config)[0], VOCAB, Traces(), "x")
    assert [r.arrival_s for r in salted.requests] == [
        r.arrival_s for r in points[0].requests
    ]


# -- goodput -----------------------------------------------------------------------


def timed(
    ttft_s: float, gap_s: float, num_tokens: int, error: str | None = None
) -> RequestRecord:
    times = [ttft_s + i * gap_s for i in range(num_tokens)]
    return RequestRecord(
        config="x", point=0, index=0, bench_id="kvb-0-0", prompt_len=8,
        output_len=num_tokens, scheduled_s=0.0, token_times_s=times,
        end_s=times[-1] if times else 0.0, error=error,
    )  # fmt: skip


def test_a_request_meets_the_slo_on_both_ttft_and_tpot() -> None:
    slo = Slo(ttft_ms=100, tpot_ms=10)
    assert slo.is_met(timed(0.099, 0.0099, 5))  # just inside both bounds
    assert not slo.is_met(timed(0.101, 0.005, 5))  # TTFT over
    assert not slo.is_met(timed(0.05, 0.011, 5))  # TPOT over
    assert slo.is_met(timed(0.05, 0.0, 1))  # one token: no TPOT to miss
    assert not slo.is_met(timed(0.05, 0.001, 5, error="timeout"))
    assert slo.describe() == "TTFT ≤ 100 ms and TPOT ≤ 10 ms"
    with pytest.raises(ValueError, match="positive"):
        Slo(ttft_ms=0, tpot_ms=1)


def test_goodput_is_the_requests_that_met_it_per_second_of_the_point() -> None:
    records = [timed(0.05, 0.005, 4), timed(0.5, 0.005, 4), timed(0.05, 0.005, 4)]
    g = goodput(records, Slo(100, 10), duration_s=2.0)
    assert g == Goodput(
        slo_ttft_ms=100, slo_tpot_ms=10, num_met=2, num_requests=3,
        share=pytest.approx(2 / 3), per_s=1.0,
    )  # fmt: skip
    empty = goodput([], Slo(100, 10), 0.0)
    assert (empty.num_met, empty.share, empty.per_s) == (0, 0.0, 0.0)


# -- the report ----------------------------------------------------------------------


def saturation_summary(kvpush_handover: float = 10.0) -> BenchSummary:
    base = sweep_summary()

    def result(point: int, ttft: float, handover: float | None) -> PointResult:
        legs = None if handover is None else RouterLegs(
            num_handovers=4, handover_mean_ms=handover, num_prefills=4,
            prefill_mean_ms=50.0,
        )  # fmt: skip
        gp = Goodput(slo_ttft_ms=250, slo_tpot_ms=20, num_met=3, num_requests=4,
                     share=0.75, per_s=1.5)  # fmt: skip
        return PointResult(point=point, stats=stats(ttft, 5.0), router=legs, goodput=gp)

    def config(name: str, ttft: float, handover: float | None) -> ConfigResult:
        points = [result(p, ttft * (p + 1), handover) for p in (0, 1)]
        return ConfigResult(name=name, status="ok", points=points)

    settings = {
        **base.settings, "workload": "saturation", "qps": [1.0, 2.0],
        "slo_ttft_ms": 250.0, "slo_tpot_ms": 20.0, "output_len": "256",
    }  # fmt: skip
    return msgspec.structs.replace(
        base,
        settings=settings,
        configs=[
            config("colocated", 50.0, None),
            config("vllm-pull", 100.0, 60.0),
            config("vllm-push", 90.0, 40.0),
            config("kvpush", 70.0, kvpush_handover),
        ],
    )


def test_the_report_states_the_slo_and_gives_goodput_per_load() -> None:
    report = render_report(saturation_summary())
    assert "saturation (decode-bound)" in report
    assert "TTFT ≤ 250 ms and TPOT ≤ 20 ms" in report
    assert "## Decode-bound load: throughput, goodput and handover" in report
    row = (
        "| 1 | kvpush | 2.00 | 64 | 70.0 | 140 | 5.0 | 5.0 | 1.50 | 3 / 4 | "
        "10.0 | 50.0 |"
    )
    assert row in report
    assert "target" not in report.lower()  # targets live in the docs


def test_the_saturation_run_plots_goodput_against_load(tmp_path: Path) -> None:
    summary = saturation_summary()
    files = write_outputs(tmp_path, summary)
    assert tmp_path / "goodput_vs_qps.png" in files
    assert (tmp_path / "goodput_vs_qps.png").stat().st_size > 0
    assert "goodput_vs_qps.png" in (tmp_path / "report.md").read_text()
    assert "Decode-bound" not in render_report(sweep_summary())


# -- a run on fake clusters ----------------------------------------------------


def test_a_saturation_run_reports_goodput_at_every_rate(
    launcher: FakeLauncher, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    argv = [
        "bench", "--workload", "saturation", "--configs", "colocated,vllm-push",
        "--qps", "50,100", "--num-requests", "4", "--num-warmup", "1",
        "--prompt-len", "16", "--output-len", "4", "--slo-ttft-ms", "5000",
        "--output", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    summary = load_summary(out)
    for name in ("colocated", "vllm-push"):
        config = summary.config(name)
        assert config is not None
        for p in (0, 1):
            result = config.point(p)
            assert result is not None and result.goodput is not None
            assert result.goodput.num_requests == 4
            assert result.goodput.slo_ttft_ms == 5000.0
    push = summary.config("vllm-push")
    assert push is not None and push.points[0].router is not None
    assert (out / "goodput_vs_qps.png").exists()
    assert "TTFT ≤ 5000 ms and TPOT ≤ 20 ms" in (out / "report.md").read_text()
