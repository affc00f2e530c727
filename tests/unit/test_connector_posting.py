"""A transfer's record: its phase moves only along the drawn transitions;
it is due to post only while matched or in flight with something known
and not posted; the sweep posts it once its decode boot said Hello, its
KV's fence completed and any fault delay passed, all before its post
deadline; past the deadline it says what held it."""

from __future__ import annotations

import pytest

from kvpush.connector.prefill.fence import NO_FENCE, ReadyFence
from kvpush.connector.prefill.transfer import (
    Phase,
    Transfer,
    next_change,
    polls_device,
    sweep,
)
from kvpush.transfer.groups import one
from kvpush.transfer.matcher import Matched, ReadyKv
from kvpush.transfer.messages import Cause, Registration
from kvpush.transfer.shares import HeadShare, HeadSlice

READY = ReadyKv("t1", one((1, 2)), 20, "d0")  # 2 blocks of 16 tokens
WHOLE = HeadSlice(HeadShare(1, 0, 1), HeadShare(1, 0, 1), 0, 1)


def matched(tid: str = "t1", deadline: float = 10.0) -> Matched:
    reg = Registration(tid, "d0", "boot-1", one((5, 6)), num_tokens=20, ttl_s=10.0)
    ready = ReadyKv(tid, one((1, 2)), 20, "d0")
    return Matched(tid, reg, ready, one((1, 2)), one((5, 6)), post_deadline=deadline)


def transfer(
    not_before: float = 0.0,
    tid: str = "t1",
    deadline: float = 10.0,
    fence: ReadyFence = NO_FENCE,
) -> Transfer:
    """``tid`` matched, with nothing posted."""
    t = Transfer("req-1", ReadyKv(tid, one((1, 2)), 20, "d0"), fence)
    m = matched(tid, deadline)
    t.match(m, block_size=16, num_layers=2, targets=(WHOLE,), not_before=not_before)
    return t


class Pending:
    """A forward that has not completed."""

    def is_ready(self) -> bool:
        return False


def knows(engine: str, boot: str, ranks: frozenset[int]) -> bool:
    return (engine, boot, ranks) == ("d0", "boot-1", frozenset({0}))


def never(*_: object) -> bool:
    return False


def test_a_transfer_is_due_only_while_it_may_post_something_known() -> None:
    waiting = Transfer("req-1", READY, NO_FENCE)
    assert waiting.phase is Phase.WAITING and not waiting.is_due

    t = transfer(not_before=2.0)
    assert t.phase is Phase.MATCHED and t.is_due
    assert (t.not_before, t.post_deadline, t.boot) == (2.0, 10.0, "boot-1")
    write = t.next_write()
    assert write is not None and write.notify
    t.posted(write)
    assert t.phase is Phase.IN_FLIGHT and not t.is_due, "everything was posted"

    t.close(Cause.CANCELLED, "aborted")
    assert t.phase is Phase.ENDING and not t.is_due
    t.close(Cause.EXPIRED, "later")
    assert t.closing is not None and t.closing.cause is Cause.CANCELLED, "first kept"


def test_an_illegal_transition_raises() -> None:
    waiting = Transfer("req-1", READY, NO_FENCE)
    with pytest.raises(RuntimeError, match="WAITING -> ENDING"):
        waiting.close(Cause.CANCELLED, "a waiting KV is dropped, not closed")
    t = transfer()
    t.close(None, "decode restarted")
    with pytest.raises(RuntimeError, match="ENDING -> IN_FLIGHT"):
        t.advance(Phase.IN_FLIGHT)
    with pytest.raises(RuntimeError, match="ENDING -> MATCHED"):
        t.match(matched(), block_size=16, num_layers=2, targets=(WHOLE,))


def test_a_failed_write_ends_it_with_write_failed_whatever_closed_it() -> None:
    t = transfer()
    write = t.next_write()
    assert write is not None
    t.posted(write)
    t.close(Cause.CANCELLED, "aborted")
    t.write_failed()
    assert t.phase is Phase.ENDING
    assert t.closing is not None and t.closing.cause is Cause.WRITE_FAILED


def test_overdue_transfers_say_what_held_them() -> None:
    t = transfer()
    reasons = {
        "no-hello": t.overdue(known=False, ready=True),
        "fence": t.overdue(known=True, ready=False),
        "late": t.overdue(known=True, ready=True),
    }
    assert {k: (v.cause, v.event) for k, v in reasons.items()} == {
        "no-hello": (Cause.EXPIRED, "expired.no_hello"),
        "fence": (Cause.WRITE_FAILED, None),
        "late": (Cause.EXPIRED, "expired.matched"),
    }


def test_the_sweep_posts_a_transfer_once_every_condition_holds() -> None:
    t = transfer(not_before=2.0)
    held = transfer(not_before=2.0, tid="t2", fence=Pending())

    assert sweep([t, held], 1.0, knows).postable == [], "fault delay not over"
    assert sweep([t, held], 3.0, never).postable == [], "no Hello yet"
    go = sweep([t, held], 3.0, knows)
    assert go.postable == [t] and go.overdue == [], "t2's fence is not done"
    assert polls_device([held]) and not polls_device([t])


def test_the_sweep_says_what_held_an_overdue_transfer() -> None:
    t = transfer(not_before=11.0)  # never postable in time
    stuck = transfer(tid="t2", fence=Pending())

    late = sweep([t, stuck], 10.5, knows).overdue
    assert [(x.transfer_id, o.cause, o.event) for x, o in late] == [
        ("t1", Cause.EXPIRED, "expired.matched"),
        ("t2", Cause.WRITE_FAILED, None),
    ]
    (unknown,) = sweep([t], 10.5, never).overdue
    assert unknown[1].event == "expired.no_hello"
    assert sweep([t, stuck], 10.5, knows).postable == []


def test_next_change_is_the_earliest_delay_or_deadline_still_ahead() -> None:
    a = transfer(not_before=4.0, tid="a", deadline=9.0)
    b = transfer(not_before=5.0, tid="b", deadline=7.0)
    assert next_change([], 0.0) is None
    assert next_change([a, b], 0.0) == 4.0
    # a delay already over wakes nobody: only what is still ahead counts
    assert next_change([a, b], 4.5) == 5.0
    assert next_change([a, b], 6.0) == 7.0
    write = a.next_write()
    assert write is not None
    a.posted(write)
    assert next_change([a, b], 6.0) == 7.0 and next_change([a], 6.0) is None
