"""The router's admin endpoints: drain an instance for a rolling restart.

Served by the router itself, on its own address (127.0.0.1 by default):

* ``POST /admin/drain/{name}``: the router sends ``name`` (an engine id) no
  new request; requests already in flight on it finish.
* ``POST /admin/undrain/{name}``: it gets new requests again.
* ``GET /admin/instances``: each instance's role, URL, ranks (its TP size;
  its DP rank when it is one engine of a data-parallel instance), health,
  whether it is drained and how many requests are in flight on it.

Drained instances are left out of selection by the :class:`HealthBoard`
(``health.py``), the one owner of routing state; ``kvpush drain`` calls these
endpoints and can wait until a drained instance has nothing in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from kvpush.router.errors import RouterError
from kvpush.router.health import HealthBoard
from kvpush.topology import Backend

logger = logging.getLogger(__name__)

BoardOf = Callable[[web.Request], HealthBoard]


def add_admin_routes(app: web.Application, board_of: BoardOf) -> None:
    """Serve the admin endpoints on ``app``; ``board_of`` finds its board."""

    async def drain(request: web.Request) -> web.Response:
        return _set_drained(board_of(request), request, True)

    async def undrain(request: web.Request) -> web.Response:
        return _set_drained(board_of(request), request, False)

    async def instances(request: web.Request) -> web.Response:
        board = board_of(request)
        return web.json_response(
            {"instances": [instance_report(board, b) for b in board.backends]}
        )

    app.router.add_post("/admin/drain/{name}", drain)
    app.router.add_post("/admin/undrain/{name}", undrain)
    app.router.add_get("/admin/instances", instances)


def instance_report(board: HealthBoard, backend: Backend) -> dict[str, Any]:
    """One instance as ``GET /admin/instances`` shows it."""
    return {
        "engine_id": backend.engine_id,
        "role": backend.role,
        "url": backend.url,
        "tp_size": backend.tp_size,
        "dp_rank": backend.dp_rank,
        "healthy": board.is_healthy(backend.engine_id),
        "drained": board.is_drained(backend.engine_id),
        "in_flight": board.num_in_flight(backend.engine_id),
    }


def _set_drained(
    board: HealthBoard, request: web.Request, is_drained: bool
) -> web.Response:
    name = request.match_info["name"]
    try:
        board.set_drained(name, is_drained)
    except KeyError:
        known = ", ".join(b.engine_id for b in board.backends)
        raise RouterError.openai(
            404,
            f"no instance {name!r} in the topology; known: {known}",
            "not_found_error",
            "unknown_instance",
        ) from None
    logger.warning("instance %s %s", name, "drained" if is_drained else "undrained")
    backend = next(b for b in board.backends if b.engine_id == name)
    return web.json_response(instance_report(board, backend))
