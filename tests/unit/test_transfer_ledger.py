"""Decode's ownership ledger: destination blocks are exclusive to one
transfer, and a release hands each hold back exactly once."""

from __future__ import annotations

import pytest

from kvpush.transfer.ledger import Hold, Ledger


def test_a_hold_is_released_once_and_leaves_nothing_behind() -> None:
    ledger = Ledger()
    hold = Hold("t1", (1, 2, 3), peer_engine_id="p0")
    ledger.hold(hold)
    assert ledger.holds() == [hold] and len(ledger) == 1

    assert ledger.release("t1") == hold
    assert ledger.release("t1") is None
    assert ledger.holds() == [] and len(ledger) == 0


def test_destination_blocks_are_exclusive() -> None:
    ledger = Ledger()
    ledger.hold(Hold("t1", (5, 6)))
    with pytest.raises(ValueError, match=r"\[6\]"):
        ledger.hold(Hold("t2", (6, 7)))
    with pytest.raises(ValueError, match="repeated"):
        ledger.hold(Hold("t3", (8, 8)))
    with pytest.raises(ValueError, match="already holds"):
        ledger.hold(Hold("t1", (9,)))
    assert [h.transfer_id for h in ledger.holds()] == ["t1"], "refusals change nothing"
    ledger.release("t1")
    ledger.hold(Hold("t2", (6, 7)))  # freed, so free to take
