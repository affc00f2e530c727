"""Achieved bandwidth per KV transfer, against the links' shaped rate.

Two sources, one per kind of configuration:

- **kvpush** traces every WRITE (:mod:`kvpush_lab.bench.timeline`):
  ``write_posted`` (marked once the post returned, with the WRITE's
  ``num_bytes``) and ``write_done`` (marked when prefill's writer, polling
  every 0.5 ms, finds it complete). With push granularity ``request`` (the
  default) a transfer is one WRITE, so its two marks time that WRITE on the
  wire; the post itself (descriptor build and ``transfer()``, ~1 ms here)
  is left out, it is the "write setup" phase. A streamed transfer (several
  WRITEs, ``write_done`` only on the last) cannot be split per WRITE from
  the trace and is left out.
- **vLLM's NIXL connectors** (the ``vllm-pull`` READ, the ``vllm-push``
  WRITE) have NIXL time every transfer (``capture_telemetry``: from the
  post to the poll that saw it complete) and publish the durations and
  sizes as Prometheus histograms on each instance's ``/metrics``:
  ``vllm:nixl_xfer_time_seconds`` and ``vllm:nixl_bytes_transferred``. The
  benchmark reads them before and after each point; the difference gives
  the point's transfers exactly in count, total bytes and total seconds
  (so their mean bandwidth), and per transfer only to the histogram's
  buckets (so the median is a range).

Bandwidth on the small transfers of the tiny model (2 MiB for 1000 tokens)
says nothing about the link: tbf lets a burst through at once. Only
transfers of :data:`MIN_MEASURED_BYTES` (32 MiB) or more are measured.
The shaped rate is the link's nominal rate in MiB/s (G x 10^9 / 8 / 2^20);
tbf delivers about 95% of it (frame overhead). Pure apart from
:func:`read_write_samples`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal, NamedTuple

import msgspec

from kvpush.telemetry import names
from kvpush.telemetry.names import Family
from kvpush.telemetry.reader import Exposition
from kvpush_lab.bench.stats import Dist
from kvpush_lab.bench.trace_files import trace_records

MIB = 2**20
MIN_MEASURED_BYTES = 32 * MIB
Source = Literal["kvpush trace", "NIXL telemetry"]
# What each configuration's transfer is, and where its timing comes from.
TRANSFER_KIND: dict[str, tuple[str, Source]] = {
    "kvpush": ("WRITE", "kvpush trace"),
    "vllm-push": ("WRITE", "NIXL telemetry"),
    "vllm-pull": ("READ", "NIXL telemetry"),
}


def shaped_mib_s(link_gbit: float) -> float:
    """A link's nominal rate in MiB/s."""
    return link_gbit * 1e9 / 8 / MIB


class TransferSample(NamedTuple):
    """One transfer: its size, its time on the wire, when it was posted
    (epoch seconds)."""

    num_bytes: int
    seconds: float
    posted_at: float


def write_samples(lines: Iterable[dict[str, object]]) -> list[TransferSample]:
    """kvpush's WRITEs from decoded trace lines: each transfer's
    ``write_posted`` (time, bytes) paired with its ``write_done``; WRITEs
    that never completed (``write_ended``) and transfers of several WRITEs
    are left out."""
    posted: dict[str, tuple[float, int]] = {}
    done: dict[str, float] = {}
    several: set[str] = set()
    for obj in lines:
        tid, event, t = obj.get("transfer_id"), obj.get("event"), obj.get("t")
        if not isinstance(tid, str) or not isinstance(t, int | float):
            continue
        num_bytes = obj.get("num_bytes")
        if event == "write_posted" and isinstance(num_bytes, int):
            if tid in posted:
                several.add(tid)
            posted[tid] = (float(t), num_bytes)
        elif event == "write_done":
            done[tid] = float(t)
    samples = [
        TransferSample(num_bytes, done[tid] - at, at)
        for tid, (at, num_bytes) in posted.items()
        if tid in done and done[tid] >= at and tid not in several
    ]
    return sorted(samples, key=lambda s: s.posted_at)


def read_write_samples(run_dir: Path) -> list[TransferSample]:
    """Every completed WRITE traced under ``run_dir/traces``."""
    return write_samples(list(trace_records(run_dir, ("write_posted", "write_done"))))


def in_window(
    samples: Sequence[TransferSample], window: tuple[float, float]
) -> list[TransferSample]:
    """The samples posted within a point's wall-clock window."""
    start, end = window
    return [s for s in samples if start <= s.posted_at <= end]


class BandwidthStats(msgspec.Struct, frozen=True, kw_only=True):
    """One point's transfers of one configuration (``kind`` WRITE or READ,
    timed by ``source``): how many, how large, how fast in MiB/s.

    ``mib_s`` is the per-transfer distribution (traces only);
    ``mib_s_p50_range`` bounds the median from histogram buckets
    (telemetry only); ``mean_mib_s`` is total bytes over total seconds of
    the measured transfers (either source)."""

    kind: str
    source: Source
    num_transfers: int
    num_measured: int  # of at least MIN_MEASURED_BYTES
    mib_per_transfer: float  # p50 (traces) or mean (telemetry), all transfers
    mean_mib_s: float | None = None
    mib_s: Dist | None = None
    mib_s_p50_range: tuple[float, float | None] | None = None  # None: unbounded
    link_gbit: float | None = None

    @property
    def typical_mib_s(self) -> float | None:
        """The median where known, else the mean."""
        return self.mib_s.p50 if self.mib_s is not None else self.mean_mib_s

    @property
    def of_shaped(self) -> float | None:
        """:attr:`typical_mib_s` as a fraction of the shaped rate."""
        typical = self.typical_mib_s
        if typical is None or self.link_gbit is None:
            return None
        return typical / shaped_mib_s(self.link_gbit)


def from_samples(
    samples: Sequence[TransferSample], kind: str, link_gbit: float | None
) -> BandwidthStats | None:
    """Per-transfer statistics of traced transfers (None for none)."""
    if not samples:
        return None
    big = [s for s in samples if s.num_bytes >= MIN_MEASURED_BYTES and s.seconds > 0]
    sizes = Dist.of(s.num_bytes / MIB for s in samples)
    assert sizes is not None
    return BandwidthStats(
        kind=kind,
        source="kvpush trace",
        num_transfers=len(samples),
        num_measured=len(big),
        mib_per_transfer=sizes.p50,
        mean_mib_s=(
            sum(s.num_bytes for s in big) / MIB / sum(s.seconds for s in big)
            if big
            else None
        ),
        mib_s=Dist.of(s.num_bytes / MIB / s.seconds for s in big),
        link_gbit=link_gbit,
    )


class Histogram(msgspec.Struct, frozen=True, kw_only=True):
    """A Prometheus histogram summed over its label sets: cumulative
    ``buckets`` (upper bound -> count), ``count`` and ``total``."""

    buckets: dict[float, float]
    count: float
    total: float

    def minus(self, earlier: Histogram) -> Histogram:
        """What was observed since ``earlier``."""
        return Histogram(
            buckets={
                le: n - earlier.buckets.get(le, 0.0) for le, n in self.buckets.items()
            },
            count=self.count - earlier.count,
            total=self.total - earlier.total,
        )

    def plus(self, other: Histogram) -> Histogram:
        les = set(self.buckets) | set(other.buckets)
        return Histogram(
            buckets={
                le: self.buckets.get(le, 0.0) + other.buckets.get(le, 0.0) for le in les
            },
            count=self.count + other.count,
            total=self.total + other.total,
        )

    def at_most(self, bound: float) -> float:
        """Observations of at most ``bound`` (a bucket bound)."""
        return self.buckets.get(bound, 0.0)

    def median_bucket(self) -> tuple[float, float] | None:
        """The bucket holding the median: (lower, upper] bound."""
        if self.count <= 0:
            return None
        lower = 0.0
        for le in sorted(self.buckets):
            if self.buckets[le] >= self.count / 2:
                return lower, le
            lower = le
        return None


EMPTY = Histogram(buckets={}, count=0.0, total=0.0)


class NixlTransfers(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's NIXL transfer histograms of one or more instances: time on
    the wire, bytes, descriptors and post time per transfer."""

    seconds: Histogram = EMPTY
    num_bytes: Histogram = EMPTY
    num_descs: Histogram = EMPTY
    post_seconds: Histogram = EMPTY

    def minus(self, earlier: NixlTransfers) -> NixlTransfers:
        return NixlTransfers(
            seconds=self.seconds.minus(earlier.seconds),
            num_bytes=self.num_bytes.minus(earlier.num_bytes),
            num_descs=self.num_descs.minus(earlier.num_descs),
            post_seconds=self.post_seconds.minus(earlier.post_seconds),
        )

    def plus(self, other: NixlTransfers) -> NixlTransfers:
        return NixlTransfers(
            seconds=self.seconds.plus(other.seconds),
            num_bytes=self.num_bytes.plus(other.num_bytes),
            num_descs=self.num_descs.plus(other.num_descs),
            post_seconds=self.post_seconds.plus(other.post_seconds),
        )


def parse_nixl_transfers(text: str) -> NixlTransfers:
    """The NIXL transfer histograms of one ``/metrics`` text (empty where an
    instance exports none, as kvpush's and colocated ones; ``ValueError``
    when the text does not parse)."""
    metrics = Exposition.parse(text)
    return NixlTransfers(
        seconds=_histogram(metrics, names.NIXL_XFER_TIME),
        num_bytes=_histogram(metrics, names.NIXL_BYTES_TRANSFERRED),
        num_descs=_histogram(metrics, names.NIXL_NUM_DESCRIPTORS),
        post_seconds=_histogram(metrics, names.NIXL_POST_TIME),
    )


def _histogram(metrics: Exposition, family: Family) -> Histogram:
    """``family`` summed over the engines."""
    return Histogram(
        buckets=metrics.buckets(family),
        count=metrics.total(family.count) or 0.0,
        total=metrics.total(family.sum) or 0.0,
    )


def from_nixl(
    transfers: NixlTransfers, kind: str, link_gbit: float | None
) -> BandwidthStats | None:
    """A point's transfers from the difference of vLLM's histograms (None
    when there were none). The median's range assumes the point's
    transfers are of one size (fixed prompt lengths), as its mean size."""
    seconds, sizes = transfers.seconds, transfers.num_bytes
    num = round(seconds.count)
    if num <= 0 or sizes.count <= 0:
        return None
    mean_bytes = sizes.total / sizes.count
    small = sizes.at_most(float(MIN_MEASURED_BYTES))  # a bucket bound: 2^25
    num_measured = round(sizes.count - small)
    everything_measured = num_measured == num and seconds.total > 0
    median = seconds.median_bucket() if everything_measured else None
    return BandwidthStats(
        kind=kind,
        source="NIXL telemetry",
        num_transfers=num,
        num_measured=num_measured,
        mib_per_transfer=mean_bytes / MIB,
        mean_mib_s=sizes.total / MIB / seconds.total if everything_measured else None,
        mib_s_p50_range=_rate_range(mean_bytes, median) if median else None,
        link_gbit=link_gbit,
    )


def _rate_range(
    num_bytes: float, seconds: tuple[float, float]
) -> tuple[float, float | None]:
    """MiB/s bounds of a transfer of ``num_bytes`` taking (lower, upper]
    seconds: (slowest, fastest), fastest None when unbounded."""
    low_s, high_s = seconds
    fastest = num_bytes / MIB / low_s if low_s > 0 else None
    slowest = num_bytes / MIB / high_s if math.isfinite(high_s) else 0.0
    return slowest, fastest
