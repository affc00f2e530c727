"""How the router fails: backend errors, refused connections, deadlines and
clients that go away. In every case the legs still open must be aborted, which
the fake backends observe as a cancelled request.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from kvpush.router.config import RoutingConfig
from kvpush.telemetry import names
from tests.fakes import FakeVllm, Fault, Received, Routed, dead_url, routed
from tests.fakes.metrics import metric

COMPLETION = {"model": "m", "prompt": "one two three", "max_tokens": 4}
STREAM = {**COMPLETION, "stream": True}
GREEDY_STREAM = {**STREAM, "temperature": 0.0}
PATH = "/v1/completions"


def _was_cancelled(records: list[Received]) -> bool:
    return bool(records) and all(rec.is_cancelled for rec in records)


async def _wait_cancelled(*fakes: FakeVllm) -> None:
    for fake in fakes:
        await fake.wait_until(_was_cancelled)


async def _metrics(r: Routed) -> str:
    return (await r.get("/metrics")).body.decode()


# -- backend errors ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["vllm-pull", "vllm-push"])
@pytest.mark.parametrize("status", [400, 503])
async def test_prefill_error_reaches_the_client_unchanged(
    mode: str, status: int
) -> None:
    async with routed(mode) as r:
        r.cluster.prefills[0].fault = Fault(status=status)
        reply = await r.post(PATH, COMPLETION)
        decodes = r.cluster.decodes[0]
        if mode == "vllm-push":  # decode was waiting for KV: it must be aborted
            await _wait_cancelled(decodes)
        else:
            assert decodes.received == []
        text = await _metrics(r)
    assert reply.status == status
    error = reply.json()["error"]
    assert error["message"] == "injected fault" and error["code"] == status
    assert metric(text, names.ROUTER_ERRORS, cause="prefill_http_error")


async def test_non_json_backend_error_is_wrapped_in_openai_shape() -> None:
    async with routed("vllm-pull") as r:
        r.cluster.prefills[0].fault = Fault(status=500, body=b"engine exploded")
        reply = await r.post(PATH, COMPLETION)
    assert reply.status == 500
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "prefill0" in error["message"] and "engine exploded" in error["message"]


@pytest.mark.parametrize("mode", ["vllm-pull", "vllm-push"])
async def test_decode_error_reaches_the_client_and_aborts_prefill(mode: str) -> None:
    async with routed(mode) as r:
        r.cluster.decodes[0].fault = Fault(status=400)
        if mode == "vllm-push":
            r.cluster.prefills[0].fault = Fault(is_hang=True)
        reply = await r.post(PATH, COMPLETION)
        if mode == "vllm-push":
            await _wait_cancelled(r.cluster.prefills[0])
    assert reply.status == 400
    assert reply.json()["error"]["message"] == "injected fault"


async def test_prefill_without_kv_params_is_a_bad_gateway() -> None:
    async with routed("vllm-pull") as r:
        r.cluster.prefills[0].is_kv_producer = False
        reply = await r.post(PATH, COMPLETION)
    assert reply.status == 502
    assert "kv_transfer_params" in reply.json()["error"]["message"]


@pytest.mark.parametrize(
    ("mode", "dead"),
    [("colocated", "colocated0"), ("vllm-pull", "prefill0"), ("vllm-push", "decode0")],
)
async def test_refused_connection_is_502_naming_the_backend(
    mode: str, dead: str
) -> None:
    async with routed(mode, url_overrides={dead: dead_url()}) as r:
        reply = await r.post(PATH, COMPLETION)
    assert reply.status == 502
    error = reply.json()["error"]
    assert dead in error["message"] and error["type"] == "upstream_error"


# -- deadlines -----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["vllm-pull", "vllm-push"])
async def test_hung_prefill_times_out_with_504_and_aborts_legs(mode: str) -> None:
    async with routed(mode, request_timeout_s=0.3, connect_timeout_s=0.3) as r:
        r.cluster.prefills[0].fault = Fault(is_hang=True)
        reply = await r.post(PATH, COMPLETION)
        await _wait_cancelled(r.cluster.prefills[0])
        if mode == "vllm-push":
            await _wait_cancelled(r.cluster.decodes[0])
    assert reply.status == 504
    assert reply.json()["error"]["type"] == "timeout_error"


async def test_timeout_mid_stream_ends_the_stream_with_an_error_event() -> None:
    async with routed("vllm-pull", request_timeout_s=0.4, connect_timeout_s=0.3) as r:
        r.cluster.decodes[0].fault = Fault(hang_after_chunks=2)
        reply = await r.post(PATH, STREAM)
        await _wait_cancelled(r.cluster.decodes[0])
    assert reply.status == 200
    *tokens, last = reply.events()
    assert len(tokens) == 2
    assert msgspec.json.decode(last)["error"]["type"] == "timeout_error"


# -- clients that leave --------------------------------------------------------


async def _leave_while_waiting(
    r: Routed, body: dict[str, object], *waited: FakeVllm
) -> None:
    """Send ``body``, wait until every fake in ``waited`` has it, then hang up."""
    client = asyncio.create_task(r.post(PATH, body))
    for fake in waited:
        await fake.wait_until(lambda recs: bool(recs))
    client.cancel()
    with pytest.raises(asyncio.CancelledError):
        await client


@pytest.mark.parametrize("is_stream", [False, True])
async def test_client_leaving_during_pull_prefill_aborts_it(is_stream: bool) -> None:
    async with routed("vllm-pull") as r:
        r.cluster.prefills[0].fault = Fault(is_hang=True)
        await _leave_while_waiting(
            r, STREAM if is_stream else COMPLETION, r.cluster.prefills[0]
        )
        await _wait_cancelled(r.cluster.prefills[0])
        assert r.cluster.decodes[0].received == []
        await _wait_for_idle(r)
        text = await _metrics(r)
    assert metric(text, names.ROUTER_REQUESTS, status="499")


@pytest.mark.parametrize("is_stream", [False, True])
async def test_client_leaving_during_push_aborts_both_legs(is_stream: bool) -> None:
    async with routed("vllm-push") as r:
        prefill, decode = r.cluster.prefills[0], r.cluster.decodes[0]
        prefill.fault = Fault(is_hang=True)
        await _leave_while_waiting(
            r, STREAM if is_stream else COMPLETION, prefill, decode
        )
        await _wait_cancelled(prefill, decode)


@pytest.mark.parametrize("mode", ["colocated", "vllm-pull", "vllm-push"])
async def test_client_leaving_mid_stream_aborts_decode(mode: str) -> None:
    async with routed(mode) as r:
        answering = (r.cluster.colocated or r.cluster.decodes)[0]
        answering.fault = Fault(hang_after_chunks=2)
        async with r.http.post(r.url + PATH, json=STREAM) as resp:
            assert resp.status == 200
            assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: ")
            resp.close()
        await _wait_cancelled(answering)
        for prefill in r.cluster.prefills:  # done before decode could answer
            assert prefill.received[0].answered_at is not None
        await _wait_for_idle(r)


@pytest.mark.parametrize("mode", ["colocated", "vllm-pull", "kvpush"])
async def test_a_client_that_hangs_up_once_it_read_done_was_served(mode: str) -> None:
    # Clients close as soon as they have read the final [DONE] event, which
    # may be before the backend's stream has ended (its end is held back
    # here). The router must record a request it served in full (200; in
    # kvpush mode, its first token from prefill), not a client that left.
    routing = {"routing": RoutingConfig(binding="early")} if mode == "kvpush" else {}
    async with routed(mode, **routing) as r:
        answering = (r.cluster.colocated or r.cluster.decodes)[0]
        answering.fault = Fault(hold_eof_s=0.5)
        async with r.http.post(r.url + PATH, json=GREEDY_STREAM) as resp:
            read = b""
            while not read.endswith(b"data: [DONE]\n\n"):
                read += await asyncio.wait_for(resp.content.readany(), 5.0)
            resp.close()
        await _wait_for_idle(r)
        text = await _metrics(r)
    assert metric(text, names.ROUTER_REQUESTS, status="200") == 1, text
    assert metric(text, names.ROUTER_REQUESTS, status="499") is None
    assert metric(text, names.ROUTER_ERRORS, cause="client_disconnected") is None
    if mode == "kvpush":
        assert metric(text, names.ROUTER_FIRST_TOKEN, outcome="prefill") == 1


async def _wait_for_idle(r: Routed) -> None:
    """Until the router reports no request in flight (its handler finished)."""
    async with asyncio.timeout(3.0):
        while True:
            gauge = metric(await _metrics(r), names.ROUTER_REQUESTS_IN_FLIGHT)
            if gauge == 0:
                return
            await asyncio.sleep(0.01)
