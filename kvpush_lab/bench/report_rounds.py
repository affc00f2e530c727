"""The report's part for a repeated run (``--repeat N``): pure rendering.

For every point (and link rate), each configuration's ratio to vllm-pull,
taken within each round and summarised over the rounds as median
[min–max] (:mod:`kvpush_lab.bench.rounds`); then the spread of each
configuration's own figures, which shows the machine's noise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpush_lab.bench.report_net import overhead
from kvpush_lab.bench.rounds import (
    Round,
    Spread,
    describe,
    describe_ms,
    ratio_spread,
    spread,
)
from kvpush_lab.bench.summary import BenchSummary, PointResult, rate

Table = Callable[[Sequence[str], Sequence[Sequence[str]]], str]
REFERENCE = "vllm-pull"
# A figure of one configuration at one point of one round's summary.
Getter = Callable[[BenchSummary, str, float | None, int], float | None]


def stat_of(field: str, pct: str) -> Getter:
    """A getter of one percentile of one PointStats field."""

    def get(s: BenchSummary, name: str, link: float | None, point: int) -> float | None:
        result = _point(s, name, link, point)
        dist = getattr(result.stats, field) if result is not None else None
        return None if dist is None else float(getattr(dist, pct))

    return get


def overhead_of(
    s: BenchSummary, name: str, link: float | None, point: int
) -> float | None:
    """TTFT p50 − colocated TTFT p50 (None for colocated itself)."""
    return None if name == "colocated" else overhead(s, name, link, point)


def _router_handover(
    s: BenchSummary, name: str, link: float | None, point: int
) -> float | None:
    """The router's mean handover (prefill leg's answer to decode's first
    byte), where the router measured one."""
    result = _point(s, name, link, point)
    legs = result.router if result is not None else None
    return None if legs is None else legs.handover_mean_ms


def goodput_of(
    s: BenchSummary, name: str, link: float | None, point: int
) -> float | None:
    """Goodput in requests/s (the saturation workload's)."""
    result = _point(s, name, link, point)
    return None if result is None or result.goodput is None else result.goodput.per_s


# (column, figure); each column's ratio is taken within a round.
FIGURES: tuple[tuple[str, Getter], ...] = (
    ("TTFT p50", stat_of("ttft_ms", "p50")),
    ("TTFT p99", stat_of("ttft_ms", "p99")),
    ("TTST p50", stat_of("ttst_ms", "p50")),
    ("TPOT p50", stat_of("tpot_ms", "p50")),
    ("TPOT p99", stat_of("tpot_ms", "p99")),
    ("overhead", overhead_of),
    ("router handover", _router_handover),
    ("goodput", goodput_of),
)


def _point(
    s: BenchSummary, name: str, link: float | None, point: int
) -> PointResult | None:
    config = next(
        (c for c in s.configs
         if c.name == name and c.link_gbit == link and c.status == "ok"),
        None,
    )  # fmt: skip
    return config.point(point) if config is not None else None


def per_round(
    summary: BenchSummary, get: Getter, name: str, link: float | None, point: int
) -> dict[Round, float | None]:
    """One figure of ``name`` in every round."""
    return {r: get(summary.in_round(r), name, link, point) for r in summary.rounds}


def ratio_to_reference(
    summary: BenchSummary, get: Getter, name: str, link: float | None, point: int
) -> Spread | None:
    """The figure's per-round ratio to vllm-pull's, over the rounds."""
    mine = per_round(summary, get, name, link, point)
    return ratio_spread(mine, per_round(summary, get, REFERENCE, link, point))


def figure_spread(
    summary: BenchSummary, get: Getter, name: str, link: float | None, point: int
) -> Spread | None:
    """The figure itself over the rounds."""
    return spread(per_round(summary, get, name, link, point).values())


def _names(summary: BenchSummary, link: float | None) -> list[str]:
    return list(
        dict.fromkeys(
            c.name for c in summary.configs if c.link_gbit == link and c.status == "ok"
        )
    )


def _columns(summary: BenchSummary) -> list[tuple[str, Getter]]:
    """The figures some configuration has in some round."""
    return [
        (label, get)
        for label, get in FIGURES
        if any(
            get(summary.in_round(r), n, link, p.index) is not None
            for r in summary.rounds
            for link in summary.link_rates
            for n in _names(summary, link)
            for p in summary.points
        )
    ]


def rounds_section(summary: BenchSummary, table: Table) -> str:
    """Ratios to vllm-pull and each figure's own spread over the rounds
    ('' unless the run was repeated)."""
    if not summary.is_repeated:
        return ""
    columns = _columns(summary)
    parts = [_intro(summary)]
    if any(REFERENCE in _names(summary, link) for link in summary.link_rates):
        parts.append(_ratio_table(summary, columns, table))
    parts.append(_figure_table(summary, columns, table))
    return "\n\n".join(parts)


def _intro(summary: BenchSummary) -> str:
    order = " ".join(dict.fromkeys(c.name for c in summary.configs))
    return (
        f"## Repeated rounds\n\n{len(summary.rounds)} rounds. Each round ran "
        f"every configuration once, in the same order ({order}), each on a "
        "fresh cluster: started, warmed up, measured and stopped within its "
        "round, so no cluster (or cache) carries over from one round to the "
        f"next. A ratio is taken within a round (against that round's "
        f"{REFERENCE}) and given as median [min–max] over the rounds; "
        f"**bold**: every round on the same side of 1, a difference the "
        "noise between rounds did not blur. **overhead** = TTFT p50 − "
        "colocated TTFT p50 of the same round and point; **router handover** "
        "= the router's mean time from the prefill leg's answer to decode's "
        "first byte (0 where decode's came first), which cancels the queueing "
        "both legs share."
    )


def _rows(summary: BenchSummary) -> list[tuple[float | None, int, str, str]]:
    """(link, point, point label, configuration) in report order."""
    return [
        (link, info.index, _point_label(link, info.label), name)
        for link in summary.link_rates
        for info in summary.points
        for name in _names(summary, link)
    ]


def _point_label(link: float | None, label: str) -> str:
    return label if link is None else f"{rate(link)}, {label}"


def _ratio_table(
    summary: BenchSummary, columns: list[tuple[str, Getter]], table: Table
) -> str:
    header = ["point", "config", *(f"{label} ÷ {REFERENCE}" for label, _ in columns)]
    rows = [
        [
            label,
            name,
            *(
                describe(
                    ratio_to_reference(summary, get, name, link, point),
                    mark_side=name != REFERENCE,
                )
                for _, get in columns
            ),
        ]
        for link, point, label, name in _rows(summary)
    ]
    return (
        f"### Ratios to {REFERENCE} over rounds\n\nBelow 1 = better than "
        f"{REFERENCE} (goodput: above 1).\n\n" + table(header, rows)
    )


def _unit(label: str) -> str:
    return f"{label} req/s" if label == "goodput" else f"{label} ms"


def _figure_table(
    summary: BenchSummary, columns: list[tuple[str, Getter]], table: Table
) -> str:
    header = ["point", "config", *(_unit(label) for label, _ in columns)]
    rows = [
        [
            label,
            name,
            *(
                describe_ms(figure_spread(summary, get, name, link, point))
                for _, get in columns
            ),
        ]
        for link, point, label, name in _rows(summary)
    ]
    return (
        "### Each figure over rounds\n\nMedian [min–max] over the rounds: the "
        "spread between rounds is this machine's noise on that figure.\n\n"
        + table(header, rows)
    )
