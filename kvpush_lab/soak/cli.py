"""``python -m kvpush_lab.soak``: a long run that must lose nothing and
leak nothing.

It starts one cluster (the benchmark's cluster set-up), warms it up, sends
streaming requests through the router with Poisson arrivals for
``--duration-s`` seconds while the client aborts a fraction of them
mid-request, waits for every request to end, lets the cluster settle and
reads each instance's KV usage. Every request is classified (completed,
aborted, failed with an error it was told, lost); the exit status is 0 only
when none was lost, no KV block leaked or was quarantined, and some
completed. Writes
``soak.json``, ``soak.md``, ``results.json`` and ``requests.jsonl`` to
``--out``; with ``--publish``, also ``docs/bench/soak/results.json``, and
renders ``BENCHMARKS.md`` again (:mod:`kvpush_lab.bench.render`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import shlex
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from kvpush.launcher import down, up
from kvpush.launcher.config import ClusterConfig
from kvpush.launcher.state import RunState
from kvpush_lab.bench import client, loadgen
from kvpush_lab.bench.inputs import normal_token_ids, resolve_model
from kvpush_lab.bench.outputs import publish_results
from kvpush_lab.bench.records import REQUESTS_FILE, write_records
from kvpush_lab.bench.resources import versions
from kvpush_lab.bench.results import save_results
from kvpush_lab.bench.runner import cluster_config
from kvpush_lab.bench.workload import WARMUP_POINT, PointWorkload, SweepPoint
from kvpush_lab.soak.config import SoakConfig
from kvpush_lab.soak.counters import ConnectorCounters, read_counters
from kvpush_lab.soak.driver import drive, settle, wait_routable
from kvpush_lab.soak.export import soak_results
from kvpush_lab.soak.leaks import KvReading
from kvpush_lab.soak.outcome import OUTCOME_KINDS, SoakRecord, classify
from kvpush_lab.soak.plan import request_spec, schedule, warmup_specs
from kvpush_lab.soak.report import (
    SOAK_SECTION_FILE,
    SOAK_SUMMARY_FILE,
    SoakRun,
    SoakSummary,
    render_section,
    summarize,
)

PROGRAM = "python -m kvpush_lab.soak"
ROUTABLE_TIMEOUT_S = 30.0  # for the router to see every instance healthy

# (flag, field, type, help); every field of SoakConfig but out_dir and model.
_FLAGS: tuple[tuple[str, str, Any, str], ...] = (
    ("--mode", "mode", str, "cluster mode (kvpush)"),
    ("--prefill", "num_prefill", int, "prefill instances of a P/D mode (1)"),
    ("--decode", "num_decode", int, "decode instances of a P/D mode (1)"),
    ("--duration-s", "duration_s", float, "seconds of arrivals (600)"),
    ("--qps", "qps", float, "Poisson arrival rate, requests/s (12)"),
    ("--prompt-len", "prompt_len", str, "prompt tokens, N or A-B (256-1024)"),
    ("--max-tokens", "max_tokens", int, "output tokens per request (32)"),
    ("--abort-fraction", "abort_fraction", float,
     "fraction of requests the client aborts mid-request (0.2)"),
    ("--abort-window-s", "abort_window_s", float, "abort within this long after "
     "the send (default: the warm-up's median request duration)"),
    ("--request-timeout-s", "request_timeout_s", float,
     "a request not ended by then is lost (60)"),
    ("--settle-s", "settle_s", float, "wait up to this long for the cluster to "
     "be idle with no KV block in use (30)"),
    ("--num-warmup", "num_warmup", int, "warm-up requests, not counted (4)"),
    ("--seed", "seed", int, "workload seed (0)"),
    ("--max-model-len", "max_model_len", int, "per instance (4096)"),
    ("--kv-cache-space-gb", "kv_cache_space_gb", int, "per instance (1)"),
    ("--port", "port", int, "router port (27000)"),
    ("--base-http-port", "base_http_port", int, "first instance port (27100)"),
    ("--base-side-channel-port", "base_side_channel_port", int,
     "first side-channel port (27200)"),
    ("--startup-timeout-s", "startup_timeout_s", float, "cluster start (300)"),
    ("--verify-kv", "verify_kv", str,
     "kvpush's KV digests: off, sample or all (off); a mismatch fails the soak"),
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.split("\n\n")[0])
    for flag, dest, kind, text in _FLAGS:
        p.add_argument(flag, dest=dest, type=kind, help=text, metavar=_metavar(dest))
    p.add_argument("--model", type=Path, help="model directory (the tiny model)")
    p.add_argument("--out", dest="out_dir", type=Path, metavar="DIR",
                   help="results directory (bench-results/soak-<time>)")  # fmt: skip
    p.add_argument(
        "--publish", nargs="?", const=Path("."), type=Path, metavar="ROOT",
        help="also write ROOT/docs/bench/soak/results.json and render "
        "ROOT/BENCHMARKS.md again (ROOT: .)",
    )  # fmt: skip
    return p


def _metavar(dest: str) -> str:
    if dest.endswith("_s"):
        return "S"
    if dest in ("mode", "prompt_len", "verify_kv"):
        return dest.split("_")[-1].upper()
    return "X" if dest in ("qps", "abort_fraction") else "N"


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    """The flags given over the defaults; ValueError says what to change."""
    names = [dest for _, dest, _, _ in _FLAGS] + ["model", "out_dir"]
    given = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    return SoakConfig(**given)


def command_line(argv: list[str]) -> str:
    """The command as run, the output directory left out."""
    words, skip = [], False
    for word in argv:
        if skip or word.startswith("--out="):
            skip = False
            continue
        skip = word == "--out"
        if not skip:
            words.append(word)
    return shlex.join([*PROGRAM.split(), *words])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    console = Console()
    try:
        config = config_from_args(args)
        out_dir, summary = run_soak(config, console, command_line(argv))
    except ValueError as e:
        console.print(f"[bold red]soak: error:[/] {e}")
        return 2
    except RuntimeError as e:  # the cluster did not start or stop
        console.print(f"[bold red]soak: failed:[/] {e}")
        return 1
    files = write_outputs(out_dir, summary)
    if args.publish is not None:
        files += publish(args.publish, summary)
    print_result(console, summary, files)
    return 0 if summary.has_passed else 1


@dataclass(frozen=True)
class Measured:
    abort_window_s: float
    warmup_e2e_ms: list[float]
    records: list[SoakRecord]
    kv: list[KvReading]
    router_in_flight: int | None
    settle_wait_s: float
    counters: ConnectorCounters


def soak_cluster(config: SoakConfig, model: Path, run_dir: Path) -> ClusterConfig:
    """The benchmark's cluster of ``config.mode``, with the soak's KV digests."""
    cluster = cluster_config(config.bench_config(), config.mode, model, run_dir)
    return dataclasses.replace(cluster, verify_kv=config.verify_kv)


def run_soak(
    config: SoakConfig, console: Console, command: str
) -> tuple[Path, SoakSummary]:
    """Start the cluster, soak it, stop it; the summary (also saved)."""
    out_dir = config.out_dir or Path("bench-results") / dt.datetime.now().strftime(
        "soak-%Y%m%d-%H%M%S"
    )
    if (out_dir / SOAK_SUMMARY_FILE).exists():
        raise ValueError(f"{out_dir} already holds a soak; choose a new --out")
    bench, run_dir = config.bench_config(), out_dir / "cluster"
    model = resolve_model(bench, console)
    vocab = normal_token_ids(model)
    cluster = soak_cluster(config, model, run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started_at = _now()
    console.print(
        f"soak: {config.mode} for {config.duration_s:g} s; results in {out_dir}"
    )
    state = up(cluster, console)
    try:
        measured = asyncio.run(_measure(config, state, vocab, console))
    finally:
        with console.status("stopping the cluster"):
            down(run_dir)
    write_records(out_dir / REQUESTS_FILE, measured.records)
    run = SoakRun(
        command=command, started_at=started_at, finished_at=_now(),
        versions=versions(), settings=config.to_dict(),
        abort_window_s=measured.abort_window_s,
        warmup_e2e_ms=measured.warmup_e2e_ms, settle_wait_s=measured.settle_wait_s,
    )  # fmt: skip
    summary = summarize(
        run, measured.records, measured.kv, measured.router_in_flight,
        measured.counters,
    )  # fmt: skip
    (out_dir / SOAK_SUMMARY_FILE).write_bytes(
        msgspec.json.format(msgspec.json.encode(summary))
    )
    return out_dir, summary


def _now() -> str:
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


async def _measure(
    config: SoakConfig, state: RunState, vocab: list[int], console: Console
) -> Measured:
    requests = schedule(config)
    instances = [p for p in state.processes if p.role != "router"]
    async with client.make_session() as session:
        down = await wait_routable(session, state.router_url, ROUTABLE_TIMEOUT_S)
        if down:
            console.print(f"[yellow]the router still marks down {', '.join(down)}[/]")
        warmup_ms = await _warm_up(config, state.router_url, vocab, session, console)
        window = config.abort_window_s or statistics.median(warmup_ms) / 1000
        with _progress(console) as progress:
            task = progress.add_task("soak", total=len(requests), counts="")
            counts: Counter[str] = Counter()

            def on_done(record: SoakRecord) -> None:
                counts[classify(record).kind] += 1
                progress.update(task, advance=1, counts=_counts_text(counts))

            records = await drive(
                session, state.router_url, requests,
                lambda r: request_spec(r, vocab, config.seed, config.max_tokens),
                window, config.request_timeout_s, config.mode, on_done,
            )  # fmt: skip
        with console.status(f"settling (up to {config.settle_s:g} s)"):
            kv, in_flight, waited = await settle(
                session, instances, state.router_url, config.settle_s
            )
        counters = await read_counters(session, instances)
    return Measured(window, warmup_ms, records, kv, in_flight, waited, counters)


async def _warm_up(
    config: SoakConfig,
    url: str,
    vocab: list[int],
    session: aiohttp.ClientSession,
    console: Console,
) -> list[float]:
    """Send the warm-up requests one by one; their durations in ms."""
    spec = config.prompt_spec
    point = SweepPoint(WARMUP_POINT, "warmup", 0.0, "concurrency", 1.0, spec)
    specs = warmup_specs(config.num_warmup, spec, vocab, config.seed, config.max_tokens)
    with console.status(f"{len(specs)} warm-up requests"):
        records = await loadgen.run_point(
            session, url, PointWorkload(point, specs), config.mode,
            config.request_timeout_s, lambda _r: None,
        )  # fmt: skip
    ok = [round(1000 * (r.end_s or 0.0), 1) for r in records if r.is_ok]
    console.print(f"  warm-up: {len(ok)}/{len(records)} ok, ms {ok}")
    if not ok:
        first = records[0]
        raise RuntimeError(
            f"every warm-up request failed (first: {first.error} {first.error_detail})"
        )
    return ok


def _counts_text(counts: Counter[str]) -> str:
    return ", ".join(f"{kind} {counts[kind]}" for kind in OUTCOME_KINDS)


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[counts]}"),
        TimeElapsedColumn(), console=console,
    )  # fmt: skip


def write_outputs(out_dir: Path, summary: SoakSummary) -> list[Path]:
    section = out_dir / SOAK_SECTION_FILE
    section.write_text(render_section(summary))
    results = save_results(soak_results(summary), out_dir)
    return [out_dir / SOAK_SUMMARY_FILE, section, results, out_dir / REQUESTS_FILE]


def publish(root: Path, summary: SoakSummary) -> list[Path]:
    """Replace ``root/docs/bench/soak/results.json`` and render
    ``root/BENCHMARKS.md`` again from every section."""
    return publish_results(soak_results(summary), root)


def print_result(console: Console, summary: SoakSummary, files: list[Path]) -> None:
    c = summary.counts
    console.print(
        f"soak: {summary.num_requests} requests at {summary.achieved_qps:.2f} req/s: "
        f"completed {c['completed']}, aborted {c['aborted']}, failed {c['failed']}, "
        f"lost {c['lost']}; leaked KV blocks {summary.num_leaked_blocks}, "
        f"quarantined {summary.num_quarantined_blocks}"
    )
    for r in summary.kv:
        console.print(
            f"  {r.name}: {r.num_blocks_in_use}/{r.num_blocks} blocks in use, "
            f"{r.num_running} running, {r.num_waiting} waiting"
            + (f", error {r.error}" if r.error else "")
        )
    if summary.counters.totals:
        console.print(f"  connector counters: {summary.counters.totals}")
    for path in files:
        console.print(f"  wrote {path}")
    if summary.has_passed:
        console.print("[bold green]soak passed[/]")
    for warning in summary.warnings:
        console.print(f"[bold yellow]warning:[/] {warning}")
    for problem in summary.problems:
        console.print(f"[bold red]soak failed:[/] {problem}")
