"""After a reconnect with prefill TP < decode TP, prefill's Failure reaches
every decode rank that reconciled, not only the last one.

Prefill TP 1, decode TP 2: the one prefill rank writes both decode ranks,
and after a lost connection each decode rank sends its own ``Reconcile``
from its own socket. Prefill then ends a transfer it still held with a
Failure: each decode rank's receive waits on that word (a Failure on one
worker's socket does not reach the other), so before the fix the rank
whose Reconcile came first waited out its deadline (~65 s) before falling
back.

Drives the pure :class:`~kvpush.connector.prefill.pipeline.Pipeline` at
explicit ``now`` values (no writer thread, no sleeps) over
:class:`FakeNixlIO`; the prompt, blocks and ids are
``test_connector_writer.py``'s.
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
    Cancel,
    Cause,
    Failure,
    Hello,
    HelloReply,
    Reconcile,
    Registration,
)
from kvpush.transfer.ranks import TpPair
from tests.fakes.fake_nixl import FakeNixlIO
from tests.unit.test_connector_writer import (
    BOOT,
    BS,
    DECODE,
    DST_BASE,
    PREFILL,
    SRC_BASE,
    Replies,
    layout,
)

HEADS = 2  # the model's KV heads: one per decode rank
HEAD_BYTES = 64  # one head of one block of one layer
PAIR = TpPair(1, 2, HEADS)  # prefill TP 1, decode TP 2
SCHEDULER = b"route-d0-scheduler-before"  # the Registration's, gone since
HELLOS = (b"route-d0-rank0", b"route-d0-rank1")  # each decode rank's Hello
RANKS = (b"route-d0-rank0-after", b"route-d0-rank1-after")  # their Reconciles
TTL_S = 10.0  # the registration's ttl


class PendingFence:
    """A forward that has not completed: nothing of it may be posted."""

    def is_ready(self) -> bool:
        return False


class TpRig:
    """Prefill rank 0 of 1's pipeline, linked to decode ranks 0 and 1;
    the test is its clock."""

    def __init__(self) -> None:
        m = PAIR.mapping
        self.io = FakeNixlIO(
            "kvpush-p0-rank0",
            layout(SRC_BASE, m.prefill_share(0).num_heads * HEAD_BYTES),
        )
        self.decode_ios = [
            FakeNixlIO(
                f"kvpush-d0-rank{d}",
                layout(DST_BASE, m.decode_share(d).num_heads * HEAD_BYTES),
            )
            for d in range(PAIR.decode_tp)
        ]
        for io in self.decode_ios:
            self.io.link(io)
        self.replies = Replies()
        self.finished: list[str] = []
        config = WriterConfig(
            PREFILL,
            MatcherConfig(block_size=BS),
            tp_size=1,
            rank=0,
            total_kv_heads=HEADS,
        )
        self.pipeline = Pipeline(
            self.io,
            config,
            self.replies,
            self.finished.append,
            Tracer("", PREFILL),
            Counters(),
            FaultSource(""),
        )

    def tick(self, now: float) -> None:
        """One turn of the writer's loop after its inbox was read."""
        for step in self.pipeline.steps:
            step(now)

    def hellos(self, now: float) -> None:
        """Each decode rank greets the prefill rank (both are its targets)."""
        for d, io in enumerate(self.decode_ios):
            hello = Hello(DECODE, BOOT, io.name, io.metadata, io.layout, d, 2, HEADS)
            self.pipeline.on_message(HELLOS[d], hello, now)
        replies = [m for _, m in self.replies.of(HelloReply)]
        assert len(replies) == 2 and all(r.accepted for r in replies), replies

    def register(self, now: float) -> None:
        """Decode's scheduler registers t1 (before the partition)."""
        reg = Registration(
            transfer_id="t1",
            decode_engine_id=DECODE,
            decode_boot_id=BOOT,
            dst_block_ids=(10, 11, 12, 13),
            num_tokens=60,
            ttl_s=TTL_S,
            decode_tp=PAIR.decode_tp,
        )
        self.pipeline.on_message(SCHEDULER, reg, now)

    def ready(self, now: float, fence: object = None) -> None:
        kv = ReadyKv("t1", (4, 5, 6, 9), 60, DECODE)
        ready = Ready(kv, "req-1", fence or NoFence())  # type: ignore[arg-type]
        self.pipeline.on_ready(ready, now)

    def reconcile(self, route: bytes, now: float) -> None:
        """A decode rank reconnected and names t1, from its new socket."""
        self.pipeline.on_message(route, Reconcile(DECODE, BOOT, ("t1",)), now)

    def cancel(self, route: bytes, now: float) -> None:
        """A decode rank gives t1 up (its deadline passed)."""
        cancel = Cancel(transfer_id="t1", engine_id=DECODE, reason="deadline")
        self.pipeline.on_message(route, cancel, now)

    def failures(self, route: bytes) -> list[Failure]:
        return [m for r, m in self.replies.of(Failure) if r == route]  # type: ignore[misc]

    def assert_nothing_held(self) -> None:
        p = self.pipeline
        held = {
            name: len(getattr(p, name))
            for name in ("_matcher", "_writes", "_streams", "_to_post", "_tell")
            if len(getattr(p, name))
        }
        assert held == {}, held
        assert self.finished in ([], ["req-1"])


def end_half_by_prefill_cancel(rig: TpRig) -> Cause:
    """The registration waits in the matcher; prefill aborts the request."""
    rig.pipeline.on_prefill_cancel("t1", 2.0)
    return Cause.CANCELLED


def end_half_by_expiry(rig: TpRig) -> Cause:
    """The registration waits in the matcher; prefill's KV never comes."""
    rig.tick(TTL_S + 5.0)
    return Cause.EXPIRED


def end_stream_by_prefill_cancel(rig: TpRig) -> Cause:
    """Matched, its forward not complete (nothing posted); prefill aborts."""
    rig.ready(1.5, PendingFence())
    rig.tick(1.6)
    assert rig.io.writes_snapshot() == [], "the test must end it unposted"
    rig.pipeline.on_prefill_cancel("t1", 2.0)
    return Cause.CANCELLED


def end_stream_by_failed_writes(rig: TpRig) -> Cause:
    """Matched and posted to both decode ranks; both WRITEs fail."""
    rig.io.script_polls("PROC", "ERR")
    rig.ready(1.5)
    rig.tick(1.6)  # posts one WRITE per decode rank
    assert len(rig.io.writes_snapshot()) == 2
    rig.tick(1.7)
    rig.tick(1.8)
    return Cause.WRITE_FAILED


ENDINGS = [
    end_half_by_prefill_cancel,
    end_half_by_expiry,
    end_stream_by_prefill_cancel,
    end_stream_by_failed_writes,
]


def reconciled_rig() -> TpRig:
    """t1 registered before the partition; after it both decode ranks
    reconnect and reconcile t1, which prefill still holds."""
    rig = TpRig()
    rig.hellos(0.0)
    rig.register(0.0)
    rig.reconcile(RANKS[0], 1.0)
    rig.reconcile(RANKS[1], 1.0)
    assert rig.replies.of(Failure) == [], "held: no answer yet"
    return rig


@pytest.mark.parametrize("end", ENDINGS, ids=lambda f: f.__name__)
def test_every_decode_rank_that_reconciled_hears_the_failure(end):
    rig = reconciled_rig()

    cause = end(rig)

    for d, route in enumerate(RANKS):
        causes = [(f.transfer_id, f.cause) for f in rig.failures(route)]
        assert causes == [("t1", cause)], f"decode rank {d}'s Reconcile socket"
    assert rig.failures(SCHEDULER) == [], "not on the socket gone before"
    rig.assert_nothing_held()


def test_a_cancel_from_each_rank_after_the_reconcile_is_answered_once_each():
    """Both ranks' deadlines pass while a WRITE is in flight: each Cancel
    comes on its rank's Reconcile socket; one Failure each, once the
    WRITEs are over."""
    rig = reconciled_rig()
    rig.io.script_polls("PROC", "PROC", "PROC", "ERR")
    rig.ready(1.5)
    rig.tick(1.6)
    assert len(rig.io.writes_snapshot()) == 2
    rig.cancel(RANKS[0], 2.0)
    rig.cancel(RANKS[1], 2.0)
    assert rig.replies.of(Failure) == [], "a WRITE may still land: no answer yet"

    for now in (2.1, 2.2, 2.3):
        rig.tick(now)

    for route in RANKS:
        assert [f.cause for f in rig.failures(route)] == [Cause.WRITE_FAILED]
    rig.assert_nothing_held()


def test_the_registration_socket_alone_still_hears_the_failure():
    """No reconnect: the Failure goes to the Registration's socket (decode's
    scheduler forwards it to every decode rank), once."""
    rig = TpRig()
    rig.hellos(0.0)
    rig.register(0.0)

    rig.pipeline.on_prefill_cancel("t1", 2.0)

    assert [f.cause for f in rig.failures(SCHEDULER)] == [Cause.CANCELLED]
    assert [r for r, _ in rig.replies.of(Failure)] == [SCHEDULER]
    rig.assert_nothing_held()


def test_a_rank_that_reconciles_twice_from_one_socket_hears_it_once():
    rig = reconciled_rig()
    rig.reconcile(RANKS[0], 1.2)  # the same rank, the same socket, again

    rig.pipeline.on_prefill_cancel("t1", 2.0)

    assert len(rig.failures(RANKS[0])) == 1
    assert len(rig.failures(RANKS[1])) == 1
    assert len(rig.replies.of(Failure)) == 2
    rig.assert_nothing_held()
