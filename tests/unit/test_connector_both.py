"""``kv_role: kv_both``: one instance that serves prefill legs and decode
legs, as vLLM's NixlConnector deployments configure every instance.

The connector runs a prefill side and a decode side next to each other and
sends each request to one of them by its leg: decode legs to the decode
side, everything else to the prefill side. Config first, then the leg
classifier, then the connector's scheduler side driven as vLLM drives it
(both legs of one transfer on one instance included), then its worker side.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.outputs import KVConnectorOutput

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.connector import KvPushConnector
from kvpush.connector.counters import Counters
from kvpush.connector.decode.scheduler import DecodeScheduler
from kvpush.connector.legs import is_decode_leg
from kvpush.connector.metadata import (
    BothMetadata,
    DecodeMetadata,
    PrefillMetadata,
    PushesOver,
    PushTrigger,
    RecvExpect,
)
from kvpush.connector.prefill.scheduler import PrefillScheduler
from kvpush.connector.trace import Tracer
from kvpush.transfer.groups import one
from kvpush.transfer.messages import DecodeLeg, PrefillLeg, Registration
from tests.fakes.fake_nixl import FakePeers, leftovers
from tests.unit.test_connector_scheduler import (
    DECODE_PARAMS,
    PREFILL_PARAMS,
    PROMPT,
    FakeBlocks,
    FakeRequest,
    NewReq,
    SchedulerOutput,
    config_for,
)


def vllm_config(kv_role: str, tp_size: int = 1) -> SimpleNamespace:
    kv = SimpleNamespace(
        kv_role=kv_role,
        engine_id="both0",
        kv_connector_extra_config={"side_channel_port": 5600},
    )
    return SimpleNamespace(
        kv_transfer_config=kv,
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size),
        instance_id="boot",
    )


# -- config ----------------------------------------------------------------------


def test_kv_both_is_a_prefill_side_and_a_decode_side_of_one_engine() -> None:
    config = ConnectorConfig.from_vllm(vllm_config("kv_both"), tp_rank=0)

    prefill, decode = config.sides
    assert (config.role, prefill.role, decode.role) == ("both", "prefill", "decode")
    assert prefill.engine_id == decode.engine_id == "both0"
    assert prefill.side_channel_port == decode.side_channel_port == 5600
    assert replace(prefill, role="both", of_both=False) == config, "nothing else"


def test_the_decode_side_of_kv_both_runs_an_agent_of_its_own_name() -> None:
    """Two NIXL agents in one process: the decode side's name differs from
    the prefill side's, and from any one-role engine's (those end in the
    rank number)."""
    both = ConnectorConfig.from_vllm(vllm_config("kv_both", tp_size=2), tp_rank=1)
    prefill, decode = both.sides
    alone = ConnectorConfig.from_vllm(vllm_config("kv_consumer", tp_size=2), tp_rank=1)

    assert prefill.agent_name == alone.agent_name == "kvpush-both0-rank1"
    assert decode.agent_name == "kvpush-both0-rank1-decode"
    assert alone.sides == (alone,)


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer", "kv_both"])
def test_every_kv_role_of_vllm_is_taken(kv_role: str) -> None:
    roles = [s.role for s in ConnectorConfig.from_vllm(vllm_config(kv_role)).sides]
    expected = {
        "kv_producer": ["prefill"],
        "kv_consumer": ["decode"],
        "kv_both": ["prefill", "decode"],
    }
    assert roles == expected[kv_role]


def test_an_unknown_kv_role_names_the_three_it_takes() -> None:
    with pytest.raises(ValueError, match=r"kv_producer.*kv_consumer.*kv_both"):
        ConnectorConfig.from_vllm(vllm_config("kv_neither"))


# -- which side a request goes to ------------------------------------------------


@pytest.mark.parametrize(
    ("params", "decodes"),
    [
        (DECODE_PARAMS, True),
        (PREFILL_PARAMS, False),
        ({"do_remote_prefill": True, "remote_request_id": "x"}, True),
        ({"do_remote_decode": True, "do_remote_prefill": False}, False),
        ({"do_remote_decode": True, "do_remote_prefill": True}, False),  # refused
        ({"role": "decode"}, True),  # malformed: the decode side refuses it
        ({"role": "prefill", "do_remote_prefill": True}, False),  # kvpush's wins
        ({}, False),
        (None, False),
        ("decode", False),
    ],
)
def test_decode_legs_are_told_from_every_other_request(params: Any, decodes: bool):
    assert is_decode_leg(params) is decodes


# -- the scheduler side ----------------------------------------------------------


def both_connector() -> tuple[KvPushConnector, FakePeers]:
    """A kv_both connector's scheduler side (vLLM's config is not needed:
    the sides are made from the tests' configs), decode's sends captured."""
    conn = object.__new__(KvPushConnector)
    conn._prefill = PrefillScheduler(
        replace(config_for("prefill"), push_granularity="request")
    )
    decode = DecodeScheduler(config_for("decode"))
    decode._peers.close()
    peers = FakePeers()
    decode._peers = peers  # type: ignore[assignment]
    decode._send = peers.send
    conn._decode = decode
    conn._prefill_worker = conn._decode_worker = None
    return conn, peers


def test_each_leg_is_served_by_its_side_in_one_step() -> None:
    conn, peers = both_connector()
    pre, dec = FakeRequest("pre", PREFILL_PARAMS), FakeRequest("dec", DECODE_PARAMS)

    assert conn.get_num_new_matched_tokens(pre, 0) == (0, False)
    assert conn.get_num_new_matched_tokens(dec, 0) == (PROMPT, True)
    conn.update_state_after_alloc(pre, FakeBlocks([1, 2, 3, 4, 5]), 0)
    conn.update_state_after_alloc(dec, FakeBlocks([6, 7, 8, 9, 10]), PROMPT)
    out = SchedulerOutput(
        scheduled_new_reqs=[NewReq("pre", ([1, 2, 3, 4, 5],))],
        num_scheduled_tokens={"pre": PROMPT},
    )
    meta = conn.build_connector_meta(out)

    assert isinstance(meta, BothMetadata)
    assert meta.prefill.triggers == [
        PushTrigger("pre", "t2", one((1, 2, 3, 4, 5)), PROMPT, "d0")
    ]
    assert meta.decode.expects == [
        RecvExpect("dec", "t1", one((6, 7, 8, 9, 10)), "p0", "127.0.0.1", 5600)
    ]
    (reg,) = peers.messages(Registration)
    assert (reg.transfer_id, reg.dst_block_ids) == ("t1", one((6, 7, 8, 9, 10)))


def test_finished_requests_are_released_by_the_side_that_held_them() -> None:
    conn, _ = both_connector()
    pre, dec = FakeRequest("pre", PREFILL_PARAMS), FakeRequest("dec", DECODE_PARAMS)
    for req, blocks, external in (
        (pre, [1, 2, 3, 4, 5], 0),
        (dec, [6, 7, 8, 9, 10], PROMPT),
    ):
        conn.get_num_new_matched_tokens(req, 0)
        conn.update_state_after_alloc(req, FakeBlocks(blocks), external)
    out = SchedulerOutput(
        scheduled_new_reqs=[NewReq("pre", ([1, 2, 3, 4, 5],))],
        num_scheduled_tokens={"pre": PROMPT},
    )
    conn.build_connector_meta(out)
    pre.num_computed_tokens = PROMPT

    assert conn.request_finished(pre, [1, 2, 3, 4, 5]) == (True, None), "pushing"
    assert conn.request_finished(dec, [6, 7, 8, 9, 10]) == (True, None), "KV on the way"
    meta = conn.build_connector_meta(SchedulerOutput())
    assert isinstance(meta, BothMetadata)
    assert meta.decode.recv_cancels == ["t1"] and meta.prefill.cancels == []
    assert conn.has_pending_push_work()

    conn.update_connector_output(
        KVConnectorOutput(finished_sending={"pre"}, finished_recving={"dec"})
    )
    assert not conn.has_pending_push_work()
    assert leftovers(conn._prefill) == {} and leftovers(conn._decode) == {}


def test_both_legs_of_one_transfer_on_one_instance_are_each_served() -> None:
    """A router may send a request's prefill leg and its decode leg to the
    same kv_both instance: the transfer id is the prefill side's in one
    request and the decode side's in the other, so neither is refused as
    a second use of the id."""
    conn, peers = both_connector()
    tid = "self-pair"
    pre = FakeRequest(
        "pre", PrefillLeg(transfer_id=tid, decode_engine_id="d0").to_dict()
    )
    dec = FakeRequest(
        "dec",
        DecodeLeg(
            transfer_id=tid,
            prefill_engine_id="p0",
            prefill_host="127.0.0.1",
            prefill_port=5601,
        ).to_dict(),
    )
    conn.get_num_new_matched_tokens(pre, 0)
    conn.update_state_after_alloc(pre, FakeBlocks([1, 2, 3, 4, 5]), 0)

    assert conn.get_num_new_matched_tokens(dec, 0) == (PROMPT, True)
    conn.update_state_after_alloc(dec, FakeBlocks([6, 7, 8, 9, 10]), PROMPT)
    assert [r.transfer_id for r in peers.messages(Registration)] == [tid]
    assert conn._prefill is not None and conn._decode is not None
    counts = {**conn._prefill.counters.snapshot(), **conn._decode.counters.snapshot()}
    assert "rejected.duplicate" not in counts


def test_a_request_without_a_leg_is_served_locally_by_the_prefill_side() -> None:
    conn, peers = both_connector()
    plain = FakeRequest("plain", None)

    assert conn.get_num_new_matched_tokens(plain, 0) == (0, False)
    conn.update_state_after_alloc(plain, FakeBlocks([1]), 0)
    assert conn.request_finished(plain, [1]) == (False, None)
    assert peers.sent == []


def test_vllms_hooks_reach_the_prefill_side_of_kv_both() -> None:
    conn, _ = both_connector()

    conn.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=PushesOver({"x": frozenset({0})}))
    )
    assert not conn.has_pending_block_frees()


# -- the worker side -------------------------------------------------------------


@dataclass
class FakeSide:
    """A worker side: records what the connector hands it."""

    finished: set[str] = field(default_factory=set)
    calls: list[tuple[str, Any]] = field(default_factory=list)
    counters: Counters = field(default_factory=Counters)
    tracer: Tracer = field(default_factory=lambda: Tracer("", "w"))

    def bind(self, meta: Any) -> None:
        self.calls.append(("bind", meta))

    def register_kv_caches(self, kv_caches: Any) -> None:
        self.calls.append(("register", kv_caches))

    def save_kv_layer(self, name: str) -> None:
        self.calls.append(("layer", name))

    def wait_for_save(self) -> None:
        self.calls.append(("save", None))

    def handle_preemptions(self, meta: Any) -> None:
        self.calls.append(("preempt", meta))

    def build_worker_meta(self) -> PushesOver:
        return PushesOver({"pre": frozenset({0})})

    def take_load_errors(self) -> set[int]:
        return {7}

    def close(self) -> None:
        self.calls.append(("close", None))


class FakePrefillWorker(FakeSide):
    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        return self.finished


class FakeDecodeWorker(FakeSide):
    def get_finished(self) -> set[str]:
        return self.finished

    def take_quarantined(self) -> dict[str, int]:
        return {}


def both_workers() -> tuple[KvPushConnector, FakePrefillWorker, FakeDecodeWorker]:
    conn = object.__new__(KvPushConnector)
    prefill, decode = FakePrefillWorker(), FakeDecodeWorker()
    conn._prefill = conn._decode = None
    conn._prefill_worker, conn._decode_worker = prefill, decode  # type: ignore[assignment]
    conn._connector_metadata = None
    return conn, prefill, decode


def test_each_worker_side_gets_its_part_of_the_steps_metadata() -> None:
    conn, prefill, decode = both_workers()
    meta = BothMetadata(
        PrefillMetadata(cancels=["a"]), DecodeMetadata(recv_cancels=["b"])
    )

    conn.register_kv_caches({})
    conn.bind_connector_metadata(meta)
    conn.handle_preemptions(meta)
    conn.save_kv_layer("layer.0", None, None)  # type: ignore[arg-type]
    conn.wait_for_save()
    conn.shutdown()

    assert prefill.calls == [
        ("register", {}),
        ("bind", meta.prefill),
        ("preempt", meta.prefill),
        ("layer", "layer.0"),
        ("save", None),
        ("close", None),
    ]
    assert decode.calls == [("register", {}), ("bind", meta.decode), ("close", None)]


def test_the_worker_reports_prefills_sends_and_decodes_receives() -> None:
    conn, prefill, decode = both_workers()
    assert conn.get_finished({"x"}) == (None, None)

    prefill.finished, decode.finished = {"pre"}, {"dec"}
    assert conn.get_finished({"x"}) == ({"pre"}, {"dec"})
    assert conn.build_connector_worker_meta() == PushesOver({"pre": frozenset({0})})
    assert conn.get_block_ids_with_load_errors() == {7}


def test_the_stats_are_both_sides_counts() -> None:
    conn, prefill, decode = both_workers()
    prefill.counters.add("fallback")
    decode.counters.add("fallback")
    decode.counters.add("digest_verified")

    stats = conn.get_kv_connector_stats()
    assert stats is not None
    assert stats.payload.events == {"fallback": 2, "digest_verified": 1}
    assert conn.get_kv_connector_stats() is None, "taken"
