"""Decode's KV-digest checks, off the engine thread (thread
``kvpush-verify``, one per decode worker, started on the first check).

The worker's main thread takes the :class:`~kvpush.connector.decode.receiver.Check`
list from its :class:`~kvpush.connector.decode.receiver.Receiver` in
``get_finished`` and hands each here (:meth:`Verifier.submit`, which
only derives the destination ranges and queues the job); this thread
hashes those bytes of decode's own KV memory (``hashlib`` releases the GIL
while it hashes, so vLLM's forward goes on) and queues the verdict; the
main thread takes the verdicts in a later ``get_finished``
(:meth:`Verifier.take`) and gives them to the Receiver. The receive stays
pending meanwhile, its blocks held, so nothing else writes or reads them.

The destination ranges (:func:`~kvpush.transfer.digest.destination_ranges`)
come from what decode knows: the receive's registered blocks, its own
layout, and the head slice this decode rank receives from that prefill
rank (:class:`~kvpush.transfer.ranks.TpPair` of the expect's
``prefill_tp``, this rank's TP size and the model's KV heads).

Fault injection (tests only, :mod:`kvpush.connector.faults`): with
``corrupt_received`` set, :meth:`Verifier.submit` inverts the first byte
this rank received for the transfer, in memory, before the check is
queued: the detector's self-test (the mismatch must be caught and the
request recomputed).
"""

from __future__ import annotations

import hmac
import logging
import queue
import threading
from collections.abc import Callable

from kvpush.connector.decode.receiver import Check
from kvpush.connector.faults import FaultSource
from kvpush.connector.kv_bytes import KvBytes
from kvpush.transfer.digest import Ranges, destination_ranges, digest
from kvpush.transfer.layout import KvLayout
from kvpush.transfer.ranks import TpPair

logger = logging.getLogger(__name__)

JOIN_S = 5.0  # close(): how long to wait for a check under way

Verdict = tuple[str, int, bool]  # (transfer id, prefill rank, intact)


class Verifier:
    """Checks digests against this decode rank's KV memory."""

    def __init__(
        self,
        layout: KvLayout,
        memory: KvBytes,
        rank: int,
        tp_size: int,
        total_kv_heads: int,
        faults: FaultSource,
        run_inline: bool = False,
    ) -> None:
        """``run_inline`` (tests): check on the caller's thread, at once."""
        self._layout, self._memory, self._faults = layout, memory, faults
        self._rank, self._tp_size, self._heads = rank, tp_size, total_kv_heads
        self._inline = run_inline
        self._jobs: queue.SimpleQueue[Callable[[], Verdict] | None] = (
            queue.SimpleQueue()
        )
        self._verdicts: queue.SimpleQueue[Verdict] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, check: Check) -> None:
        """Queue ``check`` (worker's main thread; returns at once)."""
        tid = check.expect.transfer_id
        try:
            ranges = self._ranges(check)
        except Exception:  # fail closed: a digest we cannot check fails
            logger.exception("kvpush: cannot check the KV digest of %s", tid)
            self._verdicts.put((tid, check.rank, False))
            return
        if self._faults.corrupts_received() and len(ranges):
            logger.warning("kvpush: FAULT: corrupting received KV of %s", tid)
            self._memory.flip(int(ranges[0, 0]))

        def job() -> Verdict:
            try:
                mine = digest(ranges, self._memory.read)
                intact = hmac.compare_digest(mine, check.digest)
            except Exception:
                logger.exception("kvpush: checking the KV digest of %s failed", tid)
                intact = False
            return (tid, check.rank, intact)

        if self._inline:
            self._verdicts.put(job())
            return
        self._start()
        self._jobs.put(job)

    def take(self) -> list[Verdict]:
        """Verdicts reached since the last call (worker's main thread)."""
        out = []
        while True:
            try:
                out.append(self._verdicts.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(JOIN_S)

    def _ranges(self, check: Check) -> Ranges:
        expect = check.expect
        pair = TpPair(expect.prefill_tp, self._tp_size, self._heads)
        for head_slice in pair.targets_of(check.rank):
            if head_slice.dst_rank == self._rank:
                return destination_ranges(
                    expect.dst_block_ids, self._layout, head_slice
                )
        raise ValueError(f"prefill rank {check.rank} writes nothing to this rank")

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="kvpush-verify", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._verdicts.put(job())
