"""Run a benchmark: every configuration in turn on the same workload.

For each configuration: start its cluster with the launcher, warm it up
(the first requests pay the transport handshake; they are kept out of the
results), run every sweep point while sampling each instance's CPU and
memory, read any server timelines, stop the cluster. A configuration that
cannot start is recorded as skipped (refused, e.g. not available yet) or
failed (it crashed or never became ready) and the run goes on.

On the multi-host rehearsal (``hosts="netns"``) every link rate gets its
own set of clusters, one per configuration, and each point is also
bracketed by readings of every host's link counters (:mod:`links`) and,
for vLLM's NIXL connectors, of their transfer histograms on ``/metrics``
(:mod:`bandwidth`); kvpush's WRITEs are timed from its traces.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec
from rich.console import Console
from rich.progress import Progress

from kvpush.connector.config import DEFAULT_PUSH_GRANULARITY
from kvpush.launcher import ClusterConfig
from kvpush.launcher.platform import Platform, resolve_platform
from kvpush.launcher.state import RunState
from kvpush.model.kv_size import kv_bytes_per_token
from kvpush_lab.bench import background, client, conversation, loadgen, rounds, scenario
from kvpush_lab.bench.bandwidth import (
    TRANSFER_KIND,
    BandwidthStats,
    from_nixl,
    from_samples,
    in_window,
)
from kvpush_lab.bench.bindings import Counts, count_delta
from kvpush_lab.bench.churn import CHURN_FILE
from kvpush_lab.bench.clusters import Clusters, Run, share_runs
from kvpush_lab.bench.config import BenchConfig
from kvpush_lab.bench.fragment import (
    FragmentPoint,
    churn_result,
    fragment_point,
)
from kvpush_lab.bench.goodput import Goodput, Slo, goodput
from kvpush_lab.bench.inputs import (
    describe_model,
    load_traces,
    normal_token_ids,
    resolve_model,
)
from kvpush_lab.bench.kv_bytes import KvBytes, kv_bytes
from kvpush_lab.bench.links import LinkUsage, link_usage
from kvpush_lab.bench.meters import Meters, read_meters
from kvpush_lab.bench.names import (
    cluster_of,
    first_token_of,
    granularity_of,
    recomputes_first_token,
)
from kvpush_lab.bench.overlap import in_window as transfers_in_window
from kvpush_lab.bench.overlap import summarize as summarize_overlap
from kvpush_lab.bench.progress import advance, make_progress
from kvpush_lab.bench.records import (
    REQUESTS_FILE,
    RequestRecord,
    wall_window,
    write_records,
)
from kvpush_lab.bench.resources import Mark, ResourceMonitor, machine_info, versions
from kvpush_lab.bench.stats import summarize_point
from kvpush_lab.bench.summary import (
    SUMMARY_FILE,
    BenchSummary,
    ConfigResult,
    PointInfo,
    PointResult,
    WarmupResult,
    save_summary,
)
from kvpush_lab.bench.timeline import summarize_handover
from kvpush_lab.bench.traced import Traced, descriptor_stats, read_traced
from kvpush_lab.bench.workload import (
    PointWorkload,
    build_point,
    build_warmup,
    check_fits,
    sweep_points,
)
from kvpush_lab.bench.workloads import BACKGROUND_WORKLOADS


@dataclass(frozen=True)
class Plan:
    """Everything decided before the first cluster starts."""

    config: BenchConfig
    model: Path
    out_dir: Path
    points: tuple[PointWorkload, ...]
    warmup: PointWorkload
    runs: tuple[Run, ...]
    kv_bytes_per_token: int | None = None  # rehearsals: for the link tables
    requests: dict[str, scenario.Requests] | None = None  # per config, if salted
    vocab: tuple[int, ...] = ()  # the background load draws from it
    platform: Platform = Platform.CPU  # what the clusters run on, resolved

    @property
    def dtype(self) -> str:
        """The instances' dtype: the config's, else the platform's default."""
        return self.config.dtype or self.platform.default_dtype

    def requests_of(self, name: str) -> scenario.Requests:
        """Configuration ``name``'s requests."""
        if self.requests is None:
            return scenario.Requests(self.points)
        return self.requests[name]


def default_output_dir() -> Path:
    return Path("bench-results") / dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def prepare(config: BenchConfig, console: Console) -> Plan:
    """Check and build everything (model, workload, cluster configs); raise
    ValueError before anything starts if something is wrong."""
    out_dir = config.output_dir or default_output_dir()
    for name in (SUMMARY_FILE, REQUESTS_FILE):
        if (out_dir / name).exists():
            raise ValueError(f"{out_dir} already holds results; choose a new --output")
    model = resolve_model(config, console)
    vocab = normal_token_ids(model)
    traces = load_traces(config)
    if config.workload == "multi-turn":
        points: tuple[PointWorkload, ...] = conversation.turn_points(config)
        warmup = conversation.build_warmup(config, vocab)
    else:
        points = tuple(
            build_point(config, p, vocab, traces) for p in sweep_points(config)
        )
        warmup = build_warmup(config, points, vocab)
    salted = {
        name: scenario.plan_requests(config, name, vocab, traces)
        for name in config.configs
    }
    churns = [r.churn for r in salted.values() if r.churn is not None]
    check_fits(
        [*points, warmup, *(w for r in salted.values() for w in r.points), *churns],
        config.max_model_len,
    )
    platform = resolve_platform(config.platform)
    runs = plan_runs(config, model, out_dir, platform)
    dtype = config.dtype or platform.default_dtype
    if config.hosts == "netns" and dtype == "auto":
        raise ValueError(
            "--hosts netns counts the KV bytes on its links: give --dtype "
            "(float32, bfloat16 or float16), not auto"
        )
    per_token = kv_bytes_per_token(model, dtype) if config.hosts == "netns" else None
    out_dir.mkdir(parents=True, exist_ok=True)
    return Plan(
        config, model, out_dir, points, warmup, runs, per_token, salted,
        tuple(vocab), platform,
    )  # fmt: skip


def plan_runs(
    config: BenchConfig, model: Path, out_dir: Path, platform: Platform | None = None
) -> tuple[Run, ...]:
    """Every cluster of the run, in order (:func:`rounds.round_order`): per
    round every link rate and configuration, a repeated run's clusters under
    ``clusters/round-<k>/``, a fresh set each round; on ``platform`` (None:
    the config's, resolved)."""
    platform = platform or resolve_platform(config.platform)
    pairs = [(rate, name) for rate in config.link_rates for name in config.configs]
    runs = [
        Run(
            name,
            rate,
            cluster_config(
                config,
                name,
                model,
                _run_dir(_round_dir(out_dir, r), name, rate),
                rate,
                platform,
            ),
            round=r,
        )
        for r, (rate, name) in rounds.round_order(pairs, config.repeat)
    ]
    if not config.shares_kvpush_cluster:
        return tuple(runs)
    shared: list[Run] = []
    for r in rounds.rounds_of(config.repeat):
        of_round = [run for run in runs if run.round == r]
        shared += share_runs(of_round, _round_dir(out_dir, r) / "kvpush-shared")
    return tuple(shared)


def _round_dir(out_dir: Path, round_: int | None) -> Path:
    return out_dir / "clusters" / ("" if round_ is None else f"round-{round_}")


def _run_dir(base: Path, name: str, link_gbit: float | None) -> Path:
    folder = name if link_gbit is None else f"{name}-{link_gbit:g}gbit"
    return base / folder


def cluster_config(
    config: BenchConfig,
    name: str,
    model: Path,
    run_dir: Path,
    link_gbit: float | None = None,
    platform: Platform | None = None,
) -> ClusterConfig:
    """The cluster of configuration ``name`` (at ``link_gbit`` on a
    rehearsal): its mode, for ``kvpush-<binding>`` its router's binding, for
    ``kvpush.<granularity>`` prefill's push granularity; every P/D mode
    runs the same prefill and decode TP, so the baselines stay comparable.
    On ``platform`` (None: the config's, resolved) with its dtype unless the
    config gives one; the KV space is given on CPU only."""
    platform = platform or resolve_platform(config.platform)
    mode, binding = cluster_of(name)
    is_pd = mode != "colocated"
    granularity = granularity_of(name) or DEFAULT_PUSH_GRANULARITY
    return ClusterConfig(
        mode=mode,
        binding=binding,
        first_token_from=first_token_of(name),
        num_prefill=config.num_prefill if is_pd else 0,
        num_decode=config.num_decode if is_pd else 0,
        model=model,
        port=config.port,
        base_http_port=config.base_http_port,
        base_side_channel_port=config.base_side_channel_port,
        run_dir=run_dir,
        dtype=config.dtype or platform.default_dtype,
        max_model_len=config.max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_space_gb=(
            config.kv_cache_space_gb if platform == Platform.CPU else None
        ),
        platform=platform,
        gpu_memory_utilization=config.gpu_memory_utilization,
        startup_timeout_s=config.startup_timeout_s,
        extra_vllm_args=(
            *block_size_args(config.block_size),
            *(vllm_scheduler_args(platform) if recomputes_first_token(name) else ()),
        ),
        hosts=config.hosts,
        link_gbit=link_gbit,
        push_granularity=granularity,
        prefill_tp=config.prefill_tp if is_pd else 1,
        decode_tp=config.decode_tp if is_pd else 1,
        colocated_tp=1 if is_pd else config.colocated_tp,
        prefill_dp=config.prefill_dp if is_pd else 1,
        decode_dp=config.decode_dp if is_pd else 1,
    )


def vllm_scheduler_args(platform: Platform) -> tuple[str, ...]:
    """vLLM's own scheduler class, as vLLM picks it on ``platform`` (the
    launcher then gives decode no class of kvpush's)."""
    if platform == Platform.CPU:
        return ("--scheduler-cls", "vllm.v1.core.sched.scheduler.Scheduler")
    return ("--scheduler-cls", "vllm.v1.core.sched.async_scheduler.AsyncScheduler")


def block_size_args(block_size: int | None) -> tuple[str, ...]:
    """vLLM's arguments for a block size (none: vLLM's default)."""
    return () if block_size is None else ("--block-size", str(block_size))


def run_bench(plan: Plan, console: Console, command: str) -> BenchSummary:
    """Run every configuration of ``plan``; saves summary.json as it goes."""
    started = time.monotonic()
    summary = BenchSummary(
        command=command,
        started_at=dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        machine=machine_info(),
        versions=versions(),
        settings={
            **plan.config.to_dict(),
            "platform": plan.platform.value,
            "dtype": plan.dtype,
            "model_path": str(plan.model),
            "model_description": describe_model(plan.model),
        },
        points=[point_info(w) for w in plan.points],
    )
    for r in dict.fromkeys(run.round for run in plan.runs):
        of_round = [run for run in plan.runs if run.round == r]
        clusters = Clusters(of_round)  # a round's shared cluster ends with it
        try:
            for run in of_round:
                summary.configs.append(run_config(plan, run, clusters, console))
                summary.duration_s = time.monotonic() - started
                save_summary(summary, plan.out_dir)
        finally:
            clusters.close()
    summary.finished_at = dt.datetime.now().astimezone().isoformat(timespec="seconds")
    save_summary(summary, plan.out_dir)
    return summary


def point_info(workload: PointWorkload) -> PointInfo:
    p = workload.point
    return PointInfo(
        index=p.index, label=p.label, axis=p.axis, x=p.x, arrival=p.arrival,
        load=p.load, prompt_len=p.prompt_len.describe(),
        num_requests=workload.num_requests,
    )  # fmt: skip


def run_config(
    plan: Plan, run: Run, clusters: Clusters, console: Console
) -> ConfigResult:
    """Start, warm up, measure and stop one configuration's cluster."""
    result = _run_config(plan, run, clusters, console)
    return msgspec.structs.replace(result, round=run.round)


def _run_config(
    plan: Plan, run: Run, clusters: Clusters, console: Console
) -> ConfigResult:
    name, label = run.name, _label(run)
    console.rule(f"[bold]{label}")
    try:
        state = clusters.start(run, console)
    except ValueError as e:
        console.print(f"[bold yellow]skipping {label}:[/] {e}")
        return ConfigResult(
            name=name, link_gbit=run.link_gbit, status="skipped", reason=str(e)
        )
    except Exception as e:  # LaunchError or anything else while starting
        console.print(f"[bold red]{label} failed to start:[/] {e}")
        return _failed(run, e)
    monitor = ResourceMonitor(state.processes)
    monitor.start()
    try:
        measured = asyncio.run(_measure(plan, run, state, monitor, console))
    except RuntimeError as e:
        console.print(f"[bold red]{label} failed:[/] {e}")
        return _failed(run, e)
    finally:
        monitor.close()
        with console.status(f"stopping {label}"):
            clusters.stop(run)
    if run.is_shared:  # its traces mix every run on the cluster: left out
        return _result(plan, run, state, measured, monitor, Traced())
    # Timelines are read once the cluster has stopped: a server may flush
    # them on the way out.
    traced = read_traced(run.run_dir, run.name, console)
    result = _result(plan, run, state, measured, monitor, traced)
    writes = descriptor_stats(run.run_dir, Path(state.model), console)
    return msgspec.structs.replace(result, descriptors=writes)


def _label(run: Run) -> str:
    label = (
        run.name if run.link_gbit is None else f"{run.name} @{run.link_gbit:g} Gbit/s"
    )
    return label if run.round is None else f"{label}, round {run.round}"


# Takes a resource mark and meter readings; returns the mark's index.
Checkpoint = Callable[[], Awaitable[int]]


@dataclass(frozen=True)
class Outcome:
    """The measured requests: per point, with the mark its window starts at
    (None: the i-th, or the last window there is), and the churn's."""

    records: list[list[RequestRecord]]
    starts: list[int] | None = None
    churn: list[RequestRecord] = dataclasses.field(default_factory=list)

    def start(self, point: int, num_marks: int) -> int:
        """The mark point ``point``'s window starts at."""
        return self.starts[point] if self.starts else min(point, num_marks - 2)


@dataclass(frozen=True)
class Measured:
    """What one configuration's run produced, before any statistics."""

    warmup: WarmupResult
    outcome: Outcome
    marks: list[Mark]  # before the first point and after each (and the churn)
    meters: Meters
    binding_counts: Counts | None = None  # the router's, over the whole run
    background: background.Driven | None = None  # skewed, fragmented

    @property
    def records(self) -> list[list[RequestRecord]]:
        return self.outcome.records


def _failed(run: Run, error: BaseException) -> ConfigResult:
    return ConfigResult(
        name=run.name,
        link_gbit=run.link_gbit,
        status="failed",
        reason=str(error).splitlines()[0] if str(error) else type(error).__name__,
        run_dir=str(run.run_dir),
    )


async def _measure(
    plan: Plan, run: Run, state: RunState, monitor: ResourceMonitor, console: Console
) -> Measured:
    meters = Meters()
    async with client.make_session() as session:
        warmup = await _warm_up(plan, run, state, session, console)
        marks: list[Mark] = []

        async def checkpoint() -> int:
            marks.append(monitor.mark())
            await read_meters(meters, state, session)
            return len(marks) - 1

        async with _background(plan, run, state, session) as driven:
            before = await scenario.read_binding_counts(session, state.router_url)
            await checkpoint()
            with make_progress(console) as progress:
                measure = _converse if plan.config.workload == "multi-turn" else _sweep
                outcome = await measure(plan, run, state, session, progress, checkpoint)
            after = await scenario.read_binding_counts(session, state.router_url)
    for records in outcome.records:
        _write(plan.out_dir / REQUESTS_FILE, run, records)
    if outcome.churn:
        _write(plan.out_dir / CHURN_FILE, run, outcome.churn)
    if driven is not None:
        _write(plan.out_dir / background.BACKGROUND_FILE, run, driven.records)
    counts = None if before is None or after is None else count_delta(before, after)
    return Measured(warmup, outcome, marks, meters, counts, driven)


def _write(path: Path, run: Run, records: list[RequestRecord]) -> None:
    for record in records:
        record.link_gbit, record.round = run.link_gbit, run.round
    write_records(path, records)


async def _sweep(
    plan: Plan,
    run: Run,
    state: RunState,
    session: aiohttp.ClientSession,
    progress: Progress,
    checkpoint: Checkpoint,
) -> Outcome:
    """Every point in turn, a checkpoint after each; the fragmented
    workload's churn (and a checkpoint) before its second point."""
    requests = plan.requests_of(run.name)
    records: list[list[RequestRecord]] = []
    starts, churn, mark = [], [], 0  # mark 0: taken before the first point
    for i, workload in enumerate(requests.points):
        if i == 1 and requests.churn is not None:
            churn = await _run(
                plan, run, state, session, progress, requests.churn, capped=False
            )
            mark = await checkpoint()
        records.append(await _run(plan, run, state, session, progress, workload))
        starts.append(mark)
        mark = await checkpoint()
    return Outcome(records, starts, churn)


async def _run(
    plan: Plan,
    run: Run,
    state: RunState,
    session: aiohttp.ClientSession,
    progress: Progress,
    workload: PointWorkload,
    capped: bool = True,
) -> list[RequestRecord]:
    """One point's requests (or the churn's), with a progress bar; at most
    ``max_concurrency`` of them in flight where ``capped`` (not the churn:
    churn_concurrency bounds it)."""
    task = progress.add_task(
        f"{_label(run)} {workload.point.label}",
        total=len(workload.requests),
        errors=0,
    )
    cap = plan.config.max_concurrency if capped else None
    return await loadgen.run_point(
        session, state.router_url, workload, run.name,
        plan.config.request_timeout_s, advance(progress, task), cap,
    )  # fmt: skip


async def _converse(
    plan: Plan,
    run: Run,
    state: RunState,
    session: aiohttp.ClientSession,
    progress: Progress,
    checkpoint: Checkpoint,
) -> Outcome:
    """Every conversation, then one checkpoint: its first turns and later
    turns overlap in time and share one window."""
    config, conversations = plan.config, plan.requests_of(run.name).conversations
    task = progress.add_task(
        f"{_label(run)} {len(conversations)} conversations",
        total=sum(c.num_turns for c in conversations),
        errors=0,
    )
    measured = await loadgen.run_conversations(
        session, state.router_url, conversations, config.conversation_concurrency,
        run.name, config.request_timeout_s, advance(progress, task),
    )  # fmt: skip
    await checkpoint()
    return Outcome(measured)


@contextlib.asynccontextmanager
async def _background(
    plan: Plan, run: Run, state: RunState, session: aiohttp.ClientSession
) -> AsyncIterator[background.Driven | None]:
    """The background load of the skewed and fragmented workloads around
    the block (None, and nothing sent, for the other workloads)."""
    if plan.config.workload not in BACKGROUND_WORKLOADS:
        yield None
        return
    load = background.BackgroundLoad.of(
        plan.config, scenario.salt_of(plan.config, run.name)
    )
    instance = background.target(load, state.processes)
    async with background.running(
        session, load, instance, plan.vocab, run.name, plan.config.request_timeout_s
    ) as driven:
        await asyncio.sleep(background.SETTLE_S)
        yield driven


async def _warm_up(
    plan: Plan,
    run: Run,
    state: RunState,
    session: aiohttp.ClientSession,
    console: Console,
) -> WarmupResult:
    with console.status(f"{_label(run)}: {len(plan.warmup.requests)} warm-up requests"):
        records = await loadgen.run_point(
            session,
            state.router_url,
            plan.warmup,
            run.name,
            plan.config.request_timeout_s,
            lambda _r: None,
        )
    ok = [r for r in records if r.is_ok]
    latencies = [round(1000 * (r.end_s or 0.0), 1) for r in records]
    console.print(f"  warm-up: {len(ok)}/{len(records)} ok, ms {latencies}")
    if not ok:
        first = records[0]
        raise RuntimeError(
            f"every warm-up request failed (first: {first.error} "
            f"{first.error_detail}); see the logs in {run.run_dir}"
        )
    return WarmupResult(
        num_requests=len(records), num_ok=len(ok), latencies_ms=latencies
    )


def _result(
    plan: Plan,
    run: Run,
    state: RunState,
    measured: Measured,
    monitor: ResourceMonitor,
    traced: Traced,
) -> ConfigResult:
    marks = measured.marks
    points = []
    for i, (workload, records) in enumerate(
        zip(plan.points, measured.records, strict=True)
    ):
        w = measured.outcome.start(i, len(marks))  # window: marks[w] to [w + 1]
        points.append(PointResult(
            point=workload.point.index,
            stats=summarize_point(records),
            handover=summarize_handover(
                traced.timelines, [r.bench_id for r in records], wall_window(records)
            ),
            usage=monitor.usage(marks[w], marks[w + 1]),
            load=monitor.load(marks[w], marks[w + 1]),
            links=_links(plan, state, measured.meters, w, records),
            bandwidth=_bandwidth(run, state, measured.meters, w, records, traced),
            kv_bytes=_kv_bytes(plan, measured.meters, w, records),
            bindings=scenario.point_bindings(records),
            overlap=summarize_overlap(
                transfers_in_window(traced.transfers, wall_window(records)),
                run.link_gbit,
            ),
            router=measured.meters.legs(w),
            fragment=_fragment(plan, measured, traced, w, wall_window(records)),
            goodput=_goodput(plan.config, records),
        ))  # fmt: skip
    return ConfigResult(
        name=run.name,
        link_gbit=run.link_gbit,
        status="ok",
        points=points,
        usage=monitor.usage(marks[0], marks[-1]),
        load=monitor.load(marks[0], marks[-1]),
        warmup=measured.warmup,
        run_dir=str(run.run_dir),
        has_timelines=bool(traced.timelines),
        binding_counts=measured.binding_counts,
        background=scenario.background_result(measured.background),
        shared_cluster=run.is_shared,
        churn=churn_result(measured.outcome.churn) if measured.outcome.churn else None,
    )


def _kv_bytes(
    plan: Plan, meters: Meters, i: int, records: list[RequestRecord]
) -> KvBytes | None:
    """The KV bytes moved per answered request in the window from reading
    ``i``, and decode's need (None off P/D, or without readings)."""
    before, after = meters.kv_moved[i], meters.kv_moved[i + 1]
    if before is None or after is None:
        return None
    return kv_bytes(
        after - before,
        [r.prompt_tokens or r.prompt_len for r in records if r.is_ok],
        plan.model,
        plan.dtype,
        meters.block_size[i],
        plan.config.decode_tp,
    )


def _goodput(config: BenchConfig, records: list[RequestRecord]) -> Goodput | None:
    """The saturation workload's goodput at the configured SLO."""
    if config.workload != "saturation":
        return None
    slo = Slo(config.slo_ttft_ms, config.slo_tpot_ms)
    return goodput(records, slo, summarize_point(records).duration_s)


def _fragment(
    plan: Plan, measured: Measured, traced: Traced, w: int, window: tuple[float, float]
) -> FragmentPoint | None:
    """The fragmented workload's figures of the window from mark ``w``."""
    if plan.config.workload != "fragmented":
        return None
    nixl = measured.meters.nixl[w], measured.meters.nixl[w + 1]
    driven = measured.background
    started = driven.started if driven is not None else None
    return fragment_point(nixl, traced.kvpush_writes, started, window)


def _links(
    plan: Plan,
    state: RunState,
    meters: Meters,
    i: int,
    records: list[RequestRecord],
) -> LinkUsage | None:
    """The link bytes of the window from reading ``i`` (None off the
    rehearsal)."""
    before, after = meters.links[i], meters.links[i + 1]
    if before is None or after is None or plan.kv_bytes_per_token is None:
        return None
    roles = {p.name: p.role for p in state.processes}
    return link_usage(
        before, after, roles, [r.prompt_len for r in records], plan.kv_bytes_per_token
    )


def _bandwidth(
    run: Run,
    state: RunState,
    meters: Meters,
    i: int,
    records: list[RequestRecord],
    traced: Traced,
) -> BandwidthStats | None:
    """Point ``i``'s KV transfers: kvpush's from its traces, vLLM's from the
    NIXL histograms (None for colocated, or without readings)."""
    if state.mode not in TRANSFER_KIND:
        return None
    kind, source = TRANSFER_KIND[state.mode]
    if source == "kvpush trace":
        window = in_window(traced.writes, wall_window(records))
        return from_samples(window, kind, run.link_gbit)
    before, after = meters.nixl[i], meters.nixl[i + 1]
    if before is None or after is None:
        return None
    return from_nixl(after.minus(before), kind, run.link_gbit)
