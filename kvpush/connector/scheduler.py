"""Scheduler side of KvPushConnector (runs in vLLM's EngineCore process,
on its main thread; every method here is called by vLLM's scheduler).

Decode: a request whose ``kv_transfer_params`` is a :class:`DecodeLeg` claims
the prompt tokens it does not hold in its own prefix cache as arriving from
outside (``get_num_new_matched_tokens``); as soon as vLLM has allocated its
blocks (``update_state_after_alloc``) the registration goes straight to the
prefill's side channel, and the worker is told to expect the transfer.

Prefill: a request whose params are a :class:`PrefillLeg` is followed chunk
by chunk; in the step that computes its last prompt token the worker gets a
:class:`PushTrigger`, and pushes once that step's forward is done. When the
request finishes, vLLM keeps its blocks (``request_finished`` returns True)
until the worker reports the push ended (done, failed or expired).

Decode, abort: a request that vLLM finishes (client abort) while its KV is on
the way keeps its blocks too: the worker sends prefill a Cancel and reports
the request once no WRITE can land any more (see
:mod:`kvpush.connector.receiver`). A request that ends before registering
only tells prefill not to wait for it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.counters import Counters
from kvpush.connector.faults import FaultSource
from kvpush.connector.metadata import KvPushMetadata, PushTrigger, RecvExpect
from kvpush.connector.side_channel import Peers
from kvpush.connector.trace import Tracer
from kvpush.transfer.messages import (
    Cancel,
    DecodeLeg,
    PrefillLeg,
    Registration,
    TransferParams,
)

logger = logging.getLogger(__name__)


@dataclass
class _PrefillState:
    """A prefill request followed until its push is triggered."""

    request: Any
    leg: PrefillLeg
    block_ids: list[int] = field(default_factory=list)
    triggered: bool = False


class KvPushScheduler:
    """Owns the scheduler-side state of one instance; single-threaded."""

    def __init__(self, config: ConnectorConfig) -> None:
        self.config = config
        self._peers = Peers(config.secret)
        self._tracer = Tracer(config.trace_dir, config.engine_id)
        self.counters = Counters(config.trace_dir, config.engine_id, config.role)
        self._faults = FaultSource(config.fault_file)
        self._legs: dict[str, PrefillLeg | DecodeLeg | None] = {}
        self._local_hits: dict[str, int] = {}  # decode: req -> cached tokens
        self._registered: set[str] = set()
        self._receiving: dict[str, DecodeLeg] = {}  # decode: registered, KV not in
        self._awaiting_first_step: dict[str, str] = {}  # req -> transfer id
        self._prefills: dict[str, _PrefillState] = {}
        self._held: set[str] = set()  # prefill reqs whose blocks vLLM keeps for us
        self._meta = KvPushMetadata()

    # -- parsing at the edge ------------------------------------------------

    def leg(self, request: Any) -> PrefillLeg | DecodeLeg | None:
        """The request's kvpush leg, parsed once (None: not a kvpush request,
        or params that do not parse, which are logged and served locally)."""
        rid = request.request_id
        if rid not in self._legs:
            params = request.kv_transfer_params
            leg = None
            if params:
                try:
                    leg = TransferParams.from_dict(params)
                except ValueError as e:
                    logger.warning(
                        "request %s: ignoring kv_transfer_params: %s", rid, e
                    )
            self._legs[rid] = leg
        return self._legs[rid]

    # -- vLLM scheduler hooks ---------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Decode: every prompt token not in the local prefix cache will be
        pushed (asynchronously). A full local hit cancels the transfer."""
        leg = self.leg(request)
        rid = request.request_id
        if not isinstance(leg, DecodeLeg) or rid in self._registered:
            return 0, False
        num_external = request.num_prompt_tokens - num_computed_tokens
        if num_external <= 0:
            self._give_up(rid, leg, "decode holds the whole prompt")
            return 0, False
        self._local_hits[rid] = num_computed_tokens
        return num_external, True

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        """Decode: register the freshly allocated blocks with prefill now.
        Prefill: start following the request's blocks."""
        leg = self.leg(request)
        if isinstance(leg, PrefillLeg) and request.request_id not in self._prefills:
            self._prefills[request.request_id] = _PrefillState(request, leg)
        if not isinstance(leg, DecodeLeg) or num_external_tokens <= 0:
            return
        if request.request_id in self._registered:
            return
        self._register(request, leg, list(blocks.get_block_ids()[0]))

    def _register(self, request: Any, leg: DecodeLeg, block_ids: list[int]) -> None:
        rid, bs = request.request_id, self.config.block_size
        first = self._local_hits.pop(rid, 0) // bs
        dst = tuple(block_ids[first : math.ceil(request.num_prompt_tokens / bs)])
        reg = Registration(
            transfer_id=leg.transfer_id,
            decode_engine_id=self.config.engine_id,
            decode_boot_id=self.config.boot_id,
            decode_agent_name=self.config.agent_name,
            dst_block_ids=dst,
            num_tokens=request.num_prompt_tokens,
            ttl_s=self.config.registration_ttl_s,
            first_block=first,
        )
        if self._faults.current().drop_registrations:
            logger.warning("kvpush: FAULT: registration of %s dropped", rid)
        else:
            self._peers.send(leg.prefill_host, leg.prefill_port, reg)
        self._tracer.mark(leg.transfer_id, "reg_sent", num_blocks=len(dst),
                          request_id=rid)  # fmt: skip
        self._registered.add(rid)
        self._receiving[rid] = leg
        self._awaiting_first_step[rid] = leg.transfer_id
        self._meta.expects.append(
            RecvExpect(
                req_id=rid,
                transfer_id=leg.transfer_id,
                dst_block_ids=dst,
                prefill_engine_id=leg.prefill_engine_id,
                prefill_host=leg.prefill_host,
                prefill_port=leg.prefill_port,
            )
        )

    def build_connector_meta(self, scheduler_output: Any) -> KvPushMetadata:
        """This step's instructions for the worker; resets the accumulator."""
        self._track_blocks(scheduler_output)
        self._find_last_chunks(scheduler_output.num_scheduled_tokens)
        self._mark_first_decode_steps(scheduler_output.num_scheduled_tokens)
        meta, self._meta = self._meta, KvPushMetadata()
        self._peers.receive()  # prefill's answers to our Cancels: nothing to do
        self.counters.maybe_flush()
        return meta

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
        """Trigger the push of each prefill request whose last prompt token
        this step computes (``num_computed_tokens`` is not advanced yet)."""
        for rid, state in self._prefills.items():
            if state.triggered or rid not in num_scheduled:
                continue
            req, prompt_len = state.request, state.request.num_prompt_tokens
            if req.num_computed_tokens + num_scheduled[rid] < prompt_len:
                continue
            state.triggered = True
            num_blocks = math.ceil(prompt_len / self.config.block_size)
            self._meta.triggers.append(
                PushTrigger(
                    req_id=rid,
                    transfer_id=state.leg.transfer_id,
                    src_block_ids=tuple(state.block_ids[:num_blocks]),
                    num_tokens=prompt_len,
                    decode_engine_id=state.leg.decode_engine_id,
                )
            )

    def _mark_first_decode_steps(self, num_scheduled: dict[str, int]) -> None:
        for rid in [r for r in self._awaiting_first_step if r in num_scheduled]:
            self._tracer.mark(self._awaiting_first_step.pop(rid), "first_decode_step")

    def request_finished(self, request: Any) -> tuple[bool, None]:
        """Keep a request's blocks while a push into or out of them may still
        be under way."""
        rid = request.request_id
        leg = self.leg(request)  # parsed here if vLLM never scheduled it
        self._legs.pop(rid, None)
        state = self._prefills.pop(rid, None)
        self._local_hits.pop(rid, None)
        self._awaiting_first_step.pop(rid, None)
        if isinstance(leg, DecodeLeg) and rid not in self._registered:
            self.counters.add("aborted.before_registration")
            self._give_up(rid, leg, "request finished before registering")
        self._registered.discard(rid)
        receiving = self._receiving.pop(rid, None)
        if receiving is not None:  # aborted while its KV was on the way
            self._meta.recv_cancels.append(receiving.transfer_id)
            self._held.add(rid)
            return True, None
        if state is None:
            return False, None
        if not state.triggered:  # aborted before its KV was ready
            self.counters.add("aborted.before_ready")
            self._meta.cancels.append(state.leg.transfer_id)
            return False, None
        self._held.add(rid)
        return True, None

    def _give_up(self, rid: str, leg: DecodeLeg, reason: str) -> None:
        """Tell prefill not to wait for a registration that will not come."""
        cancel = Cancel(
            transfer_id=leg.transfer_id, engine_id=self.config.engine_id, reason=reason
        )
        self._peers.send(leg.prefill_host, leg.prefill_port, cancel)
        self._registered.add(rid)

    def update_connector_output(
        self, finished_sending: set[str] | None, finished_recving: set[str] | None
    ) -> None:
        self._held.difference_update(finished_sending or ())
        self._held.difference_update(finished_recving or ())
        for rid in finished_recving or ():
            self._receiving.pop(rid, None)

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while a push may still end (so that the
        worker's ``get_finished`` runs and releases the blocks; on decode,
        the blocks of requests aborted while receiving)."""
        return bool(self._held) or any(s.triggered for s in self._prefills.values())

    def close(self) -> None:
        self._peers.close()
        self._tracer.close()
        self.counters.close()
