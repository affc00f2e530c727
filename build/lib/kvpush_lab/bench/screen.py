"""The one-screen summary printed at the end of a run."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvpush_lab.bench.stats import Dist, ratio
from kvpush_lab.bench.summary import BenchSummary


def print_summary(
    console: Console, summary: BenchSummary, files: Sequence[Path]
) -> None:
    """Per configuration and point: requests, TTFT, TPOT, throughput and
    TTFT p50 ratios; then what was not measured and where the files are."""
    table = Table(title="kvpush bench (latencies in ms)")
    for column in (
        "config", "point", "ok", "TTFT\np50", "TTFT\np99", "TPOT\np50",
        "out\ntok/s", "TTFT\n÷coloc", "TTFT\n÷pull",
    ):  # fmt: skip
        is_label = column in ("config", "point")
        table.add_column(
            column,
            justify="left" if is_label else "right",
            min_width=9 if column == "config" else None,
            no_wrap=True,
        )
    for config in summary.configs:
        if config.status != "ok":
            continue
        at_link = summary.at_link(config.link_gbit).in_round(config.round)
        for info in summary.points:
            result = config.point(info.index)
            if result is None:
                continue
            st = result.stats
            p50 = _pct(st.ttft_ms, "p50")
            table.add_row(
                config.label, info.label, f"{st.num_ok}/{st.num_requests}",
                _fmt(p50), _fmt(_pct(st.ttft_ms, "p99")),
                _fmt(_pct(st.tpot_ms, "p50")),
                f"{st.output_throughput:.0f}",
                _fmt(ratio(p50, _ref(at_link, "colocated", info.index)), "x"),
                _fmt(ratio(p50, _ref(at_link, "vllm-pull", info.index)), "x"),
            )  # fmt: skip
    console.print(table)
    for config in summary.configs:
        if config.status != "ok":
            console.print(
                f"[bold yellow]{config.label} {config.status}:[/] {config.reason}"
            )
    for path in files:
        console.print(f"  wrote {path}")


def _pct(dist: Dist | None, pct: str) -> float | None:
    return None if dist is None else float(getattr(dist, pct))


def _ref(summary: BenchSummary, name: str, point: int) -> float | None:
    st = summary.stats(name, point)
    return _pct(st.ttft_ms, "p50") if st is not None else None


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "–"
    if unit:
        return f"{value:.2f}{unit}"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"
