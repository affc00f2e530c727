"""Run a benchmark: every configuration in turn on the same workload.

For each configuration: start its cluster with the launcher, warm it up
(the first requests pay the transport handshake; they are kept out of the
results), run every sweep point while sampling each instance's CPU and
memory, read any server timelines, stop the cluster. A configuration that
cannot start is recorded as skipped (refused, e.g. not available yet) or
failed (it crashed or never became ready) and the run goes on.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from kvpush.bench import client, loadgen
from kvpush.bench.config import BenchConfig
from kvpush.bench.inputs import (
    describe_model,
    load_traces,
    normal_token_ids,
    resolve_model,
)
from kvpush.bench.records import (
    REQUESTS_FILE,
    RequestRecord,
    wall_window,
    write_records,
)
from kvpush.bench.resources import Mark, ResourceMonitor, machine_info, versions
from kvpush.bench.stats import summarize_point
from kvpush.bench.summary import (
    SUMMARY_FILE,
    BenchSummary,
    ConfigResult,
    PointInfo,
    PointResult,
    WarmupResult,
    save_summary,
)
from kvpush.bench.timeline import TimelineSet, read_timelines, summarize_handover
from kvpush.bench.workload import (
    PointWorkload,
    build_point,
    build_warmup,
    check_fits,
    sweep_points,
)
from kvpush.bench.writes import DescriptorStats, read_write_sizes, summarize_writes
from kvpush.launcher import ClusterConfig, down, up
from kvpush.launcher.state import RunState


@dataclass(frozen=True)
class Plan:
    """Everything decided before the first cluster starts."""

    config: BenchConfig
    model: Path
    out_dir: Path
    points: tuple[PointWorkload, ...]
    warmup: PointWorkload
    clusters: dict[str, ClusterConfig]


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
    points = tuple(build_point(config, p, vocab, traces) for p in sweep_points(config))
    warmup = build_warmup(config, points, vocab)
    check_fits([*points, warmup], config.max_model_len)
    clusters = {
        name: cluster_config(config, name, model, out_dir / "clusters" / name)
        for name in config.configs
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    return Plan(config, model, out_dir, points, warmup, clusters)


def cluster_config(
    config: BenchConfig, mode: str, model: Path, run_dir: Path
) -> ClusterConfig:
    is_pd = mode != "colocated"
    return ClusterConfig(
        mode=mode,
        num_prefill=config.num_prefill if is_pd else 0,
        num_decode=config.num_decode if is_pd else 0,
        model=model,
        port=config.port,
        base_http_port=config.base_http_port,
        base_side_channel_port=config.base_side_channel_port,
        run_dir=run_dir,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_space_gb=config.kv_cache_space_gb,
        startup_timeout_s=config.startup_timeout_s,
    )


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
            "model_path": str(plan.model),
            "model_description": describe_model(plan.model),
        },
        points=[point_info(w) for w in plan.points],
    )
    for name in plan.config.configs:
        summary.configs.append(run_config(plan, name, console))
        summary.duration_s = time.monotonic() - started
        save_summary(summary, plan.out_dir)
    summary.finished_at = dt.datetime.now().astimezone().isoformat(timespec="seconds")
    save_summary(summary, plan.out_dir)
    return summary


def point_info(workload: PointWorkload) -> PointInfo:
    p = workload.point
    return PointInfo(
        index=p.index, label=p.label, axis=p.axis, x=p.x, arrival=p.arrival,
        load=p.load, prompt_len=p.prompt_len.describe(),
        num_requests=len(workload.requests),
    )  # fmt: skip


def run_config(plan: Plan, name: str, console: Console) -> ConfigResult:
    """Start, warm up, measure and stop one configuration."""
    console.rule(f"[bold]{name}")
    cluster = plan.clusters[name]
    try:
        state = up(cluster, console)
    except ValueError as e:
        console.print(f"[bold yellow]skipping {name}:[/] {e}")
        return ConfigResult(name=name, status="skipped", reason=str(e))
    except Exception as e:  # LaunchError or anything else while starting
        console.print(f"[bold red]{name} failed to start:[/] {e}")
        return _failed(name, e, cluster.run_dir)
    monitor = ResourceMonitor(state.processes)
    monitor.start()
    try:
        measured = asyncio.run(_measure(plan, name, state, monitor, console))
    except RuntimeError as e:
        console.print(f"[bold red]{name} failed:[/] {e}")
        return _failed(name, e, cluster.run_dir)
    finally:
        monitor.close()
        with console.status(f"stopping {name}"):
            down(_run_dir(plan, name))
    # Timelines are read once the cluster has stopped: a server may flush
    # them on the way out.
    result = _result(plan, name, measured, monitor, _timelines(plan, name, console))
    writes = _descriptor_stats(_run_dir(plan, name), Path(state.model), console)
    return msgspec.structs.replace(result, descriptors=writes)


def _descriptor_stats(
    run_dir: Path, model_dir: Path, console: Console
) -> DescriptorStats | None:
    """Descriptor counts of the WRITEs the configuration traced, if any."""
    try:
        num_layers = int(
            json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
        )
        return summarize_writes(read_write_sizes(run_dir), num_layers)
    except (OSError, ValueError, KeyError) as e:
        console.print(f"[bold yellow]write sizes ignored:[/] {e}")
        return None


def _timelines(plan: Plan, name: str, console: Console) -> TimelineSet:
    try:
        return read_timelines(_run_dir(plan, name))
    except (OSError, ValueError) as e:
        console.print(f"[bold yellow]{name}: server timelines ignored:[/] {e}")
        return TimelineSet()


def _run_dir(plan: Plan, name: str) -> Path:
    return plan.clusters[name].run_dir or plan.out_dir


@dataclass(frozen=True)
class Measured:
    """What one configuration's run produced, before any statistics."""

    warmup: WarmupResult
    records: list[list[RequestRecord]]  # per point
    marks: list[Mark]  # before the first point and after each


def _failed(name: str, error: BaseException, run_dir: Path | None) -> ConfigResult:
    return ConfigResult(
        name=name,
        status="failed",
        reason=str(error).splitlines()[0] if str(error) else type(error).__name__,
        run_dir=str(run_dir) if run_dir else None,
    )


async def _measure(
    plan: Plan, name: str, state: RunState, monitor: ResourceMonitor, console: Console
) -> Measured:
    timeout = plan.config.request_timeout_s
    async with client.make_session() as session:
        warmup = await _warm_up(plan, name, state, session, console)
        marks: list[Mark] = [monitor.mark()]
        measured: list[list[RequestRecord]] = []
        with _progress(console) as progress:
            for workload in plan.points:
                task = progress.add_task(
                    f"{name} {workload.point.label}",
                    total=len(workload.requests),
                    errors=0,
                )
                records = await loadgen.run_point(
                    session, state.router_url, workload, name, timeout,
                    _advance(progress, task),
                )  # fmt: skip
                write_records(plan.out_dir / REQUESTS_FILE, records)
                measured.append(records)
                marks.append(monitor.mark())
    return Measured(warmup, measured, marks)


async def _warm_up(
    plan: Plan,
    name: str,
    state: RunState,
    session: aiohttp.ClientSession,
    console: Console,
) -> WarmupResult:
    with console.status(f"{name}: {len(plan.warmup.requests)} warm-up requests"):
        records = await loadgen.run_point(
            session,
            state.router_url,
            plan.warmup,
            name,
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
            f"{first.error_detail}); see the logs in {plan.clusters[name].run_dir}"
        )
    return WarmupResult(
        num_requests=len(records), num_ok=len(ok), latencies_ms=latencies
    )


def _result(
    plan: Plan,
    name: str,
    measured: Measured,
    monitor: ResourceMonitor,
    timelines: TimelineSet,
) -> ConfigResult:
    run_dir, marks = _run_dir(plan, name), measured.marks
    points = [
        PointResult(
            point=workload.point.index,
            stats=summarize_point(records),
            handover=summarize_handover(
                timelines, [r.bench_id for r in records], wall_window(records)
            ),
            usage=monitor.usage(marks[i], marks[i + 1]),
            load=monitor.load(marks[i], marks[i + 1]),
        )
        for i, (workload, records) in enumerate(
            zip(plan.points, measured.records, strict=True)
        )
    ]
    return ConfigResult(
        name=name,
        status="ok",
        points=points,
        usage=monitor.usage(marks[0], marks[-1]),
        load=monitor.load(marks[0], marks[-1]),
        warmup=measured.warmup,
        run_dir=str(run_dir),
        has_timelines=bool(timelines),
    )


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[errors]} errors"),
        TimeElapsedColumn(),
        console=console,
    )


def _advance(progress: Progress, task: TaskID) -> loadgen.OnDone:
    """Move the point's bar on, counting failed requests."""
    num_errors = 0

    def on_done(record: RequestRecord) -> None:
        nonlocal num_errors
        num_errors += not record.is_ok
        progress.update(task, advance=1, errors=num_errors)

    return on_done
