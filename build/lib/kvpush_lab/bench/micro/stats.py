"""Spread of repeated timings: median, p10, p90, min and max. Pure."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Spread:
    """Summary of repeated samples (any unit; the caller names it)."""

    median: float
    p10: float
    p90: float
    low: float
    high: float
    num_samples: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        if not samples:
            raise ValueError("a spread needs at least one sample")
        ordered = sorted(samples)
        return cls(
            median=statistics.median(ordered),
            p10=_quantile(ordered, 0.10),
            p90=_quantile(ordered, 0.90),
            low=ordered[0],
            high=ordered[-1],
            num_samples=len(ordered),
        )

    def scaled(self, factor: float) -> Spread:
        """The same spread in another unit (e.g. seconds to milliseconds)."""
        return Spread(
            self.median * factor,
            self.p10 * factor,
            self.p90 * factor,
            self.low * factor,
            self.high * factor,
            self.num_samples,
        )


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def time_rounds(
    fn: Callable[[], object], rounds: int, setup: Callable[[], object] | None = None
) -> list[float]:
    """Seconds each of ``rounds`` calls of ``fn`` took (``setup`` runs
    untimed before each)."""
    samples = []
    for _ in range(rounds):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples
