"""Decode's pending receives: each transfer from its registration to
prefill's final word, with an owner (this class), a deadline and a ledger
entry for its destination blocks.

Pure: the worker feeds it what happened (``now`` from its clock) and takes
the results with :meth:`Receiver.take`. The rule it enforces (the timing
rule, R1 of ``docs/design.md``):

    Decode gives its destination blocks back to vLLM only once no WRITE can
    land in them any more: after prefill's final word on the transfer (the
    Done of its WRITE, or a Failure, which prefill sends only when no WRITE
    of it is in flight or can still be posted, in particular its answer to
    decode's Reconcile after a reconnect), or once the prefill process is
    proven gone (its loopback connection closed, it answered a Hello with
    a new boot id, or an operator said so with ``kvpush forget``:
    :mod:`kvpush.connector.control`). A deadline never frees blocks.

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

Tensor parallelism: this worker is one decode rank; a receive waits on every
prefill rank it receives from (:meth:`TpPair.sources_of
<kvpush.transfer.ranks.TpPair.sources_of>`; rank ``r`` at the prefill's
side-channel port + ``r``). The rule then reads *every* expected rank: a
receive is over only once each of them said its final word (a Done or
Failure naming that rank) or was proven gone. A Failure from any prefill
rank, this worker's sources or not (the scheduler forwards every rank's to
every decode rank), dooms the receive: it will end failed, and the worker
asks each source still awaited for its final word at once (a Cancel), but
it still waits for those words. vLLM counts a request's receive finished
only once every decode rank reported it, and unions their load errors, so
the request's blocks go back only when every rank's receive is over.

KV digests (:mod:`kvpush.transfer.digest`): for a transfer the policy
selects, a rank's Done is not yet its final word. It carries the digest
of what that rank wrote here; the receive waits (the rank still awaited)
while the worker hashes the same bytes of its own memory
(:meth:`Receiver.take_checks`, off the engine thread), and
:meth:`Receiver.checked` makes it final: a match as a Done, a mismatch as a
failure of that rank (``digest_mismatch``), which fails the receive
through the one failure path above (load errors: vLLM recomputes the
prompt, or errors, by its policy; never serves or caches that KV). A
selected Done that carries no digest (a prefill not verifying, or the
Done said again in answer to a Reconcile) is counted ``digest_missing``
and taken as a Done.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpush.connector.counters import Counters
from kvpush.connector.metadata import RecvExpect
from kvpush.transfer import groups
from kvpush.transfer.digest import VERIFY_OFF, VerifyPolicy
from kvpush.transfer.ledger import Hold, Ledger
from kvpush.transfer.messages import Cause
from kvpush.transfer.ranks import TpPair, side_channel_port

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
    # prefill rank -> its boot id known when expected, for every rank whose
    # final word is still awaited (a rank leaves once it said it)
    awaiting: dict[int, str | None]
    phase: Phase = Phase.WAITING
    aborted: bool = False
    cause: Cause | None = None  # the first failure heard: it ends failed
    asked: bool = False  # a Cancel went to the ranks awaited
    # awaited ranks whose Done landed, its digest being checked
    checking: set[int] = field(default_factory=set)

    def address(self, rank: int) -> Address:
        port = side_channel_port(self.expect.prefill_port, rank)
        return (self.expect.prefill_host, port)

    def rank_at(self, address: Address) -> int | None:
        """The awaited prefill rank listening at ``address``, if any."""
        for rank in self.awaiting:
            if self.address(rank) == address:
                return rank
        return None

    def addresses(self) -> tuple[Address, ...]:
        """Side channels of the ranks still awaited."""
        return tuple(self.address(r) for r in self.awaiting)


@dataclass(frozen=True)
class Ask:
    """Ask the prefill ranks at ``addresses`` for their final word on
    ``expect``'s transfer (a Cancel saying ``reason``)."""

    expect: RecvExpect
    addresses: tuple[Address, ...]
    reason: str


@dataclass(frozen=True)
class Check:
    """Hash what prefill rank ``rank`` wrote here for ``expect`` and
    compare with ``digest`` (its Done's); answer with :meth:`Receiver.checked`."""

    expect: RecvExpect
    rank: int
    digest: bytes


@dataclass
class Results:
    """What the worker reports to vLLM this step."""

    finished: set[str] = field(default_factory=set)  # request ids
    load_errors: set[int] = field(default_factory=set)  # block ids
    failed: set[str] = field(default_factory=set)  # request ids (among finished)


@dataclass(frozen=True)
class _Early:
    until: float
    rank: int  # the prefill rank that said it
    cause: Cause | None  # None: a Done
    digest: bytes | None = None  # a Done's


class Receiver:
    """Every transfer this decode rank waits on, keyed by transfer id."""

    def __init__(
        self,
        ttl_s: float,
        counters: Counters,
        rank: int = 0,
        tp_size: int = 1,
        total_kv_heads: int = 0,
        verify: VerifyPolicy = VERIFY_OFF,
    ) -> None:
        self._ttl_s = ttl_s
        self._verify = verify
        self._counters = counters
        self._rank, self._tp_size = rank, tp_size  # this decode worker's
        self._total_kv_heads = total_kv_heads  # the model's (0: not known)
        self._pending: dict[str, _Receive] = {}
        self._ledger = Ledger()
        self._early: dict[str, list[_Early]] = {}  # words before their expect
        self._results = Results()
        self._asks: list[Ask] = []
        self._checks: list[Check] = []

    def sources(self, expect: RecvExpect) -> tuple[Address, ...]:
        """Side channels of the prefill ranks this rank receives
        ``expect`` from (the scheduler refused any TP pair not served)."""
        pair = self._pair(expect)
        host, base = expect.prefill_host, expect.prefill_port
        return tuple(
            (host, side_channel_port(base, r)) for r in pair.sources_of(self._rank)
        )

    def _pair(self, expect: RecvExpect) -> TpPair:
        return TpPair(expect.prefill_tp, self._tp_size, self._total_kv_heads)

    def expect(
        self,
        expect: RecvExpect,
        now: float,
        prefill_boots: dict[Address, str] | None = None,
    ) -> None:
        """Decode registered ``expect.dst_block_ids`` with its prefill, whose
        ranks' current boot ids (from their last HelloReply, by side-channel
        address) are ``prefill_boots``."""
        tid = expect.transfer_id
        if tid in self._pending:  # the scheduler refuses reused ids: a bug
            logger.error("kvpush: receive %s expected twice; kept the first", tid)
            self._counters.add("ledger_conflict")
            return
        boots = prefill_boots or {}
        pair = self._pair(expect)
        entry = _Receive(expect, now + self._ttl_s + GRACE_S, {})
        for r in pair.sources_of(self._rank):
            entry.awaiting[r] = boots.get(entry.address(r))
        self._pending[tid] = entry
        hold = Hold(tid, groups.real(expect.dst_block_ids), expect.prefill_engine_id)
        try:
            self._ledger.hold(hold)
        except ValueError as e:  # vLLM gave a block to two live receives
            logger.error("kvpush: ledger refused receive %s: %s", tid, e)
            self._counters.add("ledger_conflict")
        for early in self._early.pop(tid, []):
            if tid in self._pending:
                self._final(tid, early.rank, early.cause, early.digest)

    def abort(self, transfer_id: str) -> None:
        """vLLM finished the request while its KV was on the way: ask every
        rank still awaited for its final word (see :meth:`take_asks`)."""
        entry = self._pending.get(transfer_id)
        if entry is None or entry.aborted:
            return
        entry.aborted = True
        self._counters.add("aborted.receiving")
        self._ask(entry, "request aborted while its KV was on the way")

    def done(
        self, transfer_id: str, rank: int, now: float, digest: bytes | None = None
    ) -> None:
        """Prefill rank ``rank``'s Done arrived (its WRITE's NIXL
        notification, or its answer to a Reconcile): its KV landed (final,
        or once its ``digest`` checked, for a transfer the policy selects)."""
        self._word(transfer_id, rank, None, now, digest)

    def checked(self, transfer_id: str, rank: int, intact: bool) -> None:
        """The digest of prefill rank ``rank``'s Done was checked (a
        :class:`Check`): the KV landed ``intact``, or it did not, which
        fails the receive. Ignored when that rank's word is no longer
        awaited (the receive ended, or the rank was proven gone meanwhile)."""
        entry = self._pending.get(transfer_id)
        if entry is None or rank not in entry.checking:
            return
        entry.checking.discard(rank)
        if rank not in entry.awaiting:
            return
        if intact:
            self._counters.add("digest_verified")
            self._final(transfer_id, rank, None, checked=True)
            return
        self._counters.add("digest_mismatch")
        logger.error(
            "kvpush: the KV of %s from prefill rank %d landed corrupted (digest "
            "mismatch on decode rank %d); the request will not use it",
            transfer_id,
            rank,
            self._rank,
        )
        self._final(transfer_id, rank, Cause.DIGEST_MISMATCH)

    def take_checks(self) -> list[Check]:
        """The digests to check since the last call (worker's main thread)."""
        checks, self._checks = self._checks, []
        return checks

    def failed(self, transfer_id: str, cause: Cause, rank: int, now: float) -> None:
        """Prefill rank ``rank``'s Failure, or decode's own about that rank
        (a Registration not sent to it): no WRITE of that rank can land
        (final for that rank; the transfer as a whole fails)."""
        self._word(transfer_id, rank, cause, now)

    def peer_lost(self, address: Address) -> None:
        """The prefill rank at ``address`` is gone: none of its WRITEs will
        land (a new process there does not know these transfers)."""
        self._proven(address, lambda boot: True, Cause.PEER_LOST)

    def peer_restarted(self, address: Address, boot_id: str) -> None:
        """The prefill rank at ``address`` answered as boot ``boot_id``:
        receives registered with an earlier boot will never be written."""
        self._proven(address, lambda old: old not in (None, boot_id), Cause.PEER_LOST)

    def peer_refused(self, address: Address) -> None:
        """The prefill rank at ``address`` refused our Hello: it will never
        write to us."""
        self._proven(address, lambda boot: True, Cause.INCOMPATIBLE)

    def engine_gone(
        self, engine_id: str, spares: Callable[[Address, str | None], bool]
    ) -> int:
        """Every rank of prefill engine ``engine_id`` is proven gone (an
        operator's ``kvpush forget``: :mod:`kvpush.connector.control`), as
        :meth:`peer_lost` for each of them, except the ranks whose address
        and boot (the one known when the receive was expected) ``spares``.
        The number of receives from that engine this ended or doomed."""
        touched = 0
        for tid, entry in list(self._pending.items()):
            if entry.expect.prefill_engine_id != engine_id:
                continue
            gone = [
                rank
                for rank, boot in entry.awaiting.items()
                if not spares(entry.address(rank), boot)
            ]
            if gone:
                touched += 1
            for rank in gone:
                if tid not in self._pending:
                    break
                self._final(tid, rank, Cause.PEER_LOST)
        return touched

    def quarantined_by_engine(self) -> dict[str, int]:
        """Quarantined blocks by the prefill engine they wait on."""
        out: dict[str, int] = {}
        for e in self._pending.values():
            if e.phase is Phase.QUARANTINED:
                peer = e.expect.prefill_engine_id
                out[peer] = out.get(peer, 0) + len(groups.real(e.expect.dst_block_ids))
        return out

    def expire(self, now: float) -> None:
        """Quarantine receives past their deadline (asking each awaited rank
        for its final word: :meth:`take_asks`) and forget stale early words."""
        for entry in self._pending.values():
            if entry.phase is Phase.WAITING and now > entry.deadline:
                entry.phase = Phase.QUARANTINED
                self._counters.add("expired.receive")
                self._counters.add(
                    "quarantined.blocks", len(groups.real(entry.expect.dst_block_ids))
                )
                logger.warning(
                    "kvpush: no final word on %s by its deadline; its %d "
                    "blocks are quarantined until prefill answers",
                    entry.expect.transfer_id,
                    len(groups.real(entry.expect.dst_block_ids)),
                )
                self._ask(entry, "decode's deadline passed")
        for tid, words in list(self._early.items()):
            kept = [w for w in words if now <= w.until]
            if len(kept) < len(words):  # its receive never came
                self._counters.add("unmatched.word", len(words) - len(kept))
            if kept:
                self._early[tid] = kept
            else:
                del self._early[tid]

    def pardon(self, gap_s: float) -> None:
        """This process was stopped (or its step ran) for ``gap_s``: prefill
        is not blamed for that time; waiting receives get it back."""
        for entry in self._pending.values():
            if entry.phase is Phase.WAITING:
                entry.deadline += gap_s

    def awaited_ids(self, address: Address) -> list[str]:
        """Transfer ids awaited from the prefill rank at ``address``
        (quarantined, aborted or not), in the order they were expected."""
        return [t for t, e in self._pending.items() if e.rank_at(address) is not None]

    def pending(self) -> int:
        """Receives not yet ended (waiting, aborted or quarantined)."""
        return len(self._pending)

    def awaited(self) -> frozenset[Address]:
        """Side-channel addresses of the prefill ranks we are waiting on."""
        return frozenset(a for e in self._pending.values() for a in e.addresses())

    def quarantined_blocks(self) -> int:
        return sum(
            len(groups.real(e.expect.dst_block_ids))
            for e in self._pending.values()
            if e.phase is Phase.QUARANTINED
        )

    def holds(self) -> list[Hold]:
        """Destination blocks still reserved (empty once all is over)."""
        return self._ledger.holds()

    def take(self) -> Results:
        results, self._results = self._results, Results()
        return results

    def take_asks(self) -> list[Ask]:
        """The Cancels to send since the last call (worker's main thread)."""
        asks, self._asks = self._asks, []
        return asks

    def _word(
        self,
        tid: str,
        rank: int,
        cause: Cause | None,
        now: float,
        digest: bytes | None = None,
    ) -> None:
        if tid in self._pending:
            self._final(tid, rank, cause, digest)
            return
        words = self._early.setdefault(tid, [])
        if all(w.rank != rank for w in words):
            words.append(_Early(now + EARLY_TTL_S, rank, cause, digest))

    def _proven(
        self, address: Address, applies: Callable[[str | None], bool], cause: Cause
    ) -> None:
        """The rank at ``address`` is proven never to write (for receives
        whose boot there ``applies``): its final word, with ``cause``."""
        for tid, entry in list(self._pending.items()):
            rank = entry.rank_at(address)
            if rank is not None and applies(entry.awaiting[rank]):
                self._final(tid, rank, cause)

    def _final(
        self,
        tid: str,
        rank: int,
        cause: Cause | None,
        digest: bytes | None = None,
        checked: bool = False,
    ) -> None:
        """Prefill rank ``rank`` said its final word on ``tid`` (``cause``
        None: a Done, carrying ``digest``). A Failure from a rank this one
        does not receive from only dooms the receive: its own sources must
        still answer. A Done of a selected transfer is final only once its
        digest checked (:meth:`checked`: ``checked``)."""
        entry = self._pending[tid]
        to_check = cause is None and not checked and rank in entry.awaiting
        if to_check and self._verify.selects(tid):
            if rank in entry.checking:
                return  # said again (e.g. to a Cancel): one check is enough
            if digest is not None:
                entry.checking.add(rank)
                self._checks.append(Check(entry.expect, rank, digest))
                return
            self._counters.add("digest_missing")
        entry.awaiting.pop(rank, None)
        entry.checking.discard(rank)
        if cause is not None and entry.cause is None:
            entry.cause = cause
        if not entry.awaiting:
            self._end(tid)
        elif entry.cause is not None:  # the others need not write any more
            why = f"the transfer failed on prefill rank {rank} ({entry.cause.value})"
            self._ask(entry, why, once=True)

    def _ask(self, entry: _Receive, reason: str, once: bool = False) -> None:
        if once and entry.asked:
            return
        entry.asked = True
        self._asks.append(Ask(entry.expect, entry.addresses(), reason))

    def _end(self, tid: str) -> None:
        """The receive is over: every expected rank said its final word
        (``cause`` None on the entry: the KV landed on every rank)."""
        entry = self._pending.pop(tid)
        self._ledger.release(tid)
        self._results.finished.add(entry.expect.req_id)
        if entry.phase is Phase.QUARANTINED:
            self._counters.add("quarantine.released")
        if entry.aborted:
            self._counters.add("aborted.released")
            return
        if entry.cause is not None:
            self._counters.add(f"receive_failed.{entry.cause.value}")
            self._counters.add("fallback")
            self._results.load_errors.update(groups.real(entry.expect.dst_block_ids))
            self._results.failed.add(entry.expect.req_id)
