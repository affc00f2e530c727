"""Files a run leaves behind, rendered from ``summary.json`` and the raw
``requests.jsonl``: ``report.md`` and the plots; and, with ``--publish``,
``BENCHMARKS.md`` plus ``docs/bench/*.png`` in a repository checkout.
Sections that other tools publish into ``BENCHMARKS.md`` (the soak's and the
micro-benchmarks') are carried over from the old file."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from kvpush.bench.plots import write_plots
from kvpush.bench.records import REQUESTS_FILE, RequestRecord, read_records
from kvpush.bench.report import render_report
from kvpush.bench.sections import carry_sections
from kvpush.bench.summary import BenchSummary
from kvpush.bench.timeline import Timeline, match_by_time, read_timelines

REPORT_FILE = "report.md"
BENCHMARKS_FILE = "BENCHMARKS.md"
PUBLISHED_IMAGES = Path("docs") / "bench"
# written by python -m kvpush.soak --publish, and kvpush bench-micro --publish
KEPT_SECTIONS = ("soak", "micro")

BENCHMARKS_PREAMBLE = """\
The latest `kvpush bench` run on this project's development machine, generated
by the command below (`--publish` writes this file and `docs/bench/*.png`;
do not edit by hand). Every configuration ran one after another, in the same
run, on the same requests, each on a fresh cluster after a warm-up.

What these numbers are: vLLM's **CPU** backend serving a tiny generated
Qwen3 model (see Setup), on a small shared machine where the benchmark
client, the router and the instances compete for the same cores. Absolute
figures say nothing about GPU deployments; compare configurations only
through the ratios within one run, and check each point's background CPU:
a run disturbed by other processes on the machine can differ several-fold
(rerun it when the machine is quiet)."""


def all_records(out_dir: Path) -> list[RequestRecord]:
    path = out_dir / REQUESTS_FILE
    return read_records(path) if path.exists() else []


def all_timelines(
    summary: BenchSummary, records: Sequence[RequestRecord]
) -> dict[str, dict[str, Timeline]]:
    """Per configuration, the timelines joined to requests by id, or else
    unambiguously by time (see :func:`match_by_time`)."""
    out = {}
    for config in summary.configs:
        if not (config.run_dir and config.has_timelines):
            continue
        timelines = read_timelines(Path(config.run_dir))
        spans = {
            r.bench_id: (r.sent_wall, r.sent_wall + r.token_times_s[0])
            for r in records
            if r.config == config.name and r.token_times_s
        }
        by_time = match_by_time(timelines.unjoined, spans)
        out[config.name] = {**by_time, **timelines.by_request}
    return out


def write_outputs(out_dir: Path, summary: BenchSummary) -> list[Path]:
    """Write report.md and the plots into ``out_dir``."""
    report = out_dir / REPORT_FILE
    report.write_text(render_report(summary))
    records = all_records(out_dir)
    plots = write_plots(
        summary,
        records,
        all_timelines(summary, records),
        out_dir,
        int(summary.settings.get("num_timeline_requests", 8)),
    )
    return [report, *plots]


def publish(out_dir: Path, summary: BenchSummary, root: Path) -> list[Path]:
    """Write ``root/BENCHMARKS.md`` (keeping its soak section) and copy the
    plots to ``root/docs/bench``."""
    images = root / PUBLISHED_IMAGES
    images.mkdir(parents=True, exist_ok=True)
    copied = []
    for png in sorted(out_dir.glob("*.png")):
        target = images / png.name
        shutil.copyfile(png, target)
        copied.append(target)
    text = render_report(
        summary,
        title="kvpush benchmarks",
        preamble=BENCHMARKS_PREAMBLE,
        image_dir=PUBLISHED_IMAGES.as_posix(),
    )
    benchmarks = root / BENCHMARKS_FILE
    old = benchmarks.read_text() if benchmarks.exists() else ""
    benchmarks.write_text(carry_sections(old, text, KEPT_SECTIONS))
    return [benchmarks, *copied]
