"""Router health checks: the pure board and selection, the probing loop against
fake backends, the health metrics, the connector's counters in ``/metrics``,
and the options that wire them (config, CLI, launcher).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvpush.cli import _parser
from kvpush.launcher.cluster import router_command
from kvpush.launcher.config import ClusterConfig
from kvpush.router import RouterConfig
from kvpush.router.connector_stats import read_counters, render
from kvpush.router.errors import RouterError
from kvpush.router.health import HealthBoard
from kvpush.router.metrics import RouterMetrics
from kvpush.router.requests import parse_request
from kvpush.router.selection import RoundRobinSelector, choose, has_every_role
from kvpush.topology import Backend, Topology
from tests.fakes import Routed, routed

P0 = Backend(role="prefill", url="http://127.0.0.1:1", engine_id="p0")
P1 = Backend(role="prefill", url="http://127.0.0.1:2", engine_id="p1")
D0 = Backend(role="decode", url="http://127.0.0.1:3", engine_id="d0")
D1 = Backend(role="decode", url="http://127.0.0.1:4", engine_id="d1")
PD = Topology(mode="kvpush", backends=(P0, P1, D0, D1))
COMPLETION = {"model": "m", "prompt": "one two three", "max_tokens": 3}
REQUEST = parse_request(msgspec.json.encode(COMPLETION), "completions", False)
FAST = {"health_interval_s": 0.02, "health_timeout_s": 0.5}


# -- the board -------------------------------------------------------------------


def test_instance_goes_down_after_consecutive_failures_and_back_after_one_ok() -> None:
    board = HealthBoard(PD.backends, unhealthy_after=3)
    assert board.is_healthy("p0")
    assert board.record_probe("p0", False, "HTTP 500") is None
    assert board.record_probe("p0", True) is None  # an OK resets the count
    assert board.record_probe("p0", False) is None
    assert board.record_probe("p0", False) is None
    down = board.record_probe("p0", False, "HTTP 503")
    assert down is not None and not down.is_healthy and down.backend == P0
    assert "3 failed health probes: HTTP 503" in down.reason
    assert not board.is_healthy("p0")
    assert board.record_probe("p0", False) is None  # reported once only
    up = board.record_probe("p0", True)
    assert up is not None and up.is_healthy and board.is_healthy("p0")
    assert board.num_failures("p0") == 0
    assert all(board.is_healthy(b.engine_id) for b in (P1, D0, D1))


def test_a_connect_failure_marks_down_at_once_and_one_ok_probe_revives() -> None:
    board = HealthBoard(PD.backends, unhealthy_after=2)
    down = board.mark_unreachable("d1", "connection refused")
    assert down is not None and not down.is_healthy
    assert "connection refused" in down.reason
    assert board.mark_unreachable("d1", "again") is None
    assert board.record_probe("d1", False) is None  # still down, no new transition
    up = board.record_probe("d1", True)
    assert up is not None and up.is_healthy


def test_unknown_engine_is_never_healthy_and_zero_threshold_is_refused() -> None:
    assert not HealthBoard(PD.backends, 1).is_healthy("nobody")
    with pytest.raises(ValueError, match="unhealthy_after"):
        HealthBoard(PD.backends, 0)


# -- selection -------------------------------------------------------------------


def test_selection_skips_unhealthy_and_avoided_instances() -> None:
    board = HealthBoard(PD.backends, unhealthy_after=1)
    selector = RoundRobinSelector()
    board.mark_unreachable("p0", "refused")
    prefills = [choose(selector, "prefill", (P0, P1), REQUEST, board) for _ in range(3)]
    assert [b.engine_id for b in prefills] == ["p1", "p1", "p1"]
    decodes = [
        choose(selector, "decode", (D0, D1), REQUEST, board, avoided={"d0"})
        for _ in range(2)
    ]
    assert [b.engine_id for b in decodes] == ["d1", "d1"]


def test_no_usable_instance_is_a_503_naming_the_role() -> None:
    board = HealthBoard(PD.backends, unhealthy_after=1)
    board.mark_unreachable("d0", "refused")
    with pytest.raises(RouterError) as caught:
        choose(RoundRobinSelector(), "decode", (D0, D1), REQUEST, board, {"d1"})
    err = caught.value
    assert err.status == 503 and err.kind == "no_healthy_instance"
    body = msgspec.json.decode(err.body)["error"]
    assert "no healthy decode instance" in body["message"]
    assert body["code"] == "no_healthy_instance" and body["param"] == "decode"


def test_a_retry_needs_every_role_still_usable() -> None:
    board = HealthBoard(PD.backends, unhealthy_after=1)
    assert has_every_role(PD.backends, board, {"p0", "d0"})
    board.mark_unreachable("p1", "refused")
    assert not has_every_role(PD.backends, board, {"p0"})


# -- probing against fakes -------------------------------------------------------


async def _metrics(r: Routed) -> str:
    return (await r.get("/metrics")).body.decode()


async def _until_metric(r: Routed, line: str, timeout_s: float = 3.0) -> None:
    async with asyncio.timeout(timeout_s):
        while line not in await _metrics(r):
            await asyncio.sleep(0.01)


def _healthy(engine_id: str, role: str, value: int, mode: str = "kvpush") -> str:
    labels = f'mode="{mode}",instance="{engine_id}",role="{role}"'
    return f"kvpush_router_instance_healthy{{{labels}}} {value}"


async def _send(r: Routed, count: int) -> list[int]:
    return [(await r.post("/v1/completions", COMPLETION)).status for _ in range(count)]


async def test_instance_failing_probes_gets_no_requests_until_it_recovers() -> None:
    async with routed("kvpush", num_decodes=2, **FAST) as r:
        sick = r.cluster.decodes[0]
        sick.health_status = 500
        await _until_metric(r, _healthy("decode0", "decode", 0))
        assert await _send(r, 4) == [200] * 4
        assert sick.received == []
        assert len(r.cluster.decodes[1].received) == 4
        text = await _metrics(r)
        assert (
            'kvpush_router_health_transitions_total{mode="kvpush",'
            'instance="decode0",role="decode",to="down"} 1'
        ) in text

        sick.health_status = 200
        await _until_metric(r, _healthy("decode0", "decode", 1))
        assert await _send(r, 2) == [200, 200]
        assert len(sick.received) == 1  # round robin over both again
        text = await _metrics(r)
    assert 'instance="decode0",role="decode",to="up"} 1' in text
    assert _healthy("prefill0", "prefill", 1) in text


async def test_refused_connection_marks_down_before_any_probe_fails() -> None:
    # Probes every 60 s: only the refused leg can mark the instance down.
    async with routed("colocated", num_decodes=2, health_interval_s=60.0) as r:
        dead = r.cluster.colocated[0]
        await dead.close()
        assert await _send(r, 3) == [200] * 3  # the first one by a retry
        text = await _metrics(r)
        assert len(r.cluster.colocated[1].received) == 3
    assert _healthy("colocated0", "colocated", 0, mode="colocated") in text
    assert 'kvpush_router_retries_total{mode="colocated"} 1' in text


async def test_restarted_instance_comes_back_after_a_healthy_probe() -> None:
    async with routed("vllm-pull", num_prefills=2, **FAST) as r:
        prefill = r.cluster.prefills[0]
        await prefill.close()
        await _until_metric(r, _healthy("prefill0", "prefill", 0, "vllm-pull"))
        await _send(r, 2)
        assert prefill.received == []
        await prefill.restart()
        await _until_metric(r, _healthy("prefill0", "prefill", 1, "vllm-pull"))
        assert await _send(r, 2) == [200, 200]
        assert len(prefill.received) == 1


async def test_no_healthy_decode_is_a_fast_503_that_reaches_no_backend() -> None:
    async with routed("kvpush", num_decodes=2, **FAST) as r:
        for fake in r.cluster.decodes:
            fake.health_status = 503
        for fake in r.cluster.decodes:
            await _until_metric(r, _healthy(fake.engine_id, "decode", 0))
        reply = await r.post("/v1/completions", COMPLETION)
        received = [rec for fake in r.cluster.fakes for rec in fake.received]
        text = await _metrics(r)
    assert reply.status == 503
    error = reply.json()["error"]
    assert "no healthy decode instance" in error["message"]
    assert error["code"] == "no_healthy_instance"
    assert received == []
    failures = 'kvpush_router_failures_total{mode="kvpush",cause="no_healthy_instance"}'
    assert f"{failures} 1" in text
    assert 'kvpush_router_retries_total{mode="kvpush"}' not in text


async def test_health_endpoint_says_which_instances_are_routed() -> None:
    async with routed("vllm-push", num_decodes=2, health_interval_s=60.0) as r:
        await r.cluster.decodes[0].close()
        await r.post("/v1/completions", COMPLETION)  # marks decode0 down
        body = (await r.get("/health")).json()
    by_id = {b["engine_id"]: b for b in body["backends"]}
    assert by_id["decode0"]["routed"] is False and by_id["decode1"]["routed"] is True


async def test_health_checks_stop_with_the_router() -> None:
    async with routed("colocated", **FAST):
        names = {t.get_name() for t in asyncio.all_tasks()}
        assert "health-colocated0" in names
    await asyncio.sleep(0)
    assert not any(t.get_name().startswith("health-") for t in asyncio.all_tasks())


# -- connector counters ----------------------------------------------------------


def _write(directory: Path, name: str, content: Any) -> None:
    text = content if isinstance(content, str) else json.dumps(content)
    (directory / name).write_text(text)


def _counters(engine_id: str, role: str, pid: int, **counts: int) -> dict[str, Any]:
    counters = {k.replace("__", "."): v for k, v in counts.items()}
    return {"engine_id": engine_id, "role": role, "pid": pid, "counters": counters}


def test_counter_files_are_summed_per_engine_role_and_event(tmp_path: Path) -> None:
    _write(tmp_path, "counters-1.json", _counters("prefill0", "prefill", 1, expired=3))
    _write(
        tmp_path,
        "counters-2.json",
        _counters("prefill0", "prefill", 2, expired=4, failed__write_failed=1),
    )
    _write(tmp_path, "counters-3.json", _counters("decode0", "decode", 3, fallback=2))
    _write(tmp_path, "counters-4.json", '{"engine_id": "decode0", "ro')  # partial
    _write(tmp_path, "counters-5.json", _counters("decode0", "bogus", 5, expired=9))
    _write(tmp_path, "counters-6.json", _counters("decode0", "decode", 6, **{"X": 1}))
    _write(tmp_path, "counters-7.json", _counters("decode0", "decode", 7, expired=-1))
    _write(tmp_path, "other.json", _counters("decode0", "decode", 8, expired=50))
    (tmp_path / "counters-dir.json").mkdir()
    assert read_counters(tmp_path) == {
        ("prefill0", "prefill", "expired"): 7,
        ("prefill0", "prefill", "failed.write_failed"): 1,
        ("decode0", "decode", "fallback"): 2,
    }


def test_missing_counters_dir_reads_as_no_counters(tmp_path: Path) -> None:
    assert read_counters(tmp_path / "not-yet") == {}
    assert render({}) == ""


async def test_metrics_endpoint_appends_connector_counters(tmp_path: Path) -> None:
    _write(tmp_path, "counters-1.json", _counters("decode0", "decode", 1, expired=2))
    _write(tmp_path, "counters-2.json", _counters("decode0", "decode", 2, expired=3))
    _write(tmp_path, "counters-3.json", "not json")
    async with routed("kvpush", connector_stats_dir=tmp_path) as r:
        reply = await r.get("/metrics")
    text = reply.body.decode()
    assert reply.status == 200
    assert "# TYPE kvpush_connector_events_total counter" in text
    assert (
        'kvpush_connector_events_total{engine_id="decode0",role="decode",'
        'event="expired"} 5'
    ) in text
    assert "kvpush_router_requests_in_flight" in text  # the router's own, too


def test_metrics_render_the_fault_tolerance_families() -> None:
    metrics = RouterMetrics("kvpush")
    metrics.set_instance_healthy("p0", "prefill", True)
    metrics.health_transition("d0", "decode", False)
    metrics.failed("unreachable")
    metrics.retried()
    text = metrics.render()
    assert _healthy("p0", "prefill", 1) in text and _healthy("d0", "decode", 0) in text
    assert "# TYPE kvpush_router_instance_healthy gauge" in text
    assert 'kvpush_router_failures_total{mode="kvpush",cause="unreachable"} 1' in text
    assert 'kvpush_router_retries_total{mode="kvpush"} 1' in text
    assert (
        'kvpush_router_health_transitions_total{mode="kvpush",instance="d0",'
        'role="decode",to="down"} 1'
    ) in text


# -- options ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"health_interval_s": 0}, "health_interval_s"),
        ({"unhealthy_after": 0}, "unhealthy_after"),
        ({"unhealthy_after": 1.5}, "unhealthy_after"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"connector_stats_dir": "traces"}, "pathlib.Path"),
        ({"connector_stats_dir": Path(__file__)}, "not a directory"),
        ({"topology": Topology(mode="kvpush", backends=(P0, P0, D0))}, "unique"),
    ],
)
def test_fault_tolerance_config_errors_say_what_to_change(
    overrides: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        RouterConfig(**{"topology": PD, **overrides})


def test_config_defaults() -> None:
    config = RouterConfig(topology=PD)
    assert (config.health_interval_s, config.unhealthy_after) == (1.0, 2)
    assert config.max_attempts == 2 and config.connector_stats_dir is None


def test_router_cli_flags_reach_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    topology_path = tmp_path / "topology.json"
    topology_path.write_bytes(msgspec.json.encode(PD))
    seen: list[RouterConfig] = []
    monkeypatch.setattr("kvpush.router.run_router", seen.append)
    base = ["router", "--topology", str(topology_path)]
    flags = [
        "--health-interval-s", "0.5", "--unhealthy-after", "3",
        "--max-attempts", "4", "--connector-stats-dir", str(tmp_path),
    ]  # fmt: skip
    for argv in (base, base + flags):
        args = _parser().parse_args(argv)
        assert args.func(args) == 0
    default, given = seen
    assert default == RouterConfig(topology=PD)
    assert (given.health_interval_s, given.unhealthy_after) == (0.5, 3)
    assert (given.max_attempts, given.connector_stats_dir) == (4, tmp_path)


@pytest.mark.parametrize("mode", ["kvpush", "vllm-push"])
def test_launcher_gives_the_router_the_trace_dir_in_kvpush_mode(
    mode: str, tmp_path: Path
) -> None:
    cmd = router_command(ClusterConfig(mode=mode), tmp_path)
    assert cmd[cmd.index("--topology") + 1] == str(tmp_path / "topology.json")
    if mode == "kvpush":
        assert cmd[cmd.index("--connector-stats-dir") + 1] == str(tmp_path / "traces")
    else:
        assert "--connector-stats-dir" not in cmd
