"""Repeated, interleaved rounds (``kvpush bench --repeat N``): pure logic.

A repeated run measures every configuration once per round, in the same
order each round (A B C D, A B C D, ...), each time on a fresh cluster: a
round is a whole single run. Drift on a shared machine then reaches every
configuration of a round alike, and the ratio of two configurations is
taken within each round, against the same round's reference. Over the
rounds each ratio is summarised by its median and its min-max
(:class:`Spread`): a difference is *consistent* when every round's ratio
lies on the same side of 1.

Rounds are numbered from 1; ``None`` is the round of a run that is not
repeated (``--repeat 1``), so single runs keep their files and labels.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

import msgspec

T = TypeVar("T")
Round = int | None


def rounds_of(repeat: int) -> list[Round]:
    """The rounds of a run: ``[None]`` when not repeated, else ``1..repeat``."""
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, not {repeat}")
    return [None] if repeat == 1 else list(range(1, repeat + 1))


def round_order(items: Sequence[T], repeat: int) -> list[tuple[Round, T]]:
    """``items`` once per round, in the same order every round."""
    return [(r, item) for r in rounds_of(repeat) for item in items]


class Spread(msgspec.Struct, frozen=True, kw_only=True):
    """A value over rounds: its median, min and max, over ``n`` rounds."""

    n: int
    median: float
    min: float
    max: float

    @property
    def width(self) -> float:
        """max - min."""
        return self.max - self.min

    def side_of(self, reference: float = 1.0) -> int:
        """-1 when every round is below ``reference``, 1 when every round is
        above it, 0 when the rounds straddle it (or touch it)."""
        if self.max < reference:
            return -1
        if self.min > reference:
            return 1
        return 0


def spread(values: Iterable[float | None]) -> Spread | None:
    """The spread of the values that are there (None when none is)."""
    present = sorted(v for v in values if v is not None)
    if not present:
        return None
    return Spread(
        n=len(present),
        median=statistics.median(present),
        min=present[0],
        max=present[-1],
    )


def ratios_per_round(
    values: Mapping[Round, float | None], references: Mapping[Round, float | None]
) -> dict[Round, float]:
    """Each round's ``value / reference``, for rounds that have both (and a
    non-zero reference)."""
    out = {}
    for r, value in values.items():
        reference = references.get(r)
        if value is not None and reference:
            out[r] = value / reference
    return out


def ratio_spread(
    values: Mapping[Round, float | None], references: Mapping[Round, float | None]
) -> Spread | None:
    """The spread over rounds of the per-round ratio (None: no round has both)."""
    return spread(ratios_per_round(values, references).values())


def describe(s: Spread | None, digits: int = 2, mark_side: bool = False) -> str:
    """``0.82 [0.78–0.90]`` (``–`` for None; one round: the value alone).
    With ``mark_side``, bold where every round is on one side of 1."""
    if s is None:
        return "–"
    if s.n == 1:
        return f"{s.median:.{digits}f}"
    text = f"{s.median:.{digits}f} [{s.min:.{digits}f}–{s.max:.{digits}f}]"
    return f"**{text}**" if mark_side and s.side_of(1.0) else text


def describe_ms(s: Spread | None) -> str:
    """A spread of milliseconds, as the report writes them."""
    if s is None:
        return "–"

    def num(v: float) -> str:
        return f"{v:.1f}" if abs(v) < 100 else f"{v:.0f}"

    if s.n == 1:
        return num(s.median)
    return f"{num(s.median)} [{num(s.min)}–{num(s.max)}]"
