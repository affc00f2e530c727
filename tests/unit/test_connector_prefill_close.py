"""Prefill's shutdown order: the writer stops and its WRITEs end before the
side channel closes.

A loopback decode takes prefill's closed side-channel connection as proof
that nothing more of that prefill lands in its blocks, and frees them. So
``PrefillWorker.close`` stops the writer first (nothing more is posted),
waits for the WRITEs in flight to end (never cancelling one), and only then
closes the listener. Uses the writer rig of ``test_connector_writer.py``
(a real writer thread over fake NIXL agents).
"""

from __future__ import annotations

from kvpush.connector.prefill.worker import PrefillWorker
from tests.fakes.fake_nixl import FakeNixlIO, wait_for
from tests.unit.test_connector_worker import make_config
from tests.unit.test_connector_writer import Rig


class ListenerSpy:
    """Stands in for the side-channel listener: what was still running on
    prefill's agent when it was closed."""

    def __init__(self, io: FakeNixlIO) -> None:
        self._io = io
        self.running_at_close: list[int] | None = None

    def close(self) -> None:
        self.running_at_close = [
            i
            for i, w in enumerate(self._io.writes_snapshot())
            if w.last not in ("DONE", "ERR") and not w.released
        ]

    def reply(self, route: bytes, message: object) -> None:  # pragma: no cover
        pass


def worker_over(rig: Rig) -> tuple[PrefillWorker, ListenerSpy]:
    worker = PrefillWorker(make_config("prefill"))
    listener = ListenerSpy(rig.io)
    worker._writer, worker._listener = rig.writer, listener  # type: ignore[assignment]
    worker._io = rig.io  # type: ignore[assignment]
    return worker, listener


def test_the_side_channel_closes_only_after_the_last_write_ended():
    rig = Rig()
    rig.io.script_polls(*["PROC"] * 400, "DONE")  # a WRITE that takes a while
    rig.hello()
    rig.register()
    rig.ready()
    assert wait_for(lambda: len(rig.io.writes_snapshot()) == 1), "WRITE posted"
    worker, listener = worker_over(rig)
    assert rig.io.writes_snapshot()[0].last in ("", "PROC"), "still running"

    worker.close()

    (write,) = rig.io.writes_snapshot()
    assert listener.running_at_close == [], "a WRITE still ran at the close"
    assert write.done and not write.cancelled, "it ended by itself"
    assert rig.io.closed, "memory deregistered once every WRITE let go"
    assert rig.io.misuse == []
