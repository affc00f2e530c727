"""Live load signals of each instance, as the router last read them.

The scraper (``scraper.py``) fetches every instance's vLLM ``/metrics`` at a
short interval and hands the text to :func:`parse_scrape`; the result goes
on the :class:`SignalBoard` with the time it was read. The planner
(``planner.py``) asks the board for an instance's :class:`InstanceSignals`
and for a prefill-decode pair's :class:`PairFigures`; either is ``None``
when the last good read is older than ``max_age_s``: **a stale signal is
unknown, never idle** (the scoring charges unknown load a fixed penalty).

What is read, from vLLM's own families and kvpush connector's:

- ``vllm:num_requests_waiting``, ``vllm:num_requests_running`` (summed over
  vLLM's engines) and ``vllm:kv_cache_usage_perc`` (the fullest engine);
  for one DP rank of an instance, its engine's alone;
- on a kvpush prefill, per decode peer: ``vllm:kvpush_peer_handover_seconds``
  (from its KV and that decode's registration both there to the WRITE
  done, so a late binding's wait is not counted; the board keeps a moving
  mean of the observations between two reads) and ``vllm:kvpush_peer_bytes_in_flight``
  (WRITE bytes posted to that decode and not done).

The families are named in :mod:`kvpush.telemetry.names` and read with its
reader. Pure: no I/O and no clock (times are passed in); the router's event
loop is its only caller, so it needs no locks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpush.telemetry import names
from kvpush.telemetry.reader import Exposition

HANDOVER_SMOOTHING = 0.5  # weight of the newest window in the moving mean


@dataclass(frozen=True)
class Scrape:
    """What one instance's ``/metrics`` text says (absent families: None/empty).

    ``handover_sum_s`` and ``handover_count`` are the cumulative histogram
    sums and counts per peer engine; ``bytes_in_flight`` the gauge per peer.
    """

    num_waiting: int | None = None
    num_running: int | None = None
    kv_usage: float | None = None
    handover_sum_s: dict[str, float] = field(default_factory=dict)
    handover_count: dict[str, float] = field(default_factory=dict)
    bytes_in_flight: dict[str, float] = field(default_factory=dict)


# The samples parse_scrape reads. The scraper asks ``/metrics`` for these
# alone (prometheus_client's ``?name[]=``, which vLLM's endpoint serves):
# vLLM's whole exposition is hundreds of lines (~70 KB), and rendering it on the
# instance and parsing it on the router's event loop (where every relay
# runs) every second cost both.
SCRAPED_SAMPLES: tuple[str, ...] = (
    names.NUM_REQUESTS_WAITING.sample,
    names.NUM_REQUESTS_RUNNING.sample,
    names.KV_CACHE_USAGE.sample,
    names.KVPUSH_PEER_HANDOVER_SECONDS.sum,
    names.KVPUSH_PEER_HANDOVER_SECONDS.count,
    names.KVPUSH_PEER_BYTES_IN_FLIGHT.sample,
)


def parse_scrape(text: str, engine: int | None = None) -> Scrape:
    """The signals in one ``/metrics`` text (``ValueError`` if it does not
    parse): of every engine, or of vLLM's engine ``engine`` alone (one DP
    rank of an instance: its samples carry ``engine="<rank>"``)."""
    metrics = Exposition.parse(text)
    only = {} if engine is None else {"engine": str(engine)}
    handover = names.KVPUSH_PEER_HANDOVER_SECONDS
    in_flight = names.KVPUSH_PEER_BYTES_IN_FLIGHT
    return Scrape(
        num_waiting=_count(metrics.total(names.NUM_REQUESTS_WAITING, **only)),
        num_running=_count(metrics.total(names.NUM_REQUESTS_RUNNING, **only)),
        kv_usage=metrics.highest(names.KV_CACHE_USAGE, **only),
        handover_sum_s=metrics.by_label(handover.sum, "peer", **only),
        handover_count=metrics.by_label(handover.count, "peer", **only),
        bytes_in_flight=metrics.by_label(in_flight, "peer", **only),
    )


def _count(value: float | None) -> int | None:
    return None if value is None else round(value)


@dataclass(frozen=True)
class InstanceSignals:
    """One instance's load at ``read_at`` (monotonic seconds)."""

    num_waiting: int
    num_running: int
    kv_usage: float | None
    read_at: float


@dataclass(frozen=True)
class PairFigures:
    """A prefill's transfers to one decode, as of the prefill's last read.

    ``handover_s`` is the moving mean of recent handovers (None: none seen
    yet); ``bytes_in_flight`` the WRITE bytes posted and not done.
    """

    handover_s: float | None
    bytes_in_flight: float


@dataclass
class _Handover:
    last_sum_s: float
    last_count: float
    mean_s: float | None = None


class SignalBoard:
    """The latest good read of every instance, each with its time.

    An instance never read, or last read more than ``max_age_s`` ago, has
    no signals (:meth:`signals` returns None): a failed scrape leaves the
    old read to age out rather than replacing it with zeros.
    """

    def __init__(self, max_age_s: float) -> None:
        if not max_age_s > 0:
            raise ValueError(f"max_age_s must be positive, not {max_age_s}")
        self.max_age_s = max_age_s
        self._reads: dict[str, tuple[Scrape, float]] = {}
        self._handovers: dict[tuple[str, str], _Handover] = {}
        # per prefill: the mean of its pairs' handover means (kept at
        # each read, so that scoring a pair stays O(1) however many pairs)
        self._typical: dict[str, float] = {}

    def record(self, engine_id: str, scrape: Scrape, now: float) -> None:
        """A good read of ``engine_id``'s metrics at ``now``."""
        self._reads[engine_id] = (scrape, now)
        for peer, count in scrape.handover_count.items():
            total = scrape.handover_sum_s.get(peer, 0.0)
            self._update_handover((engine_id, peer), total, count)
        if scrape.handover_count:
            self._update_typical(engine_id)

    def forget(self, engine_id: str) -> None:
        """Drop everything known of ``engine_id`` (it went down)."""
        self._reads.pop(engine_id, None)
        for key in [k for k in self._handovers if engine_id in k]:
            del self._handovers[key]
        for prefill_id in list(self._typical):
            self._update_typical(prefill_id)

    def signals(self, engine_id: str, now: float) -> InstanceSignals | None:
        """``engine_id``'s load, or None when unknown (never read, stale, or
        the instance does not export the queue gauges)."""
        scrape = self._fresh(engine_id, now)
        if scrape is None or scrape[0].num_waiting is None:
            return None
        read, read_at = scrape
        return InstanceSignals(
            num_waiting=read.num_waiting or 0,
            num_running=read.num_running or 0,
            kv_usage=read.kv_usage,
            read_at=read_at,
        )

    def pair(self, prefill_id: str, decode_id: str, now: float) -> PairFigures | None:
        """The prefill's figures for transfers to ``decode_id`` (None when the
        prefill's read is stale or it reports nothing for that peer)."""
        scrape = self._fresh(prefill_id, now)
        if scrape is None:
            return None
        read = scrape[0]
        handover = self._handovers.get((prefill_id, decode_id))
        if handover is None and decode_id not in read.bytes_in_flight:
            return None
        return PairFigures(
            handover_s=None if handover is None else handover.mean_s,
            bytes_in_flight=read.bytes_in_flight.get(decode_id, 0.0),
        )

    def typical_handover(self, prefill_id: str, now: float) -> float | None:
        """The mean of the prefill's per-decode handover means: what a pair
        it has not measured yet is taken to cost (None: its read is stale,
        or it has measured none)."""
        if self._fresh(prefill_id, now) is None:
            return None
        return self._typical.get(prefill_id)

    def _update_typical(self, prefill_id: str) -> None:
        means = [
            h.mean_s
            for (p, _), h in self._handovers.items()
            if p == prefill_id and h.mean_s is not None
        ]
        if means:
            self._typical[prefill_id] = sum(means) / len(means)
        else:
            self._typical.pop(prefill_id, None)

    def _fresh(self, engine_id: str, now: float) -> tuple[Scrape, float] | None:
        entry = self._reads.get(engine_id)
        if entry is None or now - entry[1] > self.max_age_s:
            return None
        return entry

    def _update_handover(
        self, key: tuple[str, str], total_s: float, count: float
    ) -> None:
        old = self._handovers.get(key)
        if old is None or count < old.last_count:  # first read, or a restart
            mean = total_s / count if count > 0 else None
            self._handovers[key] = _Handover(total_s, count, mean)
            return
        if count > old.last_count:
            window = (total_s - old.last_sum_s) / (count - old.last_count)
            old.mean_s = (
                window
                if old.mean_s is None
                else HANDOVER_SMOOTHING * window + (1 - HANDOVER_SMOOTHING) * old.mean_s
            )
        old.last_sum_s, old.last_count = total_s, count
