"""KvPushConnector: kvpush's push-mode KV transfer as a vLLM connector.

Load it by the name kvpush's vLLM plugin registers (:mod:`kvpush.vllm_plugin`)::

    --kv-transfer-config '{"kv_connector": "KvPushConnector",
        "kv_role": "kv_producer" | "kv_consumer", "engine_id": "prefill0",
        "kv_connector_extra_config": {"side_channel_host": "127.0.0.1",
                                      "side_channel_port": 5600}}'

vLLM builds one instance per process: with role SCHEDULER in EngineCore and
with role WORKER in each Worker. This class only adapts vLLM's interface to
one of four role objects, chosen once here by (kvpush role, vLLM role):

* prefill: :class:`~kvpush.connector.prefill.scheduler.PrefillScheduler`
  (EngineCore) and :class:`~kvpush.connector.prefill.worker.PrefillWorker`
  (Worker);
* decode: :class:`~kvpush.connector.decode.scheduler.DecodeScheduler`
  (EngineCore) and :class:`~kvpush.connector.decode.worker.DecodeWorker`
  (Worker).

Unsupported set-ups (see :mod:`kvpush.connector.support`) are refused here,
at start-up, with an error naming the setting. ``docs/design.md``
follows one request through every message.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvpush.connector.config import (
    PER_LAYER_GRANULARITIES,
    ConnectorConfig,
    granularity_of,
)
from kvpush.connector.decode.scheduler import DecodeScheduler
from kvpush.connector.decode.worker import DecodeWorker
from kvpush.connector.metadata import DecodeMetadata, PrefillMetadata, PushesOver
from kvpush.connector.prefill.scheduler import PrefillScheduler
from kvpush.connector.prefill.worker import PrefillWorker
from kvpush.connector.stats import KvPushPromMetrics, KvPushStats, take_stats
from kvpush.connector.support import REQUIRED_KV_CACHE_LAYOUT, check_supported

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput

logger = logging.getLogger(__name__)

Scheduler = PrefillScheduler | DecodeScheduler
Worker = PrefillWorker | DecodeWorker


class KvPushConnector(KVConnectorBase_V1):
    """vLLM's connector interface over kvpush's role objects."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        check_supported(vllm_config, kv_cache_config)
        worker = role != KVConnectorRole.SCHEDULER
        config = ConnectorConfig.from_vllm(
            vllm_config, kv_cache_config, _tp_rank() if worker else 0
        )
        self._sched: Scheduler | None = None
        self._worker: Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            _log_cudagraph_needs(config)
            self._sched = (
                PrefillScheduler(config)
                if config.role == "prefill"
                else DecodeScheduler(config)
            )
        elif config.role == "prefill":
            self._worker = PrefillWorker(config)
        else:
            self._worker = DecodeWorker(config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True for ``push_granularity`` ``layer`` or ``auto``: prefill then
        pushes from ``save_kv_layer``, Python that a captured CUDA graph
        would skip, so vLLM must run FULL CUDA graphs as PIECEWISE (attention,
        and with it the per-layer hook, outside the graphs). A step that did
        replay a full graph would still push correctly, per chunk, from
        ``wait_for_save``; only the overlap would be lost."""
        return granularity_of(extra_config) in PER_LAYER_GRANULARITIES

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """Ask vLLM for the one layout kvpush maps (each block contiguous);
        a backend that cannot provide it is refused at start-up."""
        return REQUIRED_KV_CACHE_LAYOUT

    # -- scheduler side (EngineCore) ---------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._s.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        self._s.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._s.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        sched = self._s
        sending = connector_output.finished_sending
        recving = connector_output.finished_recving
        if isinstance(sched, PrefillScheduler):
            meta = connector_output.kv_connector_worker_meta
            sched.update_connector_output(sending, recving, meta)
        else:
            sched.update_connector_output(sending, recving)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s.request_finished(request)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_push_work()

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM's block pool: prefill pins the blocks a push may read there
        (see :mod:`kvpush.connector.prefill.scheduler`)."""
        if isinstance(self._sched, PrefillScheduler):
            self._sched.bind_block_pool(gpu_block_pool)

    def has_pending_block_frees(self) -> bool:
        """Asked by vLLM before it preempts: prefill's pins that will come
        back soon (:meth:`PrefillScheduler.has_pending_block_frees`)."""
        return (
            isinstance(self._sched, PrefillScheduler)
            and self._sched.has_pending_block_frees()
        )

    @property
    def _s(self) -> Scheduler:
        if self._sched is None:
            raise RuntimeError("scheduler-side method called on a worker connector")
        return self._sched

    # -- worker side (Worker) ------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        worker = self._w
        if isinstance(worker, PrefillWorker):
            if isinstance(connector_metadata, PrefillMetadata):
                worker.bind(connector_metadata)
        elif isinstance(connector_metadata, DecodeMetadata):
            worker.bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward: close the pushes of preempted requests (it
        does not wait: their blocks a WRITE may read stay pinned)."""
        worker = self._w
        if isinstance(worker, PrefillWorker) and isinstance(
            kv_connector_metadata, PrefillMetadata
        ):
            worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing to load: KV is pushed into this instance's blocks."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request runs only once its KV has landed."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Right after each layer's attention (vLLM's forward path): the
        chunks pushed per layer may send that layer (prefill); a push per
        chunk or request waits for :meth:`wait_for_save`."""
        worker = self._worker
        if isinstance(worker, PrefillWorker):
            worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        worker = self._w
        if isinstance(worker, PrefillWorker):
            worker.wait_for_save()

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        worker = self._w
        if isinstance(worker, PrefillWorker):
            return worker.get_finished(finished_req_ids) or None, None
        return None, worker.get_finished() or None

    def build_connector_worker_meta(self) -> PushesOver | None:
        """After ``get_finished``: prefill's pushes over on this rank, for
        the scheduler's pins."""
        worker = self._w
        if isinstance(worker, PrefillWorker):
            return worker.build_worker_meta()
        return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self._w
        if isinstance(worker, DecodeWorker):
            return worker.take_load_errors()
        return set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()

    @property
    def _w(self) -> Worker:
        if self._worker is None:
            raise RuntimeError("worker-side method called on a scheduler connector")
        return self._worker

    # -- metrics (vLLM /metrics) ---------------------------------------------

    def get_kv_connector_stats(self) -> KvPushStats | None:
        """What this side counted and timed since the last call (None:
        nothing). vLLM calls it after every step on both sides: the worker's
        model runner and the scheduler's ``update_from_output``, which
        aggregates the two (see :mod:`kvpush.connector.stats`)."""
        side = self._sched if self._sched is not None else self._worker
        if side is None:
            return None
        quarantined = None
        if isinstance(side, DecodeWorker):
            quarantined = side.take_quarantined()
        return take_stats(side.counters, side.tracer, quarantined)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KvPushStats:
        """vLLM's API server rebuilding the stats the engine sent."""
        return KvPushStats.from_payload(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvPushPromMetrics:
        """The ``vllm:kvpush_*`` families, made in vLLM's API server."""
        return KvPushPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )


def _log_cudagraph_needs(config: ConnectorConfig) -> None:
    """Say once per instance (its scheduler's connector) what per-layer
    push asks of vLLM's CUDA graphs (a warning: vLLM's logging shows no
    INFO of other packages, and this changes how vLLM runs)."""
    if config.may_push_per_layer:
        logger.warning(
            "kvpush: push_granularity %r may push per layer, from save_kv_layer "
            "after each layer's attention; that hook cannot run inside a captured "
            "CUDA graph, so requires_piecewise_for_cudagraph is True and vLLM runs "
            "FULL CUDA graphs as PIECEWISE on this instance (no effect without "
            "CUDA graphs, e.g. on CPU or with --enforce-eager)",
            config.push_granularity,
        )


def _tp_rank() -> int:
    """This Worker's tensor-parallel rank (vLLM has set up its TP group
    before it builds the worker-side connector)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())
