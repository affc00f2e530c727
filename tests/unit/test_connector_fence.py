"""The writer waits for the forward that wrote a prompt's KV through a fence:
an accelerator event polled until it completes, with a deadline, or nothing
at all on the synchronous CPU backend."""

from __future__ import annotations

import time

from kvpush.connector.fence import EventFence, NoFence, record_fence


class ScriptedEvent:
    """``query()`` answers False ``num_pending`` times, then True."""

    def __init__(self, num_pending: int | None) -> None:
        self.num_pending = num_pending  # None: never completes
        self.num_queries = 0

    def query(self) -> bool:
        self.num_queries += 1
        return self.num_pending is not None and self.num_queries > self.num_pending


def test_event_fence_returns_true_once_the_event_completes():
    event = ScriptedEvent(num_pending=2)

    assert EventFence(event).wait(timeout_s=5.0) is True
    assert event.num_queries == 3, "stops querying once complete"


def test_event_fence_gives_up_after_its_timeout():
    event = ScriptedEvent(num_pending=None)

    start = time.monotonic()
    assert EventFence(event).wait(timeout_s=0.05) is False
    elapsed = time.monotonic() - start

    assert 0.05 <= elapsed < 1.0
    assert 1 < event.num_queries < 5000, "polls with sleeps, never spins"


def test_a_completed_event_is_ready_even_with_no_time_left():
    assert EventFence(ScriptedEvent(num_pending=0)).wait(timeout_s=0.0) is True


def test_no_fence_is_always_ready():
    assert NoFence().wait(timeout_s=0.0) is True


def test_the_cpu_forward_needs_no_fence():
    assert isinstance(record_fence("cpu"), NoFence)
