"""Streaming push (``--push-granularity chunk``): the writer gets a prompt's
KV chunk by chunk and pushes each chunk's blocks as it comes.

Items of one transfer are posted in prompt order, each tracked in flight on
its own; the Done rides on the last WRITE, posted only after every earlier
item completed; a registration that arrives after some chunks catches up
in one coalesced WRITE; only the blocks decode lacks are sent; a cancel,
a preemption or a failed WRITE between two chunks posts nothing more and
is answered only once no WRITE of the transfer is in flight.

Real writer thread over :class:`FakeNixlIO` (the ``Rig`` of
``test_connector_writer.py``); prompt: 60 tokens, 16-token blocks, so 4
blocks; prefill's blocks 4, 5, 6, 9; decode's 10, 11, 12, 13.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpush.connector.prefill.fence import NoFence
from kvpush.transfer.matcher import ReadyKv
from kvpush.transfer.messages import Cause, Done, Failure
from tests.fakes.fake_nixl import WriteRecord, wait_for
from tests.unit.test_connector_writer import (
    BLOCK_BYTES,
    DECODE,
    DECODE_ROUTE,
    DST_BASE,
    PREFILL,
    SRC_BASE,
    Rig,
)
from tests.unit.test_connector_writer_safety import FOREVER, end_write

SLOW = ("PROC",) * 200 + ("DONE",)  # a WRITE that runs for ~0.1 s


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def chunk(
    rig: Rig,
    first: int,
    src: tuple[int, ...],
    final: bool = False,
    fence: object = None,
    tid: str = "t1",
) -> None:
    """The forward of one prefill chunk completed prompt blocks
    ``first..first+len(src)-1`` (in prefill's blocks ``src``)."""
    kv = ReadyKv(tid, src, 60, DECODE, first_block=first, final=final)
    rig.writer.kv_ready(kv, "req-1", fence or NoFence())  # type: ignore[arg-type]


def blocks_of(write: WriteRecord) -> tuple[list[int], list[int]]:
    """(prefill blocks, decode blocks) a WRITE copies, from layer 0's runs."""
    src, dst = [], []
    for s, d in zip(write.src, write.dst, strict=True):
        if s.addr >= SRC_BASE + 32 * BLOCK_BYTES:
            continue  # layer 1 repeats layer 0's runs
        first_s, first_d = (
            (s.addr - SRC_BASE) // BLOCK_BYTES,
            (d.addr - DST_BASE) // BLOCK_BYTES,
        )
        n = s.length // BLOCK_BYTES
        src += range(first_s, first_s + n)
        dst += range(first_d, first_d + n)
    return src, dst


def failures(rig: Rig) -> list[Failure]:
    return rig.replies_to(DECODE_ROUTE, Failure)  # type: ignore[return-value]


def test_each_chunk_is_pushed_as_it_comes_and_done_rides_on_the_last(rig: Rig):
    rig.hello()
    rig.register()
    chunk(rig, 0, (4, 5))
    assert wait_for(lambda: len(rig.io.writes_snapshot()) == 1)
    chunk(rig, 2, (6, 9), final=True)

    assert rig.wait_finished("req-1")
    writes = rig.io.writes_snapshot()
    assert [blocks_of(w) for w in writes] == [([4, 5], [10, 11]), ([6, 9], [12, 13])]
    assert [w.notif for w in writes[:-1]] == [b""], "only the last item notifies"
    assert writes[-1].message == Done("t1", PREFILL, num_blocks=4)
    assert rig.decode_io.notifications() == [writes[-1].notif]
    assert failures(rig) == []


def test_items_in_flight_are_tracked_apart_and_done_waits_for_all(rig: Rig):
    """Before the fix ``Writes`` was keyed by transfer id: a second item of
    one transfer raised "already has a WRITE" (and a later one would have
    overwritten the first, freeing blocks under a running WRITE)."""
    rig.io.script_polls(*SLOW)
    rig.hello()
    rig.register()
    chunk(rig, 0, (4, 5))
    assert wait_for(lambda: len(rig.io.writes_snapshot()) == 1)
    chunk(rig, 2, (6, 9), final=True)

    # the blocks before the last go at once; the Done item waits
    assert wait_for(lambda: len(rig.io.writes_snapshot()) == 2)
    first, second = rig.io.writes_snapshot()
    assert not first.done and not second.done
    assert len(rig.writer._pipeline._writes) == 2
    assert blocks_of(second) == ([6], [12]) and second.notif == b""

    assert rig.wait_finished("req-1")
    *earlier, last = rig.io.writes_snapshot()
    assert blocks_of(last) == ([9], [13])
    assert all(w.done and w.released for w in earlier)
    assert last.message == Done("t1", PREFILL, num_blocks=4)
    assert rig.decode_io.notifications() == [last.notif], "one Done, the last"


def test_a_registration_that_arrives_mid_stream_catches_up_in_one_write(rig: Rig):
    rig.hello()
    chunk(rig, 0, (4, 5))
    chunk(rig, 2, (6,))
    rig.sync()
    assert rig.io.writes_snapshot() == [], "nowhere to write yet"

    rig.register()
    assert wait_for(lambda: len(rig.io.writes_snapshot()) == 1)
    chunk(rig, 3, (9,), final=True)

    assert rig.wait_finished("req-1")
    writes = rig.io.writes_snapshot()
    assert [blocks_of(w) for w in writes] == [([4, 5, 6], [10, 11, 12]), ([9], [13])]
    assert len(writes[0].src) == 2, "one run per layer: coalesced"


def test_a_partial_prefix_hit_on_decode_streams_only_the_blocks_it_lacks(rig: Rig):
    rig.hello()
    rig.register(dst=(20, 21, 22), first_block=1)  # decode holds block 0
    chunk(rig, 0, (4, 5))
    assert wait_for(lambda: len(rig.io.writes_snapshot()) == 1)
    chunk(rig, 2, (6, 9), final=True)

    assert rig.wait_finished("req-1")
    writes = rig.io.writes_snapshot()
    assert [blocks_of(w) for w in writes] == [([5], [20]), ([6, 9], [21, 22])]
    assert writes[-1].message == Done("t1", PREFILL, num_blocks=3)


def test_a_first_chunk_inside_decodes_prefix_hit_posts_nothing(rig: Rig):
    rig.hello()
    rig.register(dst=(21, 22), first_block=2)
    chunk(rig, 0, (4, 5))
    rig.sync()
    assert rig.io.writes_snapshot() == []

    chunk(rig, 2, (6, 9), final=True)

    assert rig.wait_finished("req-1")
    (write,) = rig.io.writes_snapshot()
    assert blocks_of(write) == ([6, 9], [21, 22])


def test_prefills_own_cached_blocks_go_first_before_any_forward(rig: Rig):
    """A prefix-cache hit on prefill is the stream's first chunk: those
    blocks never go through a forward and are pushed at once."""
    rig.hello()
    rig.register()
    chunk(rig, 0, (4, 5, 6))  # cached on prefill, handed before the forward

    class Pending:
        def is_ready(self) -> bool:
            return False

    chunk(rig, 3, (9,), final=True, fence=Pending())  # its forward still runs
    assert wait_for(lambda: len(rig.io.writes_snapshot()) == 1)
    (write,) = rig.io.writes_snapshot()
    assert blocks_of(write) == ([4, 5, 6], [10, 11, 12])
    rig.writer.cancel("t1")  # prefill gives up: the fence never completes
    assert rig.wait_finished("req-1")
    assert len(rig.io.writes_snapshot()) == 1


def test_a_cancel_between_two_chunks_posts_nothing_more(rig: Rig):
    rig.hello()
    rig.register()
    chunk(rig, 0, (4, 5))
    assert wait_for(lambda: (w := rig.io.writes_snapshot()) and w[0].released)

    rig.cancel()
    assert wait_for(lambda: failures(rig))
    chunk(rig, 2, (6, 9), final=True)  # the next chunk's forward ended
    rig.sync()

    assert len(rig.io.writes_snapshot()) == 1
    ((failure),) = failures(rig)
    assert failure.cause is Cause.CANCELLED
    assert rig.decode_io.notifications() == [], "decode never completes"
    assert rig.wait_finished("req-1")


def test_a_cancel_during_an_item_is_answered_only_after_it_ended(rig: Rig):
    rig.io.script_polls(*SLOW)
    rig.hello()
    rig.register()
    chunk(rig, 0, (4, 5))
    assert wait_for(lambda: rig.io.writes_snapshot())

    rig.cancel()
    rig.sync()
    (write,) = rig.io.writes_snapshot()
    assert not write.done and failures(rig) == [], "a WRITE may still land"
    chunk(rig, 2, (6, 9), final=True)

    assert wait_for(lambda: failures(rig))
    assert write.done and write.released and not write.cancelled
    assert [f.cause for f in failures(rig)] == [Cause.CANCELLED]
    assert len(rig.io.writes_snapshot()) == 1, "no item after the cancel"
    assert rig.wait_finished("req-1")


def test_a_preemption_mid_stream_lets_the_item_in_flight_finish(rig: Rig):
    rig.io.script_polls(*FOREVER)  # ends when the test says so
    rig.hello()
    rig.register()
    chunk(rig, 0, (4, 5))
    assert wait_for(lambda: rig.io.writes_snapshot())

    rig.writer.preempt({"t1"})  # returns at once
    rig.sync()
    (write,) = rig.io.writes_snapshot()
    assert not write.released and rig.writer.take_finished() == set(), (
        "its blocks are not freed while a WRITE reads them"
    )

    end_write(rig, write)
    assert rig.wait_finished("req-1")
    assert write.done and write.released and not write.cancelled
    assert [f.cause for f in failures(rig)] == [Cause.PREEMPTED]
    chunk(rig, 2, (6, 9), final=True)  # nothing is pushed after it
    rig.sync()
    assert len(rig.io.writes_snapshot()) == 1


def test_a_failed_item_ends_the_stream_once_the_others_ended(rig: Rig):
    rig.io.script_polls("PROC", "ERR")
    rig.hello()
    rig.register()
    chunk(rig, 0, (4, 5))

    assert wait_for(lambda: failures(rig))
    chunk(rig, 2, (6, 9), final=True)
    rig.sync()
    assert len(rig.io.writes_snapshot()) == 1
    assert [f.cause for f in failures(rig)] == [Cause.WRITE_FAILED]
    assert rig.wait_finished("req-1")
    assert rig.decode_io.notifications() == []


def test_a_reconcile_mid_stream_keeps_the_transfer_going(rig: Rig):
    """A matched stream waiting for its next chunk is still held: answering
    the Reconcile with a Failure would let decode free blocks the next
    item writes into."""
    rig.hello()
    rig.register()
    chunk(rig, 0, (4, 5))
    assert wait_for(lambda: (w := rig.io.writes_snapshot()) and w[0].released)

    rig.reconcile("t1", route=b"route-new")
    chunk(rig, 2, (6, 9), final=True)

    assert rig.wait_finished("req-1")
    assert rig.counters.get("reconciled.live") == 1
    assert rig.replies_to(b"route-new", Failure) == []
    assert len(rig.io.writes_snapshot()) == 2


def test_a_chunk_out_of_order_closes_the_transfer(rig: Rig):
    rig.hello()
    rig.register()
    chunk(rig, 0, (4,))
    chunk(rig, 2, (6, 9), final=True)  # block 1 skipped: a bug upstream

    assert wait_for(lambda: failures(rig))
    assert [f.cause for f in failures(rig)] == [Cause.REJECTED]
    assert rig.wait_finished("req-1")
    assert rig.decode_io.notifications() == []


def test_the_fault_files_post_delay_holds_a_chunk_due_only_after_the_match(
    tmp_path: Path,
):
    # The match comes with nothing due (the first chunk is inside decode's
    # prefix hit); the chunk that is due later waits out the delay as well.
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"delay_post_s": 0.5}))
    rig = Rig(fault_file=str(faults))
    try:
        rig.hello()
        rig.register(dst=(21, 22), first_block=2)
        chunk(rig, 0, (4, 5))
        rig.sync()  # matched
        chunk(rig, 2, (6, 9), final=True)
        rig.sync()
        assert rig.io.writes_snapshot() == [], "held for the post delay"

        assert rig.wait_finished("req-1")
        (write,) = rig.io.writes_snapshot()
        assert blocks_of(write) == ([6, 9], [21, 22])
    finally:
        rig.close()
