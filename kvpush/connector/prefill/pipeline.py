"""The prefill writer's state machine: every transfer from its first half
(a Registration or the finished KV) to prefill's final word on it.

Owned by the writer thread (:mod:`kvpush.connector.prefill.writer`), which
feeds it events and runs :attr:`Pipeline.steps` on each tick; no locks, no waits. A
transfer is in exactly one phase here:

1. *half*: one half waits in the :class:`~kvpush.transfer.matcher.Matcher`
   (its deadline is the matcher's);
2. *to post*: matched, waiting until decode's boot said Hello, the KV's
   device fence completed and (fault injection only) a delay passed; all
   within the registration's post deadline, which is checked right before
   the post;
3. *in flight*: a WRITE posted (:class:`~kvpush.connector.prefill.writes.Writes`).

Every way out frees prefill's blocks (the request id goes to ``finished``)
and, unless the WRITE's own Done said it, tells decode with a
:class:`Failure`, prefill's final word: sent only once no WRITE of the
transfer is in flight or can be posted later. Failures about a registered
transfer go back on the socket its Registration came on (decode's
scheduler, which forwards them to its worker), so they reach decode even
before its Hello; answers to a Cancel or a Reconcile (decode reconnected:
:mod:`~kvpush.connector.prefill.reconcile`) go on its socket.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvpush.connector.counters import Counters
from kvpush.connector.faults import FaultSource
from kvpush.connector.nixl_io import NixlIO
from kvpush.connector.prefill.decode_peers import DecodePeers
from kvpush.connector.prefill.fence import ReadyFence
from kvpush.connector.prefill.posting import Posting, ToPost
from kvpush.connector.prefill.preempt_waits import PreemptWaits
from kvpush.connector.prefill.reconcile import Reconciler
from kvpush.connector.prefill.tell import Teller
from kvpush.connector.prefill.writes import InFlight, Outcome, Writes
from kvpush.connector.trace import Tracer
from kvpush.transfer.matcher import (
    Dropped,
    Matched,
    Matcher,
    MatcherConfig,
    ReadyKv,
    Rejected,
)
from kvpush.transfer.messages import (
    Cancel,
    Cause,
    Heartbeat,
    Hello,
    HelloReply,
    HelloRequest,
    Message,
    Reconcile,
    Registration,
)
from kvpush.transfer.work import split_whole

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.1  # longest sleep of the writer thread
WRITE_TIMEOUT_S = 30.0  # a WRITE in flight longer than this is counted late
POLL_S = 0.0005  # poll period while a device fence is pending


@dataclass(frozen=True)
class WriterConfig:
    """What one prefill worker's writer needs to know (frozen)."""

    engine_id: str
    matcher: MatcherConfig
    boot_id: str = "0"  # this start of the prefill (sent in HelloReply)
    peer_timeout_s: float = 10.0  # a decode silent this long is dropped
    write_timeout_s: float = WRITE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.peer_timeout_s <= 0 or self.write_timeout_s <= 0:
            raise ValueError("peer_timeout_s and write_timeout_s must be > 0")


@dataclass(frozen=True)
class Ready:
    """The worker's trigger: ``req_id``'s KV for ``ready`` is computed (once
    ``fence`` says so)."""

    ready: ReadyKv
    req_id: str
    fence: ReadyFence


class Pipeline:
    """Pending halves, matched transfers, WRITEs in flight, known decodes."""

    def __init__(
        self,
        io: NixlIO,
        config: WriterConfig,
        reply: Callable[[bytes, Message], None],
        finished: Callable[[str], None],
        tracer: Tracer,
        counters: Counters,
        faults: FaultSource,
    ) -> None:
        self._io, self._engine_id, self._boot_id = io, config.engine_id, config.boot_id
        self._reply, self._finished = reply, finished
        self._tracer, self._counters, self._faults = tracer, counters, faults
        self._matcher = Matcher(config.matcher)
        self._peers = DecodePeers(config.peer_timeout_s)
        self._writes = Writes(
            io, config.engine_id, tracer, counters, config.write_timeout_s
        )
        self._later: list[tuple[float, int, Ready]] = []  # fault-delayed KV
        self._seq = itertools.count()
        self._to_post = Posting()
        self._req_of: dict[str, str] = {}  # transfer id -> prefill request id
        self._fences: dict[str, ReadyFence] = {}
        self._tell = Teller(config.engine_id, reply, counters)
        self._reconciler = Reconciler(
            self._matcher, self._to_post, self._writes, self._tell, counters
        )
        self._preempt_waits = PreemptWaits()

    # -- events ------------------------------------------------------------

    def on_ready(self, item: Ready, now: float) -> None:
        due = now + self._faults.ready_delay_s()
        if due <= now:
            self._admit(item, now)
        else:
            heapq.heappush(self._later, (due, next(self._seq), item))

    def on_message(self, route: bytes, message: Message, now: float) -> None:
        if isinstance(message, Hello | Heartbeat | Cancel | Reconcile):
            self._peers.heard(message.engine_id, now)
        if isinstance(message, Hello):
            self._hello(route, message, now)
        elif isinstance(message, Registration):
            self._peers.heard(message.decode_engine_id, now)
            self._registration(route, message, now)
        elif isinstance(message, Cancel):
            self._decode_cancel(route, message, now)
        elif isinstance(message, Reconcile):
            self._reconciler.answer(route, message, now)
        elif not isinstance(message, Heartbeat):
            self._counters.add("rejected.unexpected")
            logger.warning("kvpush writer: unexpected %s", type(message).__name__)

    def on_prefill_cancel(self, tid: str, now: float) -> None:
        """Prefill gave the request up (aborted before its KV was ready)."""
        self._counters.add("cancelled.by_prefill")
        self._stop(tid, Cause.CANCELLED, "prefill cancelled the request", now)

    def on_preempt(
        self, tids: Iterable[str], done: Callable[[], None], now: float
    ) -> None:
        """vLLM preempted these transfers' prefill requests; their blocks are
        about to be reused. A WRITE in flight is let finish (its source is
        intact until ``done`` is called); anything not yet posted is closed
        and never posted."""
        waiting = set()
        for tid in tids:
            if self._writes.get(tid) is not None:
                waiting.add(tid)
            else:
                self._counters.add("preempted.before_write")
                self._stop(tid, Cause.PREEMPTED, "prefill's request was preempted", now)
        self._preempt_waits.add(waiting, done)

    def pardon(self, now: float, gap_s: float) -> None:
        logger.warning("kvpush writer: this process stalled for %.1f s", gap_s)
        self._peers.pardon(now)

    # -- the writer's tick -----------------------------------------------------

    @property
    def steps(self) -> tuple[Callable[[float], None], ...]:
        """What each tick runs, in order (each guarded on its own)."""
        return (self._admit_due, self._post_due, self._poll, self._expire)

    def wait_s(self, now: float) -> float:
        """How long the writer may sleep before the next due work."""
        if any(not self._fence_ready(tid) for tid in self._to_post):
            return POLL_S
        due = [self._matcher.next_deadline(), self._writes.next_due(now)]
        due += [self._later[0][0]] if self._later else []
        due.append(self._to_post.next_due())
        soonest = min((d for d in due if d is not None), default=now + IDLE_WAIT_S)
        return min(IDLE_WAIT_S, max(0.0, soonest - now))

    def shutdown(self) -> bool:
        """Cancel every WRITE in flight; True if NIXL let go of all."""
        kept = self._writes.release_all()
        if kept:
            logger.error("kvpush writer: %d WRITE(s) still held at shutdown", kept)
        return kept == 0

    # -- phase 1: halves -------------------------------------------------------

    def _admit_due(self, now: float) -> None:
        while self._later and self._later[0][0] <= now:
            self._admit(heapq.heappop(self._later)[2], now)

    def _admit(self, item: Ready, now: float) -> None:
        tid = item.ready.transfer_id
        if tid in self._req_of:  # another request's KV holds this id
            self._counters.add("rejected.duplicate")
            logger.warning("kvpush: second KV for transfer %s refused", tid)
            self._finished(item.req_id)
            return
        result = self._matcher.add_ready(item.ready, now)
        if isinstance(result, Rejected):
            self._counters.add(f"rejected.{result.code}")
            logger.warning("kvpush: KV of %s refused: %s", tid, result.reason)
            self._finished(item.req_id)  # the matcher took nothing of ours
            self._drop_all(result.dropped, Cause.REJECTED)
            if result.code in ("invalid", "mismatch", "capacity"):
                engine = item.ready.decode_engine_id
                self._fail(tid, engine, Cause.REJECTED, result.reason)
            return
        self._req_of[tid] = item.req_id
        self._fences[tid] = item.fence
        if isinstance(result, Matched):
            self._matched(result, now)

    def _registration(self, route: bytes, reg: Registration, now: float) -> None:
        tid, engine = reg.transfer_id, reg.decode_engine_id
        problem = self._peers.range_problem(reg)
        if problem is not None:  # refused; the transfer is closed
            self._counters.add("rejected.out_of_range")
            self._drop_all(self._matcher.cancel(tid, problem, now), None)
            self._fail(tid, engine, Cause.REJECTED, problem, route)
            return
        result = self._matcher.add_registration(reg, now)
        if isinstance(result, Rejected):
            self._counters.add(f"rejected.{result.code}")
            logger.warning("kvpush: registration %s refused: %s", tid, result.reason)
            if result.code == "duplicate":
                return  # the transfer carries on; its owner must not hear of it
            self._drop_all(result.dropped, Cause.REJECTED)
            self._fail(tid, engine, Cause.REJECTED, result.reason, route)
            return
        self._tell.registered(tid, route)
        if not self._peers.knows(engine, reg.decode_boot_id):
            ask = HelloRequest(self._engine_id, reg.decode_boot_id, tid)
            self._reply(route, ask)
        if isinstance(result, Matched):
            self._matched(result, now)

    # -- phase 2: matched, to post -------------------------------------------

    def _matched(self, m: Matched, now: float) -> None:
        self._to_post.add(m, now + self._faults.post_delay_s())

    def _fence_ready(self, tid: str) -> bool:
        fence = self._fences.get(tid)
        return fence is None or fence.is_ready()

    def _post_due(self, now: float) -> None:
        postable, overdue = self._to_post.sweep(
            now, self._peers.knows, self._fence_ready
        )
        for late in overdue:
            if late.event is not None:
                self._counters.add(late.event)
            tp = late.item
            self._end(tp.transfer_id, tp.engine, late.cause, late.why)
        for tp in postable:
            self._fences.pop(tp.transfer_id, None)
            self._post(tp, now)

    def _post(self, tp: ToPost, now: float) -> None:
        m, peer = tp.matched, self._peers.get(tp.engine)
        problem = self._peers.range_problem(m.registration)
        if problem is not None or peer is None:
            self._counters.add("rejected.out_of_range")
            self._end(m.transfer_id, tp.engine, Cause.REJECTED, problem or "no peer")
            return
        (item,) = split_whole(
            m.transfer_id, m.src_block_ids, m.dst_block_ids, self._io.layout.num_layers
        )
        try:
            self._writes.post(item, peer, tp.engine, now)
        except Exception as e:
            self._end(m.transfer_id, tp.engine, Cause.WRITE_FAILED, str(e))

    # -- phase 3: in flight ----------------------------------------------------

    def _poll(self, now: float) -> None:
        ended = self._writes.poll(now)
        for flight, outcome in ended:
            self._write_ended(flight, outcome)
        if ended:
            self._preempt_waits.ended(f.transfer_id for f, _ in ended)

    def _write_ended(self, flight: InFlight, outcome: Outcome) -> None:
        tid, engine, route = flight.transfer_id, flight.engine_id, flight.cancel_route
        if outcome is Outcome.DONE:  # its Done went with it: the final word
            self._tracer.mark(tid, "write_done")
            self._release(tid)
            self._tell.done(tid, engine, flight.num_blocks)
        else:
            self._tracer.mark(tid, "write_ended")
            self._end(tid, engine, Cause.WRITE_FAILED, "NIXL reported an error", route)

    # -- deadlines and peers -------------------------------------------------

    def _expire(self, now: float) -> None:
        self._drop_all(self._matcher.expire(now), Cause.EXPIRED)
        engines = self._matcher.engines_with_registrations()
        engines |= self._to_post.engines()
        for engine in self._peers.silent(engines, now):
            self._forget(engine, f"no message for {self._peers.timeout_s:.0f} s", now)

    def _hello(self, route: bytes, hello: Hello, now: float) -> None:
        known = self._peers.get(hello.engine_id)
        if known is not None and known.boot_id != hello.boot_id:
            self._forget(hello.engine_id, "decode restarted", now, hello.boot_id)
        problem = self._peers.accept(hello, route, self._io.layout, self._io.load_peer)
        reply = HelloReply(
            engine_id=self._engine_id,
            accepted=problem is None,
            boot_id=self._boot_id,
            reason=problem or "",
        )
        self._reply(route, reply)
        if problem is not None:
            self._counters.add("rejected.incompatible")
            logger.warning("kvpush: refused decode %s: %s", hello.engine_id, problem)

    def _forget(
        self, engine: str, why: str, now: float, new_boot: str | None = None
    ) -> None:
        """Decode ``engine`` fell silent (``new_boot`` None: drop all its
        transfers and tell it, in case it was only stalled) or restarted as
        ``new_boot`` (drop the old boot's; nobody is left to tell). WRITEs
        already in flight end by themselves."""
        logger.warning("kvpush: dropping decode %s: %s", engine, why)
        self._counters.add("peer_lost")
        tell = Cause.PEER_LOST if new_boot is None else None
        if new_boot is None:
            gone = set(self._matcher.ids_for_engine(engine))
        else:
            gone = {
                r.transfer_id
                for r in self._matcher.registrations_of(engine)
                if r.decode_boot_id != new_boot
            }
        for tid in gone:
            self._drop_all(self._matcher.cancel(tid, why, now), tell)
        for tp in self._to_post.of_engine(engine, new_boot):
            self._to_post.pop(tp.transfer_id)
            self._release(tp.transfer_id)
            if tell is not None:
                self._fail(tp.transfer_id, engine, tell, why)
            else:
                self._tell.closed(tp.transfer_id)
        self._peers.forget(engine, dead=new_boot is None)

    # -- endings ---------------------------------------------------------------

    def _stop(self, tid: str, cause: Cause, why: str, now: float) -> None:
        """Close ``tid`` wherever it is; a WRITE in flight runs to its end
        (see :mod:`kvpush.connector.prefill.writes`)."""
        if self._writes.get(tid) is not None:
            return
        if (tp := self._to_post.pop(tid)) is not None:
            self._end(tid, tp.engine, cause, why)
        else:
            self._drop_all(self._matcher.cancel(tid, why, now), cause)

    def _decode_cancel(self, route: bytes, cancel: Cancel, now: float) -> None:
        """Decode gave the transfer up: stop it wherever it is, and answer
        with a Failure once no WRITE of it can land any more."""
        tid = cancel.transfer_id
        self._counters.add("cancelled.by_decode")
        if self._writes.get(tid) is not None:  # answered when the WRITE ends
            self._writes.answer_on(tid, route)
            return
        if self._to_post.pop(tid) is not None:
            self._release(tid)
        else:
            self._drop_all(self._matcher.cancel(tid, cancel.reason, now), None)
        why = f"cancelled by decode: {cancel.reason}"
        self._fail(tid, cancel.engine_id, Cause.CANCELLED, why, route)

    def _drop_all(self, dropped: Iterable[Dropped], cause: Cause | None) -> None:
        """Free what the matcher let go and, unless ``cause`` is None (the
        caller answers decode itself, or nobody is left to tell), tell decode.
        An expired ready KV tells decode too: its registration was lost, and
        decode should not wait out its own deadline."""
        for d in dropped:
            if d.ready is not None:
                self._release(d.transfer_id)
            if cause is Cause.EXPIRED:
                self._counters.add(f"expired.{d.side}")
            if cause is not None:
                self._fail(d.transfer_id, d.notify_engine_id, cause, d.reason)
            else:
                self._tell.closed(d.transfer_id)

    def _end(
        self,
        tid: str,
        engine: str,
        cause: Cause,
        detail: str,
        route: bytes | None = None,
    ) -> None:
        """A matched transfer will not complete: free our blocks, tell decode."""
        self._release(tid)
        self._fail(tid, engine, cause, detail, route)

    def _release(self, tid: str) -> None:
        """Prefill's blocks for ``tid`` may be freed (no WRITE reads them)."""
        self._fences.pop(tid, None)
        req_id = self._req_of.pop(tid, None)
        if req_id:
            self._finished(req_id)

    def _fail(
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
