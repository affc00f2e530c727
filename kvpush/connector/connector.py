"""KvPushConnector: kvpush's push-mode KV transfer as a vLLM connector.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvPushConnector",
        "kv_connector_module_path": "kvpush.connector.connector",
        "kv_role": "kv_producer" | "kv_consumer", "engine_id": "prefill0",
        "kv_connector_extra_config": {"side_channel_host": "127.0.0.1",
                                      "side_channel_port": 5600}}'

vLLM builds one instance per process: with role SCHEDULER in EngineCore
(which forwards to :class:`~kvpush.connector.scheduler.KvPushScheduler`) and
with role WORKER in each Worker (:class:`~kvpush.connector.worker.KvPushWorker`).
This class only adapts vLLM's interface to those two; see
``docs/architecture.md`` for one request followed through every message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.metadata import KvPushMetadata
from kvpush.connector.scheduler import KvPushScheduler
from kvpush.connector.worker import KvPushWorker

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput


class KvPushConnector(KVConnectorBase_V1):
    """vLLM's connector interface over kvpush's scheduler and worker sides."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        config = ConnectorConfig.from_vllm(vllm_config)
        self._sched: KvPushScheduler | None = None
        self._worker: KvPushWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = KvPushScheduler(config)
        else:
            self._worker = KvPushWorker(config)

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
        self._s.update_connector_output(
            connector_output.finished_sending, connector_output.finished_recving
        )

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s.request_finished(request)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_push_work()

    @property
    def _s(self) -> KvPushScheduler:
        if self._sched is None:
            raise RuntimeError("scheduler-side method called on a worker connector")
        return self._sched

    # -- worker side (Worker) ------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KvPushMetadata):
            self._w.bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing to load: KV is pushed into this instance's blocks."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request runs only once its KV has landed."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Whole-request push happens at :meth:`wait_for_save`."""

    def wait_for_save(self) -> None:
        self._w.wait_for_save()

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._w.get_finished(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()

    @property
    def _w(self) -> KvPushWorker:
        if self._worker is None:
            raise RuntimeError("worker-side method called on a scheduler connector")
        return self._worker
