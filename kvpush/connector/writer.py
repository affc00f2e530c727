"""Prefill's background writer: pairs registrations with finished KV and
pushes the KV into decode's memory with NIXL WRITEs.

One named thread owns all of it (the matcher, the known decode peers, the
writes in flight); other threads only put events on its inbox: the listener
thread (Hello, Registration, Cancel from decodes) and the worker's main
thread (KV ready, request cancelled). The engine loop never waits on it.
Finished pushes (written, failed or expired: either way prefill's blocks may
be freed) come out through :meth:`Writer.take_finished`.

Faults it handles (each counted in :class:`~kvpush.connector.counters.Counters`):

* every pending entry has a deadline (the matcher's); a matched transfer is
  never posted after its registration's deadline;
* a Cancel from decode is always answered with a Failure once prefill is sure
  it will not write: at once, or when a WRITE already under way has ended;
* WRITEs go only to the decode boot that registered the blocks: a Hello with
  a new boot id (decode restarted) drops every transfer of the old one;
* a decode silent for ``peer_timeout_s`` while it has transfers here is dead:
  its transfers are dropped and our blocks freed;
* a registration whose blocks lie outside decode's cache is refused.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpush.connector.counters import Counters
from kvpush.connector.decode_peers import DecodePeer, DecodePeers
from kvpush.connector.faults import FaultSource, HeldBack
from kvpush.connector.fence import ReadyFence
from kvpush.connector.nixl_io import NixlIO
from kvpush.connector.trace import Tracer
from kvpush.connector.writes import Writes
from kvpush.transfer.layout import compat_problem
from kvpush.transfer.matcher import (
    AddResult,
    Dropped,
    Matched,
    Matcher,
    MatcherConfig,
    ReadyKv,
    Rejected,
)
from kvpush.transfer.messages import (
    Cancel,
    Failure,
    FailureCause,
    Heartbeat,
    Hello,
    HelloReply,
    Message,
    Registration,
)
from kvpush.transfer.work import WorkItem, split_whole

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.1  # longest sleep when nothing is in flight
INFLIGHT_POLL_S = 0.0005  # poll period while a WRITE is in flight
FENCE_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 30.0  # a WRITE in flight longer than this is cancelled


@dataclass(frozen=True)
class _Ready:
    ready: ReadyKv
    req_id: str
    fence: ReadyFence


class Writer:
    """Runs the push pipeline of one prefill worker in thread ``kvpush-writer``."""

    def __init__(
        self,
        io: NixlIO,
        engine_id: str,
        matcher_config: MatcherConfig,
        reply: Callable[[bytes, Message], None],
        tracer: Tracer,
        counters: Counters | None = None,
        peer_timeout_s: float = 10.0,
        faults: FaultSource | None = None,
        write_timeout_s: float = WRITE_TIMEOUT_S,
    ) -> None:
        self._io, self._engine_id, self._reply, self._tracer = (
            io,
            engine_id,
            reply,
            tracer,
        )
        self._counters = counters or Counters("", engine_id, "prefill")
        self._faults = faults or FaultSource("")
        self._held_back = HeldBack()  # fault injection only
        self._matcher = Matcher(matcher_config)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._finished: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._peers = DecodePeers(peer_timeout_s)
        self._req_of: dict[str, str] = {}  # transfer id -> prefill request id
        self._fences: dict[str, ReadyFence] = {}
        self._waiting_for_peer: list[Matched] = []
        self._writes = Writes(io, engine_id, tracer, write_timeout_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="kvpush-writer", daemon=True
        )
        self._thread.start()

    # -- any thread ------------------------------------------------------------

    def on_message(self, route: bytes, message: Message) -> None:
        """From the listener thread: a decode's Hello, Registration or Cancel."""
        if isinstance(message, Registration):
            self._tracer.mark(message.transfer_id, "reg_received")
        self._inbox.put(("message", (route, message)))

    def kv_ready(self, ready: ReadyKv, req_id: str, fence: ReadyFence) -> None:
        """From the worker's main thread, right after the forward that
        computed the prompt's last token."""
        self._tracer.mark(ready.transfer_id, "kv_ready")
        self._inbox.put(("ready", _Ready(ready, req_id, fence)))

    def cancel(self, transfer_id: str) -> None:
        """From the worker's main thread: prefill gave the request up."""
        self._inbox.put(("cancel", transfer_id))

    def take_finished(self) -> set[str]:
        """Request ids whose push ended since the last call (main thread)."""
        out = set()
        while True:
            try:
                out.add(self._finished.get_nowait())
            except queue.Empty:
                return out

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(("stop", None))
        self._thread.join(timeout_s)

    # -- writer thread -------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                kind, item = self._inbox.get(timeout=self._wait_s())
            except queue.Empty:
                kind, item = "tick", None
            now = time.monotonic()
            try:
                self._handle(kind, item, now)
                self._run_due(now)
                self._poll_inflight()
                self._expire(now)
                self._counters.maybe_flush()
            except Exception:  # the writer must outlive any single failure
                logger.exception("kvpush writer: unexpected error")

    def _wait_s(self) -> float:
        if self._writes:
            return INFLIGHT_POLL_S
        deadlines = [self._matcher.next_deadline(), self._held_back.next_due()]
        deadline = min((d for d in deadlines if d is not None), default=None)
        if deadline is None:
            return IDLE_WAIT_S
        return min(IDLE_WAIT_S, max(0.0, deadline - time.monotonic()))

    def _handle(self, kind: str, item: Any, now: float) -> None:
        if kind == "ready":
            self._req_of[item.ready.transfer_id] = item.req_id
            self._fences[item.ready.transfer_id] = item.fence
            delay = self._faults.current().delay_ready_s
            if delay > 0:
                self._held_back.add(now + delay, "ready", item)
            else:
                self._add_ready(item, now)
        elif kind == "cancel":
            self._counters.add("cancelled.by_prefill")
            self._drop_all(self._matcher.cancel(item, "prefill cancelled", now))
        elif kind == "message":
            self._on_message(item[0], item[1], now)

    def _add_ready(self, item: _Ready, now: float) -> None:
        result = self._matcher.add_ready(item.ready, now)
        self._apply(result, item.req_id, item.ready.decode_engine_id, now)

    def _run_due(self, now: float) -> None:
        for kind, item in self._held_back.take_due(now):
            if kind == "ready":
                self._add_ready(item, now)
            else:
                self._post(item, now, delayed=True)

    def _on_message(self, route: bytes, message: Message, now: float) -> None:
        if isinstance(message, Hello | Heartbeat | Cancel):
            self._peers.heard(message.engine_id, now)
        if isinstance(message, Hello):
            self._hello(route, message, now)
        elif isinstance(message, Heartbeat):
            pass
        elif isinstance(message, Registration):
            self._peers.heard(message.decode_engine_id, now)
            problem = self._peers.range_problem(message)
            if problem is not None:  # refused; the transfer is closed
                self._counters.add("rejected.out_of_range")
                tid = message.transfer_id
                self._drop_all(self._matcher.cancel(tid, problem, now), quiet=True)
                self._fail(tid, message.decode_engine_id, "rejected", problem)
                return
            result = self._matcher.add_registration(message, now)
            self._apply(result, None, message.decode_engine_id, now)
        elif isinstance(message, Cancel):
            self._cancel(route, message, now)
        else:
            self._counters.add("rejected.unexpected")
            logger.warning("kvpush writer: unexpected %s", type(message).__name__)

    def _cancel(self, route: bytes, cancel: Cancel, now: float) -> None:
        """Decode gave the transfer up: stop it wherever it is, and answer
        with a Failure once no WRITE of it can land any more."""
        tid = cancel.transfer_id
        self._counters.add("cancelled.by_decode")
        flight = self._writes.get(tid)
        if flight is not None:  # answered when the WRITE ends
            flight.cancel_route = route
            return
        held = [m for m in self._waiting_for_peer if m.transfer_id == tid]
        held += [
            m
            for _, m in self._held_back.take(
                lambda kind, m: kind == "post" and m.transfer_id == tid
            )
        ]
        if held:
            self._waiting_for_peer = [
                m for m in self._waiting_for_peer if m not in held
            ]
            self._release(tid)
        else:
            self._drop_all(self._matcher.cancel(tid, cancel.reason, now), quiet=True)
        self._send_failure(
            route, tid, "cancelled", f"cancelled by decode: {cancel.reason}"
        )

    def _hello(self, route: bytes, hello: Hello, now: float) -> None:
        known = self._peers.get(hello.engine_id)
        if known is not None and known.boot_id != hello.boot_id:
            self._forget(hello.engine_id, "decode restarted", now, hello.boot_id)
            known = None
        problem = compat_problem(self._io.layout, hello.layout)
        if problem is None and (known is None or known.metadata != hello.nixl_metadata):
            try:
                agent = self._io.load_peer(hello.agent_name, hello.nixl_metadata)
                peer = DecodePeer(
                    agent, hello.layout, route, hello.boot_id, hello.nixl_metadata
                )
                self._peers.add(hello.engine_id, peer)
            except Exception as e:  # bad metadata is the peer's problem
                problem = f"cannot load NIXL metadata: {e}"
        elif problem is None and known is not None:  # same decode, new socket
            self._peers.reroute(hello.engine_id, route)
        reply = HelloReply(
            engine_id=self._engine_id, accepted=problem is None, reason=problem or ""
        )
        self._reply(route, reply)
        if problem is not None:
            self._counters.add("rejected.incompatible")
            logger.warning("kvpush: refused decode %s: %s", hello.engine_id, problem)
            return
        waiting, self._waiting_for_peer = self._waiting_for_peer, []
        for matched in waiting:
            self._post(matched, now)

    def _apply(
        self, result: AddResult, req_id: str | None, engine: str, now: float
    ) -> None:
        """Act on what the matcher said about an entry for decode ``engine``."""
        if isinstance(result, Matched):
            self._post(result, now)
        elif isinstance(result, Rejected):
            self._counters.add(f"rejected.{result.code}")
            logger.warning(
                "kvpush: transfer %s rejected: %s", result.transfer_id, result.reason
            )
            if result.code == "duplicate":
                return  # the transfer carries on
            self._drop_all(result.dropped)
            if req_id is not None:  # the matcher did not take our KV
                self._release(result.transfer_id)
            if result.code != "closed" or req_id is None:
                # (KV arriving for a closed transfer: decode was told then)
                self._fail(result.transfer_id, engine, "rejected", result.reason)

    def _post(self, m: Matched, now: float, delayed: bool = False) -> None:
        engine, reg = m.registration.decode_engine_id, m.registration
        peer = self._peers.get(engine)
        if peer is None or peer.boot_id != reg.decode_boot_id:
            self._waiting_for_peer.append(m)  # until that decode boot says hello
            return
        if now > m.post_deadline:
            self._counters.add("expired.matched")
            self._end(m.transfer_id, engine, "expired", "matched after its deadline")
            return
        problem = self._peers.range_problem(m.registration)
        if problem is not None:
            self._counters.add("rejected.out_of_range")
            self._end(m.transfer_id, engine, "rejected", problem)
            return
        delay = self._faults.current().delay_post_s
        if delay > 0 and not delayed:
            self._held_back.add(now + delay, "post", m)
            return
        fence = self._fences.pop(m.transfer_id, None)
        if fence is not None and not fence.wait(FENCE_TIMEOUT_S):
            self._end(m.transfer_id, engine, "write_failed", "KV never became ready")
            return
        (item,) = split_whole(
            m.transfer_id, m.src_block_ids, m.dst_block_ids, self._io.layout.num_layers
        )
        self._post_item(item, peer, engine)

    def _post_item(self, item: WorkItem, peer: DecodePeer, engine: str) -> None:
        req_id = self._req_of.get(item.transfer_id, "")
        try:
            self._writes.post(item, peer, req_id, engine, time.monotonic())
        except Exception as e:
            self._end(item.transfer_id, engine, "write_failed", str(e))

    def _poll_inflight(self) -> None:
        for tid, flight, state in self._writes.poll():
            if state == "DONE":
                self._tracer.mark(tid, "write_done")
                self._release(tid)
                if flight.cancel_route is not None:
                    self._send_failure(
                        flight.cancel_route,
                        tid,
                        "cancelled",
                        "cancelled after the WRITE was posted; it completed",
                    )
            else:
                self._end(
                    tid,
                    flight.engine_id,
                    "write_failed",
                    f"NIXL state {state}",
                    flight.cancel_route,
                )

    def _expire(self, now: float) -> None:
        self._drop_all(self._matcher.expire(now))
        for tid, flight in self._writes.cancel_overdue(now):
            self._counters.add("expired.write")
            self._end(
                tid,
                flight.engine_id,
                "write_failed",
                "the WRITE did not end in time and was cancelled",
                flight.cancel_route,
            )
        for m in [m for m in self._waiting_for_peer if now > m.post_deadline]:
            self._waiting_for_peer.remove(m)
            self._counters.add("expired.no_hello")
            self._end(
                m.transfer_id,
                m.registration.decode_engine_id,
                "expired",
                "decode never said hello",
            )
        # Decodes with transfers here beat every second while they wait.
        engines = self._matcher.engines_with_registrations()
        engines |= {m.registration.decode_engine_id for m in self._waiting_for_peer}
        for engine in self._peers.silent(engines, now):
            why = f"no message for {self._peers.timeout_s:.0f} s"
            self._forget(engine, why, now)

    def _forget(
        self, engine: str, why: str, now: float, new_boot: str | None = None
    ) -> None:
        """Decode ``engine`` is dead (``new_boot`` None: drop all its
        transfers) or restarted as ``new_boot`` (drop those registered by
        other boots). Either way no WRITE goes to the old boot any more."""
        logger.warning("kvpush: dropping decode %s: %s", engine, why)
        self._counters.add("peer_lost")
        if new_boot is None:
            gone = set(self._matcher.ids_for_engine(engine))
        else:
            gone = {
                r.transfer_id
                for r in self._matcher.registrations_of(engine)
                if r.decode_boot_id != new_boot
            }
        for tid in gone:
            self._drop_all(self._matcher.cancel(tid, why, now), quiet=True)

        def stale(m: Matched) -> bool:
            reg = m.registration
            return reg.decode_engine_id == engine and reg.decode_boot_id != new_boot

        def gone_later(kind: str, item: Any) -> bool:
            if kind == "post":
                return stale(item)
            # KV held back by fault injection, for a decode that is dead
            return new_boot is None and item.ready.decode_engine_id == engine

        for m in [m for m in self._waiting_for_peer if stale(m)]:
            self._release(m.transfer_id)
        self._waiting_for_peer = [m for m in self._waiting_for_peer if not stale(m)]
        for kind, item in self._held_back.take(gone_later):
            self._release(
                item.transfer_id if kind == "post" else item.ready.transfer_id
            )
        self._peers.forget(engine, dead=new_boot is None)

    def _drop_all(
        self, dropped: tuple[Dropped, ...] | list[Dropped], quiet: bool = False
    ) -> None:
        """Free what the matcher let go; tell decode unless ``quiet`` (the
        caller answers decode itself, or decode is gone)."""
        for d in dropped:
            if d.ready is not None:
                self._release(d.transfer_id)
            expired = "expire" in d.reason
            if expired:
                self._counters.add(f"expired.{d.side}")
            if quiet or (d.registration is None and not expired):
                continue
            # An expired ready KV tells decode too: its registration was lost,
            # and decode should not wait out its own deadline.
            cause: FailureCause = "expired" if expired else "cancelled"
            self._fail(d.transfer_id, d.notify_engine_id, cause, d.reason)

    def _end(
        self,
        tid: str,
        engine: str,
        cause: FailureCause,
        detail: str,
        route: bytes | None = None,
    ) -> None:
        """A matched transfer will not complete: free our blocks, tell decode."""
        self._release(tid)
        self._fail(tid, engine, cause, detail, route)

    def _release(self, tid: str) -> None:
        self._fences.pop(tid, None)
        req_id = self._req_of.pop(tid, None)
        if req_id:
            self._finished.put(req_id)

    def _fail(
        self,
        tid: str,
        engine: str | None,
        cause: FailureCause,
        detail: str,
        route: bytes | None = None,
    ) -> None:
        """Tell decode (on ``route``, else its Hello's socket) that prefill will
        not write transfer ``tid``."""
        logger.warning("kvpush: transfer %s failed (%s): %s", tid, cause, detail)
        self._counters.add(f"failed.{cause}")
        peer = self._peers.get(engine) if engine else None
        route = route or (peer.route if peer is not None else None)
        if route is not None:
            self._send_failure(route, tid, cause, detail)

    def _send_failure(
        self, route: bytes, tid: str, cause: FailureCause, detail: str
    ) -> None:
        """Prefill's word to decode that it will not write ``tid``."""
        failure = Failure(
            transfer_id=tid,
            engine_id=self._engine_id,
            cause=cause,
            detail=detail[:1000],
        )
        self._reply(route, failure)
