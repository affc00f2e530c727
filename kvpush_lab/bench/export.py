"""A ``kvpush bench`` run as a :class:`SectionResults`: pure.

Each configuration's :class:`PointStats` becomes a :class:`Measurement` per
point and round; every configuration's figures over each reference's
(colocated and vLLM's two connectors), taken within each round, become
:class:`Ratio` spreads over the rounds; the run's whole summary rides
along as ``run``, from which the section's details page is rendered.
"""

from __future__ import annotations

from kvpush_lab.bench.report import plot_list, setup_fields
from kvpush_lab.bench.report_rounds import FIGURES, Getter, per_round, stat_of
from kvpush_lab.bench.results import (
    Measurement,
    Metrics,
    Plot,
    Ratio,
    SectionResults,
    Setup,
    side_of,
)
from kvpush_lab.bench.rounds import ratio_spread
from kvpush_lab.bench.stats import Dist, PointStats
from kvpush_lab.bench.summary import BenchSummary, rate

SOURCE = "kvpush bench run"
REFERENCES = ("colocated", "vllm-pull", "vllm-push")
# the ratios' figures: the rounds report's, and ITL and output throughput
RATIO_FIGURES: tuple[tuple[str, Getter], ...] = (
    *FIGURES,
    ("ITL p50", stat_of("itl_ms", "p50")),
    ("ITL p99", stat_of("itl_ms", "p99")),
)


def point_label(link_gbit: float | None, label: str) -> str:
    """A point as the reports name it: with the link rate on a rehearsal."""
    return label if link_gbit is None else f"{rate(link_gbit)}, {label}"


def metrics_of(st: PointStats) -> Metrics:
    def pct(dist: Dist | None, name: str) -> float | None:
        return None if dist is None else float(getattr(dist, name))

    return Metrics(
        num_requests=st.num_requests,
        num_ok=st.num_ok,
        errors=dict(st.errors),
        ttft_p50_ms=pct(st.ttft_ms, "p50"),
        ttft_p90_ms=pct(st.ttft_ms, "p90"),
        ttft_p99_ms=pct(st.ttft_ms, "p99"),
        ttft_mean_ms=pct(st.ttft_ms, "mean"),
        ttst_p50_ms=pct(st.ttst_ms, "p50"),
        ttst_p99_ms=pct(st.ttst_ms, "p99"),
        tpot_p50_ms=pct(st.tpot_ms, "p50"),
        tpot_p99_ms=pct(st.tpot_ms, "p99"),
        itl_p50_ms=pct(st.itl_ms, "p50"),
        itl_p99_ms=pct(st.itl_ms, "p99"),
        e2e_p50_ms=pct(st.e2e_ms, "p50"),
        e2e_p99_ms=pct(st.e2e_ms, "p99"),
        request_throughput=st.request_throughput,
        output_throughput=st.output_throughput,
    )


def measurements_of(summary: BenchSummary) -> list[Measurement]:
    labels = {p.index: p.label for p in summary.points}
    return [
        Measurement(
            round=c.round,
            point=point_label(c.link_gbit, labels.get(p.point, str(p.point))),
            config=c.name,
            metrics=metrics_of(p.stats),
        )
        for c in summary.configs
        if c.status == "ok"
        for p in c.points
    ]


def _names(summary: BenchSummary, link: float | None) -> list[str]:
    return list(dict.fromkeys(
        c.name for c in summary.configs if c.link_gbit == link and c.status == "ok"
    ))  # fmt: skip


def ratios_of(summary: BenchSummary) -> list[Ratio]:
    """Every configuration's figures over each reference's that ran beside
    it, per round, as spreads over the rounds."""
    out = []
    for link in summary.link_rates:
        names = _names(summary, link)
        for info in summary.points:
            for ref in (r for r in REFERENCES if r in names):
                base = {
                    figure: per_round(summary, get, ref, link, info.index)
                    for figure, get in RATIO_FIGURES
                }
                for name in (n for n in names if n != ref):
                    for figure, get in RATIO_FIGURES:
                        mine = per_round(summary, get, name, link, info.index)
                        spread = ratio_spread(mine, base[figure])
                        if spread is None:
                            continue
                        out.append(Ratio(
                            point=point_label(link, info.label), config=name,
                            figure=figure, reference=ref, spread=spread,
                            side=side_of(spread) if spread.n > 1 else 0,
                        ))  # fmt: skip
    return out


def results_of_run(
    summary: BenchSummary,
    section: str,
    title: str,
    plot_files: list[str] | None = None,
) -> SectionResults:
    """The section ``section`` of this run; ``plot_files``: the plots that
    were drawn (None: every plot the run's kind draws)."""
    plots = [
        Plot(file=f, caption=c)
        for f, c in plot_list(summary)
        if plot_files is None or f in plot_files
    ]
    not_run = [
        f"{c.label} {c.status}: {c.reason}" for c in summary.configs if c.status != "ok"
    ]
    return SectionResults(
        section=section,
        title=title,
        kind="bench",
        source=SOURCE,
        command=summary.command,
        started_at=summary.started_at,
        duration_min=round(summary.duration_s / 60, 2),
        commit=summary.versions.get("kvpush_commit"),
        setup=Setup(**setup_fields(summary)),
        configs=list(dict.fromkeys(c.name for c in summary.configs)),
        points=[
            point_label(link, info.label)
            for link in summary.link_rates
            for info in summary.points
        ],
        num_rounds=len(summary.rounds),
        measurements=measurements_of(summary),
        ratios=ratios_of(summary),
        plots=plots,
        notes=not_run,
        run=summary,
    )
