"""Decode's NIXL progress does not ride on the engine step: a thread reads
NIXL's notifications every millisecond while a receive is awaited, which is
what drives UCX on the receiving side, and hands them to the worker's main
thread through a queue. With no receive awaited it reads nothing (no GIL
taken from the model runner for nothing)."""

from __future__ import annotations

import threading
import time

from kvpush.connector.counters import Counters
from kvpush.connector.decode.progress import POLL_S, Progress
from kvpush.connector.decode.worker import DecodeWorker
from kvpush.connector.metadata import DecodeMetadata, RecvExpect
from kvpush.transfer.groups import one
from kvpush.transfer.messages import Done, encode
from tests.fakes.fake_nixl import FakeNixlIO, FakePeers, wait_for
from tests.unit.test_connector_worker import (
    LAYOUT,
    InlineProgress,
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


def worker_on(io: CountingIO) -> DecodeWorker:
    """A decode worker on the fake agent ``io``, with fake sockets and
    heartbeats; the caller gives it its progress."""
    worker = DecodeWorker(make_config("decode"))
    worker._peers.close()
    worker._heartbeats.close()
    worker._peers = FakePeers()  # type: ignore[assignment]
    worker._heartbeats = RecordingHeartbeats()  # type: ignore[assignment]
    worker._io = io  # type: ignore[assignment]
    return worker


def test_notifications_are_read_while_the_main_thread_does_nothing():
    io = CountingIO()
    progress = Progress(io, Counters())
    progress.want(True)
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
    progress.want(True)
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
    progress.want(True)
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
    worker = worker_on(io)
    worker._progress = Progress(io, worker.counters)
    worker._progress.want(True)  # as bind() says once it expects
    try:
        expect = RecvExpect("r1", "t1", one((3, 4, 5)), "p0", "10.250.0.2", 5600)
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


def test_with_no_receive_awaited_the_thread_reads_nothing():
    """Idle, the thread sleeps on an event: it wakes (counted) but never
    calls NIXL, so a notification waits there until a receive is awaited."""
    io = CountingIO()
    progress = Progress(io, Counters(), idle_wake_s=0.005)
    try:
        io.deliver(DONE)
        assert wait_for(lambda: progress.num_idle_wakes >= 5), "it ran idle"
        assert progress.num_polls == 0 and io.readers == set()

        progress.want(True)
        assert wait_for(lambda: progress.take() == [DONE]), "read once awaited"
        assert progress.polling

        progress.want(False)
        wakes = progress.num_idle_wakes
        assert wait_for(lambda: progress.num_idle_wakes >= wakes + 3)
        polls = progress.num_polls
        assert wait_for(lambda: progress.num_idle_wakes >= wakes + 6)
        assert progress.num_polls == polls, "no read once nothing is awaited"
    finally:
        assert progress.close()
    assert not progress._thread.is_alive()


def test_close_wakes_an_idle_thread_at_once():
    progress = Progress(CountingIO(), Counters(), idle_wake_s=60.0)
    assert progress.close(timeout_s=1.0), "not left asleep for its idle wake"


def test_the_worker_polls_exactly_while_a_receive_is_pending():
    """bind() with an expect turns polling on; the get_finished that ends
    the last receive turns it off; an empty step leaves it off."""
    io = CountingIO()
    worker = worker_on(io)
    progress = InlineProgress(io)
    worker._progress = progress  # type: ignore[assignment]
    try:
        worker.bind(DecodeMetadata())
        assert worker.get_finished() == set()
        assert progress.wanted == [False, False], "idle: no polling"

        expect = RecvExpect("r1", "t1", one((3, 4, 5)), "p0", "10.250.0.2", 5600)
        worker.bind(DecodeMetadata(expects=[expect]))
        assert progress.wanted[-1] is True
        assert worker.get_finished() == set()
        assert progress.wanted[-1] is True, "still awaited"

        io.deliver(DONE)
        assert worker.get_finished() == {"r1"}
        assert progress.wanted[-1] is False, "nothing pending any more"
    finally:
        worker.close()
