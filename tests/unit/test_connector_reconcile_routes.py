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
explicit ``now`` values (no writer thread, no sleeps) with the shared rig
of :mod:`tests.unit.prefill_pipeline_rig` (prefill rank 0 of 1, decode
ranks 0 and 1, each Hello from its own socket).
"""

from __future__ import annotations

import pytest

from kvpush.transfer.messages import Cause, Failure
from tests.unit.prefill_pipeline_rig import REG_ROUTE, PipelineRig

HEADS = 2  # the model's KV heads: one per decode rank
SCHEDULER = REG_ROUTE  # the Registration's socket, gone since the partition
RANKS = (b"route-d0-rank0-after", b"route-d0-rank1-after")  # their Reconciles
TTL_S = 10.0  # the registration's ttl (the rig's default)


class PendingFence:
    """A forward that has not completed: nothing of it may be posted."""

    def is_ready(self) -> bool:
        return False


def end_half_by_prefill_cancel(rig: PipelineRig) -> Cause:
    """The registration waits in the matcher; prefill aborts the request."""
    rig.pipeline.on_prefill_cancel("t1", 2.0)
    return Cause.CANCELLED


def end_half_by_expiry(rig: PipelineRig) -> Cause:
    """The registration waits in the matcher; prefill's KV never comes."""
    rig.tick(TTL_S + 5.0)
    return Cause.EXPIRED


def end_stream_by_prefill_cancel(rig: PipelineRig) -> Cause:
    """Matched, its forward not complete (nothing posted); prefill aborts."""
    rig.ready(1.5, fence=PendingFence())
    rig.tick(1.6)
    assert rig.io.writes_snapshot() == [], "the test must end it unposted"
    rig.pipeline.on_prefill_cancel("t1", 2.0)
    return Cause.CANCELLED


def end_stream_by_failed_writes(rig: PipelineRig) -> Cause:
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


def reconciled_rig() -> PipelineRig:
    """t1 registered before the partition; after it both decode ranks
    reconnect and reconcile t1, which prefill still holds."""
    rig = PipelineRig(decode_tp=2, total_kv_heads=HEADS)
    rig.hellos(0.0)
    rig.register(0.0)
    rig.reconcile(1.0, RANKS[0])
    rig.reconcile(1.0, RANKS[1])
    assert rig.failures() == [], "held: no answer yet"
    return rig


@pytest.mark.parametrize("end", ENDINGS, ids=lambda f: f.__name__)
def test_every_decode_rank_that_reconciled_hears_the_failure(end):
    rig = reconciled_rig()

    cause = end(rig)

    for d, route in enumerate(RANKS):
        assert rig.failures(route) == [("t1", cause)], f"decode rank {d}'s socket"
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
    rig.cancel(2.0, route=RANKS[0])
    rig.cancel(2.0, route=RANKS[1])
    assert rig.failures() == [], "a WRITE may still land: no answer yet"

    for now in (2.1, 2.2, 2.3):
        rig.tick(now)

    for route in RANKS:
        assert [c for _, c in rig.failures(route)] == [Cause.WRITE_FAILED]
    rig.assert_nothing_held()


def test_the_registration_socket_alone_still_hears_the_failure():
    """No reconnect: the Failure goes to the Registration's socket (decode's
    scheduler forwards it to every decode rank), once."""
    rig = PipelineRig(decode_tp=2, total_kv_heads=HEADS)
    rig.hellos(0.0)
    rig.register(0.0)

    rig.pipeline.on_prefill_cancel("t1", 2.0)

    assert [c for _, c in rig.failures(SCHEDULER)] == [Cause.CANCELLED]
    assert [r for r, _ in rig.replies.of(Failure)] == [SCHEDULER]
    rig.assert_nothing_held()


def test_a_rank_that_reconciles_twice_from_one_socket_hears_it_once():
    rig = reconciled_rig()
    rig.reconcile(1.2, RANKS[0])  # the same rank, the same socket, again

    rig.pipeline.on_prefill_cancel("t1", 2.0)

    assert len(rig.failures(RANKS[0])) == 1
    assert len(rig.failures(RANKS[1])) == 1
    assert len(rig.failures()) == 2
    rig.assert_nothing_held()
