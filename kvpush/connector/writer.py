"""Prefill's background writer: pairs registrations with finished KV and
pushes the KV into decode's memory with NIXL WRITEs.

One named thread owns all of it (the matcher, the known decode peers, the
writes in flight); other threads only put events on its inbox: the listener
thread (Hello, Registration, Cancel from decodes) and the worker's main
thread (KV ready, request cancelled). The engine loop never waits on it.
Finished pushes (written, failed or expired: either way prefill's blocks may
be freed) come out through :meth:`Writer.take_finished`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpush.connector.fence import ReadyFence
from kvpush.connector.nixl_io import NixlIO
from kvpush.connector.trace import Tracer
from kvpush.transfer.coalesce import descriptors, runs
from kvpush.transfer.layout import KvLayout, compat_problem
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
    Done,
    Failure,
    FailureCause,
    Hello,
    HelloReply,
    Message,
    Registration,
    encode,
)
from kvpush.transfer.work import WorkItem, split_whole

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.1  # longest sleep when nothing is in flight
INFLIGHT_POLL_S = 0.0005  # poll period while a WRITE is in flight
FENCE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class _Peer:
    agent_name: str
    layout: KvLayout
    route: bytes  # the decode worker's side-channel socket, for replies


@dataclass(frozen=True)
class _Ready:
    ready: ReadyKv
    req_id: str
    fence: ReadyFence


@dataclass
class _InFlight:
    handle: Any
    req_id: str
    engine_id: str


class Writer:
    """Runs the push pipeline of one prefill worker in thread ``kvpush-writer``."""

    def __init__(
        self,
        io: NixlIO,
        engine_id: str,
        matcher_config: MatcherConfig,
        reply: Callable[[bytes, Message], None],
        tracer: Tracer,
    ) -> None:
        self._io, self._engine_id, self._reply, self._tracer = (
            io,
            engine_id,
            reply,
            tracer,
        )
        self._matcher = Matcher(matcher_config)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._finished: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._peers: dict[str, _Peer] = {}
        self._req_of: dict[str, str] = {}  # transfer id -> prefill request id
        self._fences: dict[str, ReadyFence] = {}
        self._waiting_for_peer: list[Matched] = []
        self._inflight: dict[str, _InFlight] = {}
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
                self._poll_inflight()
                self._expire(now)
            except Exception:  # the writer must outlive any single failure
                logger.exception("kvpush writer: unexpected error")

    def _wait_s(self) -> float:
        if self._inflight:
            return INFLIGHT_POLL_S
        deadline = self._matcher.next_deadline()
        if deadline is None:
            return IDLE_WAIT_S
        return min(IDLE_WAIT_S, max(0.0, deadline - time.monotonic()))

    def _handle(self, kind: str, item: Any, now: float) -> None:
        if kind == "ready":
            self._req_of[item.ready.transfer_id] = item.req_id
            self._fences[item.ready.transfer_id] = item.fence
            result = self._matcher.add_ready(item.ready, now)
            self._apply(result, item.req_id, item.ready.decode_engine_id, now)
        elif kind == "cancel":
            self._drop_all(self._matcher.cancel(item, "prefill cancelled", now))
        elif kind == "message":
            self._on_message(item[0], item[1], now)

    def _on_message(self, route: bytes, message: Message, now: float) -> None:
        if isinstance(message, Hello):
            self._hello(route, message, now)
        elif isinstance(message, Registration):
            result = self._matcher.add_registration(message, now)
            self._apply(result, None, message.decode_engine_id, now)
        elif isinstance(message, Cancel):
            self._drop_all(
                self._matcher.cancel(message.transfer_id, message.reason, now)
            )
        else:
            logger.warning("kvpush writer: unexpected %s", type(message).__name__)

    def _hello(self, route: bytes, hello: Hello, now: float) -> None:
        problem = compat_problem(self._io.layout, hello.layout)
        if problem is None:
            try:
                agent = self._io.load_peer(hello.nixl_metadata)
                self._peers[hello.engine_id] = _Peer(agent, hello.layout, route)
            except Exception as e:  # bad metadata is the peer's problem
                problem = f"cannot load NIXL metadata: {e}"
        reply = HelloReply(
            engine_id=self._engine_id, accepted=problem is None, reason=problem or ""
        )
        self._reply(route, reply)
        if problem is not None:
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
            logger.warning(
                "kvpush: transfer %s rejected: %s", result.transfer_id, result.reason
            )
            if result.code == "duplicate":
                return  # the transfer carries on
            self._drop_all(result.dropped)
            if req_id is not None:  # the matcher did not take our KV
                self._release(result.transfer_id)
            self._fail(result.transfer_id, engine, "rejected", result.reason)

    def _post(self, m: Matched, now: float) -> None:
        engine = m.registration.decode_engine_id
        peer = self._peers.get(engine)
        if peer is None:
            self._waiting_for_peer.append(m)
            return
        if now > m.post_deadline:
            self._end(m.transfer_id, engine, "expired", "matched after its deadline")
            return
        fence = self._fences.pop(m.transfer_id, None)
        if fence is not None and not fence.wait(FENCE_TIMEOUT_S):
            self._end(m.transfer_id, engine, "write_failed", "KV never became ready")
            return
        (item,) = split_whole(m.transfer_id, m.src_block_ids, m.dst_block_ids,
                              self._io.layout.num_layers)  # fmt: skip
        self._post_item(item, peer, engine)

    def _post_item(self, item: WorkItem, peer: _Peer, engine: str) -> None:
        """One WRITE for one work item (a block range x a layer range);
        the transfer's last item carries the Done notification."""
        done = Done(transfer_id=item.transfer_id, engine_id=self._engine_id,
                    num_blocks=item.num_blocks)  # fmt: skip
        notif = encode(done) if item.notify else b""
        try:  # a block outside either cache makes descriptors() raise
            block_runs = runs(item.src_block_ids, item.dst_block_ids)
            layouts = (self._io.layout, peer.layout)
            src, dst = descriptors(block_runs, *layouts, item.layers)
            handle = self._io.write(src, dst, peer.agent_name, notif)
        except Exception as e:
            self._end(item.transfer_id, engine, "write_failed", str(e))
            return
        req_id = self._req_of.get(item.transfer_id, "")
        self._inflight[item.transfer_id] = _InFlight(handle, req_id, engine)
        sizes = {"num_descs": len(src), "num_runs": len(block_runs)}
        self._tracer.mark(item.transfer_id, "write_posted", **sizes,
                          num_blocks=item.num_blocks)  # fmt: skip

    def _poll_inflight(self) -> None:
        for tid, flight in list(self._inflight.items()):
            state = self._io.poll(flight.handle)
            if state == "PROC":
                continue
            del self._inflight[tid]
            if state == "DONE":
                self._tracer.mark(tid, "write_done")
                self._release(tid)
            else:
                self._end(tid, flight.engine_id, "write_failed", f"NIXL state {state}")

    def _expire(self, now: float) -> None:
        self._drop_all(self._matcher.expire(now))
        for m in [m for m in self._waiting_for_peer if now > m.post_deadline]:
            self._waiting_for_peer.remove(m)
            self._end(m.transfer_id, m.registration.decode_engine_id, "expired",
                      "decode never said hello")  # fmt: skip

    def _drop_all(self, dropped: tuple[Dropped, ...] | list[Dropped]) -> None:
        for d in dropped:
            if d.ready is not None:
                self._release(d.transfer_id)
            if d.registration is not None:
                cause: FailureCause = "expired" if "expire" in d.reason else "cancelled"
                self._fail(
                    d.transfer_id, d.registration.decode_engine_id, cause, d.reason
                )

    def _end(self, tid: str, engine: str, cause: FailureCause, detail: str) -> None:
        """A matched transfer will not complete: free our blocks, tell decode."""
        self._release(tid)
        self._fail(tid, engine, cause, detail)

    def _release(self, tid: str) -> None:
        self._fences.pop(tid, None)
        req_id = self._req_of.pop(tid, None)
        if req_id:
            self._finished.put(req_id)

    def _fail(
        self, tid: str, engine: str | None, cause: FailureCause, detail: str
    ) -> None:
        logger.warning("kvpush: transfer %s failed (%s): %s", tid, cause, detail)
        peer = self._peers.get(engine) if engine else None
        if peer is not None:
            failure = Failure(transfer_id=tid, engine_id=self._engine_id, cause=cause,
                              detail=detail[:1000])  # fmt: skip
            self._reply(peer.route, failure)
