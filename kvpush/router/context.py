"""One client request in flight: what the flows read and what they open.

``app.py`` builds a :class:`FlowContext` per generation request; the flows
(``dispatch.py``), the leg I/O (``legs.py``) and the client side
(``relay.py``) share it. Everything runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from kvpush.router.config import RouterConfig
from kvpush.router.errors import RouterError
from kvpush.router.metrics import RouterMetrics
from kvpush.router.monitor import HealthMonitor
from kvpush.router.planner import Prompt, RoutePlan
from kvpush.router.requests import ParsedRequest
from kvpush.router.retry import Attempts
from kvpush.router.selection import Selector, choose
from kvpush.router.tasks import cancel_all
from kvpush.topology import Backend, Role

ABORT_WAIT_S = 2.0  # how long aborting waits for cancelled leg tasks to unwind


class ClientGone(Exception):
    """The client closed its connection while the router was writing to it."""


class Legs:
    """Owns one attempt's upstream responses and leg tasks.

    Flows register what they open; :meth:`abort` runs when the attempt ends
    (a retry, or the request's end in ``dispatch.serve``): it cancels
    unfinished tasks and closes every response not yet fully read (a fully
    read one went back to the pool already).
    """

    def __init__(self) -> None:
        self._responses: list[aiohttp.ClientResponse] = []
        self._tasks: list[asyncio.Task[Any]] = []

    def track(self, response: aiohttp.ClientResponse) -> None:
        self._responses.append(response)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        return task

    async def abort(self) -> None:
        await cancel_all(self._tasks, ABORT_WAIT_S)
        for task in self._tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: a failure was already reported
        for response in self._responses:
            response.close()


class RoutePlanning(Protocol):
    """kvpush mode's planner as the flows call it: ``routing.Routing``
    (which imports this module, not the reverse)."""

    async def plan(self, ctx: FlowContext) -> RoutePlan: ...
    def bind_late(
        self, ctx: FlowContext, plan: RoutePlan, prefill: Backend
    ) -> RoutePlan: ...
    def unbound(self, ctx: FlowContext, plan: RoutePlan) -> None: ...
    def served(self, plan: RoutePlan) -> None: ...


@dataclass
class FlowContext:
    """One client request in flight: its inputs and what it has opened.

    ``legs`` belongs to the current attempt (a retry replaces it);
    ``attempts`` says which attempt this is and which instances to avoid.
    """

    request: web.Request
    parsed: ParsedRequest
    request_id: str
    session: aiohttp.ClientSession
    config: RouterConfig
    selector: Selector
    metrics: RouterMetrics
    health: HealthMonitor
    started_at: float = field(default_factory=time.monotonic)
    legs: Legs = field(default_factory=Legs)
    attempts: Attempts = field(init=False)
    client_response: web.StreamResponse | None = None
    # The client has its whole answer (the stream's final event is out, or
    # its end is being sent): a hang-up from here is the client's own close.
    is_client_done: bool = False
    sent_tail: bytes = b""  # the end of what the client was sent (for DONE)
    is_ttft_recorded: bool = False
    prefill_answered_at: float | None = None  # monotonic; for the handover metric
    first_byte_at: float | None = None  # decode's first byte/SSE event
    held: list[str] = field(default_factory=list)  # in flight on, per the board
    routing: RoutePlanning | None = None  # kvpush mode's planner
    prompt: Prompt | None = None  # counted once per request (kvpush mode)
    response_headers: dict[str, str] = field(default_factory=dict)  # this attempt's
    # fields both legs of this attempt add (the first token from prefill's)
    leg_fields: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.attempts = Attempts(max_attempts=self.config.max_attempts)

    @property
    def leg_request_id(self) -> str:
        """The X-Request-Id this attempt's legs carry."""
        return self.attempts.leg_request_id(self.request_id)

    @property
    def has_client_started(self) -> bool:
        """Whether the client got anything yet (the status line at least)."""
        return self.client_response is not None

    @property
    def is_client_here(self) -> bool:
        """Whether the client's connection is still open."""
        transport = self.request.transport
        return transport is not None and not transport.is_closing()

    def pick(self, role: Role, candidates: Sequence[Backend]) -> Backend:
        """Choose this attempt's ``role`` backend among usable ``candidates``."""
        backend = choose(
            self.selector,
            role,
            candidates,
            self.parsed,
            self.health.board,
            self.attempts.avoided,
        )
        self.take(backend)
        return backend

    def take(self, backend: Backend) -> None:
        """This attempt uses ``backend`` (chosen by ``pick`` or the planner):
        it counts in flight there until :meth:`release`."""
        self.attempts.picked.append(backend)
        self.health.board.begin(backend.engine_id)
        self.held.append(backend.engine_id)

    def release(self) -> None:
        """This attempt is done with the backends it picked (after its legs
        were aborted): they no longer count it in flight. Idempotent."""
        for engine_id in self.held:
            self.health.board.end(engine_id)
        self.held.clear()

    async def next_attempt(self, err: RouterError) -> None:
        """Abort this attempt's legs; the next one gets fresh legs and avoids
        the instances ``err`` is blamed on."""
        await self.legs.abort()
        self.release()
        self.legs = Legs()
        self.response_headers = {}
        self.leg_fields = {}
        self.attempts.start_next(err)
