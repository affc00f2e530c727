"""Prefill's worker side (vLLM's Worker process; every method is called by
vLLM on the worker's main thread).

``register_kv_caches`` registers the KV cache with NIXL, binds the
side-channel listener and starts the writer thread. Right after the
forward that computed a prompt's last token (``wait_for_save``) the KV is
handed to the writer, with a device fence; streamed, after every forward
that completed blocks (the first chunk also carries the blocks prefill's
own prefix cache held: they too count as written only after this step's
forward, which may be the one still filling them). A chunk pushed per
layer (``layer``, or ``auto`` for a large chunk:
:meth:`ConnectorConfig.pushes_per_layer`) is handed over before its
forward, with a :class:`LayerFences`, and each layer's
``save_kv_layer`` (right after that layer's attention wrote the KV) tells
the writer that layer may go, with a per-layer fence; ``wait_for_save``
then covers every layer with the forward's fence. ``save_kv_layer`` only
puts a small tuple on the writer's inbox, and does nothing at all in a
step that computes no chunk pushed per layer. ``handle_preemptions``
closes the pushes of preempted requests and returns at once: a WRITE in
flight runs to its end, its source kept allocated by the scheduler's pins
(:mod:`kvpush.connector.prefill.scheduler`). ``get_finished`` reports each
request whose push is over once vLLM has finished it too, so that vLLM
frees its blocks only then; ``build_worker_meta`` tells the scheduler every
request whose push is over on this rank (:class:`PushesOver`), finished or
not, so that it drops its pins.
"""

from __future__ import annotations

import logging

import torch

from kvpush.connector.agent import open_agent
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.counters import Counters
from kvpush.connector.faults import FaultSource
from kvpush.connector.kv_bytes import TensorBytes
from kvpush.connector.kv_memory import layer_indices, without_states
from kvpush.connector.metadata import PrefillMetadata, PushesOver, PushTrigger
from kvpush.connector.nixl_io import NixlIO
from kvpush.connector.prefill.fence import (
    ALL_LAYERS,
    LayerFences,
    ReadyFence,
    record_fence,
)
from kvpush.connector.prefill.pipeline import WriterConfig
from kvpush.connector.prefill.writer import Writer
from kvpush.connector.side_channel import Listener
from kvpush.connector.trace import Tracer
from kvpush.transfer import groups
from kvpush.transfer.matcher import MatcherConfig, ReadyKv
from kvpush.transfer.messages import Message

logger = logging.getLogger(__name__)


class PrefillWorker:
    """Owns prefill's worker-side state (main thread)."""

    def __init__(self, config: ConnectorConfig) -> None:
        self.config = config
        self.tracer = Tracer(config.trace_dir, config.engine_id)
        self.counters = Counters()
        self._io: NixlIO | None = None
        self._device_type = "cpu"
        self._listener: Listener | None = None
        self._writer: Writer | None = None
        self._triggered: set[str] = set()  # handed to the writer, not preempted
        self._finished_reqs: set[str] = set()  # of those, finished in vLLM
        self._pushed: set[str] = set()  # of those, push over; not yet reported
        self._over: set[str] = set()  # push over, for the next PushesOver
        self._meta = PrefillMetadata()
        self._layer_of: dict[str, int] = {}  # vLLM's layer name -> our layer
        self._layers: LayerFences | None = None  # this forward's, if per layer
        self._per_layer: list[PushTrigger] = []  # handed over with _layers

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._device_type = next(iter(kv_caches.values())).device.type
        self._io = open_agent(self.config, kv_caches)
        kv_caches = without_states(kv_caches, self.config.kv_groups)  # mapped
        self._layer_of = layer_indices(kv_caches)
        matcher = MatcherConfig(
            block_size=self.config.block_size, ready_ttl_s=self.config.ready_ttl_s
        )
        config = WriterConfig(
            engine_id=self.config.engine_id,
            matcher=matcher,
            boot_id=self.config.boot_id,
            peer_timeout_s=self.config.peer_timeout_s,
            tp_size=self.config.tp_size,
            rank=self.config.tp_rank,
            total_kv_heads=self.config.total_kv_heads,
            verify=self.config.verify,
        )
        self._writer = Writer(
            self._io,
            config,
            self._reply,
            self.tracer,
            self.counters,
            FaultSource(self.config.fault_file),
            TensorBytes(kv_caches, self._io.layout),
        )
        self._listener = Listener(
            self.config.side_channel_host,
            self.config.listen_port,  # one side channel per TP rank
            self._writer.on_message,
            self.counters,
            self.config.secret,
        )

    def _reply(self, route: bytes, message: Message) -> None:
        if self._listener is not None:
            self._listener.reply(route, message)

    def bind(self, meta: PrefillMetadata) -> None:
        """Take this step's instructions (before the forward). The chunks
        that go per layer are handed to the writer now, with the forward's
        :class:`LayerFences`: none of their layers counts as written until
        :meth:`save_kv_layer` (or :meth:`wait_for_save`) records that
        layer's fence. Nothing is handed over ready here: a block counts as
        written only after a forward of this step wrote it, prefix-cache
        hits included (vLLM caches a block at allocation, before the
        forward that fills it, and another request may hit it in the same
        step)."""
        self._meta = meta
        if self._writer is None:
            return
        if self.config.tp_rank == 0:  # one rank tells decode's scheduler
            for tid, (token_id, logprobs) in meta.first_tokens.items():
                self._writer.first_token(tid, token_id, logprobs)
        self._per_layer = [t for t in meta.triggers if self._goes_per_layer(t)]
        if self._per_layer and self._io is not None:
            self._layers = LayerFences(self._io.layout.num_layers)
            self._hand_over(self._per_layer, self._layers, mark_ready=False)

    def _goes_per_layer(self, trigger: PushTrigger) -> bool:
        layout = self._io.layout if self._io is not None else None
        if layout is None or not self.config.may_push_per_layer:
            return False
        layer_bytes = layout.block_bytes * layout.regions_per_layer
        num_blocks = groups.total(trigger.src_block_ids)
        return self.config.pushes_per_layer(num_blocks * layer_bytes)

    def save_kv_layer(self, layer_name: str) -> None:
        """Right after ``layer_name``'s attention wrote this forward's KV
        (vLLM's forward path, per layer): let that layer of the chunks
        pushed per layer go. Cheap by design: nothing unless this forward
        computes such a chunk, else one dict lookup and one inbox put."""
        layers = self._layers
        if layers is None:
            return
        layer = self._layer_of.get(layer_name)
        if layer is not None:
            fence = record_fence(self._device_type)
            self._writer.layer_saved(layers, layer, fence)  # type: ignore[union-attr]

    def handle_preemptions(self, meta: PrefillMetadata) -> None:
        """Before the forward of the step whose schedule preempted requests:
        close their pushes (nothing more of them is posted) and return at
        once. A WRITE in flight runs to its end: its source blocks stay
        allocated, pinned by the scheduler until this rank (and every
        other) reports the push over in :meth:`build_worker_meta`."""
        if not meta.preempted or self._writer is None:
            return
        rids = {p.req_id for p in meta.preempted}
        self._triggered -= rids  # vLLM frees these; never report them
        self._pushed -= rids
        self._finished_reqs -= rids
        self._writer.preempt({p.transfer_id for p in meta.preempted})

    def wait_for_save(self) -> None:
        """After the forward: push the KV this step's forward computed."""
        if self._writer is None:
            return
        computed = [t for t in self._meta.triggers if t not in self._per_layer]
        if computed or self._layers is not None:
            fence = record_fence(self._device_type)
            self._hand_over(computed, fence)
            if self._layers is not None:  # also any layer never saved
                self._writer.layer_saved(self._layers, ALL_LAYERS, fence)
                self._writer.kv_computed([self._ready_kv(t) for t in self._per_layer])
            self._layers, self._per_layer = None, []
        for tid in self._meta.cancels:
            self._writer.cancel(tid)
        self._meta = PrefillMetadata()

    def _hand_over(
        self, triggers: list[PushTrigger], fence: ReadyFence, mark_ready: bool = True
    ) -> None:
        for t in triggers:
            self._triggered.add(t.req_id)
            self._writer.kv_ready(  # type: ignore[union-attr]
                self._ready_kv(t), t.req_id, fence, mark_ready
            )

    @staticmethod
    def _ready_kv(t: PushTrigger) -> ReadyKv:
        return ReadyKv(
            transfer_id=t.transfer_id,
            src_block_ids=t.src_block_ids,
            num_tokens=t.num_tokens,
            decode_engine_id=t.decode_engine_id,
            first_block=t.first_block,
            final=t.final,
            claim_sha256=t.claim_sha256,
        )

    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        """Prefill requests whose blocks may be freed now."""
        if self._writer is None:
            return set()
        self._finished_reqs |= finished_req_ids & self._triggered
        ended = self._writer.take_finished()
        self._over |= ended
        self._pushed |= ended & self._triggered
        sending = self._pushed & self._finished_reqs
        self._pushed -= sending
        self._finished_reqs -= sending
        self._triggered -= sending
        return sending

    def build_worker_meta(self) -> PushesOver | None:
        """Right after :meth:`get_finished`: the requests whose push ended
        on this rank since the last call (preempted ones included), for
        the scheduler's pins; None if none."""
        if not self._over:
            return None
        rank = frozenset({self.config.tp_rank})
        over, self._over = self._over, set()
        return PushesOver({rid: rank for rid in over})

    def close(self) -> None:
        """The writer first: it stops posting and its WRITEs end. Only then
        the side channel, whose closing a loopback decode takes as proof
        that nothing more of this prefill lands in its blocks."""
        writer_done = self._writer.close() if self._writer is not None else True
        if self._listener is not None:
            self._listener.close()
        if self._io is not None:
            if writer_done:
                self._io.close()
            else:  # deregistering under a live WRITE could corrupt memory
                logger.error("kvpush: leaving KV memory registered at shutdown")
        self.tracer.close()
