"""Latency and throughput statistics, as ``vllm bench serve`` defines them.

Per successful request, from the client's streamed chunks:

- **TTFT**: first chunk carrying a generated token − send;
- **E2E latency**: last such chunk − send;
- **TPOT**: (E2E − TTFT) / (output tokens − 1), for requests of 2+ tokens;
- **ITL**: every gap between consecutive token chunks (pooled over requests).

A request whose tokens all reached the client within :data:`BURST_S` is
counted as one burst: the serving processes fell behind and flushed its
stream at once, so its TTFT includes the decoding and its TPOT is about 0
(common when a small machine's cores are oversubscribed).

Per sweep point: the duration runs from the first send to the last
response's end; throughputs are successful requests, their output tokens,
and their prompt + output tokens, each divided by that duration. Failed
requests count as errors by kind and add nothing to latencies.
Percentiles interpolate linearly between ranks (numpy's default).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np

from kvpush_lab.bench.records import RequestRecord

PERCENTILES = (50, 90, 99)
BURST_S = 0.001


class Dist(msgspec.Struct, frozen=True, kw_only=True):
    """Summary of a sample: count, mean, p50, p90, p99, min, max."""

    n: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Dist | None:
        """The summary of ``values`` (None when there are none)."""
        ordered = sorted(values)
        if not ordered:
            return None
        return cls(
            n=len(ordered),
            mean=math.fsum(ordered) / len(ordered),
            p50=percentile(ordered, 50),
            p90=percentile(ordered, 90),
            p99=percentile(ordered, 99),
            min=ordered[0],
            max=ordered[-1],
        )


def percentile(ordered: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0-100) of the values, interpolating linearly
    between the two closest ranks (numpy's default)."""
    if not ordered:
        raise ValueError("percentile of an empty sample")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be within 0..100, not {p}")
    return float(np.percentile(ordered, p))


def ttft_s(rec: RequestRecord) -> float | None:
    if not rec.is_ok or not rec.token_times_s:
        return None
    return rec.token_times_s[0]


def e2e_s(rec: RequestRecord) -> float | None:
    if not rec.is_ok or not rec.token_times_s:
        return None
    return rec.token_times_s[-1]


def tpot_s(rec: RequestRecord) -> float | None:
    """Time per output token after the first (None below two tokens)."""
    first, last = ttft_s(rec), e2e_s(rec)
    if first is None or last is None or rec.num_output_tokens < 2:
        return None
    return (last - first) / (rec.num_output_tokens - 1)


def ttst_s(rec: RequestRecord) -> float | None:
    """Time to the second token: when the second chunk carrying a token
    arrived (the first, when it carried both; None below two tokens)."""
    times = rec.token_times_s
    if not rec.is_ok or not times or rec.num_output_tokens < 2:
        return None
    return times[1] if len(times) > 1 else times[0]


def is_one_burst(rec: RequestRecord) -> bool:
    """Two or more tokens, all received within BURST_S of each other."""
    first, last = ttft_s(rec), e2e_s(rec)
    if first is None or last is None or rec.num_output_tokens < 2:
        return False
    return last - first < BURST_S


def itls_s(rec: RequestRecord) -> list[float]:
    """Gaps between consecutive token chunks."""
    if not rec.is_ok:
        return []
    times = rec.token_times_s
    return [b - a for a, b in itertools.pairwise(times)]


class PointStats(msgspec.Struct, frozen=True, kw_only=True):
    """One configuration at one sweep point. Latencies in milliseconds,
    throughputs per second."""

    num_requests: int
    num_ok: int
    num_errors: int
    errors: dict[str, int]
    num_short_output: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Dist | None
    tpot_ms: Dist | None
    itl_ms: Dist | None
    e2e_ms: Dist | None
    num_one_burst: int = 0
    ttst_ms: Dist | None = None  # time to the second token


def summarize_point(records: Sequence[RequestRecord]) -> PointStats:
    """Statistics over every record of one configuration at one point."""
    ok = [r for r in records if r.is_ok]
    duration = _duration_s(records)
    output_tokens = sum(r.num_output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or r.prompt_len for r in ok)
    return PointStats(
        num_requests=len(records),
        num_ok=len(ok),
        num_errors=len(records) - len(ok),
        errors=dict(Counter(r.error for r in records if r.error is not None)),
        num_short_output=sum(r.is_short for r in records),
        duration_s=duration,
        request_throughput=_rate(len(ok), duration),
        output_throughput=_rate(output_tokens, duration),
        total_token_throughput=_rate(prompt_tokens + output_tokens, duration),
        ttft_ms=_ms(ttft_s(r) for r in ok),
        tpot_ms=_ms(tpot_s(r) for r in ok),
        itl_ms=_ms(gap for r in ok for gap in itls_s(r)),
        e2e_ms=_ms(e2e_s(r) for r in ok),
        num_one_burst=sum(is_one_burst(r) for r in ok),
        ttst_ms=_ms(ttst_s(r) for r in ok),
    )


def _ms(values: Iterable[float | None]) -> Dist | None:
    return Dist.of(1000 * v for v in values if v is not None)


def _duration_s(records: Sequence[RequestRecord]) -> float:
    if not records:
        return 0.0
    start = min(r.sent_s for r in records)
    end = max(r.sent_s + (r.end_s or 0.0) for r in records)
    return max(0.0, end - start)


def _rate(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0


def ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference``, None when either is missing or zero."""
    if value is None or not reference:
        return None
    return value / reference
