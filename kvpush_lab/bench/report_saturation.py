"""The report's parts for the saturation workload: pure rendering.

Per load and configuration: the achieved rate against the offered one
(where it falls behind, the cluster is saturated), output throughput,
TTFT and TPOT p50/p99, goodput at the stated SLO, and the router's mean
handover and prefill leg.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvpush_lab.bench.summary import BenchSummary, ConfigResult, PointInfo, PointResult

Table = Callable[[Sequence[str], Sequence[Sequence[str]]], str]
PULL, PUSH, KVPUSH = "vllm-pull", "vllm-push", "kvpush"


def workload_line(s: dict[str, Any]) -> str:
    """Setup's workload line."""
    rates = ", ".join(f"{q:g}" for q in s.get("qps") or [])
    return (
        f"saturation (decode-bound): {s.get('num_requests')} requests per point, "
        f"Poisson arrivals at {rates} req/s; prompts {s.get('prompt_len')} "
        f"tokens (random token ids, exact), outputs {s.get('output_len')} tokens "
        f"(ignore_eos); seed {s.get('seed')}; {s.get('num_warmup')} warm-up "
        "requests per configuration, excluded. Goodput SLO: "
        f"{slo_text(s)}"
    )


def slo_text(s: dict[str, Any]) -> str:
    return f"TTFT ≤ {s.get('slo_ttft_ms'):g} ms and TPOT ≤ {s.get('slo_tpot_ms'):g} ms"


def saturation_sections(summary: BenchSummary, table: Table) -> list[str]:
    """The load table (none unless the workload was saturation)."""
    if summary.settings.get("workload") != "saturation":
        return []
    return [_loads(summary, table)]


def _ok(summary: BenchSummary) -> list[ConfigResult]:
    return [c for c in summary.configs if c.status == "ok"]


def _loads(summary: BenchSummary, table: Table) -> str:
    header = [
        "offered req/s", "config", "achieved req/s", "out tok/s", "TTFT p50",
        "TTFT p99", "TPOT p50", "TPOT p99", "goodput req/s", "met SLO",
        "router handover mean", "prefill leg mean",
    ]  # fmt: skip
    rows = [
        _row(info, config, config.point(info.index))
        for info in summary.points
        for config in _ok(summary)
    ]
    return (
        "## Decode-bound load: throughput, goodput and handover\n\n"
        f"Goodput counts the requests that met the SLO ({slo_text(summary.settings)}) "
        "per second of the point; **met SLO** is their share of those sent. "
        "Decode is saturated where output throughput stops growing with the "
        "offered rate (which asks for rate × output tokens per second) and "
        "TPOT rises instead. Rates divide by the point's duration, first send "
        "to last end, so with few requests the last ones' decoding tail lowers "
        "them: compare configurations at one rate. **router handover** = the "
        "router's mean time from the "
        "prefill leg's answer to decode's first byte (0 where decode's came "
        "first): TTFT minus the prefill leg, per request, so queueing both "
        "share cancels; **prefill leg**: the router's mean prefill leg. "
        "Times in ms.\n\n" + table(header, rows)
    )


def _row(info: PointInfo, config: ConfigResult, r: PointResult | None) -> list[str]:
    if r is None:
        return [f"{info.load:g}", config.label, *["–"] * 10]
    st, gp, legs = r.stats, r.goodput, r.router
    ttft, tpot = st.ttft_ms, st.tpot_ms
    return [
        f"{info.load:g}", config.label, f"{st.request_throughput:.2f}",
        f"{st.output_throughput:.0f}",
        _num(ttft.p50 if ttft else None), _num(ttft.p99 if ttft else None),
        _num(tpot.p50 if tpot else None), _num(tpot.p99 if tpot else None),
        "–" if gp is None else f"{gp.per_s:.2f}",
        "–" if gp is None else f"{gp.num_met} / {gp.num_requests}",
        _num(legs.handover_mean_ms if legs else None),
        _num(legs.prefill_mean_ms if legs else None),
    ]  # fmt: skip


def _num(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"
