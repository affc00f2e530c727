"""Readings taken around every point of a configuration's run.

Right before the first point and after each one the runner reads: the
rehearsal hosts' link counters (:mod:`links`), vLLM's NIXL transfer
histograms summed over the instances' ``/metrics`` (:mod:`bandwidth`; the
baselines only), the KV bytes the P/D connector moved and the KV block
size (:mod:`kv_bytes`), and the router's leg totals (:mod:`router_legs`). A
reading that fails is None; the window it bounds then has no figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp

from kvpush.launcher.netns import LinkBytes, NetnsError
from kvpush.launcher.state import RunState
from kvpush_lab.bench.bandwidth import (
    TRANSFER_KIND,
    NixlTransfers,
    parse_nixl_transfers,
)
from kvpush_lab.bench.kv_bytes import BYTES_FAMILY, block_size, bytes_moved
from kvpush_lab.bench.links import read_links
from kvpush_lab.bench.router_legs import (
    LegTotals,
    RouterLegs,
    parse_leg_totals,
    router_legs,
)

READ_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Meters:
    """Readings taken right before the first point and after each one."""

    links: list[dict[str, LinkBytes] | None] = field(default_factory=list)
    nixl: list[NixlTransfers | None] = field(default_factory=list)
    kv_moved: list[float | None] = field(default_factory=list)  # bytes, all instances
    block_size: list[int | None] = field(default_factory=list)
    router: list[LegTotals | None] = field(default_factory=list)

    def legs(self, start: int) -> RouterLegs | None:
        """The router's legs in the window from reading ``start`` to the next."""
        return router_legs(self.router[start], self.router[start + 1])


async def read_meters(
    meters: Meters, state: RunState, session: aiohttp.ClientSession
) -> None:
    """Append one reading of each meter the configuration has."""
    links = None
    if state.network is not None:
        try:
            links = read_links(state.network)
        except NetnsError:
            links = None
    meters.links.append(links)
    urls = [p.url for p in state.processes if p.role != "router"]
    wants_nixl = TRANSFER_KIND.get(state.mode, ("", ""))[1] == "NIXL telemetry"
    meters.nixl.append(await read_nixl(session, urls) if wants_nixl else None)
    moved, block = await read_kv_moved(session, urls, state.mode)
    meters.kv_moved.append(moved)
    meters.block_size.append(block)
    text = await _get_text(session, f"{state.router_url}/metrics")
    try:
        meters.router.append(None if text is None else parse_leg_totals(text))
    except ValueError:  # not metrics text: no reading
        meters.router.append(None)


async def read_nixl(
    session: aiohttp.ClientSession, urls: list[str]
) -> NixlTransfers | None:
    """The NIXL transfer histograms summed over the instances' /metrics."""
    total = NixlTransfers()
    for url in urls:
        text = await _get_text(session, f"{url}/metrics")
        if text is None:
            return None
        try:
            total = total.plus(parse_nixl_transfers(text))
        except ValueError:  # not metrics text: no reading
            return None
    return total


async def read_kv_moved(
    session: aiohttp.ClientSession, urls: list[str], mode: str
) -> tuple[float | None, int | None]:
    """The KV bytes ``mode``'s connector moved, summed over the instances'
    /metrics, and the first instance's block size (None where not known)."""
    if mode not in BYTES_FAMILY:
        return None, None
    total, block = 0.0, None
    for url in urls:
        text = await _get_text(session, f"{url}/metrics")
        if text is None:
            return None, None
        try:
            total += bytes_moved(text, mode) or 0.0
            block = block if block is not None else block_size(text)
        except ValueError:  # not metrics text: no reading
            return None, None
    return total, block


async def _get_text(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        timeout = aiohttp.ClientTimeout(total=READ_TIMEOUT_S)
        async with session.get(url, timeout=timeout) as resp:
            resp.raise_for_status()
            return await resp.text()
    except (TimeoutError, aiohttp.ClientError):
        return None
