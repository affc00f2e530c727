"""Connector counters: named counts written atomically to the trace dir,
soon after the last change even when nothing else happens."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvpush.connector.counters import FLUSH_PERIOD_S, Counters
from kvpush.connector.faults import Faults, FaultSource
from tests.fakes.fake_nixl import wait_for


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_counts_reach_the_file_even_when_the_process_goes_idle(tmp_path: Path):
    counters = Counters(str(tmp_path), "prefill0", "prefill")
    path = tmp_path / f"counters-prefill0-{os.getpid()}.json"
    counters.add("expired.ready")
    counters.add("expired.ready")  # within the flush period: written later
    counters.add("failed.write_failed")

    assert wait_for(lambda: path.exists() and read(path)["counters"]
                    == {"expired.ready": 2, "failed.write_failed": 1},
                    timeout_s=4 * FLUSH_PERIOD_S)  # fmt: skip
    assert read(path)["engine_id"] == "prefill0" and read(path)["role"] == "prefill"
    counters.close()


def test_bad_names_are_refused_and_no_dir_means_no_file(tmp_path: Path):
    counters = Counters("", "d0", "decode")
    counters.add("fallback")
    assert counters.snapshot() == {"fallback": 1}
    with pytest.raises(ValueError):
        counters.add("Bad Name")
    counters.close()
    assert list(tmp_path.iterdir()) == []


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
