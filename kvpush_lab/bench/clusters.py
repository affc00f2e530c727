"""Starting and stopping the benchmark's clusters, one at a time.

Every run gets a fresh cluster from the launcher, except where the kvpush
configurations share one (``BenchConfig.shares_kvpush_cluster``): then the
first of them starts the cluster (its router bound as that configuration
says), each later one starts a router of its own over the same topology
(``kvpush router --topology RUN_DIR/topology.json --binding B``, on
``port + k``) and stops it when done, and the last one stops the cluster.
A 2P2D cluster takes about 1.5 min to start on a small machine; the routers
take a second.
"""

from __future__ import annotations

import dataclasses
import os
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
from rich.console import Console

from kvpush.launcher import ClusterConfig, down, process, up
from kvpush.launcher.cluster import router_command
from kvpush.launcher.state import ProcessRecord, RunState

ROUTER_READY_S = 30.0
_POLL_S = 0.2


@dataclass(frozen=True)
class Run:
    """One cluster of the benchmark: a configuration at a link rate, in a
    round (None: the run is not repeated). ``router_port`` is set where the
    configuration shares a cluster an earlier run of its round started and
    brings a router of its own."""

    name: str
    link_gbit: float | None
    cluster: ClusterConfig
    is_shared: bool = False
    router_port: int | None = None
    round: int | None = None

    @property
    def run_dir(self) -> Path:
        if self.cluster.run_dir is None:
            raise ValueError(f"{self.name}: the plan gives every run a directory")
        return self.cluster.run_dir


def share_runs(runs: Sequence[Run], shared_dir: Path) -> tuple[Run, ...]:
    """``runs`` with every kvpush one on the cluster in ``shared_dir``: the
    first starts it, the others bring routers on port + 1, port + 2, ..."""
    out, num_later = [], 0
    for run in runs:
        if run.cluster.mode != "kvpush":
            out.append(run)
            continue
        cluster = dataclasses.replace(run.cluster, run_dir=shared_dir)
        is_first = not any(r.is_shared for r in out)
        port = None if is_first else cluster.port + 1 + num_later
        num_later += not is_first
        out.append(
            dataclasses.replace(run, cluster=cluster, is_shared=True, router_port=port)
        )
    return tuple(out)


class Clusters:
    """Owns what the runs started; :meth:`close` stops whatever is left."""

    def __init__(self, runs: Sequence[Run]) -> None:
        self._left = sum(r.is_shared for r in runs)  # shared runs not yet done
        self._shared: RunState | None = None
        self._shared_dir: Path | None = None
        self._router: int | None = None  # an extra router's process group

    def start(self, run: Run, console: Console) -> RunState:
        """The cluster ``run`` measures (ValueError: refused, as ``up``).
        A shared run that fails to start counts as done."""
        if not run.is_shared:
            return up(run.cluster, console)
        try:
            if self._shared is None:
                self._shared = up(run.cluster, console)
                self._shared_dir = run.run_dir
            if run.router_port is None:
                return self._shared
            return self._start_router(run, run.router_port, self._shared)
        except BaseException:
            self.stop(run)
            raise

    def stop(self, run: Run) -> None:
        """Stop what ``run`` started (a shared cluster once no run is left)."""
        if not run.is_shared:
            down(run.run_dir)
            return
        self._stop_router()
        self._left -= 1
        if self._left <= 0:
            self.close()

    def close(self) -> None:
        """Stop the extra router and the shared cluster, if still up."""
        self._stop_router()
        if self._shared_dir is not None:
            shared_dir, self._shared, self._shared_dir = self._shared_dir, None, None
            down(shared_dir)

    def _start_router(self, run: Run, port: int, shared: RunState) -> RunState:
        config = dataclasses.replace(run.cluster, port=port)
        log = run.run_dir / f"router-{run.name}.log"
        pid = process.spawn(router_command(config, run.run_dir), _env(), log)
        self._router = pid
        url = f"http://{config.host}:{config.port}"
        _wait_healthy(url, pid, log)  # raises: start() stops it
        record = ProcessRecord(
            name=f"router-{run.name}", role="router", pid=pid, url=url,
            log_path=str(log),
        )  # fmt: skip
        instances = tuple(p for p in shared.processes if p.role != "router")
        return msgspec.structs.replace(
            shared, router_url=url, processes=(*instances, record)
        )

    def _stop_router(self) -> None:
        if self._router is not None:
            pid, self._router = self._router, None
            process.stop_group(pid)


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1")


def _wait_healthy(url: str, pid: int, log: Path) -> None:
    deadline = time.monotonic() + ROUTER_READY_S
    while time.monotonic() < deadline:
        if not process.is_alive(pid):
            raise RuntimeError(f"router {url} exited:\n{process.tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(_POLL_S)
    raise RuntimeError(f"router {url} not healthy within {ROUTER_READY_S:g} s")
