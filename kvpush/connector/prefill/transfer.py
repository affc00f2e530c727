"""One prefill transfer, as the writer holds it: the record and its phase.

A :class:`Transfer` is made when the transfer's first ready KV reaches the
writer (a whole push, or the first chunk of a streamed one) and lives in
the :class:`~kvpush.connector.prefill.pipeline.Pipeline`'s one table until
prefill's blocks are freed; the pipeline is its only owner (the writer
thread) and the only code that changes its phase, through
:meth:`Transfer.advance`, which refuses a transition not drawn here::

    WAITING --match--> MATCHED --post--> IN_FLIGHT --every Done landed--> freed
       |                  |                  |
       +--dropped--> freed +------close-------+--> ENDING --last WRITE ended--> freed

* :attr:`Phase.WAITING`: its ready KV is in, no registration matched it
  yet (the matcher holds the ready half and its deadline). A registration
  that waits with no KV has no record: it is only the matcher's.
* :attr:`Phase.MATCHED`: both halves are here and nothing is posted yet:
  it waits for decode's Hello, the KV's device fence, a fault-injected
  delay, all before the post deadline.
* :attr:`Phase.IN_FLIGHT`: at least one WRITE was posted; more may follow
  as chunks (or layers of a chunk) are written. It ends when the WRITE
  carrying the Done completed on every decode rank it writes.
* :attr:`Phase.ENDING`: stopped (cancelled, preempted, expired, decode
  lost) or failed: posts nothing more, and is freed, with prefill's final
  word, once its last WRITE in flight ended (at once if none is).

Whether something is due to post is not a phase but derived from the
record (:attr:`Transfer.is_due`: what is known and not yet posted, in a
matched transfer that was not closed), recomputed by the record itself
after each of its changes, so that the writer's every-tick questions cost
an attribute read per record. The stream state it inherits
(chunks, fences, what was posted per layer, targets, done ranks, why it
closes) is :class:`~kvpush.connector.prefill.stream.Stream`'s; the sockets
its final word goes to are the
:class:`~kvpush.connector.prefill.tell.Teller`'s (a registration waiting
with no record has them too). The pipeline's posting step is
:func:`sweep` over the records. Pure: no I/O.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvpush.connector.prefill.fence import ReadyFence
from kvpush.connector.prefill.stream import Stream, StreamWrite
from kvpush.transfer.matcher import Matched, ReadyKv
from kvpush.transfer.messages import Cause
from kvpush.transfer.shares import HeadSlice

MAX_ORPHANS = 4096  # ended transfers whose later chunks are still to come


class Phase(enum.Enum):
    """Where one transfer the writer holds stands (see the module)."""

    WAITING = "waiting"
    MATCHED = "matched"
    IN_FLIGHT = "in_flight"
    ENDING = "ending"


_LEGAL = {
    Phase.WAITING: {Phase.MATCHED},
    Phase.MATCHED: {Phase.IN_FLIGHT, Phase.ENDING},
    Phase.IN_FLIGHT: {Phase.ENDING},
    Phase.ENDING: {Phase.ENDING},
}


@dataclass(frozen=True)
class Overdue:
    """Why a transfer due to post missed its post deadline."""

    cause: Cause
    why: str
    event: str | None  # the counter to add, if any


class Transfer(Stream):
    """The record of one prefill transfer: its phase, its stream (chunks,
    fences, what was posted, targets, done ranks), its match and the post
    not-before time, and why it closes."""

    def __init__(self, req_id: str, first: ReadyKv, fence: ReadyFence) -> None:
        self.phase = Phase.WAITING
        # What the writer asks of every record on every tick, derived from
        # the rest and kept in step by each change (:meth:`_derive`):
        self.waits_on_decode = False  # more to post, to its decode
        self.is_due = False  # something known and not yet posted
        super().__init__(req_id, first, fence)

    def advance(self, to: Phase) -> None:
        """Move to phase ``to``; a transition not drawn in the module
        docstring is a bug and raises."""
        if to not in _LEGAL[self.phase]:
            raise RuntimeError(
                f"transfer {self.transfer_id}: {self.phase.name} -> {to.name}"
            )
        self.phase = to
        self._derive()

    def add(self, chunk: ReadyKv, fence: ReadyFence) -> str | None:
        """The next chunk of its KV (see :meth:`Stream.add`)."""
        problem = super().add(chunk, fence)
        self._derive()
        return problem

    def item_ended(self) -> None:
        """One of its WRITEs ended (its Done piece may be due now)."""
        super().item_ended()
        self._derive()

    # -- the transitions (each called by the pipeline only) -------------------

    def match(
        self,
        matched: Matched,
        block_size: int,
        num_layers: int,
        targets: tuple[HeadSlice, ...],
        not_before: float = 0.0,
    ) -> None:
        """Decode's registration came (or was here): MATCHED; nothing is
        posted before ``not_before`` (fault injection's delay)."""
        self.advance(Phase.MATCHED)
        super().match(matched, block_size, num_layers, targets)
        self.not_before = not_before
        self._derive()

    def posted(self, write: StreamWrite, num_writes: int = 1) -> None:
        """``write`` went out as ``num_writes`` WRITEs: IN_FLIGHT."""
        if self.phase is Phase.MATCHED:
            self.advance(Phase.IN_FLIGHT)
        super().posted(write, num_writes)
        self._derive()

    def close(self, cause: Cause | None, why: str) -> None:
        """Post nothing more: ENDING (the first reason given is kept)."""
        self.advance(Phase.ENDING)
        super().close(cause, why)
        self._derive()

    def write_failed(self) -> None:
        """A WRITE failed: ENDING, with that as the final word's cause."""
        self.advance(Phase.ENDING)
        super().write_failed()
        self._derive()

    # -- derived ---------------------------------------------------------------

    @property
    def boot(self) -> str:
        """The decode boot that registered the blocks (once matched)."""
        return self.matched.registration.decode_boot_id if self.matched else ""

    @property
    def post_deadline(self) -> float:
        """Nothing of it may be posted after this (once matched)."""
        return self.matched.post_deadline if self.matched else float("inf")

    def _derive(self) -> None:
        """Recompute :attr:`waits_on_decode` (matched or in flight, with
        blocks of some layer not yet posted: decode's silence ends it) and
        :attr:`is_due` (of those, something known and not yet posted,
        whether or not its fence completed), after any change of the
        record: only its own transitions, a chunk and a WRITE's end move
        them."""
        live = self.phase in (Phase.MATCHED, Phase.IN_FLIGHT)
        self.waits_on_decode = live and self.is_open
        self.is_due = self.waits_on_decode and self.has_due()

    def overdue(self, known: bool, ready: bool) -> Overdue:
        """Why it missed its post deadline: decode's Hello had not come
        (``known`` False), its KV's device work had not finished
        (``ready`` False), or it was matched too late."""
        if not known:
            return Overdue(Cause.EXPIRED, "decode never said hello", "expired.no_hello")
        if not ready:
            why = "the KV's device work did not finish before the deadline"
            return Overdue(Cause.WRITE_FAILED, why, None)
        return Overdue(Cause.EXPIRED, "matched after its deadline", "expired.matched")


Knows = Callable[[str, str, frozenset[int]], bool]  # engine, boot, ranks


@dataclass
class Sweep:
    """What to do now with the transfers due to post."""

    postable: list[Transfer] = field(default_factory=list)
    overdue: list[tuple[Transfer, Overdue]] = field(default_factory=list)


def sweep(transfers: Iterable[Transfer], now: float, knows: Knows) -> Sweep:
    """Sort the transfers due to post (:attr:`Transfer.is_due`): to post now
    (every decode rank written to, of the boot that registered the blocks,
    said Hello, per ``knows``; the next WRITE's fences completed; the fault
    delay passed) and past their post deadline, with why (the deadline is
    checked here, right before the post, after the fence: the fence wait
    counts inside it). Changes nothing."""
    out = Sweep()
    for t in [t for t in transfers if t.is_due]:
        known = knows(t.engine, t.boot, t.target_ranks)
        ready = t.next_write() is not None
        if now > t.post_deadline:
            out.overdue.append((t, t.overdue(known, ready)))
        elif known and ready and now >= t.not_before:
            out.postable.append(t)
    return out


def next_change(transfers: Iterable[Transfer], now: float) -> float | None:
    """The earliest time after ``now`` a transfer due to post may change by
    itself (a delay that ends, or a post deadline). One that waits for an
    event (its next layer, a Hello) is woken by that event."""
    times = [x for t in transfers if t.is_due
             for x in (t.not_before, t.post_deadline) if x > now]  # fmt: skip
    return min(times, default=None)


def polls_device(transfers: Iterable[Transfer]) -> bool:
    """Whether a transfer due to post has nothing to post until a device
    fence completes (the writer polls it; a layer not yet saved comes as
    an inbox event instead)."""
    return any(
        t.is_due and t.waits_on_device() and t.next_write() is None for t in transfers
    )


class Orphans:
    """Transfers that ended before their last chunk came (bounded): their
    later chunks are dropped, and only the last one is forgotten."""

    def __init__(self, limit: int = MAX_ORPHANS) -> None:
        self._limit = limit
        self._req_ids: OrderedDict[str, str] = OrderedDict()  # tid -> req id

    def add(self, tid: str, req_id: str) -> None:
        """``req_id``'s transfer ended before its last chunk came."""
        self._req_ids[tid] = req_id
        while len(self._req_ids) > self._limit:
            self._req_ids.popitem(last=False)

    def take(self, chunk: ReadyKv, req_id: str) -> bool:
        """Whether ``chunk`` belongs to a transfer that already ended
        (forgotten at its last chunk)."""
        if self._req_ids.get(chunk.transfer_id) != req_id:
            return False
        if chunk.final:
            del self._req_ids[chunk.transfer_id]
        return True

    def forget(self, tid: str) -> None:
        """Its request will send no more chunks (aborted or preempted)."""
        self._req_ids.pop(tid, None)

    def __len__(self) -> int:
        return len(self._req_ids)
