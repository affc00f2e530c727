"""The prefill writer's state machine, driven directly: every phase of one
transfer in every arrival order, a WRITE that fails, every deadline, a
decode lost, silent or restarted; each at an explicit time (no thread, no
sleeps; :mod:`tests.unit.prefill_pipeline_rig`). Cancels, preemption and
refusals: ``test_prefill_pipeline_endings.py``; streaming, late binding,
TP and reconcile: ``test_prefill_pipeline_stream.py``.

A transfer has no record while only decode's registration is here (it
waits in the matcher); from its first ready KV on it is *waiting* (no
registration yet), *matched* (nothing posted yet), *in flight* (a WRITE
posted) and *ending* (posts nothing more; its WRITEs in flight run to
their end). Whatever the ending, prefill's blocks are freed once
(``finished``), only once no WRITE reads them, and decode hears one final
word: the Done of the last WRITE, or a Failure.
"""

from __future__ import annotations

import pytest

from kvpush.connector.prefill.pipeline import POLL_S
from kvpush.connector.prefill.transfer import Phase
from kvpush.connector.prefill.writes import RETRY_S
from kvpush.transfer.messages import (
    Cause,
    Done,
    FirstToken,
    Hello,
    HelloReply,
    HelloRequest,
    Message,
    SampleLogprobs,
)
from tests.unit.prefill_pipeline_rig import (
    CANCEL_ROUTE,
    DONE,
    DST,
    FOREVER,
    REG_ROUTE,
    SRC,
    WORKER,
    Fence,
    FixedFaults,
    PipelineRig,
    blocks_of,
    end_write,
    pushed,
    running,
)
from tests.unit.test_connector_writer import (
    DECODE,
    PREFILL,
)

# -- every phase, in every arrival order ------------------------------------------


def test_a_push_walks_every_phase_and_leaves_nothing_held():
    rig = PipelineRig()
    rig.io.script_polls("PROC", "DONE")
    assert rig.hello(0.0).accepted
    rig.register(0.1)
    assert rig.phase() is None, "a registration alone waits in the matcher"

    rig.ready(0.2)
    assert rig.phase() is Phase.MATCHED
    assert rig.writes() == [], "posted only by the tick"
    rig.tick(0.2)
    assert rig.phase() is Phase.IN_FLIGHT
    (write,) = rig.writes()
    assert blocks_of(write) == {0: (list(SRC), list(DST)), 1: (list(SRC), list(DST))}
    assert rig.finished == [], "a WRITE reads the blocks"

    rig.tick(0.3)
    assert rig.phase() is None
    assert rig.finished == ["req-1"]
    assert rig.notifications() == [DONE]
    assert rig.failures() == []
    rig.tick(0.4)
    assert rig.finished == ["req-1"], "freed once"
    rig.assert_nothing_held()


def test_kv_before_its_registration_waits_then_matches():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.ready(0.0)
    assert rig.phase() is Phase.WAITING
    rig.tick(1.0)
    assert rig.writes() == [] and rig.finished == []

    rig.register(2.0)
    assert rig.phase() is Phase.MATCHED
    rig.tick(2.0)

    assert rig.finished == ["req-1"]
    assert [w.message for w in rig.writes()] == [DONE]
    rig.assert_nothing_held()


def test_a_registration_before_decodes_hello_asks_for_it_and_waits():
    rig = PipelineRig()
    rig.register(0.0)
    (ask,) = rig.sent_to(REG_ROUTE)
    assert isinstance(ask, HelloRequest)
    rig.ready(0.1)
    rig.tick(0.1)
    assert rig.phase() is Phase.MATCHED
    assert rig.writes() == [], "no peer to write to yet"

    rig.hello(0.2)
    rig.tick(0.2)

    assert rig.finished == ["req-1"]
    assert rig.notifications() == [DONE]
    rig.assert_nothing_held()


def test_nothing_is_posted_before_the_kvs_device_fence_completed():
    rig = PipelineRig()
    fence = Fence()
    rig.hello(0.0)
    rig.register(0.0)
    rig.ready(0.0, fence=fence)
    rig.tick(0.1)
    assert rig.phase() is Phase.MATCHED and rig.writes() == []
    assert rig.pipeline.wait_s(0.1) == POLL_S, "the writer polls the fence"

    fence.done = True
    rig.tick(0.2)

    assert rig.finished == ["req-1"] and len(rig.writes()) == 1
    rig.assert_nothing_held()


def test_a_prefix_hit_on_decode_skips_the_blocks_it_already_holds():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.register(0.0, dst=(20, 21, 22), first_block=1)
    rig.ready(0.0)
    rig.tick(0.0)

    (write,) = rig.writes()
    assert blocks_of(write)[0] == ([5, 6, 9], [20, 21, 22])
    assert write.message == Done("t1", PREFILL, num_blocks=3)
    rig.assert_nothing_held()


# -- a WRITE that fails ------------------------------------------------------------


def test_a_write_nixl_fails_ends_the_transfer_with_write_failed():
    rig = PipelineRig()
    rig.io.script_polls("PROC", "ERR")
    pushed(rig)

    rig.tick(0.1)

    assert rig.phase() is None
    assert rig.finished == ["req-1"]
    assert rig.failures(REG_ROUTE) == [("t1", Cause.WRITE_FAILED)]
    assert rig.counters.get("failed.write_failed") == 1
    assert rig.notifications() == []
    rig.assert_nothing_held()


def test_a_write_nixl_refused_at_post_ends_only_once_its_handle_is_released():
    rig = PipelineRig()
    rig.io.refuse_next_write()
    rig.io.release_failures = 1
    rig.hello(0.0)
    rig.register(0.0)
    rig.ready(0.0)
    rig.tick(0.0)  # posted, refused; the release tried at once: refused

    assert rig.phase() is Phase.ENDING
    assert rig.finished == [] and rig.failures() == []
    rig.tick(RETRY_S / 2)
    assert rig.phase() is Phase.ENDING

    rig.tick(RETRY_S)  # released

    assert rig.phase() is None
    assert rig.finished == ["req-1"]
    assert rig.failures() == [("t1", Cause.WRITE_FAILED)]
    rig.assert_nothing_held()


def test_a_write_that_gets_no_handle_fails_at_once():
    rig = PipelineRig()
    rig.io.fail_next_write(RuntimeError("no route to peer"))
    rig.hello(0.0)
    rig.register(0.0)
    rig.ready(0.0)
    rig.tick(0.0)

    assert rig.writes() == []
    assert rig.finished == ["req-1"]
    assert rig.failures() == [("t1", Cause.WRITE_FAILED)]
    rig.assert_nothing_held()


def test_a_raising_state_check_is_polled_again():
    rig = PipelineRig()
    rig.io.raise_next("state")
    pushed(rig)
    assert rig.finished == []

    rig.tick(0.1)

    assert rig.finished == ["req-1"] and rig.notifications() == [DONE]
    rig.assert_nothing_held()


def test_a_write_past_its_deadline_is_counted_and_awaited_never_cancelled():
    rig = PipelineRig(write_timeout_s=1.0)
    rig.io.script_polls(*FOREVER)
    pushed(rig)
    (write,) = rig.writes()

    rig.tick(1.5)
    assert rig.counters.get("expired.write") == 1
    assert rig.phase() is Phase.IN_FLIGHT and rig.finished == []
    assert not write.released

    end_write(write)
    rig.tick(2.0)
    assert rig.finished == ["req-1"] and not write.cancelled
    assert rig.failures() == [] and rig.counters.get("expired.write") == 1
    rig.assert_nothing_held()


# -- deadlines -----------------------------------------------------------------


def test_a_fence_past_the_post_deadline_fails_the_transfer_unwritten():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.register(0.0, ttl_s=1.2)  # post deadline: 0.2 s (post margin 1 s)
    rig.ready(0.0, fence=Fence())
    rig.tick(0.15)
    assert rig.phase() is Phase.MATCHED

    rig.tick(0.3)

    assert rig.writes() == []
    assert rig.finished == ["req-1"]
    assert rig.failures(REG_ROUTE) == [("t1", Cause.WRITE_FAILED)]
    rig.assert_nothing_held()


def test_a_decode_that_never_said_hello_expires_its_matched_transfer():
    rig = PipelineRig()
    rig.register(0.0, ttl_s=1.2)
    rig.ready(0.0)
    rig.tick(0.3)

    assert rig.failures(REG_ROUTE) == [("t1", Cause.EXPIRED)]
    assert rig.counters.get("expired.no_hello") == 1
    assert rig.finished == ["req-1"] and rig.writes() == []
    rig.assert_nothing_held()


def test_a_post_delay_past_the_deadline_expires_the_matched_transfer():
    rig = PipelineRig(faults=FixedFaults(post_delay_s=1.5))
    rig.hello(0.0)
    rig.register(0.0, ttl_s=2.0)  # post deadline: 1 s
    rig.ready(0.0)
    rig.tick(0.9)
    assert rig.phase() is Phase.MATCHED and rig.writes() == []

    rig.tick(1.1)

    assert rig.failures() == [("t1", Cause.EXPIRED)]
    assert rig.counters.get("expired.matched") == 1
    assert rig.finished == ["req-1"] and rig.writes() == []
    rig.assert_nothing_held()


def test_ready_kv_nobody_registers_for_expires_and_decode_is_told():
    rig = PipelineRig(ready_ttl_s=5.0)
    rig.hello(0.0)
    rig.ready(0.0)
    rig.tick(4.9)
    assert rig.phase() is Phase.WAITING and rig.finished == []

    rig.tick(5.0)

    assert rig.phase() is None
    assert rig.finished == ["req-1"]
    assert rig.counters.get("expired.ready") == 1
    assert rig.failures(WORKER) == [("t1", Cause.EXPIRED)], "on its Hello's socket"
    rig.assert_nothing_held()


def test_a_registration_whose_kv_never_came_expires_and_refuses_the_kv_later():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.register(0.0, ttl_s=3.0)  # deadline: 2 s
    rig.tick(1.9)
    assert rig.failures() == []

    rig.tick(2.0)
    assert rig.failures(REG_ROUTE) == [("t1", Cause.EXPIRED)]
    assert rig.counters.get("expired.registration") == 1

    rig.ready(3.0)  # the KV, too late: freed, never written
    rig.tick(3.0)
    assert rig.finished == ["req-1"] and rig.writes() == []
    assert rig.counters.get("rejected.closed") == 1
    assert len(rig.failures()) == 1
    rig.assert_nothing_held()


def test_fault_delayed_kv_is_admitted_only_once_its_delay_passed():
    rig = PipelineRig(faults=FixedFaults(ready_delay_s=1.0))
    rig.hello(0.0)
    rig.register(0.0)
    rig.ready(0.0)
    assert rig.phase() is None, "held before the matcher sees it"
    rig.tick(0.9)
    assert rig.writes() == [] and rig.pipeline._matcher.is_pending("t1")

    rig.tick(1.0)

    assert rig.finished == ["req-1"] and len(rig.writes()) == 1
    rig.assert_nothing_held()


def test_a_cancel_during_the_post_delay_stops_the_transfer_unwritten():
    rig = PipelineRig(faults=FixedFaults(post_delay_s=1.0))
    rig.hello(0.0)
    rig.register(0.0)
    rig.ready(0.0)
    rig.tick(0.5)
    assert rig.phase() is Phase.MATCHED and rig.writes() == []

    rig.cancel(0.6, route=CANCEL_ROUTE)
    rig.tick(2.0)

    assert rig.writes() == []
    assert rig.finished == ["req-1"]
    assert rig.failures() == [("t1", Cause.CANCELLED)]
    rig.assert_nothing_held()


# -- decode lost, silent or restarted ---------------------------------------------


def test_a_silent_decode_is_dropped_and_told_after_the_peer_timeout():
    rig = PipelineRig(peer_timeout_s=10.0)
    rig.hello(0.0)
    rig.register(0.0, ttl_s=30.0)
    rig.tick(10.0)
    assert rig.failures() == []

    rig.tick(10.1)

    assert rig.failures(REG_ROUTE) == [("t1", Cause.PEER_LOST)]
    assert rig.counters.get("peer_lost") == 1
    assert rig.pipeline._peers.get("d0") is None, "a later Hello loads it afresh"
    rig.assert_nothing_held()


def test_a_decode_that_sends_heartbeats_is_kept():
    rig = PipelineRig(peer_timeout_s=10.0)
    rig.hello(0.0)
    rig.register(0.0, ttl_s=30.0)
    for t in (6.0, 12.0, 18.0):
        rig.heartbeat(t)
        rig.tick(t + 1.0)
    assert rig.counters.get("peer_lost") == 0 and rig.failures() == []

    rig.ready(20.0)
    rig.tick(20.0)
    assert rig.finished == ["req-1"] and len(rig.writes()) == 1
    rig.assert_nothing_held()


def test_a_silent_decode_never_stops_a_write_in_flight():
    rig, write = running()
    rig.tick(25.0)  # two peer timeouts without a word from decode
    assert rig.phase() is Phase.IN_FLIGHT
    assert rig.counters.get("peer_lost") == 0 and rig.failures() == []

    end_write(write)
    rig.tick(26.0)
    assert rig.finished == ["req-1"] and rig.notifications() == [DONE]
    rig.assert_nothing_held()


def test_a_hello_from_a_new_boot_drops_the_old_boots_transfers_untold():
    rig = PipelineRig()
    rig.hello(0.0, boot="old")
    rig.register(0.0, boot="old")
    assert rig.hello(1.0, boot="new").accepted

    assert rig.counters.get("peer_lost") == 1
    assert len(rig.pipeline._matcher) == 0
    assert rig.failures() == [], "nobody is left to tell"
    rig.ready(2.0)
    rig.tick(2.0)
    assert rig.finished == ["req-1"] and rig.writes() == []
    rig.assert_nothing_held()


def test_a_new_boot_lets_the_old_boots_write_in_flight_end():
    rig, write = running()
    rig.hello(1.0, boot="new")
    assert rig.phase() is Phase.ENDING
    assert rig.finished == []

    end_write(write)
    rig.tick(2.0)
    assert rig.finished == ["req-1"]
    assert rig.failures() == []
    rig.assert_nothing_held()


def test_a_registration_of_a_boot_not_yet_said_hello_waits_for_that_boot():
    rig = PipelineRig()
    rig.hello(0.0, boot="old")
    rig.register(0.0, boot="new")
    rig.ready(0.0)
    rig.tick(0.1)
    assert rig.writes() == [], "never into the old boot's memory"

    rig.hello(0.2, boot="new")
    rig.tick(0.2)
    assert rig.finished == ["req-1"] and len(rig.writes()) == 1
    rig.assert_nothing_held()


# -- more endings ------------------------------------------------------------------


def test_err_keeps_the_blocks_until_nixl_released_the_handle():
    rig = PipelineRig()
    rig.io.release_failures = 2  # the first two releases fail, RETRY_S apart
    rig.io.script_polls("PROC", "ERR")
    pushed(rig)
    rig.tick(0.1)  # ERR; the release refused: still in flight
    assert rig.phase() is Phase.IN_FLIGHT
    rig.tick(0.1 + RETRY_S)  # refused again
    assert rig.finished == [] and rig.failures() == [], "ERR is not proof"

    rig.tick(0.1 + 2 * RETRY_S)

    assert rig.finished == ["req-1"]
    assert rig.failures() == [("t1", Cause.WRITE_FAILED)]
    rig.assert_nothing_held()


def test_a_registration_after_its_kv_expired_is_answered_with_a_failure():
    rig = PipelineRig(ready_ttl_s=1.0)
    rig.ready(0.0)
    rig.tick(1.0)
    assert rig.finished == ["req-1"]

    rig.register(2.0)  # rejected: closed

    assert rig.failures(REG_ROUTE) == [("t1", Cause.REJECTED)]
    rig.assert_nothing_held()


def test_a_hello_with_unloadable_metadata_is_refused():
    rig = PipelineRig()
    io = rig.decodes[0].io
    hello = Hello(DECODE, "boot-1", io.name, b"junk", io.layout)
    rig.pipeline.on_message(WORKER, hello, 0.0)
    (reply,) = rig.sent_to(WORKER)
    assert isinstance(reply, HelloReply)
    assert not reply.accepted and "metadata" in reply.reason


def test_a_dropped_decode_is_asked_for_a_hello_and_served_again():
    rig = PipelineRig(peer_timeout_s=10.0)
    rig.hello(0.0)
    rig.register(0.0, tid="t0", ttl_s=30.0)
    rig.tick(10.1)
    assert rig.failures() == [("t0", Cause.PEER_LOST)]

    rig.register(11.0)  # the decode was only stalled; it carries on
    assert isinstance(rig.sent_to(REG_ROUTE)[-1], HelloRequest)
    rig.hello(11.1)
    rig.ready(11.2)
    rig.tick(11.2)
    assert rig.finished == ["req-1"] and rig.notifications() == [DONE]
    rig.assert_nothing_held()


def test_a_stalled_writer_pardons_its_peers():
    """A process stopped for longer than the peer timeout must not drop its
    decodes on waking, before it reads the heartbeats queued meanwhile."""
    rig = PipelineRig(peer_timeout_s=10.0)
    rig.hello(0.0)
    rig.register(0.0, ttl_s=120.0)
    rig.pipeline.pardon(60.0, 60.0)
    rig.tick(60.0)
    assert rig.counters.get("peer_lost") == 0 and rig.failures() == []
    rig.tick(70.1)
    assert rig.counters.get("peer_lost") == 1


# -- the first token: told on the Registration's socket --------------------------


def _first_tokens(rig: PipelineRig) -> list[tuple[bytes, Message]]:
    return [(r, m) for r, m in rig.replies.sent if isinstance(m, FirstToken)]


@pytest.mark.parametrize("after_done", [False, True])
def test_the_first_token_goes_to_the_registrations_socket(after_done):
    """Prefill samples it after handing the KV over: the WRITE may be
    in flight, or already done (and the transfer's routes gone)."""
    rig = PipelineRig()
    rig.io.script_polls("PROC", "DONE")
    rig.hello(0.0)
    rig.register(0.1)
    rig.ready(0.2)
    rig.tick(0.2)
    if after_done:
        rig.tick(0.3)
        assert rig.phase() is None

    logprobs = SampleLogprobs((77,), (-0.5,), rank=1) if after_done else None
    rig.pipeline.on_first_token("t1", 77, logprobs)

    want = FirstToken("t1", PREFILL, 77, logprobs)
    assert _first_tokens(rig) == [(REG_ROUTE, want)]


def test_no_first_token_after_a_failure_or_without_a_registration():
    rig = PipelineRig()
    rig.hello(0.0)
    rig.register(0.1)
    rig.pipeline.on_prefill_cancel("t1", 0.2)  # its Failure is the final word

    rig.pipeline.on_first_token("t1", 77, None)
    rig.pipeline.on_first_token("t9", 78, None)  # no decode registered for it

    assert _first_tokens(rig) == []
    assert rig.counters.get("first_token.unroutable") == 2
