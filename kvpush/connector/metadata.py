"""What the scheduler side tells the worker side, once per engine step.

Built by :class:`~kvpush.connector.scheduler.KvPushScheduler` in
``build_connector_meta`` (EngineCore process) and read by
:class:`~kvpush.connector.worker.KvPushWorker` (Worker process); vLLM
carries it between the two processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class PushTrigger:
    """Prefill: this step computes the last prompt token of ``req_id``; once
    its forward is done, the KV in ``src_block_ids`` is ready to push."""

    req_id: str
    transfer_id: str
    src_block_ids: tuple[int, ...]
    num_tokens: int
    decode_engine_id: str


@dataclass(frozen=True)
class RecvExpect:
    """Decode: ``req_id`` waits for transfer ``transfer_id`` into
    ``dst_block_ids``, pushed by the prefill at ``prefill_host:port``."""

    req_id: str
    transfer_id: str
    dst_block_ids: tuple[int, ...]
    prefill_engine_id: str
    prefill_host: str
    prefill_port: int


@dataclass
class KvPushMetadata(KVConnectorMetadata):
    """One step's instructions for the worker side."""

    triggers: list[PushTrigger] = field(default_factory=list)
    expects: list[RecvExpect] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # prefill: transfer ids given up
    # decode: transfers whose request vLLM finished while the KV was on the way
    recv_cancels: list[str] = field(default_factory=list)
