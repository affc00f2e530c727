"""What the scheduler side tells the worker side, once per engine step.

Built by the role's scheduler (:mod:`kvpush.connector.prefill.scheduler`,
:mod:`kvpush.connector.decode.scheduler`; EngineCore process) in
``build_connector_meta`` and read by the role's worker (Worker process);
vLLM carries it between the two processes. One thing goes the other way:
:class:`PushesOver` (prefill worker to scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvpush.transfer.groups import GroupBlocks
from kvpush.transfer.messages import Failure, SampleLogprobs


@dataclass(frozen=True)
class PushTrigger:
    """Prefill: once this step's forward is done, prompt blocks
    ``first_block..`` of ``req_id`` (in ``src_block_ids``, one list per
    KV-cache group) are ready to push.
    A whole push is one trigger, ``final``, from block 0, in the step that
    computes the last prompt token. Streamed, each step that completes
    blocks triggers those (the first trigger also carries the blocks
    prefill's own prefix cache held); the step with the last token is
    ``final``. Every trigger is handed to the writer only with a fence of
    this step's forward (see :class:`~kvpush.connector.prefill.worker.PrefillWorker`).
    ``decode_engine_id`` (early binding) or ``claim_sha256`` (late: no
    decode named yet), from the request's leg."""

    req_id: str
    transfer_id: str
    src_block_ids: GroupBlocks
    num_tokens: int
    decode_engine_id: str | None
    first_block: int = 0
    final: bool = True
    claim_sha256: str | None = None


@dataclass(frozen=True)
class PreemptedPush:
    """Prefill: vLLM preempted ``req_id`` after its push was triggered; the
    writer closes the transfer (a WRITE in flight runs to its end: the
    scheduler's pins keep its source blocks allocated until then)."""

    req_id: str
    transfer_id: str


@dataclass(frozen=True)
class RecvExpect:
    """Decode: ``req_id`` waits for transfer ``transfer_id`` into
    ``dst_block_ids`` (one list per KV-cache group), pushed by the prefill
    at ``prefill_host:port`` (its
    rank 0's side channel) running with TP ``prefill_tp``: every decode
    worker rank takes the same expect and waits on the prefill ranks it
    receives from (:meth:`~kvpush.transfer.ranks.TpPair.sources_of`)."""

    req_id: str
    transfer_id: str
    dst_block_ids: GroupBlocks
    prefill_engine_id: str
    prefill_host: str
    prefill_port: int
    prefill_tp: int = 1


@dataclass
class PrefillMetadata(KVConnectorMetadata):
    """One step's instructions for a prefill worker."""

    triggers: list[PushTrigger] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # transfer ids given up
    preempted: list[PreemptedPush] = field(default_factory=list)
    # early binding: transfer id -> the token prefill sampled after the
    # prompt and its logprobs (where asked), for rank 0's writer to tell the
    # transfer's decode
    first_tokens: dict[str, tuple[int, SampleLogprobs | None]] = field(
        default_factory=dict
    )


@dataclass
class PushesOver(KVConnectorWorkerMetadata):
    """Prefill, the other way (worker to scheduler, once per step, in
    ``kv_connector_worker_meta``): the requests whose push is over on these
    TP ranks: no WRITE of theirs reads their source blocks any more, nor
    ever will (chunks of an ended transfer that still come are dropped).
    vLLM merges one step's metas of every rank with :meth:`aggregate`; the
    scheduler collects the ranks across steps and lets go of a request's
    pinned blocks once every rank said so."""

    over: dict[str, frozenset[int]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> PushesOver:
        merged = dict(self.over)
        if isinstance(other, PushesOver):
            for rid, ranks in other.over.items():
                merged[rid] = merged.get(rid, frozenset()) | ranks
        return PushesOver(merged)


@dataclass
class DecodeMetadata(KVConnectorMetadata):
    """One step's instructions for a decode worker."""

    expects: list[RecvExpect] = field(default_factory=list)
    # transfers whose request vLLM finished while the KV was on the way
    recv_cancels: list[str] = field(default_factory=list)
    # prefill's final words that came back on the scheduler's sockets (answers
    # to Registrations, from any prefill rank: each names its rank), and the
    # scheduler's own (a Registration not sent to that rank)
    failures: list[Failure] = field(default_factory=list)
    # side channels whose prefill asked for a Hello (it does not know us)
    hello_requests: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class BothMetadata(KVConnectorMetadata):
    """One step's instructions for both sides of a ``kv_both`` instance."""

    prefill: PrefillMetadata = field(default_factory=PrefillMetadata)
    decode: DecodeMetadata = field(default_factory=DecodeMetadata)
