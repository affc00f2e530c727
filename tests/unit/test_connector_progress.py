"""Decode's NIXL progress does not ride on the engine step (issue 11 item 6):
a thread reads NIXL's notifications every millisecond, which is what drives
UCX on the receiving side, and hands them to the worker's main thread
through a queue. Before it, notifications were read only in
``get_finished``, once per engine step."""

from __future__ import annotations

import threading
import time

from kvpush.connector.counters import Counters
from kvpush.connector.decode.progress import POLL_S, Progress
from kvpush.connector.decode.worker import DecodeWorker
from kvpush.connector.metadata import DecodeMetadata, RecvExpect
from kvpush.transfer.messages import Done, encode
from tests.fakes.fake_nixl import FakeNixlIO, FakePeers, wait_for
from tests.unit.test_connector_worker import (
    LAYOUT,
    RecordingHeartbeats,
    make_config,
)

DONE = encode(Done(transfer_id="t1", engine_id="p0", num_blocks=3))


class CountingIO(FakeNixlIO):
    """A fake agent that records which threads read its notifications."""

    def __init__(self) -> None:
        super().__init__("kvpush-d0", LAYOUT)
        self.readers: set[str] = set()
        self.raises = 0  # the next this many reads raise

    def notifications(self) -> list[bytes]:
        self.readers.add(threading.current_thread().name)
        if self.raises > 0:
            self.raises -= 1
            raise RuntimeError("fake NIXL: getNotifs raised")
        return super().notifications()


def test_notifications_are_read_while_the_main_thread_does_nothing():
    io = CountingIO()
    progress = Progress(io, Counters())
    try:
        io.deliver(DONE)

        assert wait_for(lambda: progress.num_notifications == 1), "read by itself"
        assert io.notifications() == [], "taken out of NIXL already"
        assert progress.take() == [DONE]
        assert progress.take() == [], "handed over once"
        assert io.readers == {"kvpush-nixl-progress", "MainThread"}
    finally:
        assert progress.close()


def test_it_polls_about_every_millisecond_and_stops_on_close():
    io = CountingIO()
    progress = Progress(io, Counters())
    time.sleep(0.2)

    assert progress.close(timeout_s=1.0)

    polls = progress.num_polls
    assert polls >= 0.2 / POLL_S / 10, f"only {polls} polls in 0.2 s"
    assert polls <= 0.2 / POLL_S * 1.5, f"{polls} polls in 0.2 s: a busy loop"
    time.sleep(0.05)
    assert progress.num_polls == polls, "no poll after close"
    assert not any(t.name == "kvpush-nixl-progress" for t in threading.enumerate())


def test_a_read_that_raises_does_not_stop_the_thread():
    io = CountingIO()
    io.raises = 3
    counters = Counters()
    progress = Progress(io, counters)
    try:
        io.deliver(DONE)
        assert wait_for(lambda: progress.take() == [DONE])
        assert counters.get("notif.poll_failed") == 3
    finally:
        assert progress.close()


def test_the_worker_receives_a_done_the_thread_read_between_two_steps():
    """The Done is read out of NIXL with no engine step at all (that read is
    what moves UCX along); the next ``get_finished`` reports it."""
    io = CountingIO()
    worker = DecodeWorker(make_config("decode"))
    worker._peers.close()
    worker._heartbeats.close()
    worker._peers = FakePeers()  # type: ignore[assignment]
    worker._heartbeats = RecordingHeartbeats()  # type: ignore[assignment]
    worker._io = io  # type: ignore[assignment]
    worker._progress = Progress(io, worker.counters)
    try:
        expect = RecvExpect("r1", "t1", (3, 4, 5), "p0", "10.250.0.2", 5600)
        worker.bind(DecodeMetadata(expects=[expect]))
        assert worker.get_finished() == set()

        io.deliver(DONE)  # the engine is busy in a long forward meanwhile
        assert wait_for(lambda: worker._progress.num_notifications == 1)

        assert worker.get_finished() == {"r1"}
        assert "MainThread" not in io.readers, "only the thread calls NIXL's API"
    finally:
        worker.close()
    assert not worker._progress._thread.is_alive()
    assert io.closed, "the agent is closed once the thread stopped"
    assert io.misuse == []
