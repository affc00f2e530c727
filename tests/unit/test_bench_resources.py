"""Machine facts and per-process-group CPU and memory from /proc."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from kvpush.launcher.state import ProcessRecord
from kvpush_lab.bench.resources import (
    ResourceMonitor,
    git_commit,
    machine_info,
    parse_cpu_model,
    parse_cpu_ticks,
    parse_meminfo_kb,
    parse_proc_stat,
    versions,
)

# /proc/PID/stat of a process whose name contains a space and a parenthesis
STAT = (
    "4242 (vllm (Worker) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 "
    "1234 567 0 0 20 0 8 0 100 1000000 500 18446744073709551615"
)


def test_proc_texts_are_parsed() -> None:
    assert parse_cpu_ticks(STAT) == 1234 + 567
    meminfo = "MemTotal:       24576000 kB\nMemFree:  100 kB\n"
    assert parse_meminfo_kb(meminfo) == 24576000
    assert parse_meminfo_kb(meminfo, "Swap") is None
    cpuinfo = "processor\t: 0\nmodel name\t: Test CPU @ 2.0GHz\nflags\t: avx2\n"
    assert parse_cpu_model(cpuinfo) == "Test CPU @ 2.0GHz"
    stat = (
        "cpu  100 5 20 400 10 1 2 3 0 0\n"
        "cpu0 50 0 10 200 5 0 1 1 0 0\ncpu1 50 5 10 200 5 1 1 2 0 0\nintr 1\n"
    )
    assert parse_proc_stat(stat) == (100 + 5 + 20 + 1 + 2 + 3, 131 + 400 + 10, 2)


def test_machine_and_versions_are_recorded() -> None:
    info = machine_info()
    assert info["cores"] >= 1 and info["usable_cores"] >= 1
    assert info["memory_gb"] > 0 and info["cpu_model"]
    assert "kvpush" in versions()


def test_published_results_do_not_mark_the_commit_as_locally_changed(
    tmp_path: Path,
) -> None:
    # Publishing a section rewrites docs/bench and BENCHMARKS.md in the
    # checkout; the next section from it is still the commit's code.
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True,
                       capture_output=True)  # fmt: skip

    git("init", "-q")
    (tmp_path / "docs" / "bench").mkdir(parents=True)
    for name in ("docs/bench/results.json", "BENCHMARKS.md", "code.py"):
        (tmp_path / name).write_text("v1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    head = git_commit(tmp_path)
    assert head is not None and "+" not in head
    (tmp_path / "docs/bench/results.json").write_text("v2\n")
    (tmp_path / "BENCHMARKS.md").write_text("v2\n")
    assert git_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("v2\n")
    assert git_commit(tmp_path) == f"{head}+local changes"


def test_a_busy_group_shows_cpu_and_memory_between_marks() -> None:
    me = ProcessRecord(
        name="tests", role="router", pid=os.getpgrp(), url="", log_path=""
    )
    monitor = ResourceMonitor([me], interval_s=0.05)
    monitor.start()
    try:
        before = monitor.mark()
        deadline = time.process_time() + 0.3
        while time.process_time() < deadline:  # burn 0.3 s of CPU
            pass
        time.sleep(0.1)
        after = monitor.mark()
    finally:
        monitor.close()
    [usage] = monitor.usage(before, after)
    load = monitor.load(before, after)
    # this process burnt 0.3 s of CPU in the window (however long other
    # processes on a shared machine made it)
    assert load.client_cores * (after.at - before.at) >= 0.25
    assert load.cluster_cores == pytest.approx(usage.cpu_cores, abs=0.01)
    assert load.machine_cores >= load.client_cores - 0.1
    assert load.background_cores >= 0
    assert usage.name == "tests" and usage.role == "router"
    assert usage.cpu_s >= 0.25
    assert 0 < usage.cpu_cores <= os.cpu_count()  # type: ignore[operator]
    assert usage.peak_rss_mb > 10
