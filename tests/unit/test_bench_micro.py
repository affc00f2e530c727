"""The micro-benchmark measures what it says: its baseline is the old
algorithm (same descriptors as the new one), its workloads have the stated
shape, its spreads are the usual quantiles, its results are published as
``docs/bench/micro/results.json`` next to the other sections, and the writer
really reaches each state it reports on. No assertion on any duration."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpush.transfer.coalesce import desc_list, descriptors, runs
from kvpush_lab.bench.micro import baseline, build
from kvpush_lab.bench.micro.cli import publish
from kvpush_lab.bench.micro.report import (
    SECTION,
    CpuTiming,
    MicroRun,
    micro_results,
    render_section,
)
from kvpush_lab.bench.micro.stats import Spread, time_rounds
from kvpush_lab.bench.results import SectionResults, load_results, save_results

SMALL_SRC = build.layout(0x1000, num_blocks=64, block_bytes=96, num_layers=3)
SMALL_DST = build.layout(0x900000, num_blocks=80, block_bytes=96, num_layers=3)


@given(
    st.lists(st.integers(0, 63), max_size=40).flatmap(
        lambda src: st.tuples(
            st.just(src),
            st.lists(
                st.integers(0, 79), min_size=len(src), max_size=len(src), unique=True
            ),
        )
    )
)
def test_the_baseline_builds_the_same_descriptors_as_coalesce(
    pairs: tuple[list[int], list[int]],
) -> None:
    src, dst = pairs
    layers = range(SMALL_SRC.num_layers)
    old = baseline.old_descriptors(
        baseline.old_runs(src, dst), SMALL_SRC, SMALL_DST, layers
    )
    new = descriptors(runs(src, dst), SMALL_SRC, SMALL_DST, layers)
    assert baseline.as_tuples(old[0]) == [tuple(d) for d in desc_list(new[0])]
    assert baseline.as_tuples(old[1]) == [tuple(d) for d in desc_list(new[1])]


def test_the_workloads_have_the_stated_shape() -> None:
    contiguous = build.gpu_workload("contiguous")
    assert len(runs(contiguous.src, contiguous.dst)) == 1
    fragmented = build.gpu_workload("fragmented")
    assert len(set(fragmented.src)) == len(set(fragmented.dst)) == build.NUM_MOVED
    assert max(fragmented.src + fragmented.dst) < build.GPU_NUM_BLOCKS
    assert len(runs(fragmented.src, fragmented.dst)) > 0.99 * build.NUM_MOVED
    assert build.gpu_workload("fragmented") == fragmented  # seeded
    gpu = contiguous.src_layout
    assert (gpu.num_layers, gpu.regions_per_layer) == (80, 2)
    assert gpu.block_bytes == 32 * 1024
    with pytest.raises(ValueError, match="case must be one of"):
        build.block_pairs("scattered", 100)


def test_spread_is_median_and_linear_quantiles() -> None:
    samples = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0]
    s = Spread.of(samples)
    assert s.median == float(np.median(samples))
    assert s.p10 == pytest.approx(float(np.percentile(samples, 10)))
    assert s.p90 == pytest.approx(float(np.percentile(samples, 90)))
    assert (s.low, s.high, s.num_samples) == (1.0, 10.0, 6)
    assert s.scaled(1000).median == 3500.0
    assert Spread.of([7.0]).p90 == 7.0
    with pytest.raises(ValueError):
        Spread.of([])


def test_time_rounds_runs_setup_before_every_timed_call() -> None:
    calls: list[str] = []
    samples = time_rounds(lambda: calls.append("fn"), 3, lambda: calls.append("set"))
    assert calls == ["set", "fn"] * 3
    assert len(samples) == 3 and min(samples) >= 0


def _run(cpu: tuple[CpuTiming, ...] = ()) -> MicroRun:
    one = Spread.of([0.001, 0.002, 0.003])
    b = build.BuildTiming("fragmented", "numpy (now)", one, 1000, 160_000)
    return MicroRun(
        "kvpush bench-micro", "2026-01-01 00:00 UTC", "abc1234", "2 cores", [b], [], cpu
    )


def test_the_section_states_machine_case_and_units() -> None:
    pct = Spread.of([10.0, 12.0, 14.0])
    polls = Spread.of([2e5, 2e5, 2e5])
    cpu = CpuTiming("WRITEs in flight", 0, 100, pct, 2.0, polls)
    text = render_section(_run((cpu,)))
    assert text.startswith("## Micro-benchmarks")
    assert "commit `abc1234`" in text and "on 2 cores" in text
    assert "| fragmented | numpy (now) | 1000 | 160,000 | 2.00 | 1.20–2.80 |" in text
    assert cpu.us_per_write_s == pytest.approx(1200.0)
    assert cpu.us_per_poll == pytest.approx(0.6)
    assert (
        "| WRITEs in flight | 0 | 100 | 12.00 | 10.40–13.60 | 1200 | 2000 | 0.6 |"
        in text
    )
    assert "Not measured" in render_section(_run())


def test_publish_writes_the_micro_json_and_keeps_other_sections(
    tmp_path: Path,
) -> None:
    save_results(
        SectionResults(section="soak", title="Soak", kind="soak", source="a test"),
        tmp_path / "docs" / "bench" / "soak",
    )
    publish(tmp_path, _run())
    files = publish(tmp_path, _run())
    results = load_results(tmp_path / "docs" / "bench" / SECTION)
    assert results == micro_results(_run()) and results.kind == "micro"
    assert results.commit == "abc1234" and results.setup.machine == "2 cores"
    build_table = results.tables[0]
    assert build_table.title == "Descriptor build (kvpush's own code)"
    assert ["fragmented", "numpy (now)", "1000", "160,000", "2.00", "1.20–2.80"] in (
        build_table.rows
    )
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "[results.json](docs/bench/micro/results.json)" in text
    assert "[results.json](docs/bench/soak/results.json)" in text
    assert tmp_path / "BENCHMARKS.md" in files


def test_the_writer_reaches_each_state_and_stops() -> None:
    from kvpush_lab.bench.micro.writer_cpu import measure_writer_cpu

    before = set(threading.enumerate())
    idle, waiting, inflight, both = measure_writer_cpu(
        1, 0.01, settle_s=0.0, num_waiting=20, num_inflight=5
    )
    assert (idle.num_waiting, idle.num_inflight) == (0, 0)
    assert (waiting.num_waiting, waiting.num_inflight) == (20, 0)
    assert (inflight.num_waiting, inflight.num_inflight) == (0, 5)
    assert (both.num_waiting, both.num_inflight) == (20, 5)
    assert idle.polls_per_s.median == waiting.polls_per_s.median == 0
    assert set(threading.enumerate()) <= before  # every writer thread stopped


class _NoNotifications:
    """What the progress thread reads in place of a NIXL agent."""

    def __init__(self) -> None:
        self.reads = 0

    def notifications(self) -> list[bytes]:
        self.reads += 1
        return []


def test_decode_step_times_each_thread_state_against_no_thread() -> None:
    from kvpush_lab.bench.micro.decode_step import measure_decode_step, render

    source = _NoNotifications()
    timings = measure_decode_step(rounds=2, steps=20, source=source, work=2000)

    assert [t.state for t in timings] == ["none", "idle", "polling"]
    assert all(t.step_ms.num_samples == 2 for t in timings)
    assert timings[0].ratio_to_none.median == 1.0, "none over itself"
    assert source.reads > 0, "the polling state read the source"
    table = render(timings)
    assert "| idle |" in table and "| polling |" in table
    assert not any(t.name == "kvpush-nixl-progress" for t in threading.enumerate())
