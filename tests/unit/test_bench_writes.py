"""Descriptor counts per WRITE, read from kvpush's traces."""

from __future__ import annotations

import json
from pathlib import Path

from kvpush_lab.bench.writes import (
    WriteSize,
    descriptor_line,
    read_write_sizes,
    summarize_writes,
)


def test_one_descriptor_per_run_and_layer_is_recognised() -> None:
    sizes = [WriteSize(2, 1, 8), WriteSize(6, 3, 9), WriteSize(4, 2, 2)]
    stats = summarize_writes(sizes, num_layers=2)
    assert stats is not None
    assert stats.all_one_per_run_and_layer
    assert (stats.num_writes, stats.runs_p50, stats.runs_max) == (3, 2, 3)
    assert (stats.descs_p50, stats.descs_max, stats.blocks_p50) == (4, 6, 8)
    assert "on every WRITE: yes" in descriptor_line("kvpush", stats)


def test_one_uncoalesced_write_is_flagged() -> None:
    # 8 blocks in one run but 16 descriptors: one per block and layer.
    stats = summarize_writes([WriteSize(2, 1, 8), WriteSize(16, 1, 8)], num_layers=2)
    assert stats is not None and not stats.all_one_per_run_and_layer
    assert "on every WRITE: **no**" in descriptor_line("kvpush", stats)


def test_a_per_layer_write_is_held_to_its_own_layers() -> None:
    # 8 layers in the model; per-layer WRITEs of 3 runs carry one layer each.
    per_layer = [WriteSize(3, 3, 12, num_layers=1), WriteSize(1, 1, 4, num_layers=1)]
    stats = summarize_writes(per_layer, num_layers=8)
    assert stats is not None and stats.all_one_per_run_and_layer
    uncoalesced = summarize_writes([WriteSize(12, 3, 12, num_layers=1)], num_layers=8)
    assert uncoalesced is not None and not uncoalesced.all_one_per_run_and_layer


def test_nothing_written_gives_none() -> None:
    assert summarize_writes([], num_layers=2) is None


def test_sizes_are_read_from_write_posted_lines_only(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    lines = [
        {"transfer_id": "t1", "event": "kv_ready", "t": 1.0},
        {"transfer_id": "t1", "event": "write_posted", "t": 1.1,
         "num_descs": 4, "num_runs": 2, "num_blocks": 7},
        {"transfer_id": "t2", "event": "write_posted", "t": 1.2,
         "num_descs": 2, "num_runs": 2, "num_blocks": 7, "num_layers": 1},
    ]  # fmt: skip
    (traces / "prefill0-1.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    assert read_write_sizes(tmp_path) == [WriteSize(4, 2, 7), WriteSize(2, 2, 7, 1)]
    assert read_write_sizes(tmp_path / "missing") == []
