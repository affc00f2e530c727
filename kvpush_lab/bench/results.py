"""A published section's results as data: ``docs/bench/<section>/results.json``.

Every run that publishes (``kvpush bench --publish``, the soak's
``--publish``, ``kvpush bench-micro --publish``) writes one
:class:`SectionResults`; :mod:`kvpush_lab.bench.render` reads all of them
and writes ``BENCHMARKS.md`` and each section's ``README.md``. Nothing here
judges a figure: targets live in the docs (``docs/performance.md``).

The layers, from the headline down:

* ``measurements``: each configuration's client-side figures at each point
  of each round, in the columns ``vllm bench serve`` reports;
* ``ratios``: a configuration's figure over a reference configuration's,
  taken within each round and summarised over the rounds as median
  [min–max] (:class:`kvpush_lab.bench.rounds.Spread`), with ``side`` -1/1
  where every round lay below/above 1;
* ``tables``: what a section measures beyond that (handover phases, bytes
  over the links, bindings, ...), as titled tables of display strings;
* ``run``: a ``kvpush bench`` run's whole typed summary (``summary.json``),
  from which its detailed report is rendered. Absent on migrated sections.

Pure: no clock; only :func:`save_results` and :func:`load_results` touch files.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import msgspec

from kvpush_lab.bench.rounds import Spread
from kvpush_lab.bench.summary import BenchSummary

RESULTS_FILE = "results.json"
RESULTS_SCHEMA = 1
Kind = Literal["bench", "soak", "micro", "notes"]
_SECTION_NAME = re.compile(r"^[a-z][a-z0-9-]*$")


def check_section_name(name: str) -> str:
    """``name`` if it can name a section (its folder under docs/bench),
    else ValueError."""
    if not _SECTION_NAME.match(name):
        raise ValueError(
            f"section name {name!r} must be lowercase letters, - or digits"
        )
    return name


class Setup(msgspec.Struct, frozen=True, kw_only=True):
    """Where and on what a section ran, as the report states it."""

    machine: str | None = None
    versions: str | None = None
    model: str | None = None
    clusters: str | None = None
    endpoint: str | None = None  # a --base-url run: what served the requests
    workload: str | None = None
    hosts: str | None = None


class Metrics(msgspec.Struct, frozen=True, kw_only=True):
    """One configuration at one point of one round, client-side (ms, and
    requests or output tokens per second). None: not measured or not kept."""

    num_requests: int | None = None
    num_ok: int | None = None
    errors: dict[str, int] | None = None  # kind -> count
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    ttft_p99_ms: float | None = None
    ttft_mean_ms: float | None = None
    ttst_p50_ms: float | None = None  # time to the second token
    ttst_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    e2e_p50_ms: float | None = None
    e2e_p99_ms: float | None = None
    request_throughput: float | None = None
    output_throughput: float | None = None


class Measurement(msgspec.Struct, frozen=True, kw_only=True):
    """``round``: 1.. in a repeated run, None in a single one."""

    round: int | None
    point: str
    config: str
    metrics: Metrics


class Ratio(msgspec.Struct, frozen=True, kw_only=True):
    """``config``'s ``figure`` over ``reference``'s at ``point``, over the
    rounds. ``side``: -1 (1) where every round was below (above) 1, else 0."""

    point: str
    config: str
    figure: str  # "TTFT p50", "TPOT p99", "overhead", "goodput", ...
    reference: str
    spread: Spread
    side: int = 0


class Table(msgspec.Struct, frozen=True, kw_only=True):
    """A section-specific table; cells as the report wrote them."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    note: str | None = None  # what the table shows, before it
    after: str | None = None  # remarks on it, after it


class Plot(msgspec.Struct, frozen=True, kw_only=True):
    file: str  # in the section's folder
    caption: str


class SectionResults(msgspec.Struct, frozen=True, kw_only=True):
    """One published section. ``source`` says how the data came to be (a
    run, or migrated from an older report); ``started_at`` and ``command``
    are as the run (or the migrated report) gave them."""

    schema: int = RESULTS_SCHEMA
    section: str
    title: str
    kind: Kind
    source: str
    command: str | None = None
    started_at: str | None = None
    duration_min: float | None = None
    commit: str | None = None
    setup: Setup = msgspec.field(default_factory=Setup)
    configs: list[str] = msgspec.field(default_factory=list)
    points: list[str] = msgspec.field(default_factory=list)
    num_rounds: int = 1
    measurements: list[Measurement] = msgspec.field(default_factory=list)
    ratios: list[Ratio] = msgspec.field(default_factory=list)
    tables: list[Table] = msgspec.field(default_factory=list)
    plots: list[Plot] = msgspec.field(default_factory=list)
    notes: list[str] = msgspec.field(default_factory=list)
    run: BenchSummary | None = None

    def measured(self, point: str, config: str) -> list[Metrics]:
        """``config``'s metrics at ``point``, one per round."""
        return [
            m.metrics
            for m in self.measurements
            if m.point == point and m.config == config
        ]

    def ratio(
        self, point: str, config: str, figure: str, reference: str
    ) -> Ratio | None:
        return next(
            (
                r
                for r in self.ratios
                if (r.point, r.config, r.figure, r.reference)
                == (point, config, figure, reference)
            ),
            None,
        )


def side_of(spread: Spread) -> int:
    """-1 / 1 when every round lies below / above 1, else 0."""
    return spread.side_of(1.0)


def encode_results(results: SectionResults) -> bytes:
    return msgspec.json.format(msgspec.json.encode(results)) + b"\n"


def decode_results(data: bytes, where: str = "results") -> SectionResults:
    try:
        return msgspec.json.decode(data, type=SectionResults)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"{where} is unreadable: {e}") from e


def save_results(results: SectionResults, folder: Path) -> Path:
    """Write ``folder/results.json`` (atomically)."""
    check_section_name(results.section)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RESULTS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(encode_results(results))
    tmp.replace(path)
    return path


def load_results(folder: Path) -> SectionResults:
    path = folder / RESULTS_FILE
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"no results at {path}: {e}") from e
    return decode_results(data, str(path))
