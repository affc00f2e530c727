"""Workload generation: exact token counts, reproducibility, arrivals."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from random import Random

import pytest

from kvpush_lab.bench.config import BenchConfig
from kvpush_lab.bench.lengths import LengthSpec, read_trace
from kvpush_lab.bench.workload import (
    PointWorkload,
    Traces,
    build_point,
    build_warmup,
    check_fits,
    make_prompts,
    poisson_offsets,
    sweep_points,
)

VOCAB = list(range(3, 4096))  # ids 0-2 are special in the tiny model


NO_TRACES = Traces()


def build_all(config: BenchConfig, traces: Traces = NO_TRACES) -> list[PointWorkload]:
    return [build_point(config, p, VOCAB, traces) for p in sweep_points(config)]


# -- lengths -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("1000", LengthSpec("fixed", 1000, 1000)),
        ("500-1500", LengthSpec("uniform", 500, 1500)),
        ("uniform:8-8", LengthSpec("uniform", 8, 8)),
        ("trace:lens.jsonl", LengthSpec("trace", path=Path("lens.jsonl"))),
    ],
)
def test_length_specs_parse(text: str, spec: LengthSpec) -> None:
    assert LengthSpec.parse(text) == spec


@pytest.mark.parametrize("text", ["", "abc", "0", "9-3", "1-2-3", "trace:", "fixed:4"])
def test_bad_length_specs_say_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError, match=r"length|trace"):
        LengthSpec.parse(text)


def test_uniform_lengths_stay_in_range_and_trace_replays_in_order() -> None:
    values = LengthSpec.parse("10-20").sample(500, Random(1))
    assert min(values) == 10 and max(values) == 20
    trace = LengthSpec.parse("trace:x.jsonl")
    assert trace.sample(5, Random(1), [7, 8, 9]) == [7, 8, 9, 7, 8]


def test_trace_files_give_each_key(tmp_path: Path) -> None:
    path = tmp_path / "lens.jsonl"
    rows = [{"prompt_len": 100, "output_len": 5}, {"prompt_len": 300, "output_len": 9}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert read_trace(path, "prompt_len") == [100, 300]
    assert read_trace(path, "output_len") == [5, 9]
    path.write_text('{"prompt_len": "many"}\n')
    with pytest.raises(ValueError, match=r"lens.jsonl:1"):
        read_trace(path, "prompt_len")


# -- prompts -------------------------------------------------------------------


def test_prompts_have_exact_lengths_from_the_normal_vocabulary() -> None:
    config = BenchConfig(prompt_len="50-300", output_len="1-16", num_requests=30)
    for workload in build_all(config):
        for req in workload.requests:
            assert len(req.prompt) == req.prompt_len
            assert set(req.prompt) <= set(VOCAB)
            assert 50 <= req.prompt_len <= 300 and 1 <= req.output_len <= 16
            body = req.body()
            assert body["prompt"] == list(req.prompt)
            assert body["max_tokens"] == req.output_len and body["ignore_eos"]
            assert body["stream"] and body["stream_options"] == {"include_usage": True}


def test_same_seed_same_workload_other_seed_other_prompts() -> None:
    config = BenchConfig(prompt_len="100-200", num_requests=10)
    assert build_all(config) == build_all(config)
    other = build_all(BenchConfig(prompt_len="100-200", num_requests=10, seed=1))
    assert [r.prompt for r in other[0].requests] != [
        r.prompt for r in build_all(config)[0].requests
    ]


def test_changing_output_lengths_leaves_prompts_and_arrivals_alone() -> None:
    a = build_all(BenchConfig(num_requests=10, output_len="32"))[0]
    b = build_all(BenchConfig(num_requests=10, output_len="4-64"))[0]
    assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests]
    assert [r.arrival_s for r in a.requests] == [r.arrival_s for r in b.requests]


def test_points_and_warmup_never_share_prompts() -> None:
    config = BenchConfig(prompt_len="64", num_requests=8, num_warmup=4)
    points = build_all(config)
    warmup = build_warmup(config, points, VOCAB)
    prompts = [r.prompt for w in [*points, warmup] for r in w.requests]
    assert len(set(prompts)) == len(prompts)
    assert [r.bench_id for r in warmup.requests] == [f"kvb-w-{i}" for i in range(4)]
    assert all(len(r.prompt) == 64 for r in warmup.requests)


def test_shared_prefix_is_common_to_every_prompt_of_a_point() -> None:
    prompts = make_prompts([100, 200, 40], VOCAB, 0.5, Random(3))
    assert [len(p) for p in prompts] == [100, 200, 40]
    assert prompts[0][:50] == prompts[1][:50]
    assert prompts[1][:20] == prompts[2][:20]
    assert prompts[0][50:] != prompts[1][50:100]


def test_bench_ids_name_point_and_index() -> None:
    points = build_all(BenchConfig(qps=(1, 2), num_requests=3))
    assert [r.bench_id for r in points[1].requests] == ["kvb-1-0", "kvb-1-1", "kvb-1-2"]


# -- arrivals and sweeps -------------------------------------------------------


def test_poisson_arrivals_have_the_asked_mean_rate() -> None:
    offsets = poisson_offsets(5000, 4.0, Random(7))
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.1)  # exponential


def test_concurrency_points_send_without_a_schedule() -> None:
    config = BenchConfig(arrival="concurrency", concurrency=(1, 4), num_requests=5)
    points = build_all(config)
    assert [p.point.label for p in points] == ["concurrency 1", "concurrency 4"]
    assert all(r.arrival_s == 0.0 for p in points for r in p.requests)
    assert points[1].point.concurrency == 4


def test_prompt_length_sweep_fixes_each_points_length() -> None:
    config = BenchConfig(qps=(2,), prompt_len_sweep=(128, 512), num_requests=3)
    points = build_all(config)
    assert [p.point.axis for p in points] == ["prompt_len", "prompt_len"]
    assert [p.point.x for p in points] == [128, 512]
    assert {r.prompt_len for r in points[1].requests} == {512}
    assert points[0].point.load == 2.0


def test_traced_lengths_that_do_not_fit_are_refused() -> None:
    config = BenchConfig(prompt_len="trace:t.jsonl", output_len="8", num_requests=2)
    points = build_all(config, Traces(prompt_lens=(100, 5000)))
    with pytest.raises(ValueError, match=r"kvb-0-1.*max_model_len"):
        check_fits(points, config.max_model_len)
