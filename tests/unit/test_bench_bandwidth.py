"""Achieved bandwidth per KV transfer: kvpush's WRITEs from its trace lines,
vLLM's transfers from the difference of its NIXL histograms on /metrics;
only transfers of 32 MiB or more measured; ratios to the shaped rate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpush.telemetry import names
from kvpush_lab.bench.bandwidth import (
    MIB,
    from_nixl,
    from_samples,
    in_window,
    parse_nixl_transfers,
    read_write_samples,
    shaped_mib_s,
    write_samples,
)

TIME_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
BYTE_BOUNDS = tuple(2 ** (10 + i) for i in range(1, 25, 2))


def exposition(durations: list[float], sizes: list[int], engine: str = "0") -> str:
    """vLLM's two NIXL histograms as its /metrics serves them."""
    labels = f'engine="{engine}",model_name="m"'
    lines = []
    for name, values, bounds in (
        (names.NIXL_XFER_TIME.name, durations, TIME_BOUNDS),
        (names.NIXL_BYTES_TRANSFERRED.name, sizes, BYTE_BOUNDS),
    ):
        lines += [f"# HELP {name} x", f"# TYPE {name} histogram"]
        for le in (*bounds, float("inf")):
            count = sum(1 for v in values if v <= le)
            text = "+Inf" if le == float("inf") else repr(float(le))
            lines.append(f'{name}_bucket{{{labels},le="{text}"}} {count}.0')
        lines.append(f"{name}_count{{{labels}}} {len(values)}.0")
        lines.append(f"{name}_sum{{{labels}}} {float(sum(values))}")
    return "\n".join(lines) + "\n"


def test_shaped_rates_are_nominal_mib_per_second() -> None:
    assert shaped_mib_s(1.0) == pytest.approx(119.21, abs=0.01)
    assert shaped_mib_s(4.0) == pytest.approx(476.84, abs=0.01)


def test_kvpush_writes_pair_posted_and_done_by_transfer() -> None:
    lines = [
        {"transfer_id": "a", "event": "write_posted", "t": 10.0, "num_bytes": 64 * MIB},
        {"transfer_id": "b", "event": "write_posted", "t": 11.0, "num_bytes": 64 * MIB},
        {"transfer_id": "a", "event": "write_done", "t": 10.5},
        {"transfer_id": "c", "event": "write_posted", "t": 12.0, "num_bytes": MIB},
        {"transfer_id": "c", "event": "write_ended", "t": 12.1},  # never landed
        {"transfer_id": "b", "event": "write_done", "t": 11.25},
        {"transfer_id": "a", "event": "kv_ready", "t": 9.0},
        # a streamed transfer: two WRITEs, Done on the last; not split
        {"transfer_id": "s", "event": "write_posted", "t": 13.0, "num_bytes": MIB},
        {"transfer_id": "s", "event": "write_posted", "t": 13.5, "num_bytes": MIB},
        {"transfer_id": "s", "event": "write_done", "t": 14.0},
    ]
    samples = write_samples(lines)
    assert [(s.num_bytes, s.seconds, s.posted_at) for s in samples] == [
        (64 * MIB, 0.5, 10.0),
        (64 * MIB, 0.25, 11.0),
    ]
    assert in_window(samples, (10.5, 12.0)) == samples[1:]
    stats = from_samples(samples, "WRITE", 1.0)
    assert stats is not None and stats.mib_s is not None
    assert (stats.num_transfers, stats.num_measured) == (2, 2)
    assert stats.mib_s.p50 == pytest.approx(192.0)  # 128 and 256 MiB/s
    assert (stats.mib_s.min, stats.mib_s.max) == (128.0, 256.0)
    assert stats.mean_mib_s == pytest.approx(128 / 0.75)
    assert stats.of_shaped == pytest.approx(192.0 / shaped_mib_s(1.0))


def test_trace_files_are_read_from_the_run_dir(tmp_path: Path) -> None:
    folder = tmp_path / "traces"
    folder.mkdir()
    rows = [
        {"transfer_id": "a", "event": "write_posted", "t": 1.0, "num_bytes": 3},
        {"transfer_id": "a", "event": "write_done", "t": 1.5},
        {"transfer_id": "a", "event": "notif_received", "t": 1.6},
    ]
    (folder / "prefill0-1.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows)
    )
    [sample] = read_write_samples(tmp_path)
    assert (sample.num_bytes, sample.seconds) == (3, 0.5)
    assert read_write_samples(tmp_path / "nothing") == []


def test_small_transfers_are_counted_but_not_measured() -> None:
    samples = write_samples([
        {"transfer_id": "a", "event": "write_posted", "t": 1.0, "num_bytes": 2 * MIB},
        {"transfer_id": "a", "event": "write_done", "t": 1.001},
    ])  # fmt: skip
    stats = from_samples(samples, "WRITE", 4.0)
    assert stats is not None
    assert (stats.num_transfers, stats.num_measured) == (1, 0)
    assert stats.mib_per_transfer == 2.0
    assert stats.mib_s is None and stats.of_shaped is None
    assert from_samples([], "WRITE", 4.0) is None


def test_vllm_transfers_come_from_the_difference_of_its_histograms() -> None:
    warmup = parse_nixl_transfers(exposition([0.9], [56 * MIB]))
    after = parse_nixl_transfers(exposition([0.9, 0.45, 0.6, 0.55], [56 * MIB] * 4))
    stats = from_nixl(after.minus(warmup), "READ", 1.0)
    assert stats is not None
    assert (stats.kind, stats.source) == ("READ", "NIXL telemetry")
    assert (stats.num_transfers, stats.num_measured) == (3, 3)
    assert stats.mib_per_transfer == pytest.approx(56.0)
    assert stats.mean_mib_s == pytest.approx(3 * 56 / 1.6)
    # the median READ took between 0.5 and 0.75 s: 74.7-112 MiB/s
    assert stats.mib_s_p50_range == pytest.approx((56 / 0.75, 56 / 0.5))
    assert stats.mib_s is None  # no per-READ figures in a histogram
    assert stats.of_shaped == pytest.approx(stats.mean_mib_s / shaped_mib_s(1.0))


def test_histograms_of_several_instances_add_up() -> None:
    one = parse_nixl_transfers(exposition([0.2], [64 * MIB], engine="0"))
    two = parse_nixl_transfers(exposition([0.2, 0.3], [64 * MIB] * 2, engine="0"))
    both = one.plus(two)
    assert both.seconds.count == 3 and both.num_bytes.total == 3 * 64 * MIB


def test_no_histograms_or_only_small_transfers_measure_nothing() -> None:
    assert from_nixl(parse_nixl_transfers("# kvpush exports none\n"), "READ", 1) is None
    small = parse_nixl_transfers(exposition([0.01, 0.01], [2 * MIB, 2 * MIB]))
    stats = from_nixl(small, "READ", 1.0)
    assert stats is not None and stats.num_measured == 0
    assert stats.mean_mib_s is None and stats.mib_s_p50_range is None
