"""Worker side of KvPushConnector (runs in vLLM's Worker process; every
method is called by vLLM on the worker's main thread).

Both roles register the KV cache with NIXL (``register_kv_caches``).
Prefill also binds the side-channel listener and starts the writer thread,
and hands each finished prompt's KV to the writer right after the forward
that computed it (``wait_for_save``). Decode says hello to each prefill it
meets (again after a reconnect), watches those connections, sends
heartbeats while it waits, reads NIXL notifications and prefill's failure
messages, and reports each receive finished (``get_finished``) by the rule
of :mod:`kvpush.connector.receiver`; blocks of a failed receive are reported
as load errors so that vLLM does not use them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.counters import Counters
from kvpush.connector.faults import FaultSource
from kvpush.connector.fence import record_fence
from kvpush.connector.metadata import KvPushMetadata
from kvpush.connector.nixl_io import NixlIO, memory_type
from kvpush.connector.receiver import Receiver
from kvpush.connector.side_channel import Listener, Peers
from kvpush.connector.trace import Tracer
from kvpush.connector.writer import Writer
from kvpush.transfer.layout import KvLayout
from kvpush.transfer.matcher import MatcherConfig, ReadyKv
from kvpush.transfer.messages import (
    Cancel,
    Done,
    Failure,
    Heartbeat,
    Hello,
    HelloReply,
    ProtocolError,
    decode,
)

logger = logging.getLogger(__name__)


def layout_of(kv_caches: dict[str, torch.Tensor], block_size: int) -> KvLayout:
    """The memory map of vLLM's KV cache: one region per layer, block ``b``
    of a layer at ``data_ptr + b * stride(0) * element_size``."""
    tensors = list(kv_caches.values())
    first = tensors[0]
    block_bytes = first.stride(0) * first.element_size()
    for t in tensors:
        if (
            t.shape[0] != first.shape[0]
            or t.stride(0) * t.element_size() != block_bytes
        ):
            raise ValueError(
                "kvpush needs every layer's cache to have the same block shape"
            )
        if not t[0].is_contiguous():
            raise ValueError(
                "kvpush needs each block of a layer to be contiguous memory"
            )
    return KvLayout(
        num_blocks=first.shape[0],
        block_bytes=block_bytes,
        block_size=block_size,
        base_addrs=tuple(t.data_ptr() for t in tensors),
        device_id=first.device.index or 0,
        kv_dtype=str(first.dtype).removeprefix("torch."),
    )


class KvPushWorker:
    """Owns the worker-side state of one instance."""

    def __init__(self, config: ConnectorConfig) -> None:
        self.config = config
        self._tracer = Tracer(config.trace_dir, config.engine_id)
        self.counters = Counters(config.trace_dir, config.engine_id, config.role)
        self._io: NixlIO | None = None
        self._device_type = "cpu"
        self._listener: Listener | None = None
        self._writer: Writer | None = None
        # decode: sockets to prefills (main thread), watched for liveness
        self._peers = Peers(config.secret, monitor=True)
        self._hello: Hello | None = None
        self._greeted: set[tuple[str, int]] = set()  # Hello sent since (re)connect
        self._connected: set[tuple[str, int]] = set()
        self._receiver = Receiver(config.registration_ttl_s, self.counters)
        self._next_heartbeat = 0.0
        self._triggered: set[str] = set()  # prefill: handed to the writer
        self._finished_reqs: set[str] = set()  # prefill: of those, finished in vLLM
        self._pushed: set[str] = set()  # prefill: push over, not yet reported
        self._load_errors: set[int] = set()
        self._meta = KvPushMetadata()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        self._device_type = first.device.type
        layout = layout_of(kv_caches, self.config.block_size)
        self._io = NixlIO(
            self.config.agent_name, layout, memory_type(self._device_type)
        )
        if self.config.role == "decode":
            self._hello = Hello(
                engine_id=self.config.engine_id,
                boot_id=self.config.boot_id,
                agent_name=self._io.name,
                nixl_metadata=self._io.metadata,
                layout=layout,
            )
            return
        matcher = MatcherConfig(
            block_size=self.config.block_size, ready_ttl_s=self.config.ready_ttl_s
        )
        self._writer = Writer(
            self._io,
            self.config.engine_id,
            matcher,
            self._reply,
            self._tracer,
            self.counters,
            self.config.peer_timeout_s,
            FaultSource(self.config.fault_file),
        )
        self._listener = Listener(
            self.config.side_channel_host,
            self.config.side_channel_port,
            self._writer.on_message,
            self.counters,
            self.config.secret,
        )

    def _reply(self, route: bytes, message: Any) -> None:
        if self._listener is not None:
            self._listener.reply(route, message)

    def bind(self, meta: KvPushMetadata) -> None:
        """Take this step's instructions (before the forward)."""
        self._meta = meta
        now = time.monotonic()
        # Connection news, read here once per step: it predates these
        # expects (e.g. a prefill that died and came back while this engine
        # was idle) and must not fail them.
        self._watch_connections()
        for expect in meta.expects:
            self._receiver.expect(expect, now)
            self._greet((expect.prefill_host, expect.prefill_port))
        for tid in meta.recv_cancels:
            aborted = self._receiver.abort(tid)
            if aborted is not None:  # prefill answers with its final word
                cancel = Cancel(
                    transfer_id=tid,
                    engine_id=self.config.engine_id,
                    reason="request aborted while its KV was on the way",
                )
                self._peers.send(aborted.prefill_host, aborted.prefill_port, cancel)

    def _greet(self, address: tuple[str, int]) -> None:
        """Say Hello to a prefill once per connection."""
        if address not in self._greeted and self._hello is not None:
            self._peers.send(*address, self._hello)
            self._greeted.add(address)

    def wait_for_save(self) -> None:
        """After the forward: push the KV of every prompt finished this step."""
        if self._writer is None:
            return
        fence = record_fence(self._device_type) if self._meta.triggers else None
        for t in self._meta.triggers:
            ready = ReadyKv(
                transfer_id=t.transfer_id,
                src_block_ids=t.src_block_ids,
                num_tokens=t.num_tokens,
                decode_engine_id=t.decode_engine_id,
            )
            self._writer.kv_ready(ready, t.req_id, fence)  # type: ignore[arg-type]
            self._triggered.add(t.req_id)
        for tid in self._meta.cancels:
            self._writer.cancel(tid)
        self._meta = KvPushMetadata()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(prefill requests whose blocks may be freed, decode requests whose
        KV has arrived or has failed)."""
        if self._writer is not None:
            self._finished_reqs |= finished_req_ids & self._triggered
            self._pushed |= self._writer.take_finished()
            sending = self._pushed & self._finished_reqs
            self._pushed -= sending
            self._finished_reqs -= sending
            self._triggered -= sending
            return sending, set()
        return set(), self._received()

    def _received(self) -> set[str]:
        if self._io is None:
            return set()
        now = time.monotonic()
        for payload in self._io.notifications():
            try:
                msg = decode(payload)
            except ProtocolError as e:
                self.counters.add(f"rejected.{e.kind}")
                logger.warning("kvpush: dropped a notification: %s", e.reason)
                continue
            if isinstance(msg, Done):
                self._tracer.mark(msg.transfer_id, "notif_received")
                self._receiver.done(msg.transfer_id, now)
        self._read_replies()
        self._receiver.expire(now)
        self._heartbeat(now)
        results = self._receiver.take()
        self._load_errors |= results.load_errors
        self.counters.maybe_flush()
        return results.finished

    def _read_replies(self) -> None:
        for msg in self._peers.receive():
            if isinstance(msg, Failure):
                self._receiver.failed(msg.transfer_id, msg.cause)
            elif isinstance(msg, HelloReply) and not msg.accepted:
                logger.error(
                    "kvpush: prefill %s refused us: %s", msg.engine_id, msg.reason
                )
                self._receiver.peer_refused(msg.engine_id)

    def _watch_connections(self) -> None:
        """A prefill whose connection closed is gone (its kernel closed the
        socket): fail what we wait on from it; greet it again on reconnect."""
        for event in self._peers.connection_events():
            if event.up:
                self._connected.add(event.address)
                self._greet(event.address)
                continue
            if event.address in self._connected:
                logger.warning("kvpush: lost the prefill at %s:%d", *event.address)
                self.counters.add("peer_lost")
                self._connected.discard(event.address)
            self._greeted.discard(event.address)
            self._receiver.peer_lost(event.address)

    def _heartbeat(self, now: float) -> None:
        if now < self._next_heartbeat:
            return
        awaited = self._receiver.awaited()
        if not awaited:
            return
        self._next_heartbeat = now + self.config.heartbeat_s
        beat = Heartbeat(engine_id=self.config.engine_id, boot_id=self.config.boot_id)
        for address in awaited:
            self._peers.send(*address, beat)

    def reserved_blocks(self) -> int:
        """Decode: destination blocks still reserved for transfers."""
        return sum(len(h.block_ids) for h in self._receiver.holds())

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._writer is not None:
            self._writer.close()
        self._peers.close()
        if self._io is not None:
            self._io.close()
        self._tracer.close()
        self.counters.close()
