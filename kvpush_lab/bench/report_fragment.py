"""The report's parts for the fragmented workload: pure rendering.

Per configuration, at both points (a fresh cache, then after the churn):
descriptors per KV transfer, post time where vLLM's telemetry has one, the
long prompts' TTFT, and the TPOT and ITL of the plain requests decoding on
decode meanwhile; then each configuration's change from the first point
to the second, and what the churn did.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvpush.telemetry import names
from kvpush_lab.bench.fragment import Meanwhile, TransferDescs
from kvpush_lab.bench.summary import BenchSummary, ConfigResult, PointInfo

Table = Callable[[Sequence[str], Sequence[Sequence[str]]], str]
PULL, KVPUSH = "vllm-pull", "kvpush"


def workload_line(s: dict[str, Any]) -> str:
    """Setup's workload line."""
    return (
        f"fragmented: {s.get('num_requests')} requests of {s.get('prompt_len')} "
        f"prompt tokens and {s.get('output_len')} output tokens "
        f"({s.get('arrival')} {_load(s)}) on a fresh KV cache (**fresh cache**), "
        f"then a churn of {s.get('churn_requests')} requests "
        f"({s.get('churn_concurrency')} in flight, prompts "
        f"{s.get('churn_prompt_len')} tokens, outputs {s.get('churn_output_len')} "
        f"tokens, {float(s.get('churn_abort_fraction') or 0):.0%} of those of "
        "2+ tokens aborted by the client after a random 1 to output − 1 "
        "tokens) to scatter the free blocks, then as many requests again, "
        f"prompts of their own (**after churn**); block size "
        f"{s.get('block_size') or 'vLLM default'}; meanwhile "
        f"{s.get('background_concurrency')} plain requests "
        f"({s.get('background_prompt_len')}-token prompts, "
        f"{s.get('background_output_len')} output tokens) decode straight on "
        f"decode{s.get('background_decode')} (colocated: its one instance); seed "
        f"{s.get('seed')}; {s.get('num_warmup')} warm-up requests per "
        "configuration, excluded"
    )


def _load(s: dict[str, Any]) -> str:
    values = s.get("qps") if s.get("arrival") == "poisson" else s.get("concurrency")
    return ", ".join(f"{v:g}" for v in values or [])


def fragment_sections(summary: BenchSummary, table: Table) -> list[str]:
    """Descriptors and decoding per point, the changes, the churn (none
    unless the workload was fragmented)."""
    if summary.settings.get("workload") != "fragmented" or len(summary.points) != 2:
        return []
    return [
        _figures(summary, table),
        _changes(summary, table),
        _churn(summary, table),
    ]


def _ok(summary: BenchSummary) -> list[ConfigResult]:
    return [c for c in summary.configs if c.status == "ok"]


def _figures(summary: BenchSummary, table: Table) -> str:
    header = [
        "config", "point", "transfers", "descriptors / transfer mean",
        "p50", "max", "WRITEs / transfer", "post ms mean",
        "TTFT p50", "TTFT p99", "meanwhile TPOT p50", "meanwhile TPOT p99",
        "meanwhile ITL p99",
    ]  # fmt: skip
    rows = [
        _figure_row(config, info) for config in _ok(summary) for info in summary.points
    ]
    return (
        "## Fragmented KV: descriptors per transfer and decoding meanwhile\n\n"
        "Descriptors per KV transfer: vLLM's from NIXL's telemetry "
        f"(`{names.NIXL_NUM_DESCRIPTORS.name}` and "
        f"`{names.NIXL_POST_TIME.name}` on the posting instance's `/metrics`, "
        "read around each point: the mean is "
        "exact, the median and max known to a histogram bucket); kvpush's from "
        "prefill's trace, summed over a transfer's WRITEs (one descriptor per "
        "run of blocks contiguous on both sides, per layer; several WRITEs "
        "where it streams per chunk or layer). kvpush posts on prefill's "
        "writer thread, off decode's loop, and does not time the post. vLLM's "
        "post time includes UCX's `cma` copy of the KV on this machine (in "
        "decode's loop for vllm-pull). **meanwhile**: the plain requests "
        "decoding on "
        "decode during the point, on their tokens within its window (TPOT per "
        "request, ITL every gap). Times in ms.\n\n" + table(header, rows)
    )


def _figure_row(config: ConfigResult, info: PointInfo) -> list[str]:
    result = config.point(info.index)
    fragment = result.fragment if result is not None else None
    transfers = fragment.transfers if fragment is not None else None
    during = fragment.meanwhile if fragment is not None else None
    ttft = result.stats.ttft_ms if result is not None else None
    return [
        config.label, info.label, *_transfer_cells(transfers),
        _num(ttft.p50 if ttft else None), _num(ttft.p99 if ttft else None),
        *_meanwhile_cells(during),
    ]  # fmt: skip


def _transfer_cells(t: TransferDescs | None) -> list[str]:
    if t is None:
        return ["–"] * 6
    if t.descs_p50_range is not None:
        low, high = t.descs_p50_range
        p50 = f"({low:g}, {high:g}]"
    else:
        p50 = _num(t.descs_p50)
    bound = "≤ " if t.source == "NIXL telemetry" else ""
    top = "–" if t.descs_max is None else f"{bound}{t.descs_max:g}"
    return [
        str(t.num_transfers), _num(t.descs_mean), p50, top,
        _num(t.writes_per_transfer), _num(t.post_mean_ms, 2),
    ]  # fmt: skip


def _meanwhile_cells(m: Meanwhile | None) -> list[str]:
    if m is None:
        return ["–", "–", "–"]
    tpot, itl = m.tpot_ms, m.itl_ms
    return [
        _num(tpot.p50 if tpot else None),
        _num(tpot.p99 if tpot else None),
        _num(itl.p99 if itl else None),
    ]


def meanwhile_tpot(config: ConfigResult, point: int, pct: str) -> float | None:
    """The background's TPOT percentile during one point."""
    result = config.point(point)
    fragment = result.fragment if result is not None else None
    during = fragment.meanwhile if fragment is not None else None
    tpot = during.tpot_ms if during is not None else None
    return None if tpot is None else float(getattr(tpot, pct))


def _change(before: float | None, after: float | None, digits: int = 2) -> str:
    if before is None or after is None:
        return "–"
    delta = after - before
    share = f" ({delta / before:+.0%})" if before else ""
    return f"{delta:+.{digits}f}{share}"


def _changes(summary: BenchSummary, table: Table) -> str:
    fresh, churned = (p.index for p in summary.points)
    header = [
        "config", "meanwhile TPOT p50 change", "meanwhile TPOT p99 change",
        "descriptors / transfer change",
    ]  # fmt: skip
    rows = []
    for config in _ok(summary):
        rows.append([
            config.label,
            _change(meanwhile_tpot(config, fresh, "p50"),
                    meanwhile_tpot(config, churned, "p50")),
            _change(meanwhile_tpot(config, fresh, "p99"),
                    meanwhile_tpot(config, churned, "p99")),
            _change(_descs(config, fresh), _descs(config, churned), 0),
        ])  # fmt: skip
    return (
        "## Fragmented KV: after churn against fresh cache\n\n"
        "After churn − fresh cache, ms (descriptors: count), and as a share of "
        "the fresh cache's figure.\n\n" + table(header, rows)
    )


def _descs(config: ConfigResult, point: int) -> float | None:
    result = config.point(point)
    fragment = result.fragment if result is not None else None
    transfers = fragment.transfers if fragment is not None else None
    return None if transfers is None else transfers.descs_mean


def _churn(summary: BenchSummary, table: Table) -> str:
    rows = []
    for config in _ok(summary):
        c = config.churn
        if c is None:
            continue
        errors = ", ".join(f"{k} {n}" for k, n in sorted(c.errors.items()))
        failed = f"{c.num_failed} ({errors})" if errors else str(c.num_failed)
        rows.append([
            config.label, str(c.num_requests), str(c.num_completed),
            str(c.num_aborted), failed, f"{c.duration_s:.1f}",
        ])  # fmt: skip
    if not rows:
        return ""
    header = ["config", "churn sent", "completed", "aborted", "failed", "took s"]
    return (
        "## Fragmented KV: the churn\n\nThe churn's requests between the two "
        "points (aborted: by the client, as planned).\n\n" + table(header, rows)
    )


def _num(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}" if abs(value) < 100 else f"{value:.0f}"
