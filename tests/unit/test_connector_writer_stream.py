"""Streaming push (``--push-granularity chunk``) through the real writer
thread: chunks handed over by the worker's thread, each tracked in flight
on its own. The rules themselves (chunks in prompt order, the Done piece,
catching up, cancels, preemption, failures mid-stream) are tested on the
pure pipeline in ``test_prefill_pipeline_stream.py``; ``chunk`` and
``blocks_of`` here serve other thread-rig tests.

Real writer thread over :class:`FakeNixlIO` (the ``Rig`` of
``test_connector_writer.py``); prompt: 60 tokens, 16-token blocks, so 4
blocks; prefill's blocks 4, 5, 6, 9; decode's 10, 11, 12, 13.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpush.connector.prefill.fence import NoFence
from kvpush.transfer.groups import one
from kvpush.transfer.matcher import ReadyKv
from kvpush.transfer.messages import Done
from tests.fakes.fake_nixl import WriteRecord, wait_for
from tests.unit.prefill_pipeline_rig import FOREVER
from tests.unit.prefill_pipeline_rig import blocks_of as layer_blocks
from tests.unit.test_connector_writer import (
    DECODE,
    PREFILL,
    Rig,
)
from tests.unit.test_connector_writer_safety import end_write


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def chunk(
    rig: Rig,
    first: int,
    src: tuple[int, ...],
    final: bool = False,
    fence: object = None,
    tid: str = "t1",
) -> None:
    """The forward of one prefill chunk completed prompt blocks
    ``first..first+len(src)-1`` (in prefill's blocks ``src``)."""
    kv = ReadyKv(tid, one(src), 60, DECODE, first_block=first, final=final)
    rig.writer.kv_ready(kv, "req-1", fence or NoFence())  # type: ignore[arg-type]


def blocks_of(write: WriteRecord) -> tuple[list[int], list[int]]:
    """(prefill blocks, decode blocks) a WRITE copies in layer 0 (the
    other layers repeat its runs)."""
    return layer_blocks(write).get(0, ([], []))


def test_items_in_flight_are_tracked_apart_and_done_waits_for_all(rig: Rig):
    """Before the fix ``Writes`` was keyed by transfer id: a second item of
    one transfer raised "already has a WRITE" (and a later one would have
    overwritten the first, freeing blocks under a running WRITE)."""
    rig.io.script_polls(*FOREVER)  # each ends when the test says so
    rig.hello()
    rig.register()
    chunk(rig, 0, (4, 5))
    assert wait_for(lambda: len(rig.io.writes_snapshot()) == 1)
    chunk(rig, 2, (6, 9), final=True)

    # the blocks before the last go at once; the Done item waits
    assert wait_for(lambda: len(rig.io.writes_snapshot()) == 2)
    first, second = rig.io.writes_snapshot()
    assert blocks_of(second) == ([6], [12]) and second.notif == b""
    end_write(rig, first)
    end_write(rig, second)
    assert wait_for(lambda: len(rig.io.writes_snapshot()) == 3)
    end_write(rig, rig.io.writes_snapshot()[-1])

    assert rig.wait_finished("req-1")
    *earlier, last = rig.io.writes_snapshot()
    assert blocks_of(last) == ([9], [13])
    assert all(w.done and w.released for w in earlier)
    assert last.message == Done("t1", PREFILL, num_blocks=4)
    assert rig.decode_io.notifications() == [last.notif], "one Done, the last"
