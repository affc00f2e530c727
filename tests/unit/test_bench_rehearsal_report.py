"""The report of a multi-host rehearsal swept over two link rates, from a
hand-made summary: a headline row and point sections per rate, the
handover overhead, bytes over the links next to the KV, CPU per GiB, the
bandwidth per transfer against the shaped rate (no target: those live in
the docs); and publishing it as one section under docs/bench."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpush_lab.bench.bandwidth import MIB, BandwidthStats
from kvpush_lab.bench.links import HostBytes, LinkUsage
from kvpush_lab.bench.outputs import publish, write_outputs
from kvpush_lab.bench.records import RequestRecord, write_records
from kvpush_lab.bench.report import demote_headings, render_report
from kvpush_lab.bench.resources import InstanceUsage
from kvpush_lab.bench.results import SectionResults, load_results, save_results
from kvpush_lab.bench.stats import Dist, PointStats
from kvpush_lab.bench.summary import (
    BenchSummary,
    ConfigResult,
    PointInfo,
    PointResult,
    save_summary,
)

KV_PER_TOKEN = 64 * 1024  # the KV-heavy model
KV_PER_REQUEST = 1000 * KV_PER_TOKEN  # 62.5 MiB


def dist(value: float) -> Dist:
    return Dist(n=4, mean=value, p50=value, p90=value, p99=value, min=value, max=value)


def stats(ttft: float) -> PointStats:
    return PointStats(
        num_requests=4, num_ok=4, num_errors=0, errors={}, num_short_output=0,
        duration_s=2.0, request_throughput=2.0, output_throughput=64.0,
        total_token_throughput=2000.0, ttft_ms=dist(ttft), tpot_ms=dist(4.0),
        itl_ms=dist(4.0), e2e_ms=dist(ttft + 124),
    )  # fmt: skip


def links(name: str) -> LinkUsage:
    moved = 0 if name == "colocated" else 4 * KV_PER_REQUEST + 4 * MIB
    role = "colocated" if name == "colocated" else "prefill"
    hosts = [HostBytes(name=f"{role}0", role=role, sent=moved + 4096, received=8192)]
    if name != "colocated":
        hosts.append(HostBytes(name="decode0", role="decode", sent=0, received=moved))
    return LinkUsage(
        num_requests=4, kv_bytes=4 * KV_PER_REQUEST, kv_bytes_per_token=KV_PER_TOKEN,
        hosts=hosts,
    )  # fmt: skip


def usage(name: str) -> list[InstanceUsage]:
    roles = ["colocated"] if name == "colocated" else ["prefill", "decode"]
    return [
        InstanceUsage(name=f"{r}0", role=r, cpu_s=2.0, cpu_cores=0.5, peak_rss_mb=1)
        for r in roles
    ]


def bandwidth(name: str, link: float) -> BandwidthStats | None:
    if name == "kvpush":  # 95% of nominal at 1 Gbit/s, 70% at 4
        p50 = 113.0 if link == 1.0 else 334.0
        return BandwidthStats(
            kind="WRITE", source="kvpush trace", num_transfers=4, num_measured=4,
            mib_per_transfer=64.0, mean_mib_s=p50, link_gbit=link,
            mib_s=Dist(n=4, mean=p50, p50=p50, p90=p50, p99=p50, min=p50 - 5,
                       max=p50 + 5),
        )  # fmt: skip
    if name == "vllm-pull":
        return BandwidthStats(
            kind="READ", source="NIXL telemetry", num_transfers=4, num_measured=4,
            mib_per_transfer=56.0, mean_mib_s=100.0, link_gbit=link,
            mib_s_p50_range=(74.7, 112.0),
        )  # fmt: skip
    return None


def result(name: str, link: float, ttft: float) -> ConfigResult:
    return ConfigResult(
        name=name,
        status="ok",
        link_gbit=link,
        points=[
            PointResult(
                point=0,
                stats=stats(ttft),
                usage=usage(name),
                links=links(name),
                bandwidth=bandwidth(name, link),
            )
        ],
        usage=usage(name),
    )


def summary() -> BenchSummary:
    ttfts = {"colocated": 300.0, "vllm-pull": 1000.0, "kvpush": 650.0}
    return BenchSummary(
        command="kvpush bench --hosts netns --link-gbit 1,4",
        started_at="2026-01-01T00:00:00+00:00",
        machine={"cores": 2},
        settings={"hosts": "netns", "link_gbit": [1.0, 4.0], "num_requests": 4},
        points=[
            PointInfo(
                index=0,
                label="qps 1",
                axis="qps",
                x=1.0,
                arrival="poisson",
                load=1.0,
                prompt_len="1000",
                num_requests=4,
            )
        ],
        configs=[
            result(name, link, ttft / link)
            for link in (1.0, 4.0)
            for name, ttft in ttfts.items()
        ],
    )


def test_every_rate_has_its_headline_row_and_point_section() -> None:
    text = render_report(summary())
    assert (
        "| 1 Gbit/s, qps 1 | 300 / 300, 4.0 | 1000 / 1000, 4.0 | 650 / 650, 4.0 |"
        in text
    )
    assert "| 4 Gbit/s, qps 1 | 75.0 / 75.0, 4.0 |" in text
    one = text.split("## 1 Gbit/s, qps 1")[1].split("## 4 Gbit/s, qps 1")[0]
    assert "| kvpush | 4 / 4 | 0 | 650 |" in one
    assert "| kvpush | 4 / 4 | 0 | 162 |" in text.split("## 4 Gbit/s, qps 1")[1]
    assert "shaped by tbf to 1 Gbit/s, 4 Gbit/s" in text
    assert "## Setup\n\n- **Machine:**" in text


def test_overhead_is_against_colocated_on_the_same_links() -> None:
    text = render_report(summary())
    # 1 Gbit/s: pull 700 ms over colocated, kvpush 350: half of pull's
    assert "| 1 Gbit/s | qps 1 | 300 | 700 | – | 350 | 0.50 | – |" in text
    assert "| 4 Gbit/s | qps 1 | 75.0 | 175 | – | 87.5 | 0.50 | – |" in text


def test_link_bytes_sit_next_to_the_kv_with_cpu_per_gib() -> None:
    text = render_report(summary())
    assert "prompt tokens × 65536 B of KV per token (64 KiB)" in text
    assert "HTTP between router and instances and the TCP/IP" in text
    # 63.5 MiB sent per request for 62.5 MiB of KV; 2 CPU s over 0.248 GiB
    assert (
        "| 1 Gbit/s | qps 1 | kvpush | 63.50 | 63.50 | 62.50 | 1.02 | 8.06 | 8.06 "
        "| 8.06 |" in text
    )
    assert (
        "| 1 Gbit/s | qps 1 | colocated | 0.001 | 0.002 | 62.50 | – | – | – | – |"
        in text
    )


def test_bandwidth_per_transfer_against_the_shaped_rate_without_a_verdict() -> None:
    text = render_report(summary())
    assert "1 Gbit/s = 119.2 MiB/s, 4 Gbit/s = 476.8 MiB/s" in text
    assert (
        "| 1 Gbit/s | qps 1 | kvpush | WRITE | kvpush trace | 4 of 4 | 64.0 | 113 "
        "| 108–118 | 113 | 0.95 |" in text
    )
    assert (
        "| 1 Gbit/s | qps 1 | vllm-pull | READ | NIXL telemetry | 4 of 4 | 56.0 "
        "| 75–112 (bucket) | – | 100 | 0.84 |" in text
    )
    assert "target" not in text.lower()


def test_a_local_run_has_no_rehearsal_parts() -> None:
    local = summary()
    local.settings["hosts"] = "local"
    text = render_report(local)
    assert "## Over the links" not in text and "## Handover overhead" not in text


def test_headings_move_down_a_level_outside_code() -> None:
    text = "# t\n\n```\n# not a heading\n```\n## a\n#### b\n"
    assert (
        demote_headings(text) == "## t\n\n```\n# not a heading\n```\n### a\n##### b\n"
    )


def test_publishing_a_section_writes_its_json_and_plots_and_renders_the_rest(
    tmp_path: Path,
) -> None:
    root = tmp_path / "repo"
    soak = SectionResults(section="soak", title="Soak", kind="soak", source="a test")
    save_results(soak, root / "docs" / "bench" / "soak")
    s = summary()
    save_summary(s, tmp_path)
    write_records(
        tmp_path / "requests.jsonl",
        [
            RequestRecord(
                config="kvpush", point=0, index=0, bench_id="kvb-0-0",
                prompt_len=1000, output_len=32, scheduled_s=0.0, link_gbit=link,
                token_times_s=[0.1 * link, 0.2 * link],
            )
            for link in (1.0, 4.0)
        ],
    )  # fmt: skip
    local = write_outputs(tmp_path, s, section="rehearsal-ttft")
    assert tmp_path / "results.json" in local
    files = publish(tmp_path, s, root, section="rehearsal-ttft", title="Rehearsal")
    folder = root / "docs" / "bench" / "rehearsal-ttft"
    results = load_results(folder)
    assert results.section == "rehearsal-ttft" and results.title == "Rehearsal"
    assert results.points == ["1 Gbit/s, qps 1", "4 Gbit/s, qps 1"]
    assert results.run == s  # the whole summary rides along
    # one point swept over two rates: TTFT and TPOT drawn against the rate
    assert {p.file for p in results.plots} >= {"ttft_vs_link_gbit.png", "ttft_cdf.png"}
    assert (folder / "ttft_cdf.png").exists()
    assert (folder / "tpot_vs_link_gbit.png").exists()
    details = (folder / "README.md").read_text()
    assert details.startswith("# Rehearsal") and "## Over the links" in details
    assert "![TTFT CDF per point](ttft_cdf.png)" in details
    text = (root / "BENCHMARKS.md").read_text()
    assert "[results.json](docs/bench/rehearsal-ttft/results.json)" in text
    assert "[results.json](docs/bench/soak/results.json)" in text  # kept
    assert root / "BENCHMARKS.md" in files and folder / "results.json" in files


def test_a_bad_section_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="section name"):
        publish(tmp_path, summary(), tmp_path, section="Bad Name")
