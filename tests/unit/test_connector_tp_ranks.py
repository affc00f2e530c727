"""Tensor parallelism: every worker rank is a transfer endpoint (issue 10,
items 1 and 2: homogeneous TP, rank r writes to rank r).

Decode's ranks get the same metadata (vLLM broadcasts the scheduler's
connector metadata to every worker); vLLM counts a request's receive
finished only once every rank reported it, and unions their load errors
(``KVOutputAggregator``): :class:`Aggregate` models that, so a test can
state what vLLM sees. Every rank's Done is required; a Failure from any
prefill rank, or a lost rank, fails the whole transfer; an abort reaches
every rank; nothing is left held on any rank.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.metadata import DecodeMetadata
from kvpush.transfer.messages import (
    Cancel,
    Cause,
    DecodeLeg,
    Done,
    Failure,
    Hello,
    HelloReply,
    Registration,
)
from kvpush.transfer.ranks import TpPair, agent_name, side_channel_port
from tests.fakes.fake_nixl import wait_for
from tests.unit.test_connector_scheduler import (
    FakeBlocks,
    FakeRequest,
    empty_step,
    make_decode,
)
from tests.unit.test_connector_worker import (
    LAYOUT,
    PREFILL_ADDR,
    Decode,
    FakeTime,
    assert_idle,
    clock,  # noqa: F401  (a fixture)
    close_decode,
    make_config,
    recv_expect,
)
from tests.unit.test_connector_worker import (
    make_decode as make_decode_worker,
)
from tests.unit.test_connector_writer import DECODE_ROUTE, Rig

TP = 2
HOST, BASE = PREFILL_ADDR
RANK_ADDR = [(HOST, BASE + r) for r in range(TP)]  # prefill rank r's side channel
BLOCKS_T1 = {3, 4, 5}


# -- endpoints -------------------------------------------------------------------


def test_each_rank_has_its_own_agent_name_and_side_channel_port():
    configs = [make_config("prefill", rank, 4) for rank in range(4)]
    assert [c.listen_port for c in configs] == [5601, 5602, 5603, 5604]
    names = {c.agent_name for c in configs}
    names |= {make_config("decode", rank, 4).agent_name for rank in range(4)}
    assert len(names) == 8  # distinct per rank and per engine
    assert agent_name("p0", 1) == "kvpush-p0-rank1"
    assert side_channel_port(5600, 3) == 5603


def test_a_rank_outside_the_tp_size_or_ports_past_65535_are_refused():
    with pytest.raises(ValueError, match="TP rank 2 outside TP size 2"):
        make_config("decode", 2, 2)
    with pytest.raises(ValueError, match="room for one port per TP rank"):
        ConnectorConfig("decode", "d0", "127.0.0.1", 65535, 16, tp_size=2)
    with pytest.raises(ValueError, match="prefill_port"):
        DecodeLeg("t1", "p0", HOST, 65535, prefill_tp=2)


def test_homogeneous_tp_maps_rank_r_to_rank_r_whole_blocks():
    for pair in (TpPair(4, 4), TpPair(4, 4, total_kv_heads=2)):
        assert pair.problem() is None
        assert [pair.target_ranks(r) for r in range(4)] == [{0}, {1}, {2}, {3}]
        assert [pair.sources_of(r) for r in range(4)] == [{0}, {1}, {2}, {3}]
        assert all(s.is_whole_block for r in range(4) for s in pair.targets_of(r))
    with pytest.raises(ValueError, match="outside TP size"):
        TpPair(4, 4).sources_of(4)


def test_different_tp_sizes_need_the_heads_and_sizes_that_divide_them():
    assert "KV heads is unknown" in (TpPair(2, 1).problem() or "")
    with pytest.raises(ValueError, match="KV heads is unknown"):
        TpPair(2, 1).targets_of(0)
    assert TpPair(2, 1, total_kv_heads=2).problem() is None
    assert "must divide" in (TpPair(3, 2, total_kv_heads=4).problem() or "")
    assert "NHD-style" in (TpPair(1, 2, 2).problem("LBNHC") or "")


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_mla_latent_is_written_to_each_decode_rank_once_and_whole(
    prefill_tp: int, decode_tp: int
):
    # MLA is one KV "head" (connector config: total_kv_heads 1) that every
    # rank holds whole: any pair of TP sizes maps, with no head split.
    pair = TpPair(prefill_tp, decode_tp, total_kv_heads=1)
    assert pair.problem("LBNHC") is None
    writes = [s for p in range(prefill_tp) for s in pair.targets_of(p)]
    assert sorted(s.dst_rank for s in writes) == list(range(decode_tp))
    assert all(s.is_whole_block for s in writes)
    for d in range(decode_tp):
        assert pair.sources_of(d) == {d % prefill_tp}


def test_a_hello_names_its_rank_below_its_tp_size():
    hello = Hello("d0", "b0", "a", b"", LAYOUT, rank=1, tp_size=2)
    assert hello.rank == 1
    with pytest.raises(ValueError, match="rank must be below tp_size"):
        Hello("d0", "b0", "a", b"", hello.layout, rank=2, tp_size=2)


# -- decode's scheduler: one registration, to every prefill rank ----------------

LEG = DecodeLeg("t1", "p0", HOST, BASE, prefill_tp=TP)


def test_decode_registers_once_with_every_prefill_rank():
    sched, peers = make_decode(tp_size=TP)
    req = FakeRequest("r1", LEG.to_dict())
    assert sched.get_num_new_matched_tokens(req, 0) == (600, True)
    sched.update_state_after_alloc(req, FakeBlocks([1, 2, 3, 4, 5]), 600)

    sent = [(host, port) for host, port, m in peers.sent if isinstance(m, Registration)]
    assert sent == RANK_ADDR
    assert len({m for *_, m in peers.sent}) == 1, "the same registration to all"
    (expect,) = empty_step(sched).expects
    assert (expect.prefill_port, expect.prefill_tp) == (BASE, TP)
    sched.close()


def test_a_registration_not_sent_to_one_rank_is_that_ranks_failure():
    sched, peers = make_decode(tp_size=TP)
    sends = iter([True, False])
    sched._send = lambda host, port, m: next(sends) and peers.send(host, port, m)
    req = FakeRequest("r1", LEG.to_dict())
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, FakeBlocks([1, 2, 3, 4, 5]), 600)

    (failure,) = empty_step(sched).failures
    assert (failure.cause, failure.rank) == (Cause.SEND_FAILED, 1)
    sched.close()


def test_decodes_own_cancel_goes_to_every_prefill_rank():
    sched, peers = make_decode(tp_size=TP)
    req = FakeRequest("r1", LEG.to_dict())
    sched.request_finished(req)  # aborted before it registered
    cancels = [(h, p) for h, p, m in peers.sent if isinstance(m, Cancel)]
    assert cancels == RANK_ADDR
    sched.close()


def test_a_leg_naming_another_prefill_tp_is_served_locally_and_counted():
    sched, peers = make_decode(tp_size=TP)
    leg = DecodeLeg("t1", "p0", HOST, BASE)  # prefill TP 1, decode TP 2
    req = FakeRequest("r1", leg.to_dict())
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.counters.get("rejected.incompatible") == 1
    assert not peers.messages(Registration)
    assert peers.messages(Cancel), "prefill is told not to wait"
    sched.close()


# -- decode's worker ranks --------------------------------------------------------


class Aggregate:
    """What vLLM's scheduler sees of every rank's ``get_finished`` and load
    errors (vLLM's ``KVOutputAggregator``: a request is finished once every
    rank reported it; invalid blocks are the union of every rank's)."""

    def __init__(self, ranks: list[Decode]) -> None:
        self.ranks = ranks
        self._remaining: dict[str, int] = {}
        self.finished: set[str] = set()
        self.load_errors: set[int] = set()

    def step(self, meta: DecodeMetadata | None = None) -> set[str]:
        """One engine step on every rank (the same metadata for all)."""
        newly = set()
        for rank in self.ranks:
            rank.worker.bind(meta or DecodeMetadata())
            for rid in rank.worker.get_finished():
                left = self._remaining.get(rid, len(self.ranks)) - 1
                self._remaining[rid] = left
                if left == 0:
                    del self._remaining[rid]
                    newly.add(rid)
            self.load_errors |= rank.worker.take_load_errors()
        self.finished |= newly
        return newly


@pytest.fixture
def ranks(clock: FakeTime) -> Iterator[Aggregate]:  # noqa: F811
    rigs = [make_decode_worker(clock, rank, TP) for rank in range(TP)]
    yield Aggregate(rigs)
    for rig in rigs:
        close_decode(rig)


def expect_all(agg: Aggregate) -> None:
    agg.step(DecodeMetadata(expects=[recv_expect("t1", "r1", prefill_tp=TP)]))


def sent_to(rank: Decode, kind: type) -> list[tuple[str, int]]:
    return [(h, p) for h, p, m in rank.peers.sent if isinstance(m, kind)]


def assert_all_idle(agg: Aggregate) -> None:
    for rank in agg.ranks:
        assert_idle(rank.worker)


def test_each_decode_rank_greets_only_the_prefill_rank_it_receives_from(ranks):
    expect_all(ranks)
    for r, rank in enumerate(ranks.ranks):
        assert sent_to(rank, Hello) == [RANK_ADDR[r]]
        (hello,) = rank.peers.messages(Hello)
        assert (hello.rank, hello.tp_size) == (r, TP)
        assert rank.heartbeats.targets == {RANK_ADDR[r]}
    # a HelloRequest forwarded by the scheduler from prefill rank 1
    ranks.step(DecodeMetadata(hello_requests=[RANK_ADDR[1]]))
    assert sent_to(ranks.ranks[0], Hello) == [RANK_ADDR[0]], "not rank 0's peer"
    assert sent_to(ranks.ranks[1], Hello) == [RANK_ADDR[1]] * 2
    for rank in ranks.ranks:
        rank.done("t1", rank=rank.worker.config.tp_rank)
    assert ranks.step() == {"r1"}


def test_the_receive_finishes_only_once_every_rank_has_its_done(ranks):
    expect_all(ranks)
    rank0, rank1 = ranks.ranks
    rank0.done("t1", rank=0)
    rank1.done("t1", rank=0)  # not from its source: no word on its receive
    assert ranks.step() == set()
    assert rank1.worker.reserved_blocks() == 3

    rank1.done("t1", rank=1)
    assert ranks.step() == {"r1"}
    assert ranks.load_errors == set()
    assert_all_idle(ranks)


def test_a_failure_from_one_prefill_rank_fails_the_transfer_on_every_rank(ranks):
    expect_all(ranks)
    rank0, rank1 = ranks.ranks
    # prefill rank 1 refused the registration; the scheduler forwards its
    # Failure to every decode rank
    failure = Failure("t1", "p0", Cause.REJECTED, "beyond the cache", rank=1)
    assert ranks.step(DecodeMetadata(failures=[failure])) == set()
    # rank 0 asks its prefill rank for the final word and keeps the blocks
    (cancel,) = rank0.peers.messages(Cancel)
    assert sent_to(rank0, Cancel) == [RANK_ADDR[0]] and cancel.transfer_id == "t1"
    assert rank1.peers.messages(Cancel) == [], "its own rank's word is in"
    assert rank0.worker.reserved_blocks() == 3

    # prefill rank 0's WRITE was already in flight: its Done answers
    rank0.done("t1", rank=0)
    assert ranks.step() == {"r1"}
    assert ranks.load_errors == BLOCKS_T1, "rank 0 fails too: nothing is used"
    assert rank0.worker.counters.get("receive_failed.rejected") == 1
    assert rank1.worker.counters.get("receive_failed.rejected") == 1
    assert_all_idle(ranks)


def test_a_rank_whose_prefill_rank_is_gone_fails_the_whole_transfer(ranks):
    expect_all(ranks)
    rank0, rank1 = ranks.ranks
    for r, rank in enumerate(ranks.ranks):
        rank.peers.connection(RANK_ADDR[r], up=True)
    ranks.step()

    rank1.peers.connection(RANK_ADDR[1], up=False)  # loopback: proven gone
    rank0.done("t1", rank=0)

    assert ranks.step() == {"r1"}
    assert ranks.load_errors == BLOCKS_T1
    assert rank1.worker.counters.get("receive_failed.peer_lost") == 1
    assert_all_idle(ranks)


def test_a_lost_prefill_engine_fails_every_rank_at_once(ranks):
    expect_all(ranks)
    for r, rank in enumerate(ranks.ranks):
        rank.peers.connection(RANK_ADDR[r], up=True)
    ranks.step()
    for r, rank in enumerate(ranks.ranks):  # one rank's death stops its engine
        rank.peers.connection(RANK_ADDR[r], up=False)

    assert ranks.step() == {"r1"}
    assert ranks.load_errors == BLOCKS_T1
    assert_all_idle(ranks)


def test_an_abort_reaches_every_rank_and_each_waits_for_its_own_answer(ranks):
    expect_all(ranks)
    rank0, rank1 = ranks.ranks
    ranks.step(DecodeMetadata(recv_cancels=["t1"]))
    for r, rank in enumerate(ranks.ranks):
        assert sent_to(rank, Cancel) == [RANK_ADDR[r]]

    rank0.peers.queue_reply(Failure("t1", "p0", Cause.CANCELLED, rank=0), RANK_ADDR[0])
    assert ranks.step() == set(), "rank 1's prefill rank may still write"
    assert rank1.worker.reserved_blocks() == 3

    rank1.done("t1", rank=1)  # its WRITE was in flight: its Done answers
    assert ranks.step() == {"r1"}
    assert ranks.load_errors == set(), "an aborted receive reports no errors"
    assert_all_idle(ranks)


def test_a_refused_hello_fails_that_ranks_receive_with_a_clear_cause(ranks):
    expect_all(ranks)
    rank0, rank1 = ranks.ranks
    reason = "heterogeneous tensor parallelism is not yet supported"
    reply = HelloReply("p0", accepted=False, boot_id="pb", reason=reason, rank=1)
    rank1.peers.queue_reply(reply, RANK_ADDR[1])
    rank0.done("t1", rank=0)
    assert ranks.step() == {"r1"}
    assert ranks.load_errors == BLOCKS_T1
    assert rank1.worker.counters.get("receive_failed.incompatible") == 1
    assert rank1.worker.counters.get("fallback") == 1
    assert_all_idle(ranks)


# -- prefill's ranks ---------------------------------------------------------------


@pytest.fixture
def rank1() -> Iterator[Rig]:
    """Prefill worker rank 1 of 2 (it writes to decode rank 1)."""
    r = Rig(rank=1, tp_size=TP)
    yield r
    r.close()


def hello_reply(rig: Rig) -> HelloReply:
    assert wait_for(lambda: rig.replies_to(DECODE_ROUTE, HelloReply))
    (reply,) = rig.replies_to(DECODE_ROUTE, HelloReply)
    assert isinstance(reply, HelloReply)
    return reply


def test_a_prefill_rank_writes_to_its_decode_rank_and_names_itself(rank1: Rig):
    rank1.hello()
    assert hello_reply(rank1).accepted and hello_reply(rank1).rank == 1
    rank1.register()
    rank1.ready()
    assert rank1.wait_finished("req-1")
    (write,) = rank1.io.writes_snapshot()
    assert write.message == Done("t1", "p0", num_blocks=4, rank=1)
    assert wait_for(lambda: rank1.decode_io.notifications() == [write.notif])


def test_a_decode_of_another_tp_size_is_refused_with_the_reason(rank1: Rig):
    rank1.hello(rank=0, tp_size=1)
    reply = hello_reply(rank1)
    assert not reply.accepted
    assert "differ and the model's number of KV heads is unknown" in reply.reason
    assert rank1.counters.get("rejected.incompatible") == 1
    rank1.register(ttl_s=1.2)
    rank1.ready()
    assert rank1.wait_finished("req-1")  # never written; freed at its deadline
    assert rank1.io.writes_snapshot() == []
    (failure,) = [m for m in rank1.replies_to(DECODE_ROUTE, Failure)]
    assert isinstance(failure, Failure) and failure.rank == 1


def test_a_decode_rank_this_prefill_rank_does_not_write_to_is_refused(rank1: Rig):
    rank1.hello(rank=0)
    reply = hello_reply(rank1)
    assert not reply.accepted
    assert "does not write to decode rank 0" in reply.reason
