"""Per-layer push (``--push-granularity layer``, and ``auto`` for a large
chunk): within a chunk, each layer's blocks are posted as soon as that
layer's KV is written, in a WRITE that carries only that layer's
descriptors.

Over the real writer thread, with layers saved from the worker's thread
(the inbox's LAYER events), and the shared fake NIXL (the ``Rig`` of
``test_connector_writer.py``, here with 4 layers): the Done rides on the
very last WRITE, posted only once every earlier WRITE (every chunk, every
layer) completed; one layer's failed WRITE fails the transfer; a
registration that comes after some chunks and layers were written catches
up in one coalesced WRITE; blocks from prefill's own prefix cache need no
layer and go first. Layer by layer, a cancel between two layers, a late
claim and a layer never saved are tested on the pure pipeline
(``test_prefill_pipeline_stream.py``).

Prompt: 60 tokens in 16-token blocks (4 blocks); prefill's blocks 4, 5, 6,
9; decode's 10, 11, 12, 13.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpush.connector.prefill.fence import (
    ALL_LAYERS,
    NO_FENCE,
    LayerFences,
    ReadyFence,
)
from kvpush.transfer.groups import one
from kvpush.transfer.matcher import ReadyKv
from kvpush.transfer.messages import Cause, Done, Failure, claim_digest
from tests.fakes.fake_nixl import wait_for
from tests.unit.prefill_pipeline_rig import FOREVER, blocks_of
from tests.unit.test_connector_writer import (
    DECODE,
    DECODE_ROUTE,
    PREFILL,
    Rig,
)
from tests.unit.test_connector_writer_late import TOKEN
from tests.unit.test_connector_writer_safety import end_write

LAYERS = 4
ALL = [4, 5, 6, 9]  # every prompt block, on prefill


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig(num_layers=LAYERS)
    r.hello()
    yield r
    r.close()


def chunk(
    rig: Rig,
    first: int,
    src: tuple[int, ...],
    fence: ReadyFence,
    final: bool = False,
    claim: bool = False,
) -> None:
    """A chunk of prompt blocks ``first..`` (prefill's ``src``), written
    once ``fence`` says so (a :class:`LayerFences`: layer by layer)."""
    kv = ReadyKv(
        "t1", one(src), 60, None if claim else DECODE, first_block=first, final=final,
        claim_sha256=claim_digest(TOKEN) if claim else None,
    )  # fmt: skip
    rig.writer.kv_ready(kv, "req-1", fence)


def save(rig: Rig, fences: LayerFences, *layers: int) -> None:
    """The worker's ``save_kv_layer`` for these layers (CPU: no fence)."""
    for layer in layers:
        rig.writer.layer_saved(fences, layer, NO_FENCE)


def sent_per_layer(rig: Rig) -> dict[int, list[int]]:
    """Every prefill block each layer sent, over all WRITEs, in order."""
    out: dict[int, list[int]] = {}
    for write in rig.io.writes_snapshot():
        for layer, (src, _) in blocks_of(write).items():
            out.setdefault(layer, []).extend(src)
    return out


def posted_and_ended(rig: Rig, n: int) -> bool:
    writes = rig.io.writes_snapshot()
    return len(writes) == n and all(w.released for w in writes)


def failures(rig: Rig) -> list[Failure]:
    return rig.replies_to(DECODE_ROUTE, Failure)  # type: ignore[return-value]


def test_the_done_waits_for_every_earlier_write_of_every_layer(rig: Rig):
    rig.io.script_polls(*FOREVER)  # each ends when the test says so
    rig.register()
    fences = LayerFences(LAYERS)
    chunk(rig, 0, (4, 5, 6, 9), fences, final=True)  # the prompt in one chunk
    for n, layer in enumerate(range(LAYERS), start=1):
        save(rig, fences, layer)
        assert wait_for(lambda n=n: len(rig.io.writes_snapshot()) == n)
    for write in rig.io.writes_snapshot():
        end_write(rig, write)
    assert wait_for(lambda: len(rig.io.writes_snapshot()) == LAYERS + 1)
    end_write(rig, rig.io.writes_snapshot()[-1])

    assert rig.wait_finished("req-1")
    *earlier, held, done = rig.io.writes_snapshot()
    assert [blocks_of(w) for w in earlier] == [
        {layer: (ALL, [10, 11, 12, 13])} for layer in range(LAYERS - 1)
    ]
    # the last layer went at once, less its Done piece (one block)...
    assert blocks_of(held) == {LAYERS - 1: ([4, 5, 6], [10, 11, 12])}
    assert held.notif == b"" and held.running_at_post > 0
    # ...which went, with the Done, once nothing else ran
    assert blocks_of(done) == {LAYERS - 1: ([9], [13])}
    assert done.running_at_post == 0
    assert done.message == Done("t1", PREFILL, num_blocks=4)
    assert rig.decode_io.notifications() == [done.notif], "one Done, the last"


def test_a_failed_write_of_one_layer_fails_the_transfer(rig: Rig):
    rig.register()
    fences = LayerFences(LAYERS)
    chunk(rig, 0, (4, 5), fences)
    save(rig, fences, 0)
    assert wait_for(lambda: posted_and_ended(rig, 1))

    rig.io.script_polls("PROC", "PROC", "ERR")
    save(rig, fences, 1)
    assert wait_for(lambda: failures(rig))
    save(rig, fences, 2, 3, ALL_LAYERS)
    last = LayerFences(LAYERS)
    chunk(rig, 2, (6, 9), last, final=True)
    save(rig, last, 0, 1, 2, 3)

    assert rig.wait_finished("req-1")
    rig.sync()
    assert [blocks_of(w) for w in rig.io.writes_snapshot()] == [
        {0: ([4, 5], [10, 11])},
        {1: ([4, 5], [10, 11])},
    ], "nothing after the failed layer"
    assert [f.cause for f in failures(rig)] == [Cause.WRITE_FAILED]
    assert rig.decode_io.notifications() == []


def test_a_registration_mid_stream_catches_up_in_one_coalesced_write(rig: Rig):
    chunk(rig, 0, (4, 5), NO_FENCE)  # a chunk pushed whole
    fences = LayerFences(LAYERS)
    chunk(rig, 2, (6,), fences)
    save(rig, fences, 0, 1)  # half of the next chunk's layers are written
    rig.sync()
    assert rig.io.writes_snapshot() == [], "nowhere to write yet"

    rig.register()
    assert wait_for(lambda: rig.io.writes_snapshot())
    rig.sync()
    (write,) = rig.io.writes_snapshot()
    assert blocks_of(write) == {
        0: ([4, 5, 6], [10, 11, 12]),
        1: ([4, 5, 6], [10, 11, 12]),
        2: ([4, 5], [10, 11]),
        3: ([4, 5], [10, 11]),
    }
    assert len(write.src) == LAYERS, "one run per layer: coalesced"

    save(rig, fences, ALL_LAYERS)
    chunk(rig, 3, (9,), NO_FENCE, final=True)
    assert rig.wait_finished("req-1")
    assert sent_per_layer(rig) == {layer: ALL for layer in range(LAYERS)}
    assert rig.io.writes_snapshot()[-1].message == Done("t1", PREFILL, 4)


def test_prefills_own_cached_blocks_go_first_with_no_layer_to_wait_for(rig: Rig):
    rig.register()
    chunk(rig, 0, (4, 5), NO_FENCE)  # cached: handed over before any forward
    fences = LayerFences(LAYERS)
    chunk(rig, 2, (6, 9), fences, final=True)  # its forward still runs

    assert wait_for(lambda: posted_and_ended(rig, 1))
    rig.sync()
    (first,) = rig.io.writes_snapshot()
    assert blocks_of(first) == {layer: ([4, 5], [10, 11]) for layer in range(LAYERS)}, (
        "every layer of the cached blocks, in one WRITE, before any layer"
    )

    save(rig, fences, 0)
    assert wait_for(lambda: posted_and_ended(rig, 2))
    assert blocks_of(rig.io.writes_snapshot()[1]) == {0: ([6, 9], [12, 13])}
    save(rig, fences, ALL_LAYERS)  # the forward ended: the other layers
    assert rig.wait_finished("req-1")
    assert sent_per_layer(rig) == {layer: ALL for layer in range(LAYERS)}
    assert rig.io.writes_snapshot()[-1].message == Done("t1", PREFILL, 4)
