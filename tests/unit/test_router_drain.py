"""Draining an instance for a rolling restart: the router's admin endpoints
and ``kvpush drain``, against the shared fake backends."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvpush.router.admin_client import drain as drain_cli
from tests.fakes import Fault, Routed, expected_text, routed

COMPLETION = {"model": "m", "prompt": "one two three", "max_tokens": 3}


async def _instances(r: Routed) -> dict[str, dict[str, Any]]:
    reply = await r.get("/admin/instances")
    assert reply.status == 200
    return {i["engine_id"]: i for i in reply.json()["instances"]}


async def _until_idle(r: Routed, name: str) -> dict[str, dict[str, Any]]:
    """The instances once ``name`` has nothing in flight (within 2 s)."""
    async with asyncio.timeout(2.0):
        while (listed := await _instances(r))[name]["in_flight"]:
            await asyncio.sleep(0.01)
    return listed


async def test_a_drained_instance_gets_no_new_request_and_undrain_restores() -> None:
    async with routed("vllm-push", num_decodes=2) as r:
        d0, d1 = r.cluster.decodes
        reply = await r.post("/admin/drain/decode0", b"")
        assert reply.status == 200 and reply.json()["drained"] is True
        for _ in range(4):
            assert (await r.post("/v1/completions", COMPLETION)).status == 200
        assert (len(d0.received), len(d1.received)) == (0, 4)
        assert (await r.post("/admin/undrain/decode0", b"")).status == 200
        for _ in range(4):
            assert (await r.post("/v1/completions", COMPLETION)).status == 200
        assert len(d0.received) == 2 and len(d1.received) == 6
        assert (await _instances(r))["decode0"]["drained"] is False


async def test_in_flight_requests_finish_on_a_drained_instance() -> None:
    async with routed("vllm-push") as r:
        (decode,) = r.cluster.decodes
        decode.fault = Fault(delay_s=0.3)
        pending = asyncio.create_task(r.post("/v1/completions", COMPLETION))
        await decode.wait_until(lambda rs: len(rs) == 1)
        listed = await _instances(r)
        assert (listed["decode0"]["in_flight"], listed["prefill0"]["in_flight"]) == (
            1,
            1,
        )
        assert (await r.post("/admin/drain/decode0", b"")).json()["in_flight"] == 1
        reply = await pending
        assert reply.status == 200
        assert reply.json()["choices"][0]["text"] == expected_text("one two three", 3)
        listed = await _until_idle(r, "decode0")  # released just after the reply
        assert listed["decode0"] == {
            "engine_id": "decode0",
            "role": "decode",
            "url": decode.url,
            "tp_size": 1,
            "dp_rank": None,
            "healthy": True,
            "drained": True,
            "in_flight": 0,
        }
        # The only decode is drained: a new request is refused, not sent.
        refused = await r.post("/v1/completions", COMPLETION)
        assert refused.status == 503 and len(decode.received) == 1


async def test_in_flight_counts_return_to_zero_after_failures_and_retries() -> None:
    async with routed("vllm-pull", num_prefills=2, max_attempts=2) as r:
        r.cluster.prefills[0].fault = Fault(status=500, body=b"{}")
        for _ in range(3):
            await r.post("/v1/completions", COMPLETION)
        for name in ("prefill0", "prefill1", "decode0"):
            await _until_idle(r, name)


async def test_unknown_instance_is_a_404_naming_the_known_ones() -> None:
    async with routed("colocated") as r:
        reply = await r.post("/admin/drain/nope", b"")
        assert reply.status == 404
        assert "known: colocated0" in reply.json()["error"]["message"]


async def test_kvpush_drain_waits_until_nothing_is_in_flight() -> None:
    async with routed("colocated", num_decodes=2) as r:
        (c0, _) = r.cluster.colocated
        c0.fault = Fault(delay_s=0.8)
        pending = asyncio.create_task(r.post("/v1/completions", COMPLETION))
        await c0.wait_until(lambda rs: len(rs) == 1)
        lines: list[str] = []
        entry = await asyncio.to_thread(
            drain_cli, r.url, "colocated0", wait_s=10.0, report=lines.append
        )
        assert (await pending).status == 200
        assert entry["in_flight"] == 0 and entry["drained"] is True
        assert lines[-1] == "colocated0 has no request in flight; it can be stopped"
        await asyncio.to_thread(drain_cli, r.url, "colocated0", undrain=True)
        assert (await _instances(r))["colocated0"]["drained"] is False


async def test_kvpush_drain_fails_past_its_deadline_and_on_unknown_names() -> None:
    async with routed("colocated") as r:
        (c0,) = r.cluster.colocated
        c0.fault = Fault(delay_s=1.5)
        pending = asyncio.create_task(r.post("/v1/completions", COMPLETION))
        await c0.wait_until(lambda rs: len(rs) == 1)
        with pytest.raises(RuntimeError, match="still has 1 request"):
            await asyncio.to_thread(
                drain_cli, r.url, "colocated0", wait_s=0.2, report=lambda _: None
            )
        with pytest.raises(RuntimeError, match="HTTP 404"):
            await asyncio.to_thread(drain_cli, r.url, "other", report=lambda _: None)
        assert (await pending).status == 200
