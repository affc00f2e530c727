"""How a prefill transfer ends when it does not complete, driven directly
(no thread, no sleeps; :mod:`tests.unit.prefill_pipeline_rig`): cancelled
by decode or by prefill and preempted, in every phase; duplicate KV and
registrations, another decode's claim, refusals. Prefill's blocks are freed
once no WRITE reads them, and decode hears one final word: the Done of a
WRITE already in flight, or a Failure on the socket that asked.
"""

from __future__ import annotations

from kvpush.connector.prefill.fence import NO_FENCE
from kvpush.connector.prefill.transfer import Phase
from kvpush.transfer.messages import Cause, HelloReply
from tests.unit.prefill_pipeline_rig import (
    CANCEL_ROUTE,
    DONE,
    DST,
    REG_ROUTE,
    SRC,
    WORKER,
    Fence,
    PipelineRig,
    blocks_of,
    end_write,
    pushed,
    running,
)
from tests.unit.test_connector_writer import BLOCK_BYTES, DST_BASE, PREFILL, layout

# -- cancelled by decode, in every phase -------------------------------------------


def test_decodes_cancel_of_a_registration_is_answered_at_once_on_its_socket():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.register(0.0)
    rig.cancel(0.1, route=CANCEL_ROUTE)

    assert rig.failures() == [("t1", Cause.CANCELLED)]
    assert rig.failures(CANCEL_ROUTE) == [("t1", Cause.CANCELLED)]
    assert rig.counters.get("cancelled.by_decode") == 1
    rig.ready(0.2)  # prefill's KV after the cancel: freed, never written
    rig.tick(0.2)
    assert rig.finished == ["req-1"] and rig.writes() == []
    assert len(rig.failures()) == 1
    rig.assert_nothing_held()


def test_decodes_cancel_of_waiting_kv_frees_it():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.ready(0.0)
    rig.cancel(0.1, route=CANCEL_ROUTE)

    assert rig.phase() is None and rig.finished == ["req-1"]
    assert rig.failures() == [("t1", Cause.CANCELLED)]
    rig.register(0.2)  # a late registration for a cancelled transfer
    rig.tick(0.2)
    assert rig.writes() == []
    rig.assert_nothing_held()


def test_decodes_cancel_of_a_matched_transfer_answers_only_the_canceller():
    rig = PipelineRig()
    rig.register(0.0)
    rig.ready(0.0)  # matched; decode never said hello
    rig.cancel(0.1, route=CANCEL_ROUTE)

    assert rig.phase() is None and rig.finished == ["req-1"]
    assert rig.failures() == [("t1", Cause.CANCELLED)]
    assert rig.failures(CANCEL_ROUTE) == [("t1", Cause.CANCELLED)]
    rig.hello(0.2)
    rig.tick(0.2)
    assert rig.writes() == []
    rig.assert_nothing_held()


def test_decodes_cancel_during_a_write_is_answered_by_its_done():
    rig, write = running()
    assert rig.phase() is Phase.IN_FLIGHT
    rig.cancel(1.0, route=CANCEL_ROUTE)
    rig.tick(1.0)
    assert rig.phase() is Phase.ENDING
    assert rig.finished == [] and rig.failures() == [], "the WRITE may still land"
    assert not write.released

    end_write(write)
    rig.tick(2.0)
    assert rig.finished == ["req-1"]
    assert write.released and not write.cancelled
    assert rig.notifications() == [DONE], "the Done is the final word"
    assert rig.failures() == []
    rig.assert_nothing_held()


def test_decodes_cancel_during_a_write_that_fails_is_answered_on_its_socket():
    rig, write = running()
    rig.cancel(1.0, route=CANCEL_ROUTE)
    end_write(write, "ERR")
    rig.tick(2.0)

    assert rig.finished == ["req-1"]
    assert rig.failures() == [("t1", Cause.WRITE_FAILED)]
    assert rig.failures(CANCEL_ROUTE) == [("t1", Cause.WRITE_FAILED)]
    rig.assert_nothing_held()


def test_a_cancel_of_an_unknown_transfer_is_answered_so_decode_can_free():
    rig = PipelineRig()
    rig.cancel(0.0, route=CANCEL_ROUTE, tid="never-registered")
    assert rig.failures(CANCEL_ROUTE) == [("never-registered", Cause.CANCELLED)]
    rig.assert_nothing_held()


def test_another_decodes_cancel_is_refused_and_the_transfer_goes_on():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.register(0.0)
    rig.cancel(0.1, route=b"route-d9", engine="d9")
    assert rig.failures(b"route-d9") == [("t1", Cause.CANCELLED)]

    rig.ready(0.2)
    rig.tick(0.2)
    assert rig.finished == ["req-1"] and rig.notifications() == [DONE]
    assert rig.failures(REG_ROUTE) == []
    rig.assert_nothing_held()


# -- cancelled by prefill, preempted -----------------------------------------------


def test_prefills_cancel_of_a_registration_tells_decode():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.register(0.0)
    rig.pipeline.on_prefill_cancel("t1", 0.1)

    assert rig.failures(REG_ROUTE) == [("t1", Cause.CANCELLED)]
    assert rig.counters.get("cancelled.by_prefill") == 1
    rig.ready(0.2)  # the KV turns up after all: freed, not written
    rig.tick(0.2)
    assert rig.finished == ["req-1"] and rig.writes() == []
    rig.assert_nothing_held()


def test_prefills_cancel_of_a_matched_transfer_frees_it_unwritten():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.register(0.0)
    rig.ready(0.0, fence=Fence())  # its forward never completes
    rig.tick(0.0)
    rig.pipeline.on_prefill_cancel("t1", 0.1)

    assert rig.phase() is None and rig.finished == ["req-1"]
    assert rig.failures() == [("t1", Cause.CANCELLED)]
    assert rig.writes() == []
    rig.assert_nothing_held()


def test_prefills_cancel_during_a_write_waits_for_it():
    rig, write = running()
    rig.pipeline.on_prefill_cancel("t1", 1.0)
    assert rig.phase() is Phase.ENDING and rig.finished == []

    end_write(write)
    rig.tick(2.0)
    assert rig.finished == ["req-1"] and rig.notifications() == [DONE]
    assert rig.failures() == []
    rig.assert_nothing_held()


def test_preemption_before_the_write_closes_the_transfer_unwritten():
    rig = PipelineRig()
    rig.register(0.0)  # decode's Hello has not come: matched, not postable
    rig.ready(0.0)
    rig.tick(0.0)
    rig.pipeline.on_preempt({"t1"}, 0.1)

    assert rig.phase() is None and rig.finished == ["req-1"]
    assert rig.failures() == [("t1", Cause.PREEMPTED)]
    assert rig.counters.get("preempted.before_write") == 1
    rig.hello(0.2)  # had it been postable now, it would read reused blocks
    rig.tick(0.2)
    assert rig.writes() == []
    rig.assert_nothing_held()


def test_preemption_of_waiting_kv_frees_it_and_refuses_its_registration():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.ready(0.0)
    rig.pipeline.on_preempt({"t1"}, 0.1)
    assert rig.finished == ["req-1"]
    assert rig.failures(WORKER) == [("t1", Cause.PREEMPTED)]

    rig.register(0.2)

    assert rig.failures(REG_ROUTE) == [("t1", Cause.REJECTED)]
    rig.tick(0.2)
    assert rig.writes() == []
    rig.assert_nothing_held()


def test_preemption_during_a_write_lets_it_finish_and_frees_the_blocks_after():
    rig, write = running()
    rig.pipeline.on_preempt({"t1"}, 1.0)
    rig.tick(1.0)

    assert rig.phase() is Phase.ENDING
    assert rig.finished == [], "a WRITE reads the blocks"
    assert not write.released and not write.cancelled
    assert rig.counters.get("preempted.before_write") == 0

    end_write(write)
    rig.tick(2.0)
    assert rig.finished == ["req-1"]
    assert rig.notifications() == [DONE], "intact: its Done"
    assert rig.failures() == []
    rig.assert_nothing_held()


def test_a_preempted_write_that_fails_frees_its_blocks_at_its_end():
    rig, write = running()
    rig.pipeline.on_preempt({"t1"}, 1.0)
    rig.tick(1.0)
    assert rig.finished == []

    end_write(write, "ERR")
    rig.tick(2.0)
    assert rig.finished == ["req-1"]
    assert rig.failures() == [("t1", Cause.WRITE_FAILED)]
    rig.assert_nothing_held()


# -- duplicates, claims and refusals -----------------------------------------------


def test_a_second_kv_with_a_transfer_id_in_use_is_refused_before_any_change():
    rig = PipelineRig()
    rig.ready(0.0, req_id="req-1")
    rig.ready(0.0, src=(20, 21, 22, 23), req_id="req-evil")
    assert rig.finished == ["req-evil"]
    assert rig.counters.get("rejected.duplicate") == 1

    rig.hello(0.1)
    rig.register(0.1)
    rig.tick(0.1)
    assert rig.finished == ["req-evil", "req-1"]
    (write,) = rig.writes()
    assert blocks_of(write)[0] == (list(SRC), list(DST))
    rig.assert_nothing_held()


def test_kv_for_a_transfer_already_pushed_is_freed_unwritten():
    rig = pushed(PipelineRig())
    rig.ready(1.0, req_id="req-again")
    rig.tick(1.0)
    assert rig.finished == ["req-1", "req-again"]
    assert len(rig.writes()) == 1
    rig.assert_nothing_held()


def test_a_repeated_registration_is_ignored_and_the_transfer_goes_on():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.register(0.0)
    rig.register(0.1)
    assert rig.counters.get("rejected.duplicate") == 1
    assert rig.failures() == [], "its owner must not hear of it"

    rig.ready(0.2)
    rig.tick(0.2)
    assert rig.finished == ["req-1"] and len(rig.writes()) == 1
    rig.assert_nothing_held()


def test_another_decodes_registration_for_a_claimed_id_is_refused_to_it_alone():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.register(0.0)
    rig.register(0.1, engine="d9", route=b"route-d9-sched")

    assert rig.counters.get("rejected.claimed") == 1
    assert rig.failures() == [("t1", Cause.REJECTED)]
    assert rig.failures(b"route-d9-sched") == [("t1", Cause.REJECTED)]
    rig.ready(0.2)
    rig.tick(0.2)
    assert rig.finished == ["req-1"] and rig.notifications() == [DONE]
    rig.assert_nothing_held()


def test_a_registration_outside_decodes_cache_is_refused():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.register(0.0, dst=(10, 11, 12, 40))  # decode's cache has 32 blocks
    assert rig.counters.get("rejected.out_of_range") == 1
    assert rig.failures(REG_ROUTE) == [("t1", Cause.REJECTED)]

    rig.ready(0.1)
    rig.tick(0.1)
    assert rig.finished == ["req-1"] and rig.writes() == []
    rig.assert_nothing_held()


def test_a_registration_from_a_decode_tp_that_cannot_pair_is_refused():
    rig = PipelineRig()  # the model's KV heads unknown: equal TP sizes only
    rig.register(0.0, decode_tp=2)
    assert rig.counters.get("rejected.incompatible") == 1
    assert rig.failures(REG_ROUTE) == [("t1", Cause.REJECTED)]
    rig.assert_nothing_held()


def test_an_incompatible_hello_is_refused_and_its_transfer_never_written():
    rig = PipelineRig()
    bad = layout(DST_BASE, block_bytes=2 * BLOCK_BYTES)
    reply = rig.hello(0.0, decode_layout=bad)
    assert not reply.accepted and "block_bytes" in reply.reason
    assert rig.counters.get("rejected.incompatible") == 1

    rig.register(0.0, ttl_s=1.2)
    rig.ready(0.0)
    rig.tick(0.1)
    assert rig.writes() == []
    rig.tick(0.3)  # with no accepted peer it expires at its post deadline
    assert rig.finished == ["req-1"] and rig.writes() == []
    assert rig.failures() == [("t1", Cause.EXPIRED)]
    rig.assert_nothing_held()


def test_an_unexpected_message_is_counted():
    rig = PipelineRig()
    rig.pipeline.on_message(REG_ROUTE, HelloReply(PREFILL, True, "0"), 0.0)
    assert rig.counters.get("rejected.unexpected") == 1
    rig.assert_nothing_held()


def test_a_fence_of_one_transfer_never_holds_another():
    rig = PipelineRig()
    slow = Fence()
    rig.hello(0.0)
    rig.register(0.0, tid="t1")
    rig.ready(0.0, tid="t1", fence=slow)
    rig.register(0.0, tid="t2", dst=(20, 21, 22, 23))
    rig.ready(0.0, tid="t2", req_id="req-2", src=(5, 1, 2, 3), fence=NO_FENCE)
    rig.tick(0.0)
    assert rig.finished == ["req-2"], "t2 is written while t1's forward runs"

    slow.done = True
    rig.tick(0.1)
    assert rig.finished == ["req-2", "req-1"]
    rig.assert_nothing_held()


def test_kv_after_decode_cancelled_an_unknown_id_is_freed_unwritten():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.cancel(0.0, route=CANCEL_ROUTE)
    rig.ready(0.1)
    rig.tick(0.1)
    assert rig.finished == ["req-1"] and rig.writes() == []
    assert rig.counters.get("rejected.closed") == 1
    rig.assert_nothing_held()
