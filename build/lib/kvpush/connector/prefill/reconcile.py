"""Prefill's answer to a decode that reconnected: which transfers will
never be written.

A ROUTER socket drops what it sends to a peer whose connection is down, so
a Failure prefill sent to a decode during a partition is lost, and the
decode's old sockets (the routes prefill answers on) are gone with it.
After the connection comes back decode sends a
:class:`~kvpush.transfer.messages.Reconcile` naming every receive it still
waits on from this prefill. For each id, :meth:`Reconciler.answer`:

* prefill still *holds* it (a half waiting in the matcher, or a matched
  stream: an item to post, a chunk still to come, or a WRITE in flight):
  it carries on, and its final word will reach this decode rank: the
  WRITE's Done as its NIXL notification, a Failure on the Reconcile's
  socket (and on every other decode rank's that reconciled it: with decode
  TP larger than prefill's each decode rank this prefill rank writes sends
  its own Reconcile, :meth:`~kvpush.connector.prefill.tell.Teller.reconciled`);
* otherwise no WRITE of it is in flight or can be posted: the id is closed
  in the matcher (a Registration that comes later under it is refused, for
  the matcher's tombstone time), and prefill says its final word again
  (:meth:`~kvpush.connector.prefill.tell.Teller.again`): the Failure it
  sent, the Done of a WRITE NIXL reported complete, or ``Failure(peer_lost)``
  when it remembers none.

Owned by the writer's :class:`~kvpush.connector.prefill.pipeline.Pipeline`
(the writer thread), over the pipeline's own parts; no I/O of its own.
"""

from __future__ import annotations

import logging

from kvpush.connector.counters import Counters
from kvpush.connector.prefill.stream import Streams
from kvpush.connector.prefill.tell import Teller
from kvpush.transfer.matcher import Matcher
from kvpush.transfer.messages import Cause, Reconcile

logger = logging.getLogger(__name__)


class Reconciler:
    """Answers Reconciles from the pipeline's matcher and streams."""

    def __init__(
        self, matcher: Matcher, streams: Streams, tell: Teller, counters: Counters
    ) -> None:
        self._matcher, self._streams = matcher, streams
        self._tell, self._counters = tell, counters

    def holds(self, tid: str) -> bool:
        """Whether a WRITE of ``tid`` is in flight or may still be posted: a
        half in the matcher, or a matched stream (to post, waiting for its
        next chunk, or with items in flight) that has not ended."""
        return self._matcher.is_pending(tid) or tid in self._streams

    def answer(self, route: bytes, reconcile: Reconcile, now: float) -> None:
        """Decode ``reconcile.engine_id`` waits on these ids (from ``route``)."""
        logger.info(
            "kvpush: decode %s (boot %s) reconnected; it waits on %d transfers",
            reconcile.engine_id,
            reconcile.boot_id,
            len(reconcile.transfer_ids),
        )
        for tid in reconcile.transfer_ids:
            owner = self._matcher.registered_by(tid)
            if owner is not None and owner != reconcile.engine_id and self.holds(tid):
                # another decode's: it is never written for this one
                self._counters.add("reconciled.ended")
                why = "another decode registered for this transfer"
                self._tell.refuse(tid, Cause.REJECTED, why, route)
                continue
            if self.holds(tid):
                self._counters.add("reconciled.live")
                self._tell.reconciled(tid, route)  # its Failure goes here too
                continue
            self._counters.add("reconciled.ended")
            # Not pending, so this only closes the id (drops nothing).
            self._matcher.cancel(tid, "reconciled with decode", now)
            self._tell.again(tid, reconcile.engine_id, route)
