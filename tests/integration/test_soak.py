"""A short soak of a real kvpush cluster (``python -m kvpush_lab.soak``,
30 s at 5 req/s): with a quarter of the requests aborted by the client mid-request,
no request is lost, no KV block leaks, and the cluster is stopped after.
The soak starts and stops a cluster of its own, on ports no other test
cluster uses (conftest's are 18000-19499, test_bench's 28500-29599)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvpush.launcher import status
from kvpush_lab.soak.cli import main
from kvpush_lab.soak.report import SOAK_SUMMARY_FILE, SoakSummary

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def soak(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    out = tmp_path_factory.mktemp("soak") / "results"
    argv = [
        "--mode", "kvpush", "--duration-s", "30", "--qps", "5",
        "--prompt-len", "128-768", "--max-tokens", "16", "--abort-fraction", "0.25",
        "--request-timeout-s", "30", "--model", str(model_dir), "--out", str(out),
        "--port", "26000", "--base-http-port", "26100",
        "--base-side-channel-port", "26200",
    ]  # fmt: skip
    return main(argv), out


def summary_of(out: Path) -> SoakSummary:
    return msgspec.json.decode((out / SOAK_SUMMARY_FILE).read_bytes(), type=SoakSummary)


def test_no_request_is_lost(soak: tuple[int, Path]) -> None:
    summary = summary_of(soak[1])
    assert summary.counts["lost"] == 0, summary.examples["lost"]
    assert summary.num_requests == sum(summary.counts.values()) >= 100


def test_no_kv_block_leaks_once_drained(soak: tuple[int, Path]) -> None:
    summary = summary_of(soak[1])
    assert sorted(r.role for r in summary.kv) == ["decode", "prefill"]
    for reading in summary.kv:
        assert reading.error is None, reading
        assert reading.num_leaked_blocks == 0 and reading.num_stuck_requests == 0
        assert reading.num_blocks is not None and reading.num_blocks > 0


def test_some_requests_completed_and_some_were_aborted(
    soak: tuple[int, Path],
) -> None:
    summary = summary_of(soak[1])
    assert summary.counts["completed"] >= summary.num_requests // 2
    assert summary.counts["aborted"] >= 5
    assert (
        summary.ttft_ms is not None and summary.ttft_ms.n == summary.counts["completed"]
    )


def test_the_run_passed_and_its_cluster_is_stopped(soak: tuple[int, Path]) -> None:
    code, out = soak
    summary = summary_of(out)
    assert code == 0 and summary.has_passed, summary.problems
    assert (out / "soak.md").read_text().startswith("## Soak\n\n**Passed:**")
    assert status(out / "cluster") is None
