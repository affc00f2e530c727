"""Prefill's WRITEs in flight, from the post until NIXL has let go of them.

Used only by the writer thread (:mod:`kvpush.connector.prefill.writer`).
A WRITE ends here in exactly one of three ways, and only once NIXL has
released its handle, because until then the backend may still read
prefill's blocks and write decode's:

* ``DONE``: it completed; its Done notification reached decode with it;
* ``FAILED``: NIXL said ``ERR`` (or raised), and the handle was released;
* ``CANCELLED``: it was cancelled (decode gave it up, prefill's request was
  preempted past the deadline, or it ran past its deadline) and NIXL
  released it.

A handle NIXL will not release stays here, and so do its blocks: its
release is tried again every :data:`RETRY_S`, at most
:data:`MAX_RELEASE_TRIES` times for a cancel; after that the WRITE is
*stuck*: it is still polled (it may yet end), never cancelled again, and
counted. Nothing here raises out of a poll or a release.

Polling costs what is due: each WRITE has its own next poll time, polled
every :data:`POLL_MIN_S` at first and then less often, doubling up to
:data:`POLL_MAX_S` (decode learns of the data from NIXL's own notification;
prefill's poll only frees prefill's blocks and answers cancels, so a late
poll costs nothing on the critical path). A heap of due times means a wake
touches only the WRITEs that are due, and a wake also takes those due
within :data:`POLL_SLACK_S`, so that WRITEs in flight together are polled in
the same wakes rather than each in its own.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvpush.connector.counters import Counters
from kvpush.connector.nixl_io import NixlIO, XferState
from kvpush.connector.prefill.decode_peers import DecodePeer
from kvpush.connector.trace import Tracer
from kvpush.transfer.coalesce import descriptors, runs
from kvpush.transfer.messages import Cause, Done, encode
from kvpush.transfer.work import WorkItem

logger = logging.getLogger(__name__)

RETRY_S = 1.0  # between two tries to release a handle
POLL_MIN_S = 0.0005  # first poll of a WRITE, and the gap between early polls
POLL_MAX_S = 0.008  # the gap between polls of a long WRITE
POLL_SLACK_S = 0.002  # a wake also polls WRITEs due this much later
MAX_RELEASE_TRIES = 3  # cancels of a running WRITE before it counts as stuck


class Outcome(enum.Enum):
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass
class InFlight:
    """One posted WRITE (one work item) and what is known about its end."""

    handle: Any
    transfer_id: str
    engine_id: str
    deadline: float  # past it, the WRITE is cancelled
    cancel_route: bytes | None = None  # decode cancelled: answer there when over
    cancel_cause: Cause | None = None  # set once a cancel was asked for
    failed: bool = False  # NIXL said ERR; waiting for the release
    release_tries: int = 0
    next_try: float = 0.0
    stuck: bool = False
    poll_gap: float = POLL_MIN_S
    due: float = 0.0  # when it next needs attention (its heap entry's key)

    def next_due(self, now: float) -> float:
        """The next poll, release retry or deadline, whichever comes first."""
        due = now + self.poll_gap
        if self.failed or self.cancel_cause is not None:
            return min(due, max(self.next_try, now)) if not self.stuck else due
        return min(due, max(self.deadline, now))


class Writes:
    """The WRITEs in flight, by transfer id (one per transfer)."""

    def __init__(
        self,
        io: NixlIO,
        engine_id: str,
        tracer: Tracer,
        counters: Counters,
        timeout_s: float,
    ) -> None:
        self._io, self._engine_id, self._tracer = io, engine_id, tracer
        self._counters = counters
        self._timeout_s = timeout_s
        self._inflight: dict[str, InFlight] = {}
        self._due: list[tuple[float, int, str]] = []  # (due, seq, transfer id)
        self._seq = itertools.count()

    def post(self, item: WorkItem, peer: DecodePeer, engine: str, now: float) -> None:
        """One WRITE for one work item (a block range x a layer range); the
        transfer's last item carries the Done notification. Raises when it
        cannot be posted (a block outside either cache, NIXL refusing)."""
        if item.transfer_id in self._inflight:
            raise RuntimeError(f"transfer {item.transfer_id} already has a WRITE")
        done = Done(
            transfer_id=item.transfer_id,
            engine_id=self._engine_id,
            num_blocks=item.num_blocks,
        )
        notif = encode(done) if item.notify else b""
        block_runs = runs(item.src_block_ids, item.dst_block_ids)
        layouts = (self._io.layout, peer.layout)
        src, dst = descriptors(block_runs, *layouts, item.layers)
        handle = self._io.write(src, dst, peer.agent_name, notif)
        flight = InFlight(handle, item.transfer_id, engine, now + self._timeout_s)
        self._inflight[item.transfer_id] = flight
        self._schedule(flight, now + POLL_MIN_S)
        num_bytes = item.num_blocks * self._io.layout.block_bytes
        num_bytes *= len(item.layers) * self._io.layout.regions_per_layer
        self._tracer.mark(
            item.transfer_id,
            "write_posted",
            num_descs=len(src),
            num_runs=len(block_runs),
            num_blocks=item.num_blocks,
            num_bytes=num_bytes,
        )

    def cancel(
        self, transfer_id: str, cause: Cause, route: bytes | None, now: float
    ) -> None:
        """Ask NIXL to cancel the WRITE of ``transfer_id`` (``route``: decode
        gave it up and is answered there once the WRITE is over)."""
        flight = self._inflight.get(transfer_id)
        if flight is None:
            return
        if route is not None:
            flight.cancel_route = route
        if flight.cancel_cause is None:
            flight.cancel_cause, flight.next_try = cause, now
            self._schedule(flight, now)

    def next_due(self) -> float | None:
        """When the earliest WRITE needs attention (None: none in flight)."""
        while self._due:
            due, _, tid = self._due[0]
            flight = self._inflight.get(tid)
            if flight is not None and flight.due == due:
                return due
            heapq.heappop(self._due)  # stale: rescheduled or ended
        return None

    def poll(self, now: float) -> list[tuple[InFlight, Outcome]]:
        """The WRITEs that ended since the last call, each once, among those
        due. Also cancels those past their deadline and retries releases
        that NIXL refused."""
        ended = []
        for flight in self._take_due(now):
            overdue = now > flight.deadline and flight.cancel_cause is None
            if overdue and not flight.failed:
                self._counters.add("expired.write")
                flight.cancel_cause, flight.next_try = Cause.WRITE_FAILED, now
            try:
                outcome = self._step(flight, now)
            except Exception:  # never stop polling the others, or deadlines
                logger.exception(
                    "kvpush: polling the WRITE of %s failed", flight.transfer_id
                )
                flight.next_try = now + RETRY_S
                outcome = None
            if outcome is not None:
                del self._inflight[flight.transfer_id]
                ended.append((flight, outcome))
                continue
            flight.poll_gap = min(2 * flight.poll_gap, POLL_MAX_S)
            self._schedule(flight, flight.next_due(now))
        return ended

    def _take_due(self, now: float) -> list[InFlight]:
        out = []
        while (due := self.next_due()) is not None and due <= now + POLL_SLACK_S:
            _, _, tid = heapq.heappop(self._due)
            out.append(self._inflight[tid])
        return out

    def _schedule(self, flight: InFlight, due: float) -> None:
        flight.due = due
        heapq.heappush(self._due, (due, next(self._seq), flight.transfer_id))

    def _step(self, flight: InFlight, now: float) -> Outcome | None:
        if not flight.failed:
            state = self._io.state(flight.handle)
            if state is XferState.DONE:
                if not self._io.release(flight.handle):  # it completed anyway
                    logger.warning("kvpush: a completed WRITE kept its handle")
                return Outcome.DONE
            if state is XferState.ERR:
                flight.failed, flight.next_try = True, now
        ending = flight.failed or flight.cancel_cause is not None
        due = ending and not flight.stuck and now >= flight.next_try
        if due and self._try_release(flight, now):
            return Outcome.FAILED if flight.failed else Outcome.CANCELLED
        return None

    def _try_release(self, flight: InFlight, now: float) -> bool:
        if self._io.release(flight.handle):
            return True
        flight.release_tries += 1
        flight.next_try = now + RETRY_S
        if not flight.failed and flight.release_tries >= MAX_RELEASE_TRIES:
            flight.stuck = True  # still polled: it may end by itself
            self._counters.add("stuck.write")
            logger.error(
                "kvpush: NIXL will not cancel the WRITE of %s; its blocks stay "
                "held until it ends",
                flight.transfer_id,
            )
        return False

    def get(self, transfer_id: str) -> InFlight | None:
        return self._inflight.get(transfer_id)

    def __iter__(self) -> Iterator[InFlight]:
        return iter(list(self._inflight.values()))

    def __len__(self) -> int:
        return len(self._inflight)

    def release_all(self) -> int:
        """Shutdown: cancel every WRITE; how many NIXL would not release."""
        kept = 0
        for tid, flight in list(self._inflight.items()):
            if self._io.release(flight.handle):
                del self._inflight[tid]
            else:
                kept += 1
        self._due = [e for e in self._due if e[2] in self._inflight]
        heapq.heapify(self._due)
        return kept
