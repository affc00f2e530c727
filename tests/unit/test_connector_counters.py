"""Connector counters: named counts any thread may add to, with totals and
the deltas since the last take (what each engine step's stats carry)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from kvpush.connector.counters import Counters
from kvpush.connector.faults import Faults, FaultSource
from tests.fakes.fake_nixl import wait_for


def test_deltas_are_what_was_added_since_the_last_take() -> None:
    counters = Counters()
    counters.add("expired.ready")
    counters.add("quarantined.blocks", 7)
    assert counters.take_deltas() == {"expired.ready": 1, "quarantined.blocks": 7}
    assert counters.take_deltas() == {}
    counters.add("expired.ready")
    assert counters.take_deltas() == {"expired.ready": 1}
    assert counters.get("expired.ready") == 2  # totals keep counting
    assert counters.snapshot() == {"expired.ready": 2, "quarantined.blocks": 7}


def test_bad_names_and_negative_counts_are_refused() -> None:
    counters = Counters()
    with pytest.raises(ValueError, match="bad counter name"):
        counters.add("Bad Name")
    with pytest.raises(ValueError, match="only grow"):
        counters.add("fallback", -1)
    assert counters.snapshot() == {} and counters.take_deltas() == {}


def test_no_count_is_lost_or_taken_twice_across_threads() -> None:
    counters = Counters()
    taken: list[dict[str, int]] = []

    def add() -> None:
        for _ in range(2000):
            counters.add("peer_lost")

    threads = [threading.Thread(target=add) for _ in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        taken.append(counters.take_deltas())
    for t in threads:
        t.join()
    taken.append(counters.take_deltas())
    assert sum(d.get("peer_lost", 0) for d in taken) == 8000


def test_fault_file_is_read_when_it_changes_and_ignored_when_bad(tmp_path: Path):
    path = tmp_path / "faults.json"
    source = FaultSource(str(path))
    assert source.current() == Faults()
    path.write_text(json.dumps({"delay_post_s": 2.0}))
    assert wait_for(lambda: source.current() == Faults(delay_post_s=2.0))
    path.write_text(json.dumps({"delay_post_s": -1}))
    assert wait_for(lambda: source.current() == Faults())
    path.write_text(json.dumps({"explode": True}))
    assert wait_for(lambda: source.current() == Faults())
    assert FaultSource("").current() == Faults()
