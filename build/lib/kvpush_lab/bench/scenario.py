"""What the skewed, multi-turn and fragmented workloads add to a run,
beside the sweep.

- Each configuration's own draw of requests (:func:`plan_requests`): where
  the kvpush configurations share one cluster, every configuration's token
  ids are drawn with its name as salt (same lengths, arrivals and turns),
  so no run hits the prefix cache an earlier one filled; for the
  fragmented workload also its churn (:mod:`kvpush_lab.bench.churn`).
- The router's binding counter, read around the measured run
  (:func:`read_binding_counts`), and the header mix of each point.
- The background load's outcome (:func:`background_result`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from kvpush_lab.bench import conversation
from kvpush_lab.bench.background import Driven
from kvpush_lab.bench.bindings import BindingMix, Counts, header_mix, parse_counts
from kvpush_lab.bench.churn import Churn, churn_workload
from kvpush_lab.bench.config import BenchConfig
from kvpush_lab.bench.conversation import Conversation
from kvpush_lab.bench.records import RequestRecord
from kvpush_lab.bench.stats import Dist, tpot_s
from kvpush_lab.bench.summary import BackgroundResult
from kvpush_lab.bench.workload import PointWorkload, Traces, build_point, sweep_points


@dataclass(frozen=True)
class Requests:
    """One configuration's requests: its points' workloads, and for the
    multi-turn workload its conversations."""

    points: tuple[PointWorkload, ...]
    conversations: tuple[Conversation, ...] = ()
    churn: PointWorkload | None = None  # the fragmented workload's


def salt_of(config: BenchConfig, name: str) -> str:
    """The salt of configuration ``name``'s token draws ('' = the shared
    draw every configuration gets on clusters of its own)."""
    return name if config.shares_kvpush_cluster else ""


def plan_requests(
    config: BenchConfig, name: str, vocab: Sequence[int], traces: Traces
) -> Requests:
    """Configuration ``name``'s requests (see :func:`salt_of`)."""
    salt = salt_of(config, name)
    if config.workload == "multi-turn":
        return Requests(
            conversation.turn_points(config),
            conversation.build_conversations(config, vocab, salt),
        )
    points = tuple(
        build_point(config, p, vocab, traces, salt) for p in sweep_points(config)
    )
    if config.workload == "fragmented":
        return Requests(points, churn=churn_workload(Churn.of(config), vocab, salt))
    return Requests(points)


async def read_binding_counts(
    session: aiohttp.ClientSession, router_url: str
) -> Counts | None:
    """The router's binding counter now (None when it cannot be read)."""
    try:
        timeout = aiohttp.ClientTimeout(total=10.0)
        async with session.get(f"{router_url}/metrics", timeout=timeout) as resp:
            resp.raise_for_status()
            return parse_counts(await resp.text())
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None


def point_bindings(records: Sequence[RequestRecord]) -> BindingMix | None:
    """The header mix of one point (None where no request had the headers:
    not kvpush's router)."""
    mix = header_mix((r.binding, r.decode) for r in records)
    return None if mix.is_empty else mix


def background_result(driven: Driven | None) -> BackgroundResult | None:
    if driven is None:
        return None
    return BackgroundResult(
        target=driven.target,
        num_requests=len(driven.records),
        num_ok=driven.num_ok,
        tpot_ms=Dist.of(1000 * t for t in map(tpot_s, driven.records) if t is not None),
    )
