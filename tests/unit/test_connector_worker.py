"""The connector's worker sides, without NIXL or sockets.

Decode: each expected transfer is reported finished exactly once, when its
Done notification arrives (even one step before the worker learns to expect
it), when the prefill reports a Failure (also before the expect, and also
through the scheduler), or when the prefill process is proven gone; after a
Failure its blocks are reported as load errors so that vLLM does not use
them. A deadline never frees blocks: it quarantines them and asks prefill.
Prefill: each step's triggers and cancels go to the writer after the
forward, a request's blocks are released once both vLLM has finished the
request and the writer has finished its push, and preempted requests are
never reported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import pytest

from kvpush.connector.config import ConnectorConfig, KvGroup
from kvpush.connector.connector import KvPushConnector
from kvpush.connector.decode import worker as worker_module
from kvpush.connector.decode.worker import DecodeWorker
from kvpush.connector.metadata import (
    DecodeMetadata,
    PreemptedPush,
    PrefillMetadata,
    PushesOver,
    PushTrigger,
    RecvExpect,
)
from kvpush.connector.prefill.fence import NoFence
from kvpush.connector.prefill.worker import PrefillWorker
from kvpush.transfer.groups import NULL_BLOCK, one
from kvpush.transfer.layout import KvLayout
from kvpush.transfer.matcher import ReadyKv
from kvpush.transfer.messages import (
    Cancel,
    Cause,
    Done,
    Failure,
    Hello,
    HelloReply,
    HelloRequest,
    encode,
)
from tests.fakes.fake_nixl import FakeNixlIO, FakePeers, leftovers

BS = 16
TTL_S = 60.0
PREFILL_ADDR = ("127.0.0.1", 5600)
BLOCKS = {"t1": (3, 4, 5), "t2": (6, 7, 8)}  # each transfer's destination blocks
LAYOUT = KvLayout.contiguous_layers(0x1000, 2, 32, 256, BS, kv_dtype="float32")


class FakeTime:
    """Stands in for the ``time`` module inside the worker: a clock the test
    moves, and a ``sleep`` that advances it and is recorded."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        """The wall clock: the same fake seconds."""
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(worker_module, "time", fake)
    return fake


def make_config(
    role: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    total_kv_heads: int = 0,
    **extra: object,
) -> ConnectorConfig:
    return ConnectorConfig(
        role=role,  # type: ignore[arg-type]
        engine_id="d0" if role == "decode" else "p0",
        side_channel_host="127.0.0.1",
        side_channel_port=5601,
        block_size=BS,
        registration_ttl_s=TTL_S,
        tp_size=tp_size,
        tp_rank=tp_rank,
        total_kv_heads=total_kv_heads,
        **extra,  # type: ignore[arg-type]
    )


class RecordingHeartbeats:
    """Stands in for the heartbeat thread: the targets it was given."""

    def __init__(self) -> None:
        self.targets: frozenset[tuple[str, int]] = frozenset()

    def set_targets(self, addresses: frozenset[tuple[str, int]]) -> None:
        self.targets = addresses

    def close(self) -> None:
        pass


class InlineProgress:
    """Stands in for the NIXL progress thread: reads the fake agent's
    notifications when the worker takes them, so each step sees exactly
    what was delivered before it (the real thread: test_connector_progress)."""

    def __init__(self, io: FakeNixlIO) -> None:
        self._io = io
        self.wanted: list[bool] = []  # every want() the worker said

    def take(self) -> list[bytes]:
        return self._io.notifications()

    def want(self, awaited: bool) -> None:
        self.wanted.append(awaited)

    def close(self) -> bool:
        return True


@dataclass
class Decode:
    worker: DecodeWorker
    io: FakeNixlIO
    peers: FakePeers
    clock: FakeTime
    heartbeats: RecordingHeartbeats

    def expect(
        self,
        tid: str = "t1",
        req_id: str = "r1",
        address: tuple[str, int] = PREFILL_ADDR,
        prefill_tp: int = 1,
    ) -> None:
        self.worker.bind(
            DecodeMetadata(expects=[recv_expect(tid, req_id, address, prefill_tp)])
        )

    def step(self, meta: DecodeMetadata | None = None) -> set[str]:
        """One engine step; the received requests."""
        self.worker.bind(meta or DecodeMetadata())
        return self.worker.get_finished()

    def run(self, seconds: float) -> set[str]:
        """Step once a second for ``seconds``; every request received."""
        received: set[str] = set()
        for _ in range(int(seconds)):
            self.clock.now += 1.0
            received |= self.step()
        return received

    def done(self, tid: str = "t1", rank: int = 0) -> None:
        """Prefill rank ``rank``'s WRITE landed here (its notification)."""
        self.io.deliver(encode(Done(tid, "p0", num_blocks=3, rank=rank)))


def recv_expect(
    tid: str = "t1",
    req_id: str = "r1",
    address: tuple[str, int] = PREFILL_ADDR,
    prefill_tp: int = 1,
) -> RecvExpect:
    """What decode's scheduler puts in the metadata for ``tid`` (the same
    for every decode rank)."""
    return RecvExpect(
        req_id=req_id,
        transfer_id=tid,
        dst_block_ids=one(BLOCKS[tid]),
        prefill_engine_id="p0",
        prefill_host=address[0],
        prefill_port=address[1],
        prefill_tp=prefill_tp,
    )


def assert_idle(worker: DecodeWorker) -> None:
    """Nothing is held for any transfer (per-peer connection state aside)."""
    ignore = {
        "_greeted", "_connected", "_prefill_boots", "_boot_since", "_to_reconcile",
    }  # fmt: skip
    assert leftovers(worker, ignore=ignore) == {}
    assert leftovers(worker._receiver) == {}
    assert worker.reserved_blocks() == 0


def make_decode(
    clock: FakeTime,
    rank: int = 0,
    tp_size: int = 1,
    total_kv_heads: int = 0,
    **extra: object,
) -> Decode:
    """Decode worker rank ``rank`` (of ``tp_size``, the model's KV heads
    ``total_kv_heads``, 0: not known) as ``register_kv_caches`` leaves it,
    NIXL faked (``extra``: more config fields); close with
    :func:`close_decode`."""
    config = make_config("decode", rank, tp_size, total_kv_heads, **extra)
    worker = DecodeWorker(config)
    io = FakeNixlIO(config.agent_name, LAYOUT)
    peers = FakePeers()
    worker._peers.close()
    worker._heartbeats.close()
    heartbeats = RecordingHeartbeats()
    worker._io, worker._peers = io, peers  # type: ignore[assignment]
    worker._heartbeats = heartbeats  # type: ignore[assignment]
    worker._progress = InlineProgress(io)  # type: ignore[assignment]
    worker._hello = Hello(
        engine_id="d0",
        boot_id="b0",
        agent_name=io.name,
        nixl_metadata=io.metadata,
        layout=LAYOUT,
        rank=rank,
        tp_size=tp_size,
        total_kv_heads=total_kv_heads,
    )
    return Decode(worker, io, peers, clock, heartbeats)


def close_decode(decode: Decode) -> None:
    decode.worker.close()
    assert decode.io.misuse == []
    assert decode.clock.sleeps == [], "the worker never blocks vLLM's engine loop"


@pytest.fixture
def decode(clock: FakeTime) -> Iterator[Decode]:
    """A decode worker as ``register_kv_caches`` leaves it, NIXL faked."""
    rig = make_decode(clock)
    yield rig
    close_decode(rig)


# -- decode ----------------------------------------------------------------------


def test_a_receive_finishes_when_its_done_notification_arrives(decode: Decode):
    decode.expect()
    assert decode.step() == set()

    decode.done()

    assert decode.step() == {"r1"}
    assert decode.step() == set(), "reported once"
    assert decode.worker.take_load_errors() == set()
    assert_idle(decode.worker)


def test_decode_says_hello_once_to_each_prefill_before_expecting(decode: Decode):
    decode.expect("t1", "r1")
    decode.expect("t2", "r2")

    assert decode.peers.sent == [(*PREFILL_ADDR, decode.worker._hello)]


def test_a_done_one_step_before_its_expect_is_kept_for_it(decode: Decode):
    decode.done()
    assert decode.step() == set()

    decode.expect()

    assert decode.step() == {"r1"}
    assert decode.step() == set()
    assert_idle(decode.worker)


def test_a_failure_from_prefill_finishes_the_receive_with_load_errors(decode):
    decode.expect()
    decode.peers.queue_reply(Failure("t1", "p0", Cause.WRITE_FAILED))

    assert decode.step() == {"r1"}
    assert decode.worker.take_load_errors() == {3, 4, 5}
    assert decode.worker.take_load_errors() == set(), "reported once"
    assert decode.worker.counters.get("receive_failed.write_failed") == 1


def test_with_several_kv_groups_a_failure_is_told_by_request(clock: FakeTime):
    """vLLM takes failed receives of a model with several KV-cache groups
    by request (``failed_recving``: block ids are unique per group only),
    and raises on block ids; two receives whose windows keep no block (the
    null block) in the same places hold only their real blocks."""
    groups_ = (KvGroup("sliding_window:64"), KvGroup("full"))
    rig = make_decode(clock, kv_groups=groups_)
    null = NULL_BLOCK
    for tid, rid, window, full in (
        ("t1", "r1", (null, 7), (3, 4)),
        ("t2", "r2", (null, 8), (5, 6)),
    ):
        expect = replace(recv_expect(tid, rid), dst_block_ids=(window, full))
        rig.worker.bind(DecodeMetadata(expects=[expect]))
    assert rig.worker.reserved_blocks() == 6, "the null block is never held"
    rig.peers.queue_reply(Failure("t1", "p0", Cause.WRITE_FAILED))

    assert rig.step() == {"r1"}
    assert rig.worker.take_failed() == {"r1"}
    assert rig.worker.take_load_errors() == set()
    assert rig.worker.take_failed() == set(), "reported once"
    close_decode(rig)


def test_a_failure_before_its_expect_is_kept_for_it(decode: Decode):
    """Issue 9 item 5: a fast rejection used to be dropped, stalling the
    request until its deadline (about 65 s)."""
    decode.peers.queue_reply(Failure("t1", "p0", Cause.REJECTED))
    assert decode.step() == set()

    decode.expect()

    assert decode.step() == {"r1"}
    assert decode.worker.take_load_errors() == {3, 4, 5}
    assert_idle(decode.worker)


def test_a_failure_forwarded_by_the_scheduler_fails_the_receive(decode: Decode):
    """A rejection of a first-contact registration comes back on the
    scheduler's socket; the scheduler forwards it in the step's metadata."""
    decode.expect()
    failure = Failure("t1", "p0", Cause.REJECTED, "beyond decode's cache")

    assert decode.step(DecodeMetadata(failures=[failure])) == {"r1"}
    assert decode.worker.take_load_errors() == {3, 4, 5}


def test_an_overdue_receive_is_quarantined_not_freed(decode: Decode):
    """Issue 9 item 2: past its deadline prefill may still be alive and
    writing; the blocks stay held (and counted) until prefill answers."""
    decode.expect()
    assert decode.run(TTL_S) == set()
    assert decode.peers.messages(Cancel) == []

    assert decode.run(6) == set(), "the deadline does not free the blocks"

    assert decode.worker.reserved_blocks() == 3
    assert decode.worker.counters.get("quarantined.blocks") == 3
    assert decode.worker._receiver.quarantined_blocks() == 3
    (ask,) = decode.peers.messages(Cancel)
    assert ask.transfer_id == "t1", "decode asks prefill for its final word"
    decode.peers.queue_reply(Failure("t1", "p0", Cause.CANCELLED))
    assert decode.step() == {"r1"}
    assert decode.worker.take_load_errors() == {3, 4, 5}
    assert decode.worker.counters.get("quarantine.released") == 1
    assert_idle(decode.worker)


def test_a_late_done_completes_a_quarantined_receive(decode: Decode):
    decode.expect()
    decode.run(TTL_S + 6)

    decode.done()  # prefill was stalled, not dead: its WRITE landed

    assert decode.step() == {"r1"}
    assert decode.worker.take_load_errors() == set(), "the KV is good"
    assert_idle(decode.worker)


def test_decode_that_was_itself_stopped_does_not_blame_prefill(decode: Decode):
    """Issue 9 item 8: one gap of a minute between two steps (a stopped
    process, or a very long forward) is this side's, not prefill's."""
    decode.expect()
    decode.clock.now += TTL_S + 10
    decode.step()

    assert decode.worker._receiver.quarantined_blocks() == 0
    assert decode.peers.messages(Cancel) == []


def test_only_the_failed_transfer_is_affected(decode: Decode):
    decode.expect("t1", "r1")
    decode.expect("t2", "r2")
    decode.peers.queue_reply(Failure("t2", "p0", Cause.EXPIRED))

    assert decode.step() == {"r2"}
    decode.done("t1")
    assert decode.step() == {"r1"}
    assert decode.worker.take_load_errors() == {6, 7, 8}  # r2's blocks only


def test_malformed_notifications_are_dropped(decode: Decode):
    decode.expect()
    decode.io.deliver(b"\x93garbage")
    decode.done()

    assert decode.step() == {"r1"}


def test_a_refused_hello_fails_the_transfers_expected_from_that_prefill(decode):
    decode.expect()
    decode.peers.queue_reply(
        HelloReply("p0", accepted=False, boot_id="pb", reason="block_bytes differs")
    )

    assert decode.step() == {"r1"}


def test_a_hello_request_makes_decode_greet_again(decode: Decode):
    """Issue 9 item 8: a prefill that forgot this decode says so, and the
    pair converges instead of failing every transfer with "no hello"."""
    decode.expect()
    hellos = len(decode.peers.messages(Hello))

    decode.peers.queue_reply(HelloRequest("p0", "b0", "t1"), PREFILL_ADDR)
    decode.step()
    assert len(decode.peers.messages(Hello)) == hellos + 1

    decode.step(DecodeMetadata(hello_requests=[PREFILL_ADDR]))  # via the scheduler
    assert len(decode.peers.messages(Hello)) == hellos + 2


def test_a_receive_aborted_in_vllm_is_released_only_on_prefills_answer(decode):
    decode.expect()
    decode.worker.bind(DecodeMetadata(recv_cancels=["t1"]))

    (cancel,) = decode.peers.messages(Cancel)
    assert cancel.transfer_id == "t1"
    assert decode.step() == set(), "a WRITE may still land: blocks stay held"
    assert decode.worker.reserved_blocks() == 3

    decode.peers.queue_reply(Failure("t1", "p0", Cause.CANCELLED))
    assert decode.step() == {"r1"}
    assert decode.worker.take_load_errors() == set(), "the request is gone"
    assert decode.worker.counters.get("aborted.released") == 1
    assert_idle(decode.worker)


def test_a_receive_aborted_in_vllm_is_released_by_the_done_of_its_write(decode):
    decode.expect()
    decode.worker.bind(DecodeMetadata(recv_cancels=["t1"]))
    assert decode.step() == set()

    decode.done()

    assert decode.step() == {"r1"}
    assert decode.worker.take_load_errors() == set()
    assert_idle(decode.worker)


def test_an_aborted_receive_nobody_answers_stays_held_past_its_deadline(decode):
    decode.expect()
    decode.worker.bind(DecodeMetadata(recv_cancels=["t1"]))
    decode.worker.bind(DecodeMetadata(recv_cancels=["t1"]))  # vLLM repeats: one Cancel
    assert len(decode.peers.messages(Cancel)) == 1

    assert decode.run(TTL_S + 6) == set()

    assert decode.worker.reserved_blocks() == 3, "quarantined, not reused"
    decode.peers.queue_reply(Failure("t1", "p0", Cause.CANCELLED))
    assert decode.step() == {"r1"}
    assert decode.worker.take_load_errors() == set()
    assert_idle(decode.worker)


def test_a_lost_prefill_is_counted_once_however_often_reconnecting_fails(decode):
    decode.expect("t1", "r1")
    decode.peers.connection(PREFILL_ADDR, up=True)
    decode.step()

    for _ in range(5):  # ZMQ closes a socket at every refused reconnect
        decode.peers.connection(PREFILL_ADDR, up=False)
        decode.step()

    assert decode.worker.counters.get("peer_lost") == 1
    assert decode.worker.counters.get("receive_failed.peer_lost") == 1
    assert decode.worker.take_load_errors() == {3, 4, 5}
    assert_idle(decode.worker)


def test_a_lost_prefill_connection_fails_its_receives_then_greets_again(decode):
    decode.expect("t1", "r1")
    decode.peers.connection(PREFILL_ADDR, up=True)
    assert decode.step() == set()

    decode.peers.connection(PREFILL_ADDR, up=False)

    assert decode.step() == {"r1"}
    assert decode.worker.take_load_errors() == {3, 4, 5}
    assert decode.worker.counters.get("peer_lost") == 1
    assert decode.worker.counters.get("receive_failed.peer_lost") == 1
    hellos = len(decode.peers.messages(Hello))
    decode.peers.connection(PREFILL_ADDR, up=True)  # prefill restarted
    decode.step()
    assert len(decode.peers.messages(Hello)) == hellos + 1
    assert_idle(decode.worker)


REMOTE = ("10.0.0.2", 5600)
BLOCKS["t3"] = (9, 10, 11)


def test_a_lost_connection_across_a_network_proves_nothing(decode: Decode):
    """Off loopback a closed connection may be a partition, with prefill
    alive: the receive waits for proof (a new boot) or prefill's word."""
    decode.peers.queue_reply(HelloReply("p0", True, "boot-1"), REMOTE)
    decode.step()
    decode.expect("t3", "r3", REMOTE)
    decode.peers.connection(REMOTE, up=True)
    decode.step()

    decode.peers.connection(REMOTE, up=False)
    assert decode.step() == set()
    decode.peers.queue_reply(HelloReply("p0", True, "boot-1"), REMOTE)  # same one
    assert decode.step() == set()

    decode.peers.queue_reply(HelloReply("p0", True, "boot-2"), REMOTE)  # restarted
    assert decode.step() == {"r3"}
    assert decode.worker.take_load_errors() == {9, 10, 11}


def test_old_connection_news_does_not_fail_a_new_receive(decode: Decode):
    """Found by the fault suite: a prefill died and came back while decode
    was idle; the queued "down" events predate the next request's expect."""
    decode.peers.connection(PREFILL_ADDR, up=True)
    decode.step()
    decode.peers.connection(PREFILL_ADDR, up=False)  # prefill killed
    decode.peers.connection(PREFILL_ADDR, up=False)  # reconnect attempts
    decode.peers.connection(PREFILL_ADDR, up=True)  # the new prefill

    decode.expect()

    assert decode.step() == set()
    assert decode.worker.take_load_errors() == set()
    decode.done()
    assert decode.step() == {"r1"}
    assert decode.peers.messages(Hello)[-1] == decode.worker._hello, "greeted anew"


def test_a_prefill_that_never_connects_fails_the_receive(decode: Decode):
    decode.expect()
    decode.peers.connection(PREFILL_ADDR, up=False)  # connect attempt refused

    assert decode.step() == {"r1"}
    assert decode.worker.take_load_errors() == {3, 4, 5}


def test_the_heartbeat_thread_is_given_the_awaited_prefills(decode: Decode):
    decode.step()
    assert decode.heartbeats.targets == frozenset(), "nothing awaited"
    decode.expect()
    assert decode.heartbeats.targets == {PREFILL_ADDR}
    decode.done()
    decode.step()
    assert decode.heartbeats.targets == frozenset()


# -- prefill ---------------------------------------------------------------------


@dataclass
class RecordingWriter:
    """Stands in for :class:`~kvpush.connector.prefill.writer.Writer`."""

    ready: list[tuple[ReadyKv, str, object]] = field(default_factory=list)
    layers: list[tuple[object, int, object]] = field(default_factory=list)
    computed: list[ReadyKv] = field(default_factory=list)  # marked kv_ready
    cancelled: list[str] = field(default_factory=list)
    preempted: list[set[str]] = field(default_factory=list)
    pushed: set[str] = field(default_factory=set)

    def kv_ready(
        self, ready: ReadyKv, req_id: str, fence: object, mark_ready: bool = True
    ) -> None:
        self.ready.append((ready, req_id, fence))
        if mark_ready:
            self.kv_computed([ready])

    def kv_computed(self, chunks: list[ReadyKv]) -> None:
        self.computed.extend(chunks)

    def layer_saved(self, fences: object, layer: int, fence: object) -> None:
        self.layers.append((fences, layer, fence))

    def cancel(self, transfer_id: str) -> None:
        self.cancelled.append(transfer_id)

    def preempt(self, transfer_ids: set[str]) -> None:
        self.preempted.append(set(transfer_ids))

    def take_finished(self) -> set[str]:
        out, self.pushed = self.pushed, set()
        return out

    def close(self) -> bool:
        return True


@pytest.fixture
def prefill() -> Iterator[tuple[PrefillWorker, RecordingWriter]]:
    worker = PrefillWorker(make_config("prefill"))
    writer = RecordingWriter()
    worker._writer = writer  # type: ignore[assignment]
    yield worker, writer
    worker.close()


def trigger(req_id: str = "r1", tid: str = "t1") -> PushTrigger:
    return PushTrigger(
        req_id=req_id,
        transfer_id=tid,
        src_block_ids=one((7, 8, 9)),
        num_tokens=40,
        decode_engine_id="d0",
    )


def test_prefill_hands_triggered_kv_to_the_writer_after_the_forward(prefill):
    worker, writer = prefill
    worker.bind(PrefillMetadata(triggers=[trigger()], cancels=["t9"]))
    assert (writer.ready, writer.cancelled) == ([], []), "not before the forward"

    worker.wait_for_save()

    ((ready, req_id, fence),) = writer.ready
    assert ready == ReadyKv("t1", one((7, 8, 9)), 40, "d0")
    assert req_id == "r1"
    assert isinstance(fence, NoFence), "the CPU forward is synchronous"
    assert writer.cancelled == ["t9"]
    worker.wait_for_save()  # a second call in the same step repeats nothing
    assert (len(writer.ready), writer.cancelled) == (1, ["t9"])


def test_prefill_hands_a_late_bound_kv_to_the_writer_with_its_digest(prefill):
    worker, writer = prefill
    digest = "ab" * 32
    late = dataclasses.replace(trigger(), decode_engine_id=None, claim_sha256=digest)
    worker.bind(PrefillMetadata(triggers=[late]))
    worker.wait_for_save()

    ((ready, _, _),) = writer.ready
    assert ready == ReadyKv("t1", one((7, 8, 9)), 40, None, claim_sha256=digest)
    assert ready.is_late


def test_prefill_releases_blocks_once_vllm_and_the_writer_are_both_done(prefill):
    worker, writer = prefill
    worker.bind(PrefillMetadata(triggers=[trigger("r1", "t1"), trigger("r2", "t2")]))
    worker.wait_for_save()
    writer.pushed = {"r1"}  # pushed before vLLM finished the request
    assert worker.get_finished(set()) == set()

    assert worker.get_finished({"r1"}) == {"r1"}
    assert worker.get_finished(set()) == set(), "reported once"

    assert worker.get_finished({"r2"}) == set()  # vLLM first this time
    writer.pushed = {"r2"}
    assert worker.get_finished(set()) == {"r2"}
    rank0 = frozenset({0})  # and to the scheduler's pins, as the writer said
    assert worker.build_worker_meta() == PushesOver({"r1": rank0, "r2": rank0})
    assert leftovers(worker) == {}


def test_prefill_forgets_finished_requests_that_push_nothing(prefill):
    worker, _ = prefill
    worker.bind(PrefillMetadata())
    worker.wait_for_save()

    assert worker.get_finished({"plain", "aborted"}) == set()

    assert leftovers(worker) == {}


def test_preempted_requests_are_closed_before_the_forward_and_never_reported(
    prefill,
):
    """Issue 9 item 1: vLLM frees a preempted request's blocks itself; the
    worker must never report it in finished_sending (vLLM asserts on it for
    a request it no longer holds for us), only to the scheduler's pins."""
    worker, writer = prefill
    worker.bind(PrefillMetadata(triggers=[trigger("r1", "t1")]))
    worker.wait_for_save()

    worker.handle_preemptions(PrefillMetadata(preempted=[PreemptedPush("r1", "t1")]))

    assert writer.preempted == [{"t1"}]
    writer.pushed = {"r1"}  # the writer released it (closed the transfer)
    assert worker.get_finished({"r1"}) == set()
    assert worker.build_worker_meta() == PushesOver({"r1": frozenset({0})})
    assert leftovers(worker) == {}


def test_a_preemption_with_a_write_in_flight_returns_at_once_and_reports_it_later(
    prefill,
):
    """The review's hang: ``handle_preemptions`` used to wait for the WRITE
    (up to its timeout + 5 s) and then raise, stopping the engine. Now it
    only closes the push; the rank says the push is over (for the pins)
    when the writer does, however much later, and says it once."""
    worker, writer = prefill
    worker.config = dataclasses.replace(worker.config, tp_size=2, tp_rank=1)
    worker.bind(PrefillMetadata(triggers=[trigger("r1", "t1")]))
    worker.wait_for_save()

    worker.handle_preemptions(PrefillMetadata(preempted=[PreemptedPush("r1", "t1")]))

    assert writer.preempted == [{"t1"}], "closed, not waited for"
    assert worker.get_finished(set()) == set()
    assert worker.build_worker_meta() is None, "the WRITE still runs"
    writer.pushed = {"r1"}  # it ended
    assert worker.get_finished(set()) == set()
    assert worker.build_worker_meta() == PushesOver({"r1": frozenset({1})})
    assert worker.build_worker_meta() is None
    assert leftovers(worker) == {}


def test_the_connector_reports_failed_requests_with_its_finished_ones(clock: FakeTime):
    """``get_transfer_results``, as vLLM's worker calls it each step."""
    groups_ = (KvGroup("sliding_window:64"), KvGroup("full"))
    rig = make_decode(clock, kv_groups=groups_)
    connector = object.__new__(KvPushConnector)
    connector._prefill_worker, connector._decode_worker = None, rig.worker
    rig.expect()
    rig.peers.queue_reply(Failure("t1", "p0", Cause.WRITE_FAILED))

    results = connector.get_transfer_results(set())

    assert results.finished_recving == {"r1"} and results.failed_recving == {"r1"}
    assert connector.get_block_ids_with_load_errors() == set()
    close_decode(rig)
