"""Phase 2 of a prefill transfer: matched, not yet posted.

Owned by the writer's :class:`~kvpush.connector.prefill.pipeline.Pipeline`
(the writer thread); pure bookkeeping, no I/O. A matched transfer may be
posted once the decode boot that registered the blocks said Hello, the
KV's device fence completed and (fault injection only) ``not_before``
passed; it must be posted before the registration's post deadline, which is
checked right before the post, after the fence (the fence wait counts
inside the deadline). :meth:`Posting.sweep` sorts the waiting transfers
into those to post now and those whose deadline passed, with why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvpush.transfer.matcher import Matched
from kvpush.transfer.messages import Cause

ZERO = frozenset({0})  # decode rank 0 alone: no tensor parallelism


@dataclass(frozen=True)
class ToPost:
    matched: Matched
    not_before: float  # fault injection's delay; the match time otherwise
    ranks: frozenset[int] = ZERO  # the decode ranks it is written to

    @property
    def transfer_id(self) -> str:
        return self.matched.transfer_id

    @property
    def engine(self) -> str:
        return self.matched.registration.decode_engine_id

    @property
    def boot(self) -> str:
        return self.matched.registration.decode_boot_id


@dataclass(frozen=True)
class Overdue:
    """A matched transfer whose post deadline passed before it could go."""

    item: ToPost
    cause: Cause
    why: str
    event: str | None  # the counter to add, if any


class Posting:
    """Matched transfers waiting to be posted, by transfer id."""

    def __init__(self) -> None:
        self._items: dict[str, ToPost] = {}

    def add(
        self, matched: Matched, not_before: float, ranks: frozenset[int] = ZERO
    ) -> None:
        """``matched`` waits to be written to decode ranks ``ranks``."""
        self._items[matched.transfer_id] = ToPost(matched, not_before, ranks)

    def pop(self, tid: str) -> ToPost | None:
        return self._items.pop(tid, None)

    def of_engine(self, engine: str, other_than_boot: str | None) -> list[ToPost]:
        """Those registered by decode ``engine`` (and not by that boot)."""
        return [
            tp
            for tp in self._items.values()
            if tp.engine == engine and tp.boot != other_than_boot
        ]

    def engines(self) -> set[str]:
        return {tp.engine for tp in self._items.values()}

    def next_due(self, now: float) -> float | None:
        """The earliest time after ``now`` something here may change by
        itself (a delay that ends, or a post deadline). A transfer that
        waits for an event (its next layer, a Hello) is woken by it."""
        times = [t for tp in self._items.values()
                 for t in (tp.not_before, tp.matched.post_deadline)
                 if t > now]  # fmt: skip
        return min(times, default=None)

    def sweep(
        self,
        now: float,
        knows: Callable[[str, str, frozenset[int]], bool],
        fence_ready: Callable[[str], bool],
    ) -> tuple[list[ToPost], list[Overdue]]:
        """Take out (to post now, overdue). ``knows(engine, boot, ranks)``:
        those ranks of that decode boot said Hello; ``fence_ready(tid)``:
        its KV is written."""
        postable, overdue = [], []
        for tid, tp in list(self._items.items()):
            known, ready = knows(tp.engine, tp.boot, tp.ranks), fence_ready(tid)
            if now > tp.matched.post_deadline:
                del self._items[tid]
                overdue.append(_overdue(tp, known, ready))
            elif known and ready and now >= tp.not_before:
                del self._items[tid]
                postable.append(tp)
        return postable, overdue

    def __contains__(self, tid: str) -> bool:
        return tid in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)


def _overdue(tp: ToPost, known: bool, ready: bool) -> Overdue:
    if not known:
        return Overdue(tp, Cause.EXPIRED, "decode never said hello", "expired.no_hello")
    if not ready:
        why = "the KV's device work did not finish before the deadline"
        return Overdue(tp, Cause.WRITE_FAILED, why, None)
    return Overdue(tp, Cause.EXPIRED, "matched after its deadline", "expired.matched")
