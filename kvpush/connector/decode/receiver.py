"""Decode's pending receives: each transfer from its registration to
prefill's final word, with an owner (this class), a deadline and a ledger
entry for its destination blocks.

Pure: the worker feeds it what happened (``now`` from its clock) and takes
the results with :meth:`Receiver.take`. The rule it enforces (the timing
rule of ``docs/architecture.md``):

    Decode gives its destination blocks back to vLLM only once no WRITE can
    land in them any more: after prefill's final word on the transfer (the
    Done of its WRITE, or a Failure, which prefill sends only when no WRITE
    of it is in flight or can still be posted, in particular its answer to
    decode's Reconcile after a reconnect), or once the prefill process is
    proven gone (its loopback connection closed, or it answered a Hello with
    a new boot id). A deadline never frees blocks.

When the deadline passes without a final word the receive is
*quarantined*: its blocks stay held and are counted, the worker asks
prefill for its final word (a Cancel), and the receive ends only when that
word, or the proof, arrives. A late Done still completes it.

While the request is alive, a failed receive marks its blocks as load errors
(vLLM then recomputes the prompt locally, or fails the request, by its
``kv_load_failure_policy``). When the request was aborted while receiving,
vLLM keeps its blocks (the scheduler side delays the free) until this class
reports the transfer over; then they are freed, with no load error.

A Done or Failure may arrive before the expect it completes (it comes over
another path than the registration): it is kept for
:data:`EARLY_TTL_S` and applied when the expect comes.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

from kvpush.connector.counters import Counters
from kvpush.connector.metadata import RecvExpect
from kvpush.transfer.ledger import Hold, Ledger
from kvpush.transfer.messages import Cause

logger = logging.getLogger(__name__)

EARLY_TTL_S = 10.0  # how long a Done or Failure waits for its expect
GRACE_S = 5.0  # added to the registration's ttl: decode asks after prefill gave up

Address = tuple[str, int]


class Phase(enum.Enum):
    WAITING = "waiting"
    QUARANTINED = "quarantined"  # deadline passed, no final word yet


@dataclass
class _Receive:
    expect: RecvExpect
    deadline: float
    prefill_boot: str | None  # the prefill boot known when it was expected
    phase: Phase = Phase.WAITING
    aborted: bool = False

    @property
    def address(self) -> Address:
        return (self.expect.prefill_host, self.expect.prefill_port)


@dataclass
class Results:
    """What the worker reports to vLLM this step."""

    finished: set[str] = field(default_factory=set)  # request ids
    load_errors: set[int] = field(default_factory=set)  # block ids


@dataclass(frozen=True)
class _Early:
    until: float
    cause: Cause | None  # None: a Done


class Receiver:
    """Every transfer decode waits on, keyed by transfer id."""

    def __init__(self, ttl_s: float, counters: Counters) -> None:
        self._ttl_s = ttl_s
        self._counters = counters
        self._pending: dict[str, _Receive] = {}
        self._ledger = Ledger()
        self._early: dict[str, _Early] = {}  # transfer id -> word before expect
        self._results = Results()

    def expect(
        self, expect: RecvExpect, now: float, prefill_boot: str | None = None
    ) -> None:
        """Decode registered ``expect.dst_block_ids`` with its prefill, whose
        current boot id (from its last HelloReply) is ``prefill_boot``."""
        tid = expect.transfer_id
        if tid in self._pending:  # the scheduler refuses reused ids: a bug
            logger.error("kvpush: receive %s expected twice; kept the first", tid)
            self._counters.add("ledger_conflict")
            return
        deadline = now + self._ttl_s + GRACE_S
        self._pending[tid] = _Receive(expect, deadline, prefill_boot)
        hold = Hold(tid, expect.dst_block_ids, expect.prefill_engine_id)
        try:
            self._ledger.hold(hold)
        except ValueError as e:  # vLLM gave a block to two live receives
            logger.error("kvpush: ledger refused receive %s: %s", tid, e)
            self._counters.add("ledger_conflict")
        early = self._early.pop(tid, None)
        if early is not None:
            self._end(tid, early.cause)

    def abort(self, transfer_id: str) -> RecvExpect | None:
        """vLLM finished the request while its KV was on the way. Returns the
        receive (the caller sends prefill a Cancel), or None if it is over."""
        entry = self._pending.get(transfer_id)
        if entry is None or entry.aborted:
            return None
        entry.aborted = True
        self._counters.add("aborted.receiving")
        return entry.expect

    def done(self, transfer_id: str, now: float) -> None:
        """A Done arrived (its WRITE's NIXL notification, or prefill's answer
        to a Reconcile): the KV landed (final)."""
        self._word(transfer_id, None, now)

    def failed(self, transfer_id: str, cause: Cause, now: float) -> None:
        """Prefill's Failure, or decode's own (a Registration not sent): no
        WRITE of the transfer can land (final)."""
        self._word(transfer_id, cause, now)

    def peer_lost(self, address: Address) -> None:
        """The prefill process at ``address`` is gone: none of its WRITEs will
        land (a new process there does not know these transfers)."""
        for tid, entry in list(self._pending.items()):
            if entry.address == address:
                self._end(tid, Cause.PEER_LOST)

    def peer_restarted(self, address: Address, boot_id: str) -> None:
        """The prefill at ``address`` answered as boot ``boot_id``: receives
        registered with an earlier boot will never be written."""
        for tid, entry in list(self._pending.items()):
            old = entry.prefill_boot
            if entry.address == address and old is not None and old != boot_id:
                self._end(tid, Cause.PEER_LOST)

    def peer_refused(self, prefill_engine_id: str) -> None:
        """The prefill refused our Hello: it will never write to us."""
        for tid, entry in list(self._pending.items()):
            if entry.expect.prefill_engine_id == prefill_engine_id:
                self._end(tid, Cause.INCOMPATIBLE)

    def expire(self, now: float) -> list[RecvExpect]:
        """Quarantine receives past their deadline (returned: the caller asks
        each prefill for its final word) and forget stale early words."""
        newly = []
        for entry in self._pending.values():
            if entry.phase is Phase.WAITING and now > entry.deadline:
                entry.phase = Phase.QUARANTINED
                self._counters.add("expired.receive")
                self._counters.add(
                    "quarantined.blocks", len(entry.expect.dst_block_ids)
                )
                logger.warning(
                    "kvpush: no final word on %s by its deadline; its %d "
                    "blocks are quarantined until prefill answers",
                    entry.expect.transfer_id,
                    len(entry.expect.dst_block_ids),
                )
                newly.append(entry.expect)
        for tid in [t for t, e in self._early.items() if now > e.until]:
            del self._early[tid]  # its receive never came (or ended otherwise)
            self._counters.add("unmatched.word")
        return newly

    def pardon(self, gap_s: float) -> None:
        """This process was stopped (or its step ran) for ``gap_s``: prefill
        is not blamed for that time; waiting receives get it back."""
        for entry in self._pending.values():
            if entry.phase is Phase.WAITING:
                entry.deadline += gap_s

    def awaited_ids(self, address: Address) -> list[str]:
        """Transfer ids awaited from the prefill at ``address`` (quarantined,
        aborted or not), in the order they were expected."""
        return [t for t, e in self._pending.items() if e.address == address]

    def awaited(self) -> frozenset[Address]:
        """Side-channel addresses of the prefills we are waiting on."""
        return frozenset(e.address for e in self._pending.values())

    def quarantined_blocks(self) -> int:
        return sum(
            len(e.expect.dst_block_ids)
            for e in self._pending.values()
            if e.phase is Phase.QUARANTINED
        )

    def holds(self) -> list[Hold]:
        """Destination blocks still reserved (empty once all is over)."""
        return self._ledger.holds()

    def take(self) -> Results:
        results, self._results = self._results, Results()
        return results

    def _word(self, tid: str, cause: Cause | None, now: float) -> None:
        if tid in self._pending:
            self._end(tid, cause)
        elif tid not in self._early:
            self._early[tid] = _Early(now + EARLY_TTL_S, cause)

    def _end(self, tid: str, cause: Cause | None) -> None:
        """The receive is over (``cause`` None: the KV landed)."""
        entry = self._pending.pop(tid)
        self._ledger.release(tid)
        self._results.finished.add(entry.expect.req_id)
        if entry.phase is Phase.QUARANTINED:
            self._counters.add("quarantine.released")
        if entry.aborted:
            self._counters.add("aborted.released")
            return
        if cause is not None:
            self._counters.add(f"receive_failed.{cause.value}")
            self._counters.add("fallback")
            self._results.load_errors.update(entry.expect.dst_block_ids)
