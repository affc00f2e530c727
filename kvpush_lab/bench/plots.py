"""PNG plots of a run (matplotlib, Agg backend; small files).

- TTFT p50 and p99 against the sweep axis, one colour per configuration;
- TPOT p50 and p99 against the sweep axis;
- the TTFT CDF at every sweep point;
- a timeline of a few requests of the first point per configuration, each
  from its own send: waiting for the first token, then decoding, with the
  server's handover phases drawn inside where timelines exist;
- on a prompt-length sweep, the handover overhead (TTFT p50 − colocated's)
  against prompt length, one line per P/D configuration (and link rate);
- for the saturation workload, goodput against the offered load.

A repeated run (``--repeat``) draws each configuration's median over the
rounds with min–max bars; its CDFs pool the rounds, its timeline is the
first round's.

On a rehearsal swept over link rates every configuration at every rate is
a series of its own (``kvpush @4 Gbit/s``); with a single sweep point,
TTFT and TPOT are drawn against the link rate instead, one line per
configuration.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvpush_lab.bench.records import RequestRecord
from kvpush_lab.bench.report import AXIS_NAMES, plot_axis, plot_files
from kvpush_lab.bench.report_rounds import (
    Getter,
    figure_spread,
    goodput_of,
    overhead_of,
    stat_of,
)
from kvpush_lab.bench.stats import ttft_s
from kvpush_lab.bench.summary import BenchSummary, ConfigResult
from kvpush_lab.bench.timeline import MATCHED, Timeline

DPI = 80
CATEGORICAL_AXES = ("cache", "turn")  # points named, not measured on a scale
_COLORS = (
    "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple",
    "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan",
)  # fmt: skip
# Server segments drawn in the timeline: (label, from event, to event).
_SERVER_SEGMENTS = (
    ("await registration", "kv_ready", MATCHED),
    ("write setup", MATCHED, "write_posted"),
    ("transfer", "write_posted", "write_done"),
    ("notify", "write_done", "notif_received"),
    ("schedule decode", "notif_received", "first_decode_step"),
)


def write_plots(
    summary: BenchSummary,
    records: Sequence[RequestRecord],
    timelines: Mapping[str, Mapping[str, Timeline]],
    out_dir: Path,
    num_timeline_requests: int = 8,
) -> list[Path]:
    """Write every plot into ``out_dir``; returns their paths."""
    files = plot_files(plot_axis(summary), summary.settings.get("workload", "sweep"))
    # a repeated run: one series per configuration (its first round's), the
    # median over rounds with min-max bars; CDFs pool every round
    runs = [c for c in summary.in_round(summary.rounds[0]).configs if c.status == "ok"]
    timeline_path = out_dir / files["timeline"]
    against = _against_rate if plot_axis(summary) == "link_gbit" else _against_axis
    written = [
        against(summary, runs, "ttft_ms", "TTFT", out_dir / files["ttft"]),
        against(summary, runs, "tpot_ms", "TPOT", out_dir / files["tpot"]),
        _cdf(summary, runs, records, out_dir / files["cdf"]),
        _timeline(runs, records, timelines, num_timeline_requests, timeline_path),
    ]
    if "overhead" in files:
        written.append(_overhead(summary, runs, out_dir / files["overhead"]))
    if "goodput" in files:
        written.append(_goodput(summary, runs, out_dir / files["goodput"]))
    return written


def _goodput(summary: BenchSummary, runs: Sequence[ConfigResult], path: Path) -> Path:
    """Goodput against the offered load, a line per configuration."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    xs = [p.x for p in summary.points]
    ax.plot(xs, xs, ":", color="black", linewidth=0.8, label="offered")
    for run in runs:
        series = _over_rounds(summary, run, goodput_of)
        _draw(ax, xs, series, "-o", _color(runs, run), _series_label(run))
    ax.set_xlabel(AXIS_NAMES.get(summary.axis, summary.axis))
    ax.set_ylabel("goodput (req/s meeting the SLO)")
    s = summary.settings
    ax.set_title(
        f"Goodput: TTFT ≤ {s.get('slo_ttft_ms', 0):g} ms, "
        f"TPOT ≤ {s.get('slo_tpot_ms', 0):g} ms", fontsize="medium",
    )  # fmt: skip
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def _overhead(summary: BenchSummary, runs: Sequence[ConfigResult], path: Path) -> Path:
    """Handover overhead against prompt length, a line per P/D run."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    xs = [p.x for p in summary.points]
    pd_runs = [run for run in runs if run.name != "colocated"]
    for i, run in enumerate(pd_runs):
        series = _over_rounds(summary, run, overhead_of)
        _draw(ax, xs, series, "-o", _COLORS[i % len(_COLORS)], _series_label(run))
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xlabel(AXIS_NAMES["prompt_len"] + " (tokens)")
    ax.set_ylabel("TTFT p50 − colocated TTFT p50 (ms)")
    ax.set_title("Handover overhead against prompt length")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def _color(runs: Sequence[ConfigResult], run: ConfigResult) -> str:
    return _COLORS[runs.index(run) % len(_COLORS)]


def _mine(
    records: Sequence[RequestRecord], run: ConfigResult, every_round: bool = False
) -> list[RequestRecord]:
    """The records of one configuration at its link rate, in its round (or
    in every round)."""
    return [
        r
        for r in records
        if r.config == run.name
        and r.link_gbit == run.link_gbit
        and (every_round or r.round == run.round)
    ]


def _series_label(run: ConfigResult) -> str:
    """A series' name: the configuration (and link), not one round."""
    return run.label if run.round is None else run.label.rsplit(", round ", 1)[0]


Series = tuple[list[float], list[float], list[float]]  # value, low, high


def _over_rounds(summary: BenchSummary, run: ConfigResult, get: Getter) -> Series:
    """Per point: the figure's median over rounds and its min and max (the
    figure itself, where the run was not repeated)."""
    ys, lo, hi = [], [], []
    for p in summary.points:
        s = figure_spread(summary, get, run.name, run.link_gbit, p.index)
        nan = float("nan")
        ys.append(nan if s is None else s.median)
        lo.append(nan if s is None else s.min)
        hi.append(nan if s is None else s.max)
    return ys, lo, hi


def _draw(
    ax: Any, xs: Sequence[float], series: Series, style: str, color: str, label: str
) -> None:
    """A line, with min-max bars where the values spread over rounds."""
    ys, lo, hi = series
    if any(h > low for low, h in zip(lo, hi, strict=True)):
        bars = [
            [y - low for y, low in zip(ys, lo, strict=True)],
            [h - y for y, h in zip(ys, hi, strict=True)],
        ]
        ax.errorbar(xs, ys, yerr=bars, fmt=style, color=color, label=label, capsize=3)
    else:
        ax.plot(xs, ys, style, color=color, label=label)


def _against_axis(
    summary: BenchSummary,
    runs: Sequence[ConfigResult],
    field: str,
    what: str,
    path: Path,
) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    xs = [p.x for p in summary.points]
    for run in runs:
        for pct, style in (("p50", "-o"), ("p99", "--^")):
            series = _over_rounds(summary, run, stat_of(field, pct))
            label = f"{_series_label(run)} {pct}"
            _draw(ax, xs, series, style, _color(runs, run), label)
    ax.set_xlabel(AXIS_NAMES.get(summary.axis, summary.axis))
    if summary.axis in CATEGORICAL_AXES:
        ax.set_xticks(xs, [p.label for p in summary.points])
    ax.set_ylabel(f"{what} (ms)")
    rounds = (
        f", median and min–max of {len(summary.rounds)} rounds"
        if summary.is_repeated
        else ""
    )
    ax.set_title(f"{what} p50 (solid) and p99 (dashed){rounds}", fontsize="medium")
    _log_if_wide(ax, summary, runs, field)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    return _save(fig, path)


def _against_rate(
    summary: BenchSummary,
    runs: Sequence[ConfigResult],
    field: str,
    what: str,
    path: Path,
) -> Path:
    """One line per configuration across the link rates (single point)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    names = list(dict.fromkeys(run.name for run in runs))
    point = summary.points[0].index
    for i, name in enumerate(names):
        mine = [run for run in runs if run.name == name and run.link_gbit is not None]
        xs = [float(run.link_gbit or 0.0) for run in mine]
        color = _COLORS[i % len(_COLORS)]
        for pct, style in (("p50", "-o"), ("p99", "--^")):
            ys = [_median(summary, run, point, field, pct) for run in mine]
            ax.plot(xs, ys, style, color=color, label=f"{name} {pct}")
    ax.set_xscale("log")
    rates = [r for r in summary.link_rates if r is not None]
    ax.set_xticks(rates, [f"{r:g}" for r in rates])
    ax.set_xlabel(f"{AXIS_NAMES['link_gbit']}, {summary.points[0].label}")
    ax.set_ylabel(f"{what} (ms)")
    ax.set_title(f"{what} p50 (solid) and p99 (dashed)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    return _save(fig, path)


def _median(
    summary: BenchSummary, run: ConfigResult, point: int, field: str, pct: str
) -> float:
    """The figure's median over rounds (the figure, if not repeated)."""
    get = stat_of(field, pct)
    s = figure_spread(summary, get, run.name, run.link_gbit, point)
    return float("nan") if s is None else s.median


def _value(run: ConfigResult, point: int, field: str, pct: str) -> float:
    result = run.point(point)
    dist = getattr(result.stats, field) if result is not None else None
    return float(getattr(dist, pct)) if dist is not None else float("nan")


def _log_if_wide(
    ax: Any, summary: BenchSummary, runs: Sequence[ConfigResult], field: str
) -> None:
    values = [
        _value(run, p.index, field, pct)
        for run in runs
        for p in summary.points
        for pct in ("p50", "p99")
    ]
    finite = [v for v in values if v == v and v > 0]
    if finite and max(finite) / min(finite) > 20:
        ax.set_yscale("log")


def _cdf(
    summary: BenchSummary,
    runs: Sequence[ConfigResult],
    records: Sequence[RequestRecord],
    path: Path,
) -> Path:
    num = max(1, len(summary.points))
    cols = min(num, 4)
    rows = -(-num // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.2 * cols, 2.8 * rows), squeeze=False, sharey=True
    )
    for slot, info in enumerate(summary.points):
        ax = axes[slot // cols][slot % cols]
        for run in runs:
            values = sorted(
                1000 * t
                for r in _mine(records, run, every_round=True)
                if r.point == info.index
                if (t := ttft_s(r)) is not None
            )
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                color = _color(runs, run)
                label = _series_label(run)
                ax.step(values, ys, where="post", color=color, label=label)
        ax.set_title(info.label, fontsize="medium")
        ax.set_xlabel("TTFT (ms)")
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
    for slot in range(len(summary.points), rows * cols):
        axes[slot // cols][slot % cols].set_visible(False)
    axes[0][0].set_ylabel("fraction of requests")
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend(fontsize="small")
    return _save(fig, path)


def _timeline(
    runs: Sequence[ConfigResult],
    records: Sequence[RequestRecord],
    timelines: Mapping[str, Mapping[str, Timeline]],
    num_requests: int,
    path: Path,
) -> Path:
    rows = max(1, len(runs))
    height = 1.2 + (0.25 * max(num_requests, 2) + 0.3) * rows
    fig, axes = plt.subplots(rows, 1, figsize=(7.0, height), squeeze=False, sharex=True)
    first_point = min((r.point for r in records), default=0)
    has_server = False
    for ax, run in zip([a[0] for a in axes], runs, strict=False):
        sample = sorted(
            (r for r in _mine(records, run) if r.point == first_point),
            key=lambda r: r.index,
        )[:num_requests]
        has_server |= _draw_requests(ax, sample, timelines.get(run.label, {}))
        ax.set_ylabel(run.label, fontsize="small")
    axes[-1][0].set_xlabel("ms since the request was sent")
    labels = [("waiting for first token", "tab:gray"), ("decoding", "tab:blue")]
    labels.append(("failed", "tab:red"))
    if has_server:
        labels += list(
            zip([s[0] for s in _SERVER_SEGMENTS], _server_colors(), strict=False)
        )
    handles = [plt.Rectangle((0, 0), 1, 1, color=color) for _, color in labels]
    axes[0][0].legend(
        handles, [label for label, _ in labels], fontsize="x-small", ncol=4,
        loc="lower left", bbox_to_anchor=(0.0, 1.02), frameon=False,
    )  # fmt: skip
    return _save(fig, path)


def _draw_requests(
    ax: Any, sample: Sequence[RequestRecord], timelines: Mapping[str, Timeline]
) -> bool:
    """Draw one bar per request; True if any server phase was drawn."""
    has_server = False
    for row, rec in enumerate(sample):
        if not rec.is_ok or not rec.token_times_s:
            ax.barh(row, 1000 * (rec.end_s or 0), color="tab:red")
            continue
        first, last = (1000 * t for t in (rec.token_times_s[0], rec.token_times_s[-1]))
        ax.barh(row, first, color="tab:gray", height=0.6)
        ax.barh(row, last - first, left=first, color="tab:blue", height=0.6)
        timeline = timelines.get(rec.bench_id)
        if timeline:
            has_server |= _draw_server(ax, row, timeline, rec.sent_wall)
    ax.set_yticks(range(len(sample)), [r.bench_id for r in sample], fontsize="x-small")
    ax.invert_yaxis()
    ax.grid(True, axis="x", alpha=0.3)
    return has_server


def _server_colors() -> list[Any]:
    return list(plt.get_cmap("Set2").colors)  # type: ignore[attr-defined]


def _draw_server(ax: Any, row: int, timeline: Timeline, origin: float) -> bool:
    """The handover phases as thin bars inside the request's bar."""
    events = dict(timeline)
    if "kv_ready" in events and "reg_received" in events:
        events[MATCHED] = max(events["kv_ready"], events["reg_received"])
    drawn = False
    for (_, start, end), color in zip(_SERVER_SEGMENTS, _server_colors(), strict=False):
        if start in events and end in events:
            left = 1000 * (events[start] - origin)
            width = 1000 * (events[end] - events[start])
            ax.barh(row, width, left=left, height=0.25, color=color)
            drawn = True
    return drawn


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
