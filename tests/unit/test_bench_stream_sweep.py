"""The prompt-length sweep of issue 12: kvpush at a push granularity as a
configuration of its own (``kvpush.chunk``), the kv-heavy model preset, the
overlap of a transfer with its prompt's prefill read from prefill's trace,
and the report's overhead, bytes and overlap per length (no targets: they
live in the docs), and the overhead plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpush.connector.config import DEFAULT_PUSH_GRANULARITY
from kvpush_lab.bench.bandwidth import MIB, shaped_mib_s
from kvpush_lab.bench.config import BenchConfig, make_config
from kvpush_lab.bench.links import HostBytes, LinkUsage
from kvpush_lab.bench.names import cluster_of, granularity_of
from kvpush_lab.bench.outputs import write_outputs
from kvpush_lab.bench.overlap import (
    OverlapStats,
    TransferTrace,
    collect,
    in_window,
    read_transfers,
    summarize,
)
from kvpush_lab.bench.report import render_report
from kvpush_lab.bench.runner import cluster_config
from kvpush_lab.bench.stats import Dist, PointStats
from kvpush_lab.bench.summary import (
    BenchSummary,
    ConfigResult,
    PointInfo,
    PointResult,
    save_summary,
)

# -- configuration names ------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "granularity", "binding"),
    [
        ("kvpush.request", "request", None),
        ("kvpush.chunk", "chunk", None),
        ("kvpush.layer", "layer", None),
        ("kvpush.auto", "auto", None),  # the granularity, not the binding
        ("kvpush-late", DEFAULT_PUSH_GRANULARITY, "late"),  # a binding: default push
    ],
)
def test_a_dotted_name_sets_prefills_push_granularity(
    name: str, granularity: str, binding: str | None
) -> None:
    config = BenchConfig(configs=(name,))
    made = cluster_config(config, name, Path("/m"), Path("/r"))
    assert (made.mode, made.push_granularity, made.binding) == (
        "kvpush",
        granularity,
        binding,
    )


def test_baselines_keep_the_launchers_default_granularity() -> None:
    assert granularity_of("kvpush") is None
    assert cluster_of("kvpush.chunk") == ("kvpush", None)
    made = cluster_config(BenchConfig(), "vllm-pull", Path("/m"), Path("/r"))
    assert (
        made.mode == "vllm-pull" and made.push_granularity == DEFAULT_PUSH_GRANULARITY
    )


def test_a_granularity_written_as_a_binding_is_refused_with_the_right_name() -> None:
    with pytest.raises(ValueError, match=r"'kvpush-chunk'.*write kvpush\.chunk"):
        BenchConfig(configs=("kvpush-chunk",))


def test_an_unknown_granularity_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"auto, request, chunk, layer"):
        BenchConfig(configs=("kvpush.page",))


def test_granularities_never_share_a_cluster() -> None:
    with pytest.raises(ValueError, match="cluster of its own"):
        BenchConfig(configs=("kvpush.chunk", "kvpush.layer"), share_kvpush_cluster=True)


# -- decode computing prefill's first token again -------------------------------


def test_a_recomputing_decode_runs_vllms_scheduler_class() -> None:
    name = "kvpush-early-t1-recomputed"
    made = cluster_config(BenchConfig(configs=(name,)), name, Path("/m"), Path("/r"))
    assert (made.mode, made.binding) == ("kvpush", "early")
    flags = made.extra_vllm_args
    assert flags[flags.index("--scheduler-cls") + 1] == (
        "vllm.v1.core.sched.scheduler.Scheduler"  # the CPU build's
    )
    plain = cluster_config(BenchConfig(), "kvpush-early", Path("/m"), Path("/r"))
    assert "--scheduler-cls" not in plain.extra_vllm_args  # kvpush's, by default


def test_a_recomputing_decode_never_shares_a_cluster() -> None:
    with pytest.raises(ValueError, match="cluster of its own"):
        BenchConfig(
            configs=("kvpush-early", "kvpush-early-t1-recomputed"),
            share_kvpush_cluster=True,
        )


# -- the model preset -----------------------------------------------------------


def test_the_kv_heavy_preset_brings_its_model_length_and_kv_space() -> None:
    config = make_config(
        {"model_preset": "kv-heavy", "prompt_len_sweep": "1000,7000", "qps": "1"}
    )
    assert (config.max_model_len, config.kv_cache_space_gb) == (8192, 4)
    given = make_config({"model_preset": "kv-heavy", "kv_cache_space_gb": 6})
    assert given.kv_cache_space_gb == 6


def test_a_model_preset_goes_alone() -> None:
    with pytest.raises(ValueError, match="model_preset alone"):
        make_config({"model_preset": "kv-heavy", "model_layers": 4})
    with pytest.raises(ValueError, match="unknown model preset"):
        make_config({"model_preset": "huge"})


# -- overlap from prefill's trace ---------------------------------------------


def line(tid: str, event: str, t: float, **extra: object) -> dict[str, object]:
    return {"transfer_id": tid, "event": event, "t": t, "engine_id": "p0", **extra}


def streamed(tid: str = "a", start: float = 100.0) -> list[dict[str, object]]:
    """Four 8 MiB WRITEs, three posted during prefill, the last after it."""
    lines = [line(tid, "reg_received", start - 0.5)]
    lines += [line(tid, "write_posted", start + i, num_bytes=8 * MIB) for i in range(3)]
    lines += [line(tid, "kv_ready", start + 3.0)]
    lines += [line(tid, "write_posted", start + 3.01, num_bytes=8 * MIB)]
    return [*lines, line(tid, "write_done", start + 3.1)]


def test_posted_before_counts_the_bytes_posted_by_the_last_forward() -> None:
    (transfer,) = collect(streamed())
    assert transfer.is_complete and transfer.num_bytes == 32 * MIB
    assert transfer.posted_before() == pytest.approx(0.75)
    assert transfer.tail_s() == pytest.approx(0.1)


def test_at_least_what_the_link_could_not_carry_in_the_tail_crossed_before() -> None:
    (transfer,) = collect(streamed())
    after = 0.1 * shaped_mib_s(1.0)  # MiB the link carries in the tail
    assert transfer.crossed_before_at_least(1.0) == pytest.approx(1 - after / 32)
    whole = TransferTrace("b", kv_ready=0.0, write_done=0.6, writes=[(0.01, 64 * MIB)])
    assert whole.posted_before() == 0.0
    assert whole.crossed_before_at_least(1.0) == 0.0


def test_a_point_takes_the_complete_transfers_ready_in_its_window() -> None:
    lines = streamed("a", 100.0) + streamed("b", 200.0)
    lines.append(line("c", "kv_ready", 101.0))  # never written: left out
    transfers = collect(lines)
    assert [t.transfer_id for t in in_window(transfers, (99.0, 150.0))] == ["a"]
    stats = summarize(in_window(transfers, (0.0, 300.0)), 1.0)
    assert isinstance(stats, OverlapStats)
    assert (stats.num_transfers, stats.writes_per_transfer) == (2, 4)
    assert stats.mib_per_transfer == 32.0
    assert stats.posted_before.p50 == pytest.approx(0.75)
    assert stats.tail_ms.p50 == pytest.approx(100.0, abs=0.01)
    assert stats.crossed_before_at_least is not None
    assert summarize([], 1.0) is None
    assert summarize(transfers, None).crossed_before_at_least is None  # type: ignore[union-attr]


def test_the_trace_files_are_read_from_the_run_directory(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    text = "\n".join(json.dumps(x) for x in streamed())
    (traces / "prefill0-1.jsonl").write_text(text + "\n")
    (traces / "decode0-2.jsonl").write_text(json.dumps(line("a", "reg_sent", 99)))
    (transfer,) = read_transfers(tmp_path)
    assert len(transfer.writes) == 4 and transfer.kv_ready == 103.0


# -- the report -----------------------------------------------------------------

LENGTHS = (1000, 4000, 7000)
KV_PER_TOKEN = 64 * 1024
# TTFT p50 (ms) per configuration and length; colocated's prefill grows
TTFT = {
    "colocated": (500.0, 4000.0, 11000.0),
    "vllm-pull": (1100.0, 6300.0, 15000.0),
    "kvpush.request": (1080.0, 6200.0, 14900.0),
    "kvpush.chunk": (700.0, 4300.0, 11400.0),
    "kvpush.layer": (650.0, 4200.0, 11900.0),
}


def dist(value: float) -> Dist:
    return Dist(n=4, mean=value, p50=value, p90=value, p99=value, min=value, max=value)


def point_stats(ttft: float) -> PointStats:
    return PointStats(
        num_requests=4, num_ok=4, num_errors=0, errors={}, num_short_output=0,
        duration_s=2.0, request_throughput=2.0, output_throughput=64.0,
        total_token_throughput=2000.0, ttft_ms=dist(ttft), tpot_ms=dist(4.0),
        itl_ms=dist(4.0), e2e_ms=dist(ttft + 124),
    )  # fmt: skip


def link_usage(name: str, length: int) -> LinkUsage:
    kv = 4 * length * KV_PER_TOKEN
    moved = 0 if name == "colocated" else kv + 4 * MIB
    role = "colocated" if name == "colocated" else "prefill"
    return LinkUsage(
        num_requests=4, kv_bytes=kv, kv_bytes_per_token=KV_PER_TOKEN,
        hosts=[HostBytes(name=f"{role}0", role=role, sent=moved, received=0)],
    )  # fmt: skip


def overlap(name: str) -> OverlapStats | None:
    if not name.startswith("kvpush"):
        return None
    share = 0.0 if name == "kvpush.request" else 0.9
    return OverlapStats(
        num_transfers=4, mib_per_transfer=250.0, writes_per_transfer=16.0,
        posted_before=dist(share), tail_ms=dist(300.0),
        crossed_before_at_least=dist(share / 2),
    )  # fmt: skip


def result(name: str) -> ConfigResult:
    points = [
        PointResult(
            point=i,
            stats=point_stats(TTFT[name][i]),
            links=link_usage(name, n),
            overlap=overlap(name),
        )
        for i, n in enumerate(LENGTHS)
    ]
    return ConfigResult(name=name, status="ok", link_gbit=1.0, points=points)


def point_info(index: int, length: int) -> PointInfo:
    return PointInfo(
        index=index, label=f"prompt {length}", axis="prompt_len", x=float(length),
        arrival="concurrency", load=1.0, prompt_len=str(length), num_requests=4,
    )  # fmt: skip


def sweep_summary() -> BenchSummary:
    return BenchSummary(
        command="kvpush bench --prompt-len-sweep 1000,4000,7000",
        started_at="2026-01-01T00:00:00+00:00",
        machine={"cores": 2},
        settings={"hosts": "netns", "link_gbit": [1.0], "max_num_batched_tokens": 256},
        points=[point_info(i, n) for i, n in enumerate(LENGTHS)],
        configs=[result(name) for name in TTFT],
    )


def test_overhead_per_length_is_against_colocated_at_that_length() -> None:
    text = render_report(sweep_summary())
    assert "## Handover overhead against prompt length" in text
    # header: prompt, colocated, then every P/D configuration in run order
    assert (
        "| prompt tokens | colocated TTFT p50 | vllm-pull | kvpush.request | "
        "kvpush.chunk | kvpush.layer |" in text
    )
    assert "| 7000 | 11000 | 4000 | 3900 | 400 | 900 |" in text


def test_the_details_carry_bytes_and_both_overlap_bounds() -> None:
    text = render_report(sweep_summary())
    assert "## Bytes and overlap per prompt length" in text
    # 4000 tokens of 64 KiB = 250 MiB of KV; chunk's overhead 300 of pull's 2300
    assert (
        "| 1 Gbit/s | 4000 | kvpush.chunk | 300 | 0.13 | 251 | 250 | 16 | 90 % | "
        "45 % | 300 |" in text
    )
    assert "| 1 Gbit/s | 4000 | vllm-pull | 2300 | 1.00 | 251 | 250 | – | – |" in text


def test_a_load_sweep_has_no_prompt_length_parts() -> None:
    s = sweep_summary()
    s.points = [s.points[0]]
    s.points[0] = PointInfo(
        index=0, label="qps 1", axis="qps", x=1.0, arrival="poisson", load=1.0,
        prompt_len="1000", num_requests=4,
    )  # fmt: skip
    text = render_report(s)
    assert "against prompt length" not in text


def test_the_overhead_plot_is_drawn_and_linked(tmp_path: Path) -> None:
    s = sweep_summary()
    save_summary(s, tmp_path)
    files = write_outputs(tmp_path, s)
    assert tmp_path / "overhead_vs_prompt_len.png" in files
    assert (tmp_path / "overhead_vs_prompt_len.png").stat().st_size > 1000
    report = (tmp_path / "report.md").read_text()
    assert "](overhead_vs_prompt_len.png)" in report


def test_the_setup_names_the_swept_lengths_and_the_chunk() -> None:
    s = sweep_summary()
    s.settings.update(
        prompt_len="1000", prompt_len_sweep=list(LENGTHS), num_requests=4,
        model_preset="kv-heavy", kv_cache_space_gb=4,
    )  # fmt: skip
    text = render_report(s)
    assert "prompt lengths 1000, 4000, 7000 tokens, one point each" in text
    assert "max_num_batched_tokens 256 (the prefill chunk)" in text
    assert "model preset kv-heavy, KV space 4 GB per instance" in text


def test_a_streamed_transfers_phases_time_its_last_write() -> None:
    from kvpush_lab.bench.timeline import collect as collect_timelines
    from kvpush_lab.bench.timeline import parse_line

    timelines = collect_timelines(parse_line(x) for x in streamed())
    (timeline,) = timelines.unjoined
    assert timeline["write_posted"] == pytest.approx(103.01)  # the last post
    assert timeline["kv_ready"] == pytest.approx(103.0)
