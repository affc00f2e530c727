"""Goodput: the requests that met a latency SLO, per second. Pure.

A request meets the SLO when it succeeded, its TTFT is at most
``ttft_ms`` and its TPOT at most ``tpot_ms`` (a one-token answer has no
TPOT and meets that half). Goodput is the number that met it divided by
the point's duration, first send to last response, as the throughputs of
:mod:`kvpush_lab.bench.stats`; ``share`` is that number over the requests
sent (failures count against it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from kvpush_lab.bench.records import RequestRecord
from kvpush_lab.bench.stats import tpot_s, ttft_s


@dataclass(frozen=True)
class Slo:
    """The latency a request must meet to count, in ms."""

    ttft_ms: float
    tpot_ms: float

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.tpot_ms <= 0:
            raise ValueError(f"an SLO must be positive, not {self}")

    def is_met(self, record: RequestRecord) -> bool:
        first = ttft_s(record)
        if not record.is_ok or first is None or 1000 * first > self.ttft_ms:
            return False
        per_token = tpot_s(record)
        return per_token is None or 1000 * per_token <= self.tpot_ms

    def describe(self) -> str:
        return f"TTFT ≤ {self.ttft_ms:g} ms and TPOT ≤ {self.tpot_ms:g} ms"


class Goodput(msgspec.Struct, frozen=True, kw_only=True):
    """One point's requests that met the SLO: how many, what share of those
    sent, and per second of the point."""

    slo_ttft_ms: float
    slo_tpot_ms: float
    num_met: int
    num_requests: int
    share: float
    per_s: float


def goodput(records: Sequence[RequestRecord], slo: Slo, duration_s: float) -> Goodput:
    """The goodput of one point's ``records`` over ``duration_s``."""
    met = sum(slo.is_met(r) for r in records)
    return Goodput(
        slo_ttft_ms=slo.ttft_ms,
        slo_tpot_ms=slo.tpot_ms,
        num_met=met,
        num_requests=len(records),
        share=met / len(records) if records else 0.0,
        per_s=met / duration_s if duration_s > 0 else 0.0,
    )
