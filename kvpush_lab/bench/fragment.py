"""The fragmented workload's figures: descriptors per KV transfer, post
time, and the decoding of the requests running on decode meanwhile.

Descriptors per transfer come from two sources:

- **vLLM's NIXL connectors** record each transfer's descriptor count and
  post time in NIXL's telemetry and publish them as histograms
  (``vllm:nixl_num_descriptors``, ``vllm:nixl_post_time_seconds``) on the
  ``/metrics`` of the instance that posts: decode for ``vllm-pull``'s
  READ, prefill for ``vllm-push``'s WRITE. Read before and after a point,
  their difference gives the point's mean exactly and its median and
  maximum to a bucket.
- **kvpush** traces every WRITE (``write_posted`` with ``num_descs``: one
  per run of blocks contiguous on both sides, per layer); a transfer's
  descriptors are the sum over its WRITEs (several where it streams per
  chunk or layer), and a transfer belongs to the point during whose window
  its first WRITE was posted. kvpush's post runs on prefill's writer
  thread and is not timed per WRITE.

On this machine UCX copies over ``cma`` within the post, so vLLM's post
time holds the copy of the KV itself (in decode's loop for ``vllm-pull``).

*Meanwhile*: the plain requests decoding on decode during a point (the
background load), timed on their tokens that arrived within the point's
window: per request (2+ such tokens) the mean gap, the TPOT of the request
while the point ran; and every gap, the ITL, where a stall of decode's loop
shows. Pure apart from :func:`read_traced_writes`.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import msgspec

from kvpush_lab.bench.bandwidth import Histogram, NixlTransfers
from kvpush_lab.bench.records import ABORTED, RequestRecord
from kvpush_lab.bench.stats import Dist
from kvpush_lab.bench.trace_files import trace_records


class TransferDescs(msgspec.Struct, frozen=True, kw_only=True):
    """One point's KV transfers of one configuration: descriptors each
    (mean exact; p50 exact from traces, a bucket range from telemetry; max
    exact, or a bucket's upper bound, None when in the last, unbounded one)."""

    source: str  # "NIXL telemetry" or "kvpush trace"
    num_transfers: int
    descs_mean: float
    descs_p50: float | None = None
    descs_p50_range: tuple[float, float] | None = None
    descs_max: float | None = None
    post_mean_ms: float | None = None  # telemetry only
    writes_per_transfer: float | None = None  # traces only


class Meanwhile(msgspec.Struct, frozen=True, kw_only=True):
    """The background requests' decoding within a point's window."""

    num_requests: int  # with 2+ tokens in the window
    tpot_ms: Dist | None
    itl_ms: Dist | None


class FragmentPoint(msgspec.Struct, frozen=True, kw_only=True):
    transfers: TransferDescs | None = None
    meanwhile: Meanwhile | None = None


class ChurnResult(msgspec.Struct, frozen=True, kw_only=True):
    """What the churn's requests did: completed, aborted by the client as
    planned, or failed otherwise."""

    num_requests: int
    num_completed: int
    num_aborted: int
    num_failed: int
    duration_s: float
    errors: dict[str, int] = msgspec.field(default_factory=dict)


def churn_result(records: Sequence[RequestRecord]) -> ChurnResult:
    aborted = sum(r.error == ABORTED for r in records)
    completed = sum(r.is_ok for r in records)
    start = min((r.sent_wall for r in records), default=0.0)
    end = max((r.sent_wall + (r.end_s or 0.0) for r in records), default=0.0)
    return ChurnResult(
        num_requests=len(records),
        num_completed=completed,
        num_aborted=aborted,
        num_failed=len(records) - completed - aborted,
        duration_s=max(0.0, end - start),
        errors=dict(
            Counter(r.error for r in records if r.error not in (None, ABORTED))
        ),
    )


def from_telemetry(delta: NixlTransfers) -> TransferDescs | None:
    """A point's transfers from the difference of vLLM's histograms (None
    when none was posted)."""
    descs = delta.num_descs
    if descs.count <= 0:
        return None
    post = delta.post_seconds
    return TransferDescs(
        source="NIXL telemetry",
        num_transfers=round(descs.count),
        descs_mean=descs.total / descs.count,
        descs_p50_range=descs.median_bucket(),
        descs_max=top_bucket(descs),
        post_mean_ms=1000 * post.total / post.count if post.count > 0 else None,
    )


def top_bucket(h: Histogram) -> float | None:
    """The upper bound of the highest bucket that holds an observation
    (None: only the unbounded one does)."""
    for le in sorted(h.buckets):
        if h.buckets[le] >= h.count:
            return None if math.isinf(le) else le
    return None


class TracedWrite(NamedTuple):
    """One of kvpush's WRITEs, from prefill's trace."""

    transfer_id: str
    posted_at: float  # epoch seconds
    num_descs: int


def from_traces(
    writes: Iterable[TracedWrite], window: tuple[float, float]
) -> TransferDescs | None:
    """The transfers whose first WRITE was posted within ``window``."""
    by_transfer: dict[str, list[TracedWrite]] = {}
    for w in sorted(writes, key=lambda w: w.posted_at):
        by_transfer.setdefault(w.transfer_id, []).append(w)
    start, end = window
    mine = [ws for ws in by_transfer.values() if start <= ws[0].posted_at <= end]
    if not mine:
        return None
    descs = Dist.of(sum(w.num_descs for w in ws) for ws in mine)
    assert descs is not None
    return TransferDescs(
        source="kvpush trace",
        num_transfers=len(mine),
        descs_mean=descs.mean,
        descs_p50=descs.p50,
        descs_max=descs.max,
        writes_per_transfer=math.fsum(len(ws) for ws in mine) / len(mine),
    )


def read_traced_writes(run_dir: Path) -> list[TracedWrite]:
    """Every WRITE traced under ``run_dir/traces``."""
    return [
        TracedWrite(obj["transfer_id"], float(obj["t"]), int(obj["num_descs"]))
        for obj in trace_records(run_dir, ("write_posted",))
    ]


def meanwhile(
    records: Sequence[RequestRecord], window: tuple[float, float]
) -> Meanwhile | None:
    """How the requests decoding during ``window`` fared (None: none had
    two tokens in it)."""
    start, end = window
    tpots, gaps = [], []
    for rec in records:
        times = [
            rec.sent_wall + t
            for t in rec.token_times_s
            if start <= rec.sent_wall + t <= end
        ]
        if len(times) < 2:
            continue
        tpots.append(1000 * (times[-1] - times[0]) / (len(times) - 1))
        gaps += [1000 * (b - a) for a, b in itertools.pairwise(times)]
    if not tpots:
        return None
    return Meanwhile(
        num_requests=len(tpots), tpot_ms=Dist.of(tpots), itl_ms=Dist.of(gaps)
    )


def fragment_point(
    nixl: tuple[NixlTransfers | None, NixlTransfers | None],
    kvpush_writes: Sequence[TracedWrite],
    background: Sequence[RequestRecord] | None,
    window: tuple[float, float],
) -> FragmentPoint:
    """One point's figures: descriptors from vLLM's telemetry where both
    readings (before, after) are there, else from kvpush's traced WRITEs;
    the background's decoding within ``window``."""
    before, after = nixl
    if before is not None and after is not None:
        transfers = from_telemetry(after.minus(before))
    else:
        transfers = from_traces(kvpush_writes, window)
    return FragmentPoint(
        transfers=transfers,
        meanwhile=meanwhile(background, window) if background is not None else None,
    )
