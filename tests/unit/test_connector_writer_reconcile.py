"""The writer answers a decode that reconnected (issue 11 item 6).

A ROUTER drops what it sends to a disconnected peer, and the routes it
knew die with the connection; so after a reconnect decode names every
receive it still waits on (``Reconcile``), and the writer answers each id
it no longer holds with its final word, closing the id for good, while
the ids it still holds carry on and their final word goes to the new
socket: tested on the pure pipeline (``test_prefill_pipeline_stream.py``);
here, through the writer thread, a completed WRITE's Done said again.
Ends with nothing held (``Rig.close``).
"""

from __future__ import annotations

from kvpush.transfer.messages import Done, Failure
from tests.fakes.fake_nixl import wait_for
from tests.unit.test_connector_writer import PREFILL, Rig

NEW_ROUTE = b"route-d0-worker-after"


def words(rig: Rig, route: bytes = NEW_ROUTE) -> list[Failure | Done]:
    return rig.replies_to(route, Failure) + rig.replies_to(route, Done)  # type: ignore[return-value]


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
