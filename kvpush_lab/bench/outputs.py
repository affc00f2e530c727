"""Files a run leaves behind, rendered from ``summary.json`` and the raw
``requests.jsonl``: ``report.md``, the plots and ``results.json``
(:mod:`kvpush_lab.bench.results`) in its results directory; and, with
``--publish``, its section in a repository checkout:
``docs/bench/<section>/`` (``results.json`` and the plots), after which
``BENCHMARKS.md`` and every section's ``README.md`` are rendered again
from all the sections' JSON (:mod:`kvpush_lab.bench.render`)."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from kvpush_lab.bench.export import results_of_run
from kvpush_lab.bench.plots import write_plots
from kvpush_lab.bench.records import REQUESTS_FILE, RequestRecord, read_records
from kvpush_lab.bench.render import SECTIONS_DIR, render_all
from kvpush_lab.bench.report import render_report
from kvpush_lab.bench.report_endpoint import endpoint_of
from kvpush_lab.bench.results import (
    RESULTS_FILE,
    SectionResults,
    check_section_name,
    load_results,
    save_results,
)
from kvpush_lab.bench.summary import BenchSummary
from kvpush_lab.bench.timeline import Timeline, match_by_time, read_timelines

REPORT_FILE = "report.md"


def default_section(summary: BenchSummary) -> str:
    """A run's section unless ``--section`` names one: its workload's
    (``saturation``, ``fragmented``, ...), a plain sweep by its axis
    (``qps-sweep``, ``prompt-len-sweep``), ``endpoint`` for ``--base-url``."""
    if endpoint_of(summary) is not None:
        return "endpoint"
    workload = str(summary.settings.get("workload") or "sweep")
    if workload != "sweep":
        return workload
    return f"{summary.axis.replace('_', '-')}-sweep"


def all_records(out_dir: Path) -> list[RequestRecord]:
    path = out_dir / REQUESTS_FILE
    return read_records(path) if path.exists() else []


def all_timelines(
    summary: BenchSummary, records: Sequence[RequestRecord]
) -> dict[str, dict[str, Timeline]]:
    """Per configuration (its label: with the link rate on a rehearsal),
    the timelines joined to requests by id, or else unambiguously by time
    (see :func:`match_by_time`)."""
    out = {}
    for config in summary.configs:
        if not (config.run_dir and config.has_timelines):
            continue
        timelines = read_timelines(Path(config.run_dir))
        spans = {
            r.bench_id: (r.sent_wall, r.sent_wall + r.token_times_s[0])
            for r in records
            if r.config == config.name
            and r.link_gbit == config.link_gbit
            and r.round == config.round
            and r.token_times_s
        }
        by_time = match_by_time(timelines.unjoined, spans)
        out[config.label] = {**by_time, **timelines.by_request}
    return out


def section_results(
    out_dir: Path,
    summary: BenchSummary,
    section: str | None = None,
    title: str | None = None,
) -> SectionResults:
    """The run as section ``section`` (default: :func:`default_section`),
    with the plots found in ``out_dir``."""
    name = check_section_name(section or default_section(summary))
    plots = sorted(p.name for p in out_dir.glob("*.png"))
    return results_of_run(summary, name, title or f"kvpush bench: {name}", plots)


def write_outputs(
    out_dir: Path,
    summary: BenchSummary,
    title: str | None = None,
    section: str | None = None,
) -> list[Path]:
    """Write report.md, the plots and results.json into ``out_dir``."""
    report = out_dir / REPORT_FILE
    report.write_text(render_report(summary, title=title or "kvpush bench report"))
    records = all_records(out_dir)
    plots = write_plots(
        summary,
        records,
        all_timelines(summary, records),
        out_dir,
        int(summary.settings.get("num_timeline_requests", 8)),
    )
    results = save_results(section_results(out_dir, summary, section, title), out_dir)
    return [report, *plots, results]


def publish(
    out_dir: Path,
    summary: BenchSummary,
    root: Path,
    section: str | None = None,
    title: str | None = None,
) -> list[Path]:
    """Replace ``root/docs/bench/<section>/`` with this run's results.json
    and plots, then render ``root/BENCHMARKS.md`` and the sections' pages
    again from every section's JSON. Without ``title``, a section published
    before keeps its title (``make bench`` names none)."""
    name = check_section_name(section or default_section(summary))
    previous = root / SECTIONS_DIR / name
    if title is None and (previous / RESULTS_FILE).exists():
        title = load_results(previous).title
    results = section_results(out_dir, summary, name, title)
    return publish_results(results, root, sorted(out_dir.glob("*.png")))


def publish_results(
    results: SectionResults, root: Path, images: Sequence[Path] = ()
) -> list[Path]:
    """Any tool's section into ``root/docs/bench/<section>/`` (its old
    plots removed), and everything rendered again."""
    folder = root / SECTIONS_DIR / check_section_name(results.section)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.png"):
        old.unlink()
    copied = []
    for png in images:
        target = folder / png.name
        shutil.copyfile(png, target)
        copied.append(target)
    return [save_results(results, folder), *copied, *render_all(root)]
