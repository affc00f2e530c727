"""The router's own view of each request's legs, from its ``/metrics``.

The router (in front of every configuration) times, per request, the
prefill leg (``kvpush_router_prefill_leg_seconds``, by outcome) and the
handover: from the prefill leg's whole answer to decode's first byte
(``kvpush_router_handover_seconds``; 0 where decode's came first, as when
kvpush binds both legs at once). Both are histograms; read before and
after a point, their difference gives the point's legs exactly in count
and sum, so their means. The mean handover is TTFT minus the prefill leg,
per request and averaged: the queueing both legs share cancels. A
colocated cluster has no prefill leg and shows none. Pure.
"""

from __future__ import annotations

import msgspec

from kvpush.telemetry import names
from kvpush.telemetry.reader import Exposition


class LegTotals(msgspec.Struct, frozen=True, kw_only=True):
    """Cumulative counts and sums (seconds) of one reading."""

    num_handovers: float = 0.0
    handover_s: float = 0.0
    num_prefills: float = 0.0  # successful prefill legs
    prefill_s: float = 0.0

    def minus(self, earlier: LegTotals) -> LegTotals:
        return LegTotals(
            num_handovers=self.num_handovers - earlier.num_handovers,
            handover_s=self.handover_s - earlier.handover_s,
            num_prefills=self.num_prefills - earlier.num_prefills,
            prefill_s=self.prefill_s - earlier.prefill_s,
        )


class RouterLegs(msgspec.Struct, frozen=True, kw_only=True):
    """One point's legs as the router timed them (means in ms)."""

    num_handovers: int
    handover_mean_ms: float | None
    num_prefills: int
    prefill_mean_ms: float | None


def parse_leg_totals(text: str) -> LegTotals:
    """The router's handover and successful prefill-leg totals (``ValueError``
    when the text does not parse)."""
    metrics = Exposition.parse(text)
    handover, prefill = names.ROUTER_HANDOVER, names.ROUTER_PREFILL_LEG
    return LegTotals(
        num_handovers=metrics.total(handover.count) or 0.0,
        handover_s=metrics.total(handover.sum) or 0.0,
        num_prefills=metrics.total(prefill.count, outcome="ok") or 0.0,
        prefill_s=metrics.total(prefill.sum, outcome="ok") or 0.0,
    )


def router_legs(before: LegTotals | None, after: LegTotals | None) -> RouterLegs | None:
    """The legs between two readings (None: a reading is missing, or the
    router timed no leg, as colocated)."""
    if before is None or after is None:
        return None
    d = after.minus(before)
    if d.num_handovers <= 0 and d.num_prefills <= 0:
        return None
    return RouterLegs(
        num_handovers=round(d.num_handovers),
        handover_mean_ms=_mean_ms(d.handover_s, d.num_handovers),
        num_prefills=round(d.num_prefills),
        prefill_mean_ms=_mean_ms(d.prefill_s, d.num_prefills),
    )


def _mean_ms(total_s: float, count: float) -> float | None:
    return 1000 * total_s / count if count > 0 else None
