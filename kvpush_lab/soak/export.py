"""The soak as a published section: ``docs/bench/soak/results.json``. Pure."""

from __future__ import annotations

from kvpush_lab.bench.results import (
    Measurement,
    Metrics,
    SectionResults,
    Setup,
    Table,
)
from kvpush_lab.bench.stats import Dist
from kvpush_lab.soak.report import (
    KV_HEADER,
    OUTCOME_HEADER,
    SOAK_DEFINITIONS,
    SoakSummary,
    counters_text,
    examples,
    kv_note,
    kv_rows,
    outcome_row,
    setup_text,
    verdict,
)

SECTION = "soak"
POINT = "soak"


def _pct(dist: Dist | None, name: str) -> float | None:
    return None if dist is None else float(getattr(dist, name))


def soak_results(summary: SoakSummary) -> SectionResults:
    """The soak's section: its verdict, its outcomes and latencies, each
    instance's settled KV, the connector counters."""
    run, mode = summary.run, str(summary.run.settings.get("mode", "kvpush"))
    shown = examples(summary)
    outcome = Table(
        title="Outcomes",
        columns=OUTCOME_HEADER,
        rows=[outcome_row(summary)],
        note="Latencies of completed requests, in ms.",
        after="Examples: " + "; ".join(f"`{e}`" for e in shown) if shown else None,
    )
    kv = Table(
        title="KV once settled",
        columns=KV_HEADER,
        rows=kv_rows(summary),
        note=kv_note(summary),
    )
    metrics = Metrics(
        num_requests=summary.num_requests,
        num_ok=summary.counts.get("completed", 0),
        ttft_p50_ms=_pct(summary.ttft_ms, "p50"),
        ttft_p99_ms=_pct(summary.ttft_ms, "p99"),
        e2e_p50_ms=_pct(summary.e2e_ms, "p50"),
        e2e_p99_ms=_pct(summary.e2e_ms, "p99"),
    )
    return SectionResults(
        section=SECTION,
        title="Soak",
        kind="soak",
        source="python -m kvpush_lab.soak run",
        command=run.command,
        started_at=run.started_at,
        commit=run.versions.get("kvpush_commit"),
        setup=Setup(
            versions=", ".join(f"{k} {v}" for k, v in run.versions.items()),
            workload=setup_text(summary).removesuffix(" Command:"),
        ),
        configs=[mode],
        points=[POINT],
        measurements=[
            Measurement(round=None, point=POINT, config=mode, metrics=metrics)
        ],
        tables=[outcome, kv],
        notes=[verdict(summary), counters_text(summary.counters), SOAK_DEFINITIONS],
    )
