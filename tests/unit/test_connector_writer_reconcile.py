"""The writer answers a decode that reconnected (issue 11 item 6).

A ROUTER drops what it sends to a disconnected peer, and the routes it
knew die with the connection; so after a reconnect decode names every
receive it still waits on (``Reconcile``), and the writer answers each id
it no longer holds with its final word, closing the id for good, while
the ids it still holds carry on and their final word goes to the new
socket. Also: a decode's silence never stops a WRITE already in flight
(only posting does prefill give up on a silent decode). Each test ends
with nothing held (``Rig.close``).
"""

from __future__ import annotations

import time

from kvpush.transfer.messages import Cause, Done, Failure
from tests.fakes.fake_nixl import wait_for
from tests.unit.test_connector_writer import DECODE_ROUTE, PREFILL, Rig

OLD_ROUTE = b"route-d0-scheduler-before"  # a socket gone with the partition
NEW_ROUTE = b"route-d0-worker-after"


def words(rig: Rig, route: bytes = NEW_ROUTE) -> list[Failure | Done]:
    return rig.replies_to(route, Failure) + rig.replies_to(route, Done)  # type: ignore[return-value]


def test_an_id_prefill_never_saw_is_failed_and_refused_ever_after():
    """Decode's Registration may still be on its way (another socket):
    once prefill answered "never", that Registration must not be served."""
    rig = Rig()
    try:
        rig.hello()
        rig.reconcile("t1", route=NEW_ROUTE)

        assert wait_for(lambda: words(rig))
        (answer,) = words(rig)
        assert (answer.transfer_id, answer.cause) == ("t1", Cause.PEER_LOST)
        rig.register()  # arrives after the answer
        rig.ready()
        assert rig.wait_finished("req-1"), "the KV is released, unwritten"
        rig.sync()
        assert rig.io.writes_snapshot() == [], "never written after the answer"
        assert rig.counters.get("reconciled.ended") == 1
        assert rig.writer._pipeline._matcher.is_pending("t1") is False
    finally:
        rig.close()


def test_a_failure_lost_while_decode_was_away_is_said_again():
    rig = Rig()
    try:
        rig.hello()
        rig.register(route=OLD_ROUTE)
        rig.writer.cancel("t1")  # prefill gives up: told on the dead socket
        assert wait_for(lambda: rig.replies_to(OLD_ROUTE, Failure))
        (lost,) = rig.replies_to(OLD_ROUTE, Failure)

        rig.reconcile("t1", route=NEW_ROUTE)

        assert wait_for(lambda: words(rig))
        assert words(rig) == [lost], "the same final word, on the live socket"
        assert rig.counters.get("failed.cancelled") == 1, "said again, not anew"
    finally:
        rig.close()


def test_a_completed_write_is_answered_with_its_done_to_its_decode_only():
    rig = Rig()
    try:
        rig.hello()
        rig.register()
        rig.ready()
        assert rig.wait_finished("req-1")

        rig.reconcile("t1", route=NEW_ROUTE)
        rig.reconcile("t1", route=b"other", engine="d9")

        assert wait_for(lambda: words(rig) and words(rig, b"other"))
        assert words(rig) == [Done("t1", PREFILL, num_blocks=4)], "the KV landed"
        (other,) = words(rig, b"other")
        assert isinstance(other, Failure), "a Done says nothing to another decode"
        rig.reconcile("t1", route=NEW_ROUTE)
        assert wait_for(lambda: len(words(rig)) == 2)
        assert words(rig)[1] == words(rig)[0], "still remembered"
    finally:
        rig.close()


def test_a_held_transfer_carries_on_and_its_word_goes_to_the_new_socket():
    rig = Rig()
    try:
        rig.hello()
        rig.register(route=OLD_ROUTE)  # waiting for its KV

        rig.reconcile("t1", route=NEW_ROUTE)
        rig.sync()
        assert words(rig) == [], "held: no answer yet"
        assert rig.counters.get("reconciled.live") == 1

        rig.writer.cancel("t1")
        assert wait_for(lambda: words(rig))
        assert words(rig)[0].cause is Cause.CANCELLED
        assert rig.replies_to(OLD_ROUTE, Failure) == []
    finally:
        rig.close()


def test_a_write_in_flight_across_the_reconnect_completes_with_its_done():
    rig = Rig()
    try:
        rig.io.script_polls(*["PROC"] * 200, "DONE")
        rig.hello()
        rig.register()
        rig.ready()
        assert wait_for(lambda: rig.io.writes_snapshot())

        rig.reconcile("t1", route=NEW_ROUTE)
        rig.sync()
        assert not rig.io.writes_snapshot()[0].done, "the test must ask mid-write"

        assert rig.wait_finished("req-1")
        (write,) = rig.io.writes_snapshot()
        assert write.done and not write.cancelled
        assert rig.decode_io.notifications() == [write.notif]
        assert words(rig) == [] and words(rig, DECODE_ROUTE) == []
    finally:
        rig.close()


def test_a_silent_decode_never_stops_a_write_in_flight():
    """Missed heartbeats prove nothing about a WRITE already posted: prefill
    drops only what it has not posted."""
    rig = Rig(peer_timeout_s=0.1)
    try:
        rig.io.script_polls(*["PROC"] * 1000, "DONE")
        rig.hello()
        rig.register()
        rig.ready()
        assert wait_for(lambda: rig.io.writes_snapshot())

        time.sleep(0.3)  # three peer timeouts without a word from decode

        (write,) = rig.io.writes_snapshot()
        assert not write.done, "the test must be silent mid-write"
        assert rig.wait_finished("req-1", timeout_s=5.0)
        assert write.done and not write.cancelled
        assert rig.replies_to(DECODE_ROUTE, Failure) == []
        assert rig.counters.get("peer_lost") == 0
    finally:
        rig.close()


def test_a_write_cancelled_before_the_partition_answers_on_the_new_socket():
    rig = Rig()
    try:
        rig.io.cancellable = False  # the cancel cannot stop it: it ends by itself
        rig.io.script_polls(*["PROC"] * 400, "ERR")
        rig.hello()
        rig.register()
        rig.ready()
        assert wait_for(lambda: rig.io.writes_snapshot())
        rig.cancel(route=OLD_ROUTE)  # answered once the WRITE is over

        rig.reconcile("t1", route=NEW_ROUTE)
        rig.sync()
        assert words(rig) == [], "the WRITE may still land: no answer yet"

        assert rig.wait_finished("req-1")
        assert wait_for(lambda: words(rig))
        assert words(rig)[0].cause is Cause.WRITE_FAILED
        assert rig.replies_to(OLD_ROUTE, Failure) == [], "not on the dead socket"
    finally:
        rig.close()
