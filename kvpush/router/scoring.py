"""Scores of candidate instances, and the pick among them.

Pure and on the router's event loop only. A score is in "request
equivalents", lower is better. ``planner.py`` builds a :class:`Load` per
candidate (the router's own legs in flight on it, plus its scraped
:class:`~kvpush.router.signals.InstanceSignals`, None when unknown) and calls
:func:`prefill_score` or :func:`decode_score`, then :func:`pick`.

The terms (weights in :class:`ScoreWeights`):

- **queue**: ``max(router's legs in flight, running + waiting)``: the
  router's own count is current to the request, the instance's counts
  include other routers' requests; waiting requests cost extra (they have
  not even started);
- **KV** (decode): used KV-cache fraction, plus a large penalty at or above
  ``kv_full_at`` (a new request there preempts another);
- **unknown**: a stale or absent read costs ``unknown`` on top of the
  router's own count, so an unknown instance never looks idle;
- **transfer**: the pair's recent handover mean per second (a pair not
  measured yet: the prefill's mean over those it has) and the bytes still
  in flight to that decode per MiB;
- **prefix** (decode): minus ``prefix`` times the fraction of the prompt
  the decode holds.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvpush.router.signals import InstanceSignals, PairFigures

T = TypeVar("T")
MIB = 1024 * 1024


@dataclass(frozen=True)
class ScoreWeights:
    """The weights of each score term (request equivalents per unit)."""

    waiting: float = 1.0
    kv_usage: float = 4.0
    kv_full_at: float = 0.95
    kv_full: float = 100.0
    unknown: float = 4.0
    handover_per_s: float = 100.0  # 10 ms of handover cost one request
    in_flight_per_mib: float = 0.05
    prefix: float = 4.0


@dataclass(frozen=True)
class Load:
    """What the router knows of one instance's load now."""

    num_in_flight: int
    signals: InstanceSignals | None


def queue_score(load: Load, w: ScoreWeights) -> float:
    """The queue term (and the unknown penalty when there is no fresh read)."""
    s = load.signals
    if s is None:
        return load.num_in_flight + w.unknown
    busy = max(load.num_in_flight, s.num_running + s.num_waiting)
    return busy + w.waiting * s.num_waiting


def busy_score(load: Load, w: ScoreWeights) -> float:
    """How far a decode is from clearly free: its queue term, plus the KV
    penalty when its cache is nearly full (binding ``auto`` binds late above
    a threshold of this)."""
    usage = None if load.signals is None else load.signals.kv_usage
    full = usage is not None and usage >= w.kv_full_at
    return queue_score(load, w) + (w.kv_full if full else 0.0)


def kv_score(load: Load, w: ScoreWeights) -> float:
    """The KV term; unknown usage costs half the full weight."""
    usage = None if load.signals is None else load.signals.kv_usage
    if usage is None:
        return w.kv_usage / 2
    return w.kv_usage * usage + (w.kv_full if usage >= w.kv_full_at else 0.0)


def transfer_score(
    pair: PairFigures | None, w: ScoreWeights, typical_s: float | None = None
) -> float:
    """The transfer term of a prefill-decode pair. A handover not measured
    yet costs ``typical_s``, the prefill's mean over the pairs it has
    measured (0 when it has none): unknown is not free, or a measured pair
    would always lose to an unmeasured one."""
    handover = pair.handover_s if pair is not None else None
    if handover is None:
        handover = typical_s or 0.0
    in_flight = 0.0 if pair is None else pair.bytes_in_flight
    return w.handover_per_s * handover + w.in_flight_per_mib * (in_flight / MIB)


def prefill_score(
    load: Load,
    pair: PairFigures | None,
    w: ScoreWeights,
    typical_s: float | None = None,
) -> float:
    """A prefill's score: its queue, plus the transfer to the chosen decode."""
    return queue_score(load, w) + transfer_score(pair, w, typical_s)


def decode_score(
    load: Load, transfer: float, held_fraction: float, w: ScoreWeights
) -> float:
    """A decode's score: queue, KV, the expected ``transfer`` term (0 when
    no prefill leg will run) and the prefix it holds (0..1 of the prompt)."""
    return (
        queue_score(load, w)
        + kv_score(load, w)
        + transfer
        - w.prefix * max(0.0, min(1.0, held_fraction))
    )


def pick(
    candidates: Sequence[T],
    score: Callable[[T], float],
    turn: int,
    rng: random.Random,
    full_scan_max: int = 4,
) -> T:
    """The best of ``candidates`` by ``score``.

    Up to ``full_scan_max`` candidates every one is scored and ties go to
    the first in an order rotated by ``turn`` (so equal instances take turns,
    as round robin did). Above it, two distinct candidates drawn from
    ``rng`` are compared (power of two choices): a score per request stays
    O(1) and replicas with slightly stale views do not herd onto one
    instance.
    """
    if not candidates:
        raise ValueError("no candidate to pick from")
    n = len(candidates)
    if n <= full_scan_max:
        start = turn % n
        ordered = [*candidates[start:], *candidates[:start]]
    else:
        first, second = rng.sample(range(n), 2)
        ordered = [candidates[first], candidates[second]]
    best, best_score = ordered[0], score(ordered[0])
    for candidate in ordered[1:]:
        value = score(candidate)
        if value < best_score:
            best, best_score = candidate, value
    return best
