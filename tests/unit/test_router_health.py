"""Router health checks: the pure board and selection, the probing loop against
fake backends, the health metrics, the connector's counters in ``/metrics``,
and the options that wire them (config, CLI, launcher).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from kvpush.cli import _parser
from kvpush.launcher.cluster import router_command
from kvpush.launcher.config import ClusterConfig
from kvpush.router import RouterConfig
from kvpush.router.config import FirstTokenFrom
from kvpush.router.connector_stats import events_of, scrape
from kvpush.router.errors import RouterError
from kvpush.router.health import HealthBoard
from kvpush.router.metrics import RouterMetrics
from kvpush.router.requests import parse_request
from kvpush.router.selection import RoundRobinSelector, choose, has_every_role
from kvpush.telemetry import names
from kvpush.topology import Backend, Topology
from tests.fakes import Routed, routed
from tests.fakes.fake_vllm import vllm_metrics_text
from tests.fakes.metrics import families, metric

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


async def _until_healthy(
    r: Routed, engine_id: str, role: str, value: int, mode: str = "kvpush"
) -> None:
    async with asyncio.timeout(3.0):
        while _healthy(await _metrics(r), engine_id, role, mode) != value:
            await asyncio.sleep(0.01)


def _healthy(
    text: str, engine_id: str, role: str, mode: str = "kvpush"
) -> float | None:
    gauge = names.ROUTER_INSTANCE_HEALTHY
    return metric(text, gauge, mode=mode, instance=engine_id, role=role)


def _transitions(text: str, engine_id: str, to: str) -> float | None:
    counter = names.ROUTER_HEALTH_TRANSITIONS
    return metric(text, counter, instance=engine_id, to=to)


async def _send(r: Routed, count: int) -> list[int]:
    return [(await r.post("/v1/completions", COMPLETION)).status for _ in range(count)]


async def test_instance_failing_probes_gets_no_requests_until_it_recovers() -> None:
    async with routed("kvpush", num_decodes=2, **FAST) as r:
        sick = r.cluster.decodes[0]
        sick.health_status = 500
        await _until_healthy(r, "decode0", "decode", 0)
        assert await _send(r, 4) == [200] * 4
        assert sick.received == []
        assert len(r.cluster.decodes[1].received) == 4
        assert _transitions(await _metrics(r), "decode0", "down") == 1

        sick.health_status = 200
        await _until_healthy(r, "decode0", "decode", 1)
        assert await _send(r, 2) == [200, 200]
        assert len(sick.received) == 1  # round robin over both again
        text = await _metrics(r)
    assert _transitions(text, "decode0", "up") == 1
    assert _healthy(text, "prefill0", "prefill") == 1


async def test_refused_connection_marks_down_before_any_probe_fails() -> None:
    # Probes every 60 s: only the refused leg can mark the instance down.
    async with routed("colocated", num_decodes=2, health_interval_s=60.0) as r:
        dead = r.cluster.colocated[0]
        await dead.close()
        assert await _send(r, 3) == [200] * 3  # the first one by a retry
        text = await _metrics(r)
        assert len(r.cluster.colocated[1].received) == 3
    assert _healthy(text, "colocated0", "colocated", mode="colocated") == 0
    assert metric(text, names.ROUTER_RETRIES, mode="colocated") == 1


async def test_restarted_instance_comes_back_after_a_healthy_probe() -> None:
    async with routed("vllm-pull", num_prefills=2, **FAST) as r:
        prefill = r.cluster.prefills[0]
        await prefill.close()
        await _until_healthy(r, "prefill0", "prefill", 0, "vllm-pull")
        await _send(r, 2)
        assert prefill.received == []
        await prefill.restart()
        await _until_healthy(r, "prefill0", "prefill", 1, "vllm-pull")
        assert await _send(r, 2) == [200, 200]
        assert len(prefill.received) == 1


async def test_no_healthy_decode_is_a_fast_503_that_reaches_no_backend() -> None:
    async with routed("kvpush", num_decodes=2, **FAST) as r:
        for fake in r.cluster.decodes:
            fake.health_status = 503
        for fake in r.cluster.decodes:
            await _until_healthy(r, fake.engine_id, "decode", 0)
        reply = await r.post("/v1/completions", COMPLETION)
        received = [rec for fake in r.cluster.fakes for rec in fake.received]
        text = await _metrics(r)
    assert reply.status == 503
    error = reply.json()["error"]
    assert "no healthy decode instance" in error["message"]
    assert error["code"] == "no_healthy_instance"
    assert received == []
    failures = names.ROUTER_FAILURES
    assert metric(text, failures, mode="kvpush", cause="no_healthy_instance") == 1
    assert metric(text, names.ROUTER_RETRIES) is None


async def test_ready_endpoint_says_which_instances_are_routed() -> None:
    async with routed("vllm-push", num_decodes=2, health_interval_s=60.0) as r:
        await r.cluster.decodes[0].close()
        await r.post("/v1/completions", COMPLETION)  # marks decode0 down
        body = (await r.get("/ready")).json()
    by_id = {b["engine_id"]: b for b in body["backends"]}
    assert by_id["decode0"]["routed"] is False and by_id["decode1"]["routed"] is True


async def test_health_checks_stop_with_the_router() -> None:
    async with routed("colocated", **FAST):
        tasks = {t.get_name() for t in asyncio.all_tasks()}
        assert "health-colocated0" in tasks
    await asyncio.sleep(0)
    assert not any(t.get_name().startswith("health-") for t in asyncio.all_tasks())


# -- connector events scraped from the instances -------------------------------


def test_connector_events_are_read_from_vllm_metrics_summed_over_engines() -> None:
    text = vllm_metrics_text({"expired.ready": 2, "fallback": 1})
    text += (
        'vllm:kvpush_events_total{engine="1",event="expired.ready",'
        'model_name="fake-model"} 3.0\n'
    )
    assert events_of(text) == {"expired.ready": 5.0, "fallback": 1.0}
    assert events_of(vllm_metrics_text({})) == {}
    with pytest.raises(ValueError):
        events_of("not metrics at all\n")


async def test_metrics_endpoint_serves_each_instances_connector_events() -> None:
    async with routed("kvpush") as r:
        r.cluster.prefills[0].connector_events = {"expired.ready": 2}
        r.cluster.decodes[0].connector_events = {"fallback": 3, "peer_lost": 1}
        text = await _metrics(r)
    events = names.CONNECTOR_EVENTS
    assert families(text)[names.CONNECTOR_EVENTS.name] == "counter"
    assert metric(text, events, engine_id="prefill0", role="prefill",
                  event="expired.ready") == 2  # fmt: skip
    assert metric(text, events, engine_id="decode0", role="decode",
                  event="fallback") == 3  # fmt: skip
    assert metric(text, events, role="decode") == 4
    assert metric(text, names.ROUTER_REQUESTS_IN_FLIGHT) == 0  # its own, too


async def test_an_instance_that_does_not_answer_in_time_is_left_out() -> None:
    async with routed("kvpush", num_decodes=2) as r:
        r.cluster.prefills[0].connector_events = {"expired.ready": 1}
        slow, dead = r.cluster.decodes
        slow.connector_events, slow.metrics_delay_s = {"fallback": 1}, 1.0
        await dead.close()
        async with aiohttp.ClientSession() as session:
            backends = r.cluster.topology().backends
            totals = await scrape(session, backends, timeout_s=0.2)
    assert totals == {("prefill0", "prefill", "expired.ready"): 1.0}


async def test_other_modes_do_not_scrape_the_instances() -> None:
    async with routed("vllm-push") as r:
        r.cluster.decodes[0].connector_events = {"fallback": 3}
        text = await _metrics(r)
    assert names.CONNECTOR_EVENTS.name not in text


def test_metrics_render_the_fault_tolerance_families() -> None:
    metrics = RouterMetrics("kvpush")
    metrics.set_instance_healthy("p0", "prefill", True)
    metrics.health_transition("d0", "decode", False)
    metrics.failed("unreachable")
    metrics.retried()
    text = metrics.render()
    assert _healthy(text, "p0", "prefill") == 1 and _healthy(text, "d0", "decode") == 0
    assert families(text)[names.ROUTER_INSTANCE_HEALTHY.name] == "gauge"
    failures = names.ROUTER_FAILURES
    assert metric(text, failures, mode="kvpush", cause="unreachable") == 1
    assert metric(text, names.ROUTER_RETRIES, mode="kvpush") == 1
    assert _transitions(text, "d0", "down") == 1
    assert metric(text, names.ROUTER_HEALTH_TRANSITIONS, role="decode") == 1


# -- options ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"health_interval_s": 0}, "health_interval_s"),
        ({"unhealthy_after": 0}, "unhealthy_after"),
        ({"unhealthy_after": 1.5}, "unhealthy_after"),
        ({"max_attempts": 0}, "max_attempts"),
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
    assert config.max_attempts == 2


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
        "--max-attempts", "4", "--first-token-from", "decode", "--state-model",
    ]  # fmt: skip
    for argv in (base, base + flags):
        args = _parser().parse_args(argv)
        assert args.func(args) == 0
    default, given = seen
    assert default == RouterConfig(topology=PD)
    assert (given.health_interval_s, given.unhealthy_after) == (0.5, 3)
    assert given.max_attempts == 4
    assert default.routing.first_token_from is FirstTokenFrom.PREFILL
    assert given.routing.first_token_from is FirstTokenFrom.DECODE
    assert (default.routing.state_model, given.routing.state_model) == (False, True)


@pytest.mark.parametrize("mode", ["kvpush", "vllm-push"])
def test_launcher_gives_the_router_the_topology_only(mode: str, tmp_path: Path) -> None:
    cmd = router_command(ClusterConfig(mode=mode), tmp_path)
    assert cmd[cmd.index("--topology") + 1] == str(tmp_path / "topology.json")
    assert not any(word.startswith("--connector") for word in cmd)


async def test_idle_connections_to_instances_close_before_vllms_keep_alive() -> None:
    """vLLM's API server closes a connection idle for its keep-alive
    (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s); a router that kept one longer
    could send a leg on it as it closes ("Server disconnected")."""
    from vllm import envs

    from kvpush.router.app import STATE, _client_session, build_app

    app = build_app(RouterConfig(topology=PD))
    session = _client_session(app)
    await session.__anext__()
    try:
        connector = app[STATE].client().connector
        assert isinstance(connector, aiohttp.TCPConnector)
        kept_s = connector._keepalive_timeout  # aiohttp exposes no getter
        assert kept_s is not None and kept_s < envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    finally:
        await session.aclose()
