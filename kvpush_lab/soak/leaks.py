"""Leaked KV blocks, from the Prometheus text of each instance's ``/metrics``.

vLLM exports ``vllm:kv_cache_usage_perc`` (the fraction of the KV blocks in
use, the null block excluded), ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` per engine, and the block count as the
``num_gpu_blocks`` label of ``vllm:cache_config_info`` (the CPU backend
counts its blocks there too). Once every request has ended and the
instance has settled, an instance with no request running or waiting
should hold no block: any block still in use is **leaked**. An instance
that still runs requests nobody waits for holds **stuck** requests. The
router's ``kvpush_router_requests_in_flight`` should be back to 0 too (a
warning only: it is a count, not a resource), and before the soak starts
its ``kvpush_router_instance_healthy`` should be up everywhere.

Pure functions of the metrics text (the families named in
:mod:`kvpush.telemetry.names`, read with its reader); the soak fetches it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from kvpush.telemetry import names
from kvpush.telemetry.reader import Exposition


class KvReading(msgspec.Struct, frozen=True, kw_only=True):
    """One instance's KV cache and queues at one moment. ``num_blocks`` is
    the usable block count (None when the metrics do not say); ``error``
    is set, and the rest meaningless, when ``/metrics`` could not be read."""

    name: str
    role: str
    usage: float = 0.0
    num_blocks: int | None = None
    num_blocks_in_use: int | None = None
    num_running: int = 0
    num_waiting: int = 0
    error: str | None = None

    @property
    def is_idle(self) -> bool:
        return self.error is None and self.num_running + self.num_waiting == 0

    @property
    def is_clean(self) -> bool:
        """Idle, and no block in use."""
        return self.is_idle and self.usage == 0.0 and not self.num_blocks_in_use

    @property
    def num_leaked_blocks(self) -> int:
        """Blocks in use with no request running or waiting (-1: a usage
        above 0 whose block count is unknown)."""
        if not self.is_idle or self.usage == 0.0:
            return 0
        return self.num_blocks_in_use if self.num_blocks_in_use is not None else -1

    @property
    def num_stuck_requests(self) -> int:
        return 0 if self.error is not None else self.num_running + self.num_waiting


def read_kv(name: str, role: str, text: str) -> KvReading:
    """An instance's reading from its metrics text (summed over engines)."""
    try:
        metrics = Exposition.parse(text)
    except ValueError as e:
        return KvReading(name=name, role=role, error=str(e))
    usage = metrics.by_label(names.KV_CACHE_USAGE, "engine")
    if not usage:
        return KvReading(
            name=name, role=role, error=f"no {names.KV_CACHE_USAGE.name} in the metrics"
        )
    blocks = _blocks_by_engine(metrics)
    has_blocks = all(engine in blocks for engine in usage)
    return KvReading(
        name=name,
        role=role,
        usage=max(usage.values()),
        num_blocks=sum(blocks[e] for e in usage) if has_blocks else None,
        num_blocks_in_use=(
            sum(round(u * blocks[e]) for e, u in usage.items()) if has_blocks else None
        ),
        num_running=_engines_sum(metrics, names.NUM_REQUESTS_RUNNING, usage),
        num_waiting=_engines_sum(metrics, names.NUM_REQUESTS_WAITING, usage),
    )


def _blocks_by_engine(metrics: Exposition) -> dict[str, int]:
    """Usable blocks per engine: ``num_gpu_blocks`` less vLLM's null block."""
    out: dict[str, int] = {}
    for sample in metrics.samples(names.CACHE_CONFIG_INFO):
        engine = sample.labels.get("engine", "")
        num_blocks = sample.labels.get("num_gpu_blocks", "")
        if engine and num_blocks.isdigit():
            out[engine] = int(num_blocks) - 1
    return out


def _engines_sum(
    metrics: Exposition, family: names.Family, engines: Iterable[str]
) -> int:
    """``family`` summed over ``engines`` (those that report a KV usage)."""
    per_engine = metrics.by_label(family, "engine")
    return round(sum(per_engine.get(e, 0.0) for e in engines))


def router_in_flight(text: str) -> int | None:
    """The router's in-flight gauge (None when it does not export one;
    ``ValueError`` when the text does not parse)."""
    value = Exposition.parse(text).total(names.ROUTER_REQUESTS_IN_FLIGHT)
    return None if value is None else round(value)


def router_unhealthy(text: str) -> list[str] | None:
    """Instances the router has marked down (None: no health gauge;
    ``ValueError`` when the text does not parse)."""
    samples = Exposition.parse(text).samples(names.ROUTER_INSTANCE_HEALTHY)
    if not samples:
        return None
    return sorted(s.labels.get("instance", "?") for s in samples if s.value != 1.0)


def is_settled(readings: Iterable[KvReading]) -> bool:
    """Every instance idle and clean."""
    return all(r.is_clean for r in readings)


def leak_problems(readings: Sequence[KvReading]) -> list[str]:
    """What is wrong once the soak has drained and settled, one line each."""
    problems = []
    for r in readings:
        if r.error is not None:
            problems.append(f"{r.name}: cannot read its KV usage ({r.error})")
        elif r.num_leaked_blocks:
            count = (
                "an unknown number of"
                if r.num_leaked_blocks < 0
                else str(r.num_leaked_blocks)
            )
            problems.append(
                f"{r.name}: {count} KV blocks leaked ({100 * r.usage:.2f}% in use "
                "with no request running or waiting)"
            )
        elif r.num_stuck_requests:
            problems.append(
                f"{r.name}: {r.num_running} running + {r.num_waiting} waiting "
                "requests stuck after every client request ended"
            )
    return problems


def router_warnings(in_flight: int | None) -> list[str]:
    """What looks wrong in the router's metrics once drained."""
    if not in_flight:
        return []
    return [f"router: its in-flight gauge still counts {in_flight} requests"]
