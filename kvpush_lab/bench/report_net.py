"""The report's multi-host rehearsal parts: pure rendering.

For a run on ``--hosts netns`` (every link rate a set of clusters): the
handover overhead of each P/D configuration against colocated at each rate,
the bytes over the links next to the KV the requests needed, CPU per GiB
moved, and the achieved bandwidth per KV transfer against the shaped rate
(:mod:`kvpush_lab.bench.links`, :mod:`kvpush_lab.bench.bandwidth`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpush.telemetry import names
from kvpush_lab.bench.bandwidth import MIN_MEASURED_BYTES, BandwidthStats, shaped_mib_s
from kvpush_lab.bench.links import MIB, cpu_per_gib, excess_cpu_s, per_gib
from kvpush_lab.bench.stats import ratio
from kvpush_lab.bench.summary import BenchSummary, ConfigResult, PointInfo, rate

PD_CONFIGS = ("vllm-pull", "vllm-push", "kvpush")

Table = Callable[[Sequence[str], Sequence[Sequence[str]]], str]


def rehearsal_sections(summary: BenchSummary, table: Table) -> list[str]:
    """Overhead, links and bandwidth sections (none off the rehearsal; the
    overhead left out of a prompt-length sweep, which has its own)."""
    if not summary.is_rehearsal:
        return []
    # a prompt-length sweep has its overhead per length (report_sweep)
    by_length = summary.axis == "prompt_len"
    return [
        "" if by_length else overhead_section(summary, table),
        links_section(summary, table),
        bandwidth_section(summary, table),
    ]


def hosts_line(summary: BenchSummary) -> str:
    """The Setup text saying where the instances ran ('' off the rehearsal)."""
    if not summary.is_rehearsal:
        return ""
    rates = ", ".join(rate(r) for r in summary.link_rates)
    return (
        "multi-host rehearsal (`--hosts netns`): each instance in "
        "its own network and IPC namespace with one veth link to a bridge, so "
        "UCX moves the KV over TCP as between hosts; each host's egress shaped "
        f"by tbf to {rates} (a fresh set of clusters per rate; tbf delivers "
        "about 95% of nominal); the router and the client on 127.0.0.1"
    )


def _points(summary: BenchSummary) -> list[tuple[float | None, PointInfo]]:
    return [(r, info) for r in summary.link_rates for info in summary.points]


def _ok(summary: BenchSummary, link: float | None) -> list[ConfigResult]:
    return [c for c in summary.configs if c.link_gbit == link and c.status == "ok"]


def _p50(config: ConfigResult | None, point: int) -> float | None:
    result = config.point(point) if config is not None else None
    if result is None or result.stats.ttft_ms is None:
        return None
    return result.stats.ttft_ms.p50


def _find(summary: BenchSummary, name: str, link: float | None) -> ConfigResult | None:
    return next((c for c in _ok(summary, link) if c.name == name), None)


def overhead(
    summary: BenchSummary, name: str, link: float | None, point: int
) -> float | None:
    """TTFT p50 of ``name`` minus colocated's, same rate and point."""
    mine = _p50(_find(summary, name, link), point)
    base = _p50(_find(summary, "colocated", link), point)
    return None if mine is None or base is None else mine - base


def _pd_names(summary: BenchSummary) -> list[str]:
    """The baselines and kvpush, then any other P/D configuration that ran
    (``kvpush-early``, ``kvpush.chunk``, ...), in run order."""
    ran = [c.name for c in summary.configs if c.status == "ok"]
    others = [n for n in ran if n not in PD_CONFIGS and n != "colocated"]
    return [*PD_CONFIGS, *dict.fromkeys(others)]


def overhead_section(summary: BenchSummary, table: Table) -> str:
    names = _pd_names(summary)
    header = ["link", "point", "colocated TTFT p50"]
    header += [f"{n} overhead" for n in names]
    header += ["kvpush ÷ pull", "kvpush ÷ push"]
    rows = []
    for link, info in _points(summary):
        colocated = _p50(_find(summary, "colocated", link), info.index)
        over = {n: overhead(summary, n, link, info.index) for n in names}
        cells = [_num(over[n]) for n in names]
        rows.append([
            rate(link), info.label, _num(colocated), *cells,
            _ratio(over["kvpush"], over["vllm-pull"]),
            _ratio(over["kvpush"], over["vllm-push"]),
        ])  # fmt: skip
    return (
        "## Handover overhead\n\nOverhead = TTFT p50 − colocated TTFT p50 on "
        "the same links and requests, in ms; the ratios divide kvpush's "
        "overhead by each baseline's.\n\n" + table(header, rows)
    )


def links_section(summary: BenchSummary, table: Table) -> str:
    header = [
        "link", "point", "config", "prefill sent MiB/req", "decode received MiB/req",
        "KV MiB/req", "sent ÷ KV", "CPU s/GiB prefill", "CPU s/GiB decode",
        "CPU s/GiB beyond colocated",
    ]  # fmt: skip
    rows = []
    per_token = None
    for link, info in _points(summary):
        colocated = _find(summary, "colocated", link)
        base = colocated.point(info.index) if colocated else None
        for config in _ok(summary, link):
            result = config.point(info.index)
            if result is None or result.links is None:
                continue
            lu, per_token = result.links, result.links.kv_bytes_per_token
            moves_kv = config.name != "colocated"
            cpu = cpu_per_gib(result.usage, lu)
            beyond = (
                per_gib(excess_cpu_s(result.usage, base.usage), lu.prefill_sent)
                if base is not None and moves_kv
                else None
            )
            rows.append([
                rate(link), info.label, config.name,
                _mib(lu.mib_per_request(lu.prefill_sent)),
                _mib(lu.mib_per_request(lu.decode_received)),
                _mib(lu.kv_mib_per_request),
                _num(lu.sent_over_kv if moves_kv else None, 2),
                _num(cpu.prefill, 2), _num(cpu.decode, 2), _num(beyond, 2),
            ])  # fmt: skip
    if not rows:
        return ""
    return (
        "## Over the links\n\n"
        f"Bytes each host's link counters counted during the point, per "
        f"request. **Prefill sent** sums the KV-sending hosts (prefill, or a "
        f"colocated instance), **decode received** the KV-receiving ones. "
        f"**KV** is what the requests needed: prompt tokens × "
        f"{_per_token(per_token)}. The counters also count the HTTP between "
        "router and instances and the TCP/IP and Ethernet overhead of "
        "everything (a colocated instance's link carries only that part). "
        "**CPU s/GiB** divides a side's process-group CPU seconds over the "
        "point (API server, EngineCore and Worker: prompt and decode compute "
        "included) by the GiB its link carried; **beyond colocated** is the "
        "pair's CPU minus the colocated instance's on the same requests, per "
        "GiB prefill sent: what disaggregating cost in CPU, the transfer and "
        "both engines' waiting included.\n\n" + table(header, rows)
    )


def _per_token(per_token: int | None) -> str:
    if per_token is None:
        return "the model's KV bytes per token"
    return f"{per_token} B of KV per token ({per_token / 1024:g} KiB)"


def bandwidth_section(summary: BenchSummary, table: Table) -> str:
    header = [
        "link", "point", "config", "transfer", "timed by", "n (≥ 32 MiB)",
        "MiB each", "MiB/s p50", "MiB/s min–max", "MiB/s mean", "÷ nominal",
    ]  # fmt: skip
    rows = []
    for link, info in _points(summary):
        for config in _ok(summary, link):
            result = config.point(info.index)
            bw = result.bandwidth if result is not None else None
            if bw is not None:
                rows.append([rate(link), info.label, config.name, *_bw_cells(bw)])
    if not rows:
        return ""
    return (
        "## KV transfer bandwidth\n\n"
        "Achieved MiB/s of each KV transfer, against the link's nominal rate "
        f"({_nominal(summary)}). kvpush's WRITEs are timed from its traces "
        "(`write_posted`, once the post returned, to `write_done`, seen by "
        "prefill's 0.5 ms polls): the median and range are over WRITEs. "
        "vLLM's transfers are timed by NIXL's telemetry (post to completion) "
        f"and read from the histograms `{names.NIXL_XFER_TIME.name}` and "
        f"`{names.NIXL_BYTES_TRANSFERRED.name}` on the instances' `/metrics` around "
        "the point: their mean is exact, their median known only to the "
        "histogram's bucket (a range, for transfers of one size). Only "
        f"transfers of at least {MIN_MEASURED_BYTES // MIB} MiB are measured: "
        "below that tbf's burst, not the rate, sets the time. **÷ nominal** "
        "divides the p50 (kvpush) or the mean (vLLM) by the nominal rate.\n\n"
        + table(header, rows)
    )


def _bw_cells(bw: BandwidthStats) -> list[str]:
    if bw.num_measured == 0:
        measured = [f"– (all under {MIN_MEASURED_BYTES // MIB} MiB)", "–", "–", "–"]
    elif bw.mib_s is not None:
        spread = f"{bw.mib_s.min:.0f}–{bw.mib_s.max:.0f}"
        measured = [f"{bw.mib_s.p50:.0f}", spread, _num(bw.mean_mib_s), ""]
    else:
        measured = [_range(bw.mib_s_p50_range), "–", _num(bw.mean_mib_s), ""]
    measured[3] = _num(bw.of_shaped, 2)
    return [
        bw.kind, bw.source, f"{bw.num_measured} of {bw.num_transfers}",
        f"{bw.mib_per_transfer:.1f}", *measured,
    ]  # fmt: skip


def _range(bounds: tuple[float, float | None] | None) -> str:
    if bounds is None:
        return "–"
    low, high = bounds
    return f"{low:.0f}–{'∞' if high is None else f'{high:.0f}'} (bucket)"


def _nominal(summary: BenchSummary) -> str:
    rates = [r for r in summary.link_rates if r is not None]
    if not rates:
        return "unshaped links: no nominal rate"
    return ", ".join(f"{r:g} Gbit/s = {shaped_mib_s(r):.1f} MiB/s" for r in rates)


def _mib(value: float) -> str:
    return f"{value:.2f}" if value >= 0.1 else f"{value:.3f}"


def _num(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}" if abs(value) < 100 else f"{value:.0f}"


def _ratio(value: float | None, reference: float | None) -> str:
    r = ratio(value, reference)
    return "–" if r is None else f"{r:.2f}"
