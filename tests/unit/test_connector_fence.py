"""The writer learns that the forward which wrote a prompt's KV has finished
through a fence: an accelerator event it asks on each tick, never waits on
(issue 9 item 6: one transfer's slow forward must not stall the others), or
nothing at all on the synchronous CPU backend."""

from __future__ import annotations

import pytest
import torch

from kvpush.connector.prefill.fence import EventFence, NoFence, record_fence

CREATED: list[FakeEvent] = []


class FakeEvent:
    """``torch.cuda.Event``'s interface (``record``, ``query``,
    ``synchronize``); blocking calls fail the test."""

    def __init__(self) -> None:
        self.recorded = False
        self.num_pending = 2  # query() answers False this many times
        self.num_queries = 0
        CREATED.append(self)

    def record(self, stream: object = None) -> None:
        self.recorded = True

    def query(self) -> bool:
        self.num_queries += 1
        return self.num_queries > self.num_pending

    def synchronize(self) -> None:
        raise AssertionError("the writer must never block on an event")


@pytest.fixture
def cuda_events(monkeypatch: pytest.MonkeyPatch) -> list[FakeEvent]:
    CREATED.clear()
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return CREATED


def test_an_accelerator_fence_records_an_event_after_the_forward(cuda_events):
    fence = record_fence("cuda")

    (event,) = cuda_events
    assert event.recorded
    assert isinstance(fence, EventFence)


def test_an_event_fence_is_asked_without_blocking_until_it_completes(cuda_events):
    fence = record_fence("cuda")
    (event,) = cuda_events

    assert [fence.is_ready() for _ in range(3)] == [False, False, True]
    assert fence.is_ready(), "stays ready"
    assert event.num_queries == 3, "not asked again once complete"


def test_no_fence_is_always_ready():
    assert NoFence().is_ready() is True


def test_the_cpu_forward_needs_no_fence():
    assert isinstance(record_fence("cpu"), NoFence)
