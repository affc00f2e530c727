"""The router's edges: input checking, configuration, selection, metrics,
health and model listing. Pure parts are tested directly; the rest through a
router in front of fake backends.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from kvpush.router import RouterConfig
from kvpush.router.config import SUPPORTED_MODES
from kvpush.router.dispatch import FLOWS
from kvpush.router.metrics import RouterMetrics
from kvpush.router.requests import parse_request
from kvpush.router.selection import RoundRobinSelector
from kvpush.telemetry import names
from kvpush.topology import Backend, Topology, dump_topology
from tests.fakes import dead_url, routed
from tests.fakes.metrics import families, metric

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPLETION = {"model": "m", "prompt": "one two", "max_tokens": 3}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
P0 = Backend(role="prefill", url="http://127.0.0.1:1", engine_id="p0")
P1 = Backend(role="prefill", url="http://127.0.0.1:2", engine_id="p1")
D0 = Backend(role="decode", url="http://127.0.0.1:3", engine_id="d0")
D1 = Backend(role="decode", url="http://127.0.0.1:4", engine_id="d1")
PD = Topology(mode="vllm-pull", backends=(P0, D0))


def _is_openai_error(body: Any) -> bool:
    return set(body) == {"error"} and set(body["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }


# -- bad input -------------------------------------------------------------------

BAD_BODIES: list[tuple[str, str, bytes, str]] = [
    ("not json", "/v1/completions", b"{nope", "not valid JSON"),
    ("json array", "/v1/completions", b"[1, 2]", "JSON object"),
    ("no prompt", "/v1/completions", b'{"model": "m"}', "prompt"),
    ("no messages", "/v1/chat/completions", b'{"prompt": "x"}', "messages"),
    (
        "max_tokens 0",
        "/v1/completions",
        b'{"prompt": "x", "max_tokens": 0}',
        "max_tokens",
    ),
    (
        "max_tokens str",
        "/v1/completions",
        b'{"prompt": "x", "max_tokens": "3"}',
        "max_tokens",
    ),
    (
        "max_tokens float",
        "/v1/completions",
        b'{"prompt": "x", "max_tokens": 2.5}',
        "max_tokens",
    ),
    (
        "max_completion_tokens 0",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}',
        "max_completion_tokens",
    ),
    ("n 2", "/v1/completions", b'{"prompt": "x", "n": 2}', "n > 1"),
    (
        "n 2 greedy",
        "/v1/completions",
        b'{"prompt": "x", "n": 2, "temperature": 0}',
        "needs sampling",
    ),
    ("stream str", "/v1/completions", b'{"prompt": "x", "stream": "yes"}', "stream"),
    (
        "client kv params",
        "/v1/completions",
        b'{"prompt": "x", "kv_transfer_params": {"do_remote_decode": true}}',
        "reserved for the router",
    ),
]


@pytest.mark.parametrize(
    ("path", "raw", "fragment"),
    [case[1:] for case in BAD_BODIES],
    ids=[case[0] for case in BAD_BODIES],
)
async def test_bad_input_is_400_and_reaches_no_backend(
    path: str, raw: bytes, fragment: str
) -> None:
    async with routed("vllm-push") as r:
        reply = await r.post(path, raw)
        received = [rec for fake in r.cluster.fakes for rec in fake.received]
    assert reply.status == 400
    body = reply.json()
    assert _is_openai_error(body) and fragment in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    assert received == []
    assert reply.headers["X-Request-Id"]


@pytest.mark.parametrize("mode", ["colocated", "kvpush"])
async def test_colocated_and_kvpush_modes_accept_n_above_one(mode: str) -> None:
    async with routed(mode) as r:  # type: ignore[arg-type]
        reply = await r.post("/v1/completions", {**COMPLETION, "n": 2})
        bodies = [rec.body for fake in r.cluster.fakes for rec in fake.received]
    assert reply.status == 200
    if mode == "kvpush":  # one prefill (n 1), decode samples n
        prefill_leg = next(
            b for b in bodies if b["kv_transfer_params"]["role"] == "prefill"
        )
        decode_leg = next(
            b for b in bodies if b["kv_transfer_params"]["role"] == "decode"
        )
        assert (prefill_leg["n"], decode_leg["n"]) == (1, 2)


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/nothing", 404),
        ("POST", "/v2/completions", 404),
        ("GET", "/v1/completions", 405),
    ],
)
async def test_unknown_routes_answer_json_errors(
    method: str, path: str, status: int
) -> None:
    async with (
        routed("colocated") as r,
        r.http.request(method, r.url + path) as resp,
    ):
        body = msgspec.json.decode(await resp.read())
    assert resp.status == status and _is_openai_error(body)


async def test_oversized_body_is_413() -> None:
    async with routed("colocated", max_body_bytes=2048) as r:
        reply = await r.post("/v1/completions", {"prompt": "x" * 4096})
    assert reply.status == 413 and _is_openai_error(reply.json())


async def test_bad_client_request_id_is_refused() -> None:
    async with routed("colocated") as r:
        reply = await r.post("/v1/completions", COMPLETION, {"X-Request-Id": "a b/c"})
    assert reply.status == 400 and "X-Request-Id" in reply.json()["error"]["message"]


def test_leg_bodies_follow_the_vllm_contract() -> None:
    raw = msgspec.json.encode(
        {
            **CHAT,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_completion_tokens": 9,
        }
    )
    parsed = parse_request(raw, "chat", allow_n=False)
    prefill = msgspec.json.decode(parsed.prefill_body())
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert "stream_options" not in prefill and "max_completion_tokens" not in prefill
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    decode = msgspec.json.decode(parsed.decode_body({"a": 1}))
    assert decode == {**msgspec.json.decode(raw), "kv_transfer_params": {"a": 1}}
    assert parsed.body == msgspec.json.decode(raw)  # leg bodies never touch it


@pytest.mark.parametrize(
    ("endpoint", "fields", "wants"),
    [
        ("completions", {}, False),
        ("completions", {"prompt_logprobs": 0}, True),
        ("completions", {"prompt_logprobs": None}, False),
        ("completions", {"echo": True}, False),  # logprobs null: none
        ("completions", {"echo": True, "logprobs": 0}, True),
        ("completions", {"echo": "false", "logprobs": 3}, False),
        ("completions", {"echo": "true", "logprobs": 3}, True),
        ("chat", {"echo": True}, True),  # top_logprobs defaults to 0
        ("chat", {"echo": False, "logprobs": True, "top_logprobs": 2}, False),
        ("chat", {"prompt_logprobs": -1}, True),
    ],
)
def test_requests_vllm_computes_prompt_logprobs_for_are_recognised(
    endpoint: str, fields: dict[str, object], wants: bool
) -> None:
    """As vLLM 0.32's ``to_sampling_params``: these set ``prompt_logprobs``,
    and with it ``skip_reading_prefix_cache`` (no KV load on decode)."""
    body = {**(CHAT if endpoint == "chat" else COMPLETION), **fields}
    raw = msgspec.json.encode(body)
    parsed = parse_request(raw, endpoint, allow_n=True)  # type: ignore[arg-type]
    assert parsed.wants_prompt_logprobs is wants


# -- configuration ---------------------------------------------------------------


def test_every_supported_mode_has_exactly_one_flow() -> None:
    assert set(FLOWS) == set(SUPPORTED_MODES)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"port": 70000}, "port"),
        ({"request_timeout_s": 0}, "request_timeout_s"),
        ({"connect_timeout_s": 700.0}, "connect_timeout_s"),
        ({"health_timeout_s": -1.0}, "health_timeout_s"),
        ({"max_body_bytes": 10}, "max_body_bytes"),
        ({"topology": Topology(mode="vllm-pull", backends=(P0,))}, "decode"),
        (
            {"topology": Topology(mode="colocated", backends=(P0, D0))},
            "colocated",
        ),
        (
            {
                "topology": Topology(
                    mode="vllm-pull",
                    backends=(
                        P0,
                        Backend(role="decode", url="127.0.0.1:9", engine_id="d"),
                    ),
                )
            },
            "http://",
        ),
    ],
)
def test_config_errors_say_what_to_change(
    overrides: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        RouterConfig(**{"topology": PD, **overrides})


def test_round_robin_cycles_each_role_independently() -> None:
    selector = RoundRobinSelector()
    request = parse_request(
        msgspec.json.encode(COMPLETION), "completions", allow_n=False
    )
    picks = [
        (
            selector.pick_prefill((P0, P1), request).engine_id,
            selector.pick_decode((D0, D1), request).engine_id,
        )
        for _ in range(3)
    ]
    assert picks == [("p0", "d0"), ("p1", "d1"), ("p0", "d0")]
    assert selector.pick_decode((D0, D1), request).engine_id == "d1"


# -- metrics, health, models ------------------------------------------------------


def test_metrics_render_prometheus_text() -> None:
    metrics = RouterMetrics("vllm-push")
    metrics.request_started()
    metrics.observe_ttft("chat", 0.03)
    metrics.observe_prefill(0.02, "ok")
    metrics.request_finished("chat", "200", 0.2)
    metrics.error("timeout")
    text = metrics.render()
    push = {"mode": "vllm-push"}
    requests = names.ROUTER_REQUESTS
    assert metric(text, requests, **push, endpoint="chat", status="200") == 1
    assert metric(text, names.ROUTER_ERRORS, **push, cause="timeout") == 1
    assert metric(text, names.ROUTER_REQUESTS_IN_FLIGHT, **push) == 0
    ttft = names.ROUTER_TTFT.bucket
    assert metric(text, ttft, **push, endpoint="chat", le="0.05") == 1
    assert metric(text, ttft, **push, endpoint="chat", le="0.025") == 0
    prefill = names.ROUTER_PREFILL_LEG.count
    assert metric(text, prefill, **push, outcome="ok") == 1
    assert families(text)[names.ROUTER_REQUEST_LATENCY.name] == "histogram"
    assert "_created" not in text


async def test_metrics_endpoint_counts_served_and_refused_requests() -> None:
    async with routed("vllm-pull") as r:
        assert (await r.post("/v1/completions", COMPLETION)).status == 200
        assert (
            await r.post("/v1/chat/completions", {**CHAT, "stream": True})
        ).status == 200
        assert (await r.post("/v1/completions", b"[]")).status == 400
        reply = await r.get("/metrics")
    text = reply.body.decode()
    assert reply.headers["Content-Type"].startswith("text/plain")
    pull = {"mode": "vllm-pull"}
    completions = {**pull, "endpoint": "completions"}
    requests = names.ROUTER_REQUESTS
    assert metric(text, requests, **completions, status="200") == 1
    assert metric(text, requests, **completions, status="400") == 1
    assert metric(text, requests, **pull, endpoint="chat", status="200") == 1
    assert metric(text, names.ROUTER_ERRORS, **pull, cause="bad_request") == 1
    assert metric(text, names.ROUTER_TTFT.count, **completions) == 1
    prefill = names.ROUTER_PREFILL_LEG.count
    assert metric(text, prefill, **pull, outcome="ok") == 2
    # pull: decode starts only after prefill answered, so each handover is > 0
    assert metric(text, names.ROUTER_HANDOVER.count, **pull) == 2
    assert metric(text, names.ROUTER_HANDOVER.bucket, **pull, le="0.0") == 0


async def test_health_is_liveness_ok_while_the_router_serves() -> None:
    # a dead instance must not make a liveness probe restart the router
    async with routed("vllm-pull", url_overrides={"prefill0": dead_url()}) as r:
        reply = await r.get("/health")
    assert reply.status == 200 and reply.json()["status"] == "ok"


async def test_ready_is_ok_when_every_backend_is() -> None:
    async with routed("vllm-push", num_decodes=2) as r:
        reply = await r.get("/ready")
    body = reply.json()
    assert reply.status == 200 and body["status"] == "ok"
    assert sorted(b["engine_id"] for b in body["backends"]) == [
        "decode0",
        "decode1",
        "prefill0",
    ]


async def test_ready_is_200_degraded_while_every_role_is_served() -> None:
    async with routed("vllm-pull", num_decodes=2) as r:
        r.cluster.decodes[0].health_status = 500
        reply = await r.get("/ready")
    assert reply.status == 200 and reply.json()["status"] == "degraded"


async def test_ready_is_503_naming_sick_and_dead_backends() -> None:
    async with routed("vllm-pull", url_overrides={"prefill0": dead_url()}) as r:
        r.cluster.decodes[0].health_status = 500
        reply = await r.get("/ready")
    body = reply.json()
    assert reply.status == 503 and body["status"] == "unavailable"
    by_id = {b["engine_id"]: b for b in body["backends"]}
    assert by_id["decode0"]["status"] == 500 and not by_id["decode0"]["healthy"]
    assert by_id["prefill0"]["status"] is None and by_id["prefill0"]["error"]


@pytest.mark.parametrize("mode", ["colocated", "vllm-push"])
async def test_models_come_from_the_first_decode_or_colocated(mode: str) -> None:
    async with routed(mode) as r:
        reply = await r.get("/v1/models")
    assert reply.status == 200
    owner = reply.json()["data"][0]["owned_by"]
    assert owner == ("colocated0" if mode == "colocated" else "decode0")


# -- the blocking entry point ------------------------------------------------------


async def test_run_router_serves_until_sigterm_then_exits_cleanly(
    tmp_path: Path,
) -> None:
    async with routed("colocated") as r:
        topology_path = tmp_path / "topology.json"
        dump_topology(r.cluster.topology(), topology_path)
        port = int(dead_url().rsplit(":", 1)[1])
        code = (
            "from pathlib import Path\n"
            "from kvpush.router import RouterConfig, run_router\n"
            "from kvpush.topology import load_topology\n"
            f"topology = load_topology(Path({str(topology_path)!r}))\n"
            f"run_router(RouterConfig(topology=topology, port={port}))\n"
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, cwd=REPO_ROOT, stderr=asyncio.subprocess.PIPE
        )
        try:
            url = f"http://127.0.0.1:{port}"
            await _wait_healthy(r.http, url)
            async with r.http.post(url + "/v1/completions", json=COMPLETION) as resp:
                assert resp.status == 200
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(5.0):
                assert await proc.wait() == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def _wait_healthy(http: aiohttp.ClientSession, url: str) -> None:
    async with asyncio.timeout(10.0):
        while True:
            try:
                async with http.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.05)
