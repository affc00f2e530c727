"""The report's prompt-length sweep parts: pure rendering.

For a run swept over prompt lengths (``--prompt-len-sweep``), per link
rate: each P/D configuration's handover overhead (TTFT p50 − colocated's,
same run and length), the bytes its prefill host sent per request, and for
kvpush configurations how much of each transfer overlapped the prompt's
prefill (:mod:`kvpush_lab.bench.overlap`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpush_lab.bench.overlap import OverlapStats
from kvpush_lab.bench.report_net import overhead
from kvpush_lab.bench.stats import ratio
from kvpush_lab.bench.summary import BenchSummary, ConfigResult, PointInfo, rate

Table = Callable[[Sequence[str], Sequence[Sequence[str]]], str]
PULL = "vllm-pull"


def sweep_sections(summary: BenchSummary, table: Table) -> list[str]:
    """Overhead and overlap (none unless swept over prompt length)."""
    if summary.axis != "prompt_len" or not summary.points:
        return []
    return [
        overhead_by_length(summary, table),
        details(summary, table),
    ]


def pd_names(summary: BenchSummary, link: float | None) -> list[str]:
    """The P/D configurations that ran at ``link``, in run order."""
    return [
        c.name
        for c in summary.configs
        if c.link_gbit == link and c.status == "ok" and c.name != "colocated"
    ]


def overhead_by_length(summary: BenchSummary, table: Table) -> str:
    parts = [
        "## Handover overhead against prompt length\n\nOverhead = TTFT p50 − "
        "colocated TTFT p50 at the same length, in ms, same run and requests "
        "(`kvpush.<granularity>`: kvpush with prefill at that "
        "`--push-granularity`; plain `kvpush`: the launcher's default)."
    ]
    for link in summary.link_rates:
        names = pd_names(summary, link)
        header = ["prompt tokens", "colocated TTFT p50", *names]
        rows = []
        for info in summary.points:
            base = _p50(summary, "colocated", link, info.index)
            cells = [_num(overhead(summary, n, link, info.index)) for n in names]
            rows.append([f"{int(info.x)}", _num(base), *cells])
        title = "" if link is None else f"**{rate(link)}**\n\n"
        parts.append(title + table(header, rows))
    return "\n\n".join(parts)


def details(summary: BenchSummary, table: Table) -> str:
    header = [
        "link", "prompt tokens", "config", "overhead ms", "÷ vllm-pull",
        "prefill sent MiB/req", "KV MiB/req", "WRITEs/transfer",
        "posted before p50", "crossed before ≥ p50", "tail ms p50",
    ]  # fmt: skip
    rows = []
    for link in summary.link_rates:
        for info in summary.points:
            pull = overhead(summary, PULL, link, info.index)
            for name in pd_names(summary, link):
                rows.append(_detail_row(summary, name, link, info, pull))
    return (
        "## Bytes and overlap per prompt length\n\n"
        "**prefill sent** is what the prefill host's link counters counted per "
        "request (KV, HTTP and TCP/IP overhead; see Over the links), **KV** "
        "what the prompt needed. For kvpush, from prefill's trace, medians over "
        "the point's transfers: **posted before** is the share of a transfer's "
        "bytes whose WRITE was posted by the end of the forward of the "
        "prompt's last chunk (`kv_ready`), an upper bound on what crossed "
        "before it; **crossed before ≥** the lower bound "
        "1 − tail × nominal rate ÷ bytes; **tail** = `write_done` (the last "
        "WRITE complete) − `kv_ready`, the transfer's exposed part. The trace "
        "marks `write_done` only on a transfer's last WRITE and its marks "
        "carry no per-WRITE id, so an earlier WRITE's completion cannot be "
        "matched to it: the share that crossed is bracketed, not measured.\n\n"
        + table(header, rows)
    )


def _detail_row(
    summary: BenchSummary,
    name: str,
    link: float | None,
    info: PointInfo,
    pull: float | None,
) -> list[str]:
    over = overhead(summary, name, link, info.index)
    result = _config(summary, name, link)
    point = result.point(info.index) if result is not None else None
    lu = point.links if point is not None else None
    sent = _num(lu.mib_per_request(lu.prefill_sent)) if lu is not None else "–"
    kv = _num(lu.kv_mib_per_request) if lu is not None else "–"
    cells = _overlap_cells(point.overlap if point is not None else None)
    return [
        rate(link), f"{int(info.x)}", name, _num(over), _ratio(over, pull),
        sent, kv, *cells,
    ]  # fmt: skip


def _overlap_cells(ov: OverlapStats | None) -> list[str]:
    if ov is None:
        return ["–", "–", "–", "–"]
    crossed = ov.crossed_before_at_least
    return [
        f"{ov.writes_per_transfer:g}",
        _pct(ov.posted_before.p50),
        _pct(crossed.p50) if crossed is not None else "–",
        _num(ov.tail_ms.p50),
    ]


def _config(
    summary: BenchSummary, name: str, link: float | None
) -> ConfigResult | None:
    return next(
        (c for c in summary.configs
         if c.name == name and c.link_gbit == link and c.status == "ok"),
        None,
    )  # fmt: skip


def _p50(
    summary: BenchSummary, name: str, link: float | None, point: int
) -> float | None:
    config = _config(summary, name, link)
    result = config.point(point) if config is not None else None
    if result is None or result.stats.ttft_ms is None:
        return None
    return result.stats.ttft_ms.p50


def _num(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}" if abs(value) < 100 else f"{value:.0f}"


def _pct(share: float) -> str:
    return f"{100 * share:.0f} %"


def _ratio(value: float | None, reference: float | None) -> str:
    r = ratio(value, reference)
    return "–" if r is None else f"{r:.2f}"
