"""Prefill's scheduler side (vLLM's EngineCore process, its main thread;
every method is called by vLLM's scheduler).

A request whose leg is a :class:`PrefillLeg` is followed chunk by chunk.
With ``push_granularity`` ``request``, in the step that computes its last
prompt token the worker gets one :class:`PushTrigger` and pushes once that
step's forward is done. Streamed (``chunk``), every step that completes
prompt blocks triggers those blocks: ``build_connector_meta`` runs before
vLLM advances ``num_computed_tokens``, so after this step's forward the
first ``computed + scheduled`` tokens hold KV, and the blocks they fill
are complete (the last block when the whole prompt is). Blocks prefill's
own prefix cache held at admission go with the request's first trigger,
after this step's forward: vLLM caches a block when it allocates it, before
the forward that writes it, so a hit may be a block another request's
forward in this very step is still filling ("written by a completed
forward", ``docs/architecture.md``).
When the request finishes, vLLM keeps its blocks (``request_finished``
returns True) until the worker reports the push over (done, failed or
expired); one aborted between two chunks is also cancelled.

Preemption: vLLM frees a preempted request's blocks at once and may hand
them to another request in the same step. A preemption after the trigger
is passed to the worker (:class:`PreemptedPush`), whose
``handle_preemptions`` runs before the forward that could overwrite the
blocks and returns only once no WRITE reads them; the transfer is closed
(decode falls back to computing the prompt itself). vLLM recomputes the
preempted request (``requires_kv_delivery``); that recompute does not push
again: its transfer id is closed, and a second push under one id is exactly
what the duplicate rule refuses. Its blocks are then vLLM's to free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.counters import Counters
from kvpush.connector.legs import Legs
from kvpush.connector.metadata import PreemptedPush, PrefillMetadata, PushTrigger
from kvpush.connector.trace import Tracer
from kvpush.transfer.messages import PrefillLeg


@dataclass
class _Prefill:
    """A prefill request followed until it finishes."""

    request: Any
    leg: PrefillLeg
    block_ids: list[int] = field(default_factory=list)
    triggered: bool = False  # a first chunk went to the worker
    num_sent: int = 0  # prompt blocks handed to the worker
    final_sent: bool = False  # the last chunk went to the worker
    preempted: bool = False  # after the trigger: its push was closed


class PrefillScheduler:
    """Owns prefill's scheduler-side state; single-threaded."""

    def __init__(self, config: ConnectorConfig) -> None:
        self.config = config
        self.tracer = Tracer(config.trace_dir, config.engine_id)
        self.counters = Counters()
        self._legs = Legs(self.counters)
        self._prefills: dict[str, _Prefill] = {}
        self._held: set[str] = set()  # requests whose blocks vLLM keeps for us
        self._meta = PrefillMetadata()
        self._streamed = config.streams

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Prefill loads nothing from outside."""
        self._legs.of(request)
        return 0, False

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        """Start following a prefill request's blocks."""
        leg = self._legs.of(request)
        if isinstance(leg, PrefillLeg) and request.request_id not in self._prefills:
            self._prefills[request.request_id] = _Prefill(request, leg)

    def build_connector_meta(self, scheduler_output: Any) -> PrefillMetadata:
        """This step's instructions for the worker; resets the accumulator."""
        self._note_preemptions(scheduler_output.preempted_req_ids or ())
        self._track_blocks(scheduler_output)
        self._find_last_chunks(scheduler_output.num_scheduled_tokens)
        meta, self._meta = self._meta, PrefillMetadata()
        return meta

    def _note_preemptions(self, preempted: Any) -> None:
        for rid in preempted:
            state = self._prefills.get(rid)
            if state is None or not state.triggered or state.preempted:
                continue  # not triggered yet: it pushes from its new blocks
            state.preempted = True
            self.counters.add("preempted.after_trigger")
            self._meta.preempted.append(PreemptedPush(rid, state.leg.transfer_id))

    def _track_blocks(self, out: Any) -> None:
        for new in out.scheduled_new_reqs:
            state = self._prefills.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self._prefills.get(rid)
            new_ids = cached.new_block_ids[i]
            if state is None or new_ids is None:
                continue
            if rid in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0])
            else:
                state.block_ids.extend(new_ids[0])

    def _find_last_chunks(self, num_scheduled: dict[str, int]) -> None:
        """Trigger the blocks this step completes, of each prefill request
        it schedules (``num_computed_tokens`` is not advanced yet)."""
        for rid, state in self._prefills.items():
            if state.final_sent or state.preempted or rid not in num_scheduled:
                continue
            computed = state.request.num_computed_tokens
            prompt_len = state.request.num_prompt_tokens
            after = computed + num_scheduled[rid]
            if after >= prompt_len:
                self._trigger(state, math.ceil(prompt_len / self.config.block_size))
            elif self._streamed:
                self._trigger(state, after // self.config.block_size)

    def _trigger(self, state: _Prefill, end: int) -> None:
        """Hand prompt blocks ``num_sent..end-1`` to the worker (the last
        trigger: ``end`` is the prompt's block count)."""
        final = end == math.ceil(
            state.request.num_prompt_tokens / self.config.block_size
        )
        start = state.num_sent
        if end <= start:
            return
        state.triggered, state.num_sent, state.final_sent = True, end, final
        self._meta.triggers.append(
            PushTrigger(
                req_id=state.request.request_id,
                transfer_id=state.leg.transfer_id,
                src_block_ids=tuple(state.block_ids[start:end]),
                num_tokens=state.request.num_prompt_tokens,
                decode_engine_id=state.leg.decode_engine_id,
                first_block=start,
                final=final,
                claim_sha256=state.leg.claim_sha256,
            )
        )

    def request_finished(self, request: Any) -> tuple[bool, None]:
        """Keep a request's blocks while a WRITE out of them may still run."""
        rid = request.request_id
        leg = self._legs.of(request)  # parsed here if vLLM never scheduled it
        self._legs.forget(rid)
        state = self._prefills.pop(rid, None)
        if not isinstance(leg, PrefillLeg):
            return False, None
        if state is None or not state.triggered:  # aborted before its KV was ready
            name = "aborted.before_ready" if state else "aborted.before_allocation"
            self.counters.add(name)
            self._meta.cancels.append(leg.transfer_id)
            return False, None
        if state.preempted:  # its push was closed at the preemption
            return False, None
        if not state.final_sent:  # aborted between two chunks: stop the push
            self.counters.add("aborted.mid_stream")
            self._meta.cancels.append(leg.transfer_id)
        self._held.add(rid)
        return True, None

    def update_connector_output(
        self, finished_sending: set[str] | None, finished_recving: set[str] | None
    ) -> None:
        self._held.difference_update(finished_sending or ())

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while a push may still end (so that the
        worker's ``get_finished`` runs and releases the blocks)."""
        return bool(self._held) or any(
            s.triggered and not s.preempted for s in self._prefills.values()
        )

    def close(self) -> None:
        self.tracer.close()
