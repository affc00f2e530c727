"""kvpush mode's per-request binding through the real router and fake
instances: headers, counters, what each instance received."""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import pytest

from kvpush.router.binding import BindingPolicy
from kvpush.router.config import RoutingConfig
from kvpush.router.prefix import rendezvous_order
from kvpush.telemetry import names
from tests.fakes import Fault, Load, Routed, expected_text, prompt_text, routed
from tests.fakes.metrics import metric

LONG_PROMPT = " ".join(f"word{i}" for i in range(40))  # 40 fake tokens
COMPLETION = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 4}
FAST_SIGNALS = {"signal_interval_s": 0.05, "signal_max_age_s": 1.0}


def _routing(binding: str, **extra: Any) -> RoutingConfig:
    return RoutingConfig(
        binding=binding,  # type: ignore[arg-type]
        block_size=4,
        skip_max_new_tokens=8,
        **{**FAST_SIGNALS, **extra},
    )


def _tokenizing(r: Routed) -> None:
    for fake in r.cluster.fakes:
        fake.serves_tokenize = True


async def _decodes_loaded(r: Routed, load: Load) -> None:
    """Every decode reports ``load``, and the router has read it."""
    for fake in r.cluster.decodes:
        fake.load = load
    await _until_read(r)


def _binding_count(text: str, binding: str, reason: str) -> float:
    return metric(text, names.ROUTER_BINDING, binding=binding, reason=reason) or 0.0


async def _post(r: Routed, body: dict[str, Any], session: str | None = None):
    headers = {"x-session-id": session} if session else None
    reply = await r.post("/v1/completions", body, headers=headers)
    assert reply.status == 200, reply.body
    return reply


@pytest.mark.parametrize("stream", [False, True])
async def test_a_conversations_next_turn_skips_prefill_on_the_same_decode(
    stream: bool,
) -> None:
    async with routed(
        "kvpush", num_prefills=2, num_decodes=2, routing=_routing("auto")
    ) as r:
        _tokenizing(r)
        first = await _post(r, {**COMPLETION, "stream": stream}, session="chat-1")
        assert first.headers["x-kvpush-binding"] == "early"
        decode = first.headers["x-kvpush-decode"]
        assert decode == rendezvous_order("chat-1", ["decode0", "decode1"])[0]
        num_prefill_legs = sum(len(p.received) for p in r.cluster.prefills)
        body = {**COMPLETION, "prompt": LONG_PROMPT + " and five more new words"}
        second = await _post(r, {**body, "stream": stream}, session="chat-1")
        assert second.headers["x-kvpush-binding"] == "skip"
        assert second.headers["x-kvpush-decode"] == decode
        assert sum(len(p.received) for p in r.cluster.prefills) == num_prefill_legs
        served = next(d for d in r.cluster.decodes if d.engine_id == decode)
        last = served.received[-1]
        assert last.kv_transfer_params is None  # a plain request
        if not stream:
            text = second.json()["choices"][0]["text"]
            assert text == expected_text(prompt_text(body), 4)
        metrics = (await r.get("/metrics")).body.decode()
    assert _binding_count(metrics, "early", "new_tokens") == 1
    assert _binding_count(metrics, "skip", "few_new_tokens") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_for_one_token_is_answered_by_a_prefill_alone(
    stream: bool,
) -> None:
    # No decode phase: no decode leg, no KV held or moved, no /tokenize hop.
    body = {**COMPLETION, "max_tokens": 1, "stream": stream}
    async with routed("kvpush", num_decodes=2, routing=_routing("auto")) as r:
        _tokenizing(r)
        reply = await _post(r, body)
        metrics = (await r.get("/metrics")).body.decode()
        (prefill,) = r.cluster.prefills
        (leg,) = prefill.received
        assert [d.received for d in r.cluster.decodes] == [[], []]
        assert [f.tokenized for f in r.cluster.fakes] == [[], [], []]
    assert reply.headers["x-kvpush-binding"] == "prefill"
    assert "x-kvpush-decode" not in reply.headers
    assert leg.body == body  # the client's body: a plain request
    assert leg.path == "/v1/completions"
    if not stream:
        text = reply.json()["choices"][0]["text"]
        assert text == expected_text(LONG_PROMPT, 1)
    else:
        assert expected_text(LONG_PROMPT, 1).encode() in reply.body
    assert _binding_count(metrics, "prefill", "one_token") == 1


async def test_forced_skip_sends_the_client_body_to_decode_alone() -> None:
    async with routed("kvpush", num_decodes=2, routing=_routing("skip")) as r:
        for i in range(4):
            reply = await _post(r, {**COMPLETION, "prompt": f"prompt {i}"})
            assert reply.headers["x-kvpush-binding"] == "skip"
        assert r.cluster.prefills[0].received == []
        assert {d.engine_id: len(d.received) for d in r.cluster.decodes} == {
            "decode0": 2,
            "decode1": 2,
        }  # idle decodes take turns
        assert all(d.tokenized == [] for d in r.cluster.decodes)  # no count needed
        metrics = (await r.get("/metrics")).body.decode()
    assert _binding_count(metrics, "skip", "forced") == 4


async def test_forced_early_sends_both_legs_and_says_so() -> None:
    async with routed("kvpush", routing=_routing("early")) as r:
        reply = await _post(r, {**COMPLETION, "stream": True})
        assert reply.headers["x-kvpush-binding"] == "early"
        assert reply.headers["x-kvpush-decode"] == "decode0"
        assert len(r.cluster.prefills[0].received) == 1


async def test_a_prompt_that_cannot_be_counted_binds_early() -> None:
    async with routed("kvpush", routing=_routing("auto")) as r:  # no /tokenize
        short = {**COMPLETION, "prompt": "two words"}
        reply = await _post(r, short)
        assert reply.headers["x-kvpush-binding"] == "early"
        metrics = (await r.get("/metrics")).body.decode()
    assert _binding_count(metrics, "early", "tokens_unknown") == 1
    assert metric(metrics, names.ROUTER_ERRORS, cause="tokenize_failed") == 1


async def test_a_short_prompt_skips_and_token_ids_need_no_count() -> None:
    async with routed("kvpush", routing=_routing("auto")) as r:
        reply = await _post(r, {**COMPLETION, "prompt": [5, 6, 7]})
        assert reply.headers["x-kvpush-binding"] == "skip"
        assert r.cluster.decodes[0].tokenized == []


async def test_decode_choice_avoids_a_loaded_decode_once_its_load_is_read() -> None:
    async with routed("kvpush", num_decodes=2, routing=_routing("early")) as r:
        r.cluster.decodes[0].load = Load(num_waiting=6, num_running=8, kv_usage=0.5)
        for fake in r.cluster.decodes:
            if fake.load.num_waiting is None:
                fake.load = Load(num_waiting=0, num_running=0)
        await _until_read(r)
        decodes = {
            (await _post(r, COMPLETION)).headers["x-kvpush-decode"] for _ in range(4)
        }
    assert decodes == {"decode1"}


@pytest.mark.parametrize("stream", [False, True])
async def test_forced_late_sends_prefill_first_then_the_claim_to_a_decode(
    stream: bool,
) -> None:
    async with routed("kvpush", num_decodes=2, routing=_routing("late")) as r:
        reply = await _post(r, {**COMPLETION, "stream": stream})
        assert reply.headers["x-kvpush-binding"] == "late"
        decode = next(
            d
            for d in r.cluster.decodes
            if d.engine_id == reply.headers["x-kvpush-decode"]
        )
        [prefill_leg] = r.cluster.prefills[0].received
        [decode_leg] = decode.received
        metrics = (await r.get("/metrics")).body.decode()
    p, d = prefill_leg.kv_transfer_params, decode_leg.kv_transfer_params
    assert p["role"] == "prefill" and p.get("decode_engine_id") is None
    assert d["role"] == "decode" and d["transfer_id"] == p["transfer_id"]
    assert d["prefill_engine_id"] == "prefill0"
    assert hashlib.sha256(d["claim_token"].encode()).hexdigest() == p["claim_sha256"]
    assert d["claim_token"] not in str(prefill_leg.body)  # only its digest
    assert prefill_leg.answered_at is not None
    assert decode_leg.arrived_at >= prefill_leg.answered_at  # chosen after
    if not stream:
        text = reply.json()["choices"][0]["text"]
        assert text == expected_text(prompt_text(COMPLETION), 4)
    assert _binding_count(metrics, "late", "forced") == 1


async def test_late_bound_requests_take_turns_on_idle_decodes() -> None:
    async with routed("kvpush", num_decodes=2, routing=_routing("late")) as r:
        for i in range(4):
            await _post(r, {**COMPLETION, "prompt": f"prompt {i}"})
        counts = {d.engine_id: len(d.received) for d in r.cluster.decodes}
    assert counts == {"decode0": 2, "decode1": 2}


async def test_late_binding_chooses_the_decode_on_the_load_at_prefills_answer() -> None:
    async with routed("kvpush", num_decodes=2, routing=_routing("late")) as r:
        decode0, decode1 = r.cluster.decodes
        decode0.load = Load(num_waiting=0, num_running=0)
        decode1.load = Load(num_waiting=6, num_running=8, kv_usage=0.5)
        r.cluster.prefills[0].load = Load(num_waiting=0, num_running=0)
        await _until_read(r)
        prefill = r.cluster.prefills[0]
        prefill.fault = Fault(delay_s=2.0)
        post = asyncio.create_task(_post(r, COMPLETION))
        await prefill.wait_until(lambda got: len(got) == 1)  # planned: decode0
        decode0.load, decode1.load = decode1.load, decode0.load
        await _until_read(r)
        reply = await post
    assert reply.headers["x-kvpush-decode"] == "decode1"
    assert decode0.received == []


async def test_auto_binds_late_when_every_decode_is_busy() -> None:
    async with routed(
        "kvpush", num_decodes=2, routing=_routing("auto", late_min_busy=4.0)
    ) as r:
        _tokenizing(r)
        await _decodes_loaded(r, Load(num_waiting=0, num_running=6, kv_usage=0.2))
        busy = await _post(r, COMPLETION)
        await _decodes_loaded(r, Load(num_waiting=0, num_running=0))
        other = " ".join(f"other{i}" for i in range(40))  # nothing held
        free = await _post(r, {**COMPLETION, "prompt": other})
        metrics = (await r.get("/metrics")).body.decode()
    assert busy.headers["x-kvpush-binding"] == "late"
    assert free.headers["x-kvpush-binding"] == "early"
    assert _binding_count(metrics, "late", "decode_busy") == 1
    assert _binding_count(metrics, "early", "new_tokens") == 1


async def test_a_late_bound_request_that_ends_at_its_first_token_binds_no_decode() -> (
    None
):
    # Bound late, prefill's first token ends the request (end of sequence):
    # no decode leg is sent, so no decode may be taken to hold the prompt. A
    # next turn then needs prefill again (early), not a skip to that decode.
    async with routed(
        "kvpush", num_decodes=2, routing=_routing("auto", late_min_busy=4.0)
    ) as r:
        _tokenizing(r)
        await _decodes_loaded(r, Load(num_waiting=0, num_running=6, kv_usage=0.2))
        r.cluster.prefills[0].fault = Fault(stops_at_first=True)
        greedy = {**COMPLETION, "stream": True, "temperature": 0.0}
        ended = await _post(r, greedy, session="chat-1")
        assert [d.received for d in r.cluster.decodes] == [[], []]
        r.cluster.prefills[0].fault = Fault()
        await _decodes_loaded(r, Load(num_waiting=0, num_running=0))
        more = {**COMPLETION, "prompt": LONG_PROMPT + " and five more new words"}
        second = await _post(r, more, session="chat-1")
    assert ended.headers["x-kvpush-binding"] == "late"
    assert second.headers["x-kvpush-binding"] == "early"


CHAT = {"model": "m", "messages": [{"role": "user", "content": LONG_PROMPT}]}
PROMPT_LOGPROBS = [  # vLLM 0.32 computes prompt logprobs: it loads no KV
    ("/v1/completions", {**COMPLETION, "prompt_logprobs": 1}),
    ("/v1/completions", {**COMPLETION, "echo": True, "logprobs": 2}),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 0}),
    ("/v1/chat/completions", {**CHAT, "echo": True}),  # top_logprobs 0
]


@pytest.mark.parametrize("binding", ["early", "late", "auto"])
@pytest.mark.parametrize(("path", "body"), PROMPT_LOGPROBS)
async def test_a_request_asking_for_prompt_logprobs_is_served_without_pd_legs(
    binding: str, path: str, body: dict[str, Any]
) -> None:
    """vLLM would skip the pushed KV on decode (``skip_reading_prefix_cache``)
    while prefill computed and held it: decode alone serves it, as a plain
    request, whatever the binding policy, and the decision is counted."""
    async with routed("kvpush", routing=_routing(binding)) as r:
        _tokenizing(r)
        reply = await r.post(path, body)
        assert reply.status == 200, reply.body
        metrics = (await r.get("/metrics")).body.decode()
    assert reply.headers["x-kvpush-binding"] == "skip"
    assert r.cluster.prefills[0].received == [], "no prefill leg"
    (served,) = r.cluster.decodes[0].received
    assert served.body == body, "the client's body, no kv_transfer_params"
    assert r.cluster.decodes[0].tokenized == [], "no prompt count needed"
    assert _binding_count(metrics, "skip", "prompt_logprobs") == 1


async def test_echo_without_logprobs_on_completions_keeps_its_pd_legs() -> None:
    async with routed("kvpush", routing=_routing("early")) as r:
        reply = await _post(r, {**COMPLETION, "echo": True, "logprobs": None})
        assert reply.headers["x-kvpush-binding"] == "early"
        assert len(r.cluster.prefills[0].received) == 1


async def test_a_late_prefill_that_fails_reaches_no_decode() -> None:
    async with routed("kvpush", num_decodes=2, routing=_routing("late")) as r:
        r.cluster.prefills[0].fault = Fault(status=500)
        reply = await r.post("/v1/completions", COMPLETION)
    assert reply.status >= 500
    assert all(d.received == [] for d in r.cluster.decodes)


@pytest.mark.parametrize("binding", ["late", "skip"])
async def test_a_forced_binding_other_than_early_needs_kvpush_mode(
    binding: BindingPolicy,
) -> None:
    with pytest.raises(ValueError, match="needs kvpush mode"):
        async with routed("vllm-push", routing=RoutingConfig(binding=binding)):
            pass


async def test_the_default_binding_is_auto_and_other_modes_bind_early() -> None:
    """kvpush mode decides per request by default; the same default in
    vllm-push mode sends both legs, as that mode always does."""
    assert RoutingConfig().binding == "auto"
    async with routed("vllm-push") as r:
        reply = await r.post("/v1/completions", COMPLETION)
        assert reply.status == 200
        assert len(r.cluster.prefills[0].received) == 1


async def _until_read(r: Routed, timeout_s: float = 10.0) -> None:
    """Until the router has recorded a read of every instance answered
    after this call began: two answers each (the router reads an instance
    again only after it took in the last read)."""
    fakes = [*r.cluster.prefills, *r.cluster.decodes]
    wanted = [f.metrics_served + 2 for f in fakes]
    deadline = time.monotonic() + timeout_s
    while any(f.metrics_served < n for f, n in zip(fakes, wanted, strict=True)):
        assert time.monotonic() < deadline, "the router read no fresh /metrics"
        await asyncio.sleep(0.01)
