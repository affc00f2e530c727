"""``kvpush bench`` end to end, with the launcher replaced by fake clusters
(the real router in front of fake vLLM backends, on a thread of their own):
every request accounted for, warm-up kept out, unavailable and failing
configurations reported, server timelines joined, every file written."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from kvpush.cli import main
from kvpush.launcher import ClusterConfig
from kvpush.launcher.state import ProcessRecord, RunState
from kvpush_lab.bench import clusters, runner
from kvpush_lab.bench.records import read_records
from kvpush_lab.bench.results import load_results
from kvpush_lab.bench.summary import load_summary
from tests.fakes import Fault, routed

NUM_REQUESTS = 6  # the quick preset
FAST = ["--quick", "--qps", "50"]  # the quick preset, sent faster


class ThreadedCluster:
    """Fakes plus a router for one mode, served from a background thread."""

    def __init__(self, mode: str, fault: Fault | None) -> None:
        self.mode, self.fault, self.url = mode, fault, ""
        self.instances: list[tuple[str, str, str]] = []  # (name, role, url)
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._serve()), name=f"fake-{mode}"
        )
        self._thread.start()
        assert self._ready.wait(10), "fake cluster did not start"

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with routed(self.mode) as r:  # type: ignore[arg-type]
            for fake in r.cluster.fakes:
                fake.fault = self.fault
                self.instances.append((fake.engine_id, fake.role, fake.url))
            self.url = r.url
            self._ready.set()
            await self._stop.wait()

    def stop(self) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


class FakeLauncher:
    """Stands in for ``up``/``down``: refuses kvpush as the real one does,
    fails vllm-pull's every request, writes timelines for vllm-push."""

    def __init__(self) -> None:
        self.running: dict[Path, ThreadedCluster] = {}
        self.started: list[str] = []

    def up(self, config: ClusterConfig, console: Any = None) -> RunState:
        if config.mode == "kvpush":
            raise ValueError("mode 'kvpush' is not available yet")
        assert config.run_dir is not None
        fault = Fault(status=500) if config.mode == "vllm-pull" else None
        cluster = ThreadedCluster(config.mode, fault)
        self.running[config.run_dir] = cluster
        self.started.append(config.mode)
        if config.mode == "vllm-push":
            write_timelines(config.run_dir)
        process = ProcessRecord(
            name="router", role="router", pid=os.getpgrp(), url=cluster.url,
            log_path=str(config.run_dir / "router.log"),
        )  # fmt: skip
        instances = tuple(
            ProcessRecord(name=n, role=r, pid=os.getpgrp(), url=u, log_path=f"{n}.log")
            for n, r, u in cluster.instances
        )
        return RunState(
            mode=config.mode, model="m", router_url=cluster.url,
            processes=(process, *instances),
        )  # fmt: skip

    def down(self, run_dir: Path) -> list[str]:
        self.running.pop(run_dir).stop()
        return ["router"]


def write_timelines(run_dir: Path) -> None:
    """Traces of three of the point's requests, one event per line, the
    request named on the decode's first line."""
    folder = run_dir / "traces"
    folder.mkdir(parents=True)
    rows = []
    for i in range(3):
        rows += [
            {"transfer_id": f"t{i}", "event": "kv_ready", "t": 1.0},
            {"transfer_id": f"t{i}", "event": "first_decode_step", "t": 1.02},
            {"transfer_id": f"t{i}", "request_id": f"cmpl-kvb-0-{i}.x-0"},
        ]
    (folder / "decode0-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def launcher(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeLauncher:
    fake = FakeLauncher()
    monkeypatch.setattr(clusters, "up", fake.up)
    monkeypatch.setattr(clusters, "down", fake.down)
    model = tmp_path / "model"
    monkeypatch.setattr(runner, "resolve_model", lambda config, console: model)
    monkeypatch.setattr(runner, "normal_token_ids", lambda path: list(range(3, 500)))
    return fake


def test_a_run_accounts_for_every_request_of_every_configuration(
    launcher: FakeLauncher, tmp_path: Path
) -> None:
    out, repo = tmp_path / "out", tmp_path / "repo"
    argv = [
        "bench", *FAST, "--configs", "colocated,kvpush,vllm-pull,vllm-push",
        "--output", str(out), "--publish", str(repo), "--repeat", "1",
    ]  # fmt: skip
    assert main(argv) == 1  # kvpush skipped, vllm-pull failed: not all measured
    assert launcher.started == ["colocated", "vllm-pull", "vllm-push"]
    assert launcher.running == {}  # every cluster stopped

    summary = load_summary(out)
    status = {c.name: c.status for c in summary.configs}
    assert status == {
        "colocated": "ok", "kvpush": "skipped", "vllm-pull": "failed",
        "vllm-push": "ok",
    }  # fmt: skip
    assert "warm-up" in (summary.config("vllm-pull").reason or "")  # type: ignore[union-attr]

    records = read_records(out / "requests.jsonl")
    assert sorted((r.config, r.index) for r in records) == sorted(
        (c, i) for c in ("colocated", "vllm-push") for i in range(NUM_REQUESTS)
    )
    assert all(r.bench_id.startswith("kvb-0-") for r in records)  # no warm-up
    for name in ("colocated", "vllm-push"):
        stats = summary.stats(name, 0)
        assert stats is not None
        assert stats.num_ok + stats.num_errors == NUM_REQUESTS
        assert summary.config(name).warmup.num_ok == 2  # type: ignore[union-attr]

    push = summary.config("vllm-push").points[0]  # type: ignore[union-attr]
    assert push.handover is not None and push.handover.num_requests == 3
    assert push.handover.phases_ms["handover total"].p50 == pytest.approx(20.0)
    assert summary.config("colocated").points[0].handover is None  # type: ignore[union-attr]
    colocated = summary.config("colocated")
    assert colocated is not None and colocated.usage[0].name == "router"
    assert colocated.load is not None and colocated.points[0].load is not None

    for name in ("report.md", "ttft_vs_qps.png", "ttft_cdf.png", "timeline.png"):
        assert (out / name).stat().st_size > 0
    report = (out / "report.md").read_text()
    assert "**kvpush** skipped: mode 'kvpush' is not available yet" in report
    assert (out / "results.json").exists()
    section = repo / "docs" / "bench" / "qps-sweep"
    assert load_results(section).measured("qps 50", "colocated")
    assert (section / "README.md").read_text().count("## qps 50") == 1
    assert (section / "tpot_vs_qps.png").exists()
    assert "(docs/bench/qps-sweep/results.json)" in (repo / "BENCHMARKS.md").read_text()


def test_render_redoes_the_report_from_the_files(
    launcher: FakeLauncher, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert main(["bench", *FAST, "--configs", "colocated", "--output", str(out)]) == 0
    (out / "report.md").unlink()
    assert main(["bench", "--render", str(out)]) == 0
    assert "| colocated | 6 / 6 |" in (out / "report.md").read_text()


def test_a_results_directory_is_never_reused(
    launcher: FakeLauncher, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    assert main(["bench", "--quick", "--output", str(out)]) == 2
    assert launcher.started == []


def test_a_multi_turn_run_records_every_turn_in_its_point(
    launcher: FakeLauncher, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    argv = [
        "bench", "--workload", "multi-turn", "--configs", "colocated",
        "--num-conversations", "2", "--num-turns", "3", "--history-len", "64",
        "--turn-len", "8", "--output-len", "4", "--num-warmup", "1",
        "--output", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    summary = load_summary(out)
    assert [p.label for p in summary.points] == ["turn 1", "turns 2+"]
    assert [p.num_requests for p in summary.points] == [2, 4]
    first, later = (summary.stats("colocated", i) for i in (0, 1))
    assert first is not None and first.num_ok == 2
    assert later is not None and later.num_ok == 4
    records = read_records(out / "requests.jsonl")
    turns = sorted((r.bench_id, r.point, r.prompt_len) for r in records)
    # Each turn adds the answer's 4 token ids (the fake returns them when
    # asked, as vLLM does) and its own 8 new tokens.
    assert turns == [
        ("kvb-c0-t1", 0, 64), ("kvb-c0-t2", 1, 76), ("kvb-c0-t3", 1, 88),
        ("kvb-c1-t1", 0, 64), ("kvb-c1-t2", 1, 76), ("kvb-c1-t3", 1, 88),
    ]  # fmt: skip
    assert "multi-turn: 2 conversations of 3 turns" in (out / "report.md").read_text()
