"""Prefill's WRITEs in flight: one work item's descriptors built, posted
over NIXL with its Done notification, and polled until it ends or its
deadline passes (then NIXL is asked to cancel it; only a cancelled WRITE
frees its blocks, since one still running could yet land). Used only by the
writer thread (:mod:`kvpush.connector.writer`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpush.connector.decode_peers import DecodePeer
from kvpush.connector.nixl_io import NixlIO
from kvpush.connector.trace import Tracer
from kvpush.transfer.coalesce import descriptors, runs
from kvpush.transfer.messages import Done, encode
from kvpush.transfer.work import WorkItem


@dataclass
class InFlight:
    handle: Any
    req_id: str
    engine_id: str
    deadline: float  # past it, the WRITE is cancelled
    cancel_route: bytes | None = None  # decode cancelled: answer when over


class Writes:
    """The WRITEs in flight, by transfer id."""

    def __init__(
        self, io: NixlIO, engine_id: str, tracer: Tracer, timeout_s: float
    ) -> None:
        self._io, self._engine_id, self._tracer = io, engine_id, tracer
        self._timeout_s = timeout_s
        self._inflight: dict[str, InFlight] = {}

    def post(
        self, item: WorkItem, peer: DecodePeer, req_id: str, engine: str, now: float
    ) -> None:
        """One WRITE for one work item (a block range x a layer range); the
        transfer's last item carries the Done notification. Raises when it
        cannot be posted (a block outside either cache, NIXL refusing)."""
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
        deadline = now + self._timeout_s
        self._inflight[item.transfer_id] = InFlight(handle, req_id, engine, deadline)
        sizes = {"num_descs": len(src), "num_runs": len(block_runs)}
        self._tracer.mark(
            item.transfer_id, "write_posted", **sizes, num_blocks=item.num_blocks
        )

    def poll(self) -> list[tuple[str, InFlight, str]]:
        """The WRITEs that ended since the last call: (transfer id, its
        flight, ``"DONE"`` or ``"ERR"``)."""
        ended = []
        for tid, flight in list(self._inflight.items()):
            state = self._io.poll(flight.handle)
            if state != "PROC":
                del self._inflight[tid]
                ended.append((tid, flight, state))
        return ended

    def cancel_overdue(self, now: float) -> list[tuple[str, InFlight]]:
        """WRITEs past their deadline that NIXL cancelled (no longer in
        flight: their blocks may be freed). One NIXL cannot cancel stays in
        flight and is tried again after another timeout."""
        cancelled = []
        for tid, flight in list(self._inflight.items()):
            if now <= flight.deadline:
                continue
            if self._io.cancel(flight.handle):
                del self._inflight[tid]
                cancelled.append((tid, flight))
            else:
                flight.deadline = now + self._timeout_s
        return cancelled

    def get(self, transfer_id: str) -> InFlight | None:
        return self._inflight.get(transfer_id)

    def __len__(self) -> int:
        return len(self._inflight)
