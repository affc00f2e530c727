"""The first token from prefill (``first_token.py``, ``first_token_flow.py``).

End to end against fake vLLM backends (``tests.fakes``), whose tokens are
the prompt's words upper-cased, one id per word (``fake_tokens``), and pure
tests of the stream rewriting.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from kvpush.router.config import FirstTokenFrom, RoutingConfig
from kvpush.router.first_token import (
    Continuation,
    DecodeEcho,
    Diverged,
    FirstToken,
    Progress,
    blocker,
    continuation_body,
    leg_fields,
    opening_events,
)
from kvpush.router.requests import parse_request
from kvpush.telemetry import names
from tests.fakes import Fault, Routed, expected_text, fake_tokens, routed
from tests.fakes.metrics import metric

PROMPT = "the quick brown fox"
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
EARLY = RoutingConfig(binding="early")
LATE = RoutingConfig(binding="late")


def _body(endpoint: str, max_tokens: int = 5, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "max_tokens": max_tokens, "stream": True}
    body["temperature"] = 0.0
    body["stream_options"] = {"include_usage": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    return {**body, **extra}


def _chunks(reply_events: list[bytes]) -> list[dict[str, Any]]:
    assert reply_events[-1] == b"[DONE]"
    return [msgspec.json.decode(e) for e in reply_events[:-1]]


def _text(endpoint: str, chunks: list[dict[str, Any]]) -> str:
    parts = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            if endpoint == "chat":
                parts.append(choice["delta"].get("content") or "")
            else:
                parts.append(choice["text"])
    return "".join(parts)


def _usage(chunks: list[dict[str, Any]]) -> dict[str, int]:
    (usage,) = [c["usage"] for c in chunks if not c["choices"]]
    return usage


async def _first_token_count(r: Routed, outcome: str) -> float | None:
    text = (await r.get("/metrics")).body.decode()
    return metric(text, names.ROUTER_FIRST_TOKEN, outcome=outcome)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("routing", [EARLY, LATE], ids=["early", "late"])
async def test_the_client_reads_decodes_answer_with_the_first_token_from_prefill(
    endpoint: str, routing: RoutingConfig
) -> None:
    body = _body(endpoint)
    async with routed("kvpush", routing=routing) as r:
        reply = await r.post(PATHS[endpoint], body)
        served = await _first_token_count(r, "prefill")
        (prefill,) = r.cluster.prefills[0].received
        (decode,) = r.cluster.decodes[0].received
    assert reply.status == 200, reply.body
    chunks = _chunks(reply.events())
    assert _text(endpoint, chunks) == expected_text(PROMPT, 5)
    assert served == 1
    # both legs asked for token ids; the client, who did not, gets none
    assert prefill.body["return_token_ids"] is True
    assert decode.body["return_token_ids"] is True
    assert b"token_ids" not in reply.body
    # one stream, as decode alone would have sent it: its id, one role event
    assert {c["id"] for c in chunks} == {f"cmpl-{decode.request_id}"}
    if endpoint == "chat":
        roles = [c["choices"][0]["delta"].get("role") for c in chunks if c["choices"]]
        assert roles.count("assistant") == 1 and roles[0] == "assistant"
    assert _usage(chunks)["completion_tokens"] == 5  # decode's count, t1 included


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_the_first_token_reaches_the_client_while_decode_has_not_answered(
    endpoint: str,
) -> None:
    async with routed("kvpush", routing=EARLY) as r:
        r.cluster.decodes[0].fault = Fault(hang_after_chunks=0)  # opens, then hangs
        async with r.http.post(r.url + PATHS[endpoint], json=_body(endpoint)) as resp:
            assert resp.status == 200
            first = b""
            while b" THE" not in first:  # t1 is the first word, upper-cased
                first += await asyncio.wait_for(resp.content.readany(), 5.0)
        (decode,) = r.cluster.decodes[0].received
    assert decode.answered_at is None  # decode sent no event at all


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_a_decode_that_diverges_is_continued_from_the_first_token(
    endpoint: str,
) -> None:
    async with routed("kvpush", routing=EARLY) as r:
        r.cluster.decodes[0].fault = Fault(diverge=True)
        reply = await r.post(PATHS[endpoint], _body(endpoint))
        continued = await _first_token_count(r, "continued")
        leg, continuation = r.cluster.decodes[0].received
    assert reply.status == 200, reply.body
    chunks = _chunks(reply.events())
    t1_id = fake_tokens("THE")[0]
    assert continuation.path == "/v1/completions"
    assert continuation.body["prompt"] == [*fake_tokens(PROMPT), t1_id]
    assert continuation.body["max_tokens"] == 4
    assert "kv_transfer_params" not in continuation.body
    # the client reads t1, then the continuation's output, never DIVERGED
    rest = expected_text(str(continuation.body["prompt"]), 4)
    assert _text(endpoint, chunks) == " THE" + rest
    assert b"DIVERGED" not in reply.body
    assert _usage(chunks) == {
        "prompt_tokens": len(fake_tokens(PROMPT)),
        "completion_tokens": 5,
        "total_tokens": len(fake_tokens(PROMPT)) + 5,
    }
    assert {c["id"] for c in chunks} == {f"cmpl-{leg.request_id}"}
    assert continued == 1


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_a_decode_killed_after_the_first_token_is_continued_on_another(
    endpoint: str,
) -> None:
    async with routed("kvpush", num_decodes=2, routing=EARLY) as r:
        first, second = r.cluster.decodes
        # the decode drops its connection after its first events (chat: role)
        events = 3 if endpoint == "chat" else 2
        for decode in (first, second):
            decode.fault = Fault(reset_after_chunks=events, legs_only=True)
        reply = await r.post(PATHS[endpoint], _body(endpoint))
    assert reply.status == 200, reply.body
    chunks = _chunks(reply.events())
    failed, other = (first, second) if first.received[:1] else (second, first)
    (leg,) = failed.received
    (continuation,) = other.received  # not on the decode that failed
    assert leg.kv_transfer_params is not None
    assert continuation.path == "/v1/completions"
    # t1 and the one token relayed after it are the continuation's prompt end
    assert continuation.body["prompt"] == [
        *fake_tokens(PROMPT),
        *fake_tokens("THE QUICK"),
    ]
    assert continuation.body["max_tokens"] == 3
    rest = expected_text(str(continuation.body["prompt"]), 3)
    assert _text(endpoint, chunks) == " THE QUICK" + rest
    assert _usage(chunks)["completion_tokens"] == 5
    assert b'"error"' not in reply.body


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_a_late_bound_decode_is_sent_a_continuation_from_the_first_token(
    endpoint: str,
) -> None:
    # Bound after prefill answered, decode's leg already ends with t1: the
    # KV of the prompt before it is pushed, and decode's first step computes
    # t1 and samples the second token (no step spent on a copy of t1).
    async with routed("kvpush", routing=LATE) as r:
        reply = await r.post(PATHS[endpoint], _body(endpoint))
        served = await _first_token_count(r, "prefill")
        (prefill,) = r.cluster.prefills[0].received
        (decode,) = r.cluster.decodes[0].received
    assert reply.status == 200, reply.body
    prompt_ids = fake_tokens(PROMPT)
    assert decode.path == "/v1/completions"
    assert decode.body["prompt"] == [*prompt_ids, fake_tokens("THE")[0]]
    assert decode.body["max_tokens"] == 4
    params = decode.kv_transfer_params
    assert params["num_kv_tokens"] == len(prompt_ids)
    assert params["claim_token"] and params["transfer_id"]
    assert decode.continues == PROMPT  # the fake paired it with prefill's KV
    chunks = _chunks(reply.events())
    assert _text(endpoint, chunks) == expected_text(PROMPT, 5)
    assert _usage(chunks) == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 5,
        "total_tokens": len(prompt_ids) + 5,
    }
    assert {c["id"] for c in chunks} == {f"cmpl-{prefill.request_id}"}
    assert served == 1


async def test_a_late_bound_decode_killed_mid_stream_is_continued_on_another() -> None:
    async with routed("kvpush", num_decodes=2, routing=LATE) as r:
        first, second = r.cluster.decodes
        for decode in (first, second):  # drops its connection after one event
            decode.fault = Fault(reset_after_chunks=1, legs_only=True)
        reply = await r.post(PATHS["completions"], _body("completions"))
        continued = await _first_token_count(r, "continued")
    assert reply.status == 200, reply.body
    failed, other = (first, second) if first.received[:1] else (second, first)
    (leg,) = failed.received
    (continuation,) = other.received
    assert leg.kv_transfer_params["num_kv_tokens"] == len(fake_tokens(PROMPT))
    assert "kv_transfer_params" not in continuation.body
    # t1 and the token the failed decode sent after it end the new prompt
    assert continuation.body["prompt"] == [
        *fake_tokens(PROMPT),
        *fake_tokens("THE QUICK"),
    ]
    assert continuation.body["max_tokens"] == 3
    chunks = _chunks(reply.events())
    rest = expected_text(str(continuation.body["prompt"]), 3)
    assert _text("completions", chunks) == " THE QUICK" + rest
    assert _usage(chunks)["completion_tokens"] == 5
    assert continued == 1


async def test_the_token_ids_a_client_asked_for_follow_its_text() -> None:
    body = _body("completions", return_token_ids=True)
    async with routed("kvpush", routing=EARLY) as r:
        reply = await r.post(PATHS["completions"], body)
    chunks = _chunks(reply.events())
    ids = [i for c in chunks for choice in c["choices"] for i in choice["token_ids"]]
    prompt_ids = [
        choice["prompt_token_ids"]
        for c in chunks
        for choice in c["choices"]
        if "prompt_token_ids" in choice
    ]
    assert ids == fake_tokens(expected_text(PROMPT, 5))
    assert prompt_ids == [fake_tokens(PROMPT)]  # once, with the first token


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_a_request_for_one_token_is_answered_from_prefill_and_decode_aborted(
    endpoint: str,
) -> None:
    async with routed("kvpush", routing=EARLY) as r:
        r.cluster.decodes[0].fault = Fault(hang_after_chunks=0)
        reply = await r.post(PATHS[endpoint], _body(endpoint, max_tokens=1))
        await r.cluster.decodes[0].wait_until(lambda rs: rs[0].is_cancelled)
        ended = await _first_token_count(r, "ended")
    chunks = _chunks(reply.events())
    assert _text(endpoint, chunks) == " THE"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    assert _usage(chunks)["completion_tokens"] == 1
    assert ended == 1


async def test_a_late_bound_request_that_stops_at_its_first_token_ends_there() -> None:
    # Bound late, prefill's first token is end-of-sequence: the client's
    # request is whole, no decode leg is sent, and prefill's leg said so
    # beforehand, so that prefill drops its KV at once.
    async with routed("kvpush", routing=LATE) as r:
        r.cluster.prefills[0].fault = Fault(stops_at_first=True)
        reply = await r.post(PATHS["completions"], _body("completions"))
        ended = await _first_token_count(r, "ended")
        (prefill,) = r.cluster.prefills[0].received
        decode_legs = r.cluster.decodes[0].received
    chunks = _chunks(reply.events())
    assert _text("completions", chunks) == " THE"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == [
        "stop"
    ]
    assert ended == 1 and decode_legs == []
    assert prefill.kv_transfer_params["ends_if_stopped"] is True
    assert reply.headers["x-kvpush-binding"] == "late"
    assert "x-kvpush-decode" not in reply.headers  # none was chosen


async def test_a_late_bound_request_for_one_token_says_so_to_prefill() -> None:
    # Forced late, a request for one token is whole at prefill's first
    # token whatever its finish reason: the leg says so, so that prefill
    # drops its KV at once (before: only a "stop" did, and a "length" held
    # the KV to the ready deadline), and no decode is chosen.
    async with routed("kvpush", routing=LATE) as r:
        reply = await r.post(PATHS["completions"], _body("completions", max_tokens=1))
        (prefill,) = r.cluster.prefills[0].received
        decode_legs = r.cluster.decodes[0].received
    chunks = _chunks(reply.events())
    assert _text("completions", chunks) == " THE"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == [
        "length"
    ]
    assert decode_legs == []
    assert prefill.kv_transfer_params["ends_at_first_token"] is True
    assert "x-kvpush-decode" not in reply.headers


async def test_a_late_leg_whose_first_token_is_decodes_does_not_end_if_stopped() -> (
    None
):
    routing = RoutingConfig(binding="late", first_token_from=FirstTokenFrom.DECODE)
    async with routed("kvpush", routing=routing) as r:
        reply = await r.post(PATHS["completions"], _body("completions"))
        (prefill,) = r.cluster.prefills[0].received
    assert reply.status == 200
    assert not prefill.kv_transfer_params.get("ends_if_stopped")
    assert not prefill.kv_transfer_params.get("ends_at_first_token")


@pytest.mark.parametrize(
    ("routing", "extra"),
    [
        (RoutingConfig(binding="early", first_token_from=FirstTokenFrom.DECODE), {}),
        (EARLY, {"stop": ["fox"]}),
        (EARLY, {"temperature": 1.0}),
        (EARLY, {"stream": False}),
    ],
    ids=["option-decode", "stop-strings", "sampled-unseeded", "not-streamed"],
)
async def test_requests_it_cannot_serve_exactly_get_decodes_first_token(
    routing: RoutingConfig, extra: dict[str, Any]
) -> None:
    async with routed("kvpush", routing=routing) as r:
        reply = await r.post(PATHS["completions"], _body("completions", **extra))
        (prefill,) = r.cluster.prefills[0].received
        (decode,) = r.cluster.decodes[0].received
    assert reply.status == 200
    assert "return_token_ids" not in prefill.body
    assert "return_token_ids" not in decode.body


# -- pure: the rules and the rewriting ------------------------------------------


def _parsed(endpoint: str, **extra: Any) -> Any:
    raw = msgspec.json.encode(_body(endpoint, **extra))
    return parse_request(raw, "chat" if endpoint == "chat" else "completions", True)


def _first(text: str = " THE", token_id: int = 7) -> FirstToken:
    return FirstToken(
        token_id=token_id,
        prompt_token_ids=[1, 2, 3],
        text=text,
        logprobs=None,
        finish_reason="length",
        stop_reason=None,
        id="cmpl-x",
        created=5,
        model="m",
        usage=None,
    )


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


def test_blocker_names_what_a_streamed_first_token_cannot_follow() -> None:
    assert blocker(_parsed("completions")) is None
    assert blocker(_parsed("chat")) is None
    assert blocker(_parsed("completions", stream=False)) == "not streamed"
    assert blocker(_parsed("completions", n=2, temperature=1.0)) == "n > 1"
    assert blocker(_parsed("completions", stop="x")) == "stop strings hold text back"
    assert blocker(_parsed("completions", prompt=["a", "b"])) == "a batch of prompts"
    assert blocker(_parsed("completions", prompt=[1, 2])) is None
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert "tool" in str(blocker(_parsed("chat", tools=tools)))
    assert blocker(_parsed("chat", response_format={"type": "text"})) is None
    assert blocker(_parsed("chat", response_format={"type": "json_object"})) == (
        "structured output"
    )


def test_a_sampled_request_needs_its_own_seed_and_gets_none_added() -> None:
    sampled = "sampled without a seed (decode would sample its own first token)"
    assert blocker(_parsed("completions", temperature=0.8)) == sampled
    assert blocker(_parsed("completions", temperature=None)) == sampled
    assert blocker(_parsed("completions", temperature=0.8, seed=3)) is None
    assert leg_fields(_parsed("completions", temperature=0.8, seed=3)) == {
        "return_token_ids": True
    }


def test_echo_drops_t1_from_a_coalesced_event_with_its_logprob() -> None:
    echo = DecodeEcho(_parsed("completions"), _first())
    logprobs = {
        "tokens": [" THE", " QUICK"],
        "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{" THE": -0.1}, {" QUICK": -0.2}],
        "text_offset": [0, 4],
    }
    choice = {"index": 0, "text": " THE QUICK", "token_ids": [7, 8]}
    choice.update(logprobs=logprobs, finish_reason=None)
    data = _event({"id": "cmpl-x", "choices": [choice]})
    out = echo.feed(data[:10]) + echo.feed(data[10:])  # split mid-event
    (chunk,) = [msgspec.json.decode(e[6:]) for e in out.split(b"\n\n") if e]
    (rest,) = chunk["choices"]
    assert rest["text"] == " QUICK" and "token_ids" not in rest
    assert rest["logprobs"] == {
        "tokens": [" QUICK"],
        "token_logprobs": [-0.2],
        "top_logprobs": [{" QUICK": -0.2}],
        "text_offset": [4],
    }
    assert echo.progress.token_ids == [8] and echo.progress.text_len == 6


def test_echo_refuses_another_first_token_and_a_first_text_without_ids() -> None:
    other = {"index": 0, "text": " A", "token_ids": [9], "finish_reason": None}
    with pytest.raises(Diverged, match="first token 9 is not 7"):
        DecodeEcho(_parsed("completions"), _first()).feed(_event({"choices": [other]}))
    same_id = {"index": 0, "text": " A", "token_ids": [7], "finish_reason": None}
    with pytest.raises(Diverged, match="does not start with"):
        DecodeEcho(_parsed("completions"), _first()).feed(
            _event({"choices": [same_id]})
        )
    no_ids = {"index": 0, "delta": {"content": " THE"}, "finish_reason": None}
    with pytest.raises(Diverged, match="no token ids"):
        DecodeEcho(_parsed("chat"), _first()).feed(_event({"choices": [no_ids]}))
    error = _event({"error": {"message": "boom"}})
    with pytest.raises(Diverged, match="boom"):
        DecodeEcho(_parsed("chat"), _first()).feed(error)


def test_continuation_asks_for_the_rest_as_token_ids_with_the_clients_sampling() -> (
    None
):
    parsed = _parsed("chat", max_tokens=None, max_completion_tokens=6, logprobs=True)
    parsed.body["top_logprobs"] = 2
    progress = Progress(token_ids=[8, 9], text_len=12)
    body = msgspec.json.decode(continuation_body(parsed, _first(), progress))
    assert body["prompt"] == [1, 2, 3, 7, 8, 9]
    assert body["max_tokens"] == 3 and "max_completion_tokens" not in body
    assert body["logprobs"] == 2 and "top_logprobs" not in body
    assert "messages" not in body and body["stream"] is True


def test_continuation_events_read_as_the_rest_of_the_clients_chat_stream() -> None:
    parsed = _parsed("chat", logprobs=True)
    rewrite = Continuation(parsed, _first(), Progress(token_ids=[8], text_len=6))
    logprobs = {
        "tokens": [" FOX"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{" FOX": -0.5, " DOG": -1.5}],
        "text_offset": [0],
    }
    choice = {"index": 0, "text": " FOX", "token_ids": [10], "logprobs": logprobs}
    choice.update(finish_reason="length", stop_reason=None)
    usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    out = rewrite.feed(
        _event({"id": "cmpl-other", "choices": [choice]})
        + _event({"id": "cmpl-other", "choices": [], "usage": usage})
        + b"data: [DONE]\n\n"
    )
    text, usage_event, done = (e for e in out.split(b"\n\n") if e)
    chunk = msgspec.json.decode(text[6:])
    assert chunk["id"] == "cmpl-x" and chunk["object"] == "chat.completion.chunk"
    (rest,) = chunk["choices"]
    assert rest["delta"] == {"content": " FOX"} and rest["finish_reason"] == "length"
    assert "token_ids" not in rest
    (entry,) = rest["logprobs"]["content"]
    assert entry["token"] == " FOX" and entry["logprob"] == -0.5
    assert [t["token"] for t in entry["top_logprobs"]] == [" FOX", " DOG"]
    # the original prompt's tokens; t1 and the one after it count as output
    assert msgspec.json.decode(usage_event[6:])["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
    }
    assert done == b"data: [DONE]"


def test_continuation_shifts_completion_text_offsets_past_the_text_sent() -> None:
    rewrite = Continuation(
        _parsed("completions"), _first(), Progress(token_ids=[8], text_len=6)
    )
    logprobs = {"tokens": [" FOX"], "token_logprobs": [-0.5], "text_offset": [0]}
    choice = {"index": 0, "text": " FOX", "logprobs": logprobs, "finish_reason": None}
    out = rewrite.feed(_event({"choices": [choice]}))
    (rest,) = msgspec.json.decode(out.strip()[6:])["choices"]
    assert rest["logprobs"]["text_offset"] == [10]  # " THE" (4) + 6 relayed


def test_continuation_counts_what_it_relays_after_what_the_client_had() -> None:
    had = Progress(token_ids=[8], text_len=6)
    rewrite = Continuation(_parsed("completions"), _first(), had)
    fox = {"index": 0, "text": " FOX", "token_ids": [9], "finish_reason": None}
    end = {"index": 0, "text": " END", "token_ids": [10], "finish_reason": "length"}
    rewrite.feed(_event({"choices": [fox]}) + _event({"choices": [end]}))
    assert rewrite.progress == Progress([8, 9, 10], 14, is_finished=True)
    rewrite.feed(b"data: [DONE]\n\n")
    assert rewrite.progress.is_done
    assert had == Progress(token_ids=[8], text_len=6)  # the caller's is untouched


def test_only_stripping_ids_passes_errors_and_odd_events_through() -> None:
    echo = DecodeEcho(_parsed("completions"), None)
    error = _event({"error": {"message": "boom"}})
    assert echo.feed(error) == error
    assert echo.feed(b"data: not json\n\n") == b"data: not json\n\n"
    choice = {"index": 0, "text": " A", "token_ids": [9], "finish_reason": None}
    (out,) = [e for e in echo.feed(_event({"choices": [choice]})).split(b"\n\n") if e]
    assert msgspec.json.decode(out[6:])["choices"] == [
        {"index": 0, "text": " A", "finish_reason": None}
    ]


def test_a_chat_that_continues_its_last_message_opens_with_that_role() -> None:
    parsed = _parsed("chat", add_generation_prompt=False)
    parsed.body["messages"] = [{"role": "user", "content": "hi"}]
    opening = opening_events(_first(), parsed)
    first = msgspec.json.decode(opening.split(b"\n\n")[0][6:])
    assert first["choices"][0]["delta"] == {"role": "user", "content": ""}
