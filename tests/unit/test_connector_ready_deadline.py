"""A streamed prompt's finished KV waits ``ready_ttl_s`` for its claim (or
registration) from its *last* chunk, not its first: a chunked prefill that
takes longer than ``ready_ttl_s`` is not thrown away before anyone could
claim it (decode would then recompute the whole prompt).

Drives the pure :class:`~kvpush.connector.prefill.pipeline.Pipeline` at
explicit ``now`` values (no writer thread, no sleeps) with the shared rig
of :mod:`tests.unit.prefill_pipeline_rig`; prompt 60 tokens in 16-token
blocks (4 blocks), prefill's blocks 4, 5, 6, 9, decode's 10..13.
"""

from __future__ import annotations

import pytest

from kvpush.transfer.messages import Cause, Done
from tests.unit.prefill_pipeline_rig import TOKEN, PipelineRig, blocks_of
from tests.unit.test_connector_writer import PREFILL

TTL_S = 10.0  # ready_ttl_s
# (time, first block, prefill's blocks, final): each gap below TTL_S, the
# whole chunked prefill (16 s) longer than it
CHUNKS = ((0.0, 0, (4, 5), False), (8.0, 2, (6,), False), (16.0, 3, (9,), True))
LAST_S = CHUNKS[-1][0]


class PureRig(PipelineRig):
    """The shared pure rig; late: bound to no decode, claimed by ``d1``."""

    def __init__(self, late: bool) -> None:
        super().__init__(ready_ttl_s=TTL_S)
        self.late = late
        self.engine = "d1" if late else "d0"

    def hello(self, now: float) -> None:  # type: ignore[override]
        assert super().hello(now, engine=self.engine).accepted

    def chunk(self, now: float, first: int, src: tuple[int, ...], final: bool) -> None:
        """One prefill chunk's forward completed (late: no decode named)."""
        self.ready(now, src, first=first, final=final, late=self.late)

    def register(self, now: float) -> None:  # type: ignore[override]
        """Decode's registration (late: any decode's claim, with the token)."""
        token = TOKEN if self.late else None
        super().register(now, engine=self.engine, token=token)

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
        assert self.writes() == []
        assert self.failures() == []


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

    (write,) = rig.writes()
    assert blocks_of(write)[0] == ([4, 5, 6, 9], [10, 11, 12, 13])
    assert write.peer == rig.decode(rig.engine).io.name
    assert write.message == Done("t1", PREFILL, num_blocks=4)
    assert rig.notifications(engine=rig.engine) == [write.message]
    assert rig.finished == ["req-1"]
    assert rig.failures() == []
    assert rig.counters.get("expired.ready") == 0
    rig.tick(LAST_S + TTL_S + 1.0)
    assert len(rig.pipeline._matcher) == 0 and rig.pipeline.transfer("t1") is None


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
    assert rig.pipeline.transfer("t1") is None
    assert rig.writes() == []
    if late:
        assert rig.failures() == [], "nobody to tell"
    else:
        assert rig.failures() == [("t1", Cause.EXPIRED)]
    rig.register(LAST_S + TTL_S + 1.0)  # too late: the transfer is closed
    rig.tick(LAST_S + TTL_S + 1.0)
    assert rig.writes() == []
