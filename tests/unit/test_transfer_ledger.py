"""The ownership ledger: every hold has a deadline, exclusive blocks cannot
be held twice, and releasing or expiring hands each hold back exactly once."""

from __future__ import annotations

import pytest

from kvpush.transfer.ledger import Hold, Ledger


def test_a_transfer_lifecycle_on_prefill_leaves_nothing_behind() -> None:
    ledger = Ledger()
    ledger.hold(Hold("t1", "unsent_src", (1, 2, 3), deadline=30.0, peer_engine_id="d0"))
    assert ledger.next_deadline() == 30.0
    assert ledger.move("t1", "unsent_src", "posted_write", deadline=12.0)
    assert ledger.get("t1", "unsent_src") is None
    posted = ledger.get("t1", "posted_write")
    assert posted is not None and posted.block_ids == (1, 2, 3)
    assert posted.deadline == 12.0
    released = ledger.release("t1", "posted_write")
    assert released == posted
    assert ledger.release("t1", "posted_write") is None
    assert ledger.holds() == [] and len(ledger) == 0


def test_destination_blocks_are_exclusive() -> None:
    ledger = Ledger()
    ledger.hold(Hold("t1", "reserved_dst", (5, 6), 10.0))
    with pytest.raises(ValueError, match=r"\[6\]"):
        ledger.hold(Hold("t2", "reserved_dst", (6, 7), 10.0))
    with pytest.raises(ValueError, match="repeated"):
        ledger.hold(Hold("t3", "reserved_dst", (8, 8), 10.0))
    with pytest.raises(ValueError, match="already holds"):
        ledger.hold(Hold("t1", "reserved_dst", (9,), 10.0))
    # Shared prefix-cache source blocks may be held by two transfers.
    ledger.hold(Hold("t1", "unsent_src", (1, 2), 10.0))
    ledger.hold(Hold("t2", "unsent_src", (1, 2), 10.0))
    ledger.release("t1", "reserved_dst")
    ledger.hold(Hold("t2", "reserved_dst", (6, 7), 10.0))  # freed, so free to take


def test_expired_releases_each_due_hold_once_earliest_first() -> None:
    ledger = Ledger()
    ledger.hold(Hold("late", "unsent_src", (1,), 20.0))
    ledger.hold(Hold("early", "reserved_dst", (2,), 5.0))
    ledger.hold(Hold("early", "unsent_src", (3,), 7.0))
    assert ledger.expired(4.9) == []
    assert [(h.transfer_id, h.kind) for h in ledger.expired(10.0)] == [
        ("early", "reserved_dst"),
        ("early", "unsent_src"),
    ]
    assert ledger.expired(10.0) == []
    assert [h.transfer_id for h in ledger.holds()] == ["late"]
    ledger.hold(Hold("again", "reserved_dst", (2,), 30.0))  # block 2 came back


def test_release_all_and_a_refused_move_changes_nothing() -> None:
    ledger = Ledger()
    ledger.hold(Hold("t1", "unsent_src", (1,), 10.0))
    ledger.hold(Hold("t1", "reserved_dst", (4,), 10.0))
    ledger.hold(Hold("t2", "reserved_dst", (1,), 10.0))
    with pytest.raises(ValueError):
        ledger.move("t1", "unsent_src", "reserved_dst", 20.0)
    assert ledger.get("t1", "unsent_src") == Hold("t1", "unsent_src", (1,), 10.0)
    assert not ledger.move("t9", "unsent_src", "posted_write", 1.0)
    assert {h.kind for h in ledger.release_all("t1")} == {"unsent_src", "reserved_dst"}
    assert [h.transfer_id for h in ledger.holds()] == ["t2"]
