"""Decode's ownership ledger: which destination blocks each transfer holds.

Decode reserves a transfer's destination blocks from its registration until
prefill's final word (see the timing rule, R1 in ``docs/design.md``);
:class:`~kvpush.connector.decode.receiver.Receiver` records each reservation
here. Blocks are exclusive: vLLM must never give one block to two live
receives, and a ledger that refused such a hold makes the bug visible
instead of letting two WRITEs race for one block. It records ownership and
frees nothing itself; a test checks that nothing is left once every
transfer ended. Owned by the thread that owns the receives.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hold:
    """``block_ids`` reserved for ``transfer_id``, written by prefill
    ``peer_engine_id``."""

    transfer_id: str
    block_ids: tuple[int, ...]
    peer_engine_id: str = ""


class Ledger:
    """Holds keyed by transfer id; a block belongs to at most one."""

    def __init__(self) -> None:
        self._holds: dict[str, Hold] = {}
        self._owner: dict[int, str] = {}  # block id -> transfer id

    def __len__(self) -> int:
        return len(self._holds)

    def hold(self, entry: Hold) -> None:
        """Record ``entry``. ``ValueError`` (and nothing recorded) if the
        transfer already holds blocks, or a block is repeated or already
        held by another transfer: bugs in the caller, which recording them
        would hide."""
        if entry.transfer_id in self._holds:
            raise ValueError(f"{entry.transfer_id} already holds blocks")
        taken = [b for b in entry.block_ids if b in self._owner]
        if taken or len(set(entry.block_ids)) != len(entry.block_ids):
            raise ValueError(f"blocks {taken or 'repeated'} already held")
        self._owner.update(dict.fromkeys(entry.block_ids, entry.transfer_id))
        self._holds[entry.transfer_id] = entry

    def release(self, transfer_id: str) -> Hold | None:
        """Give the hold back; returns it, or ``None`` when there was none."""
        entry = self._holds.pop(transfer_id, None)
        if entry is not None:
            for block in entry.block_ids:
                del self._owner[block]
        return entry

    def holds(self) -> list[Hold]:
        """Every current hold (a copy); empty when nothing leaked."""
        return list(self._holds.values())
