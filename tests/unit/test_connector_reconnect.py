"""Liveness across a network (issue 11 item 6): a decode worker and a real
prefill writer joined by a simulated side channel that can be cut.

Off loopback a closed connection proves nothing: both processes may live,
and a Failure prefill sent meanwhile is lost (a ROUTER drops messages to a
disconnected peer, and that peer's routes die with its connection). When
the connection comes back with the same prefill boot, decode sends a
Reconcile and frees exactly the blocks prefill's answers free: those of
transfers prefill no longer holds, right after the reconnect and not at
decode's deadline; the transfers prefill still holds carry on and their
Done completes them. A new boot still proves the old prefill gone.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpush.connector.decode import worker as worker_module
from kvpush.connector.decode.worker import DecodeWorker
from kvpush.connector.metadata import DecodeMetadata, RecvExpect
from kvpush.transfer.groups import one
from kvpush.transfer.messages import (
    Cause,
    Done,
    Failure,
    Hello,
    HelloReply,
    Message,
    Reconcile,
    Registration,
)
from tests.fakes.fake_nixl import FakePeers
from tests.unit.test_connector_worker import (
    TTL_S,
    FakeTime,
    InlineProgress,
    RecordingHeartbeats,
    assert_idle,
    make_config,
)
from tests.unit.test_connector_writer import Rig

REMOTE = ("10.250.0.2", 5600)  # off loopback: a closed connection proves nothing
DST = {"t1": (10, 11, 12, 13), "t2": (14, 15, 16, 17)}
SRC = {"t1": (4, 5, 6, 9), "t2": (20, 21, 22, 23)}


class Link:
    """The side channel between decode's worker (and scheduler) and the
    prefill writer, as ZMQ behaves: while the link is down decode's DEALERs
    queue what they send (delivered once it is up); prefill's ROUTER
    silently drops what it sends to a route of a connection that is gone.
    Each connection has new routes."""

    def __init__(
        self, worker: DecodeWorker, peers: FakePeers, rig: Rig, clock: FakeTime
    ) -> None:
        self.worker, self.peers, self.rig, self.clock = worker, peers, rig, clock
        self.up, self.conn = True, 1
        self._sent = 0  # decode's messages carried so far
        self._replies = 0  # prefill's replies looked at so far
        self.lost: list[Message] = []  # prefill's replies dropped

    @property
    def worker_route(self) -> bytes:
        return f"d0-worker-{self.conn}".encode()

    @property
    def scheduler_route(self) -> bytes:
        return f"d0-scheduler-{self.conn}".encode()

    def cut(self) -> None:
        self.up = False
        self.peers.connection(REMOTE, up=False)

    def heal(self) -> None:
        self.up, self.conn = True, self.conn + 1
        self.peers.connection(REMOTE, up=True)

    def register(self, tid: str) -> None:
        """Decode's scheduler registers ``tid`` with prefill."""
        reg = Registration(tid, "d0", "b0", one(DST[tid]), num_tokens=60, ttl_s=TTL_S)
        self.rig.writer.on_message(self.scheduler_route, reg)

    def carry(self) -> DecodeMetadata:
        """Move what both sides sent; the Failures decode's scheduler got,
        for the worker's next step."""
        if self.up:
            for _, _, msg in self.peers.sent[self._sent :]:
                self.rig.writer.on_message(self.worker_route, msg)
            self._sent = len(self.peers.sent)
        self.rig.sync()  # the writer handled all of it
        forwarded = DecodeMetadata()
        for route, msg in self.rig.replies.sent[self._replies :]:
            if not route.startswith(b"d0-"):
                continue  # Rig.sync's probes
            if not self.up or route not in (self.worker_route, self.scheduler_route):
                self.lost.append(msg)
            elif route == self.worker_route:
                self.peers.queue_reply(msg, REMOTE)
            elif isinstance(msg, Failure):
                forwarded.failures.append(msg)
        self._replies = len(self.rig.replies.sent)
        return forwarded

    def step(self) -> set[str]:
        """One decode engine step, with the link carried before it."""
        self.worker.bind(self.carry())
        return self.worker.get_finished()


@pytest.fixture
def link(monkeypatch: pytest.MonkeyPatch) -> Iterator[Link]:
    clock = FakeTime()
    monkeypatch.setattr(worker_module, "time", clock)
    rig = Rig()
    worker = DecodeWorker(make_config("decode"))
    worker._peers.close()
    worker._heartbeats.close()
    peers = FakePeers()
    io = rig.decode_io
    worker._io, worker._peers = io, peers  # type: ignore[assignment]
    worker._heartbeats = RecordingHeartbeats()  # type: ignore[assignment]
    worker._progress = InlineProgress(io)  # type: ignore[assignment]
    worker._hello = Hello("d0", "b0", io.name, io.metadata, io.layout)
    link = Link(worker, peers, rig, clock)
    peers.connection(REMOTE, up=True)
    try:
        yield link
    finally:
        worker.close()
        rig.close()  # nothing held on prefill either
    assert io.misuse == []


def expect(link: Link, tid: str, req_id: str) -> None:
    """Decode's scheduler registered ``tid``; its worker expects it."""
    link.register(tid)
    recv = RecvExpect(req_id, tid, one(DST[tid]), "p0", *REMOTE)
    link.worker.bind(DecodeMetadata(expects=[recv]))


def test_a_failure_lost_in_a_partition_frees_its_blocks_right_after_it(link):
    link.step()  # Hello, HelloReply: decode knows prefill's boot
    link.step()
    expect(link, "t1", "r1")
    expect(link, "t2", "r2")
    assert link.step() == set()

    link.cut()
    assert link.step() == set(), "a closed connection off loopback proves nothing"
    link.rig.writer.cancel("t1")  # prefill gives t1 up during the partition
    assert link.step() == set()
    assert [type(m) for m in link.lost] == [Failure], "its Failure was lost"

    link.heal()
    received: set[str] = set()
    for _ in range(4):  # Hello, HelloReply, Reconcile, its answer
        link.clock.now += 0.1
        received |= link.step()

    assert received == {"r1"}, "freed at once, on prefill's answer"
    assert link.worker.take_load_errors() == set(DST["t1"])
    (ask,) = link.peers.messages(Reconcile)
    assert set(ask.transfer_ids) == {"t1", "t2"}
    assert link.worker.counters.get("expired.receive") == 0, "not by a deadline"
    assert link.worker.reserved_blocks() == 4, "t2's blocks: prefill holds it"

    link.rig.ready(SRC["t2"], tid="t2", req_id="req-2")  # t2's KV, written now
    assert link.rig.wait_finished("req-2")
    assert link.step() == {"r2"}, "its Done completes it"
    assert link.worker.take_load_errors() == set()
    assert link.rig.counters.get("reconciled.live") == 1
    assert link.rig.counters.get("reconciled.ended") == 1
    assert_idle(link.worker)


def test_a_receive_prefill_never_heard_of_is_settled_by_the_reconcile(link):
    """The Registration itself was lost with the connection (sent, then
    the connection died under it): prefill has nothing of t1, says so, and
    refuses the Registration if it comes."""
    link.step()
    link.step()
    recv = RecvExpect("r1", "t1", one(DST["t1"]), "p0", *REMOTE)
    link.worker.bind(DecodeMetadata(expects=[recv]))  # registration lost
    link.cut()
    link.heal()
    received: set[str] = set()
    for _ in range(4):
        received |= link.step()

    assert received == {"r1"}
    assert link.worker.take_load_errors() == set(DST["t1"])
    link.register("t1")  # late after all: refused, never written
    link.rig.ready(SRC["t1"], tid="t1", req_id="req-1")
    assert link.rig.wait_finished("req-1")
    link.rig.sync()
    assert link.rig.io.writes_snapshot() == []
    assert_idle(link.worker)


def test_a_receive_quarantined_in_the_partition_is_settled_once_it_heals(link):
    """Its deadline's Cancel waits in decode's queue; the Reconcile and the
    Cancel reach prefill after the reconnect, and either answer frees it."""
    link.step()
    link.step()
    expect(link, "t1", "r1")
    link.cut()
    link.rig.writer.cancel("t1")
    for _ in range(int(TTL_S) + 6):  # decode's deadline passes in the partition
        link.clock.now += 1.0
        assert link.step() == set()
    assert link.worker._receiver.quarantined_blocks() == 4

    link.heal()
    received: set[str] = set()
    for _ in range(4):
        received |= link.step()

    assert received == {"r1"}
    assert link.worker.take_load_errors() == set(DST["t1"])
    assert link.worker.counters.get("quarantine.released") == 1
    assert_idle(link.worker)


def test_a_reconnect_to_a_new_prefill_boot_fails_every_receive_from_it(link):
    link.step()
    link.step()
    expect(link, "t1", "r1")
    expect(link, "t2", "r2")
    link.step()
    link.cut()
    link.step()

    link.peers.queue_reply(HelloReply("p0", True, boot_id="p0-boot-2"), REMOTE)

    assert link.worker.get_finished() == {"r1", "r2"}, "the old process is gone"
    assert link.worker.take_load_errors() == set(DST["t1"]) | set(DST["t2"])
    assert link.worker.counters.get("receive_failed.peer_lost") == 2
    link.rig.writer.cancel("t1")  # (the old prefill's state, in this rig)
    link.rig.writer.cancel("t2")
    link.rig.sync()
    assert_idle(link.worker)


def test_a_failure_forwarded_by_decodes_scheduler_still_frees_at_once(link):
    """Without a partition nothing changes: prefill's Failure goes back on
    the Registration's socket, and the scheduler forwards it."""
    link.step()
    link.step()
    expect(link, "t1", "r1")
    link.rig.writer.cancel("t1")

    assert link.step() == {"r1"}
    assert link.worker.take_load_errors() == set(DST["t1"])
    assert link.peers.messages(Reconcile) == [], "no reconnect, no reconcile"
    assert link.rig.replies_to(link.scheduler_route, Failure)[0].cause is (
        Cause.CANCELLED
    )
    assert_idle(link.worker)


def test_a_done_that_answers_a_reconcile_is_traced_as_the_notification(link):
    """A Reconcile's answer can be the first word decode gets that the KV
    landed: the receive then ends without the NIXL notification (decode
    stops reading NIXL once nothing is awaited), so the Done on the side
    channel is the transfer's ``notif_received``, or its timeline has no
    end and the push looks like it never arrived."""
    marks: list[tuple[str, str]] = []
    mark = link.worker.tracer.mark

    def recording(transfer_id: str, event: str, **extra: object) -> None:
        marks.append((transfer_id, event))
        mark(transfer_id, event, **extra)

    link.worker.tracer.mark = recording  # type: ignore[method-assign]
    link.step()
    link.step()
    recv = RecvExpect("r1", "t1", one(DST["t1"]), "p0", *REMOTE)
    link.worker.bind(DecodeMetadata(expects=[recv]))  # (prefill's side aside)
    link.peers.queue_reply(Done("t1", "p0", num_blocks=4), REMOTE)

    assert link.step() == {"r1"}
    assert link.worker.take_load_errors() == set(), "the KV landed"
    assert ("t1", "notif_received") in marks
    assert_idle(link.worker)


def test_a_reconnect_read_with_the_next_registration_leaves_it_alone(link):
    """The connection dropped and came back while decode was idle; decode
    reads that at its next step, the one whose Registration (on the
    scheduler's socket) may reach prefill after the worker's Reconcile.
    Naming it would make prefill close an id it has not heard of yet and
    fail a healthy transfer (CI, test_a_side_channel_reset_in_a_burst_of_registrations):
    nothing awaited when the link went down, nothing to reconcile."""
    link.step()
    link.step()
    link.cut()
    link.heal()  # both read at the next step
    recv = RecvExpect("r1", "t1", one(DST["t1"]), "p0", *REMOTE)
    link.worker.bind(DecodeMetadata(expects=[recv]))  # its Registration: later
    for _ in range(3):  # Hello, HelloReply
        assert link.step() == set()
    link.register("t1")
    link.rig.ready(SRC["t1"], tid="t1", req_id="req-1")
    assert link.rig.wait_finished("req-1")

    assert link.step() == {"r1"}
    assert link.worker.take_load_errors() == set(), "pushed, not failed"
    assert link.peers.messages(Reconcile) == []
    assert_idle(link.worker)
