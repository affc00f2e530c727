"""Decode's scheduler side (vLLM's EngineCore process, its main thread;
every method is called by vLLM's scheduler).

A request whose leg is a :class:`DecodeLeg` claims the prompt tokens it does
not hold in its own prefix cache as arriving from outside
(``get_num_new_matched_tokens``); as soon as vLLM has allocated its blocks
(``update_state_after_alloc``) the registration goes straight to the
prefill's side channel, and the worker is told to expect the transfer.
Prefill's answers to registrations come back on this socket: Failures and
requests for a Hello are forwarded to the worker in the next step's
metadata (this process never touches the receives themselves).

Tensor parallelism: block ids are the same on every rank, so this one
scheduler sends one Registration (and any Cancel of its own) to every
prefill rank's side channel (``prefill_port + r``,
:mod:`kvpush.transfer.ranks`), and its metadata reaches every decode worker
rank: a Failure from any prefill rank reaches them all. A leg whose
``prefill_tp`` this decode cannot pair with its own TP size is served
locally (``rejected.incompatible``) before anything is sent.

Siblings (``n > 1``): vLLM fans a request out into children with the same
``kv_transfer_params``; one prefill pushes one transfer, and the children
share it. The first child seen owns the transfer id and registers; a later
one (a *sibling*, :meth:`~kvpush.connector.legs.Legs.first_of`) gets
``None`` from ``get_num_new_matched_tokens`` while the first's receive is
pending (vLLM skips it this step and asks again), and ``(0, False)`` once
that receive ended, done or failed, or the first finished: vLLM's own
prefix cache then serves what the first received (vLLM caches the blocks
of an async load when it ends, before it looks at the waiting siblings),
and the sibling computes the rest. The wait is bounded by the
registration's ttl, after which the sibling computes the prompt itself. A
sibling never registers, cancels, or holds blocks for kvpush.

No external load: vLLM may load nothing external for a request after all.
A request with ``prompt_logprobs`` (vLLM sets ``skip_reading_prefix_cache``
for it) is asked ``get_num_new_matched_tokens`` but vLLM then drops the
answer and calls ``update_state_after_alloc`` with 0 external tokens; other
trims of vLLM's scheduler can also leave 0. Decode then gives the transfer
up at once (``skipped.no_external_load``; a Cancel, so that prefill frees
the pushed KV now rather than at its ready deadline) and the request is
served locally; a sibling just stops waiting (the transfer is its first's).

The first token (early binding): prefill tells this scheduler the token it
sampled after the prompt (:class:`FirstToken`, on the Registration's
socket); :meth:`DecodeScheduler.first_token` hands it to kvpush's vLLM
scheduler class (:mod:`kvpush.connector.decode.first_token`), which then
continues from it instead of computing it again. Without that class the
tokens are kept a while and dropped.

Abort: a request that vLLM finishes while its KV is on the way keeps its
blocks (``request_finished`` returns True): the worker sends prefill a
Cancel and reports the request once no WRITE can land any more (see
:mod:`kvpush.connector.decode.receiver`). A request that ends before
registering only tells prefill not to wait for it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvpush.connector.config import ConnectorConfig, rewind_reads_a_skipped_block
from kvpush.connector.counters import Counters
from kvpush.connector.decode.first_token import why_never
from kvpush.connector.faults import FaultSource, outbound
from kvpush.connector.legs import Legs
from kvpush.connector.metadata import DecodeMetadata, RecvExpect
from kvpush.connector.side_channel import Peers
from kvpush.connector.trace import Tracer
from kvpush.transfer import groups
from kvpush.transfer.groups import Groups
from kvpush.transfer.layout import REQUIRED_KV_CACHE_LAYOUT
from kvpush.transfer.messages import (
    Cancel,
    Cause,
    DecodeLeg,
    Failure,
    FirstToken,
    HelloRequest,
    Registration,
)
from kvpush.transfer.ranks import TpPair, side_channel_port
from kvpush.transfer.state_pages import state_writers_problem

logger = logging.getLogger(__name__)

SKIPS_LOAD = "vLLM skips external loads for this request (prompt_logprobs)"
NO_LOAD = "vLLM allocated the request with no external tokens"
MAX_FIRST_TOKENS = 4096  # prefill's first tokens kept, oldest dropped first


class DecodeScheduler:
    """Owns decode's scheduler-side state; single-threaded."""

    def __init__(
        self, config: ConnectorConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        self.tracer = Tracer(config.trace_dir, config.engine_id)
        self.counters = Counters()
        self._peers = Peers(config.secret)
        self._send = outbound(self._peers, FaultSource(config.fault_file)).send
        self._legs = Legs(self.counters, share_ids=True)
        self._sibling_until: dict[str, float] = {}  # waiting sibling -> deadline
        self._local_hits: dict[str, int] = {}  # req -> tokens in our prefix cache
        self._closed: set[str] = set()  # registered, or gave the transfer up
        self._receiving: dict[str, DecodeLeg] = {}  # registered, KV not in
        self._awaiting_first_step: dict[str, str] = {}  # req -> transfer id
        self._held: set[str] = set()  # aborted while receiving; vLLM keeps blocks
        self._first_tokens: OrderedDict[str, FirstToken] = OrderedDict()  # by tid
        # _state_tp_problem by prefill TP size (at most ranks.MAX_TP_SIZE)
        self._state_tp_problems: dict[int, str | None] = {}
        self._meta = DecodeMetadata()

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Every prompt token prefill computed (:func:`pushed_tokens`) and
        the local prefix cache lacks will be pushed (asynchronously). A
        full local hit cancels the transfer. A sibling waits (None) while
        its first's receive is pending."""
        leg = self._legs.of(request)
        rid = request.request_id
        if not isinstance(leg, DecodeLeg) or rid in self._closed:
            return 0, False
        first = self._legs.first_of(rid)
        if getattr(request, "skip_reading_prefix_cache", False) is True:
            # vLLM will zero whatever we claim (prompt_logprobs): say 0 now
            self._no_external_load(rid, leg, first, SKIPS_LOAD)
            return 0, False
        if first is not None:
            return self._sibling(rid, first, leg), False
        problem = self._tp_problem(leg) or _pushed_problem(request, leg)
        if problem is not None:
            self.counters.add("rejected.incompatible")
            logger.error("kvpush: serving %s locally: %s", rid, problem)
            self._give_up(rid, leg, problem)
            return 0, False
        state_problem = self._state_problem(request, leg)
        if state_problem is not None:
            self.counters.add("rejected.state_rewind")
            logger.info("kvpush: serving %s locally: %s", rid, state_problem)
            self._give_up(rid, leg, state_problem)
            return 0, False
        pushed = pushed_tokens(request, leg)
        num_external = pushed - num_computed_tokens
        if pushed == request.num_prompt_tokens and rewind_reads_a_skipped_block(
            self.config.kv_groups, pushed, self.config.block_size
        ):
            num_external -= 1  # vLLM computes the last token, its window whole
        if num_external <= 0:
            self._give_up(rid, leg, "decode holds the whole prompt")
            return 0, False
        self._local_hits[rid] = num_computed_tokens
        return num_external, True

    def _state_problem(self, request: Any, leg: DecodeLeg) -> str | None:
        """Why a model with state groups (Mamba) cannot load this leg, or
        None. vLLM computes a whole loaded prompt's last token again, which
        would apply it to the loaded state twice; so only a leg whose
        prompt goes on past the pushed tokens may load: one bound late
        (its prompt ends with prefill's first token), or one bound early
        that continues from prefill's first token (kvpush's scheduler class,
        and a request that can: :func:`why_never`)."""
        if not self.config.has_state:
            return None
        if leg.prefill_tp != self.config.tp_size:
            tp = leg.prefill_tp  # the answer depends on the sizes alone
            if tp not in self._state_tp_problems:
                self._state_tp_problems[tp] = self._state_tp_problem(tp)
            if self._state_tp_problems[tp] is not None:
                return self._state_tp_problems[tp]
        if pushed_tokens(request, leg) < request.num_prompt_tokens:
            return None  # bound late: nothing is computed again
        if not self.config.continues_from_t1:
            return (
                "a state model's leg loads only where decode continues from "
                "prefill's first token (kvpush's --scheduler-cls)"
            )
        reason = why_never(request)
        if reason is not None:
            return (
                f"a state model's leg that cannot continue from prefill's "
                f"first token ({reason.value})"
            )
        return None

    def _state_tp_problem(self, prefill_tp: int) -> str | None:
        """Why this decode's state pages cannot come from prefill ranks of
        TP ``prefill_tp`` (:func:`state_writers_problem`; a page kvpush does
        not describe copies whole, between equal TP sizes only), or None."""
        c = self.config
        pair = TpPair(prefill_tp, c.tp_size, c.total_kv_heads)
        writers = [pair.sources_of(d) for d in range(c.tp_size)]
        for group in c.kv_groups:
            if not group.is_state:
                continue
            if group.page is None:
                return (
                    f"a state model's leg from prefill TP {prefill_tp} to decode "
                    f"TP {c.tp_size}: its {group.kind} pages are not ones kvpush "
                    "splits by TP (connector/state_spec.py), so they copy "
                    "between equal TP sizes only"
                )
            problem = state_writers_problem(group.page, prefill_tp, c.tp_size, writers)
            if problem is not None:
                return f"a state model's leg: {problem}"
        return None

    def _tp_problem(self, leg: DecodeLeg) -> str | None:
        """Why this decode's ranks cannot receive from the leg's prefill TP
        size (:meth:`TpPair.problem`), or None."""
        c = self.config
        pair = TpPair(leg.prefill_tp, c.tp_size, c.total_kv_heads)
        return pair.problem(REQUIRED_KV_CACHE_LAYOUT)

    def _sibling(self, rid: str, first: str, leg: DecodeLeg) -> int | None:
        """None while ``first``'s receive is pending (within the wait's
        deadline), else 0: the sibling goes on without kvpush."""
        now = self._clock()
        if self._is_receiving(first):
            if rid not in self._sibling_until:
                self.counters.add("sibling.wait")
                logger.debug(
                    "request %s waits for %s's receive of transfer %s",
                    rid, first, leg.transfer_id,
                )  # fmt: skip
                self._sibling_until[rid] = now + self.config.registration_ttl_s
            if now < self._sibling_until[rid]:
                return None
            self.counters.add("sibling.expired")
            logger.debug("request %s stops waiting for %s", rid, first)
        else:
            self.counters.add("sibling.after_first")
        self._sibling_until.pop(rid, None)
        self._closed.add(rid)  # kvpush is done with it: vLLM's from here
        return 0

    def _is_receiving(self, rid: str) -> bool:
        """``rid`` registered and its receive has not ended, or it is live
        and has not yet registered (nor given up)."""
        if rid in self._receiving:
            return True
        return self._legs.is_live(rid) and rid not in self._closed

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        """Register the freshly allocated blocks with prefill now; give the
        transfer up if vLLM allocated them with no external tokens."""
        leg = self._legs.of(request)
        rid = request.request_id
        if not isinstance(leg, DecodeLeg) or rid in self._closed:
            return
        if num_external_tokens <= 0:  # vLLM loads nothing after all
            self._no_external_load(rid, leg, self._legs.first_of(rid), NO_LOAD)
            return
        self._register(request, leg, blocks.get_block_ids())

    def _no_external_load(
        self, rid: str, leg: DecodeLeg, first: str | None, reason: str
    ) -> None:
        """vLLM computes the prompt itself: cancel the transfer now (a
        sibling's is its first's: it only stops waiting)."""
        self._local_hits.pop(rid, None)
        self._sibling_until.pop(rid, None)
        if first is not None:
            self._closed.add(rid)  # vLLM's from here
            return
        self.counters.add("skipped.no_external_load")
        logger.info("kvpush: serving %s locally: %s", rid, reason)
        self._give_up(rid, leg, reason)

    def _register(self, request: Any, leg: DecodeLeg, block_ids: Groups) -> None:
        """Register vLLM's tables (one per KV-cache group) from decode's
        first missing prompt block on."""
        rid, bs = request.request_id, self.config.block_size
        first = self._local_hits.pop(rid, 0) // bs
        num_tokens = pushed_tokens(request, leg)
        n = math.ceil(num_tokens / bs)
        is_state = [g.is_state for g in self.config.kv_groups]
        dst = groups.span(groups.prompt_view(block_ids, is_state, n), first, n)
        reg = Registration(
            transfer_id=leg.transfer_id,
            decode_engine_id=self.config.engine_id,
            decode_boot_id=self.config.boot_id,
            dst_block_ids=dst,
            num_tokens=num_tokens,
            ttl_s=self.config.registration_ttl_s,
            first_block=first,
            claim_token=leg.claim_token,  # late binding: what lets us claim it
            decode_tp=self.config.tp_size,  # which ranks each prefill rank writes
        )
        self._meta.expects.append(
            RecvExpect(
                req_id=rid,
                transfer_id=leg.transfer_id,
                dst_block_ids=dst,
                prefill_engine_id=leg.prefill_engine_id,
                prefill_host=leg.prefill_host,
                prefill_port=leg.prefill_port,
                prefill_tp=leg.prefill_tp,
            )
        )
        for rank, port in _rank_ports(leg):
            if not self._send(leg.prefill_host, port, reg):
                self.counters.add("registration.not_sent")
                failure = Failure(
                    transfer_id=leg.transfer_id,
                    engine_id=self.config.engine_id,
                    cause=Cause.SEND_FAILED,
                    detail="the registration could not be queued",
                    rank=rank,
                )
                self._meta.failures.append(failure)  # that rank cannot write
        self.tracer.mark(leg.transfer_id, "reg_sent", num_blocks=groups.total(dst),
                         request_id=rid)  # fmt: skip
        self._closed.add(rid)
        self._receiving[rid] = leg
        self._awaiting_first_step[rid] = leg.transfer_id

    def build_connector_meta(self, scheduler_output: Any) -> DecodeMetadata:
        """This step's instructions for the worker; resets the accumulator."""
        num_scheduled = scheduler_output.num_scheduled_tokens
        for rid in [r for r in self._awaiting_first_step if r in num_scheduled]:
            self.tracer.mark(self._awaiting_first_step.pop(rid), "first_decode_step")
        self._forward_replies()
        meta, self._meta = self._meta, DecodeMetadata()
        return meta

    def _forward_replies(self) -> None:
        """Prefill's answers on this socket are the worker's to act on."""
        for address, msg in self._peers.receive():
            if isinstance(msg, Failure):
                self._meta.failures.append(msg)
            elif isinstance(msg, HelloRequest):
                self._meta.hello_requests.append(address)
            elif isinstance(msg, FirstToken):
                self._keep_first_token(msg)

    def _keep_first_token(self, msg: FirstToken) -> None:
        self._first_tokens[msg.transfer_id] = msg
        self._first_tokens.move_to_end(msg.transfer_id)
        while len(self._first_tokens) > MAX_FIRST_TOKENS:
            self._first_tokens.popitem(last=False)
            self.counters.add("first_token.dropped")

    def requires_first_token(self, request: Any) -> bool:
        """Whether ``request`` loads a model's state (Mamba) with its whole
        prompt: it may only continue from prefill's first token, and
        decode recomputes it whole rather than compute its last prompt token
        again (:meth:`_state_problem`)."""
        if not self.config.has_state:
            return False
        leg = self._legs.of(request)
        return (
            isinstance(leg, DecodeLeg)
            and request.request_id in self._closed
            and pushed_tokens(request, leg) >= request.num_prompt_tokens
        )

    def awaits_first_token(self, request: Any) -> bool:
        """Whether ``request`` is an early-bound leg whose first token prefill
        will tell and has not yet (reads the sockets first)."""
        leg = self._early_leg(request)
        return leg is not None and leg.transfer_id not in self._first_tokens

    def first_token(self, request: Any) -> FirstToken | None:
        """The token prefill sampled after ``request``'s pushed prompt (and
        its logprobs where asked), if it came (taken: asked once per
        request, when its KV landed); None for any other request. Reads the
        sockets first, so a token that came during this step counts."""
        leg = self._early_leg(request)
        if leg is None:
            return None
        first = self._first_tokens.pop(leg.transfer_id, None)
        if first is None:
            self.counters.add("first_token.missing")  # not in time: computed
        return first

    def _early_leg(self, request: Any) -> DecodeLeg | None:
        """``request``'s leg if bound early (prefill tells its first token;
        a late leg's prompt already ends with it), after reading the
        sockets, so that a token that came during this step counts."""
        leg = self._legs.of(request)
        if not isinstance(leg, DecodeLeg) or leg.num_kv_tokens is not None:
            return None
        self._forward_replies()
        return leg

    def first_token_outcome(self, reason: Any) -> None:
        """Count what became of a token :meth:`first_token` gave: continued
        from (``reason`` None) or computed again (a
        :class:`~kvpush.connector.decode.first_token.NotGiven`)."""
        name = "continued" if reason is None else f"recomputed.{reason.value}"
        self.counters.add(f"first_token.{name}")

    def request_finished(self, request: Any) -> tuple[bool, None]:
        """Keep a request's blocks while a WRITE into them may still land."""
        rid = request.request_id
        leg = self._legs.of(request)  # parsed here if vLLM never scheduled it
        is_sibling = self._legs.first_of(rid) is not None
        self._legs.forget(rid)
        if isinstance(leg, DecodeLeg) and not is_sibling:
            self._first_tokens.pop(leg.transfer_id, None)
        self._local_hits.pop(rid, None)
        self._awaiting_first_step.pop(rid, None)
        self._sibling_until.pop(rid, None)
        if is_sibling:  # the transfer is its first's: nothing to give up
            self._closed.discard(rid)
            return False, None
        if isinstance(leg, DecodeLeg) and rid not in self._closed:
            self.counters.add("aborted.before_registration")
            self._give_up(rid, leg, "request finished before registering")
        self._closed.discard(rid)
        receiving = self._receiving.pop(rid, None)
        if receiving is None:
            return False, None
        self._meta.recv_cancels.append(receiving.transfer_id)  # aborted
        self._held.add(rid)
        return True, None

    def _give_up(self, rid: str, leg: DecodeLeg, reason: str) -> None:
        """Tell prefill not to wait for a registration that will not come."""
        cancel = Cancel(
            transfer_id=leg.transfer_id, engine_id=self.config.engine_id, reason=reason
        )
        for _, port in _rank_ports(leg):
            if not self._peers.send(leg.prefill_host, port, cancel):
                self.counters.add("cancel.not_sent")  # its deadline covers it
        self._closed.add(rid)

    def update_connector_output(
        self, finished_sending: set[str] | None, finished_recving: set[str] | None
    ) -> None:
        self._held.difference_update(finished_recving or ())
        for rid in finished_recving or ():
            self._receiving.pop(rid, None)

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while blocks of aborted receives are held
        (so that the worker's ``get_finished`` runs and releases them)."""
        return bool(self._held)

    def close(self) -> None:
        self._peers.close()
        self.tracer.close()


def pushed_tokens(request: Any, leg: DecodeLeg) -> int:
    """How many of the request's first prompt tokens prefill pushes: the
    leg's ``num_kv_tokens`` (its prompt ends with tokens decode computes,
    as the first token from prefill) or the whole prompt."""
    if leg.num_kv_tokens is None:
        return int(request.num_prompt_tokens)
    return leg.num_kv_tokens


def _pushed_problem(request: Any, leg: DecodeLeg) -> str | None:
    """Why the leg's ``num_kv_tokens`` cannot be this request's, or None."""
    if leg.num_kv_tokens is not None and leg.num_kv_tokens > request.num_prompt_tokens:
        return (
            f"the leg's num_kv_tokens={leg.num_kv_tokens} exceeds the "
            f"prompt's {request.num_prompt_tokens} tokens"
        )
    return None


def _rank_ports(leg: DecodeLeg) -> list[tuple[int, int]]:
    """(rank, side-channel port) of every rank of the leg's prefill."""
    return [(r, side_channel_port(leg.prefill_port, r)) for r in range(leg.prefill_tp)]
