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
forward", rule R2 of ``docs/design.md``).
When the request finishes, vLLM keeps its blocks (``request_finished``
returns True) until the worker reports the push over (done, failed or
expired); one aborted between two chunks is also cancelled. A leg in vLLM's
P/D protocol (:mod:`kvpush.connector.vllm_params`: late-bound, by a claim)
answers there, once its whole prompt's KV is held, the params its decode
leg needs, the claim included; vLLM puts them in the response.

Pins: every block handed to the worker in a trigger gets a reference of
our own in vLLM's block pool (``touch``, at the trigger; the pool comes
from ``bind_gpu_block_pool``), dropped (``free_blocks``, once) when every
TP rank's writer said the request's push is over (:class:`PushesOver` in
``kv_connector_worker_meta``, or ``finished_sending``, which vLLM reports
only once every rank did). While pinned, a block is out of vLLM's free
queue whoever else lets go of it: no forward can be handed it while a
WRITE may read it.

Preemption: vLLM frees a preempted request's blocks at once, in
``schedule()``, and may hand them to another request in the same step; the
pins keep the triggered ones (those a WRITE may read) allocated. A
preemption after the trigger is passed to the worker
(:class:`PreemptedPush`), whose ``handle_preemptions`` only closes the
transfer (decode falls back to computing the prompt itself) and returns at
once; a WRITE in flight runs to its end, and the pins go when it has.
vLLM recomputes the preempted request (``requires_kv_delivery``); that
recompute does not push again: its transfer id is closed, and a second push
under one id is exactly what the duplicate rule refuses. Its new blocks are
vLLM's alone. ``has_pending_block_frees`` asks vLLM to wait for pins that
will come back instead of preempting (see there).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.counters import Counters
from kvpush.connector.legs import Legs
from kvpush.connector.metadata import (
    PreemptedPush,
    PrefillMetadata,
    PushesOver,
    PushTrigger,
)
from kvpush.connector.prefill.pipeline import WRITE_TIMEOUT_S
from kvpush.connector.trace import Tracer
from kvpush.connector.vllm_params import VllmPrefill
from kvpush.side_channel_auth import is_wildcard
from kvpush.transfer import groups
from kvpush.transfer.groups import Groups
from kvpush.transfer.messages import PrefillLeg, SampleLogprobs

logger = logging.getLogger(__name__)

# How long after its request let go of them (finished or preempted) pinned
# blocks count as coming back soon, so that vLLM waits for them rather
# than preempting: the WRITE timeout, past which a WRITE is late anyway.
PENDING_FREE_S = WRITE_TIMEOUT_S


@dataclass
class _Prefill:
    """A prefill request followed until it finishes."""

    request: Any
    leg: PrefillLeg
    triggered: bool = False  # a first chunk went to the worker
    num_sent: int = 0  # prompt blocks handed to the worker
    final_sent: bool = False  # the last chunk went to the worker
    preempted: bool = False  # after the trigger: its push was closed
    push_over: bool = False  # every rank's push ended: later chunks unpinned


@dataclass
class _Pin:
    """Our references on one request's triggered blocks."""

    block_ids: list[int] = field(default_factory=list)
    ranks_over: set[int] = field(default_factory=set)  # pushes over on these
    gone_at: float | None = None  # when vLLM finished or preempted the request


class PrefillScheduler:
    """Owns prefill's scheduler-side state; single-threaded."""

    def __init__(
        self, config: ConnectorConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        self.tracer = Tracer(config.trace_dir, config.engine_id)
        self.counters = Counters()
        self._legs = Legs(self.counters)
        self._prefills: dict[str, _Prefill] = {}
        self._held: set[str] = set()  # requests whose blocks vLLM keeps for us
        self._pins: dict[str, _Pin] = {}  # request id -> our block references
        self._pool: Any = None  # vLLM's BlockPool (bind_block_pool)
        self._meta = PrefillMetadata()
        self._streamed = config.streams
        self._is_state = tuple(g.is_state for g in config.kv_groups)
        self._refused: set[str] = set()  # legs whose push was refused at admission
        # early-bound legs: request id -> its first token's logprobs (kept
        # from the step that sampled it until request_finished, in that step)
        self._first_logprobs: dict[str, SampleLogprobs] = {}

    def bind_block_pool(self, pool: Any) -> None:
        """vLLM's GPU block pool (``bind_gpu_block_pool``, called once the
        scheduler built its cache manager), where the pins are taken."""
        self._pool = pool

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Prefill loads nothing from outside."""
        self._legs.of(request)
        return 0, False

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        """Start following a prefill request's blocks. With state groups
        (Mamba) only a leg that ends at its first token: another forward
        would overwrite the state in place while a WRITE reads it."""
        leg = self._legs.of(request)
        rid = request.request_id
        if not isinstance(leg, PrefillLeg) or rid in self._prefills:
            return
        if self.config.has_state and request.max_tokens > 1:
            self.counters.add("rejected.state_would_change")
            self._meta.cancels.append(leg.transfer_id)
            self._refused.add(rid)
            return
        self._prefills[rid] = _Prefill(request, leg)

    def build_connector_meta(self, scheduler_output: Any) -> PrefillMetadata:
        """This step's instructions for the worker; resets the accumulator."""
        self._note_preemptions(scheduler_output.preempted_req_ids or ())
        self._find_last_chunks(
            scheduler_output.num_scheduled_tokens,
            scheduler_output.kv_connector_block_state,
        )
        meta, self._meta = self._meta, PrefillMetadata()
        return meta

    def _note_preemptions(self, preempted: Any) -> None:
        for rid in preempted:
            state = self._prefills.get(rid)
            if state is None or not state.triggered or state.preempted:
                continue  # not triggered yet: it pushes from its new blocks
            state.preempted = True
            self._let_go(rid)
            self.counters.add("preempted.after_trigger")
            self._meta.preempted.append(PreemptedPush(rid, state.leg.transfer_id))

    def _find_last_chunks(self, num_scheduled: dict[str, int], tables: Any) -> None:
        """Trigger the blocks this step completes, of each prefill request
        it schedules (``num_computed_tokens`` is not advanced yet).

        The blocks come from vLLM's current tables (``tables``: the
        scheduler output's ``kv_connector_block_state``, offered for every
        request the step schedules): a sliding-window group lets go of the
        blocks its window has left (the null block takes their place)
        without saying so in the per-step ``new_block_ids``, so only the
        current table tells which ids the request still holds."""
        for rid, state in self._prefills.items():
            if state.final_sent or state.preempted or rid not in num_scheduled:
                continue
            prompt_len = state.request.num_prompt_tokens
            after = state.request.num_computed_tokens + num_scheduled[rid]
            if after >= prompt_len:
                end = math.ceil(prompt_len / self.config.block_size)
            elif self._streamed:
                end = after // self.config.block_size
            else:
                continue
            current = tables.get_block_ids(rid)
            if current is None:  # vLLM offers every scheduled request's
                raise RuntimeError(f"vLLM offered no block table for {rid}")
            n = math.ceil(prompt_len / self.config.block_size)
            self._trigger(state, end, groups.prompt_view(current, self._is_state, n))

    def _trigger(self, state: _Prefill, end: int, tables: Groups) -> None:
        """Hand prompt blocks ``num_sent..end-1`` of ``tables`` (vLLM's,
        one per KV-cache group) to the worker (the last trigger: ``end`` is
        the prompt's block count)."""
        final = end == math.ceil(
            state.request.num_prompt_tokens / self.config.block_size
        )
        start = state.num_sent
        if end <= start:
            return
        state.triggered, state.num_sent, state.final_sent = True, end, final
        src_block_ids = groups.span(tables, start, end)
        if not state.push_over:  # else no rank writes it: dropped as an orphan
            self._pin(state.request.request_id, groups.real(src_block_ids))
        self._meta.triggers.append(
            PushTrigger(
                req_id=state.request.request_id,
                transfer_id=state.leg.transfer_id,
                src_block_ids=src_block_ids,
                num_tokens=state.request.num_prompt_tokens,
                decode_engine_id=state.leg.decode_engine_id,
                first_block=start,
                final=final,
                claim_sha256=state.leg.claim_sha256,
            )
        )

    def keep_first_logprobs(self, request: Any, logprobs: SampleLogprobs) -> None:
        """The logprobs of the first token prefill sampled for ``request``
        (from kvpush's scheduler class), told to its decode with the token
        where the leg is bound early."""
        leg = self._legs.of(request)
        if isinstance(leg, PrefillLeg) and leg.decode_engine_id is not None:
            self._first_logprobs[request.request_id] = logprobs

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Keep a request's blocks while a WRITE out of them may still run.
        A vLLM-protocol leg whose whole prompt's KV is held answers what
        its decode leg needs (vLLM puts it in the response's
        ``kv_transfer_params``); every other request answers None."""
        rid = request.request_id
        leg = self._legs.of(request)  # parsed here if vLLM never scheduled it
        logprobs = self._first_logprobs.pop(rid, None)
        vllm = self._legs.vllm_prefill(rid)
        self._legs.forget(rid)
        state = self._prefills.pop(rid, None)
        self._let_go(rid)
        if not isinstance(leg, PrefillLeg) or rid in self._refused:
            self._refused.discard(rid)
            return False, None
        if not self._keeps_blocks(rid, leg, state):
            return False, None
        stopped = leg.ends_if_stopped and _finish_reason(request) == "stop"
        if stopped or leg.ends_at_first_token:
            # The router ends the request at this token: no decode will
            # claim the KV, which goes now rather than at the ready deadline.
            self.counters.add("ended.at_first_token")
            self._meta.cancels.append(leg.transfer_id)
        elif leg.decode_engine_id is not None and request.output_token_ids:
            # Bound early, decode's leg left before this token existed: tell
            # its decode, which then need not compute it again.
            token_id = request.output_token_ids[0]
            self._meta.first_tokens[leg.transfer_id] = (token_id, logprobs)
        if vllm is None or state is None or not state.final_sent:
            return True, None
        return True, self._answer(vllm)

    def _keeps_blocks(self, rid: str, leg: PrefillLeg, state: _Prefill | None) -> bool:
        """Whether vLLM keeps the finished request's blocks for a push
        (cancelling the push of a request aborted before its KV was whole)."""
        if state is None or not state.triggered:  # aborted before its KV was ready
            name = "aborted.before_ready" if state else "aborted.before_allocation"
            self.counters.add(name)
            self._meta.cancels.append(leg.transfer_id)
            return False
        if state.preempted:  # its push was closed at the preemption
            return False
        if not state.final_sent:  # aborted between two chunks: stop the push
            self.counters.add("aborted.mid_stream")
            self._meta.cancels.append(leg.transfer_id)
        self._held.add(rid)
        return True

    def _answer(self, vllm: VllmPrefill) -> dict[str, Any] | None:
        """What a decode needs to claim ``vllm``'s KV; None (and the push
        cancelled) when this prefill's side channel has no address to give
        (it binds a wildcard)."""
        c = self.config
        host = c.advertised_side_channel_host
        if is_wildcard(host):
            self.counters.add("skipped.wildcard_host")
            logger.error(
                "kvpush: cannot answer a vLLM P/D prefill leg: the side "
                "channel binds %r, which no decode can connect to; set the "
                "address decodes reach it at (kv_connector_extra_config."
                "side_channel_advertise_host; kvpush serve "
                "--side-channel-advertise-host)",
                host,
            )  # fmt: skip
            self._meta.cancels.append(vllm.leg.transfer_id)
            return None
        return vllm.answer(c.engine_id, host, c.side_channel_port, c.tp_size)

    def update_connector_output(
        self,
        finished_sending: set[str] | None,
        finished_recving: set[str] | None,
        worker_meta: Any = None,
    ) -> None:
        """vLLM reports a request in ``finished_sending`` only once every
        rank did, and it then frees the request's blocks: our pins go too.
        :class:`PushesOver` names the ranks done with a request (finished or
        not, preempted included); its pins go once all of them are."""
        for rid in finished_sending or ():
            self._held.discard(rid)
            self._unpin(rid)
        if not isinstance(worker_meta, PushesOver):
            return
        for rid, ranks in worker_meta.over.items():
            pin = self._pins.get(rid)
            if pin is None:  # unpinned already, or nothing was pinned
                continue
            pin.ranks_over |= ranks
            if len(pin.ranks_over) >= self.config.tp_size:
                self._unpin(rid)

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while a push may still end (so that the
        worker's ``get_finished`` runs and releases the blocks)."""
        return (
            bool(self._held)
            or bool(self._pins)
            or any(s.triggered and not s.preempted for s in self._prefills.values())
        )

    def has_pending_block_frees(self) -> bool:
        """True while blocks pinned for a push will come back soon: their
        request is finished or preempted (vLLM let go of them) less than
        :data:`PENDING_FREE_S` ago. vLLM then waits for them instead of
        preempting a running request (``allocate_slots`` loop).

        This cannot stall vLLM for ever: each pin counts here for at most
        :data:`PENDING_FREE_S` after its request let go, and the question is
        asked again at every step; after that vLLM preempts as it would
        without us (the pins still keep a WRITE's source intact, whatever
        it preempts). Pins of running requests do not count: freeing them
        would return nothing."""
        now = self._clock()
        return any(
            p.gone_at is not None and now - p.gone_at < PENDING_FREE_S
            for p in self._pins.values()
        )

    def _pin(self, rid: str, block_ids: tuple[int, ...]) -> None:
        """Take our reference on ``block_ids`` (the request holds them too,
        so ``touch`` never takes a block out of the free queue here)."""
        pin = self._pins.setdefault(rid, _Pin())
        pin.block_ids.extend(block_ids)
        if self._pool is not None:
            self._pool.touch([self._pool.blocks[b] for b in block_ids])

    def _let_go(self, rid: str) -> None:
        """vLLM finished or preempted ``rid``: from now on only our pins
        hold its triggered blocks (and vLLM, for a request it keeps for us)."""
        pin = self._pins.get(rid)
        if pin is not None and pin.gone_at is None:
            pin.gone_at = self._clock()

    def _unpin(self, rid: str) -> None:
        """Every rank's push of ``rid`` is over: drop our references, once;
        chunks triggered later are not pinned (no rank writes them)."""
        pin = self._pins.pop(rid, None)
        state = self._prefills.get(rid)
        if state is not None:
            state.push_over = True
        if pin is not None and self._pool is not None:
            self._pool.free_blocks([self._pool.blocks[b] for b in pin.block_ids])

    def close(self) -> None:
        self.tracer.close()


def _finish_reason(request: Any) -> str | None:
    """Why vLLM finished ``request``, as its API reports it ("stop",
    "length", ...); None for a request not finished."""
    reason = request.get_finished_reason()
    return None if reason is None else str(reason)
