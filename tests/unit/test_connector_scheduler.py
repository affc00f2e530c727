"""The connector's scheduler side, driven as vLLM's scheduler drives it.

Decode: a request with a decode leg claims the prompt tokens its prefix
cache lacks, registers exactly those blocks with the prefill as soon as they
are allocated, and tells the worker to expect them; it cancels whenever it
will not receive. Prefill: a request with a prefill leg triggers its push in
the step that computes its last prompt token, once, with its blocks, and
keeps them allocated until the worker reports the push over.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from kvpush.connector.config import ConnectorConfig, KvGroup
from kvpush.connector.decode.scheduler import DecodeScheduler
from kvpush.connector.metadata import (
    DecodeMetadata,
    PreemptedPush,
    PrefillMetadata,
    PushesOver,
    PushTrigger,
    RecvExpect,
)
from kvpush.connector.prefill.scheduler import PrefillScheduler
from kvpush.transfer.groups import of, one
from kvpush.transfer.messages import (
    Cancel,
    Cause,
    DecodeLeg,
    Failure,
    FirstToken,
    HelloRequest,
    PrefillLeg,
    Registration,
    SampleLogprobs,
    claim_digest,
)
from tests.fakes.fake_block_tables import BlockState, apply
from tests.fakes.fake_nixl import FakePeers, leftovers

BS = 128
PROMPT = 600  # ceil(600 / 128) = 5 blocks
PREFILL_HOST, PREFILL_PORT = "127.0.0.1", 5600

DECODE_PARAMS = DecodeLeg(
    transfer_id="t1",
    prefill_engine_id="p0",
    prefill_host=PREFILL_HOST,
    prefill_port=PREFILL_PORT,
).to_dict()
PREFILL_PARAMS = PrefillLeg(transfer_id="t2", decode_engine_id="d0").to_dict()


# -- tiny stand-ins for vLLM's objects ------------------------------------------


@dataclass
class FakeRequest:
    request_id: str
    kv_transfer_params: dict[str, Any] | None
    num_prompt_tokens: int = PROMPT
    num_computed_tokens: int = 0
    skip_reading_prefix_cache: bool = False  # vLLM: prompt_logprobs
    finish_reason: str | None = None  # once finished: "stop", "length", ...
    output_token_ids: list[int] = field(default_factory=list)

    def get_finished_reason(self) -> str | None:
        return self.finish_reason


@dataclass
class FakeBlocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class NewReq:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int = 0


@dataclass
class CachedReqs:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: CachedReqs = field(default_factory=CachedReqs)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: set[str] | None = None
    applied: bool = False  # its allocations are in fake_block_tables

    @property
    def kv_connector_block_state(self) -> BlockState:
        """vLLM's current tables once this step allocated."""
        if not self.applied:
            apply(self)
            self.applied = True
        return BlockState()


def config_for(role: str, trace_dir: str = "", tp_size: int = 1) -> ConnectorConfig:
    return ConnectorConfig(
        role=role,  # type: ignore[arg-type]
        engine_id="d0" if role == "decode" else "p0",
        side_channel_host="127.0.0.1",
        side_channel_port=5601,
        block_size=BS,
        trace_dir=trace_dir,
        tp_size=tp_size,
    )


def make_decode(
    trace_dir: str = "", tp_size: int = 1, **more: Any
) -> tuple[DecodeScheduler, FakePeers]:
    sched = DecodeScheduler(replace(config_for("decode", trace_dir, tp_size), **more))
    sched._peers.close()
    peers = FakePeers()
    sched._peers = peers  # type: ignore[assignment]
    sched._send = peers.send
    return sched, peers


@pytest.fixture
def decode() -> Iterator[tuple[DecodeScheduler, FakePeers]]:
    sched, peers = make_decode()
    yield sched, peers
    sched.close()


@pytest.fixture
def prefill() -> Iterator[PrefillScheduler]:
    # whole-request pushes (the default, auto, streams: see the stream tests)
    sched = PrefillScheduler(replace(config_for("prefill"), push_granularity="request"))
    yield sched
    sched.close()


def empty_step(sched: Any) -> Any:
    return sched.build_connector_meta(SchedulerOutput())


# -- decode ----------------------------------------------------------------------


def test_decode_claims_the_prompt_tokens_its_cache_lacks_asynchronously(decode):
    sched, peers = decode
    req = FakeRequest("r1", DECODE_PARAMS)

    assert sched.get_num_new_matched_tokens(req, 256) == (PROMPT - 256, True)
    assert peers.sent == [], "nothing is registered before blocks are allocated"


def test_allocation_registers_the_blocks_after_the_local_hit(decode):
    sched, peers = decode
    req = FakeRequest("r1", DECODE_PARAMS)
    sched.get_num_new_matched_tokens(req, 256)  # 2 blocks hit locally

    sched.update_state_after_alloc(req, FakeBlocks([7, 8, 1, 2, 3, 9]), PROMPT - 256)

    assert peers.sent == [
        (
            PREFILL_HOST,
            PREFILL_PORT,
            Registration(
                transfer_id="t1",
                decode_engine_id="d0",
                decode_boot_id=sched.config.boot_id,
                dst_block_ids=one((1, 2, 3)),  # prompt blocks 2..4; 9 is past it
                num_tokens=PROMPT,
                ttl_s=sched.config.registration_ttl_s,
                first_block=2,
            ),
        )
    ]
    meta = empty_step(sched)
    assert meta.expects == [
        RecvExpect(
            req_id="r1",
            transfer_id="t1",
            dst_block_ids=one((1, 2, 3)),
            prefill_engine_id="p0",
            prefill_host=PREFILL_HOST,
            prefill_port=PREFILL_PORT,
        )
    ]
    assert empty_step(sched).expects == [], "each expect is sent to the worker once"


def test_without_a_local_hit_every_prompt_block_is_registered(decode):
    sched, peers = decode
    req = FakeRequest("r1", DECODE_PARAMS)
    assert sched.get_num_new_matched_tokens(req, 0) == (PROMPT, True)

    sched.update_state_after_alloc(req, FakeBlocks([5, 6, 7, 8, 9]), PROMPT)

    (reg,) = peers.messages(Registration)
    assert (reg.dst_block_ids, reg.first_block) == (one((5, 6, 7, 8, 9)), 0)


@dataclass
class GroupedBlocks:
    """vLLM's ``KVCacheBlocks`` of a model with several KV-cache groups."""

    ids: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.ids


def test_decode_registers_one_list_per_group_from_first_block():
    two = (KvGroup("sliding_window:128"), KvGroup("full"))
    sched, peers = make_decode(kv_groups=two)
    req = FakeRequest("r1", DECODE_PARAMS)
    assert sched.get_num_new_matched_tokens(req, 128) == (PROMPT - 128, True)
    tables = GroupedBlocks(([5, 6, 7, 8, 9], [15, 16, 17, 18, 19]))

    sched.update_state_after_alloc(req, tables, PROMPT - 128)

    (reg,) = peers.messages(Registration)
    assert (reg.first_block, reg.dst_block_ids) == (
        1,
        of([[6, 7, 8, 9], [16, 17, 18, 19]]),
    )
    (expect,) = empty_step(sched).expects
    assert expect.dst_block_ids == reg.dst_block_ids
    sched.close()


def test_a_leg_pushing_the_prompts_first_tokens_claims_and_registers_those(decode):
    # Late binding from prefill's first token: decode's prompt is the
    # prompt prefill computed (512 tokens: exactly 4 blocks) and that
    # token; only the 512 are pushed, and vLLM computes the last one.
    sched, peers = decode
    leg = DecodeLeg.from_dict({**DECODE_PARAMS, "num_kv_tokens": 512})
    req = FakeRequest("r1", leg.to_dict(), num_prompt_tokens=513)
    assert sched.get_num_new_matched_tokens(req, 128) == (512 - 128, True)

    sched.update_state_after_alloc(req, FakeBlocks([7, 1, 2, 3, 9]), 512 - 128)

    (reg,) = peers.messages(Registration)
    assert (reg.num_tokens, reg.first_block, reg.dst_block_ids) == (
        512,
        1,
        one((1, 2, 3)),
    )


def test_a_leg_claiming_more_tokens_than_the_prompt_is_served_locally(decode):
    sched, peers = decode
    params = {**DECODE_PARAMS, "num_kv_tokens": PROMPT + 1}
    req = FakeRequest("r1", params)

    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.counters.get("rejected.incompatible") == 1
    assert peers.messages(Registration) == []


def test_a_registered_request_claims_nothing_more(decode):
    sched, peers = decode
    req = FakeRequest("r1", DECODE_PARAMS)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, FakeBlocks([5, 6, 7, 8, 9]), PROMPT)

    # vLLM asks again when the request is scheduled after its KV arrived
    assert sched.get_num_new_matched_tokens(req, PROMPT) == (0, False)
    sched.update_state_after_alloc(req, FakeBlocks([5, 6, 7, 8, 9]), 0)
    assert len(peers.messages(Registration)) == 1
    assert peers.messages(Cancel) == []


def test_a_full_local_hit_cancels_the_transfer_and_claims_nothing(decode):
    sched, peers = decode
    req = FakeRequest("r1", DECODE_PARAMS)

    assert sched.get_num_new_matched_tokens(req, PROMPT) == (0, False)
    sched.update_state_after_alloc(req, FakeBlocks([1, 2, 3, 4, 5]), 0)

    assert peers.sent == [
        (
            PREFILL_HOST,
            PREFILL_PORT,
            Cancel(
                transfer_id="t1",
                engine_id="d0",
                reason="decode holds the whole prompt",
            ),
        )
    ]
    assert empty_step(sched).expects == []
    assert sched.request_finished(req) == (False, None)
    assert len(peers.sent) == 1, "cancelled once"
    assert leftovers(sched) == {}


@pytest.mark.parametrize(
    "params",
    [
        {"role": "decode", "transfer_id": "t1"},  # no prefill address
        {**DECODE_PARAMS, "prefill_port": 0},
        {"role": "sideways", "transfer_id": "t1"},
        {"do_remote_prefill": True},  # another connector's params
    ],
)
def test_invalid_params_are_ignored_and_the_request_is_served_locally(decode, params):
    sched, peers = decode
    req = FakeRequest("r1", params)

    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, FakeBlocks([1, 2, 3, 4, 5]), 0)
    assert empty_step(sched) == DecodeMetadata()
    assert sched.request_finished(req) == (False, None)
    assert peers.sent == []


def test_a_request_without_params_is_not_kvpushs_business(decode):
    sched, peers = decode
    req = FakeRequest("r1", None)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.request_finished(req) == (False, None)
    assert peers.sent == []


def test_decode_request_aborted_while_receiving_keeps_its_blocks(decode):
    """The blocks stay with vLLM until the worker says no WRITE can land;
    the worker (not the scheduler) sends the Cancel and awaits the answer."""
    sched, peers = decode
    req = FakeRequest("r1", DECODE_PARAMS)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, FakeBlocks([5, 6, 7, 8, 9]), PROMPT)
    empty_step(sched)

    assert sched.request_finished(req) == (True, None)
    meta = sched.build_connector_meta(SchedulerOutput())
    assert meta.recv_cancels == ["t1"]
    assert sched.has_pending_push_work(), "the engine must step until released"
    assert peers.messages(Cancel) == []

    sched.update_connector_output(finished_sending=None, finished_recving={"r1"})
    assert not sched.has_pending_push_work()
    assert leftovers(sched) == {}


def test_decode_request_aborted_before_it_was_ever_scheduled_cancels(decode):
    """Found by the soak: a request aborted while still queued never met the
    connector before ``request_finished``; prefill must still be told."""
    sched, peers = decode
    req = FakeRequest("r1", DECODE_PARAMS)

    assert sched.request_finished(req) == (False, None)

    assert [c.transfer_id for c in peers.messages(Cancel)] == ["t1"]
    assert leftovers(sched) == {}


def test_decode_request_aborted_before_allocation_cancels_the_transfer(decode):
    sched, peers = decode
    req = FakeRequest("r1", DECODE_PARAMS)
    sched.get_num_new_matched_tokens(req, 0)  # no room: stays waiting

    sched.request_finished(req)

    assert [c.transfer_id for c in peers.messages(Cancel)] == ["t1"]
    assert peers.messages(Registration) == []


def test_decode_request_finishing_after_its_kv_arrived_cancels_nothing(decode):
    sched, peers = decode
    req = FakeRequest("r1", DECODE_PARAMS)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, FakeBlocks([5, 6, 7, 8, 9]), PROMPT)
    empty_step(sched)

    sched.update_connector_output(finished_sending=None, finished_recving={"r1"})
    sched.build_connector_meta(SchedulerOutput(num_scheduled_tokens={"r1": 1}))
    assert sched.request_finished(req) == (False, None)

    assert peers.messages(Cancel) == []
    assert not sched.has_pending_push_work()
    assert leftovers(sched) == {}, "the request's whole life left nothing behind"


def test_a_request_allocated_with_no_external_tokens_cancels_at_once(decode):
    """vLLM claims nothing external after all (e.g. trims of its own): decode
    gives the transfer up in that very call, so prefill frees the pushed KV
    now, not at its ready deadline; the request is served locally."""
    sched, peers = decode
    req = FakeRequest("r1", DECODE_PARAMS)
    assert sched.get_num_new_matched_tokens(req, 0) == (PROMPT, True)

    sched.update_state_after_alloc(req, FakeBlocks([5, 6, 7, 8, 9]), 0)

    assert peers.sent == [
        (
            PREFILL_HOST,
            PREFILL_PORT,
            Cancel(
                transfer_id="t1",
                engine_id="d0",
                reason="vLLM allocated the request with no external tokens",
            ),
        )
    ], "cancelled at allocation, before the request finished"
    assert sched.counters.get("skipped.no_external_load") == 1
    assert empty_step(sched) == DecodeMetadata(), "the worker expects nothing"
    # preempted and scheduled again: still nothing to claim or register
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, FakeBlocks([1, 2, 3, 4, 5]), 0)
    assert sched.request_finished(req) == (False, None), "vLLM frees its blocks"
    assert peers.messages(Registration) == []
    assert len(peers.messages(Cancel)) == 1, "cancelled once"
    assert sched.counters.get("aborted.before_registration") == 0, "not an abort"
    assert not sched.has_pending_push_work()
    assert leftovers(sched) == {}


def test_a_request_vllm_skips_external_loads_for_claims_nothing_and_cancels(
    decode,
):
    """``prompt_logprobs`` makes vLLM set ``skip_reading_prefix_cache`` and
    zero whatever the connector claims (``update_state_after_alloc`` gets 0):
    decode says 0 and cancels when first asked."""
    sched, peers = decode
    req = FakeRequest("r1", DECODE_PARAMS, skip_reading_prefix_cache=True)

    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert [(c.transfer_id, c.reason) for c in peers.messages(Cancel)] == [
        ("t1", "vLLM skips external loads for this request (prompt_logprobs)")
    ]
    sched.update_state_after_alloc(req, FakeBlocks([5, 6, 7, 8, 9]), 0)
    assert sched.request_finished(req) == (False, None)

    assert peers.messages(Registration) == []
    assert len(peers.messages(Cancel)) == 1, "cancelled once"
    assert sched.counters.snapshot() == {"skipped.no_external_load": 1}
    assert empty_step(sched) == DecodeMetadata()
    assert leftovers(sched) == {}


def test_a_sibling_vllm_skips_external_loads_for_cancels_nothing(decode):
    """``n`` > 1 with ``prompt_logprobs``: the first child gives the transfer
    up; the others neither wait for it nor cancel it again."""
    sched, peers = decode
    first = FakeRequest("r1", DECODE_PARAMS, skip_reading_prefix_cache=True)
    twin = FakeRequest("r9", DECODE_PARAMS, skip_reading_prefix_cache=True)
    assert sched.get_num_new_matched_tokens(first, 0) == (0, False)

    assert sched.get_num_new_matched_tokens(twin, 0) == (0, False)
    sched.update_state_after_alloc(twin, FakeBlocks([1, 2, 3, 4, 5]), 0)
    assert [sched.request_finished(r) for r in (twin, first)] == [(False, None)] * 2

    assert len(peers.messages(Cancel)) == 1
    assert peers.messages(Registration) == []
    assert sched.counters.snapshot() == {"skipped.no_external_load": 1}
    assert leftovers(sched) == {}


def test_decode_traces_the_registration_and_the_first_decode_step(tmp_path: Path):
    sched, _ = make_decode(trace_dir=str(tmp_path))
    try:
        req = FakeRequest("r1", DECODE_PARAMS)
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, FakeBlocks([5, 6, 7, 8, 9]), PROMPT)
        empty_step(sched)  # waiting for KV: not scheduled
        out = SchedulerOutput(num_scheduled_tokens={"r1": 1})
        sched.build_connector_meta(out)
        sched.build_connector_meta(out)  # marked once
    finally:
        sched.close()

    (trace,) = tmp_path.glob("d0-*.jsonl")
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [(x["transfer_id"], x["event"]) for x in lines] == [
        ("t1", "reg_sent"),
        ("t1", "first_decode_step"),
    ]
    assert lines[0]["num_blocks"] == 5


# -- prefill ---------------------------------------------------------------------


def admit(sched: PrefillScheduler, req: FakeRequest) -> None:
    """vLLM admits a waiting request: match, allocate."""
    assert sched.get_num_new_matched_tokens(req, req.num_computed_tokens) == (0, False)
    sched.update_state_after_alloc(req, FakeBlocks([]), 0)


def run_step(
    sched: PrefillScheduler, req: FakeRequest, num_tokens: int, out: SchedulerOutput
) -> PrefillMetadata:
    """One engine step that computes ``num_tokens`` of ``req``; vLLM builds
    the metadata before it advances ``num_computed_tokens``."""
    out.num_scheduled_tokens = {req.request_id: num_tokens}
    meta = sched.build_connector_meta(out)
    req.num_computed_tokens += num_tokens
    return meta


def new(req: FakeRequest, blocks: list[int]) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=[NewReq(req.request_id, (blocks,), req.num_computed_tokens)]
    )


def cached(
    req: FakeRequest, blocks: list[int] | None, resumed: bool = False
) -> SchedulerOutput:
    rid = req.request_id
    return SchedulerOutput(
        scheduled_cached_reqs=CachedReqs(
            req_ids=[rid],
            new_block_ids=[None if blocks is None else (blocks,)],
            resumed_req_ids={rid} if resumed else set(),
        )
    )


def trigger_for(req: FakeRequest, blocks: tuple[int, ...]) -> PushTrigger:
    return PushTrigger(
        req_id=req.request_id,
        transfer_id="t2",
        src_block_ids=one(blocks),
        num_tokens=req.num_prompt_tokens,
        decode_engine_id="d0",
    )


def test_push_is_triggered_in_the_step_computing_the_last_prompt_token(prefill):
    req = FakeRequest("r2", PREFILL_PARAMS)
    admit(prefill, req)

    chunk1 = run_step(prefill, req, 256, new(req, [1, 2]))  # tokens 0..255
    chunk2 = run_step(prefill, req, 256, cached(req, [3, 4]))  # 256..511
    assert (chunk1.triggers, chunk2.triggers) == ([], [])
    assert prefill.has_pending_push_work() is False

    last = run_step(prefill, req, 88, cached(req, [5, 6]))  # 512..599
    assert last.triggers == [trigger_for(req, (1, 2, 3, 4, 5))]
    assert prefill.has_pending_push_work() is True

    after = run_step(prefill, req, 1, cached(req, [7]))  # first output token
    assert after.triggers == [], "triggered once"


def test_prefill_tracks_one_list_per_group_and_triggers_each():
    """vLLM's tables per KV-cache group (two here): each is followed as
    vLLM extends it, and the trigger carries every group's blocks."""
    two = (KvGroup("sliding_window:128"), KvGroup("full"))
    prefill = PrefillScheduler(
        replace(config_for("prefill"), push_granularity="request", kv_groups=two)
    )
    req = FakeRequest("r2", PREFILL_PARAMS)
    admit(prefill, req)
    out = SchedulerOutput(scheduled_new_reqs=[NewReq("r2", ([1, 2], [21, 22]), 0)])
    run_step(prefill, req, 256, out)
    more = SchedulerOutput(
        scheduled_cached_reqs=CachedReqs(
            req_ids=["r2"],
            new_block_ids=[([3, 4, 5], [23, 24, 25])],
            resumed_req_ids=set(),
        )
    )

    (trigger,) = run_step(prefill, req, PROMPT - 256, more).triggers

    assert trigger.src_block_ids == of([[1, 2, 3, 4, 5], [21, 22, 23, 24, 25]])


def test_a_prompt_computed_in_one_step_triggers_in_that_step(prefill):
    req = FakeRequest("r2", PREFILL_PARAMS)
    admit(prefill, req)

    meta = run_step(prefill, req, PROMPT, new(req, [9, 3, 4, 8, 1]))

    assert meta.triggers == [trigger_for(req, (9, 3, 4, 8, 1))]


def test_a_resumed_request_pushes_its_new_blocks(prefill):
    req = FakeRequest("r2", PREFILL_PARAMS)
    admit(prefill, req)
    run_step(prefill, req, 256, new(req, [1, 2]))
    req.num_computed_tokens = 0  # preempted: its blocks were freed

    meta = run_step(prefill, req, PROMPT, cached(req, [11, 12, 13, 14, 15], True))

    assert meta.triggers == [trigger_for(req, (11, 12, 13, 14, 15))]


def test_steps_that_do_not_schedule_the_request_do_not_trigger(prefill):
    req = FakeRequest("r2", PREFILL_PARAMS)
    admit(prefill, req)
    req.num_computed_tokens = PROMPT - 1  # even on the brink

    assert empty_step(prefill).triggers == []


def test_a_triggered_request_keeps_its_blocks_until_the_push_ends(prefill):
    req = FakeRequest("r2", PREFILL_PARAMS)
    admit(prefill, req)
    run_step(prefill, req, PROMPT, new(req, [1, 2, 3, 4, 5]))

    assert prefill.request_finished(req) == (True, None)
    assert prefill.has_pending_push_work()
    prefill.update_connector_output(finished_sending=set(), finished_recving=None)
    assert prefill.has_pending_push_work()

    prefill.update_connector_output(finished_sending={"r2"}, finished_recving=None)
    assert not prefill.has_pending_push_work()
    assert empty_step(prefill).cancels == []
    assert leftovers(prefill) == {}


def test_a_request_aborted_before_its_trigger_frees_its_blocks_and_cancels(prefill):
    req = FakeRequest("r2", PREFILL_PARAMS)
    admit(prefill, req)
    run_step(prefill, req, 256, new(req, [1, 2]))

    assert prefill.request_finished(req) == (False, None)

    assert empty_step(prefill).cancels == ["t2"]
    assert empty_step(prefill).cancels == [], "cancelled once"
    assert not prefill.has_pending_push_work()
    assert leftovers(prefill) == {}


def test_a_plain_request_on_prefill_is_freed_normally(prefill):
    req = FakeRequest("r3", None)
    admit(prefill, req)
    assert run_step(prefill, req, PROMPT, new(req, [1, 2, 3, 4, 5])).triggers == []
    assert prefill.request_finished(req) == (False, None)
    assert not prefill.has_pending_push_work()


def test_a_request_aborted_before_allocation_cancels_its_transfer(prefill):
    """Loose end of issue 9: aborted while still queued, it met the connector
    only in ``request_finished``; decode's registration must not wait out
    prefill's deadline (about 59 s)."""
    req = FakeRequest("r2", PREFILL_PARAMS)

    assert prefill.request_finished(req) == (False, None)

    assert empty_step(prefill).cancels == ["t2"]
    assert leftovers(prefill) == {}


def test_preemption_after_the_trigger_is_handed_to_the_worker_once(prefill):
    """Async scheduling: the max_tokens=1 request still runs in the next
    schedule() and can be preempted there, its blocks freed at once."""
    req = FakeRequest("r2", PREFILL_PARAMS)
    admit(prefill, req)
    run_step(prefill, req, PROMPT, new(req, [1, 2, 3, 4, 5]))  # triggers

    out = cached(req, None)
    out.preempted_req_ids = {"r2"}
    meta = prefill.build_connector_meta(out)

    assert meta.preempted == [PreemptedPush("r2", "t2")]
    assert prefill.has_pending_push_work(), "our pins hold its pushed blocks"
    # vLLM recomputes it; the recompute does not push again
    req.num_computed_tokens = 0
    again = run_step(prefill, req, PROMPT, cached(req, [7, 8, 9, 10, 11], True))
    assert again.triggers == [] and again.preempted == []
    assert prefill.request_finished(req) == (False, None), "vLLM frees its blocks"
    # the writer's WRITE ended: the pins go (test_connector_prefill_pins.py)
    prefill.update_connector_output(None, None, PushesOver({"r2": frozenset({0})}))
    assert not prefill.has_pending_push_work()
    assert leftovers(prefill) == {}


def test_preemption_before_the_trigger_needs_no_worker_action(prefill):
    req = FakeRequest("r2", PREFILL_PARAMS)
    admit(prefill, req)
    run_step(prefill, req, 256, new(req, [1, 2]))
    out = SchedulerOutput(preempted_req_ids={"r2"})
    assert prefill.build_connector_meta(out).preempted == []


def test_a_second_prefill_request_with_a_transfer_id_in_use_is_served_locally(
    prefill,
):
    first = FakeRequest("r2", PREFILL_PARAMS)
    twin = FakeRequest("r9", PREFILL_PARAMS)  # crafted: same transfer id
    admit(prefill, first)
    admit(prefill, twin)

    meta = run_step(prefill, first, PROMPT, new(first, [1, 2, 3, 4, 5]))
    twin_meta = run_step(prefill, twin, PROMPT, new(twin, [6, 7, 8, 9, 10]))

    assert meta.triggers == [trigger_for(first, (1, 2, 3, 4, 5))]
    assert twin_meta.triggers == [], "the twin never pushes"
    assert prefill.request_finished(twin) == (False, None)
    assert prefill.counters.get("rejected.duplicate") == 1
    assert prefill.request_finished(first) == (True, None), "the first goes on"


def test_a_second_decode_request_with_a_transfer_id_in_use_waits_as_a_sibling(
    decode,
):
    """vLLM's n > 1 children share one transfer id: the first registers, the
    other waits (None) and never registers (test_connector_siblings.py)."""
    sched, peers = decode
    first, twin = FakeRequest("r1", DECODE_PARAMS), FakeRequest("r9", DECODE_PARAMS)
    sched.get_num_new_matched_tokens(first, 0)
    sched.update_state_after_alloc(first, FakeBlocks([5, 6, 7, 8, 9]), PROMPT)

    assert sched.get_num_new_matched_tokens(twin, 0) == (None, False)
    assert sched.request_finished(twin) == (False, None)

    assert len(peers.messages(Registration)) == 1
    assert peers.messages(Cancel) == [], "the twin cancels nothing of the first's"
    assert [e.req_id for e in empty_step(sched).expects] == ["r1"]


def test_a_registration_that_cannot_be_sent_fails_its_receive_at_once(decode):
    sched, peers = decode
    peers.send_ok = False
    req = FakeRequest("r1", DECODE_PARAMS)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, FakeBlocks([5, 6, 7, 8, 9]), PROMPT)

    meta = empty_step(sched)
    assert [e.transfer_id for e in meta.expects] == ["t1"]
    assert [(f.transfer_id, f.cause) for f in meta.failures] == [
        ("t1", Cause.SEND_FAILED)
    ]


def test_prefills_answers_on_the_schedulers_socket_go_to_the_worker(decode):
    """A rejection of a first-contact registration arrives before any Hello:
    its only route back is the registration's own socket."""
    sched, peers = decode
    failure = Failure("t1", "p0", Cause.REJECTED, "blocks beyond decode's cache")
    peers.queue_reply(failure, (PREFILL_HOST, PREFILL_PORT))
    peers.queue_reply(HelloRequest("p0", "boot", "t1"), (PREFILL_HOST, PREFILL_PORT))

    meta = empty_step(sched)

    assert meta.failures == [failure]
    assert meta.hello_requests == [(PREFILL_HOST, PREFILL_PORT)]


# -- late binding: the claim travels from the legs to the wire ------------------

LATE_TOKEN = "k" * 43  # what secrets.token_urlsafe(32) looks like


def test_a_late_prefill_leg_triggers_with_its_claim_digest_and_no_decode(prefill):
    leg = PrefillLeg(transfer_id="t2", claim_sha256=claim_digest(LATE_TOKEN))
    req = FakeRequest("r2", leg.to_dict())
    admit(prefill, req)

    meta = run_step(prefill, req, PROMPT, new(req, [9, 3, 4, 8, 1]))

    (trigger,) = meta.triggers
    assert trigger.decode_engine_id is None
    assert trigger.claim_sha256 == claim_digest(LATE_TOKEN)


@pytest.mark.parametrize(
    ("ends_if_stopped", "ends_at_first_token", "finish_reason", "dropped"),
    [
        (True, False, "stop", True),
        (True, False, "length", False),
        (False, False, "stop", False),
        (True, True, "length", True),  # the client asked for one token
        (False, False, "length", False),
    ],
)
def test_a_late_leg_ended_at_its_first_token_drops_its_kv_at_once(
    prefill, ends_if_stopped, ends_at_first_token, finish_reason, dropped
):
    # The router ends a request whose late leg (its first token the
    # client's) stops there, or whose client asked for one token, and sends
    # no decode: the worker drops the KV the next step instead of holding
    # it to the ready deadline. vLLM keeps the blocks until the worker says
    # the push is over, as for any push.
    leg = PrefillLeg(
        transfer_id="t2",
        claim_sha256=claim_digest(LATE_TOKEN),
        ends_if_stopped=ends_if_stopped,
        ends_at_first_token=ends_at_first_token,
    )
    req = FakeRequest("r2", leg.to_dict())
    admit(prefill, req)
    assert run_step(prefill, req, PROMPT, new(req, [9, 3, 4, 8, 1])).triggers
    req.finish_reason = finish_reason

    assert prefill.request_finished(req) == (True, None)

    meta = prefill.build_connector_meta(cached(req, None))
    assert meta.cancels == (["t2"] if dropped else [])
    assert prefill.counters.get("ended.at_first_token") == (1 if dropped else 0)


def test_decode_registers_with_the_claim_token_of_its_leg(decode):
    sched, peers = decode
    params = {**DECODE_PARAMS, "claim_token": LATE_TOKEN}
    req = FakeRequest("r1", params)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, FakeBlocks([5, 6, 7, 8, 9]), PROMPT)

    (reg,) = peers.messages(Registration)
    assert reg.claim_token == LATE_TOKEN
    early = FakeRequest("r2", {**DECODE_PARAMS, "transfer_id": "t3"})
    sched.get_num_new_matched_tokens(early, 0)
    sched.update_state_after_alloc(early, FakeBlocks([1, 2, 3, 4, 10]), PROMPT)
    assert peers.messages(Registration)[1].claim_token is None


# -- the first token: prefill's, told to an early-bound decode ------------------


def test_prefill_tells_an_early_bound_decode_the_token_it_sampled(prefill):
    req = FakeRequest("r2", PREFILL_PARAMS, output_token_ids=[77])
    admit(prefill, req)
    run_step(prefill, req, PROMPT, new(req, [9, 3, 4, 8, 1]))

    assert prefill.request_finished(req) == (True, None)

    assert empty_step(prefill).first_tokens == {"t2": (77, None)}
    assert empty_step(prefill).first_tokens == {}, "told once"


def test_prefill_tells_the_first_tokens_logprobs_kept_for_it(prefill):
    req = FakeRequest("r2", PREFILL_PARAMS, output_token_ids=[77])
    admit(prefill, req)
    run_step(prefill, req, PROMPT, new(req, [9, 3, 4, 8, 1]))
    logprobs = SampleLogprobs((77, 5), (-0.25, -1.5), rank=1)
    prefill.keep_first_logprobs(req, logprobs)

    prefill.request_finished(req)

    assert empty_step(prefill).first_tokens == {"t2": (77, logprobs)}
    other = FakeRequest("r3", {**PREFILL_PARAMS, "transfer_id": "t3"})
    prefill.keep_first_logprobs(other, logprobs)  # never scheduled: a late
    prefill.request_finished(other)  # ... finish forgets them
    assert prefill._first_logprobs == {}


@pytest.mark.parametrize(
    ("leg", "tokens"),
    [
        # late binding: decode's leg starts from the token already
        (PrefillLeg(transfer_id="t2", claim_sha256=claim_digest("k" * 43)), [77]),
        # the router ends the request at this token: no decode continues
        (PrefillLeg("t2", decode_engine_id="d0", ends_at_first_token=True), [77]),
        # aborted before it sampled one
        (PrefillLeg(transfer_id="t2", decode_engine_id="d0"), []),
    ],
)  # fmt: skip
def test_prefill_tells_no_token_where_no_decode_waits_for_one(prefill, leg, tokens):
    req = FakeRequest("r2", leg.to_dict(), output_token_ids=tokens)
    admit(prefill, req)
    run_step(prefill, req, PROMPT, new(req, [9, 3, 4, 8, 1]))

    prefill.request_finished(req)

    assert empty_step(prefill).first_tokens == {}


def _landing(
    sched: DecodeScheduler, params: dict[str, Any] = DECODE_PARAMS, rid: str = "r1"
) -> FakeRequest:
    req = FakeRequest(rid, params)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, FakeBlocks([5, 6, 7, 8, 9]), PROMPT)
    return req


def test_decode_hands_prefills_first_token_to_the_scheduler_class_once(decode):
    sched, peers = decode
    req = _landing(sched)
    assert sched.awaits_first_token(req) is True
    assert sched.first_token(req) is None  # not come yet
    peers.queue_reply(FirstToken("t1", "p0", 77), (PREFILL_HOST, PREFILL_PORT))

    assert sched.awaits_first_token(req) is False  # read from the socket
    assert sched.first_token(req) == FirstToken("t1", "p0", 77)
    assert sched.first_token(req) is None, "taken"
    sched.first_token_outcome(None)
    assert sched.counters.get("first_token.missing") == 2
    assert sched.counters.get("first_token.continued") == 1


def test_a_first_token_for_a_late_leg_or_after_the_request_is_not_kept(decode):
    sched, peers = decode
    late = DecodeLeg(
        transfer_id="t1",
        prefill_engine_id="p0",
        prefill_host=PREFILL_HOST,
        prefill_port=PREFILL_PORT,
        num_kv_tokens=PROMPT - 1,
    )
    req = _landing(sched, late.to_dict())
    assert sched.awaits_first_token(req) is False
    peers.queue_reply(FirstToken("t1", "p0", 77), (PREFILL_HOST, PREFILL_PORT))
    assert sched.first_token(req) is None  # its prompt ends with the token

    other = DecodeLeg(
        transfer_id="t3",
        prefill_engine_id="p0",
        prefill_host=PREFILL_HOST,
        prefill_port=PREFILL_PORT,
    )
    early = _landing(sched, other.to_dict(), rid="r3")
    peers.queue_reply(FirstToken("t3", "p0", 78), (PREFILL_HOST, PREFILL_PORT))
    empty_step(sched)  # read, kept for r3
    sched.request_finished(early)  # aborted before its KV landed
    assert sched.first_token(early) is None, "forgotten with its request"
