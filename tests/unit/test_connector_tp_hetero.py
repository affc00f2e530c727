"""Heterogeneous tensor parallelism (issue 10, items 3 and 4): prefill TP P
pushes to decode TP D for a model of K KV heads, each prefill rank writing
its head slice of every block to the decode ranks the mapping
(:class:`~kvpush.transfer.ranks.TpPair`) names.

Each prefill rank is a real writer over the shared fake NIXL
(:class:`~tests.unit.test_connector_writer.Rig`), linked to one fake agent
per decode rank; :class:`~tests.fakes.fake_nixl.FakeMemory` applies the
WRITEs' descriptors so a test can compare bytes: every head of every
destination block must hold the source's bytes of that head. Decode's side
(every rank waits for its writers' Done) runs the decode worker ranks under
:class:`~tests.unit.test_connector_tp_ranks.Aggregate`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpush.connector.metadata import DecodeMetadata
from kvpush.transfer.digest import VERIFY_OFF, VerifyPolicy
from kvpush.transfer.messages import Cancel, Cause, Done, Failure, HelloReply, decode
from kvpush.transfer.ranks import TpPair
from kvpush.transfer.shares import HeadShare
from tests.fakes.fake_nixl import FakeMemory, FakeNixlIO, wait_for
from tests.unit.test_connector_tp_ranks import Aggregate, assert_all_idle
from tests.unit.test_connector_worker import (
    PREFILL_ADDR,
    FakeTime,
    clock,  # noqa: F401  (a fixture)
    close_decode,
    recv_expect,
)
from tests.unit.test_connector_worker import make_decode as make_decode_worker
from tests.unit.test_connector_writer import (
    DECODE_ROUTE,
    DST_BASE,
    NUM_LAYERS,
    Rig,
    layout,
)
from tests.unit.test_connector_writer_stream import chunk

HEAD_BYTES = 64  # one head of one block of one layer
SRC = (4, 5, 6, 9)  # Rig.ready's prompt blocks
DST = (10, 11, 12, 13)  # Rig.register's


class Cluster:
    """Every prefill rank's writer and every decode rank's agent and memory."""

    def __init__(
        self,
        prefill_tp: int,
        decode_tp: int,
        heads: int,
        verify: VerifyPolicy = VERIFY_OFF,
    ) -> None:
        self.pair = TpPair(prefill_tp, decode_tp, heads)
        self.decode_ios = [
            FakeNixlIO(f"kvpush-d0-rank{d}", layout(DST_BASE, self._block(d, False)))
            for d in range(decode_tp)
        ]
        self.rigs = [
            Rig(
                rank=r,
                tp_size=prefill_tp,
                decode_ios=self.decode_ios,
                total_kv_heads=heads,
                block_bytes=self._block(r, True),
                verify=verify,
            )
            for r in range(prefill_tp)
        ]
        self.src_mem = [rig.memory for rig in self.rigs]  # what digests hash
        self.dst_mem = [FakeMemory(io.layout) for io in self.decode_ios]
        for r, mem in enumerate(self.src_mem):
            self._fill(mem, self.rigs[r].io.layout, self.pair.mapping.prefill_share(r))

    def _block(self, rank: int, prefill: bool) -> int:
        m = self.pair.mapping
        share = m.prefill_share(rank) if prefill else m.decode_share(rank)
        return share.num_heads * HEAD_BYTES

    @staticmethod
    def _fill(mem: FakeMemory, lay: object, share: HeadShare) -> None:
        """Each head of each block holds (layer, block, global head)."""
        for layer in range(NUM_LAYERS):
            base = lay.base_addrs[layer]  # type: ignore[attr-defined]
            for block in SRC:
                for j, head in enumerate(share.heads):
                    addr = base + block * share.num_heads * HEAD_BYTES + j * HEAD_BYTES
                    mem.put(addr, bytes([layer, block, head, 7]) * (HEAD_BYTES // 4))

    def say_hellos(self) -> None:
        """Each decode rank greets the prefill ranks that write to it."""
        for d in range(self.pair.decode_tp):
            for r in self.pair.sources_of(d):
                self.rigs[r].hello(rank=d)

    def push(self) -> None:
        for rig in self.rigs:
            rig.register()
            rig.ready()
        assert all(rig.wait_finished("req-1") for rig in self.rigs), "blocks freed"

    def land(self) -> None:
        """Apply every WRITE each prefill rank posted to decode's memory."""
        names = {io.name: d for d, io in enumerate(self.decode_ios)}
        for r, rig in enumerate(self.rigs):
            for write in rig.io.writes_snapshot():
                self.src_mem[r].copy(write, self.dst_mem[names[write.peer]])

    def assert_heads_landed(self) -> None:
        for d, io in enumerate(self.decode_ios):
            share = self.pair.mapping.decode_share(d)
            for layer in range(NUM_LAYERS):
                for src, dst in zip(SRC, DST, strict=True):
                    for j, head in enumerate(share.heads):
                        addr = (
                            io.layout.base_addrs[layer]
                            + dst * share.num_heads * HEAD_BYTES
                            + j * HEAD_BYTES
                        )
                        want = bytes([layer, src, head, 7]) * (HEAD_BYTES // 4)
                        assert self.dst_mem[d].at(addr, HEAD_BYTES) == want, (d, head)

    def dones_to(self, d: int) -> set[int]:
        """The prefill ranks whose Done reached decode rank ``d``."""
        notes = self.decode_ios[d].notifications()
        return {_done(n).rank for n in notes}

    def close(self) -> None:
        for rig in self.rigs:
            rig.close()


def _done(payload: bytes) -> Done:
    message = decode(payload)
    assert isinstance(message, Done)
    return message


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster(*request.param)
    yield c
    c.close()


SHAPES = [(1, 2, 2), (2, 1, 2), (4, 2, 2), (2, 4, 2), (2, 4, 4), (1, 4, 8)]


@pytest.mark.parametrize("cluster", SHAPES, indirect=True, ids=str)
def test_every_decode_rank_gets_its_heads_of_every_block(cluster: Cluster):
    cluster.say_hellos()
    for rig in cluster.rigs:
        for reply in rig.replies_to(DECODE_ROUTE, HelloReply):
            assert reply.accepted, reply  # type: ignore[union-attr]
    cluster.push()
    assert wait_for(lambda: all(not rig.held() for rig in cluster.rigs))
    cluster.land()
    cluster.assert_heads_landed()
    for d in range(cluster.pair.decode_tp):
        assert cluster.dones_to(d) == cluster.pair.sources_of(d)
    for r, rig in enumerate(cluster.rigs):
        writes = rig.io.writes_snapshot()
        assert {w.peer for w in writes} == {
            f"kvpush-d0-rank{d}" for d in cluster.pair.target_ranks(r)
        }, "one WRITE per target decode rank; idle ranks write nothing"


@pytest.mark.parametrize("cluster", [(1, 2, 2)], indirect=True, ids=str)
def test_a_partial_slice_is_one_descriptor_per_block_per_layer(cluster: Cluster):
    cluster.say_hellos()
    cluster.push()
    for write in cluster.rigs[0].io.writes_snapshot():
        assert len(write.src) == len(SRC) * NUM_LAYERS
        assert {d.length for d in write.dst} == {HEAD_BYTES}


@pytest.mark.parametrize("cluster", [(2, 2, 2)], indirect=True, ids=str)
def test_whole_blocks_still_coalesce(cluster: Cluster):
    cluster.say_hellos()
    cluster.push()
    (write,) = cluster.rigs[0].io.writes_snapshot()
    assert len(write.src) == 2 * NUM_LAYERS  # runs 4..6 and 9, per layer


@pytest.mark.parametrize("cluster", [(4, 2, 2)], indirect=True, ids=str)
def test_an_idle_prefill_rank_frees_its_blocks_at_once(cluster: Cluster):
    idle = cluster.rigs[1]  # holds head 0, like rank 0, which decode reads
    assert cluster.pair.targets_of(1) == ()
    idle.ready()  # its KV first: freed once the registration says so
    idle.sync()
    assert not idle.wait_finished("req-1", 0.05), "no registration yet"
    idle.register()
    assert idle.wait_finished("req-1")
    assert idle.io.writes_snapshot() == []
    assert idle.replies.sent == [] or all(
        isinstance(m, HelloReply) for _, m in idle.replies.sent
    ), "no HelloRequest, no Failure: decode waits for no word from it"
    # the registration first, then the KV
    other = cluster.rigs[2]
    other.register()
    other.sync()
    other.ready()
    assert other.wait_finished("req-1")
    assert other.counters.get("idle_rank") == 1


@pytest.mark.parametrize("cluster", [(1, 2, 2)], indirect=True, ids=str)
def test_a_failed_write_to_one_target_fails_the_transfer(cluster: Cluster):
    rig = cluster.rigs[0]
    cluster.say_hellos()
    rig.io.script_polls("PROC", "ERR")
    cluster.push()
    (failure,) = rig.replies_to(DECODE_ROUTE, Failure)
    assert failure.cause is Cause.WRITE_FAILED  # type: ignore[union-attr]
    assert rig.held() == {}


@pytest.mark.parametrize("cluster", [(1, 2, 2)], indirect=True, ids=str)
def test_a_write_nixl_refuses_for_the_second_target_fails_it(cluster: Cluster):
    rig = cluster.rigs[0]
    cluster.say_hellos()
    rig.register()
    rig.io.script_polls("PROC", "PROC", "DONE")
    rig.io.fail_next_write()  # the first target's post raises
    rig.ready()
    assert rig.wait_finished("req-1")
    (failure,) = rig.replies_to(DECODE_ROUTE, Failure)
    assert failure.cause is Cause.WRITE_FAILED  # type: ignore[union-attr]


@pytest.mark.parametrize("cluster", [(1, 2, 2)], indirect=True, ids=str)
def test_a_cancel_from_each_decode_rank_is_answered_on_its_own_socket(
    cluster: Cluster,
):
    rig = cluster.rigs[0]
    cluster.say_hellos()
    rig.io.script_polls("PROC", "PROC", "PROC", "ERR")
    rig.register()
    rig.ready()
    assert wait_for(lambda: len(rig.io.writes_snapshot()) == 2)
    rig.cancel(route=b"rank0")
    rig.cancel(route=b"rank1")
    assert rig.wait_finished("req-1")
    for route in (b"rank0", b"rank1"):
        assert wait_for(lambda r=route: rig.replies_to(r, Failure)), route


@pytest.mark.parametrize("cluster", [(1, 2, 2)], indirect=True, ids=str)
def test_a_decode_of_other_kv_heads_is_refused(cluster: Cluster):
    rig = cluster.rigs[0]
    rig.hello(rank=0, total_kv_heads=4)  # another model's decode
    assert wait_for(lambda: rig.replies_to(DECODE_ROUTE, HelloReply))
    (reply,) = rig.replies_to(DECODE_ROUTE, HelloReply)
    assert not reply.accepted  # type: ignore[union-attr]
    assert "KV heads differ" in reply.reason  # type: ignore[union-attr]


# -- decode: every rank waits for its writers ------------------------------------


@pytest.fixture
def p2d1(clock: FakeTime) -> Iterator[Aggregate]:  # noqa: F811
    rank = make_decode_worker(clock, 0, 1, total_kv_heads=2)
    yield Aggregate([rank])
    close_decode(rank)


def test_decode_waits_for_every_prefill_rank_writing_its_blocks(p2d1: Aggregate):
    p2d1.step(DecodeMetadata(expects=[recv_expect("t1", "r1", prefill_tp=2)]))
    (rank,) = p2d1.ranks
    addresses = {(h, p) for h, p, m in rank.peers.sent}
    assert addresses == {PREFILL_ADDR, (PREFILL_ADDR[0], PREFILL_ADDR[1] + 1)}
    rank.done("t1", rank=0)
    assert p2d1.step() == set(), "prefill rank 1's heads are not in yet"
    rank.done("t1", rank=1)
    assert p2d1.step() == {"r1"}
    assert p2d1.load_errors == set()
    assert_all_idle(p2d1)


def test_a_failure_from_one_writer_cancels_the_other(p2d1: Aggregate):
    p2d1.step(DecodeMetadata(expects=[recv_expect("t1", "r1", prefill_tp=2)]))
    (rank,) = p2d1.ranks
    failure = Failure("t1", "p0", Cause.WRITE_FAILED, "NIXL", rank=1)
    assert p2d1.step(DecodeMetadata(failures=[failure])) == set()
    (cancel,) = rank.peers.messages(Cancel)
    assert cancel.transfer_id == "t1"
    rank.done("t1", rank=0)
    assert p2d1.step() == {"r1"}
    assert p2d1.load_errors, "the blocks are not used"
    assert_all_idle(p2d1)


@pytest.mark.parametrize("cluster", [(1, 2, 2), (2, 1, 2)], indirect=True, ids=str)
def test_a_streamed_transfer_lands_on_every_target(cluster: Cluster):
    cluster.say_hellos()
    for rig in cluster.rigs:
        rig.io.script_polls("PROC", "PROC", "DONE")  # chunk 1 runs while 2 comes
        rig.register()
        chunk(rig, 0, SRC[:2])
        assert wait_for(lambda rig=rig: rig.io.writes_snapshot())
        chunk(rig, 2, SRC[2:], final=True)
    assert all(rig.wait_finished("req-1") for rig in cluster.rigs)
    assert wait_for(lambda: all(not rig.held() for rig in cluster.rigs))
    cluster.land()
    cluster.assert_heads_landed()
    for d in range(cluster.pair.decode_tp):
        assert cluster.dones_to(d) == cluster.pair.sources_of(d), "one Done each"
    for r, rig in enumerate(cluster.rigs):
        writes = rig.io.writes_snapshot()
        num_targets = len(cluster.pair.targets_of(r))
        assert len(writes) >= 2 * num_targets, "per chunk, per target"
        assert sum(bool(w.notif) for w in writes) == num_targets
        # each Done goes once no earlier WRITE runs (only its siblings to
        # the other targets, posted with it, may)
        assert all(w.running_at_post < num_targets for w in writes if w.notif)
