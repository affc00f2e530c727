"""The xPyD workloads of ``kvpush bench``: configuration names for kvpush's
bindings, the skewed workload's background load, multi-turn conversations
(seeded, deterministic), the binding mix from router metrics and response
headers, and the report's parts for both."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from kvpush.launcher.state import ProcessRecord
from kvpush_lab.bench import background, conversation
from kvpush_lab.bench import config as config_module
from kvpush_lab.bench.bindings import (
    BindingMix,
    count_delta,
    describe_counts,
    header_mix,
    parse_counts,
)
from kvpush_lab.bench.clusters import Run, share_runs
from kvpush_lab.bench.config import BenchConfig, cluster_of, make_config
from kvpush_lab.bench.report import render_report
from kvpush_lab.bench.runner import cluster_config
from kvpush_lab.bench.scenario import plan_requests, salt_of
from kvpush_lab.bench.stats import Dist, PointStats
from kvpush_lab.bench.summary import (
    BackgroundResult,
    BenchSummary,
    ConfigResult,
    PointInfo,
    PointResult,
)
from kvpush_lab.bench.workload import Traces

VOCAB = list(range(3, 500))
SKEWED = {"workload": "skewed", "num_prefill": 2, "num_decode": 2}
MULTI = {"workload": "multi-turn", "num_turns": 3, "num_conversations": 2}


# -- configuration names ------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cluster"),
    [
        ("kvpush", ("kvpush", None)),
        ("kvpush-auto", ("kvpush", "auto")),
        ("kvpush-early", ("kvpush", "early")),
        ("kvpush-skip", ("kvpush", "skip")),
        ("vllm-pull", ("vllm-pull", None)),
    ],
)
def test_a_kvpush_binding_name_is_kvpush_with_that_router_binding(
    name: str, cluster: tuple[str, str | None]
) -> None:
    assert cluster_of(name) == cluster
    config = BenchConfig(configs=(name,), num_prefill=2, num_decode=2)
    made = cluster_config(config, name, Path("/m"), Path("/r"))
    assert (made.mode, made.binding) == cluster


def test_kvpush_first_token_decode_runs_kvpush_with_decodes_first_token() -> None:
    name = "kvpush-first-token-decode"
    assert cluster_of(name) == ("kvpush", None)
    config = BenchConfig(configs=("kvpush", name))
    made = cluster_config(config, name, Path("/m"), Path("/r"))
    assert (made.mode, made.first_token_from) == ("kvpush", "decode")
    default = cluster_config(config, "kvpush", Path("/m"), Path("/r"))
    assert default.first_token_from is None
    late = "kvpush-late-first-token-decode"
    made = cluster_config(BenchConfig(configs=(late,)), late, Path("/m"), Path("/r"))
    assert (made.binding, made.first_token_from) == ("late", "decode")


def test_unknown_names_and_unsupported_bindings_say_what_to_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match=r"unknown configs.*kvpush-auto"):
        BenchConfig(configs=("kvpush-fast",))

    def refuse(policy: str) -> None:
        if policy == "late":
            raise ValueError("--binding late is not yet supported")

    monkeypatch.setattr(config_module, "check_policy", refuse)
    with pytest.raises(ValueError, match=r"configuration kvpush-late: .*late"):
        BenchConfig(configs=("kvpush-late",))
    assert BenchConfig(configs=("kvpush-early",)).configs == ("kvpush-early",)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"workload": "bursty"}, "workload must be one of"),
        ({"workload": "skewed"}, "--decode 2 or more"),
        ({**SKEWED, "background_decode": 2}, "background_decode must name"),
        ({**SKEWED, "background_concurrency": 0}, "background_concurrency"),
        ({**SKEWED, "background_output_len": 4096}, "max_model_len"),
        ({**MULTI, "num_turns": 1}, "num_turns must be at least 2"),
        ({**MULTI, "history_len": 3900}, "last turn's prompt"),
        ({**MULTI, "output_len": "trace:x.jsonl"}, "not a trace"),
        ({**SKEWED, "port": 28099, "base_http_port": 28100}, "collide"),
    ],
)
def test_bad_workload_settings_say_what_to_change(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        BenchConfig(**values)


def test_the_workload_flags_are_config_fields() -> None:
    config = make_config(
        {"workload": "multi-turn", "num_turns": 4, "share_kvpush_cluster": False}
    )
    assert config.workload == "multi-turn" and not config.shares_kvpush_cluster
    assert BenchConfig(**SKEWED).shares_kvpush_cluster  # scenarios share by default
    assert not BenchConfig().shares_kvpush_cluster  # the sweep does not


def test_kvpush_runs_share_one_cluster_with_routers_of_their_own() -> None:
    config = BenchConfig(
        **SKEWED, configs=("colocated", "kvpush-auto", "vllm-pull", "kvpush-early")
    )
    runs = [
        Run(n, None, cluster_config(config, n, Path("/m"), Path(f"/r/{n}")))
        for n in config.configs
    ]
    shared = {r.name: r for r in share_runs(runs, Path("/r/shared"))}
    assert not shared["colocated"].is_shared and not shared["vllm-pull"].is_shared
    assert shared["kvpush-auto"].router_port is None  # the launcher's router
    assert shared["kvpush-early"].router_port == config.port + 1
    assert shared["kvpush-early"].run_dir == Path("/r/shared")
    assert shared["kvpush-early"].cluster.binding == "early"


# -- background load ----------------------------------------------------------


def test_background_requests_are_long_plain_and_seeded() -> None:
    config = BenchConfig(**SKEWED, background_output_len=600)
    load = background.BackgroundLoad.of(config, "kvpush-auto")
    first = list(itertools.islice(background.background_requests(load, VOCAB), 5))
    again = list(itertools.islice(background.background_requests(load, VOCAB), 5))
    assert first == again
    assert all(r.output_len == 600 and r.prompt_len == 64 for r in first)
    assert len({r.prompt for r in first}) == 5  # no prefix hits among them
    body = first[0].body()
    assert body["ignore_eos"] is True and "kv_transfer_params" not in body
    other = background.BackgroundLoad.of(config, "colocated")
    assert next(background.background_requests(other, VOCAB)).prompt != first[0].prompt


def test_background_goes_to_the_named_decode_or_the_colocated_instance() -> None:
    def proc(name: str, role: str) -> ProcessRecord:
        return ProcessRecord(name=name, role=role, pid=1, url=f"u-{name}", log_path="")

    pd = [
        proc("router", "router"),
        proc("decode1", "decode"),
        proc("decode0", "decode"),
    ]
    load = background.BackgroundLoad.of(BenchConfig(**SKEWED, background_decode=1))
    assert background.target(load, pd).name == "decode1"
    colocated = [proc("router", "router"), proc("colocated", "colocated")]
    assert background.target(load, colocated).name == "colocated"


# -- conversations ------------------------------------------------------------


def test_each_turn_extends_the_last_prompt_with_its_answer_and_a_new_message() -> None:
    config = BenchConfig(**MULTI, history_len=100, turn_len=20, output_len="8")
    conv = conversation.build_conversations(config, VOCAB)[1]
    assert conv.session == "conv-1" and conv.num_turns == 3
    first = conv.request(1, conv.history)
    assert first.prompt_len == 100 and first.wants_token_ids
    answer = [7] * 8
    prompt2 = conv.prompt_after(1, first.prompt, answer)
    assert prompt2 == (*conv.history, *answer, *conv.user_messages[0])
    second = conv.request(2, prompt2)
    assert second.prompt_len == 128 and second.session == "conv-1"
    last = conv.request(3, conv.prompt_after(2, prompt2, answer))
    assert last.prompt_len == 156 and not last.wants_token_ids
    assert [conversation.point_of(r) for r in (first, second, last)] == [0, 1, 1]
    with pytest.raises(ValueError, match="turn 4"):
        conv.request(4, ())


def test_conversations_are_seeded_and_a_salt_changes_only_the_tokens() -> None:
    config = BenchConfig(**MULTI, output_len="8-16")
    same = conversation.build_conversations(config, VOCAB)
    assert same == conversation.build_conversations(config, VOCAB)
    salted = conversation.build_conversations(config, VOCAB, "kvpush-auto")
    assert [c.history for c in salted] != [c.history for c in same]
    assert [c.output_lens for c in salted] == [c.output_lens for c in same]
    assert [len(c.history) for c in salted] == [1200, 1200]
    histories = [c.history for c in same]
    assert len(set(histories)) == 2  # conversations share nothing


def test_turn_ids_are_unique_within_each_point() -> None:
    config = BenchConfig(**{**MULTI, "num_conversations": 3, "num_turns": 4})
    convs = conversation.build_conversations(config, VOCAB)
    specs = [c.request(t, ()) for c in convs for t in range(1, 5)]
    by_point: dict[int, list[int]] = {0: [], 1: []}
    for spec in specs:
        by_point[conversation.point_of(spec)].append(spec.index)
    assert sorted(by_point[0]) == [0, 1, 2]
    assert sorted(by_point[1]) == list(range(9))
    first, later = conversation.turn_points(config)
    assert (first.num_requests, later.num_requests) == (3, 9)
    assert (first.point.label, later.point.label) == ("turn 1", "turns 2+")


def test_shared_clusters_give_every_configuration_its_own_draw() -> None:
    config = BenchConfig(**SKEWED, qps=(2.0,), num_requests=3)
    assert salt_of(config, "kvpush-auto") == "kvpush-auto"
    auto = plan_requests(config, "kvpush-auto", VOCAB, Traces()).points[0]
    early = plan_requests(config, "kvpush-early", VOCAB, Traces()).points[0]
    assert [r.prompt for r in auto.requests] != [r.prompt for r in early.requests]
    assert [r.arrival_s for r in auto.requests] == [r.arrival_s for r in early.requests]
    sweep = BenchConfig(qps=(2.0,), num_requests=3)
    a = plan_requests(sweep, "kvpush", VOCAB, Traces()).points[0]
    b = plan_requests(sweep, "colocated", VOCAB, Traces()).points[0]
    assert a == b  # fresh clusters: the very same requests


# -- binding mix --------------------------------------------------------------

METRICS = """\
# HELP kvpush_router_binding_total kvpush mode: binding of each attempt.
# TYPE kvpush_router_binding_total counter
kvpush_router_binding_total{mode="kvpush",binding="early",reason="new_tokens"} 5.0
kvpush_router_binding_total{mode="kvpush",binding="skip",reason="few_new_tokens"} 3.0
kvpush_router_binding_total{mode="kvpush",binding="skip",reason="prefix_held"} 1.0
# HELP kvpush_router_requests_total requests
# TYPE kvpush_router_requests_total counter
kvpush_router_requests_total{mode="kvpush"} 9.0
"""


def test_the_binding_counter_is_read_per_binding_and_reason() -> None:
    counts = parse_counts(METRICS)
    assert counts == {
        "early/new_tokens": 5,
        "skip/few_new_tokens": 3,
        "skip/prefix_held": 1,
    }
    before = {"early/new_tokens": 2, "skip/prefix_held": 1}
    delta = count_delta(before, counts)
    assert delta == {"early/new_tokens": 3, "skip/few_new_tokens": 3}
    assert describe_counts(delta) == "early 3 (new_tokens 3), skip 3 (few_new_tokens 3)"
    assert parse_counts("# TYPE kvpush_router_binding_total counter\n") == {}


def test_headers_give_the_mix_per_request() -> None:
    mix = header_mix(
        [("early", "decode1"), ("skip", "decode0"), ("early", "decode1"), (None, None)]
    )
    assert mix.bindings == {"early": 2, "none": 1, "skip": 1}
    assert mix.decodes == {"decode0": 1, "decode1": 2}
    assert header_mix([(None, None)]).is_empty


# -- report -------------------------------------------------------------------


def _dist(value: float) -> Dist:
    return Dist(
        n=4, mean=value, p50=value, p90=value, p99=2 * value, min=value, max=value
    )


def _stats(ttft: float) -> PointStats:
    return PointStats(
        num_requests=4,
        num_ok=4,
        num_errors=0,
        errors={},
        num_short_output=0,
        duration_s=2.0,
        request_throughput=2.0,
        output_throughput=64.0,
        total_token_throughput=2000.0,
        ttft_ms=_dist(ttft),
        tpot_ms=_dist(3.0),
        itl_ms=_dist(3.0),
        e2e_ms=_dist(ttft + 93.0),
    )


def _summary(workload: str) -> BenchSummary:
    early = BindingMix(bindings={"early": 4}, decodes={"decode1": 4})
    labels = ["turn 1", "turns 2+"] if workload == "multi-turn" else ["qps 2"]
    points = [
        PointInfo(
            index=i,
            label=label,
            axis="turn",
            x=i + 1.0,
            arrival="conversation",
            load=2.0,
            prompt_len="1200",
            num_requests=4,
        )
        for i, label in enumerate(labels)
    ]
    bg = BackgroundResult(
        target="decode0", num_requests=3, num_ok=3, tpot_ms=_dist(9.0)
    )
    return BenchSummary(
        command=f"kvpush bench --workload {workload}",
        started_at="2026-01-01T00:00:00+00:00",
        settings={
            "workload": workload,
            "num_conversations": 4,
            "num_turns": 6,
            "conversation_concurrency": 2,
            "history_len": 1200,
            "turn_len": 130,
            "output_len": "32",
            "background_concurrency": 2,
            "background_prompt_len": 64,
            "background_output_len": 512,
            "background_decode": 0,
        },
        points=points,
        configs=[
            ConfigResult(
                name="colocated",
                status="ok",
                points=[PointResult(point=p.index, stats=_stats(30.0)) for p in points],
                background=bg if workload == "skewed" else None,
            ),
            ConfigResult(
                name="kvpush-early",
                status="ok",
                shared_cluster=True,
                points=[
                    PointResult(point=p.index, stats=_stats(40.0), bindings=early)
                    for p in points
                ],
                binding_counts={"early/forced": 8},
                background=bg if workload == "skewed" else None,
            ),
        ],
    )


def test_the_multi_turn_report_describes_turns_and_the_binding_mix() -> None:
    text = render_report(_summary("multi-turn"))
    assert "multi-turn: 4 conversations of 6 turns, 2 at a time" in text
    assert "about 98 words" in text
    assert "| turn 1 | 30.0 / 60.0, 3.0 | 40.0 / 80.0, 3.0 |" in text
    assert "| turns 2+ | 30.0 / 60.0, 3.0 | 40.0 / 80.0, 3.0 |" in text
    section = text.split("## Binding mix")[1].split("\n## ")[0]
    assert "| kvpush-early | turns 2+ | early 4 | decode1 4 |" in section
    assert "| colocated | turn 1 | – | – |" in section
    assert "| kvpush-early | router counter | early 8 (forced 8) |" in section
    assert "kvpush-early ran one after another on one kvpush cluster" in text
    assert "## Background load" not in text


def test_the_skewed_report_shows_the_background_load() -> None:
    text = render_report(_summary("skewed"))
    assert "kept in flight straight to decode0's own server" in text
    section = text.split("## Background load")[1].split("\n## ")[0]
    assert "| colocated | decode0 | 3 / 3 | 9.0 |" in section


def test_the_sweep_report_has_no_scenario_parts() -> None:
    summary = _summary("skewed")
    summary.settings["workload"] = "sweep"
    text = render_report(summary)
    assert "## Binding mix" not in text and "## Background load" not in text
