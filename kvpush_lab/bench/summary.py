"""The run's summary: typed structs saved as ``summary.json``.

The report and the plots are rendered from this file (plus the raw
``requests.jsonl``), so ``kvpush bench --render DIR`` can redo them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

from kvpush_lab.bench.bandwidth import BandwidthStats
from kvpush_lab.bench.bindings import BindingMix
from kvpush_lab.bench.fragment import ChurnResult, FragmentPoint
from kvpush_lab.bench.goodput import Goodput
from kvpush_lab.bench.kv_bytes import KvBytes
from kvpush_lab.bench.links import LinkUsage
from kvpush_lab.bench.overlap import OverlapStats
from kvpush_lab.bench.resources import InstanceUsage, WindowLoad
from kvpush_lab.bench.router_legs import RouterLegs
from kvpush_lab.bench.stats import Dist, PointStats
from kvpush_lab.bench.timeline import HandoverStats
from kvpush_lab.bench.writes import DescriptorStats

SUMMARY_FILE = "summary.json"
SUMMARY_VERSION = 1
Status = Literal["ok", "skipped", "failed"]


class PointResult(msgspec.Struct, frozen=True, kw_only=True):
    point: int
    stats: PointStats
    handover: HandoverStats | None = None
    usage: list[InstanceUsage] = msgspec.field(default_factory=list)
    load: WindowLoad | None = None
    links: LinkUsage | None = None  # --hosts netns: bytes over the links
    bandwidth: BandwidthStats | None = None  # per KV transfer
    kv_bytes: KvBytes | None = None  # KV moved per request, against decode's need
    bindings: BindingMix | None = None  # by the router's response headers
    overlap: OverlapStats | None = None  # kvpush: transfer vs. last forward
    router: RouterLegs | None = None  # the router's legs (P/D modes)
    fragment: FragmentPoint | None = None  # the fragmented workload's
    goodput: Goodput | None = None  # the saturation workload's


class BackgroundResult(msgspec.Struct, frozen=True, kw_only=True):
    """The skewed workload's background requests that ended during the
    measured run, on instance ``target``."""

    target: str
    num_requests: int
    num_ok: int
    tpot_ms: Dist | None = None


class WarmupResult(msgspec.Struct, frozen=True, kw_only=True):
    num_requests: int
    num_ok: int
    latencies_ms: list[float]


class ConfigResult(msgspec.Struct, frozen=True, kw_only=True):
    """One configuration's run: ``status`` ok, skipped (unavailable or
    refused before anything started) or failed (with ``reason``);
    ``link_gbit``: the rehearsal links' rate it ran at (None: unshaped, or
    not a rehearsal); ``round``: its round of a repeated run (None: not
    repeated)."""

    name: str
    status: Status
    link_gbit: float | None = None
    reason: str | None = None
    points: list[PointResult] = msgspec.field(default_factory=list)
    usage: list[InstanceUsage] = msgspec.field(default_factory=list)
    warmup: WarmupResult | None = None
    load: WindowLoad | None = None
    run_dir: str | None = None
    has_timelines: bool = False
    descriptors: DescriptorStats | None = None  # kvpush: WRITE sizes
    # kvpush_router_binding_total's gain over the measured run (binding/reason)
    binding_counts: dict[str, int] | None = None
    background: BackgroundResult | None = None  # the skewed workload's
    shared_cluster: bool = False  # ran on a kvpush cluster others shared
    round: int | None = None  # of a repeated run (--repeat)
    churn: ChurnResult | None = None  # the fragmented workload's

    def point(self, index: int) -> PointResult | None:
        return next((p for p in self.points if p.point == index), None)

    @property
    def label(self) -> str:
        """The name, with the link rate and the round where there are."""
        label = (
            self.name
            if self.link_gbit is None
            else f"{self.name} @{rate(self.link_gbit)}"
        )
        return label if self.round is None else f"{label}, round {self.round}"


def rate(link_gbit: float | None) -> str:
    """A link rate as the report writes it."""
    return "unshaped" if link_gbit is None else f"{link_gbit:g} Gbit/s"


class PointInfo(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    label: str
    axis: str
    x: float
    arrival: str
    load: float
    prompt_len: str
    num_requests: int


class BenchSummary(msgspec.Struct, kw_only=True):
    version: int = SUMMARY_VERSION
    command: str
    started_at: str
    finished_at: str = ""
    duration_s: float = 0.0
    machine: dict[str, Any] = msgspec.field(default_factory=dict)
    versions: dict[str, str] = msgspec.field(default_factory=dict)
    settings: dict[str, Any] = msgspec.field(default_factory=dict)
    points: list[PointInfo] = msgspec.field(default_factory=list)
    configs: list[ConfigResult] = msgspec.field(default_factory=list)

    def config(self, name: str) -> ConfigResult | None:
        return next((c for c in self.configs if c.name == name), None)

    def stats(self, name: str, point: int) -> PointStats | None:
        """One configuration's statistics at one point (None if not run)."""
        config = self.config(name)
        result = config.point(point) if config else None
        return result.stats if result else None

    @property
    def axis(self) -> str:
        return self.points[0].axis if self.points else "qps"

    @property
    def link_rates(self) -> list[float | None]:
        """The link rate of each set of clusters, in run order."""
        rates: list[float | None] = []
        for c in self.configs:
            if c.link_gbit not in rates:
                rates.append(c.link_gbit)
        return rates

    @property
    def is_rehearsal(self) -> bool:
        """Whether the clusters ran on rehearsal hosts (--hosts netns)."""
        return self.settings.get("hosts") == "netns"

    def at_link(self, link_gbit: float | None) -> BenchSummary:
        """This summary with only the configurations run at one link rate."""
        return msgspec.structs.replace(
            self, configs=[c for c in self.configs if c.link_gbit == link_gbit]
        )

    @property
    def rounds(self) -> list[int | None]:
        """The rounds that ran, in order (``[None]``: not repeated)."""
        return list(dict.fromkeys(c.round for c in self.configs)) or [None]

    @property
    def is_repeated(self) -> bool:
        """Whether the run had rounds (``--repeat`` 2 or more)."""
        return any(c.round is not None for c in self.configs)

    def in_round(self, round_: int | None) -> BenchSummary:
        """This summary with only the configurations run in one round."""
        return msgspec.structs.replace(
            self, configs=[c for c in self.configs if c.round == round_]
        )


def save_summary(summary: BenchSummary, out_dir: Path) -> Path:
    path = out_dir / SUMMARY_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(summary)))
    tmp.replace(path)
    return path


def load_summary(out_dir: Path) -> BenchSummary:
    path = out_dir / SUMMARY_FILE
    try:
        return msgspec.json.decode(path.read_bytes(), type=BenchSummary)
    except OSError as e:
        raise ValueError(f"no benchmark summary at {path}: {e}") from e
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"benchmark summary {path} is unreadable: {e}") from e
