"""An ownership ledger: what each transfer holds here, and until when.

Every pending state that pins blocks gets an entry with a deadline, so that
nothing can be held forever and a test can check that nothing leaked:

* ``reserved_dst`` (decode): destination blocks reserved for a transfer,
  held from allocation until Done, Failure, cancel, or the deadline. These
  are exclusive: one block belongs to at most one transfer.
* ``unsent_src`` (prefill): computed source blocks waiting for their
  registration or their turn at the writer.
* ``posted_write`` (prefill): source blocks of a WRITE in flight; they are
  freed when it completes (or when the write is given up at its deadline).
  Source blocks may be shared between transfers (prefix cache), so these
  two kinds do not check exclusivity.

One :class:`Ledger` per connector side, owned by the thread that owns the
transfers' state. It records ownership; it frees nothing itself: the caller
frees what :meth:`Ledger.release` and :meth:`Ledger.expired` return.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

Kind = Literal["reserved_dst", "unsent_src", "posted_write"]
_EXCLUSIVE: frozenset[Kind] = frozenset({"reserved_dst"})


@dataclass(frozen=True)
class Hold:
    """``block_ids`` held for ``transfer_id`` as ``kind`` until ``deadline``;
    ``peer_engine_id`` is whom to tell if the hold is given up."""

    transfer_id: str
    kind: Kind
    block_ids: tuple[int, ...]
    deadline: float
    peer_engine_id: str = ""


class Ledger:
    """Holds keyed by ``(transfer_id, kind)``; at most one of each."""

    def __init__(self) -> None:
        self._holds: dict[tuple[str, Kind], Hold] = {}
        self._owner: dict[int, str] = {}  # exclusive block id -> transfer id

    def __len__(self) -> int:
        return len(self._holds)

    def hold(self, entry: Hold) -> None:
        """Record ``entry``. ``ValueError`` if the transfer already holds that
        kind, or an exclusive block is already held by another transfer:
        both are bugs in the caller, and recording them would hide a leak."""
        key = (entry.transfer_id, entry.kind)
        if key in self._holds:
            raise ValueError(f"{entry.transfer_id} already holds {entry.kind}")
        if entry.kind in _EXCLUSIVE:
            taken = [b for b in entry.block_ids if b in self._owner]
            if taken or len(set(entry.block_ids)) != len(entry.block_ids):
                raise ValueError(
                    f"blocks {taken or 'repeated'} already held as {entry.kind}"
                )
            self._owner.update(dict.fromkeys(entry.block_ids, entry.transfer_id))
        self._holds[key] = entry

    def release(self, transfer_id: str, kind: Kind) -> Hold | None:
        """Give the hold back; returns it (the caller frees its blocks), or
        ``None`` when there was none (already released or expired)."""
        entry = self._holds.pop((transfer_id, kind), None)
        if entry is not None and kind in _EXCLUSIVE:
            for block in entry.block_ids:
                del self._owner[block]
        return entry

    def release_all(self, transfer_id: str) -> list[Hold]:
        """Every hold of ``transfer_id``, released."""
        kinds = [k for (t, k) in self._holds if t == transfer_id]
        return [h for k in kinds if (h := self.release(transfer_id, k)) is not None]

    def move(self, transfer_id: str, src: Kind, dst: Kind, deadline: float) -> bool:
        """Re-label a hold (e.g. ``unsent_src`` → ``posted_write``) with a new
        deadline. False when there is no ``src`` hold; ``ValueError`` (and
        nothing changed) when :meth:`hold` would refuse the new one."""
        entry = self.release(transfer_id, src)
        if entry is None:
            return False
        try:
            self.hold(replace(entry, kind=dst, deadline=deadline))
        except ValueError:
            self.hold(entry)
            raise
        return True

    def expired(self, now: float) -> list[Hold]:
        """Release and return every hold whose deadline is ``<= now``,
        earliest first."""
        due = sorted(
            (h for h in self._holds.values() if h.deadline <= now),
            key=lambda h: (h.deadline, h.transfer_id, h.kind),
        )
        return [h for h in due if self.release(h.transfer_id, h.kind) is not None]

    def get(self, transfer_id: str, kind: Kind) -> Hold | None:
        return self._holds.get((transfer_id, kind))

    def holds(self) -> list[Hold]:
        """Every current hold (a copy); empty when nothing leaked."""
        return list(self._holds.values())

    def next_deadline(self) -> float | None:
        return min((h.deadline for h in self._holds.values()), default=None)
