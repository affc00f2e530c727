"""vLLM's own P/D request protocol, spoken by kvpush's connector.

Routers written for vLLM's NixlConnector put ``do_remote_decode`` on the
prefill leg and ``do_remote_prefill`` plus prefill's answer on the decode
leg. kvpush serves these as late-bound transfers: the claim is a secret
prefill draws (or the router's ``transfer_id``), prefill's answer carries
it, the decode registers with it, and the transfer id both sides use is a
digest of it. Translation first, then the two schedulers, then the claim
end to end through a real prefill writer: claimed once, a forged or
replayed claim gets nothing (a forged one of the form prefill draws is
refused at once).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import msgspec
import pytest

from kvpush.connector.counters import Counters
from kvpush.connector.decode.scheduler import DecodeScheduler
from kvpush.connector.legs import Legs
from kvpush.connector.prefill.fence import NoFence
from kvpush.connector.prefill.scheduler import PrefillScheduler
from kvpush.connector.vllm_params import (
    TRANSFER_ID_PREFIX,
    VllmPrefill,
    parse,
    speaks_vllm,
    transfer_id_of,
)
from kvpush.transfer.groups import one
from kvpush.transfer.matcher import PREFILL_CLAIM_PREFIX, ReadyKv
from kvpush.transfer.messages import (
    Cancel,
    Cause,
    DecodeLeg,
    Done,
    Failure,
    PrefillLeg,
    Registration,
    TransferParams,
    claim_digest,
    encode,
)
from kvpush.transfer.messages import decode as decode_message
from tests.fakes.fake_nixl import FakePeers, leftovers, wait_for
from tests.unit.test_connector_scheduler import (
    DECODE_PARAMS,
    PREFILL_PARAMS,
    PROMPT,
    FakeBlocks,
    FakeRequest,
    SchedulerOutput,
    admit,
    cached,
    config_for,
    new,
    run_step,
)
from tests.unit.test_connector_writer import BOOT, DECODE, DECODE_ROUTE
from tests.unit.test_connector_writer_late import D1, D1_ROUTE, LateRig
from tests.unit.test_connector_writer_stream import blocks_of

# What vLLM's proxies send the prefill leg (toy_proxy_server.py and
# toy_push_proxy_server.py alike).
VLLM_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
CLAIM = "c" * 43  # what secrets.token_urlsafe(32) looks like
PUSH_PROXY_FIELDS = (
    "remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size",
)  # fmt: skip


def answer_for(claim: str = CLAIM, **extra: Any) -> dict[str, Any]:
    """Prefill p0's answer (config_for("prefill")) for ``claim``."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "p0",
        "remote_host": "127.0.0.1",
        "remote_port": 5601,
        "tp_size": 1,
        "remote_request_id": claim,
        "transfer_mode": "push",
        **extra,
    }


def push_proxy(answer: dict[str, Any]) -> dict[str, Any]:
    """The decode params vLLM's push proxy builds from prefill's answer."""
    kept = {name: answer.get(name) for name in PUSH_PROXY_FIELDS}
    return {"do_remote_prefill": True, "do_remote_decode": False, **kept}


# -- translation -----------------------------------------------------------------


def test_a_pull_proxys_prefill_leg_is_late_bound_to_a_fresh_claim() -> None:
    first, second = parse(VLLM_PREFILL), parse(VLLM_PREFILL)

    assert isinstance(first, VllmPrefill) and isinstance(second, VllmPrefill)
    assert first.claim != second.claim, "a fresh claim per leg"
    assert not first.is_router_set
    assert first.leg == PrefillLeg(
        transfer_id=transfer_id_of(first.claim),
        claim_sha256=claim_digest(first.claim),
    )
    assert first.leg.is_late and first.leg.decode_engine_id is None


def test_prefill_draws_claims_of_a_form_no_router_may_use() -> None:
    """The prefix marks a claim as prefill's own; 256 random bits follow;
    it is still a claim token on the wire."""
    claim = parse(VLLM_PREFILL).claim  # type: ignore[union-attr]

    assert claim.startswith(PREFILL_CLAIM_PREFIX)
    assert len(claim) == len(PREFILL_CLAIM_PREFIX) + 43  # token_urlsafe(32)
    reg = Registration("t1", "d0", "b0", one((1,)), 16, 10.0, claim_token=claim)
    assert decode_message(encode(reg)) == reg


def test_a_routers_transfer_id_with_prefills_claim_prefix_is_refused() -> None:
    tid = PREFILL_CLAIM_PREFIX + uuid.uuid4().hex

    with pytest.raises(ValueError, match="transfer_id starts with") as info:
        parse({**VLLM_PREFILL, "transfer_id": tid})

    assert repr(PREFILL_CLAIM_PREFIX) in str(info.value), "names the prefix"
    assert tid not in str(info.value), "a claim is never logged"


@pytest.mark.parametrize(
    "tid",
    [uuid.uuid4().hex, str(uuid.uuid4()), "x" * 128],
    ids=["uuid-hex", "uuid", "128-chars"],
)
def test_a_routers_transfer_id_is_the_claim(tid: str) -> None:
    parsed = parse({**VLLM_PREFILL, "transfer_id": tid})

    assert isinstance(parsed, VllmPrefill)
    assert (parsed.claim, parsed.is_router_set) == (tid, True)
    assert parsed.leg.claim_sha256 == claim_digest(tid)
    assert parsed.leg.transfer_id == transfer_id_of(tid)


def test_the_transfer_id_names_the_claim_without_revealing_it() -> None:
    tid = transfer_id_of(CLAIM)

    assert tid == transfer_id_of(CLAIM), "both sides derive the same one"
    assert tid != transfer_id_of("d" * 43)
    assert tid.startswith(TRANSFER_ID_PREFIX) and len(tid) == 37
    assert CLAIM not in tid and CLAIM[:8] not in tid
    TransferParams.from_dict({"role": "prefill", "transfer_id": tid,
                              "decode_engine_id": "d0"})  # fmt: skip


@pytest.mark.parametrize(
    "tid", ["short-secret", "x" * 31, "x" * 129, "has space " * 4, "a+b/" * 10, 7]
)
def test_a_routers_transfer_id_that_is_no_claim_is_refused(tid: Any) -> None:
    with pytest.raises(ValueError, match="transfer_id") as info:
        parse({**VLLM_PREFILL, "transfer_id": tid})

    assert "32 to 128" in str(info.value), "says what a claim must be"
    if isinstance(tid, str):
        assert tid not in str(info.value), "a claim is never logged"


def test_prefills_answer_forwarded_whole_is_a_decode_leg() -> None:
    # what the pull proxy forwards: the answer, with vLLM's own additions
    params = answer_for(remote_prefill_cached_tokens=128)

    assert parse(params) == DecodeLeg(
        transfer_id=transfer_id_of(CLAIM),
        prefill_engine_id="p0",
        prefill_host="127.0.0.1",
        prefill_port=5601,
        claim_token=CLAIM,
        prefill_tp=1,
    )


def test_the_push_proxys_five_fields_are_enough() -> None:
    params = push_proxy(answer_for(tp_size=2))

    assert set(params) == {*PUSH_PROXY_FIELDS, "do_remote_prefill", "do_remote_decode"}
    assert parse(params) == msgspec.structs.replace(parse(answer_for()), prefill_tp=2)


def test_a_concurrent_decode_leg_claims_with_the_routers_transfer_id() -> None:
    tid = uuid.uuid4().hex
    params = {**push_proxy(answer_for()), "transfer_id": tid,
              "remote_request_id": "x-request-id-1"}  # fmt: skip

    leg = parse(params)

    assert isinstance(leg, DecodeLeg)
    assert (leg.claim_token, leg.transfer_id) == (tid, transfer_id_of(tid))


@pytest.mark.parametrize("tp_size", [None, "absent"])
def test_a_decode_leg_without_tp_size_is_one_rank(tp_size: Any) -> None:
    params = answer_for(tp_size=tp_size)
    if tp_size == "absent":
        del params["tp_size"]
    leg = parse(params)
    assert isinstance(leg, DecodeLeg) and leg.prefill_tp == 1


@pytest.mark.parametrize(
    ("change", "hint"),
    [
        ({"remote_engine_id": None}, "remote_engine_id"),
        ({"remote_engine_id": ""}, "remote_engine_id"),
        ({"remote_host": None}, "remote_host"),
        ({"remote_port": None}, "remote_port"),
        ({"remote_port": "5601"}, "remote_port"),
        ({"remote_port": 0}, "remote_port"),
        ({"remote_port": True}, "remote_port"),
        ({"remote_port": 65535, "tp_size": 2}, "remote_port 65535"),
        ({"tp_size": 0}, "tp_size"),
        ({"tp_size": "2"}, "tp_size"),
        ({"remote_request_id": None}, "remote_request_id .* or transfer_id"),
        ({"remote_request_id": "cmpl-1"}, "remote_request_id"),
        ({"transfer_id": "short"}, "transfer_id"),
        ({"transfer_mode": "pull"}, "transfer_mode 'pull'"),
        ({"do_remote_decode": True}, "exactly one of"),
        ({"do_remote_prefill": False}, "exactly one of"),
    ],
)
def test_a_malformed_decode_leg_says_what_is_wrong(
    change: dict[str, Any], hint: str
) -> None:
    with pytest.raises(
        ValueError, match=f"invalid vLLM P/D kv_transfer_params: .*{hint}"
    ):
        parse({**answer_for(), **change})


@pytest.mark.parametrize(
    ("params", "is_vllm"),
    [
        (VLLM_PREFILL, True),
        (answer_for(), True),
        ({"do_remote_decode": False, "do_remote_prefill": False}, True),
        (PREFILL_PARAMS, False),
        ({**PREFILL_PARAMS, "do_remote_decode": True}, False),  # role: kvpush's
        ({"transfer_id": "t"}, False),
        (["do_remote_decode"], False),
    ],
)
def test_kvpush_params_come_first_then_vllms(params: Any, is_vllm: bool) -> None:
    assert speaks_vllm(params) is is_vllm


def test_kvpush_params_with_vllm_keys_stay_kvpush_legs() -> None:
    legs = Legs(Counters())
    req = FakeRequest("r1", {**PREFILL_PARAMS, "do_remote_decode": True})

    assert legs.of(req) == TransferParams.from_dict(PREFILL_PARAMS)
    assert legs.vllm_prefill("r1") is None


def test_malformed_vllm_params_are_counted_logged_and_served_locally(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sched = PrefillScheduler(config_for("prefill"))
    req = FakeRequest("r1", {**VLLM_PREFILL, "transfer_id": "tiny-secret"})
    caplog.set_level(logging.WARNING)

    admit(sched, req)
    meta = run_step(sched, req, PROMPT, new(req, [1, 2, 3, 4, 5]))

    assert meta.triggers == []
    assert sched.request_finished(req) == (False, None)
    assert sched.counters.snapshot() == {"rejected.params": 1}
    (line,) = [r.getMessage() for r in caplog.records if "r1" in r.getMessage()]
    assert "invalid vLLM P/D kv_transfer_params: transfer_id" in line
    assert "tiny-secret" not in line


# -- prefill's scheduler: the answer ----------------------------------------------


@pytest.fixture
def prefill() -> Iterator[PrefillScheduler]:
    sched = PrefillScheduler(replace(config_for("prefill"), push_granularity="request"))
    yield sched
    sched.close()


def finish_prefill(
    sched: PrefillScheduler, params: Any, rid: str = "p1"
) -> tuple[Any, tuple[bool, dict[str, Any] | None]]:
    """Admit, compute the whole prompt in one step, finish: (the step's
    one trigger, what ``request_finished`` returned)."""
    req = FakeRequest(rid, params)
    admit(sched, req)
    (trigger,) = run_step(sched, req, PROMPT, new(req, [1, 2, 3, 4, 5])).triggers
    return trigger, sched.request_finished(req)


def test_prefill_answers_what_the_decode_leg_needs(prefill: PrefillScheduler):
    trigger, (held, answer) = finish_prefill(prefill, VLLM_PREFILL)

    assert held is True, "vLLM keeps the blocks for the push"
    assert answer is not None
    claim = answer["remote_request_id"]
    assert answer == answer_for(claim)
    assert "transfer_id" not in answer, "the router set none"
    assert (trigger.decode_engine_id, trigger.claim_sha256) == (
        None,
        claim_digest(claim),
    )
    assert trigger.transfer_id == transfer_id_of(claim)
    assert leftovers(prefill._legs, ignore=["_ended"]) == {}


def test_prefill_answers_a_routers_transfer_id_back(prefill: PrefillScheduler):
    tid = uuid.uuid4().hex
    trigger, (_, answer) = finish_prefill(prefill, {**VLLM_PREFILL, "transfer_id": tid})

    assert answer == answer_for(tid, transfer_id=tid)
    assert trigger.transfer_id == transfer_id_of(tid)


def test_prefill_answers_nothing_for_kvpush_legs(prefill: PrefillScheduler):
    _, finished = finish_prefill(prefill, PREFILL_PARAMS)
    assert finished == (True, None)


def test_a_prefill_aborted_before_its_kv_is_ready_answers_nothing(prefill):
    req = FakeRequest("p1", VLLM_PREFILL)
    admit(prefill, req)
    run_step(prefill, req, 256, new(req, [1, 2]))  # not the last chunk

    assert prefill.request_finished(req) == (False, None)
    (cancelled,) = prefill.build_connector_meta(SchedulerOutput()).cancels
    assert cancelled.startswith(TRANSFER_ID_PREFIX)


def test_a_prefill_aborted_mid_stream_holds_its_blocks_but_answers_nothing():
    sched = PrefillScheduler(replace(config_for("prefill"), push_granularity="chunk"))
    req = FakeRequest("p1", VLLM_PREFILL)
    admit(sched, req)
    (chunk,) = run_step(sched, req, 256, new(req, [1, 2])).triggers

    assert sched.request_finished(req) == (True, None), "a WRITE may read them"
    assert sched.build_connector_meta(SchedulerOutput()).cancels == [chunk.transfer_id]
    sched.close()


def test_a_prefill_preempted_after_its_trigger_answers_nothing(prefill):
    req = FakeRequest("p1", VLLM_PREFILL)
    admit(prefill, req)
    run_step(prefill, req, PROMPT, new(req, [1, 2, 3, 4, 5]))
    prefill.build_connector_meta(SchedulerOutput(preempted_req_ids={"p1"}))
    req.num_computed_tokens = 0
    run_step(prefill, req, PROMPT, cached(req, [6, 7, 8, 9, 10], resumed=True))

    assert prefill.request_finished(req) == (False, None), "its push was closed"


def test_a_prefill_whose_side_channel_binds_a_wildcard_cancels_its_push():
    config = replace(
        config_for("prefill"), side_channel_host="0.0.0.0",
        insecure_side_channel=True, push_granularity="request",
    )  # fmt: skip
    sched = PrefillScheduler(config)
    trigger, finished = finish_prefill(sched, VLLM_PREFILL)

    assert finished == (True, None), "no address to give: the decode computes"
    assert sched.build_connector_meta(SchedulerOutput()).cancels == [
        trigger.transfer_id
    ]
    assert sched.counters.get("skipped.wildcard_host") == 1
    sched.close()


def test_a_wildcard_bound_prefill_answers_with_its_advertised_host():
    """Bound to every interface, the prefill names the address decodes reach
    it at (``side_channel_advertise_host``, set by ``kvpush serve``/``up``
    from ``--side-channel-advertise-host``)."""
    config = replace(
        config_for("prefill"), side_channel_host="0.0.0.0",
        side_channel_advertise_host="10.0.0.5", insecure_side_channel=True,
        push_granularity="request",
    )  # fmt: skip
    sched = PrefillScheduler(config)
    _, (held, answer) = finish_prefill(sched, VLLM_PREFILL)

    assert held and answer is not None
    assert (answer["remote_host"], answer["remote_port"]) == (
        "10.0.0.5",
        config.side_channel_port,
    )
    assert sched.counters.get("skipped.wildcard_host") == 0
    sched.close()


def test_n_children_of_a_concurrent_prefill_leg_push_once(prefill: PrefillScheduler):
    """vLLM's n > 1 children share the router's transfer_id: as with
    kvpush's own legs, the first pushes, the others are served locally."""
    params = {**VLLM_PREFILL, "transfer_id": uuid.uuid4().hex}
    _, (_, answer) = finish_prefill(prefill, params, rid="0_p")
    twin = FakeRequest("1_p", params)
    admit(prefill, twin)

    assert run_step(prefill, twin, PROMPT, new(twin, [6, 7, 8, 9, 10])).triggers == []
    assert prefill.request_finished(twin) == (False, None)
    assert answer is not None and prefill.counters.get("rejected.duplicate") == 1


def test_n_children_of_a_sequential_prefill_leg_each_draw_a_claim(prefill):
    """Without a router's transfer_id the children share nothing: each
    draws its own claim; vLLM's response carries one child's answer, and
    the others' KV waits out prefill's ready deadline unclaimed."""
    _, (_, first) = finish_prefill(prefill, VLLM_PREFILL, rid="0_p")
    _, (_, second) = finish_prefill(prefill, VLLM_PREFILL, rid="1_p")

    assert first and second
    assert first["remote_request_id"] != second["remote_request_id"]


# -- decode's scheduler: the registration -------------------------------------------


def decode_for(engine: str = "d0", **changes: Any) -> tuple[DecodeScheduler, FakePeers]:
    config = replace(config_for("decode"), engine_id=engine, **changes)
    sched = DecodeScheduler(config)
    sched._peers.close()
    peers = FakePeers()
    sched._peers = peers  # type: ignore[assignment]
    sched._send = peers.send
    return sched, peers


@pytest.fixture
def decode() -> Iterator[tuple[DecodeScheduler, FakePeers]]:
    sched, peers = decode_for()
    yield sched, peers
    sched.close()


def register(
    decode: tuple[DecodeScheduler, FakePeers],
    params: Any,
    rid: str = "d1",
    num_tokens: int = PROMPT,
) -> Registration:
    """Decode admits a request and allocates it blocks 10, 11, ...: the
    Registration it sends."""
    sched, peers = decode
    req = FakeRequest(rid, params, num_prompt_tokens=num_tokens)
    dst = list(range(10, 10 - (-num_tokens // sched.config.block_size)))
    assert sched.get_num_new_matched_tokens(req, 0) == (num_tokens, True)
    sched.update_state_after_alloc(req, FakeBlocks(dst), num_tokens)
    return peers.messages(Registration)[-1]  # type: ignore[no-any-return]


@pytest.mark.parametrize("proxy", ["pull", "push"])
def test_decode_registers_with_the_claim_of_prefills_answer(decode, proxy: str):
    params = answer_for() if proxy == "pull" else push_proxy(answer_for())

    reg = register(decode, params)

    sched, peers = decode
    assert (reg.transfer_id, reg.claim_token) == (transfer_id_of(CLAIM), CLAIM)
    assert [(h, p) for h, p, _ in peers.sent] == [("127.0.0.1", 5601)]
    (expect,) = sched.build_connector_meta(SchedulerOutput()).expects
    assert (expect.prefill_engine_id, expect.prefill_port) == ("p0", 5601)
    assert expect.transfer_id == reg.transfer_id


def test_kvpush_decode_legs_register_as_before(decode):
    reg = register(decode, DECODE_PARAMS)
    assert (reg.transfer_id, reg.claim_token) == ("t1", None)


def test_a_claim_decode_already_used_is_served_locally(decode):
    """The same answer sent twice to one decode: the second request never
    reaches prefill (its transfer id's owner finished)."""
    sched, peers = decode
    register(decode, answer_for())
    sched.update_connector_output(finished_sending=None, finished_recving={"d1"})
    assert sched.request_finished(FakeRequest("d1", answer_for())) == (False, None)

    again = FakeRequest("d2", answer_for())
    assert sched.get_num_new_matched_tokens(again, 0) == (0, False)
    assert sched.request_finished(again) == (False, None)

    assert len(peers.messages(Registration)) == 1
    assert peers.messages(Cancel) == []
    assert sched.counters.get("rejected.duplicate") == 1
    assert leftovers(sched) == {}


def test_n_decode_children_share_the_claimed_transfer(decode):
    sched, peers = decode
    register(decode, answer_for(), rid="0_d")

    twin = FakeRequest("1_d", answer_for())
    assert sched.get_num_new_matched_tokens(twin, 0) == (None, False), "waits"
    assert len(peers.messages(Registration)) == 1


# -- the claim end to end: prefill's writer decides ---------------------------------

E2E_BS, E2E_PROMPT = 16, 60  # the writer rig's: 4 blocks, prefill's 4, 5, 6, 9


def ready_kv(trigger: Any) -> ReadyKv:
    """What prefill's worker hands its writer for a trigger."""
    return ReadyKv(
        trigger.transfer_id, trigger.src_block_ids, trigger.num_tokens,
        trigger.decode_engine_id, first_block=trigger.first_block,
        final=trigger.final, claim_sha256=trigger.claim_sha256,
    )  # fmt: skip


def prefill_e2e(granularity: str = "request") -> PrefillScheduler:
    config = replace(config_for("prefill"), block_size=E2E_BS,
                     push_granularity=granularity)  # fmt: skip
    return PrefillScheduler(config)


def decode_e2e(engine: str, ttl_s: float = 10.0) -> tuple[DecodeScheduler, FakePeers]:
    return decode_for(engine, block_size=E2E_BS, boot_id=BOOT, registration_ttl_s=ttl_s)


def compute(prefill: PrefillScheduler, rig: LateRig, params: Any) -> dict[str, Any]:
    """Prefill computes a vLLM leg (60 tokens in one step), its writer gets
    the KV, the request finishes: prefill's answer."""
    req = FakeRequest("p1", params, num_prompt_tokens=E2E_PROMPT)
    admit(prefill, req)
    (trigger,) = run_step(prefill, req, E2E_PROMPT, new(req, [4, 5, 6, 9])).triggers
    rig.writer.kv_ready(ready_kv(trigger), "p1", NoFence())
    held, answer = prefill.request_finished(req)
    assert held is True and answer is not None
    return answer


def claim(
    rig: LateRig, engine: str, params: Any, route: bytes, ttl_s: float = 10.0
) -> Registration:
    """Decode ``engine`` registers a request with ``params`` at the writer."""
    decode = decode_e2e(engine, ttl_s)
    reg = register(decode, params, num_tokens=E2E_PROMPT)
    rig.writer.on_message(route, reg)
    decode[0].close()
    return reg


@pytest.fixture
def rig() -> Iterator[LateRig]:
    r = LateRig()
    yield r
    r.close()


@pytest.mark.parametrize("proxy", ["pull", "push"])
def test_the_decode_holding_prefills_answer_claims_the_kv(rig: LateRig, proxy: str):
    prefill = prefill_e2e()
    answer = compute(prefill, rig, VLLM_PREFILL)
    rig.sync()
    assert rig.io.writes_snapshot() == [], "nobody claimed it yet"

    reg = claim(rig, D1, answer if proxy == "pull" else push_proxy(answer), D1_ROUTE)

    assert rig.wait_finished("p1")
    (write,) = rig.io.writes_snapshot()
    assert write.peer == "kvpush-d1"
    assert write.message == Done(reg.transfer_id, "p0", num_blocks=4)
    assert rig.replies.of(Failure) == []
    prefill.close()


def test_a_forged_claim_is_refused_at_once_and_touches_nothing(rig: LateRig):
    """A claim of the form prefill draws that prefill does not hold: no
    decode got it from this prefill's answer (which comes only once the KV
    is in), so its registration fails at once, holding nothing; the real
    transfer is still the real claim's."""
    prefill = prefill_e2e()
    answer = compute(prefill, rig, VLLM_PREFILL)
    forged = {**answer, "remote_request_id": PREFILL_CLAIM_PREFIX + "f" * 43}

    reg = claim(rig, D1, forged, D1_ROUTE)  # waits 9 s at prefill if held

    assert wait_for(lambda: rig.failures_to(D1_ROUTE))
    (failure,) = rig.failures_to(D1_ROUTE)
    assert (failure.transfer_id, failure.cause) == (reg.transfer_id, Cause.REJECTED)
    assert "prefill-drawn claim" in failure.detail
    assert forged["remote_request_id"] not in failure.detail
    assert rig.counters.get("rejected.unknown_claim") == 1
    assert rig.io.writes_snapshot() == []
    claim(rig, DECODE, answer, DECODE_ROUTE)
    assert rig.wait_finished("p1")
    (write,) = rig.io.writes_snapshot()
    assert write.peer == "kvpush-d0", "the real claim still works"
    assert len(rig.replies.of(Failure)) == 1
    prefill.close()


def test_a_claim_a_router_may_have_set_waits_for_its_kv_until_its_deadline():
    """A claim not of prefill's form may be a concurrent router's, whose
    registration comes before the KV: it waits, and ends with prefill's
    Failure at its deadline when no KV comes."""
    rig = LateRig()
    try:
        prefill = prefill_e2e()
        answer = compute(prefill, rig, VLLM_PREFILL)
        forged = {**answer, "remote_request_id": "f" * 43}

        reg = claim(rig, D1, forged, D1_ROUTE, ttl_s=1.05)  # 50 ms at prefill

        assert wait_for(lambda: rig.failures_to(D1_ROUTE))
        (failure,) = rig.failures_to(D1_ROUTE)
        assert (failure.transfer_id, failure.cause) == (reg.transfer_id, Cause.EXPIRED)
        assert rig.io.writes_snapshot() == []
        claim(rig, DECODE, answer, DECODE_ROUTE)
        assert rig.wait_finished("p1")
        (write,) = rig.io.writes_snapshot()
        assert write.peer == "kvpush-d0", "the real claim still works"
        prefill.close()
    finally:
        rig.close()


def test_a_replayed_claim_is_refused_and_the_first_write_stands(rig: LateRig):
    prefill = prefill_e2e()
    answer = compute(prefill, rig, VLLM_PREFILL)
    claim(rig, D1, answer, D1_ROUTE)
    assert rig.wait_finished("p1")

    reg = claim(rig, DECODE, answer, DECODE_ROUTE)  # d0 replays the answer

    assert wait_for(lambda: rig.failures_to(DECODE_ROUTE))
    (failure,) = rig.failures_to(DECODE_ROUTE)
    assert (failure.transfer_id, failure.cause) == (reg.transfer_id, Cause.REJECTED)
    assert "already claimed" in failure.detail
    assert answer["remote_request_id"] not in failure.detail
    (write,) = rig.io.writes_snapshot()
    assert write.peer == "kvpush-d1" and rig.failures_to(D1_ROUTE) == []
    assert rig.counters.get("rejected.claimed") == 1
    prefill.close()


def test_a_concurrent_registration_before_the_prefill_streams_each_chunk(
    rig: LateRig,
):
    """Both legs at once, with the router's transfer_id: decode registers
    before prefill has computed anything; each chunk is then pushed as its
    forward ends, as for an early-bound transfer."""
    tid = uuid.uuid4().hex
    router = {"remote_engine_id": "p0", "remote_host": "127.0.0.1",
              "remote_port": 5601, "tp_size": 1}  # fmt: skip
    claim(rig, D1, {"do_remote_prefill": True, "transfer_id": tid, **router}, D1_ROUTE)
    prefill = prefill_e2e("chunk")
    req = FakeRequest("p1", {**VLLM_PREFILL, "transfer_id": tid},
                      num_prompt_tokens=E2E_PROMPT)  # fmt: skip
    admit(prefill, req)

    (first,) = run_step(prefill, req, 32, new(req, [4, 5, 6, 9])).triggers
    rig.writer.kv_ready(ready_kv(first), "p1", NoFence())
    assert wait_for(lambda: len(rig.io.writes_snapshot()) == 1), "chunk 1 at once"
    (last,) = run_step(prefill, req, 28, cached(req, None)).triggers
    rig.writer.kv_ready(ready_kv(last), "p1", NoFence())

    assert rig.wait_finished("p1")
    writes = rig.io.writes_snapshot()
    assert [blocks_of(w) for w in writes] == [([4, 5], [10, 11]), ([6, 9], [12, 13])]
    assert writes[-1].message == Done(transfer_id_of(tid), "p0", num_blocks=4)
    assert prefill.request_finished(req) == (
        True, answer_for(tid, transfer_id=tid),
    )  # fmt: skip
    prefill.close()
