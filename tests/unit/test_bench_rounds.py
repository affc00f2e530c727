"""Repeated rounds (--repeat): the order, ratios per round, their spread,
the router's leg means, the report and a run on fake clusters."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from kvpush.cli import main
from kvpush_lab.bench.cli import PUBLISH_REPEAT, add_parser, config_from_args
from kvpush_lab.bench.config import BenchConfig, make_config
from kvpush_lab.bench.records import read_records
from kvpush_lab.bench.report import render_report
from kvpush_lab.bench.rounds import (
    Spread,
    describe,
    ratio_spread,
    ratios_per_round,
    round_order,
    rounds_of,
    spread,
)
from kvpush_lab.bench.router_legs import LegTotals, parse_leg_totals, router_legs
from kvpush_lab.bench.runner import plan_runs
from kvpush_lab.bench.summary import (
    BenchSummary,
    ConfigResult,
    PointResult,
    load_summary,
)
from tests.unit.test_bench_report import stats
from tests.unit.test_bench_report import summary as one_round_summary
from tests.unit.test_bench_runner import FAST, FakeLauncher, launcher

__all__ = ["launcher"]  # the fixture, used by name


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpush")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


# -- order and spread ----------------------------------------------------------


def test_rounds_repeat_every_configuration_in_the_same_order() -> None:
    assert rounds_of(1) == [None]  # not repeated: single runs keep their names
    assert round_order(["A", "B"], 1) == [(None, "A"), (None, "B")]
    assert round_order(["A", "B", "C"], 2) == [
        (1, "A"), (1, "B"), (1, "C"), (2, "A"), (2, "B"), (2, "C"),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="at least 1"):
        rounds_of(0)


def test_a_spread_is_the_median_and_range_of_the_values_there() -> None:
    assert spread([3.0, None, 1.0, 2.0, 10.0]) == Spread(
        n=4, median=2.5, min=1.0, max=10.0
    )
    assert spread([None]) is None
    below, straddling = spread([0.7, 0.9]), spread([0.8, 1.1])
    assert below is not None and below.side_of(1.0) == -1
    assert straddling is not None and straddling.side_of(1.0) == 0
    above = spread([1.2, 1.05])
    assert above is not None and above.side_of(1.0) == 1
    assert above.width == pytest.approx(0.15)


def test_ratios_are_taken_within_a_round_against_that_rounds_reference() -> None:
    mine = {1: 50.0, 2: 90.0, 3: 60.0, 4: 10.0}
    pull = {1: 100.0, 2: 100.0, 3: None, 4: 0.0}  # 3 missing, 4 zero: skipped
    assert ratios_per_round(mine, pull) == {1: 0.5, 2: 0.9}
    assert ratio_spread(mine, pull) == Spread(n=2, median=0.7, min=0.5, max=0.9)
    assert ratio_spread({1: None}, pull) is None


def test_spreads_read_as_median_and_range_bold_when_on_one_side() -> None:
    assert describe(Spread(n=3, median=0.8, min=0.7, max=0.9)) == "0.80 [0.70–0.90]"
    consistent = Spread(n=3, median=0.8, min=0.7, max=0.9)
    assert describe(consistent, mark_side=True) == "**0.80 [0.70–0.90]**"
    mixed = Spread(n=3, median=0.95, min=0.9, max=1.1)
    assert describe(mixed, mark_side=True) == "0.95 [0.90–1.10]"
    assert describe(Spread(n=1, median=0.5, min=0.5, max=0.5)) == "0.50"
    assert describe(None) == "–"


# -- settings ------------------------------------------------------------------


def test_publish_repeats_three_rounds_unless_told_otherwise(tmp_path: Path) -> None:
    assert config_from_args(parse([])).repeat == 1
    assert config_from_args(parse(["--publish"])).repeat == PUBLISH_REPEAT == 3
    assert config_from_args(parse(["--publish", "--repeat", "1"])).repeat == 1
    assert config_from_args(parse(["--repeat", "5"])).repeat == 5
    file = tmp_path / "bench.json"
    file.write_text('{"repeat": 2}')
    assert config_from_args(parse(["--publish", "--config", str(file)])).repeat == 2
    with pytest.raises(ValueError, match=r"repeat must be in 1\.\.20"):
        make_config({"repeat": 0})


def test_each_round_gets_fresh_clusters_of_its_own(tmp_path: Path) -> None:
    config = BenchConfig(configs=("colocated", "vllm-pull"), repeat=2)
    runs = plan_runs(config, tmp_path / "model", tmp_path)
    assert [(r.round, r.name) for r in runs] == [
        (1, "colocated"), (1, "vllm-pull"), (2, "colocated"), (2, "vllm-pull"),
    ]  # fmt: skip
    assert runs[2].run_dir == tmp_path / "clusters" / "round-2" / "colocated"
    single = plan_runs(BenchConfig(configs=("colocated",)), tmp_path, tmp_path)
    assert single[0].run_dir == tmp_path / "clusters" / "colocated"
    assert single[0].round is None


def test_a_shared_kvpush_cluster_is_shared_within_a_round_only(tmp_path: Path) -> None:
    config = BenchConfig(
        configs=("kvpush-early", "kvpush-late"), workload="skewed", num_decode=2,
        repeat=2,
    )  # fmt: skip
    runs = plan_runs(config, tmp_path / "model", tmp_path)
    dirs = [(r.round, r.run_dir.relative_to(tmp_path).as_posix()) for r in runs]
    assert dirs == [
        (1, "clusters/round-1/kvpush-shared"), (1, "clusters/round-1/kvpush-shared"),
        (2, "clusters/round-2/kvpush-shared"), (2, "clusters/round-2/kvpush-shared"),
    ]  # fmt: skip
    assert [r.router_port for r in runs] == [None, 28001, None, 28001]


# -- the router's legs ---------------------------------------------------------

ROUTER_METRICS = """\
# TYPE kvpush_router_handover_seconds histogram
kvpush_router_handover_seconds_bucket{mode="vllm-pull",le="+Inf"} 4.0
kvpush_router_handover_seconds_count{mode="vllm-pull"} 4.0
kvpush_router_handover_seconds_sum{mode="vllm-pull"} 0.2
# TYPE kvpush_router_prefill_leg_seconds histogram
kvpush_router_prefill_leg_seconds_bucket{mode="vllm-pull",outcome="ok",le="+Inf"} 4.0
kvpush_router_prefill_leg_seconds_count{mode="vllm-pull",outcome="ok"} 4.0
kvpush_router_prefill_leg_seconds_sum{mode="vllm-pull",outcome="ok"} 0.4
kvpush_router_prefill_leg_seconds_count{mode="vllm-pull",outcome="error"} 7.0
kvpush_router_prefill_leg_seconds_sum{mode="vllm-pull",outcome="error"} 9.0
"""


def test_the_router_legs_of_a_point_are_the_difference_of_two_readings() -> None:
    after = parse_leg_totals(ROUTER_METRICS)
    assert after == LegTotals(
        num_handovers=4, handover_s=0.2, num_prefills=4, prefill_s=0.4
    )
    before = LegTotals(num_handovers=2, handover_s=0.18, num_prefills=2, prefill_s=0.2)
    legs = router_legs(before, after)
    assert legs is not None and legs.num_handovers == 2 and legs.num_prefills == 2
    assert legs.handover_mean_ms == pytest.approx(10.0)  # (0.2 - 0.18) / 2
    assert legs.prefill_mean_ms == pytest.approx(100.0)  # errors left out
    assert router_legs(None, after) is None
    assert router_legs(LegTotals(), LegTotals()) is None  # colocated: no legs


# -- the report ----------------------------------------------------------------


def repeated_summary() -> BenchSummary:
    """Three rounds: kvpush's TTFT p50 is half of vllm-pull's, then 0.4, 0.6
    of it; its TPOT p50 straddles pull's."""
    base = one_round_summary()
    configs = []
    for r, (k_ttft, k_tpot) in enumerate(((50.0, 3.0), (40.0, 5.0), (60.0, 4.0)), 1):
        for name, ttft, tpot in (
            ("colocated", 30.0, 2.0),
            ("vllm-pull", 100.0, 4.0),
            ("kvpush", k_ttft, k_tpot),
        ):
            point = PointResult(point=0, stats=stats(ttft, tpot))
            configs.append(
                ConfigResult(name=name, status="ok", points=[point], round=r)
            )
    return msgspec.structs.replace(base, points=base.points[:1], configs=configs)


def test_the_report_gives_each_ratio_as_median_and_range_over_rounds() -> None:
    summary = repeated_summary()
    assert summary.rounds == [1, 2, 3] and summary.is_repeated
    report = render_report(summary)
    assert "## Repeated rounds" in report and "3 rounds" in report
    assert "(colocated vllm-pull kvpush)" in report  # the order of every round
    lines = report.splitlines()
    row = next(line for line in lines if line.startswith("| qps 1.0 | kvpush |"))
    cells = [c.strip() for c in row.split("|")[3:-1]]
    # TTFT p50, TTFT p99 (2x p50), TPOT p50, TPOT p99, overhead (vs colocated 30)
    half = "**0.50 [0.40–0.60]**"
    assert cells[:3] == [half, half, "1.00 [0.75–1.25]"]
    assert cells[4] == "**0.29 [0.14–0.43]**"  # 20/70, 10/70, 30/70
    for r in (1, 2, 3):
        assert f"## Round {r}" in report
    assert "### Headline" in report  # each round's own report, a level down


def test_a_single_run_has_no_rounds_section() -> None:
    report = render_report(one_round_summary())
    assert "Repeated rounds" not in report and "## Round" not in report


# -- a repeated run end to end ---------------------------------------------------


def test_a_repeated_run_interleaves_the_configurations_round_by_round(
    launcher: FakeLauncher, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    argv = [
        "bench", *FAST, "--configs", "colocated,vllm-push", "--repeat", "2",
        "--output", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    assert launcher.started == ["colocated", "vllm-push", "colocated", "vllm-push"]
    assert launcher.running == {}
    summary = load_summary(out)
    assert [(c.round, c.name) for c in summary.configs] == [
        (1, "colocated"), (1, "vllm-push"), (2, "colocated"), (2, "vllm-push"),
    ]  # fmt: skip
    records = read_records(out / "requests.jsonl")
    assert sorted({(r.round, r.config) for r in records}) == [
        (1, "colocated"), (1, "vllm-push"), (2, "colocated"), (2, "vllm-push"),
    ]  # fmt: skip
    push = summary.in_round(2).config("vllm-push")
    assert push is not None and push.run_dir is not None
    assert Path(push.run_dir) == out / "clusters" / "round-2" / "vllm-push"
    legs = push.points[0].router
    assert legs is not None and legs.num_prefills == 6  # the fake's prefill legs
    report = (out / "report.md").read_text()
    assert "## Round 2" in report and "router handover ms" in report
    assert (out / "ttft_vs_qps.png").stat().st_size > 0
