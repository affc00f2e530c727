"""The fragmented workload: its settings, the churn schedule, the client's
abort, descriptors per transfer, decoding meanwhile, the report, a run on
fake clusters."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from kvpush.cli import main
from kvpush_lab.bench.bandwidth import Histogram, NixlTransfers
from kvpush_lab.bench.churn import CHURN_POINT, Churn, abort_points, churn_workload
from kvpush_lab.bench.cli import add_parser, config_from_args
from kvpush_lab.bench.config import make_config
from kvpush_lab.bench.fragment import (
    FragmentPoint,
    Meanwhile,
    TracedWrite,
    TransferDescs,
    churn_result,
    fragment_point,
    from_telemetry,
    from_traces,
    meanwhile,
    read_traced_writes,
    top_bucket,
)
from kvpush_lab.bench.lengths import LengthSpec
from kvpush_lab.bench.records import ABORTED, RequestRecord, read_records
from kvpush_lab.bench.report import render_report
from kvpush_lab.bench.runner import block_size_args, cluster_config
from kvpush_lab.bench.summary import (
    BenchSummary,
    ConfigResult,
    PointResult,
    load_summary,
)
from kvpush_lab.bench.workload import RequestSpec, sweep_points
from tests.fakes import routed
from tests.unit.test_bench_client import send_one
from tests.unit.test_bench_report import dist, stats
from tests.unit.test_bench_report import summary as sweep_summary
from tests.unit.test_bench_runner import FakeLauncher, launcher

__all__ = ["launcher"]  # the fixture, used by name
VOCAB = list(range(3, 4096))
TRACE = "kvpush trace"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpush")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


# -- settings ------------------------------------------------------------------


def test_the_fragmented_workload_brings_small_blocks_and_long_prompts() -> None:
    config = config_from_args(parse(["--workload", "fragmented"]))
    assert config.block_size == 32  # the smallest the CPU backend takes
    assert config.model_preset == "kv-heavy" and config.max_model_len == 8192
    assert config.kv_cache_space_gb == 2  # not the preset's 4: the churn wraps it
    assert config.prompt_spec == LengthSpec.parse("4000")
    assert config.arrival == "concurrency" and config.loads == (1.0,)
    assert not config.shares_kvpush_cluster  # kvpush's traces stay its own
    labels = [p.label for p in sweep_points(config)]
    assert labels == ["fresh cache", "after churn"]


def test_given_settings_win_over_the_workloads_defaults() -> None:
    argv = [
        "--workload", "fragmented", "--block-size", "64", "--prompt-len", "512",
        "--kv-cache-space-gb", "1", "--model-layers", "4",
    ]  # fmt: skip
    config = config_from_args(parse(argv))
    assert config.block_size == 64 and config.prompt_len == "512"
    assert config.kv_cache_space_gb == 1
    assert config.model_preset is None and config.model_layers == 4
    assert make_config({}).block_size is None  # the sweep keeps vLLM's default


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"churn_abort_fraction": 1.5}, "churn_abort_fraction"),
        ({"churn_requests": 0}, "churn_requests"),
        ({"churn_prompt_len": "trace:x.jsonl"}, "not a trace"),
        ({"churn_prompt_len": "8000", "churn_output_len": "500"}, "max_model_len"),
        ({"concurrency": (1, 2)}, "one concurrency"),
        ({"block_size": 0}, "block_size"),
    ],
)
def test_bad_fragmented_settings_say_what_to_change(
    values: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_config({"workload": "fragmented", **values})


def test_every_instance_gets_the_block_size(tmp_path: Path) -> None:
    assert block_size_args(None) == ()
    config = make_config({"workload": "fragmented", "configs": ["vllm-pull"]})
    cluster = cluster_config(config, "vllm-pull", tmp_path, tmp_path / "run")
    assert cluster.extra_vllm_args == ("--block-size", "32")


# -- the churn -------------------------------------------------------------------


def churn(fraction: float = 0.5, seed: int = 0) -> Churn:
    return Churn(
        num_requests=40, concurrency=8, prompt_len=LengthSpec.parse("64-512"),
        output_len=LengthSpec.parse("1-16"), abort_fraction=fraction, seed=seed,
    )  # fmt: skip


def test_the_churn_is_mixed_lengths_some_aborted_mid_decode() -> None:
    workload = churn_workload(churn(), VOCAB)
    assert workload.point.index == CHURN_POINT and workload.point.concurrency == 8
    requests = workload.requests
    assert len(requests) == 40 and len({r.bench_id for r in requests}) == 40
    assert all(64 <= r.prompt_len <= 512 for r in requests)
    assert len({r.prompt_len for r in requests}) > 10  # mixed
    assert all(set(r.prompt) <= set(VOCAB) for r in requests)
    eligible = [r for r in requests if r.output_len >= 2]
    aborted = [r for r in requests if r.abort_after_tokens is not None]
    assert len(aborted) == round(0.5 * len(eligible))
    for r in aborted:  # after a first token, before the last: while decoding
        assert r.abort_after_tokens is not None
        assert 1 <= r.abort_after_tokens <= r.output_len - 1


def test_the_churn_is_seeded_and_a_salt_changes_only_the_tokens() -> None:
    first, again = churn_workload(churn(), VOCAB), churn_workload(churn(), VOCAB)
    assert first == again
    salted = churn_workload(churn(), VOCAB, salt="kvpush")
    shape = [(r.prompt_len, r.output_len, r.abort_after_tokens) for r in first.requests]
    assert shape == [
        (r.prompt_len, r.output_len, r.abort_after_tokens) for r in salted.requests
    ]
    assert first.requests[0].prompt != salted.requests[0].prompt
    other = churn_workload(churn(seed=1), VOCAB)
    assert other.requests[0].prompt != first.requests[0].prompt


def test_abort_points_take_exactly_the_share_of_eligible_requests() -> None:
    outputs = [1, 1, 5, 9, 2, 30, 1, 4]  # 5 of 8 ask for 2+ tokens
    assert abort_points(outputs, 0.0, 0) == [None] * 8
    every = abort_points(outputs, 1.0, 0)
    assert [a is not None for a in every] == [n >= 2 for n in outputs]
    assert sum(a is not None for a in abort_points(outputs, 0.4, 0)) == 2


async def test_a_planned_abort_closes_the_connection_after_its_tokens() -> None:
    spec = RequestSpec(
        0, "kvb-churn-0", tuple(range(100, 112)), 6, abort_after_tokens=2
    )
    async with routed("vllm-pull") as r:
        record = await send_one(r.url, spec)
    assert record.error == ABORTED and len(record.token_times_s) == 2
    outcome = churn_result([record, msgspec.structs.replace(record, error=None)])
    assert (outcome.num_aborted, outcome.num_completed, outcome.num_failed) == (1, 1, 0)


# -- descriptors and decoding meanwhile --------------------------------------------


def histogram(counts: dict[float, float], total: float) -> Histogram:
    """A cumulative histogram from per-bucket counts."""
    buckets, running = {}, 0.0
    for le in sorted(counts):
        running += counts[le]
        buckets[le] = running
    return Histogram(buckets=buckets, count=running, total=total)


def test_vllms_descriptors_and_post_time_come_from_its_telemetry() -> None:
    inf = float("inf")
    after = NixlTransfers(
        num_descs=histogram({400: 1, 1000: 3, 2000: 0, inf: 0}, 3200.0),
        post_seconds=histogram({0.001: 4, inf: 0}, 0.002),
    )
    t = from_telemetry(after.minus(NixlTransfers()))
    assert t is not None and t.source == "NIXL telemetry" and t.num_transfers == 4
    assert t.descs_mean == pytest.approx(800.0)
    assert t.descs_p50_range == (400, 1000)
    assert t.descs_max == 1000  # the top bucket that holds one: an upper bound
    assert t.post_mean_ms == pytest.approx(0.5)
    assert from_telemetry(NixlTransfers()) is None  # nothing posted
    assert top_bucket(histogram({10: 0, inf: 2}, 1e6)) is None  # unbounded


def test_kvpushs_descriptors_are_summed_per_transfer_in_the_window() -> None:
    writes = [
        TracedWrite("a", 10.0, 8), TracedWrite("a", 10.2, 16),
        TracedWrite("b", 11.0, 80),
        TracedWrite("c", 30.0, 8),  # another point's
    ]  # fmt: skip
    t = from_traces(writes, (9.0, 20.0))
    assert t is not None and t.source == "kvpush trace" and t.num_transfers == 2
    assert (t.descs_p50, t.descs_max, t.descs_mean) == (52.0, 80.0, 52.0)
    assert t.writes_per_transfer == 1.5
    assert from_traces(writes, (40.0, 50.0)) is None


def test_kvpushs_writes_are_read_from_prefills_trace(tmp_path: Path) -> None:
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "prefill0-1.jsonl").write_text(
        '{"transfer_id": "t1", "event": "kv_ready", "t": 1.0}\n'
        '{"transfer_id": "t1", "event": "write_posted", "t": 1.5, "num_descs": 16,'
        ' "num_runs": 2, "num_blocks": 6, "num_layers": 8, "num_bytes": 1}\n'
    )
    assert read_traced_writes(tmp_path) == [TracedWrite("t1", 1.5, 16)]
    assert read_traced_writes(tmp_path / "none") == []


def record(sent_wall: float, token_times: list[float]) -> RequestRecord:
    return RequestRecord(
        config="x", point=-2, index=0, bench_id="kvb-bg-0", prompt_len=64,
        output_len=512, scheduled_s=0.0, sent_wall=sent_wall,
        token_times_s=token_times,
    )  # fmt: skip


def test_decoding_meanwhile_counts_only_the_tokens_inside_the_window() -> None:
    steady = record(100.0, [0.1 * i for i in range(1, 200)])  # 100.1 .. 119.9
    stalled = record(105.0, [1.0, 1.01, 1.02, 1.52, 1.53])  # one 500 ms stall
    before = record(50.0, [1.0, 2.0])  # ended before the window
    m = meanwhile([steady, stalled, before], (106.0, 110.0))
    assert m is not None and m.num_requests == 2
    assert m.tpot_ms is not None and m.itl_ms is not None
    assert m.tpot_ms.min == pytest.approx(100.0)  # steady: 100 ms a token
    assert m.tpot_ms.max == pytest.approx(132.5)  # stalled: 530 ms over 4 gaps
    assert m.itl_ms.max == pytest.approx(500.0)  # the stall itself
    assert meanwhile([before], (106.0, 110.0)) is None


def test_a_point_takes_telemetry_where_there_is_some_else_the_traces() -> None:
    telemetry = NixlTransfers(num_descs=histogram({100: 2}, 150.0))
    writes = [TracedWrite("a", 1.0, 8)]
    vllm = fragment_point((NixlTransfers(), telemetry), writes, None, (0.0, 2.0))
    assert vllm.transfers is not None and vllm.transfers.source == "NIXL telemetry"
    assert vllm.meanwhile is None  # no background
    kvpush = fragment_point((None, None), writes, [], (0.0, 2.0))
    assert kvpush.transfers is not None and kvpush.transfers.source == "kvpush trace"


# -- the report ---------------------------------------------------------------------


def fragmented_summary() -> BenchSummary:
    """vllm-pull's meanwhile TPOT rises after the churn, kvpush's does not."""
    base = sweep_summary()
    points = [
        msgspec.structs.replace(base.points[i], label=label, axis="cache", x=float(i))
        for i, label in enumerate(("fresh cache", "after churn"))
    ]

    def point(i: int, descs: float, tpot: float, source: str) -> PointResult:
        transfers = TransferDescs(
            source=source, num_transfers=4, descs_mean=descs,
            descs_p50=descs if source == "kvpush trace" else None,
            descs_p50_range=(400.0, 1000.0) if source != "kvpush trace" else None,
            descs_max=descs, post_mean_ms=0.8 if source != "kvpush trace" else None,
        )  # fmt: skip
        during = Meanwhile(num_requests=2, tpot_ms=dist(tpot), itl_ms=dist(tpot))
        return PointResult(
            point=i, stats=stats(300.0, 10.0),
            fragment=FragmentPoint(transfers=transfers, meanwhile=during),
        )  # fmt: skip

    configs = [
        ConfigResult(
            name="vllm-pull", status="ok",
            points=[point(0, 1000, 10.0, "t"), point(1, 1000, 14.0, "t")],
            churn=churn_result([record(1.0, [0.1]), record(2.0, [])]),
        ),
        ConfigResult(
            name="kvpush", status="ok",
            points=[point(0, 8, 9.0, TRACE), point(1, 640, 9.0, TRACE)],
        ),
    ]  # fmt: skip
    settings = {**base.settings, "workload": "fragmented", "block_size": 32,
                "churn_requests": 64, "churn_abort_fraction": 0.33}  # fmt: skip
    return msgspec.structs.replace(
        base, points=points, configs=configs, settings=settings
    )


def test_the_report_gives_descriptors_and_decoding_meanwhile() -> None:
    report = render_report(fragmented_summary())
    assert "## Fragmented KV: descriptors per transfer and decoding meanwhile" in report
    assert "| kvpush | after churn | 4 | 640 | 640 | 640 |" in report
    assert "| +632 (+7900%) |" in report  # descriptors: a count
    assert "| vllm-pull | fresh cache | 4 | 1000 | (400, 1000] | 1000 |" in report
    assert "| vllm-pull | +4.00 (+40%) |" in report
    assert "| kvpush | +0.00 (+0%) |" in report
    assert "target" not in report.lower()  # targets live in the docs
    assert "block size 32" in report and "fragmented: " in report
    assert "| vllm-pull | 2 | 2 | 0 | 0 |" in report  # the churn's outcome


def test_other_workloads_have_no_fragmented_sections() -> None:
    assert "Fragmented KV" not in render_report(sweep_summary())


# -- a run on fake clusters ------------------------------------------------------------


def test_a_fragmented_run_measures_both_points_around_the_churn(
    launcher: FakeLauncher, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    argv = [
        "bench", "--workload", "fragmented", "--configs", "colocated,vllm-push",
        "--model-preset", "tiny", "--prompt-len", "64", "--output-len", "4",
        "--num-requests", "3", "--num-warmup", "1", "--churn-requests", "6",
        "--churn-concurrency", "3", "--churn-prompt-len", "16-64",
        "--churn-output-len", "2-6", "--churn-abort-fraction", "0.5",
        "--background-concurrency", "1", "--background-output-len", "40",
        "--output", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    summary = load_summary(out)
    assert [p.label for p in summary.points] == ["fresh cache", "after churn"]
    for name in ("colocated", "vllm-push"):
        config = summary.config(name)
        assert config is not None and config.churn is not None
        assert config.churn.num_requests == 6 and config.churn.num_aborted == 3
        assert config.churn.num_failed == 0
        for p in (0, 1):
            result = config.point(p)
            assert result is not None and result.stats.num_ok == 3
            assert result.fragment is not None
    churned = read_records(out / "churn.jsonl")
    assert len(churned) == 12 and {r.point for r in churned} == {CHURN_POINT}
    requests = read_records(out / "requests.jsonl")
    assert sorted({r.point for r in requests}) == [0, 1]
    report = (out / "report.md").read_text()
    assert "## Fragmented KV: the churn" in report
    assert "## after churn" in report
