"""The writer under faults: decode's Cancel at every phase is answered once
no WRITE can land; writes go only to the decode boot that registered the
blocks; a silent decode is dropped; fault-file delays hold a transfer in a
phase. Each test ends with nothing held (``Rig.close``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from kvpush.transfer.messages import Cause, Failure, HelloReply
from tests.fakes.fake_nixl import wait_for
from tests.unit.test_connector_writer import DECODE_ROUTE, PREFILL, Rig

OTHER_ROUTE = b"route-d0-scheduler"


def failures(rig: Rig, route: bytes = DECODE_ROUTE) -> list[Failure]:
    return rig.replies_to(route, Failure)  # type: ignore[return-value]


def test_cancel_of_a_pending_registration_is_answered_at_once():
    rig = Rig()
    try:
        rig.hello()
        rig.register()
        rig.cancel(route=OTHER_ROUTE)

        assert wait_for(lambda: failures(rig, OTHER_ROUTE))
        (answer,) = failures(rig, OTHER_ROUTE)
        assert (answer.transfer_id, answer.cause) == ("t1", Cause.CANCELLED)
        rig.ready()  # prefill's KV after the cancel: released, never written
        assert rig.wait_finished("req-1")
        rig.sync()
        assert rig.io.writes_snapshot() == []
        assert failures(rig) == [], "one answer per cancel, to its sender"
        assert rig.counters.get("cancelled.by_decode") == 1
    finally:
        rig.close()


def test_cancel_of_an_unknown_transfer_is_answered_so_decode_can_free():
    rig = Rig()
    try:
        rig.cancel(tid="never-registered")
        assert wait_for(lambda: failures(rig))
        assert failures(rig)[0].transfer_id == "never-registered"
    finally:
        rig.close()


def test_cancel_during_a_write_waits_for_its_done():
    rig = Rig()
    try:
        rig.io.script_polls(*["PROC"] * 100, "DONE")
        rig.hello()
        rig.register()
        rig.ready()
        assert wait_for(lambda: rig.io.writes_snapshot())
        rig.cancel()
        rig.sync()
        (write,) = rig.io.writes_snapshot()
        assert not write.released, "the test must cancel mid-write"
        assert failures(rig) == [], "no answer while the WRITE may still land"

        assert rig.wait_finished("req-1")
        assert write.released and not write.cancelled
        assert rig.decode_io.notifications() == [write.notif], "Done: final word"
        assert failures(rig) == []
    finally:
        rig.close()


def test_cancel_during_a_write_never_releases_it_while_it_runs():
    """Over TCP a cancelled WRITE still lands what UCX already sent (seen on
    the netns rehearsal: a WRITE cancelled at decode's deadline corrupted
    the request that reused its blocks). Before the fix the writer released
    the running handle and answered ``cancelled`` at once."""
    rig = Rig()
    try:
        rig.io.script_polls(*["PROC"] * 2000, "ERR")  # runs for a while
        rig.hello()
        rig.register()
        rig.ready()
        assert wait_for(lambda: rig.io.writes_snapshot())
        rig.cancel()
        time.sleep(0.2)
        (write,) = rig.io.writes_snapshot()
        assert not write.cancelled, "a running WRITE was released"
        assert failures(rig) == [], "answered while the WRITE may still land"

        assert wait_for(lambda: failures(rig), timeout_s=10.0)  # once it erred
        assert failures(rig)[0].cause is Cause.WRITE_FAILED
        assert write.released and not write.cancelled
        assert rig.wait_finished("req-1")
    finally:
        rig.close()


def test_cancel_while_waiting_for_decodes_hello_releases_and_answers():
    rig = Rig()
    try:
        rig.register()
        rig.ready()  # matched, but decode never said hello
        rig.sync()
        rig.cancel()

        assert rig.wait_finished("req-1")
        assert wait_for(lambda: failures(rig))
        rig.hello()
        rig.sync()
        assert rig.io.writes_snapshot() == []
    finally:
        rig.close()


def test_a_registration_of_another_boot_waits_for_that_boots_hello():
    rig = Rig()
    try:
        rig.hello(boot_id="old")
        rig.register(boot_id="new")  # decode restarted; its Hello is late
        rig.ready()
        rig.sync()
        assert rig.io.writes_snapshot() == [], "never into the old boot's memory"

        rig.hello(boot_id="new")

        assert rig.wait_finished("req-1")
        assert len(rig.io.writes_snapshot()) == 1
    finally:
        rig.close()


def test_a_hello_from_a_new_boot_drops_the_old_boots_registrations():
    rig = Rig()
    try:
        rig.hello(boot_id="old")
        rig.register(boot_id="old")
        rig.hello(boot_id="new")
        rig.sync()
        assert len(rig.writer._pipeline._matcher) == 0
        assert rig.counters.get("peer_lost") == 1

        rig.ready()  # the KV for the dead boot's transfer: released unwritten
        assert rig.wait_finished("req-1")
        rig.sync()
        assert rig.io.writes_snapshot() == []
        assert [r.accepted for r in rig.replies_to(DECODE_ROUTE, HelloReply)] == [
            True,
            True,
        ]
    finally:
        rig.close()


def test_a_silent_decode_is_dropped_after_the_peer_timeout():
    rig = Rig(peer_timeout_s=0.2)
    try:
        rig.hello()
        rig.register()
        rig.sync()
        assert wait_for(lambda: len(rig.writer._pipeline._matcher) == 0, 2.0)
        assert rig.counters.get("peer_lost") == 1
        assert wait_for(lambda: failures(rig)), "told, in case it was only stalled"
        assert failures(rig)[0].cause is Cause.PEER_LOST
        assert rig.writer._pipeline._peers.get("d0") is None, (
            "a later Hello must load it afresh"
        )
    finally:
        rig.close()


def test_a_decode_that_keeps_sending_heartbeats_is_kept():
    rig = Rig(peer_timeout_s=0.3)
    try:
        rig.hello()
        rig.register()
        for _ in range(6):
            time.sleep(0.1)
            rig.heartbeat()
        rig.sync()
        assert len(rig.writer._pipeline._matcher) == 1
        assert rig.counters.get("peer_lost") == 0
        rig.ready()
        assert rig.wait_finished("req-1")
        assert len(rig.io.writes_snapshot()) == 1
    finally:
        rig.close()


def test_fault_file_delays_the_post_and_a_cancel_in_that_window_stops_it(
    tmp_path: Path,
):
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"delay_post_s": 0.3}))
    rig = Rig(fault_file=str(faults))
    try:
        rig.hello()
        rig.register()
        rig.ready()
        rig.sync()
        assert rig.io.writes_snapshot() == [], "matched, held before the WRITE"
        rig.cancel()

        assert rig.wait_finished("req-1")
        assert wait_for(lambda: failures(rig))
        time.sleep(0.4)
        assert rig.io.writes_snapshot() == []
    finally:
        rig.close()


def test_fault_file_delay_past_the_deadline_expires_the_transfer(tmp_path: Path):
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"delay_post_s": 1.5}))
    rig = Rig(fault_file=str(faults))
    try:
        rig.hello()
        rig.register(ttl_s=2.0)  # post deadline: arrival + 1 s
        rig.ready()

        assert rig.wait_finished("req-1", timeout_s=3.0)
        assert wait_for(lambda: failures(rig))
        assert failures(rig)[0].cause is Cause.EXPIRED
        assert rig.io.writes_snapshot() == []
        assert rig.counters.get("expired.matched") == 1
    finally:
        rig.close()


def test_fault_file_delay_ready_holds_the_kv_before_the_match(tmp_path: Path):
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"delay_ready_s": 0.3}))
    rig = Rig(fault_file=str(faults))
    try:
        rig.hello()
        rig.register()
        rig.ready()
        rig.sync()
        assert rig.writer._pipeline._matcher.is_pending("t1"), (
            "registration still unmatched"
        )
        assert rig.wait_finished("req-1")
        assert len(rig.io.writes_snapshot()) == 1
        assert rig.replies_to(DECODE_ROUTE, Failure) == []
        assert PREFILL
    finally:
        rig.close()


def test_a_write_past_its_deadline_is_counted_and_awaited_not_cancelled():
    rig = Rig()
    rig.writer._pipeline._writes._timeout_s = 0.1
    try:
        rig.io.script_polls(*["PROC"] * 3000, "DONE")  # ends after a second or so
        rig.hello()
        rig.register()
        rig.ready()
        assert wait_for(lambda: rig.io.writes_snapshot())
        time.sleep(0.3)
        assert not rig.wait_finished("req-1", timeout_s=0.01), "still in flight"
        assert rig.counters.get("expired.write") == 1

        assert rig.wait_finished("req-1", timeout_s=10.0)  # freed when it ends
        (write,) = rig.io.writes_snapshot()
        assert write.done and not write.cancelled
        assert failures(rig) == []
    finally:
        rig.close()
