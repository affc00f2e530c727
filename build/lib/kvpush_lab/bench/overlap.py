"""How much of a streamed transfer overlapped its prompt's prefill.

From prefill's trace (:mod:`kvpush.connector.trace`), per transfer:
``kv_ready`` is marked once the forward of the prompt's last chunk ended
(per layer too: a chunk pushed layer by layer is posted before its forward
ends, and ``kv_ready`` still waits for that end); every WRITE marks
``write_posted`` with its ``num_bytes``; ``write_done`` is marked only
once, when the *last* WRITE (the one carrying the Done notification)
completed. The earlier WRITEs' completions are not traced, and the marks
carry no per-WRITE id, so which bytes crossed before ``kv_ready`` cannot be
read off the trace. Two bounds can:

- **posted before** (upper bound): the share of the transfer's bytes whose
  WRITE was posted at or before ``kv_ready``; bytes cannot cross before
  they are posted.
- **crossed before, at least** (lower bound, on a shaped link): after
  ``kv_ready`` the link carried the rest within ``write_done − kv_ready``
  (the **tail**), at most at its nominal rate, so at least
  ``total − tail × rate`` bytes had crossed before (tbf's small burst
  aside).

The tail itself is the transfer's exposed part: what the prompt waited for
after its last forward. Pure apart from :func:`read_transfers`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from kvpush_lab.bench.bandwidth import MIB, shaped_mib_s
from kvpush_lab.bench.stats import Dist
from kvpush_lab.bench.trace_files import trace_records

_EVENTS = ("kv_ready", "write_posted", "write_done")


@dataclass
class TransferTrace:
    """One transfer as prefill traced it (epoch seconds; bytes)."""

    transfer_id: str
    kv_ready: float | None = None
    write_done: float | None = None
    writes: list[tuple[float, int]] = field(default_factory=list)  # (posted, bytes)

    @property
    def num_bytes(self) -> int:
        return sum(n for _, n in self.writes)

    @property
    def is_complete(self) -> bool:
        """Ready, written and done: the transfers the statistics use."""
        return bool(
            self.kv_ready is not None and self.write_done is not None and self.num_bytes
        )

    def posted_before(self) -> float:
        """Share of the bytes whose WRITE was posted by ``kv_ready``."""
        ready = self.kv_ready if self.kv_ready is not None else float("inf")
        early = sum(n for t, n in self.writes if t <= ready)
        return early / self.num_bytes

    def tail_s(self) -> float:
        """``write_done − kv_ready``: the transfer's exposed part."""
        return float((self.write_done or 0.0) - (self.kv_ready or 0.0))

    def crossed_before_at_least(self, link_gbit: float) -> float:
        """The lower bound on the share that crossed before ``kv_ready``."""
        after = max(0.0, self.tail_s()) * shaped_mib_s(link_gbit) * MIB
        return max(0.0, 1.0 - after / self.num_bytes)


def collect(lines: Iterable[dict[str, object]]) -> list[TransferTrace]:
    """Transfers from decoded trace lines, in order of first appearance
    (other events and lines without a transfer id are ignored; a repeated
    ``kv_ready`` or ``write_done`` keeps its first time)."""
    found: dict[str, TransferTrace] = {}
    for obj in lines:
        tid, event, t = obj.get("transfer_id"), obj.get("event"), obj.get("t")
        if not isinstance(tid, str) or not isinstance(t, int | float):
            continue
        transfer = found.setdefault(tid, TransferTrace(tid))
        num_bytes = obj.get("num_bytes")
        if event == "write_posted" and isinstance(num_bytes, int):
            transfer.writes.append((float(t), num_bytes))
        elif event == "kv_ready" and transfer.kv_ready is None:
            transfer.kv_ready = float(t)
        elif event == "write_done" and transfer.write_done is None:
            transfer.write_done = float(t)
    return [t for t in found.values() if t.writes or t.kv_ready is not None]


def read_transfers(run_dir: Path) -> list[TransferTrace]:
    """Every transfer traced under ``run_dir/traces``."""
    return collect(list(trace_records(run_dir, _EVENTS)))


def in_window(
    transfers: Sequence[TransferTrace], window: tuple[float, float]
) -> list[TransferTrace]:
    """The complete transfers whose ``kv_ready`` falls in a point's window."""
    start, end = window
    return [
        t for t in transfers if t.is_complete and start <= (t.kv_ready or 0.0) <= end
    ]


class OverlapStats(msgspec.Struct, frozen=True, kw_only=True):
    """One point's transfers of one kvpush configuration: medians over
    transfers (shares in [0, 1], the tail in ms)."""

    num_transfers: int
    mib_per_transfer: float
    writes_per_transfer: float
    posted_before: Dist
    tail_ms: Dist
    crossed_before_at_least: Dist | None = None  # shaped links only


def summarize(
    transfers: Sequence[TransferTrace], link_gbit: float | None
) -> OverlapStats | None:
    """Statistics of a point's complete transfers (None when it has none)."""
    done = [t for t in transfers if t.is_complete]
    if not done:
        return None
    posted = Dist.of(t.posted_before() for t in done)
    tail = Dist.of(1000 * t.tail_s() for t in done)
    sizes = Dist.of(t.num_bytes / MIB for t in done)
    writes = Dist.of(len(t.writes) for t in done)
    if posted is None or tail is None or sizes is None or writes is None:
        return None
    crossed = (
        None
        if link_gbit is None
        else Dist.of(t.crossed_before_at_least(link_gbit) for t in done)
    )
    return OverlapStats(
        num_transfers=len(done),
        mib_per_transfer=sizes.p50,
        writes_per_transfer=writes.p50,
        posted_before=posted,
        tail_ms=tail,
        crossed_before_at_least=crossed,
    )
