"""kvpush mode's routing, wired to the app: the adapter around ``planner.py``.

The app builds one :class:`Routing` in kvpush mode (``app.py``): it owns the
:class:`~kvpush.router.signals.SignalBoard` and its
:class:`~kvpush.router.scraper.SignalScraper`, the
:class:`~kvpush.router.prefix.PrefixIndex` and the
:class:`~kvpush.router.planner.Planner`. For each attempt ``dispatch.py``
calls :meth:`Routing.plan`, which counts the prompt once per request
(``binding auto`` only: the other bindings need no count, so they pay no
``/tokenize`` round trip, nor does a request asking for prompt logprobs,
which always skips: ``binding.py``), plans, and counts the decision; a late-bound
attempt calls :meth:`Routing.bind_late` once its prefill answered; after
decode's answer was relayed it calls :meth:`Routing.served`. An instance the health
checks mark down is forgotten (its index entries and reads). Decodes that
publish vLLM's KV cache events feed the index too (``kv_feed.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import aiohttp

from kvpush.router.config import RouterConfig
from kvpush.router.context import FlowContext
from kvpush.router.first_token import asks_one_token
from kvpush.router.health import HealthBoard
from kvpush.router.kv_feed import KvEventFeed
from kvpush.router.metrics import RouterMetrics
from kvpush.router.planner import Planner, Prompt, RoutePlan
from kvpush.router.prefix import PrefixIndex, session_key
from kvpush.router.scraper import SignalScraper
from kvpush.router.selection import usable
from kvpush.router.signals import SignalBoard
from kvpush.router.tokenize import fetch_tokens
from kvpush.topology import Backend

logger = logging.getLogger(__name__)

BINDING_HEADER = "x-kvpush-binding"
DECODE_HEADER = "x-kvpush-decode"


class Routing:
    """The planner and the live state it reads, for one router."""

    def __init__(
        self, config: RouterConfig, health: HealthBoard, metrics: RouterMetrics
    ) -> None:
        self.config = config
        routing = config.routing
        self.signals = SignalBoard(routing.signal_max_age_s)
        self.index = PrefixIndex(routing.prefix_index_entries)
        self.planner = Planner(routing, health, self.signals, self.index)
        self.scraper = SignalScraper(
            config.topology.backends,
            self.signals,
            routing.signal_interval_s,
            config.health_timeout_s,
        )
        self.kv_events = KvEventFeed(
            config.topology.backends, self.index, routing.block_size, metrics
        )
        self._health = health
        self._metrics = metrics
        self._num_tokenizes = 0

    def start(self, session: aiohttp.ClientSession) -> None:
        self.scraper.start(session)
        self.kv_events.start()

    async def close(self) -> None:
        await self.kv_events.close()
        await self.scraper.close()

    def instance_down(self, engine_id: str) -> None:
        """Health said ``engine_id`` went down: forget what it held."""
        self.planner.forget(engine_id)
        self.kv_events.forget(engine_id)

    async def plan(self, ctx: FlowContext) -> RoutePlan:
        """This attempt's route; its decision is counted and put in the
        headers the client's answer will carry."""
        if ctx.prompt is None:
            ctx.prompt = await self._prompt(ctx)
        topology = self.config.topology
        plan = self.planner.plan(
            topology.prefills,
            topology.decodes,
            ctx.attempts.avoided,
            ctx.prompt,
            time.monotonic(),
        )
        self._metrics.binding(plan.decision.binding, plan.decision.reason)
        logger.debug(
            "request %s attempt %d: binding %s (%s)",
            ctx.request_id,
            ctx.attempts.number,
            plan.decision.binding,
            plan.decision.reason,
        )
        if plan.decision.binding == "prefill":  # no decode serves it
            self.unbound(ctx, plan)
        elif plan.decision.binding != "late":  # its decode is chosen later
            self._announce(ctx, plan)
        return plan

    def bind_late(
        self, ctx: FlowContext, plan: RoutePlan, prefill: Backend
    ) -> RoutePlan:
        """A late-bound attempt's prefill holds the KV: choose its decode now
        (on the load of now); the plan with that decode, counted and put in
        the headers."""
        if ctx.prompt is None:
            raise RuntimeError("bind_late before plan")
        decode, reason, held = self.planner.choose_late_decode(
            self.config.topology.decodes,
            ctx.attempts.avoided,
            ctx.prompt,
            prefill,
            plan.hashes,
            time.monotonic(),
        )
        bound = dataclasses.replace(
            plan, decode=decode, decode_reason=reason, num_held_tokens=held
        )
        self._announce(ctx, bound)
        return bound

    def unbound(self, ctx: FlowContext, plan: RoutePlan) -> None:
        """No decode serves this attempt (a prefill answers it alone, or a
        late-bound one ended at prefill's first token): the headers say
        its binding and name no decode."""
        ctx.response_headers = {BINDING_HEADER: plan.decision.binding}

    def _announce(self, ctx: FlowContext, plan: RoutePlan) -> None:
        self._metrics.decode_choice(plan.decode_reason)
        ctx.response_headers = {
            BINDING_HEADER: plan.decision.binding,
            DECODE_HEADER: plan.decode.engine_id,
        }

    def served(self, plan: RoutePlan) -> None:
        """Decode answered the plan's request in full."""
        self.planner.served(plan)

    async def _prompt(self, ctx: FlowContext) -> Prompt:
        session = session_key(
            ctx.request.headers, ctx.parsed.body, self.config.routing.session_header
        )
        if ctx.parsed.wants_prompt_logprobs:  # skips, and reads no prefix cache
            return Prompt(tokens=None, session=session, prompt_logprobs=True)
        one_token = asks_one_token(ctx.parsed)
        recomputed = self.config.routing.state_model and (
            ctx.parsed.first_token_recomputed is not None
        )
        if self.config.routing.binding != "auto" or one_token:
            return Prompt(
                tokens=None,
                session=session,
                one_token=one_token,
                state_recomputed=recomputed,
            )
        tokens = await self._tokens(ctx)
        if tokens is None:
            self._metrics.error("tokenize_failed")
        return Prompt(tokens=tokens, session=session, state_recomputed=recomputed)

    async def _tokens(self, ctx: FlowContext) -> tuple[int, ...] | None:
        """Counted on a usable instance (decodes first), taking turns."""
        topology = self.config.topology
        candidates = usable((*topology.decodes, *topology.prefills), self._health, ())
        if not candidates:
            return None
        backend = candidates[self._num_tokenizes % len(candidates)]
        self._num_tokenizes += 1
        return await fetch_tokens(
            ctx.session, backend, ctx.parsed, self.config.routing.tokenize_timeout_s
        )
