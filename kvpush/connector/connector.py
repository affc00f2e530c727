"""KvPushConnector: kvpush's push-mode KV transfer as a vLLM connector.

Load it by the name kvpush's vLLM plugin registers (:mod:`kvpush.vllm_plugin`)::

    --kv-transfer-config '{"kv_connector": "KvPushConnector",
        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
        "engine_id": "prefill0",
        "kv_connector_extra_config": {"side_channel_host": "127.0.0.1",
                                      "side_channel_port": 5600}}'

vLLM builds one instance per process: with role SCHEDULER in EngineCore and
with role WORKER in each Worker. This class only adapts vLLM's interface to
kvpush's role objects, made once here by (kvpush role, vLLM role):

* prefill (``kv_producer``):
  :class:`~kvpush.connector.prefill.scheduler.PrefillScheduler` (EngineCore)
  and :class:`~kvpush.connector.prefill.worker.PrefillWorker` (Worker);
* decode (``kv_consumer``):
  :class:`~kvpush.connector.decode.scheduler.DecodeScheduler` (EngineCore)
  and :class:`~kvpush.connector.decode.worker.DecodeWorker` (Worker);
* both (``kv_both``, what vLLM's NixlConnector deployments configure on
  every instance): a prefill's and a decode's, side by side. Each request
  goes to one side by its leg (:func:`~kvpush.connector.legs.is_decode_leg`:
  decode legs to the decode side, everything else to the prefill side, as
  a prefill-only instance serves it); the step's metadata carries both
  sides' (:class:`~kvpush.connector.metadata.BothMetadata`); each worker
  side runs its own NIXL agent over the same KV cache, and each keeps its
  own state, threads and counters, exactly as on a one-role instance.

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
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvpush.connector.config import (
    PER_LAYER_GRANULARITIES,
    ConnectorConfig,
    granularity_of,
)
from kvpush.connector.decode.scheduler import DecodeScheduler
from kvpush.connector.decode.worker import DecodeWorker
from kvpush.connector.legs import is_decode_leg
from kvpush.connector.metadata import (
    BothMetadata,
    DecodeMetadata,
    PrefillMetadata,
    PushesOver,
)
from kvpush.connector.prefill.scheduler import PrefillScheduler
from kvpush.connector.prefill.worker import PrefillWorker
from kvpush.connector.stats import KvPushPromMetrics, KvPushStats, take_stats
from kvpush.connector.support import (
    REQUIRED_KV_CACHE_LAYOUT,
    check_model,
    check_supported,
)
from kvpush.transfer.messages import FirstToken, SampleLogprobs

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput

logger = logging.getLogger(__name__)

Scheduler = PrefillScheduler | DecodeScheduler
Worker = PrefillWorker | DecodeWorker


class KvPushConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's connector interface over kvpush's role objects.

    It supports vLLM's hybrid KV-cache manager (``SupportsHMA``): vLLM keeps
    it on for kvpush, and a model with sliding-window layers beside full
    ones gets a block table per KV-cache group, each copied as decode keeps
    it (:mod:`kvpush.transfer.groups`)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        check_supported(vllm_config, kv_cache_config)
        worker = role != KVConnectorRole.SCHEDULER
        config = ConnectorConfig.from_vllm(
            vllm_config, kv_cache_config, _tp_rank() if worker else 0
        )
        # this process's role objects (None: a side it does not run)
        self._prefill: PrefillScheduler | None = None
        self._decode: DecodeScheduler | None = None
        self._prefill_worker: PrefillWorker | None = None
        self._decode_worker: DecodeWorker | None = None
        if not worker:
            _log_cudagraph_needs(config)
        for side in config.sides:
            if side.role == "prefill" and worker:
                self._prefill_worker = PrefillWorker(side)
            elif side.role == "prefill":
                self._prefill = PrefillScheduler(side)
            elif worker:
                self._decode_worker = DecodeWorker(side)
            else:
                self._decode = DecodeScheduler(side)

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
        a backend that cannot provide it is refused at start-up. vLLM asks
        while the workers set up attention, before it groups the KV-cache
        layers, so this is also where a model vLLM would stop on before any
        connector exists is refused with kvpush's reason
        (:func:`~kvpush.connector.support.check_model`)."""
        check_model(vllm_config)
        return REQUIRED_KV_CACHE_LAYOUT

    # -- scheduler side (EngineCore) ---------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._side_of(request).get_num_new_matched_tokens(
            request, num_computed_tokens
        )

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        self._side_of(request).update_state_after_alloc(
            request, blocks, num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        prefill = self._prefill
        decode = self._decode
        if prefill is not None and decode is not None:
            return BothMetadata(
                prefill.build_connector_meta(scheduler_output),
                decode.build_connector_meta(scheduler_output),
            )
        return self._side_of(None).build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Each side takes its own requests (prefill's in ``finished_sending``
        and the worker meta, decode's in ``finished_recving``)."""
        sending = connector_output.finished_sending
        recving = connector_output.finished_recving
        if self._prefill is not None:
            meta = connector_output.kv_connector_worker_meta
            self._prefill.update_connector_output(sending, recving, meta)
        if self._decode is not None:
            self._decode.update_connector_output(sending, recving)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._side_of(request).request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's finish hook with the hybrid manager (every group's table);
        kvpush reads the tables at its triggers, so it answers alike."""
        return self._side_of(request).request_finished(request)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """A push writes the request's own blocks of every group vLLM
        transfers, so none of them may be zeroed while it lands."""
        return tuple(self._kv_cache_config.transfer_group_ids)

    def first_token(self, request: Any) -> FirstToken | None:
        """The token prefill sampled after ``request``'s prompt (with its
        logprobs where asked), for kvpush's vLLM scheduler class
        (:mod:`kvpush.connector.decode.first_token`); None unless this
        instance decodes that request and the token came."""
        decode = self._decoding(request)
        return None if decode is None else decode.first_token(request)

    def wants_first_logprobs(self, request: Any) -> bool:
        """Whether :meth:`keep_first_logprobs` keeps ``request``'s (a leg
        this instance prefills), so the scheduler class builds them only
        then."""
        return self._prefill is not None and self._side_of(request) is self._prefill

    def keep_first_logprobs(self, request: Any, logprobs: SampleLogprobs) -> None:
        """From kvpush's scheduler class: the logprobs of the first token
        this instance sampled for ``request``, which a prefill leg bound
        early tells its decode with the token."""
        if self._prefill is not None and self.wants_first_logprobs(request):
            self._prefill.keep_first_logprobs(request, logprobs)

    def awaits_first_token(self, request: Any) -> bool:
        """Whether prefill will tell ``request``'s first token and it has not
        come yet (an early-bound leg this instance decodes)."""
        decode = self._decoding(request)
        return decode is not None and decode.awaits_first_token(request)

    def requires_first_token(self, request: Any) -> bool:
        """Whether ``request`` loaded a state (Mamba) it may only continue
        from with prefill's first token: vLLM must never compute its last
        prompt token again (see :meth:`DecodeScheduler.requires_first_token`)."""
        decode = self._decoding(request)
        return decode is not None and decode.requires_first_token(request)

    def _decoding(self, request: Any) -> DecodeScheduler | None:
        """This instance's decode side if it serves ``request``, else None."""
        if self._decode is None or self._side_of(request) is not self._decode:
            return None
        return self._decode

    def first_token_outcome(self, reason: Any) -> None:
        """What the scheduler class did with a first token :meth:`first_token`
        gave (``reason`` None: continued from it), for the counters."""
        if self._decode is not None:
            self._decode.first_token_outcome(reason)

    def has_pending_push_work(self) -> bool:
        return any(s.has_pending_push_work() for s in self._schedulers())

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM's block pool: prefill pins the blocks a push may read there
        (see :mod:`kvpush.connector.prefill.scheduler`)."""
        if self._prefill is not None:
            self._prefill.bind_block_pool(gpu_block_pool)

    def has_pending_block_frees(self) -> bool:
        """Asked by vLLM before it preempts: prefill's pins that will come
        back soon (:meth:`PrefillScheduler.has_pending_block_frees`)."""
        return self._prefill is not None and self._prefill.has_pending_block_frees()

    def _side_of(self, request: Any) -> Scheduler:
        """The scheduler side that serves ``request`` (None: this instance's
        only side): on a ``kv_both`` instance, by its leg."""
        if self._prefill is not None and self._decode is not None:
            params = getattr(request, "kv_transfer_params", None)
            return self._decode if is_decode_leg(params) else self._prefill
        side = self._prefill or self._decode
        if side is None:
            raise RuntimeError("scheduler-side method called on a worker connector")
        return side

    def _schedulers(self) -> list[Scheduler]:
        return [s for s in (self._prefill, self._decode) if s is not None]

    # -- worker side (Worker) ------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        workers = self._workers()
        if not workers:
            raise RuntimeError("worker-side method called on a scheduler connector")
        for worker in workers:
            worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        prefill, decode = _split(connector_metadata)
        if self._prefill_worker is not None and prefill is not None:
            self._prefill_worker.bind(prefill)
        if self._decode_worker is not None and decode is not None:
            self._decode_worker.bind(decode)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward: close the pushes of preempted requests (it
        does not wait: their blocks a WRITE may read stay pinned)."""
        prefill, _ = _split(kv_connector_metadata)
        if self._prefill_worker is not None and prefill is not None:
            self._prefill_worker.handle_preemptions(prefill)

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
        if self._prefill_worker is not None:
            self._prefill_worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._prefill_worker is not None:
            self._prefill_worker.wait_for_save()

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        sending = recving = None
        if self._prefill_worker is not None:
            sending = self._prefill_worker.get_finished(finished_req_ids) or None
        if self._decode_worker is not None:
            recving = self._decode_worker.get_finished() or None
        return sending, recving

    def build_connector_worker_meta(self) -> PushesOver | None:
        """After ``get_finished``: prefill's pushes over on this rank, for
        the scheduler's pins."""
        if self._prefill_worker is not None:
            return self._prefill_worker.build_worker_meta()
        return None

    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        """:meth:`get_finished`'s sets, and the receives that failed where
        vLLM takes failures by request (several KV-cache groups)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = set()
        if self._decode_worker is not None:
            failed = self._decode_worker.take_failed()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._decode_worker is not None:
            return self._decode_worker.take_load_errors()
        return set()

    def shutdown(self) -> None:
        for worker in self._workers():
            worker.close()
        for sched in self._schedulers():
            sched.close()

    def _workers(self) -> list[Worker]:
        return [w for w in (self._prefill_worker, self._decode_worker) if w is not None]

    # -- metrics (vLLM /metrics) ---------------------------------------------

    def get_kv_connector_stats(self) -> KvPushStats | None:
        """What this process's sides counted and timed since the last call
        (None: nothing). vLLM calls it after every step on both sides: the
        worker's model runner and the scheduler's ``update_from_output``,
        which aggregates the two (see :mod:`kvpush.connector.stats`)."""
        total: KvPushStats | None = None
        for side in [*self._schedulers(), *self._workers()]:
            quarantined = None
            if isinstance(side, DecodeWorker):
                quarantined = side.take_quarantined()
            stats = take_stats(side.counters, side.tracer, quarantined)
            if stats is not None:
                total = stats if total is None else total.aggregate(stats)
        return total

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


def _split(
    meta: KVConnectorMetadata,
) -> tuple[PrefillMetadata | None, DecodeMetadata | None]:
    """The prefill side's and the decode side's parts of a step's metadata."""
    if isinstance(meta, BothMetadata):
        return meta.prefill, meta.decode
    if isinstance(meta, PrefillMetadata):
        return meta, None
    if isinstance(meta, DecodeMetadata):
        return None, meta
    return None, None


def _tp_rank() -> int:
    """This Worker's tensor-parallel rank (vLLM has set up its TP group
    before it builds the worker-side connector)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())
