"""Prefill's WRITEs in flight, from the post until NIXL has let go of them.

Used only by the writer thread (:mod:`kvpush.connector.prefill.writer`).
A WRITE ends here in exactly one of two ways, both NIXL's own verdict, and
only once NIXL has released its handle:

* ``DONE``: it completed; its Done notification reached decode with it;
* ``FAILED``: NIXL said ``ERR`` (or raised), and the handle was released.

A WRITE is in flight from the moment NIXL gave it a handle: one NIXL
refused at post time (:class:`~kvpush.connector.nixl_io.WriteRefused`:
``transfer`` said ``ERR`` or raised) may have been partly posted, so it is
tracked here like any other, failed from the start (:meth:`Writes.post`
returns False); only a post that got no handle fails with nothing held.

A running WRITE is never cancelled, neither when decode gives it up, nor
when prefill's request is aborted or preempted, nor past its deadline:
over TCP, releasing a running handle stops only what UCX has not yet sent,
and the bytes already in the sockets still land in decode's blocks (seen on
the rehearsal hosts: a WRITE cancelled at decode's deadline on a 10 Mbit/s
link corrupted the output of the request that reused its blocks). So a
WRITE past its deadline is only counted (``expired.write``) and logged;
decode keeps its blocks quarantined until this WRITE's own end answers it.
After ``ERR`` the release is tried at once (at the next poll) and, while
NIXL refuses, again every :data:`RETRY_S`; the handle stays here until
then, and so do its blocks. Nothing here raises out of a poll or a release.

Every WRITE in flight is polled on every writer tick, every
:data:`POLL_S` while any is in flight: NIXL's progress thread is off, so
these polls are what moves the transfer along and sends its Done
notification (a back-off to 8 ms was tried: handover p50 grew from 4.9 to
6.4 ms in ``kvpush bench``, as Done waited for prefill's next poll). The
cost, per WRITE in flight, is in ``BENCHMARKS.md`` ("Micro-benchmarks").
"""

from __future__ import annotations

import enum
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.connector.counters import Counters
from kvpush.connector.nixl_io import NixlIO, WriteRefused, XferState
from kvpush.connector.prefill.decode_peers import DecodePeer
from kvpush.connector.trace import Tracer
from kvpush.transfer.coalesce import Descs
from kvpush.transfer.heads import group_descriptors
from kvpush.transfer.messages import Done, encode
from kvpush.transfer.shares import HeadSlice
from kvpush.transfer.work import WorkItem

logger = logging.getLogger(__name__)

RETRY_S = 1.0  # between two tries to release a handle after ERR
POLL_S = 0.0005  # the writer's tick while a WRITE is in flight


class Outcome(enum.Enum):
    DONE = "done"
    FAILED = "failed"


@dataclass
class InFlight:
    """One posted WRITE (one or more work items of one transfer) and what
    is known about its end."""

    handle: Any
    transfer_id: str
    engine_id: str
    deadline: float  # past it, the WRITE is counted late (never cancelled)
    num_blocks: int = 0  # the transfer's, for the Done said again on a Reconcile
    notify: bool = True  # it carries the transfer's Done (its last item)
    dst_rank: int = 0  # the decode worker rank it writes to
    late: bool = False  # past its deadline, counted
    failed: bool = False  # NIXL said ERR (or refused the post); to release
    next_try: float = 0.0


class Writes:
    """The WRITEs in flight; a transfer may have several (streamed: one per
    chunk, or per chunk and layer; with TP, one per decode rank written to),
    each tracked on its own, keyed here by (transfer id, sequence number):
    a transfer has a WRITE in flight while any of its pieces, to any decode
    rank, is."""

    def __init__(
        self,
        io: NixlIO,
        engine_id: str,
        tracer: Tracer,
        counters: Counters,
        timeout_s: float,
        rank: int = 0,
    ) -> None:
        self._io, self._engine_id, self._tracer = io, engine_id, tracer
        self._rank = rank  # this prefill worker's TP rank, named in its Done
        self._counters = counters
        self._timeout_s = timeout_s
        self._inflight: dict[tuple[str, int], InFlight] = {}
        self._per_transfer: dict[str, int] = {}  # transfer id -> items in flight
        self._seq = itertools.count()

    def post(
        self,
        items: Sequence[WorkItem],
        peer: DecodePeer,
        head_slice: HeadSlice,
        engine: str,
        now: float,
        total: int,
        digest: bytes | None = None,
    ) -> bool:
        """One WRITE of one transfer's ``items`` (block range x layer range
        pieces, each coalesced into runs; one piece on the whole or chunk
        path, one per group of layers when pushed per layer); if the last
        item notifies it carries the transfer's Done, naming all ``total``
        blocks of the transfer (the caller posts it only once no earlier
        WRITE of the transfer is in flight). ``peer`` is the decode rank
        ``head_slice`` goes to: its heads of each block
        (:func:`~kvpush.transfer.heads.slice_descriptors`: whole blocks
        coalesce into runs, a part of a block is one descriptor per block
        per region). True once posted; False when NIXL refused it after
        giving it a handle: it is in flight all the same, already failed,
        and ends at a later :meth:`poll` once NIXL released the handle.
        Raises when no handle exists (a block outside either cache, layouts
        whose heads differ, NIXL refusing the descriptors). ``digest``: the
        KV digest of everything this transfer writes to that rank, carried
        by its Done (:mod:`kvpush.transfer.digest`)."""
        tid = items[-1].transfer_id
        notify = items[-1].notify
        done = Done(tid, self._engine_id, total, rank=self._rank, digest=digest)
        layouts = (self._io.layout, peer.layout)
        srcs, dsts, num_runs = [], [], 0
        for item in items:
            src, dst, item_runs = group_descriptors(
                item.src_block_ids,
                item.dst_block_ids,
                *layouts,
                item.layers,
                head_slice,
            )
            srcs.append(src)
            dsts.append(dst)
            num_runs += item_runs
        src, dst = (srcs[0], dsts[0]) if len(items) == 1 else _joined(srcs, dsts)
        notif = encode(done) if notify else b""
        refused: WriteRefused | None = None
        try:
            handle = self._io.write(src, dst, peer.agent_name, notif)
        except WriteRefused as e:  # its handle is held: in flight, failed
            handle, refused = e.handle, e
        deadline = now + self._timeout_s
        rank = head_slice.dst_rank
        flight = InFlight(handle, tid, engine, deadline, total, notify, rank)
        self._inflight[(tid, next(self._seq))] = flight
        self._per_transfer[tid] = self._per_transfer.get(tid, 0) + 1
        if refused is not None:
            flight.failed, flight.next_try = True, now
            logger.warning("kvpush: the WRITE of %s failed at post: %s", tid, refused)
            return False
        self._tracer.mark(
            tid,
            "write_posted",
            num_descs=len(src),
            dst_rank=rank,
            num_heads=head_slice.num_heads,
            num_runs=num_runs,
            num_blocks=sum(item.num_blocks for item in items),
            num_layers=len({layer for item in items for layer in item.layers}),
            num_bytes=int(src[:, 1].sum()),  # what the descriptors copy
        )
        return True

    def next_due(self, now: float) -> float | None:
        """When the writer must tick again for these WRITEs (None: none)."""
        return now + POLL_S if self._inflight else None

    def poll(self, now: float) -> list[tuple[InFlight, Outcome]]:
        """The WRITEs that ended since the last call, each once (every WRITE
        in flight is polled). Also counts those past their deadline, and
        retries releases that NIXL refused after ``ERR``."""
        ended = []
        for key, flight in list(self._inflight.items()):
            if now > flight.deadline and not flight.late:
                flight.late = True
                self._counters.add("expired.write")
                logger.warning(
                    "kvpush: the WRITE of %s runs past %.0f s; it is awaited, "
                    "not cancelled (bytes already sent would still land)",
                    flight.transfer_id,
                    self._timeout_s,
                )
            try:
                outcome = self._step(flight, now)
            except Exception:  # never stop polling the others
                logger.exception(
                    "kvpush: polling the WRITE of %s failed", flight.transfer_id
                )
                flight.next_try = now + RETRY_S
                outcome = None
            if outcome is not None:
                self._drop(key)
                ended.append((flight, outcome))
        return ended

    def _drop(self, key: tuple[str, int]) -> None:
        tid = self._inflight.pop(key).transfer_id
        left = self._per_transfer[tid] - 1
        if left:
            self._per_transfer[tid] = left
        else:
            del self._per_transfer[tid]

    def _step(self, flight: InFlight, now: float) -> Outcome | None:
        if not flight.failed:
            state = self._io.state(flight.handle)
            if state is XferState.DONE:
                if not self._io.release(flight.handle):  # it completed anyway
                    logger.warning("kvpush: a completed WRITE kept its handle")
                return Outcome.DONE
            if state is not XferState.ERR:
                return None
            flight.failed, flight.next_try = True, now
            logger.warning(
                "kvpush: the WRITE of %s to decode %s rank %d ended in ERR",
                flight.transfer_id,
                flight.engine_id,
                flight.dst_rank,
            )
        if now < flight.next_try:
            return None
        if self._io.release(flight.handle):
            return Outcome.FAILED
        flight.next_try = now + RETRY_S
        return None

    def has(self, transfer_id: str) -> bool:
        """Whether any WRITE of ``transfer_id`` is in flight."""
        return transfer_id in self._per_transfer

    def __len__(self) -> int:
        return len(self._inflight)


def _joined(srcs: list[Descs], dsts: list[Descs]) -> tuple[Descs, Descs]:
    """Several items' descriptors as the two arrays of one WRITE."""
    return np.ascontiguousarray(np.concatenate(srcs)), np.ascontiguousarray(
        np.concatenate(dsts)
    )
