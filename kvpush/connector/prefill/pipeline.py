"""The prefill writer's state machine: every transfer from its first half
(a Registration or the finished KV) to prefill's final word on it.

Owned by the writer thread (:mod:`kvpush.connector.prefill.writer`), which
feeds it events and runs :attr:`Pipeline.steps` on each tick; no locks, no
waits. A registration that waits for its KV is only the
:class:`~kvpush.transfer.matcher.Matcher`'s; from its first ready KV on, a
transfer is one :class:`~kvpush.connector.prefill.transfer.Transfer` in
the pipeline's one table, in exactly one
:class:`~kvpush.connector.prefill.transfer.Phase` (*waiting*, *matched*,
*in flight*, *ending*; drawn in :mod:`~kvpush.connector.prefill.transfer`).
Only this class changes the table or a record's phase.

Each tick: admit fault-delayed KV; post what is due (:meth:`Pipeline._post_due`:
a record with something known and not yet posted, once decode's boot said
Hello, its KV's device fence completed and any fault-injected delay
passed, all before the registration's post deadline, which is checked
right before the post); poll the WRITEs in flight
(:class:`~kvpush.connector.prefill.writes.Writes`); judge deadlines and
silent decodes. A transfer that must end (cancelled, preempted, expired, a
WRITE failed, decode lost) posts nothing more and is freed when its last
WRITE in flight ended (:meth:`Pipeline._close`).

KV digests (``verify_kv``): the Done WRITE of a selected transfer carries,
per decode rank, the digest of every byte the transfer writes to that
rank (:mod:`kvpush.transfer.digest`), hashed here, on the writer thread,
right before that WRITE is posted: every earlier WRITE of the transfer
has ended by then, and its source blocks hold their final KV (written by
completed forwards, pinned until the transfer ends). The hash releases
the GIL (vLLM's forward goes on) but holds this thread: about 1.5 s per
GiB on the dev machine, during which no other WRITE is posted or polled.

Every way out frees prefill's blocks (the request id goes to ``finished``,
in :meth:`Pipeline._release` only, never while a WRITE reads them: the
timing rule's prefill half, R1 of ``docs/design.md``) and, unless the
WRITE's own Done said it, tells decode with a :class:`Failure`, prefill's
final word: sent only once no WRITE of the transfer is in flight or can be
posted later. Failures about a registered transfer go back on the socket
its Registration came on (decode's scheduler, which forwards them to its
worker), so they reach decode even before its Hello; answers to a Cancel
or a Reconcile (decode reconnected: :mod:`~kvpush.connector.prefill.reconcile`)
go on its socket (:class:`~kvpush.connector.prefill.tell.Teller`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvpush.connector.counters import Counters
from kvpush.connector.faults import FaultSource
from kvpush.connector.kv_bytes import KvBytes
from kvpush.connector.nixl_io import NixlIO
from kvpush.connector.prefill import reconcile
from kvpush.connector.prefill.decode_peers import DecodePeers, hello_slice
from kvpush.connector.prefill.fence import LayerFences, ReadyFence
from kvpush.connector.prefill.tell import Teller
from kvpush.connector.prefill.transfer import (
    Orphans,
    Phase,
    Transfer,
    next_change,
    polls_device,
    sweep,
)
from kvpush.connector.prefill.writes import InFlight, Outcome, Writes
from kvpush.connector.trace import Tracer
from kvpush.transfer import groups
from kvpush.transfer.digest import VERIFY_OFF, VerifyPolicy, digest, source_ranges
from kvpush.transfer.layout import REQUIRED_KV_CACHE_LAYOUT, KvLayout
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
    SampleLogprobs,
)
from kvpush.transfer.ranks import TpPair
from kvpush.transfer.shares import HeadSlice

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.1  # longest sleep of the writer thread
WRITE_TIMEOUT_S = 30.0  # a WRITE in flight longer than this is counted late
POLL_S = 0.0005  # poll period while a device fence is pending
MAX_IDLE = 4096  # ids registered with this rank that it writes nothing of


@dataclass(frozen=True)
class WriterConfig:
    """What one prefill worker's writer needs to know (frozen)."""

    engine_id: str
    matcher: MatcherConfig
    boot_id: str = "0"  # this start of the prefill (sent in HelloReply)
    peer_timeout_s: float = 10.0  # a decode silent this long is dropped
    write_timeout_s: float = WRITE_TIMEOUT_S
    tp_size: int = 1  # this prefill instance's --tensor-parallel-size
    rank: int = 0  # this worker's TP rank (its side channel: base port + rank)
    total_kv_heads: int = 0  # the model's, over every rank (0: not known)
    verify: VerifyPolicy = VERIFY_OFF  # which transfers' Done carry a digest

    def __post_init__(self) -> None:
        if self.peer_timeout_s <= 0 or self.write_timeout_s <= 0:
            raise ValueError("peer_timeout_s and write_timeout_s must be > 0")


@dataclass(frozen=True)
class Ready:
    """The worker's trigger: ``req_id``'s KV for ``ready`` (a whole prompt,
    or one chunk of it) is computed (once ``fence`` says so)."""

    ready: ReadyKv
    req_id: str
    fence: ReadyFence


class Pipeline:
    """The table of transfers (one :class:`Transfer` per transfer id from
    its first ready KV on), the halves waiting in the matcher, the WRITEs
    in flight (NIXL's handles) and the known decodes."""

    def __init__(
        self,
        io: NixlIO,
        config: WriterConfig,
        reply: Callable[[bytes, Message], None],
        finished: Callable[[str], None],
        tracer: Tracer,
        counters: Counters,
        faults: FaultSource,
        memory: KvBytes | None = None,
    ) -> None:
        self._io, self._engine_id, self._boot_id = io, config.engine_id, config.boot_id
        self._verify, self._memory = config.verify, memory
        self._block_size = config.matcher.block_size
        self._reply, self._finished = reply, finished
        self._tracer, self._counters, self._faults = tracer, counters, faults
        self._matcher = Matcher(config.matcher)
        self._peers = DecodePeers(config.peer_timeout_s)
        self._tp_size, self._rank = config.tp_size, config.rank
        self._total_kv_heads = config.total_kv_heads
        self._transfers: dict[str, Transfer] = {}  # the one table
        self._orphans = Orphans()  # ended before their last chunk came
        self._idle: OrderedDict[str, None] = OrderedDict()  # nothing to write
        self._writes = Writes(
            io, config.engine_id, tracer, counters, config.write_timeout_s, config.rank
        )
        self._later: list[tuple[float, int, Ready]] = []  # fault-delayed KV
        self._seq = itertools.count()
        self._tell = Teller(config.engine_id, reply, counters, config.rank)

    def transfer(self, tid: str) -> Transfer | None:
        """The record of ``tid`` (None: no ready KV of it is held), to read."""
        return self._transfers.get(tid)

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
            self._reconcile(route, message, now)
        elif not isinstance(message, Heartbeat):
            self._counters.add("rejected.unexpected")
            logger.warning("kvpush writer: unexpected %s", type(message).__name__)

    def on_prefill_cancel(self, tid: str, now: float) -> None:
        """Prefill gave the request up (aborted before its KV was ready)."""
        self._counters.add("cancelled.by_prefill")
        self._orphans.forget(tid)
        self._stop(tid, Cause.CANCELLED, "prefill cancelled the request", now)

    def on_first_token(
        self, tid: str, token_id: int, logprobs: SampleLogprobs | None
    ) -> None:
        """Prefill sampled ``token_id`` after ``tid``'s prompt (early
        binding; ``logprobs`` where asked): its decode may continue from it."""
        self._tell.first_token(tid, token_id, logprobs)

    def on_preempt(self, tids: Iterable[str], now: float) -> None:
        """vLLM preempted these transfers' prefill requests: anything not
        yet posted is closed and never posted; a WRITE in flight is let
        finish. Its source stays intact (the scheduler pins the blocks until
        the request id goes to ``finished``, once no WRITE reads them)."""
        for tid in tids:
            self._orphans.forget(tid)
            if not self._writes.has(tid):
                self._counters.add("preempted.before_write")
            self._stop(tid, Cause.PREEMPTED, "prefill's request was preempted", now)

    def on_layer_saved(
        self, fences: LayerFences, layer: int, fence: ReadyFence
    ) -> None:
        """One layer of a forward pushed per layer wrote its KV (once
        ``fence`` says so); this tick's sweep posts what became ready."""
        fences.saved(layer, fence)

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
        transfers = self._transfers.values()
        if polls_device(transfers):
            return POLL_S
        due = [self._matcher.next_deadline(), self._writes.next_due(now)]
        due += [self._later[0][0]] if self._later else []
        due.append(next_change(transfers, now))
        soonest = min((d for d in due if d is not None), default=now + IDLE_WAIT_S)
        return min(IDLE_WAIT_S, max(0.0, soonest - now))

    def drain(self, now: float) -> int:
        """Shutdown, after the writer thread stopped (nothing is posted any
        more): poll the WRITEs in flight; how many NIXL still holds. A
        running WRITE is awaited, never cancelled (see
        :mod:`~kvpush.connector.prefill.writes`)."""
        self._writes.poll(now)
        return len(self._writes)

    # -- the halves: waiting -------------------------------------------------------

    def _admit_due(self, now: float) -> None:
        while self._later and self._later[0][0] <= now:
            self._admit(heapq.heappop(self._later)[2], now)

    def _admit(self, item: Ready, now: float) -> None:
        tid, req_id = item.ready.transfer_id, item.req_id
        transfer = self._transfers.get(tid)
        if transfer is not None and transfer.req_id == req_id:
            self._next_chunk(transfer, item, now)
            return
        if self._orphans.take(item.ready, req_id):
            return  # its transfer already ended; nothing more is sent
        if tid in self._idle:  # registered; this rank writes none of it
            del self._idle[tid]
            self._finished(req_id)
            if not item.ready.final:
                self._orphans.add(tid, req_id)
            return
        if transfer is not None:  # another request's KV holds this id
            self._counters.add("rejected.duplicate")
            logger.warning("kvpush: second KV for transfer %s refused", tid)
            self._finished(req_id)
            return
        result = self._matcher.add_ready(item.ready, now)
        if isinstance(result, Rejected):
            self._counters.add(f"rejected.{result.code}")
            logger.warning("kvpush: KV of %s refused: %s", tid, result.reason)
            self._finished(req_id)  # the matcher took nothing of ours
            if not item.ready.final:
                self._orphans.add(tid, req_id)
            self._drop_all(result.dropped, Cause.REJECTED)
            engine = item.ready.decode_engine_id  # None: late, nobody named
            if engine and result.code in ("invalid", "mismatch", "capacity"):
                self._fail(tid, engine, Cause.REJECTED, result.reason)
            return
        self._transfers[tid] = Transfer(req_id, item.ready, item.fence)
        if isinstance(result, Matched):
            self._matched(result, now)

    def _next_chunk(self, transfer: Transfer, item: Ready, now: float) -> None:
        """A later chunk of a transfer this writer holds. While it waits
        for its registration, every chunk (the final one too) restarts its
        ready deadline in the matcher: finished KV waits ``ready_ttl_s``
        from its last chunk, however long the chunked prefill took."""
        problem = transfer.add(item.ready, item.fence)
        if problem is None:
            if transfer.phase is Phase.WAITING:
                self._matcher.refresh_ready(transfer.transfer_id, now)
            return
        tid = transfer.transfer_id
        self._counters.add("rejected.invalid")
        logger.warning("kvpush: chunk of %s refused: %s", tid, problem)
        self._stop(tid, Cause.REJECTED, problem, now)

    def _registration(self, route: bytes, reg: Registration, now: float) -> None:
        tid, engine = reg.transfer_id, reg.decode_engine_id
        pair = self._pair(reg.decode_tp)
        tp_problem = pair.problem(REQUIRED_KV_CACHE_LAYOUT)
        problem = tp_problem or self._peers.range_problem(reg)
        if problem is None and not pair.targets_of(self._rank):
            self._idle_registration(tid, now)
            return
        if problem is not None:  # refused; the transfer is closed
            kind = "incompatible" if tp_problem else "out_of_range"
            self._counters.add(f"rejected.{kind}")
            self._drop_all(self._matcher.cancel(tid, problem, now), None)
            self._fail(tid, engine, Cause.REJECTED, problem, route)
            return
        result = self._matcher.add_registration(reg, now)
        if isinstance(result, Rejected):
            self._counters.add(f"rejected.{result.code}")
            logger.warning("kvpush: registration %s refused: %s", tid, result.reason)
            if result.code == "duplicate":
                return  # the transfer carries on; its owner must not hear of it
            if result.code == "claimed":  # it carries on for another decode
                self._tell.refuse(tid, Cause.REJECTED, result.reason, route)
                return
            self._drop_all(result.dropped, Cause.REJECTED)
            self._fail(tid, engine, Cause.REJECTED, result.reason, route)
            return
        self._tell.registered(tid, route)
        ranks = pair.target_ranks(self._rank)
        if not self._peers.knows(engine, reg.decode_boot_id, ranks):
            ask = HelloRequest(self._engine_id, reg.decode_boot_id, tid)
            self._reply(route, ask)
        if isinstance(result, Matched):
            self._matched(result, now)

    def _pair(self, decode_tp: int) -> TpPair:
        """This prefill's TP size and a decode's (the model's heads, ours)."""
        return TpPair(self._tp_size, decode_tp, self._total_kv_heads)

    def _idle_registration(self, tid: str, now: float) -> None:
        """A registration this rank writes nothing of (its heads are a
        replicated copy the mapping does not read): decode waits for no
        word from it; its KV, in now or later, is freed at once."""
        self._counters.add("idle_rank")
        dropped = self._matcher.cancel(tid, "this rank writes nothing", now)
        self._drop_all(dropped, None)  # frees a ready KV already in
        if not any(d.ready is not None for d in dropped):
            self._idle[tid] = None
            while len(self._idle) > MAX_IDLE:
                self._idle.popitem(last=False)

    # -- matched: posting ------------------------------------------------------

    def _matched(self, m: Matched, now: float) -> None:
        transfer = self._transfers.get(m.transfer_id)
        if transfer is None:  # unreachable: the ready half made the record
            raise RuntimeError(f"matched {m.transfer_id} has no record")
        targets = self._pair(m.registration.decode_tp).targets_of(self._rank)
        num_layers = self._io.layout.num_layers
        not_before = now + self._faults.post_delay_s()
        transfer.match(m, self._block_size, num_layers, targets, not_before)

    def _post_due(self, now: float) -> None:
        """Post what is due (not before the fault file's post delay from
        the match, for every WRITE: a chunk due only after the match is
        held back as well); close what missed its post deadline."""
        due = sweep(self._transfers.values(), now, self._peers.knows)
        for transfer, late in due.overdue:
            if late.event is not None:
                self._counters.add(late.event)
            self._close(transfer, late.cause, late.why)
        for transfer in due.postable:
            self._post(transfer, now)

    def _post(self, transfer: Transfer, now: float) -> None:
        m, engine = transfer.matched, transfer.engine
        write = transfer.next_write()
        if m is None or write is None:  # unreachable: it was due and ready
            return
        peers = [
            (peer, s)
            for s in transfer.targets
            if (peer := self._peers.get(engine, s.dst_rank)) is not None
        ]
        problem = self._peers.range_problem(m.registration)
        targets = transfer.targets
        if problem is not None or not targets or len(peers) < len(targets):
            self._counters.add("rejected.out_of_range")
            self._close(transfer, Cause.REJECTED, problem or "no peer")
            return
        num_posted, total, problem = 0, len(groups.real(m.dst_block_ids)), None
        try:
            for peer, head_slice in peers:
                digest = self._digest(transfer, write.notify, peer.layout, head_slice)
                accepted = self._writes.post(
                    write.items, peer, head_slice, engine, now, total, digest
                )
                num_posted += 1  # refused or not: in flight until released
                if not accepted:
                    problem = f"NIXL refused the WRITE to {peer.agent_name}"
                    break
        except Exception as e:  # no handle: nothing of this one in flight
            problem = str(e)
        if num_posted:
            transfer.posted(write, num_posted)
        if problem is not None:  # ends once its WRITEs in flight ended
            self._close(transfer, Cause.WRITE_FAILED, problem)

    def _digest(
        self, transfer: Transfer, notify: bool, dst: KvLayout, head_slice: HeadSlice
    ) -> bytes | None:
        """The KV digest the Done to ``head_slice``'s decode rank carries
        (None: not a Done WRITE, or a transfer the policy does not select)."""
        if not notify or self._memory is None:
            return None
        if not self._verify.selects(transfer.transfer_id):
            return None
        src, dst_ids = transfer.whole()
        ranges = source_ranges(src, dst_ids, self._io.layout, dst, head_slice)
        return digest(ranges, self._memory.read)

    # -- in flight -------------------------------------------------------------

    def _poll(self, now: float) -> None:
        for flight, outcome in self._writes.poll(now):
            self._write_ended(flight, outcome)

    def _write_ended(self, flight: InFlight, outcome: Outcome) -> None:
        tid, engine = flight.transfer_id, flight.engine_id
        transfer = self._transfers.get(tid)
        if transfer is None:  # unreachable: freed only with no WRITE
            logger.error("kvpush: a WRITE of %s ended with no record", tid)
            return
        transfer.item_ended()
        if outcome is Outcome.DONE and flight.notify:  # its Done reached its rank
            transfer.done_ranks.add(flight.dst_rank)
            if transfer.is_written:  # every target's Done: the final word
                self._tracer.mark(tid, "write_done")
                self._release(tid)
                self._tell.done(tid, engine, flight.num_blocks)
                return
            if transfer.closing is None:
                return  # other targets' Done WRITEs are in flight
        if outcome is not Outcome.DONE:
            transfer.write_failed()
        if transfer.closing is not None and transfer.in_flight == 0:
            self._tracer.mark(tid, "write_ended")
            self._finish(transfer)

    # -- deadlines and peers -------------------------------------------------

    def _expire(self, now: float) -> None:
        self._drop_all(self._matcher.expire(now), Cause.EXPIRED)
        engines = self._matcher.engines_with_registrations()
        engines |= {t.engine for t in self._transfers.values() if t.waits_on_decode}
        for engine in self._peers.silent(engines, now):
            self._forget(engine, f"no message for {self._peers.timeout_s:.0f} s", now)

    def _hello(self, route: bytes, hello: Hello, now: float) -> None:
        known = self._peers.get(hello.engine_id)
        if known is not None and known.boot_id != hello.boot_id:
            self._forget(hello.engine_id, "decode restarted", now, hello.boot_id)
        problem, head_slice = hello_slice(
            hello, self._tp_size, self._rank, self._total_kv_heads
        )
        if head_slice is not None:
            problem = self._peers.accept(
                hello, route, self._io.layout, self._io.load_peer, head_slice
            )
        reply = HelloReply(
            engine_id=self._engine_id,
            accepted=problem is None,
            boot_id=self._boot_id,
            reason=problem or "",
            rank=self._rank,
        )
        self._reply(route, reply)
        if problem is not None:
            self._counters.add("rejected.incompatible")
            logger.warning(
                "kvpush: refused decode %s rank %d: %s",
                hello.engine_id,
                hello.rank,
                problem,
            )

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
        for transfer in [
            t
            for t in self._transfers.values()
            if t.matched is not None and t.engine == engine and t.boot != new_boot
        ]:
            self._close(transfer, tell, why)
        self._peers.forget(engine, dead=new_boot is None)

    def _reconcile(self, route: bytes, message: Reconcile, now: float) -> None:
        """Decode ``message.engine_id`` reconnected and waits on these ids
        (:mod:`~kvpush.connector.prefill.reconcile`)."""
        engine = message.engine_id
        logger.info(
            "kvpush: decode %s (boot %s) reconnected; it waits on %d transfers",
            engine,
            message.boot_id,
            len(message.transfer_ids),
        )
        for tid in message.transfer_ids:
            holds = self._matcher.is_pending(tid) or tid in self._transfers
            owner = self._matcher.registered_by(tid)
            answer = reconcile.answer(engine, owner, holds)
            if answer is reconcile.Answer.OTHER_DECODE:
                self._counters.add("reconciled.ended")
                why = "another decode registered for this transfer"
                self._tell.refuse(tid, Cause.REJECTED, why, route)
            elif answer is reconcile.Answer.LIVE:
                self._counters.add("reconciled.live")
                self._tell.reconciled(tid, route)  # its Failure goes here too
            else:
                self._counters.add("reconciled.ended")
                # Not pending, so this only closes the id (drops nothing).
                self._matcher.cancel(tid, "reconciled with decode", now)
                self._tell.again(tid, engine, route)

    # -- endings ---------------------------------------------------------------

    def _stop(self, tid: str, cause: Cause, why: str, now: float) -> None:
        """Close ``tid`` wherever it is; WRITEs in flight run to their end
        (see :mod:`kvpush.connector.prefill.writes`)."""
        transfer = self._transfers.get(tid)
        if transfer is not None and transfer.matched is not None:
            self._close(transfer, cause, why)
        else:
            self._drop_all(self._matcher.cancel(tid, why, now), cause)

    def _decode_cancel(self, route: bytes, cancel: Cancel, now: float) -> None:
        """Decode gave the transfer up: stop it wherever it is, and answer
        with a Failure once no WRITE of it can land any more (or with the
        Done of its last WRITE, if that one is already in flight)."""
        tid = cancel.transfer_id
        self._counters.add("cancelled.by_decode")
        why = f"cancelled by decode: {cancel.reason}"
        owner = self._matcher.registered_by(tid)
        if owner is not None and owner != cancel.engine_id:
            # another decode registered for it: this one has nothing to cancel
            self._tell.refuse(tid, Cause.CANCELLED, why, route)
            return
        transfer = self._transfers.get(tid)
        if transfer is not None and transfer.matched is not None:
            self._close(transfer, Cause.CANCELLED, why, route)
            return
        self._drop_all(self._matcher.cancel(tid, cancel.reason, now), None)
        self._fail(tid, cancel.engine_id, Cause.CANCELLED, why, route)

    def _close(
        self,
        transfer: Transfer,
        cause: Cause | None,
        why: str,
        route: bytes | None = None,
    ) -> None:
        """A matched transfer will not complete: ENDING, nothing more of it
        is posted; once no WRITE of it is in flight, free our blocks and
        tell decode (``cause`` None: nobody is left to tell), on ``route``
        too (a Cancel's: each decode rank that cancelled is answered)."""
        if route is not None:
            self._tell.asked(transfer.transfer_id, route)
        transfer.close(cause, why)
        if transfer.in_flight == 0:
            self._finish(transfer)

    def _finish(self, transfer: Transfer) -> None:
        """A closed transfer's last WRITE ended (or it had none): its word
        goes to every route the :class:`Teller` keeps for it."""
        closing, tid = transfer.closing, transfer.transfer_id
        self._release(tid)
        if closing is None or closing.cause is None:
            self._tell.closed(tid)
        else:
            self._fail(tid, transfer.engine, closing.cause, closing.why)

    def _drop_all(self, dropped: Iterable[Dropped], cause: Cause | None) -> None:
        """Free what the matcher let go and, unless ``cause`` is None (the
        caller answers decode itself, or nobody is left to tell), tell decode.
        An expired ready KV tells decode too: its registration was lost, and
        decode should not wait out its own deadline. A late-bound ready KV
        that no decode claimed has nobody to tell."""
        for d in dropped:
            if d.ready is not None:
                self._release(d.transfer_id)
            if cause is Cause.EXPIRED:
                self._counters.add(f"expired.{d.side}")
            if cause is not None and d.notify_engine_id:
                self._fail(d.transfer_id, d.notify_engine_id, cause, d.reason)
            else:
                self._tell.closed(d.transfer_id)

    def _release(self, tid: str) -> None:
        """Prefill's blocks for ``tid`` may be freed: the one place that
        says so (its record leaves the table), and only when no WRITE of
        ``tid`` reads them."""
        if self._writes.has(tid):  # unreachable: callers wait for the WRITEs
            logger.error("kvpush: kept the blocks of %s: a WRITE reads them", tid)
            return
        transfer = self._transfers.pop(tid, None)
        if transfer is not None:
            if not transfer.final:  # a later chunk of it is an orphan's
                self._orphans.add(tid, transfer.req_id)
            self._finished(transfer.req_id)

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
