"""Retrying a failed request on other instances: only while nothing has
reached the client, only for upstream failures, with fresh leg ids, and at
most ``max_attempts`` times. The pure policy first, then against fakes.
"""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import pytest

from kvpush.router.config import FirstTokenFrom, RoutingConfig
from kvpush.router.errors import (
    RouterError,
    bad_request,
    no_healthy_instance,
    unreachable,
    upstream_timeout,
)
from kvpush.router.retry import Attempts
from kvpush.telemetry import names
from kvpush.telemetry.reader import Name
from kvpush.topology import Backend
from tests.fakes import FakeVllm, Fault, Received, Routed, dead_url, routed
from tests.fakes.metrics import metric

P0 = Backend(role="prefill", url="http://127.0.0.1:1", engine_id="p0")
D0 = Backend(role="decode", url="http://127.0.0.1:3", engine_id="d0")
COMPLETION = {"model": "m", "prompt": "one two three", "max_tokens": 4}
STREAM = {**COMPLETION, "stream": True}
PATH = "/v1/completions"


# -- the policy ------------------------------------------------------------------


def _from_backend(status: int) -> RouterError:
    return RouterError.from_backend(status, b"{}", "decode", D0)


@pytest.mark.parametrize(
    ("err", "expected"),
    [
        (unreachable("prefill", P0, "refused"), True),
        (_from_backend(500), True),
        (_from_backend(503), True),
        (upstream_timeout("connect", P0), True),
        (_from_backend(400), False),
        (_from_backend(404), False),
        (bad_request("no"), False),
        (no_healthy_instance("decode", 2), False),
    ],
)
def test_only_upstream_failures_are_retryable(err: RouterError, expected: bool) -> None:
    attempts = Attempts(max_attempts=2)
    assert (
        attempts.may_retry(err, has_client_started=False, is_client_here=True)
        is expected
    )


def test_no_retry_once_the_client_got_bytes_or_left_or_attempts_ran_out() -> None:
    err = unreachable("prefill", P0, "refused")
    attempts = Attempts(max_attempts=2)
    assert not attempts.may_retry(err, has_client_started=True, is_client_here=True)
    assert not attempts.may_retry(err, has_client_started=False, is_client_here=False)
    attempts.start_next(err)
    assert attempts.number == 2
    assert not attempts.may_retry(err, has_client_started=False, is_client_here=True)
    assert not Attempts(max_attempts=1).may_retry(
        err, has_client_started=False, is_client_here=True
    )


def test_blame_falls_on_the_failed_leg_else_the_whole_attempt() -> None:
    attempts = Attempts(max_attempts=3, picked=[P0, D0])
    assert attempts.blame(_from_backend(502)) == {"d0"}
    assert attempts.blame(upstream_timeout("request")) == {"p0", "d0"}
    attempts.start_next(_from_backend(502))
    assert attempts.avoided == {"d0"} and attempts.picked == []
    assert attempts.leg_request_id("abc") == "abc.a2"
    assert Attempts(max_attempts=3).leg_request_id("abc") == "abc"


# -- against fakes ---------------------------------------------------------------


async def _metric(r: Routed, name: Name, **labels: str) -> int:
    """The sample ``name`` with ``labels``, 0 when absent."""
    text = (await r.get("/metrics")).body.decode()
    return round(metric(text, name, **labels) or 0)


def _transfer_id(rec: Received) -> str:
    return str(rec.kv_transfer_params["transfer_id"])


async def test_kvpush_retries_on_a_fresh_pair_with_a_fresh_transfer_id() -> None:
    async with routed("kvpush", num_prefills=2, num_decodes=2) as r:
        (p0, p1), (d0, d1) = r.cluster.prefills, r.cluster.decodes
        p0.fault = Fault(status=503)
        reply = await r.post(PATH, COMPLETION, {"X-Request-Id": "client-7"})
        await d0.wait_until(lambda recs: bool(recs) and recs[0].is_cancelled)
        retries = await _metric(r, names.ROUTER_RETRIES, mode="kvpush")
        failures = await _metric(
            r, names.ROUTER_FAILURES, mode="kvpush", cause="upstream_error"
        )
    assert reply.status == 200 and reply.headers["X-Request-Id"] == "client-7"
    assert (retries, failures) == (1, 1)
    (first_p,), (first_d,) = p0.received, d0.received
    (second_p,), (second_d,) = p1.received, d1.received
    assert _transfer_id(first_p) == _transfer_id(first_d)
    assert _transfer_id(second_p) == _transfer_id(second_d) != _transfer_id(first_d)
    assert second_p.kv_transfer_params["decode_engine_id"] == "decode1"
    assert second_d.kv_transfer_params["prefill_engine_id"] == "prefill1"
    assert first_d.request_id is not None and first_d.request_id.startswith("client-7.")
    assert second_d.request_id == f"{first_d.request_id}.a2"


@pytest.mark.parametrize(
    ("mode", "dead_ids"),
    [
        ("vllm-push", ("prefill0", "decode0")),
        ("kvpush", ("prefill0", "decode0")),
        # Pull picks decode only after prefill answered: with both firsts dead
        # two attempts would each find one; a dead decode is retried once.
        ("vllm-pull", ("decode0",)),
    ],
)
async def test_dead_first_pair_is_retried_on_the_second(
    mode: str, dead_ids: tuple[str, ...]
) -> None:
    dead = {engine_id: dead_url() for engine_id in dead_ids}
    async with routed(mode, num_prefills=2, num_decodes=2, url_overrides=dead) as r:
        reply = await r.post(PATH, STREAM)
        retries = await _metric(r, names.ROUTER_RETRIES, mode=mode)
        unreachable_count = await _metric(
            r, names.ROUTER_FAILURES, mode=mode, cause="unreachable"
        )
        (prefill,), (decode,) = (
            r.cluster.prefills[1].received,
            r.cluster.decodes[1].received,
        )
        second = await r.post(PATH, COMPLETION)  # no retry: dead ones are down
        retries_after = await _metric(r, names.ROUTER_RETRIES, mode=mode)
    assert reply.status == 200 and reply.events()[-1] == b"[DONE]"
    assert (retries, unreachable_count) == (1, 1)
    assert decode.request_id == prefill.request_id
    assert decode.request_id is not None and decode.request_id.endswith(".a2")
    if mode == "vllm-push":
        assert decode.kv_transfer_params["remote_request_id"] == decode.request_id
    assert second.status == 200 and retries_after == 1


async def test_colocated_retries_on_another_instance() -> None:
    async with routed("colocated", num_decodes=2) as r:
        r.cluster.colocated[0].fault = Fault(is_reset=True)  # drops, no answer
        reply = await r.post(PATH, COMPLETION)
        retries = await _metric(r, names.ROUTER_RETRIES, mode="colocated")
    assert reply.status == 200 and retries == 1
    assert len(r.cluster.colocated[1].received) == 1


async def test_no_retry_after_the_first_byte_reached_the_client() -> None:
    """With the first token from decode (from prefill, decode's failure is
    continued elsewhere: ``test_router_first_token.py``)."""
    routing = RoutingConfig(first_token_from=FirstTokenFrom.DECODE)
    async with routed("kvpush", num_decodes=2, routing=routing) as r:
        r.cluster.decodes[0].fault = Fault(reset_after_chunks=2)
        reply = await r.post(PATH, STREAM)
        retries = await _metric(r, names.ROUTER_RETRIES, mode="kvpush")
        assert r.cluster.decodes[1].received == []
    assert reply.status == 200
    *tokens, last = reply.events()
    assert len(tokens) == 2
    assert msgspec.json.decode(last)["error"]["type"] == "upstream_error"
    assert retries == 0


@pytest.mark.parametrize("status", [400, 422])
async def test_client_errors_are_not_retried(status: int) -> None:
    async with routed("vllm-pull", num_prefills=2, num_decodes=2) as r:
        r.cluster.decodes[0].fault = Fault(status=status)
        reply = await r.post(PATH, COMPLETION)
        retries = await _metric(r, names.ROUTER_RETRIES, mode="vllm-pull")
        others = r.cluster.prefills[1].received + r.cluster.decodes[1].received
    assert reply.status == status and retries == 0 and others == []


async def test_retries_stop_at_max_attempts_with_the_last_error() -> None:
    async with routed("colocated", num_decodes=3, max_attempts=2) as r:
        for fake in r.cluster.colocated:
            fake.fault = Fault(status=500, body=b"boom " + fake.engine_id.encode())
        reply = await r.post(PATH, COMPLETION)
        tried = [fake for fake in r.cluster.colocated if fake.received]
        retries = await _metric(r, names.ROUTER_RETRIES, mode="colocated")
    assert [len(fake.received) for fake in tried] == [1, 1] and retries == 1
    last = max(tried, key=lambda fake: fake.received[0].arrived_at)
    assert reply.status == 500
    assert f"boom {last.engine_id}" in reply.json()["error"]["message"]


async def test_max_attempts_one_disables_retries() -> None:
    async with routed("colocated", num_decodes=2, max_attempts=1) as r:
        r.cluster.colocated[0].fault = Fault(status=503)
        reply = await r.post(PATH, COMPLETION)
        assert r.cluster.colocated[1].received == []
    assert reply.status == 503


async def test_the_request_deadline_is_not_retried() -> None:
    config = {"request_timeout_s": 0.3, "connect_timeout_s": 0.3}
    async with routed("kvpush", num_prefills=2, **config) as r:
        r.cluster.prefills[0].fault = Fault(is_hang=True)
        reply = await r.post(PATH, COMPLETION)
        await r.cluster.prefills[0].wait_until(lambda recs: recs[0].is_cancelled)
        assert r.cluster.prefills[1].received == []
    assert reply.status == 504


async def test_a_client_that_leaves_is_not_retried() -> None:
    async with routed("kvpush", num_prefills=2, num_decodes=2) as r:
        p0, d0 = r.cluster.prefills[0], r.cluster.decodes[0]
        p0.fault = Fault(is_hang=True)
        client = asyncio.create_task(r.post(PATH, COMPLETION))
        await _all_received(p0, d0)
        client.cancel()
        with pytest.raises(asyncio.CancelledError):
            await client
        await p0.wait_until(lambda recs: recs[0].is_cancelled)
        await d0.wait_until(lambda recs: recs[0].is_cancelled)
        gone = await _metric(
            r, names.ROUTER_FAILURES, mode="kvpush", cause="client_gone"
        )
        retries = await _metric(r, names.ROUTER_RETRIES, mode="kvpush")
        others = r.cluster.prefills[1].received + r.cluster.decodes[1].received
    assert (gone, retries, others) == (1, 0, [])


async def _all_received(*fakes: FakeVllm) -> None:
    for fake in fakes:
        await fake.wait_until(lambda recs: bool(recs))


async def test_kvpush_a_lost_prefill_leg_is_retried_without_waiting_for_decode() -> (
    None
):
    """Off loopback decode cannot tell a dead prefill from a partition and
    would wait for it: the router aborts the attempt (the aborted receive
    keeps its blocks until prefill's final word) and tries the other prefill."""
    dead = {"prefill0": dead_url()}
    async with routed("kvpush", num_prefills=2, url_overrides=dead) as r:
        (decode,) = r.cluster.decodes
        decode.kv_wait_s = 60.0  # waits for its KV far past this test
        reply = await r.post(PATH, COMPLETION)
        await decode.wait_until(lambda recs: bool(recs) and recs[0].is_cancelled)
        retries = await _metric(r, names.ROUTER_RETRIES, mode="kvpush")
    assert reply.status == 200, reply.body
    assert retries == 1
    first, second = decode.received
    assert first.is_cancelled, "the first attempt's decode leg was aborted"
    assert first.kv_transfer_params["prefill_engine_id"] == "prefill0"
    assert second.kv_transfer_params["prefill_engine_id"] == "prefill1"


async def test_kvpush_auto_retries_a_lost_prefill_leg_on_decode_alone() -> None:
    dead = {"prefill0": dead_url()}
    routing = RoutingConfig(binding="auto")
    async with routed("kvpush", url_overrides=dead, routing=routing) as r:
        (decode,) = r.cluster.decodes
        decode.kv_wait_s = 60.0
        reply = await r.post(PATH, COMPLETION)
        await decode.wait_until(lambda recs: bool(recs) and recs[0].is_cancelled)
        retries = await _metric(r, names.ROUTER_RETRIES, mode="kvpush")
    assert reply.status == 200, reply.body
    assert retries == 1
    first, second = decode.received
    assert first.is_cancelled and first.kv_transfer_params
    assert not second.kv_transfer_params, "no prefill left: decode computes it"


@pytest.mark.parametrize("max_attempts", [1, 2])
async def test_kvpush_decode_falls_back_when_no_retry_can_follow(
    max_attempts: int,
) -> None:
    """With no attempt left (or, bound early, no other prefill), a lost
    prefill loses its leg, not the request: kvpush's decode sees the same
    dead peer and computes the prompt itself."""
    dead = {"prefill0": dead_url()}
    early = RoutingConfig(binding="early")  # auto would retry it as a skip
    async with routed(
        "kvpush", url_overrides=dead, max_attempts=max_attempts, routing=early
    ) as r:
        (decode,) = r.cluster.decodes
        decode.kv_fallback, decode.kv_wait_s = True, 0.2
        reply = await r.post(PATH, COMPLETION)
        retries = await _metric(r, names.ROUTER_RETRIES, mode="kvpush")
    assert reply.status == 200, reply.body
    assert retries == 0
    assert len(decode.received) == 1


async def test_kvpush_prefill_answering_an_error_still_fails_the_attempt() -> None:
    async with routed("kvpush") as r:
        (prefill,), (decode,) = r.cluster.prefills, r.cluster.decodes
        prefill.fault = Fault(status=400)
        decode.kv_fallback = True
        reply = await r.post(PATH, COMPLETION)
    assert reply.status == 400


async def test_a_client_hanging_up_at_the_end_is_counted_and_its_legs_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the soak: a client closing right after the last byte cancels
    the handler while it closes the legs; the request must still be counted
    finished and every leg closed."""
    from kvpush.router import context

    original = context.Legs.abort
    closed: list[bool] = []

    async def slow_abort(self: context.Legs) -> None:
        await asyncio.sleep(0.2)  # the window the client hangs up in
        await original(self)
        closed.append(True)

    monkeypatch.setattr(context.Legs, "abort", slow_abort)
    async with routed("kvpush") as r:
        host, port = r.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        payload = msgspec.json.encode(STREAM)
        writer.write(
            f"POST {PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        received = b""
        while b"[DONE]" not in received:
            received += await asyncio.wait_for(reader.read(4096), 5)
        writer.close()  # hang up at once, as an HTTP client may
        for _ in range(50):
            in_flight = await _metric(r, names.ROUTER_REQUESTS_IN_FLIGHT, mode="kvpush")
            if in_flight == 0 and closed:
                break
            await asyncio.sleep(0.05)
    assert in_flight == 0
    assert closed == [True]


def test_only_a_broken_connection_counts_as_a_lost_prefill() -> None:
    """kvpush's decode can fall back only when prefill is gone, not when it
    answered with an error (it is alive, and decode would wait it out)."""
    from kvpush.router.errors import bad_gateway
    from kvpush.router.legs import is_connection_lost, leg_failure

    cut = aiohttp.ClientPayloadError("Response payload is not completed")
    try:
        raise leg_failure("prefill", P0, cut) from cut
    except RouterError as e:
        assert is_connection_lost(e)
    assert is_connection_lost(unreachable("prefill", P0, "refused"))
    assert not is_connection_lost(_from_backend(500))
    assert not is_connection_lost(bad_gateway("prefill", P0, "not JSON"))
