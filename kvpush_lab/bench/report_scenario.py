"""The report's parts for the skewed, multi-turn and fragmented workloads:
what was sent, how kvpush's routers bound it, and what the background load
did. Pure rendering of a :class:`BenchSummary` (nothing for the sweep)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvpush.telemetry import names
from kvpush_lab.bench.bindings import describe_counts, describe_share
from kvpush_lab.bench.report_fragment import workload_line as fragmented_line
from kvpush_lab.bench.report_saturation import workload_line as saturation_line
from kvpush_lab.bench.summary import BenchSummary

Table = Callable[[Sequence[str], Sequence[Sequence[str]]], str]
WORDS_PER_TOKEN = 0.75  # about, for English text


def workload_line(s: dict[str, Any]) -> str | None:
    """Setup's workload line for a scenario (None for the sweep)."""
    workload = s.get("workload", "sweep")
    if workload == "fragmented":
        return fragmented_line(s)
    if workload == "saturation":
        return saturation_line(s)
    if workload == "skewed":
        return (
            f"skewed: the sweep below through the router, while "
            f"{s.get('background_concurrency')} plain requests "
            f"({s.get('background_prompt_len')}-token prompts, "
            f"{s.get('background_output_len')} output tokens, ignore_eos) are "
            f"kept in flight straight to decode{s.get('background_decode')}'s own "
            "server, bypassing the router (colocated: to its one instance, the "
            f"same load on the only engine it has). Foreground: "
            f"{s.get('num_requests')} requests per point, prompts "
            f"{s.get('prompt_len')} tokens, outputs {s.get('output_len')} tokens "
            f"(ignore_eos); seed {s.get('seed')}; {s.get('num_warmup')} warm-up "
            "requests per configuration, excluded"
        )
    if workload == "multi-turn":
        turn_len = int(s.get("turn_len") or 0)
        return (
            f"multi-turn: {s.get('num_conversations')} conversations of "
            f"{s.get('num_turns')} turns, {s.get('conversation_concurrency')} at a "
            "time, each turn sent when the last answer ended, with "
            "`x-session-id: conv-<i>`; turn 1's prompt is "
            f"{s.get('history_len')} random token ids, each later turn's prompt "
            f"the last one + its answer (the generated token ids) + {turn_len} "
            f"new tokens (about {round(turn_len * WORDS_PER_TOKEN)} words); answers "
            f"{s.get('output_len')} tokens (ignore_eos); seed {s.get('seed')}; "
            f"{s.get('num_warmup')} single warm-up requests per configuration, "
            "excluded. **turn 1**: every conversation's first turn; **turns 2+**: "
            "all later turns"
        )
    return None


def scenario_sections(summary: BenchSummary, table: Table) -> list[str]:
    """Sharing note, binding mix and background load (none for the sweep)."""
    if summary.settings.get("workload", "sweep") == "sweep":
        return []
    return [_sharing(summary), _bindings(summary, table), _background(summary, table)]


def _sharing(summary: BenchSummary) -> str:
    shared = [c.name for c in summary.configs if c.shared_cluster]
    if not shared:
        return ""
    return (
        f"{', '.join(shared)} ran one after another on one kvpush cluster, "
        f"started once: {shared[0]} through the launcher's router, each other "
        "through a router of its own over the same topology (`kvpush router "
        "--topology RUN_DIR/topology.json --binding B`). Every configuration's "
        "token ids are a draw of its own (same lengths, arrivals and turns), so "
        "no run hits a prefix cache an earlier one filled. Their server "
        "timelines mix runs and are left out."
    )


def _bindings(summary: BenchSummary, table: Table) -> str:
    rows = []
    for config in summary.configs:
        if config.status != "ok":
            continue
        for info in summary.points:
            result = config.point(info.index)
            mix = result.bindings if result is not None else None
            rows.append([
                config.label, info.label,
                describe_share(mix.bindings) if mix else "–",
                describe_share(mix.decodes) if mix else "–",
            ])  # fmt: skip
        counts = config.binding_counts
        if counts:
            rows.append([config.label, "router counter", describe_counts(counts), ""])
    if not rows:
        return ""
    header = ["config", "point", "requests by binding", "by decode"]
    return (
        "## Binding mix\n\nPer request, from kvpush's response headers "
        "(`x-kvpush-binding`, `x-kvpush-decode`; the baselines' router sends "
        f"none: –); then the router's `{names.ROUTER_BINDING.total}{{binding,"
        "reason}` gained over the measured run (every attempt, retries "
        "included, with its reason).\n\n" + table(header, rows)
    )


def _background(summary: BenchSummary, table: Table) -> str:
    rows = []
    for config in summary.configs:
        bg = config.background
        if bg is None:
            continue
        tpot = "–" if bg.tpot_ms is None else f"{bg.tpot_ms.p50:.1f}"
        rows.append([config.label, bg.target, f"{bg.num_ok} / {bg.num_requests}", tpot])
    if not rows:
        return ""
    header = ["config", "busy instance", "ok / ended", "TPOT p50 ms"]
    return (
        "## Background load\n\nThe background requests that ended during each "
        "configuration's measured run (those still in flight at its end were "
        "cancelled).\n\n" + table(header, rows)
    )
