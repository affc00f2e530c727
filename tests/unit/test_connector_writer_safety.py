"""The writer never lets data read from blocks it no longer owns reach decode
as a completed transfer, and never wedges: issue 9's defects, each as the
sequence that exposed it. Every test ends with nothing held (``Rig.close``).

* preemption after the trigger (item 1): a WRITE not yet posted is never
  posted; ``preempt`` returns at once, and one in flight is let finish (it
  is never cancelled): the request is reported finished (its blocks
  unpinned) only once that WRITE ended;
* NIXL errors (item 3): ``ERR`` keeps the blocks until NIXL released the
  handle; a raising ``state`` or ``release`` never stops the loop;
* duplicate transfer ids (item 4);
* fences (item 6): a pending fence does not stall another transfer;
* a forgotten decode converges (item 8): it is told, asked for a Hello,
  and its next transfer is pushed;
* shutdown (item 9): WRITEs are cancelled; memory stays registered if NIXL
  would not let go.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from kvpush.transfer.messages import Cause, Done, Failure, HelloRequest
from tests.fakes.fake_nixl import WriteRecord, wait_for
from tests.unit.test_connector_writer import DECODE_ROUTE, Rig

FOREVER = ("PROC",) * 1_000_000 + ("DONE",)


def failures(rig: Rig) -> list[Failure]:
    return rig.replies_to(DECODE_ROUTE, Failure)  # type: ignore[return-value]


def end_write(rig: Rig, write: WriteRecord, state: str = "DONE") -> None:
    """A WRITE scripted to run for ever (:data:`FOREVER`) ends at its next
    poll, as ``state`` says."""
    with rig.io._lock:
        write.states = deque([state])


# -- item 1: preemption --------------------------------------------------------


def test_preemption_before_the_write_closes_the_transfer_unwritten():
    rig = Rig()
    try:
        rig.register()  # decode's Hello has not come: matched, not postable
        rig.ready()
        rig.sync()

        rig.writer.preempt({"t1"})

        assert wait_for(lambda: failures(rig))
        assert failures(rig)[0].cause is Cause.PREEMPTED
        rig.hello()  # had it been postable now, it would read reused blocks
        rig.sync()
        assert rig.io.writes_snapshot() == []
        assert rig.decode_io.notifications() == [], "no Done for reused blocks"
        assert rig.wait_finished("req-1")
    finally:
        rig.close()


def test_preemption_of_kv_waiting_for_its_registration_refuses_it_later():
    rig = Rig()
    try:
        rig.hello()
        rig.ready()
        rig.sync()
        rig.writer.preempt({"t1"})
        assert rig.wait_finished("req-1")

        rig.register()  # arrives after the preemption

        assert wait_for(lambda: failures(rig))
        rig.sync()
        assert rig.io.writes_snapshot() == []
    finally:
        rig.close()


def test_preemption_does_not_wait_for_a_write_in_flight_nor_free_its_blocks():
    """The review's hang: ``preempt`` used to wait for the WRITE (and the
    worker then raised, stopping the engine). It returns at once now; the
    WRITE runs on, uncancelled, and the request comes out of
    ``take_finished`` (its pins go) only once that WRITE ended."""
    rig = Rig()
    try:
        rig.io.script_polls(*FOREVER)  # ends when the test says so
        rig.hello()
        rig.register()
        rig.ready()
        assert wait_for(lambda: rig.io.writes_snapshot())

        rig.writer.preempt({"t1"})  # returns, with the WRITE in flight
        rig.sync()  # the writer handled the preemption

        (write,) = rig.io.writes_snapshot()
        assert not write.done and not write.released and not write.cancelled
        assert rig.writer.take_finished() == set(), "a WRITE reads the blocks"
        assert rig.writer._pipeline._writes.has("t1")
        end_write(rig, write)
        assert rig.wait_finished("req-1")
        assert write.done and write.released and not write.cancelled
        assert rig.decode_io.notifications() == [write.notif], "intact: its Done"
    finally:
        rig.close()


def test_a_preempted_write_that_fails_also_frees_its_blocks_only_at_its_end():
    rig = Rig()
    try:
        rig.io.script_polls(*FOREVER)
        rig.hello()
        rig.register()
        rig.ready()
        assert wait_for(lambda: rig.io.writes_snapshot())
        rig.writer.preempt({"t1"})
        rig.sync()
        assert rig.writer.take_finished() == set()

        (write,) = rig.io.writes_snapshot()
        end_write(rig, write, "ERR")

        assert rig.wait_finished("req-1")
        assert write.released and not write.cancelled
        assert wait_for(lambda: failures(rig))
    finally:
        rig.close()


# -- item 3: NIXL errors -------------------------------------------------------


def test_err_keeps_the_blocks_until_nixl_released_the_handle():
    rig = Rig()
    try:
        rig.io.release_failures = 2  # the first two releases fail (1 s apart)
        rig.io.script_polls("PROC", "ERR")
        rig.hello()
        rig.register()
        rig.ready()
        assert wait_for(lambda: rig.io.writes_snapshot())
        time.sleep(0.3)
        assert not rig.wait_finished("req-1", timeout_s=0.01), "ERR is not proof"
        assert failures(rig) == [], "no final word while the handle is held"

        assert rig.wait_finished("req-1", timeout_s=4.0)
        (write,) = rig.io.writes_snapshot()
        assert write.released
        assert failures(rig)[0].cause is Cause.WRITE_FAILED
    finally:
        rig.close()


def test_a_raising_state_check_does_not_stop_the_writer_or_its_deadlines():
    rig = Rig()
    try:
        rig.io.raise_next("state")  # e.g. nixlRemoteDisconnectError
        rig.hello()
        rig.register()
        rig.ready()
        rig.register(tid="t2", ttl_s=1.05)  # expires 50 ms after arrival

        assert rig.wait_finished("req-1")  # polled again after the error
        assert len(rig.io.writes_snapshot()) == 1
        assert wait_for(lambda: [f for f in failures(rig) if f.transfer_id == "t2"])
    finally:
        rig.close()


def test_a_raising_release_is_retried():
    rig = Rig()
    try:
        rig.io.script_polls("ERR")
        rig.io.raise_next("release")
        rig.hello()
        rig.register()
        rig.ready()

        assert rig.wait_finished("req-1", timeout_s=4.0)
        assert failures(rig)[0].cause is Cause.WRITE_FAILED
    finally:
        rig.close()


# -- item 4: duplicate transfer ids ----------------------------------------------


def test_a_second_kv_with_a_transfer_id_in_use_is_refused_before_any_change():
    """Before the fix the second request's id overwrote the first's: the
    WRITE read the first's blocks and reported the second, and the first
    was held forever."""
    rig = Rig()
    try:
        rig.ready(src=(4, 5, 6, 9), req_id="req-1")
        rig.ready(src=(20, 21, 22, 23), req_id="req-evil")

        assert rig.wait_finished("req-evil"), "refused at once, nothing held"
        rig.hello()
        rig.register()
        assert rig.wait_finished("req-1"), "the first is pushed and released"
        (write,) = rig.io.writes_snapshot()
        assert write.message == Done(transfer_id="t1", engine_id="p0", num_blocks=4)
        assert rig.counters.get("rejected.duplicate") == 1
    finally:
        rig.close()


def test_a_kv_for_a_transfer_already_pushed_is_released_unwritten():
    rig = Rig()
    try:
        rig.hello()
        rig.register()
        rig.ready()
        assert rig.wait_finished("req-1")

        rig.ready(req_id="req-again")

        assert rig.wait_finished("req-again")
        assert len(rig.io.writes_snapshot()) == 1
    finally:
        rig.close()


# -- item 6: fences never block the writer ------------------------------------


class Fence:
    def __init__(self) -> None:
        self.ready = threading.Event()

    def is_ready(self) -> bool:
        return self.ready.is_set()


def test_a_pending_fence_does_not_stall_another_transfer():
    """Before the fix the writer blocked up to 10 s on one transfer's event."""
    rig = Rig()
    try:
        slow = Fence()
        rig.hello()
        rig.register(tid="t1")
        rig.ready(tid="t1", req_id="req-1", fence=slow)
        rig.register(tid="t2", dst=(20, 21, 22, 23))
        rig.ready(tid="t2", req_id="req-2", src=(0, 1, 2, 3))

        assert rig.wait_finished("req-2"), "t2 is written while t1's forward runs"
        assert len(rig.io.writes_snapshot()) == 1
        slow.ready.set()
        assert rig.wait_finished("req-1")
        assert len(rig.io.writes_snapshot()) == 2
    finally:
        rig.close()


# -- item 8: a decode prefill forgot converges ---------------------------------


def test_a_forgotten_decode_is_told_asked_for_a_hello_and_served_again():
    rig = Rig(peer_timeout_s=0.2)
    try:
        rig.hello()
        rig.register(tid="t0")
        assert wait_for(lambda: failures(rig), 2.0), "dropped: t0 failed, told"
        assert failures(rig)[0].cause is Cause.PEER_LOST

        rig.register()  # the decode was only stalled; it carries on
        assert wait_for(lambda: rig.replies_to(DECODE_ROUTE, HelloRequest))
        rig.hello()
        rig.ready()

        assert rig.wait_finished("req-1")
        assert len(rig.io.writes_snapshot()) == 1, "the pair works again"
    finally:
        rig.close()


def test_a_stalled_writer_pardons_its_peers():
    """A process stopped for longer than the peer timeout must not drop its
    decodes on waking, before it reads the heartbeats queued meanwhile."""
    rig = Rig(peer_timeout_s=0.2)
    try:
        pipeline = rig.writer._pipeline
        rig.hello()
        rig.heartbeat()
        rig.sync()
        pipeline._peers.heard("d0", time.monotonic() - 60)  # as if stopped a minute
        pipeline.pardon(time.monotonic(), 60.0)
        assert pipeline._peers.silent({"d0"}, time.monotonic()) == set()
    finally:
        rig.close()


# -- item 9: shutdown ------------------------------------------------------------


def test_close_never_cancels_a_write_and_reports_one_still_running():
    # (the side channel closes only after the WRITEs ended:
    # test_connector_prefill_close.py)
    rig = Rig()
    rig.io.script_polls(*FOREVER)
    rig.hello()
    rig.register()
    rig.ready()
    assert wait_for(lambda: rig.io.writes_snapshot())

    assert not rig.writer.close(drain_s=0.05), "the memory must stay registered"
    (write,) = rig.io.writes_snapshot()
    assert not write.cancelled and not write.released
