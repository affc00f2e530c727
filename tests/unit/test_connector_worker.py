"""The connector's worker side, without NIXL or sockets.

Decode: each expected transfer is reported finished exactly once, when its
Done notification arrives (even one step before the worker learns to expect
it), when the prefill reports a Failure, or when its deadline passes; in the
last two cases its blocks are reported as load errors so that vLLM does not
use them. Prefill: each step's triggers and cancels go to the writer after
the forward, and a request's blocks are released once both vLLM has finished
the request and the writer has finished its push.

``layout_of`` maps vLLM's CPU cache tensors to a :class:`KvLayout`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from kvpush.connector import worker as worker_module
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.fence import NoFence
from kvpush.connector.metadata import KvPushMetadata, PushTrigger, RecvExpect
from kvpush.connector.worker import KvPushWorker, layout_of
from kvpush.transfer.layout import KvLayout
from kvpush.transfer.matcher import ReadyKv
from kvpush.transfer.messages import (
    Cancel,
    Done,
    Failure,
    Heartbeat,
    Hello,
    HelloReply,
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

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(worker_module, "time", fake)
    return fake


def make_worker(role: str) -> KvPushWorker:
    config = ConnectorConfig(
        role=role,  # type: ignore[arg-type]
        engine_id="d0" if role == "decode" else "p0",
        side_channel_host="127.0.0.1",
        side_channel_port=5601,
        block_size=BS,
        registration_ttl_s=TTL_S,
    )
    return KvPushWorker(config)


@dataclass
class Decode:
    worker: KvPushWorker
    io: FakeNixlIO
    peers: FakePeers

    def expect(self, tid: str = "t1", req_id: str = "r1") -> None:
        expect = RecvExpect(
            req_id=req_id,
            transfer_id=tid,
            dst_block_ids=BLOCKS[tid],
            prefill_engine_id="p0",
            prefill_host=PREFILL_ADDR[0],
            prefill_port=PREFILL_ADDR[1],
        )
        self.worker.bind(KvPushMetadata(expects=[expect]))

    def step(self) -> set[str]:
        """One engine step with no new instructions; the received requests."""
        self.worker.bind(KvPushMetadata())
        self.worker.wait_for_save()
        sending, received = self.worker.get_finished(set())
        assert sending == set(), "decode never sends"
        return received

    def done(self, tid: str = "t1") -> None:
        self.io.deliver(encode(Done(transfer_id=tid, engine_id="p0", num_blocks=3)))


def assert_idle(worker: KvPushWorker) -> None:
    """Nothing is held for any transfer (per-peer connection state aside)."""
    assert leftovers(worker, ignore={"_greeted", "_connected"}) == {}
    assert leftovers(worker._receiver) == {}
    assert worker.reserved_blocks() == 0


@pytest.fixture
def decode(clock: FakeTime) -> Iterator[Decode]:
    """A decode worker as ``register_kv_caches`` leaves it, NIXL faked."""
    worker = make_worker("decode")
    io = FakeNixlIO("kvpush-d0", LAYOUT)
    peers = FakePeers()
    worker._peers.close()
    worker._io, worker._peers = io, peers  # type: ignore[assignment]
    worker._hello = Hello(
        engine_id="d0",
        boot_id="b0",
        agent_name=io.name,
        nixl_metadata=io.metadata,
        layout=LAYOUT,
    )
    yield Decode(worker, io, peers)
    worker.close()
    assert io.misuse == []
    assert clock.sleeps == [], "the worker never blocks vLLM's engine loop"


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
    decode.peers.queue_reply(
        Failure(transfer_id="t1", engine_id="p0", cause="write_failed")
    )

    assert decode.step() == {"r1"}
    assert decode.worker.take_load_errors() == {3, 4, 5}
    assert decode.worker.take_load_errors() == set(), "reported once"
    decode.done()  # a Done after all is ignored
    assert decode.step() == set()


def test_an_overdue_receive_finishes_with_load_errors(decode, clock: FakeTime):
    decode.expect()
    clock.now += TTL_S
    assert decode.step() == set(), "the deadline leaves a margin past the TTL"

    clock.now += 5.1

    assert decode.step() == {"r1"}
    assert decode.worker.take_load_errors() == {3, 4, 5}
    assert_idle(decode.worker)


def test_a_late_done_after_a_failure_is_forgotten(decode, clock: FakeTime):
    decode.expect()
    decode.peers.queue_reply(Failure(transfer_id="t1", engine_id="p0", cause="expired"))
    assert decode.step() == {"r1"}
    decode.worker.take_load_errors()

    decode.done()  # the write landed after all
    assert decode.step() == set()
    clock.now += TTL_S + 10  # however long a Done may wait for its expect
    assert decode.step() == set()

    assert_idle(decode.worker)


def test_only_the_failed_transfer_is_affected(decode: Decode):
    decode.expect("t1", "r1")
    decode.expect("t2", "r2")
    decode.peers.queue_reply(Failure(transfer_id="t2", engine_id="p0", cause="expired"))

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
        HelloReply(engine_id="p0", accepted=False, reason="block_bytes differs")
    )

    assert decode.step() == {"r1"}


def test_a_receive_aborted_in_vllm_is_released_only_on_prefills_answer(decode):
    decode.expect()
    decode.worker.bind(KvPushMetadata(recv_cancels=["t1"]))

    (cancel,) = [m for m in decode.peers.messages(Cancel)]
    assert cancel.transfer_id == "t1"
    assert decode.step() == set(), "a WRITE may still land: blocks stay held"
    assert decode.worker.reserved_blocks() == 3

    decode.peers.queue_reply(
        Failure(transfer_id="t1", engine_id="p0", cause="cancelled")
    )
    assert decode.step() == {"r1"}
    assert decode.worker.take_load_errors() == set(), "the request is gone"
    assert decode.worker.counters.get("aborted.released") == 1
    assert_idle(decode.worker)


def test_a_receive_aborted_in_vllm_is_released_by_the_done_of_its_write(decode):
    decode.expect()
    decode.worker.bind(KvPushMetadata(recv_cancels=["t1"]))
    assert decode.step() == set()

    decode.done()

    assert decode.step() == {"r1"}
    assert decode.worker.take_load_errors() == set()
    assert_idle(decode.worker)


def test_an_aborted_receive_nobody_answers_is_released_at_its_deadline(
    decode, clock: FakeTime
):
    decode.expect()
    decode.worker.bind(KvPushMetadata(recv_cancels=["t1"]))
    decode.worker.bind(KvPushMetadata(recv_cancels=["t1"]))  # vLLM repeats: one Cancel
    assert len(decode.peers.messages(Cancel)) == 1
    clock.now += TTL_S
    assert decode.step() == set()

    clock.now += 5.1

    assert decode.step() == {"r1"}
    assert decode.worker.take_load_errors() == set()
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


def test_heartbeats_go_every_second_to_awaited_prefills_only(decode, clock):
    decode.step()
    assert decode.peers.messages(Heartbeat) == [], "nothing awaited"
    decode.expect()
    decode.step()
    decode.step()
    assert len(decode.peers.messages(Heartbeat)) == 1
    clock.now += 1.0
    decode.step()
    (_, second) = decode.peers.messages(Heartbeat)
    assert second == Heartbeat(engine_id="d0", boot_id=decode.worker.config.boot_id)


# -- prefill ---------------------------------------------------------------------


@dataclass
class RecordingWriter:
    """Stands in for :class:`~kvpush.connector.writer.Writer`."""

    ready: list[tuple[ReadyKv, str, object]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    pushed: set[str] = field(default_factory=set)

    def kv_ready(self, ready: ReadyKv, req_id: str, fence: object) -> None:
        self.ready.append((ready, req_id, fence))

    def cancel(self, transfer_id: str) -> None:
        self.cancelled.append(transfer_id)

    def take_finished(self) -> set[str]:
        out, self.pushed = self.pushed, set()
        return out

    def close(self) -> None:
        pass


@pytest.fixture
def prefill() -> Iterator[tuple[KvPushWorker, RecordingWriter]]:
    worker = make_worker("prefill")
    writer = RecordingWriter()
    worker._writer = writer  # type: ignore[assignment]
    yield worker, writer
    worker.close()


def trigger(req_id: str = "r1", tid: str = "t1") -> PushTrigger:
    return PushTrigger(
        req_id=req_id,
        transfer_id=tid,
        src_block_ids=(7, 8, 9),
        num_tokens=40,
        decode_engine_id="d0",
    )


def test_prefill_hands_triggered_kv_to_the_writer_after_the_forward(prefill):
    worker, writer = prefill
    worker.bind(KvPushMetadata(triggers=[trigger()], cancels=["t9"]))
    assert (writer.ready, writer.cancelled) == ([], []), "not before the forward"

    worker.wait_for_save()

    ((ready, req_id, fence),) = writer.ready
    assert ready == ReadyKv("t1", (7, 8, 9), 40, "d0")
    assert req_id == "r1"
    assert isinstance(fence, NoFence), "the CPU forward is synchronous"
    assert writer.cancelled == ["t9"]
    worker.wait_for_save()  # a second call in the same step repeats nothing
    assert (len(writer.ready), writer.cancelled) == (1, ["t9"])


def test_prefill_releases_blocks_once_vllm_and_the_writer_are_both_done(prefill):
    worker, writer = prefill
    worker.bind(KvPushMetadata(triggers=[trigger("r1", "t1"), trigger("r2", "t2")]))
    worker.wait_for_save()
    writer.pushed = {"r1"}  # pushed before vLLM finished the request
    assert worker.get_finished(set()) == (set(), set())

    assert worker.get_finished({"r1"}) == ({"r1"}, set())
    assert worker.get_finished(set()) == (set(), set()), "reported once"

    assert worker.get_finished({"r2"}) == (set(), set())  # vLLM first this time
    writer.pushed = {"r2"}
    assert worker.get_finished(set()) == ({"r2"}, set())
    assert leftovers(worker) == {}


def test_prefill_forgets_finished_requests_that_push_nothing(prefill):
    worker, _ = prefill
    worker.bind(KvPushMetadata())
    worker.wait_for_save()

    assert worker.get_finished({"plain", "aborted"}) == (set(), set())

    assert leftovers(worker) == {}


# -- layout_of ---------------------------------------------------------------------


def cpu_cache(num_layers=3, num_blocks=10, kv_heads=2, head_size=8, dtype=None):
    """vLLM's CPU KV cache: one allocation, a view per layer shaped
    [num_blocks, kv_heads, block_size, 2 * head_size]."""
    shape = (num_layers, num_blocks, kv_heads, BS, 2 * head_size)
    whole = torch.zeros(shape, dtype=dtype or torch.float32)
    return whole, {f"model.layers.{i}.attn": whole[i] for i in range(num_layers)}


@pytest.mark.parametrize(
    ("dtype", "name", "itemsize"),
    [(torch.float32, "float32", 4), (torch.bfloat16, "bfloat16", 2)],
)
def test_layout_of_the_cpu_cache_maps_every_layer_and_block(dtype, name, itemsize):
    whole, caches = cpu_cache(dtype=dtype)

    layout = layout_of(caches, BS)

    block_bytes = 2 * BS * 2 * 8 * itemsize  # kv_heads * block_size * 2*head_size
    layer_bytes = 10 * block_bytes
    base = whole.data_ptr()
    assert layout == KvLayout(
        num_blocks=10,
        block_bytes=block_bytes,
        block_size=BS,
        base_addrs=(base, base + layer_bytes, base + 2 * layer_bytes),
        device_id=0,
        kv_dtype=name,
    )
    assert layout.block_addr(2, 7) == whole[2, 7].data_ptr()


def test_layout_of_refuses_layers_with_different_block_shapes():
    _, caches = cpu_cache()
    caches["model.layers.9.attn"] = torch.zeros(10, 4, BS, 16)
    with pytest.raises(ValueError, match="same block shape"):
        layout_of(caches, BS)


def test_layout_of_refuses_blocks_that_are_not_contiguous():
    whole = torch.zeros(2, 2, 10, BS, 16)  # [layer, head, block, ...]
    caches = {"l0": whole[0].transpose(0, 1), "l1": whole[1].transpose(0, 1)}
    with pytest.raises(ValueError, match="contiguous"):
        layout_of(caches, BS)
