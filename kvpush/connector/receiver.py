"""Decode's pending receives: each transfer from its registration to
prefill's final word, with an owner (this class), a deadline and a ledger
entry for its destination blocks.

Pure: the worker feeds it what happened (``now`` from its clock) and takes
the results with :meth:`Receiver.take`. The rule it enforces:

    Decode gives its destination blocks back to vLLM only once no WRITE can
    land in them any more: after prefill's final word on the transfer (the
    Done of its WRITE, or a Failure, which prefill sends only when it will
    not write), after prefill's process is gone (its connection closed), or
    after the registration's deadline (prefill never starts a WRITE past it).

While the request is alive, a failed receive marks its blocks as load errors
(vLLM then recomputes the prompt locally, or fails the request, by its
``kv_load_failure_policy``). When the request was aborted while receiving,
vLLM keeps its blocks (the scheduler side delays the free) until this class
reports the transfer over; then they are freed, with no load error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvpush.connector.counters import Counters
from kvpush.connector.metadata import RecvExpect
from kvpush.transfer.ledger import Hold, Ledger

logger = logging.getLogger(__name__)

EARLY_DONE_TTL_S = 10.0  # how long a Done waits for the receive it completes
GRACE_S = 5.0  # added to the registration's ttl: decode waits past prefill


@dataclass
class _Receive:
    expect: RecvExpect
    deadline: float
    aborted: bool = False


@dataclass
class Results:
    """What the worker reports to vLLM this step."""

    finished: set[str] = field(default_factory=set)  # request ids
    load_errors: set[int] = field(default_factory=set)  # block ids


class Receiver:
    """Every transfer decode waits on, keyed by transfer id."""

    def __init__(self, ttl_s: float, counters: Counters) -> None:
        self._ttl_s = ttl_s
        self._counters = counters
        self._pending: dict[str, _Receive] = {}
        self._ledger = Ledger()
        self._early_done: dict[str, float] = {}  # transfer id -> expiry
        self._results = Results()

    def expect(self, expect: RecvExpect, now: float) -> None:
        """Decode registered ``expect.dst_block_ids`` with its prefill."""
        tid = expect.transfer_id
        deadline = now + self._ttl_s + GRACE_S
        self._pending[tid] = _Receive(expect, deadline)
        hold = Hold(tid, "reserved_dst", expect.dst_block_ids, deadline,
                    expect.prefill_engine_id)  # fmt: skip
        try:
            self._ledger.hold(hold)
        except ValueError as e:  # vLLM gave a block to two live receives
            logger.error("kvpush: ledger refused receive %s: %s", tid, e)
            self._counters.add("ledger_conflict")
        if self._early_done.pop(tid, None) is not None:
            self._end(tid, failed=False, cause="")

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
        """A Done notification arrived (perhaps before its expect)."""
        if transfer_id in self._pending:
            self._end(transfer_id, failed=False, cause="")
        elif transfer_id not in self._early_done:
            self._early_done[transfer_id] = now + EARLY_DONE_TTL_S

    def failed(self, transfer_id: str, cause: str) -> None:
        """Prefill's Failure: it will not write (final)."""
        if transfer_id in self._pending:
            self._end(transfer_id, failed=True, cause=cause)

    def peer_lost(self, address: tuple[str, int]) -> None:
        """The prefill at ``address`` is gone: none of its WRITEs will come."""
        for tid, entry in list(self._pending.items()):
            if (entry.expect.prefill_host, entry.expect.prefill_port) == address:
                self._end(tid, failed=True, cause="peer_lost")

    def peer_refused(self, prefill_engine_id: str) -> None:
        """The prefill refused our Hello: it cannot write to us."""
        for tid, entry in list(self._pending.items()):
            if entry.expect.prefill_engine_id == prefill_engine_id:
                self._end(tid, failed=True, cause="incompatible")

    def expire(self, now: float) -> None:
        """Give up receives past their deadline, and stale early Dones."""
        for tid in [t for t, e in self._pending.items() if now > e.deadline]:
            self._counters.add("expired.receive")
            self._end(tid, failed=True, cause="expired")
        for tid in [t for t, until in self._early_done.items() if now > until]:
            del self._early_done[tid]  # its receive failed or never came

    def awaited(self) -> set[tuple[str, int]]:
        """Side-channel addresses of the prefills we are waiting on."""
        return {
            (e.expect.prefill_host, e.expect.prefill_port)
            for e in self._pending.values()
        }

    def holds(self) -> list[Hold]:
        """Destination blocks still reserved (empty once all is over)."""
        return self._ledger.holds()

    def take(self) -> Results:
        results, self._results = self._results, Results()
        return results

    def _end(self, tid: str, failed: bool, cause: str) -> None:
        entry = self._pending.pop(tid)
        self._ledger.release(tid, "reserved_dst")
        self._results.finished.add(entry.expect.req_id)
        if entry.aborted:
            self._counters.add("aborted.released")
            return
        if failed:
            self._counters.add(f"receive_failed.{cause}")
            self._counters.add("fallback")
            self._results.load_errors.update(entry.expect.dst_block_ids)
