"""Deadlines by key, cheap to ask about on every wake of a polling thread.

A :class:`Deadlines` is a binary heap with lazy deletion: setting a key's
deadline pushes an entry, discarding a key only forgets it, and stale heap
entries are skipped (and dropped) when they reach the top. So
:meth:`~Deadlines.earliest` is O(1) amortised, :meth:`~Deadlines.pop_due`
is O(k log n) for k keys due, and a thread that wakes to find nothing due
pays nothing for the n keys still waiting. The heap is rebuilt when stale
entries outnumber live ones, so memory stays O(n).

Pure bookkeeping with no clock of its own; owned by one thread (the
matcher's). Keys must be hashable and orderable: keys due at the same
instant come out in key order.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

_COMPACT_SLACK = 64  # stale entries tolerated beyond the live count


class Deadlines(Generic[K]):
    """At most one deadline per key; the earliest first."""

    def __init__(self) -> None:
        self._current: dict[K, float] = {}
        self._heap: list[tuple[float, K]] = []

    def set(self, key: K, deadline: float) -> None:
        """Give ``key`` this deadline (replacing any it had)."""
        self._current[key] = deadline
        heapq.heappush(self._heap, (deadline, key))
        if len(self._heap) > 2 * len(self._current) + _COMPACT_SLACK:
            self._compact()

    def discard(self, key: K) -> None:
        """Forget ``key`` (nothing if it has no deadline)."""
        self._current.pop(key, None)

    def earliest(self) -> float | None:
        """The earliest deadline of any key, or None when there are none."""
        self._skip_stale()
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[K]:
        """Keys whose deadline is ``<= now``, earliest first (ties in key
        order); they are forgotten."""
        due: list[K] = []
        while self._heap and self._heap[0][0] <= now:
            deadline, key = heapq.heappop(self._heap)
            if self._current.get(key) == deadline:
                del self._current[key]
                due.append(key)
        return due

    def __contains__(self, key: object) -> bool:
        return key in self._current

    def __len__(self) -> int:
        return len(self._current)

    @property
    def num_stored(self) -> int:
        """Heap entries, stale ones included (bounded by about twice the live
        count)."""
        return len(self._heap)

    def _skip_stale(self) -> None:
        while self._heap:
            deadline, key = self._heap[0]
            if self._current.get(key) == deadline:
                return
            heapq.heappop(self._heap)

    def _compact(self) -> None:
        self._heap = [(d, k) for k, d in self._current.items()]
        heapq.heapify(self._heap)
