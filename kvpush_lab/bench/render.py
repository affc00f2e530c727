"""``BENCHMARKS.md`` and each section's ``README.md``, rendered from
``docs/bench/*/results.json`` (:mod:`kvpush_lab.bench.results`).

``python -m kvpush_lab.bench.render [ROOT]`` rewrites both; every publishing
run calls :func:`render_all` after writing its JSON. ``BENCHMARKS.md`` is
short: the setup, one headline table per benchmark section (kvpush's
figures in ``vllm bench serve``'s columns and its ratios to vLLM's
connectors, median [min–max] over rounds), a line for each other section,
a few plots, and a link to every section's JSON and details. The renderer
shows measured figures only; what they should be is in
``docs/performance.md``. Pure except :func:`render_all` and :func:`main`.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from kvpush_lab.bench.results import (
    RESULTS_FILE,
    Metrics,
    SectionResults,
    Table,
    load_results,
)
from kvpush_lab.bench.rounds import Spread

BENCHMARKS_FILE = "BENCHMARKS.md"
SECTIONS_DIR = Path("docs") / "bench"
README_FILE = "README.md"
CONNECTORS = ("vllm-pull", "vllm-push")  # vLLM's own, kvpush's references
# (column, Metrics field): the client-side figures, as vllm bench serve names them
FIGURES: tuple[tuple[str, str], ...] = (
    ("TTFT p50", "ttft_p50_ms"),
    ("TTFT p99", "ttft_p99_ms"),
    ("TTST p50", "ttst_p50_ms"),
    ("TTST p99", "ttst_p99_ms"),
    ("TPOT p50", "tpot_p50_ms"),
    ("TPOT p99", "tpot_p99_ms"),
    ("ITL p50", "itl_p50_ms"),
    ("ITL p99", "itl_p99_ms"),
    ("out tok/s", "output_throughput"),
)
# (figure, reference): the ratio columns a headline may carry
RATIOS: tuple[tuple[str, str], ...] = (
    ("TTFT p50", "vllm-pull"),
    ("TTFT p99", "vllm-pull"),
    ("TPOT p50", "vllm-pull"),
    ("TTFT p50", "vllm-push"),
    ("TPOT p50", "vllm-push"),
)
NUM_PLOTS = 3
_KIND_ORDER = {"bench": 0, "soak": 1, "micro": 2, "notes": 3}


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def ordered(sections: Sequence[SectionResults]) -> list[SectionResults]:
    """Benchmarks first (a prompt-length sweep, then load sweeps, then the
    rest, by name), then the soak, the micro-benchmarks and hand-written notes."""

    def key(s: SectionResults) -> tuple[int, int, str]:
        first = s.points[0] if s.points else ""
        axis = 0 if _is_prompt_sweep(s) else 1 if first.startswith("qps") else 2
        return _KIND_ORDER.get(s.kind, 9), axis, s.section

    return sorted(sections, key=key)


def _is_prompt_sweep(s: SectionResults) -> bool:
    return any(p.file.startswith("overhead_vs_prompt_len") for p in s.plots)


def headline_configs(s: SectionResults) -> list[str]:
    """The configurations a headline shows: kvpush's (every other one
    than vLLM's and colocated, where none is named kvpush)."""
    mine = [c for c in s.configs if c.startswith("kvpush")]
    return mine or [c for c in s.configs if c not in (*CONNECTORS, "colocated")]


def number(value: float | None, field: str = "") -> str:
    """A figure as the headline writes it: ms to 3 significant digits
    (whole ms from 100), throughputs to one decimal."""
    if value is None:
        return "–"
    if field.endswith("throughput"):
        return f"{value:.1f}"
    return f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"


def median_of(metrics: Sequence[Metrics], field: str) -> float | None:
    """A figure's median over the rounds that measured it."""
    values = [v for m in metrics if (v := getattr(m, field)) is not None]
    return statistics.median(values) if values else None


def spread_text(spread: Spread, side: int) -> str:
    """``0.82 [0.78–0.90]``; bold where every round lay on one side of 1;
    one round: the value alone."""
    if spread.n == 1:
        return f"{spread.median:.2f}"
    text = f"{spread.median:.2f} [{spread.min:.2f}–{spread.max:.2f}]"
    return f"**{text}**" if side else text


def ratio_columns(s: SectionResults) -> list[tuple[str, str]]:
    """The (figure, reference) ratios some headline row has."""
    names = headline_configs(s)
    return [
        (fig, ref)
        for fig, ref in RATIOS
        if any(s.ratio(p, c, fig, ref) for p in s.points for c in names)
    ]


def figure_columns(s: SectionResults) -> list[tuple[str, str]]:
    """The figures some headline row has (a section older than a figure
    does not show its column)."""
    names = headline_configs(s)
    measured = [m for p in s.points for c in names for m in s.measured(p, c)]
    return [(label, f) for label, f in FIGURES if median_of(measured, f) is not None]


def headline_table(s: SectionResults) -> str:
    """kvpush's figures (median over rounds) and its ratios to vLLM's
    connectors at every point."""
    ratios = ratio_columns(s)
    figures = figure_columns(s)
    header = ["point", "config", *(label for label, _ in figures)]
    header += [f"{fig} ÷ {ref}" for fig, ref in ratios]
    rows = []
    for point in s.points:
        for config in headline_configs(s):
            measured = s.measured(point, config)
            if not measured:
                continue
            cells = [point, config]
            cells += [number(median_of(measured, f), f) for _, f in figures]
            for fig, ref in ratios:
                r = s.ratio(point, config, fig, ref)
                cells.append("–" if r is None else spread_text(r.spread, r.side))
            rows.append(cells)
    return table(header, rows) if rows else ""


def _when(s: SectionResults) -> str:
    parts = [s.started_at or "date not recorded"]
    if s.commit:
        parts.append(f"commit `{s.commit}`")
    if s.kind == "bench":
        parts.append(f"{s.num_rounds} round{'s' if s.num_rounds != 1 else ''}")
    return ", ".join(parts)


def _links(s: SectionResults) -> str:
    folder = (SECTIONS_DIR / s.section).as_posix()
    return (
        f"[results.json]({folder}/{RESULTS_FILE}) · [details]({folder}/{README_FILE})"
    )


def _bench_part(s: SectionResults) -> str:
    head = f"### {s.title}\n{_when(s)}. {_links(s)}"
    body = headline_table(s)
    return f"{head}\n\n{body}" if body else head


def _other_line(s: SectionResults) -> str:
    verdict = f" {s.notes[0]}" if s.kind == "soak" and s.notes else ""
    return f"- **{s.title}** ({_when(s)}).{verdict} {_links(s)}"


def _setup(sections: Sequence[SectionResults]) -> str:
    machines = list(dict.fromkeys(
        s.setup.machine for s in sections if s.kind == "bench" and s.setup.machine
    ))  # fmt: skip
    lines = ["## Setup", ""]
    lines += [f"- **Machine:** {m}" for m in machines]
    lines += [
        "- Each benchmark section ran every configuration one after another on "
        "the same requests, each on a fresh cluster after a warm-up; its model, "
        "versions and workload are in its details. Compare configurations only "
        "through ratios within one section: absolute figures are this machine's.",
        "- **Headline columns:** kvpush's client-side figures as `vllm bench "
        "serve` defines them (ms; TTST: time to the second token; out tok/s = "
        "output tokens per second), the median over rounds; **÷ vllm-pull / "
        "vllm-push**: kvpush's figure over that vLLM connector's, taken within "
        "each round, median [min–max] over the rounds (below 1: kvpush "
        "lower); **bold**: every round on the same side of 1. –: not "
        "measured, or not kept by a migrated section.",
    ]
    return "\n".join(lines)


def _plots(benches: Sequence[SectionResults]) -> str:
    """The first plot of the sections that sweep the most points (the
    prompt-length sweep first; a plot of one point shows little)."""
    plotted = [s for s in benches if s.plots]
    swept = [s for s in plotted if len(s.points) > 1]
    swept.sort(key=lambda s: (not _is_prompt_sweep(s), -len(s.points)))
    ranked = swept + [s for s in plotted if s not in swept]
    shown = [(s, s.plots[0]) for s in ranked][:NUM_PLOTS]
    if not shown:
        return ""
    lines = ["## Plots"]
    for s, plot in shown:
        path = (SECTIONS_DIR / s.section / plot.file).as_posix()
        lines += ["", f"![{s.title}: {plot.caption}]({path})"]
    return "\n".join(lines)


def render_benchmarks(sections: Sequence[SectionResults]) -> str:
    """The whole ``BENCHMARKS.md``."""
    ordered_ = ordered(sections)
    benches = [s for s in ordered_ if s.kind == "bench"]
    others = [s for s in ordered_ if s.kind != "bench"]
    parts = [
        "# kvpush benchmarks",
        "Rendered by `python -m kvpush_lab.bench.render` from "
        f"`{SECTIONS_DIR.as_posix()}/*/{RESULTS_FILE}`, which every publishing "
        "run writes (`kvpush bench --publish --section NAME`, the soak's and "
        "`kvpush bench-micro`'s `--publish`); do not edit by hand. Each "
        "section's JSON holds every round, point and configuration; its "
        "details page renders all of it.",
        _setup(sections),
    ]
    if benches:
        parts.append("## Headline")
        parts += [_bench_part(s) for s in benches]
    if others:
        parts.append("## Other results\n\n" + "\n".join(_other_line(s) for s in others))
    parts.append(_plots(benches))
    return "\n\n".join(p for p in parts if p) + "\n"


# --- a section's README.md ---------------------------------------------------


def render_section(s: SectionResults) -> str:
    """A section's details page: its run's full report where the JSON has
    the run (and the notes added to it), else its tables and notes as they
    were kept."""
    if s.run is not None:
        from kvpush_lab.bench.report import render_report

        preamble = "\n\n".join([_provenance(s), *s.notes])
        return render_report(s.run, title=s.title, preamble=preamble)
    parts = [f"# {s.title}", _provenance(s)]
    if s.command:
        parts.append(f"Command:\n\n```\n{s.command}\n```")
    setup = [
        f"- **{label}:** {text}"
        for label, text in (
            ("Machine", s.setup.machine),
            ("Versions", s.setup.versions),
            ("Model", s.setup.model),
            ("Clusters", s.setup.clusters),
            ("Endpoint", s.setup.endpoint),
            ("Workload", s.setup.workload),
            ("Hosts", s.setup.hosts),
        )
        if text
    ]
    if setup:
        parts.append("## Setup\n\n" + "\n".join(setup))
    parts += s.notes
    titles = [t.title for t in s.tables]
    parts += [
        _table_part(t, show_title=i == 0 or titles[i - 1] != t.title)
        for i, t in enumerate(s.tables)
    ]
    if s.plots:
        parts.append(
            "## Plots\n\n" + "\n\n".join(f"![{p.caption}]({p.file})" for p in s.plots)
        )
    return "\n\n".join(p for p in parts if p) + "\n"


def _provenance(s: SectionResults) -> str:
    return (
        f"Rendered from [{RESULTS_FILE}]({RESULTS_FILE}) by `python -m "
        f"kvpush_lab.bench.render`; do not edit by hand. {_when(s)}. "
        f"Source: {s.source}."
    )


def _table_part(t: Table, show_title: bool = True) -> str:
    parts = [f"## {t.title}"] if show_title else []
    if t.note:
        parts.append(t.note)
    if t.columns:
        parts.append(table(t.columns, t.rows))
    if t.after:
        parts.append(t.after)
    return "\n\n".join(parts)


# --- files ---------------------------------------------------------------------


def load_all(root: Path) -> list[SectionResults]:
    """Every ``root/docs/bench/*/results.json``, in name order."""
    folder = root / SECTIONS_DIR
    paths = sorted(folder.glob(f"*/{RESULTS_FILE}")) if folder.is_dir() else []
    return [load_results(p.parent) for p in paths]


def render_all(root: Path) -> list[Path]:
    """Rewrite ``root/BENCHMARKS.md`` and every section's ``README.md``."""
    sections = load_all(root)
    written = []
    for s in sections:
        path = root / SECTIONS_DIR / s.section / README_FILE
        path.write_text(render_section(s))
        written.append(path)
    benchmarks = root / BENCHMARKS_FILE
    benchmarks.write_text(render_benchmarks(sections))
    return [benchmarks, *written]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) > 1 or (args and args[0].startswith("-")):
        print("usage: python -m kvpush_lab.bench.render [ROOT]", file=sys.stderr)
        return 2
    root = Path(args[0]) if args else Path(".")
    try:
        files = render_all(root)
    except ValueError as e:
        print(f"render: error: {e}", file=sys.stderr)
        return 2
    for path in files:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
