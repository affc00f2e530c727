"""A matched transfer is posted only once its decode boot said Hello, its
KV's fence completed and any fault delay passed, all before its post
deadline; past the deadline it is overdue, with the reason that held it."""

from __future__ import annotations

from kvpush.connector.prefill.posting import Posting
from kvpush.transfer.matcher import Matched, ReadyKv
from kvpush.transfer.messages import Cause, Registration

READY = ReadyKv("t1", (1, 2), 20, "d0")


def matched(tid: str = "t1", deadline: float = 10.0) -> Matched:
    reg = Registration(tid, "d0", "boot-1", (5, 6), num_tokens=20, ttl_s=10.0)
    return Matched(tid, reg, READY, (1, 2), (5, 6), post_deadline=deadline)


def knows(engine: str, boot: str, ranks: frozenset[int] = frozenset()) -> bool:
    return (engine, boot) == ("d0", "boot-1")


def never(*_: object) -> bool:
    return False


def always(*_: object) -> bool:
    return True


def test_a_transfer_goes_once_every_condition_holds() -> None:
    posting = Posting()
    posting.add(matched(), not_before=2.0)

    assert posting.sweep(1.0, knows, always) == ([], []), "fault delay not over"
    assert posting.sweep(3.0, never, always) == ([], []), "no Hello yet"
    assert posting.sweep(3.0, knows, never) == ([], []), "fence not done"
    (go,), overdue = posting.sweep(3.0, knows, always)

    assert go.transfer_id == "t1" and overdue == []
    assert len(posting) == 0


def test_overdue_transfers_say_what_held_them() -> None:
    posting = Posting()
    for tid in ("no-hello", "fence", "late"):
        posting.add(matched(tid), not_before=0.0)
    held = {
        "no-hello": (never, always),
        "fence": (knows, never),
        "late": (knows, always),
    }

    reasons = {}
    for tid, (known, ready) in held.items():
        only = Posting()
        only.add(matched(tid), not_before=11.0)  # never postable in time
        _, (late,) = only.sweep(10.5, known, ready)
        reasons[tid] = (late.cause, late.event)

    assert reasons == {
        "no-hello": (Cause.EXPIRED, "expired.no_hello"),
        "fence": (Cause.WRITE_FAILED, None),
        "late": (Cause.EXPIRED, "expired.matched"),
    }


def test_next_due_and_the_engines_waiting() -> None:
    posting = Posting()
    assert posting.next_due(0.0) is None
    posting.add(matched("a", deadline=9.0), not_before=4.0)
    posting.add(matched("b", deadline=7.0), not_before=5.0)
    assert posting.next_due(0.0) == 4.0
    # a delay already over wakes nobody (waiting for an event, the writer
    # sleeps): only what is still ahead counts
    assert posting.next_due(4.5) == 5.0
    assert posting.next_due(6.0) == 7.0
    assert posting.engines() == {"d0"}
    assert [tp.transfer_id for tp in posting.of_engine("d0", "boot-1")] == []
    assert len(posting.of_engine("d0", None)) == 2
