"""How prefill's writer tells a decode about a transfer: its final word.

Owned by the writer's :class:`~kvpush.connector.prefill.pipeline.Pipeline`
(the writer thread). A :class:`Failure` is prefill's final word on a
transfer: sent only when no WRITE of it is in flight or can still be posted
(the pipeline's job). This class decides *where* it goes
(:class:`Routes`): on every socket that asked for it (each Cancel's, and,
once decode reconnected, each decode rank's Reconcile's: with decode TP
larger than prefill's, one prefill rank writes several decode ranks, each
asking on its own socket), else on the socket the transfer's Registration
came on (decode's scheduler, which forwards it to its workers, so it
reaches decode even before any Hello), else to decode's worker (its
Hello's socket). With none known it is counted and dropped: decode's own
deadline then asks again. A Done needs no route: each decode rank gets its
own as the NIXL notification of its last WRITE.

It also remembers the last :data:`MAX_WORDS` final words (:class:`FinalWords`:
each Failure, and the Done of each WRITE that completed), to say them again
when decode reconciles after a lost connection (a ROUTER drops what it
sends to a disconnected peer).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpush.connector.counters import Counters
from kvpush.transfer.messages import (
    Cause,
    Done,
    Failure,
    FirstToken,
    Message,
    SampleLogprobs,
)

logger = logging.getLogger(__name__)

MAX_DETAIL = 1000
MAX_WORDS = 16_384  # final words remembered (oldest forgotten first; ~5 MB)


@dataclass(frozen=True)
class Word:
    """What prefill last said about a transfer, and to which decode."""

    decode_engine_id: str | None  # None: not recorded (a Failure to anyone)
    message: Done | Failure
    route: bytes | None = None  # a Done's: where its Registration came from


class FinalWords:
    """The last ``limit`` final words, by transfer id (pure, bounded)."""

    def __init__(self, limit: int = MAX_WORDS) -> None:
        self._limit = limit
        self._words: OrderedDict[str, Word] = OrderedDict()

    def put(self, tid: str, word: Word) -> None:
        self._words[tid] = word
        self._words.move_to_end(tid)
        while len(self._words) > self._limit:
            self._words.popitem(last=False)

    def get(self, tid: str) -> Word | None:
        return self._words.get(tid)

    def __len__(self) -> int:
        return len(self._words)


@dataclass
class Routes:
    """Where one transfer's final word goes: every socket that asked for
    it, else its Registration's."""

    registration: bytes | None = None  # where its Registration came from
    asked: list[bytes] = field(default_factory=list)  # Cancels', Reconciles'
    reconciled: bool = False  # a Reconcile named it: older sockets are gone

    def ask(self, route: bytes) -> None:
        """A decode socket asked for the word (said once per socket)."""
        if route not in self.asked:
            self.asked.append(route)

    def reconcile(self, route: bytes) -> None:
        """A decode rank reconnected and asked on ``route``: the sockets
        known from before the first Reconcile died with the connection;
        every Reconcile's (one per decode rank) is kept."""
        if not self.reconciled:
            self.registration, self.asked, self.reconciled = None, [], True
        self.ask(route)

    def targets(self) -> list[bytes]:
        if self.asked:
            return list(self.asked)
        return [self.registration] if self.registration is not None else []


class Teller:
    """The reply routes of open transfers, and the final words sent on them."""

    def __init__(
        self,
        engine_id: str,
        reply: Callable[[bytes, Message], None],
        counters: Counters,
        rank: int = 0,
    ) -> None:
        self._engine_id, self._reply, self._counters = engine_id, reply, counters
        self._rank = rank  # this prefill worker's TP rank, named in every word
        self._routes: dict[str, Routes] = {}  # of the transfers not ended
        self.words = FinalWords()

    def registered(self, tid: str, route: bytes) -> None:
        """``tid``'s Registration came on ``route``."""
        self._routes.setdefault(tid, Routes()).registration = route

    def asked(self, tid: str, route: bytes) -> None:
        """A Cancel of ``tid`` came on ``route``: its final word goes there
        (and to every other socket that asked), not to the Registration's."""
        self._routes.setdefault(tid, Routes()).ask(route)

    def reconciled(self, tid: str, route: bytes) -> None:
        """A decode rank that reconnected named ``tid``, still held, in a
        Reconcile from ``route``: its final word goes there, and to each
        other decode rank's Reconcile socket (:meth:`Routes.reconcile`)."""
        self._routes.setdefault(tid, Routes()).reconcile(route)

    def closed(self, tid: str) -> None:
        """``tid`` ended without a word (nobody is left to tell, or the
        caller answers itself)."""
        self._routes.pop(tid, None)

    def done(self, tid: str, decode_engine_id: str, num_blocks: int) -> None:
        """``tid``'s WRITE completed: its Done told decode (remembered)."""
        routes = self._routes.pop(tid, None)
        route = routes.registration if routes is not None else None
        done = Done(tid, self._engine_id, num_blocks, rank=self._rank)
        self.words.put(tid, Word(decode_engine_id, done, route))

    def first_token(
        self, tid: str, token_id: int, logprobs: SampleLogprobs | None = None
    ) -> None:
        """Tell ``tid``'s decode scheduler the token prefill sampled, on the
        socket its Registration came from, while the transfer is open or
        after its WRITE completed (the token comes a step after the KV);
        not after a Failure, nor when no Registration came: decode then
        computes the token itself."""
        routes = self._routes.get(tid)
        route = routes.registration if routes is not None else None
        word = self.words.get(tid)
        if route is None and word is not None and isinstance(word.message, Done):
            route = word.route
        if route is None:
            self._counters.add("first_token.unroutable")
            return
        self._counters.add("first_token.sent")
        self._reply(route, FirstToken(tid, self._engine_id, token_id, logprobs))

    def fail(
        self,
        tid: str,
        cause: Cause,
        detail: str,
        route: bytes | None = None,
        worker_route: bytes | None = None,
    ) -> None:
        """Prefill will not write ``tid``: say so (remembered), once on each
        socket that asked for it (``route`` too: a Cancel's or Reconcile's
        being answered now), else on the Registration's, else on
        ``worker_route``."""
        logger.warning("kvpush: transfer %s failed (%s): %s", tid, cause.value, detail)
        self._counters.add(f"failed.{cause.value}")
        routes = self._routes.pop(tid, None) or Routes()
        if route is not None:
            routes.ask(route)
        targets = routes.targets() or ([worker_route] if worker_route else [])
        failure = self._failure(tid, cause, detail)
        self.words.put(tid, Word(None, failure))
        if not targets:
            self._counters.add("failed.unroutable")
        for target in targets:
            self._reply(target, failure)

    def refuse(self, tid: str, cause: Cause, detail: str, route: bytes) -> None:
        """Tell the decode on ``route`` that ``tid`` will never be written
        for it, while the transfer goes on for another decode (it was
        claimed by that one): nothing of the transfer's own routes and
        final words changes."""
        logger.warning("kvpush: refused %s on another route: %s", tid, detail)
        self._reply(route, self._failure(tid, cause, detail))

    def again(self, tid: str, decode_engine_id: str, route: bytes) -> None:
        """Say the final word on ``tid`` again, on ``route`` (a Reconcile's):
        the one remembered (a Done only to the decode it wrote to), else
        ``Failure(peer_lost)``. The caller has made sure no WRITE of ``tid``
        is in flight or can be posted."""
        word = self.words.get(tid)
        why = "prefill no longer holds this transfer (reconciled)"
        if word is None:
            self.fail(tid, Cause.PEER_LOST, why, route)
        elif word.decode_engine_id in (None, decode_engine_id):
            self._reply(route, word.message)
        else:  # another decode's transfer: not its Done, and not forgotten
            self._reply(route, self._failure(tid, Cause.PEER_LOST, why))

    def _failure(self, tid: str, cause: Cause, detail: str) -> Failure:
        return Failure(
            tid, self._engine_id, cause, detail[:MAX_DETAIL], rank=self._rank
        )

    def __len__(self) -> int:
        return len(self._routes)
