"""The router's three flows, end to end against fake vLLM backends.

Each test starts fake backends and a real router (``tests.fakes.routed``)
and checks what the client got and what each backend received.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from tests.fakes import Fault, Routed, expected_text, prompt_text, routed

PROMPT = "the quick brown fox"
COMPLETION = {"model": "m", "prompt": PROMPT, "max_tokens": 5}
CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": PROMPT}],
    "max_completion_tokens": 4,
}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
BODIES = {"completions": COMPLETION, "chat": CHAT}


def _streaming(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


def _text_of(endpoint: str, reply_json: dict[str, Any]) -> str:
    choice = reply_json["choices"][0]
    return choice["message"]["content"] if endpoint == "chat" else choice["text"]


def _streamed_text(endpoint: str, events: list[bytes]) -> str:
    parts = []
    for event in events[:-1]:
        for choice in msgspec.json.decode(event)["choices"]:
            if endpoint == "chat":
                parts.append(choice["delta"].get("content", ""))
            else:
                parts.append(choice["text"])
    return "".join(parts)


def _expected(body: dict[str, Any]) -> str:
    limit = body.get("max_completion_tokens") or body["max_tokens"]
    return expected_text(prompt_text(body), limit)


async def _check_reply(r: Routed, endpoint: str, body: dict[str, Any]) -> None:
    """Send ``body`` and check the client got decode's full answer with usage."""
    reply = await r.post(PATHS[endpoint], body)
    assert reply.status == 200, reply.body
    if body.get("stream"):
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        events = reply.events()
        assert events[-1] == b"[DONE]"
        usage = msgspec.json.decode(events[-2])
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
        assert _streamed_text(endpoint, events) == _expected(body)
    else:
        answer = reply.json()
        assert _text_of(endpoint, answer) == _expected(body)
        assert answer["usage"]["total_tokens"] > 0
        assert "kv_transfer_params" not in answer


# -- colocated ---------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("is_stream", [False, True])
async def test_colocated_passes_body_and_answer_through(
    endpoint: str, is_stream: bool
) -> None:
    body = _streaming(BODIES[endpoint]) if is_stream else BODIES[endpoint]
    async with routed("colocated") as r:
        await _check_reply(r, endpoint, body)
        (received,) = r.cluster.colocated[0].received
        assert received.path == PATHS[endpoint]
        assert received.body == body


# -- vLLM pull -----------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("is_stream", [False, True])
async def test_pull_prefills_one_token_then_decodes_with_returned_params(
    endpoint: str, is_stream: bool
) -> None:
    body = _streaming(BODIES[endpoint]) if is_stream else BODIES[endpoint]
    async with routed("vllm-pull") as r:
        await _check_reply(r, endpoint, body)
        (prefill,) = r.cluster.prefills[0].received
        (decode,) = r.cluster.decodes[0].received

    assert prefill.body["max_tokens"] == 1
    assert prefill.body["stream"] is False
    assert "stream_options" not in prefill.body
    assert "max_completion_tokens" not in prefill.body
    assert prefill.kv_transfer_params == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert prefill.answer is not None
    assert decode.body == {
        **body,
        "kv_transfer_params": prefill.answer["kv_transfer_params"],
    }
    assert prefill.answered_at is not None and decode.arrived_at >= prefill.answered_at
    assert decode.request_id == prefill.request_id


# -- vLLM push -----------------------------------------------------------------


@pytest.mark.parametrize("late_role", ["prefill", "decode"])
@pytest.mark.parametrize("is_stream", [False, True])
async def test_push_sends_both_legs_at_once_in_either_arrival_order(
    late_role: str, is_stream: bool
) -> None:
    body = _streaming(COMPLETION) if is_stream else COMPLETION
    async with routed("vllm-push") as r:
        prefill_fake, decode_fake = r.cluster.prefills[0], r.cluster.decodes[0]
        late = prefill_fake if late_role == "prefill" else decode_fake
        late.fault = Fault(arrival_delay_s=0.2)
        await _check_reply(r, "completions", body)
        (prefill,) = prefill_fake.received
        (decode,) = decode_fake.received

    first, second = (decode, prefill) if late_role == "prefill" else (prefill, decode)
    assert first.arrived_at < second.arrived_at
    assert prefill.request_id == decode.request_id is not None
    assert prefill.body["max_tokens"] == 1 and prefill.body["stream"] is False
    assert prefill.kv_transfer_params["do_remote_decode"] is True
    assert decode.body == {
        **body,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "prefill0",
            "remote_request_id": prefill.request_id,
            "remote_host": "127.0.0.1",
            "remote_port": prefill_fake.side_channel_port,
            "tp_size": 1,
        },
    }


@pytest.mark.parametrize("late_role", ["prefill", "decode"])
async def test_kvpush_pairs_legs_by_one_fresh_transfer_id(late_role: str) -> None:
    async with routed("kvpush") as r:
        prefill_fake, decode_fake = r.cluster.prefills[0], r.cluster.decodes[0]
        late = prefill_fake if late_role == "prefill" else decode_fake
        late.fault = Fault(arrival_delay_s=0.2)
        for _ in range(2):
            await _check_reply(r, "completions", _streaming(COMPLETION))
        prefills, decodes = prefill_fake.received, decode_fake.received

    first, second = (
        (decodes, prefills) if late_role == "prefill" else (prefills, decodes)
    )
    assert first[0].arrived_at < second[0].arrived_at
    ids = [p.kv_transfer_params["transfer_id"] for p in prefills]
    assert len(set(ids)) == 2  # one per request, never reused
    for prefill, decode in zip(prefills, decodes, strict=True):
        assert prefill.body["max_tokens"] == 1 and prefill.body["stream"] is False
        assert prefill.kv_transfer_params == {
            "role": "prefill",
            "transfer_id": prefill.kv_transfer_params["transfer_id"],
            "decode_engine_id": "decode0",
        }
        assert decode.kv_transfer_params == {
            "role": "decode",
            "transfer_id": prefill.kv_transfer_params["transfer_id"],
            "prefill_engine_id": "prefill0",
            "prefill_host": "127.0.0.1",
            "prefill_port": prefill_fake.side_channel_port,
        }


async def test_push_legs_overlap_in_time() -> None:
    """Decode is sent while prefill is still computing, not after it."""
    async with routed("vllm-push") as r:
        r.cluster.prefills[0].fault = Fault(delay_s=0.2)
        await _check_reply(r, "chat", CHAT)
        (prefill,) = r.cluster.prefills[0].received
        (decode,) = r.cluster.decodes[0].received
    assert prefill.answered_at is not None
    assert decode.arrived_at < prefill.answered_at


# -- request ids and selection -----------------------------------------------


@pytest.mark.parametrize("mode", ["colocated", "vllm-pull", "vllm-push"])
async def test_client_request_id_goes_to_every_leg_and_back(mode: str) -> None:
    async with routed(mode) as r:
        replies = [
            await r.post(PATHS["completions"], COMPLETION, {"X-Request-Id": "abc-1"})
            for _ in range(2)
        ]
        assert [reply.status for reply in replies] == [200, 200]
        assert [reply.headers["X-Request-Id"] for reply in replies] == ["abc-1"] * 2
        received = [rec for fake in r.cluster.fakes for rec in fake.received]
    # Every leg carries the client's id plus a suffix unique to the request,
    # so two requests reusing one client id are never paired with each other.
    ids = {rec.request_id for rec in received}
    assert len(ids) == 2
    assert all(i.startswith("abc-1.") for i in ids)


async def test_router_makes_a_fresh_request_id_per_request() -> None:
    async with routed("vllm-push") as r:
        replies = [await r.post(PATHS["completions"], COMPLETION) for _ in range(2)]
        ids = [reply.headers["X-Request-Id"] for reply in replies]
        decode_ids = [rec.request_id for rec in r.cluster.decodes[0].received]
    assert len(set(ids)) == 2 and all(len(i) == 32 for i in ids)
    assert decode_ids == ids


@pytest.mark.parametrize("mode", ["vllm-pull", "vllm-push"])
async def test_round_robin_over_two_prefills_and_two_decodes(mode: str) -> None:
    async with routed(mode, num_prefills=2, num_decodes=2) as r:
        for i in range(4):
            body = {**COMPLETION, "prompt": f"prompt number {i}"}
            assert (await r.post(PATHS["completions"], body)).status == 200
        seen = {
            f.engine_id: [rec.body["prompt"] for rec in f.received]
            for f in r.cluster.fakes
        }
    assert seen == {
        "prefill0": ["prompt number 0", "prompt number 2"],
        "prefill1": ["prompt number 1", "prompt number 3"],
        "decode0": ["prompt number 0", "prompt number 2"],
        "decode1": ["prompt number 1", "prompt number 3"],
    }


async def test_concurrent_push_requests_are_paired_by_request_id() -> None:
    async with routed("vllm-push", num_prefills=2, num_decodes=2) as r:
        bodies = [{**COMPLETION, "prompt": f"words for request {i}"} for i in range(6)]
        replies = await asyncio.gather(
            *(r.post(PATHS["completions"], b) for b in bodies)
        )
    for body, reply in zip(bodies, replies, strict=True):
        assert reply.status == 200
        assert reply.json()["choices"][0]["text"] == _expected(body)


def test_a_vllm_push_decode_leg_names_prefills_tp() -> None:
    # vLLM's push connector maps KV heads by the prefill's TP size; naming 1
    # for a TP 2 prefill made decode's handshake fail on the block sizes.
    from kvpush.router.requests import PushDecodeParams
    from kvpush.topology import Backend

    prefill = Backend(
        role="prefill",
        url="http://127.0.0.1:8100",
        engine_id="prefill0",
        side_channel_host="127.0.0.1",
        side_channel_port=5600,
        tp_size=2,
    )
    assert PushDecodeParams.for_prefill(prefill, "r1").tp_size == 2
