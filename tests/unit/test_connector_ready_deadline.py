"""A streamed prompt's finished KV waits ``ready_ttl_s`` for its claim (or
registration) from its *last* chunk, not its first: a chunked prefill that
takes longer than ``ready_ttl_s`` is not thrown away before anyone could
claim it (decode would then recompute the whole prompt).

Drives the pure :class:`~kvpush.connector.prefill.pipeline.Pipeline` at
explicit ``now`` values (no writer thread, no sleeps) over
:class:`FakeNixlIO`; prompt 60 tokens in 16-token blocks (4 blocks),
prefill's blocks 4, 5, 6, 9, decode's 10..13, as in
``test_connector_writer.py``.
"""

from __future__ import annotations

import pytest

from kvpush.connector.counters import Counters
from kvpush.connector.faults import FaultSource
from kvpush.connector.prefill.fence import NoFence
from kvpush.connector.prefill.pipeline import Pipeline, Ready, WriterConfig
from kvpush.connector.trace import Tracer
from kvpush.transfer.matcher import MatcherConfig, ReadyKv
from kvpush.transfer.messages import (
    Cause,
    Done,
    Failure,
    Hello,
    HelloReply,
    Registration,
    claim_digest,
)
from tests.fakes.fake_nixl import FakeNixlIO
from tests.unit.test_connector_writer import (
    BOOT,
    BS,
    DECODE,
    DECODE_ROUTE,
    DST_BASE,
    PREFILL,
    SRC_BASE,
    Replies,
    layout,
)
from tests.unit.test_connector_writer_late import D1, D1_ROUTE, TOKEN
from tests.unit.test_connector_writer_stream import blocks_of

TTL_S = 10.0  # ready_ttl_s
# (time, first block, prefill's blocks, final): each gap below TTL_S, the
# whole chunked prefill (16 s) longer than it
CHUNKS = ((0.0, 0, (4, 5), False), (8.0, 2, (6,), False), (16.0, 3, (9,), True))
LAST_S = CHUNKS[-1][0]


class PureRig:
    """A writer's pipeline, with no thread: the test is its clock."""

    def __init__(self, late: bool) -> None:
        self.late = late
        self.engine, self.route = (D1, D1_ROUTE) if late else (DECODE, DECODE_ROUTE)
        self.io = FakeNixlIO("kvpush-p0", layout(SRC_BASE))
        self.decode_io = FakeNixlIO(f"kvpush-{self.engine}", layout(DST_BASE))
        self.io.link(self.decode_io)
        self.replies = Replies()
        self.finished: list[str] = []
        self.counters = Counters()
        self.tracer = Tracer("", PREFILL)
        config = WriterConfig(PREFILL, MatcherConfig(block_size=BS, ready_ttl_s=TTL_S))
        self.pipeline = Pipeline(
            self.io,
            config,
            self.replies,
            self.finished.append,
            self.tracer,
            self.counters,
            FaultSource(""),
        )

    def tick(self, now: float) -> None:
        """One turn of the writer's loop after its inbox was read."""
        for step in self.pipeline.steps:
            step(now)

    def hello(self, now: float) -> None:
        io = self.decode_io
        hello = Hello(self.engine, BOOT, io.name, io.metadata, io.layout)
        self.pipeline.on_message(self.route, hello, now)
        assert [m for _, m in self.replies.of(HelloReply) if m.accepted]

    def chunk(self, now: float, first: int, src: tuple[int, ...], final: bool) -> None:
        """One prefill chunk's forward completed (late: no decode named)."""
        decode, digest = (None, claim_digest(TOKEN)) if self.late else (DECODE, None)
        kv = ReadyKv("t1", src, 60, decode, first, final, claim_sha256=digest)
        self.pipeline.on_ready(Ready(kv, "req-1", NoFence()), now)

    def register(self, now: float) -> None:
        """Decode's registration (late: any decode's claim, with the token)."""
        reg = Registration(
            transfer_id="t1",
            decode_engine_id=self.engine,
            decode_boot_id=BOOT,
            dst_block_ids=(10, 11, 12, 13),
            num_tokens=60,
            ttl_s=10.0,
            claim_token=TOKEN if self.late else None,
        )
        self.pipeline.on_message(self.route, reg, now)

    def stream_chunks(self) -> None:
        """Every chunk at its time, with ticks between (one past the first
        chunk's ready_ttl_s) and at each arrival."""
        for at, first, src, final in CHUNKS:
            self.tick(at - 0.5)
            self.chunk(at, first, src, final)
            self.tick(at)
        self.tick(CHUNKS[0][0] + TTL_S + 1.0)

    def assert_pending(self, when: str) -> None:
        matcher = self.pipeline._matcher
        assert self.counters.get("expired.ready") == 0, f"expired {when}"
        assert self.finished == [], f"prefill's blocks freed {when}"
        assert matcher.is_pending("t1"), f"not pending {when}"
        assert self.io.writes_snapshot() == []
        assert self.replies.of(Failure) == []


@pytest.mark.parametrize("late", [True, False], ids=["late_bound", "early_bound"])
def test_a_stream_longer_than_ready_ttl_waits_from_its_last_chunk(late: bool):
    """Before the fix the deadline was the first chunk's arrival plus
    ``ready_ttl_s`` (10 s): the KV expired at 10 s, before its last chunk
    (16 s), and the claim at 25 s found the transfer closed."""
    rig = PureRig(late)
    rig.hello(0.0)
    rig.stream_chunks()
    rig.assert_pending(f"after the last chunk, {TTL_S + 1} s after the first")
    assert rig.pipeline._matcher.next_deadline() == LAST_S + TTL_S

    claim_at = LAST_S + TTL_S - 1.0
    rig.tick(claim_at - 0.1)
    rig.assert_pending("just before the claim")
    rig.register(claim_at)
    rig.tick(claim_at)
    rig.tick(claim_at + 0.1)

    (write,) = rig.io.writes_snapshot()
    assert blocks_of(write) == ([4, 5, 6, 9], [10, 11, 12, 13])
    assert write.peer == rig.decode_io.name
    assert write.message == Done("t1", PREFILL, num_blocks=4)
    assert rig.decode_io.notifications() == [write.notif]
    assert rig.finished == ["req-1"]
    assert rig.replies.of(Failure) == []
    assert rig.counters.get("expired.ready") == 0
    rig.tick(LAST_S + TTL_S + 1.0)
    assert len(rig.pipeline._matcher) == 0 and len(rig.pipeline._streams) == 0


@pytest.mark.parametrize("late", [True, False], ids=["late_bound", "early_bound"])
def test_an_unclaimed_stream_expires_ready_ttl_after_its_last_chunk(late: bool):
    rig = PureRig(late)
    rig.hello(0.0)
    rig.stream_chunks()
    rig.tick(LAST_S + TTL_S - 0.01)
    rig.assert_pending("before ready_ttl_s after the last chunk")

    rig.tick(LAST_S + TTL_S)

    assert rig.counters.get("expired.ready") == 1
    assert rig.finished == ["req-1"], "prefill's blocks are freed"
    assert not rig.pipeline._matcher.is_pending("t1")
    assert len(rig.pipeline._streams) == 0
    assert rig.io.writes_snapshot() == []
    failures = [m for _, m in rig.replies.of(Failure)]
    if late:
        assert failures == [], "nobody to tell"
    else:
        assert [(f.transfer_id, f.cause) for f in failures] == [("t1", Cause.EXPIRED)]
    rig.register(LAST_S + TTL_S + 1.0)  # too late: the transfer is closed
    rig.tick(LAST_S + TTL_S + 1.0)
    assert rig.io.writes_snapshot() == []
