"""How a prefill transfer ends: the one place prefill frees source blocks.

Owned by the writer's :class:`~kvpush.connector.prefill.pipeline.Pipeline`
(the writer thread); no I/O of its own (decode is told through the
:class:`~kvpush.connector.prefill.tell.Teller`). The timing rule's prefill
half (``docs/architecture.md``) is enforced here: :meth:`Endings.release`
is the only code that hands a transfer's source blocks back (the request
id goes to ``finished``), and it refuses while any WRITE of the transfer
is in flight; :meth:`Endings.end` closes a matched stream (nothing more of
it is posted) and finishes it, with prefill's final word, only once its
last WRITE in flight ended.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from kvpush.connector.counters import Counters
from kvpush.connector.prefill.decode_peers import DecodePeers
from kvpush.connector.prefill.posting import Posting
from kvpush.connector.prefill.stream import Stream, Streams
from kvpush.connector.prefill.tell import Teller
from kvpush.connector.prefill.writes import Writes
from kvpush.transfer.matcher import Dropped
from kvpush.transfer.messages import Cause

logger = logging.getLogger(__name__)


class Endings:
    """Frees source blocks and says prefill's final word, item-aware."""

    def __init__(
        self,
        streams: Streams,
        to_post: Posting,
        writes: Writes,
        peers: DecodePeers,
        tell: Teller,
        finished: Callable[[str], None],
        counters: Counters,
    ) -> None:
        self._streams, self._to_post, self._writes = streams, to_post, writes
        self._peers, self._tell, self._finished = peers, tell, finished
        self._counters = counters

    def drop_all(self, dropped: Iterable[Dropped], cause: Cause | None) -> None:
        """Free what the matcher let go and, unless ``cause`` is None (the
        caller answers decode itself, or nobody is left to tell), tell decode.
        An expired ready KV tells decode too: its registration was lost, and
        decode should not wait out its own deadline. A late-bound ready KV
        that no decode claimed has nobody to tell."""
        for d in dropped:
            if d.ready is not None:
                self.release(d.transfer_id)
            if cause is Cause.EXPIRED:
                self._counters.add(f"expired.{d.side}")
            if cause is not None and d.notify_engine_id:
                self.fail(d.transfer_id, d.notify_engine_id, cause, d.reason)
            else:
                self._tell.closed(d.transfer_id)

    def end(
        self,
        tid: str,
        engine: str,
        cause: Cause | None,
        detail: str,
        route: bytes | None = None,
    ) -> None:
        """A matched transfer will not complete: nothing more of it is
        posted; once no WRITE of it is in flight, free our blocks and tell
        decode (``cause`` None: nobody is left to tell), on ``route`` too
        (a Cancel's: each decode rank that cancelled is answered)."""
        self._to_post.pop(tid)
        stream = self._streams.get(tid)
        if stream is None:
            self.release(tid)
            self.word(tid, engine, cause, detail, route)
            return
        if route is not None:
            self._tell.asked(tid, route)
        stream.close(cause, detail)
        if stream.in_flight == 0:
            self.finish(stream)

    def finish(self, stream: Stream) -> None:
        """A closed stream's last WRITE ended (or it had none): its word
        goes to every route the :class:`Teller` keeps for it."""
        closing, tid = stream.closing, stream.transfer_id
        self.release(tid)
        if closing is not None:
            self.word(tid, stream.engine, closing.cause, closing.why, None)

    def word(
        self, tid: str, engine: str, cause: Cause | None, why: str, route: bytes | None
    ) -> None:
        if cause is None:
            self._tell.closed(tid)
        else:
            self.fail(tid, engine, cause, why, route)

    def release(self, tid: str) -> None:
        """Prefill's blocks for ``tid`` may be freed: the one place that
        says so, and only when no WRITE of ``tid`` reads them."""
        if self._writes.has(tid):  # unreachable: callers wait for the WRITEs
            logger.error("kvpush: kept the blocks of %s: a WRITE reads them", tid)
            return
        self._to_post.pop(tid)
        stream = self._streams.pop(tid)
        if stream is not None:
            self._finished(stream.req_id)

    def fail(
        self,
        tid: str,
        engine: str,
        cause: Cause,
        detail: str,
        route: bytes | None = None,
    ) -> None:
        """Prefill's final word on ``tid`` (see :class:`Teller`)."""
        peer = self._peers.get(engine)
        self._tell.fail(tid, cause, detail, route, peer.route if peer else None)
