"""Worker side of KvPushConnector (runs in vLLM's Worker process; every
method is called by vLLM on the worker's main thread).

Both roles register the KV cache with NIXL (``register_kv_caches``).
Prefill also binds the side-channel listener and starts the writer thread,
and hands each finished prompt's KV to the writer right after the forward
that computed it (``wait_for_save``). Decode says hello to each prefill it
meets, reads NIXL notifications and prefill's failure messages, and reports
each receive finished (``get_finished``); blocks of a failed or overdue
receive are reported as load errors so that vLLM does not use them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.fence import record_fence
from kvpush.connector.metadata import KvPushMetadata, RecvExpect
from kvpush.connector.nixl_io import NixlIO, memory_type
from kvpush.connector.side_channel import Listener, Peers
from kvpush.connector.trace import Tracer
from kvpush.connector.writer import Writer
from kvpush.transfer.layout import KvLayout
from kvpush.transfer.matcher import MatcherConfig, ReadyKv
from kvpush.transfer.messages import (
    Done,
    Failure,
    Hello,
    HelloReply,
    ProtocolError,
    decode,
)

logger = logging.getLogger(__name__)

EARLY_DONE_TTL_S = 10.0  # how long a Done waits for the receive it completes


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


@dataclass
class _Expected:
    expect: RecvExpect
    deadline: float


class KvPushWorker:
    """Owns the worker-side state of one instance."""

    def __init__(self, config: ConnectorConfig) -> None:
        self.config = config
        self._tracer = Tracer(config.trace_dir, config.engine_id)
        self._io: NixlIO | None = None
        self._device_type = "cpu"
        self._listener: Listener | None = None
        self._writer: Writer | None = None
        self._peers = Peers()  # decode: sockets to prefills (main thread)
        self._hello: Hello | None = None
        self._expected: dict[str, _Expected] = {}  # transfer id -> receive
        self._early_done: dict[str, float] = {}  # Done before its RecvExpect: expiry
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
                agent_name=self._io.name,
                nixl_metadata=self._io.metadata,
                layout=layout,
            )
            return
        matcher = MatcherConfig(
            block_size=self.config.block_size, ready_ttl_s=self.config.ready_ttl_s
        )
        self._writer = Writer(self._io, self.config.engine_id, matcher,
                              self._reply, self._tracer)  # fmt: skip
        self._listener = Listener(
            self.config.side_channel_host,
            self.config.side_channel_port,
            self._writer.on_message,
        )

    def _reply(self, route: bytes, message: Any) -> None:
        if self._listener is not None:
            self._listener.reply(route, message)

    def bind(self, meta: KvPushMetadata) -> None:
        """Take this step's instructions (before the forward)."""
        self._meta = meta
        now = time.monotonic()
        for expect in meta.expects:
            self._expect(expect, now)

    def _expect(self, expect: RecvExpect, now: float) -> None:
        is_new_peer = not self._peers.is_known(expect.prefill_host, expect.prefill_port)
        if is_new_peer and self._hello is not None:
            self._peers.send(expect.prefill_host, expect.prefill_port, self._hello)
        deadline = now + self.config.registration_ttl_s + 5.0
        self._expected[expect.transfer_id] = _Expected(expect, deadline)

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
        for tid in [t for t, expiry in self._early_done.items() if now > expiry]:
            del self._early_done[tid]  # its receive failed or never came
        done: set[str] = set(self._early_done)
        for payload in self._io.notifications():
            try:
                msg = decode(payload)
            except ProtocolError as e:
                logger.warning("kvpush: dropped a notification: %s", e.reason)
                continue
            if isinstance(msg, Done):
                self._tracer.mark(msg.transfer_id, "notif_received")
                done.add(msg.transfer_id)
        finished = self._finish(done, failed=False)
        finished |= self._finish(self._failures_and_overdue(), failed=True)
        return finished

    def _failures_and_overdue(self) -> set[str]:
        failed = set()
        for msg in self._peers.receive():
            if isinstance(msg, Failure):
                failed.add(msg.transfer_id)
            elif isinstance(msg, HelloReply) and not msg.accepted:
                logger.error(
                    "kvpush: prefill %s refused us: %s", msg.engine_id, msg.reason
                )
                failed |= {
                    tid
                    for tid, e in self._expected.items()
                    if e.expect.prefill_engine_id == msg.engine_id
                }
        now = time.monotonic()
        failed |= {tid for tid, e in self._expected.items() if now > e.deadline}
        return failed

    def _finish(self, transfer_ids: set[str], failed: bool) -> set[str]:
        finished = set()
        for tid in transfer_ids:
            entry = self._expected.pop(tid, None)
            if entry is None:
                if not failed and tid not in self._early_done:
                    # Its RecvExpect normally comes with the next step.
                    self._early_done[tid] = time.monotonic() + EARLY_DONE_TTL_S
                continue
            self._early_done.pop(tid, None)
            finished.add(entry.expect.req_id)
            if failed:
                logger.warning("kvpush: transfer %s failed; blocks marked invalid", tid)
                self._load_errors.update(entry.expect.dst_block_ids)
        return finished

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
