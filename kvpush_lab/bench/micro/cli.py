"""``kvpush bench-micro [--publish [ROOT]]``: run the micro-benchmarks,
print their tables, and with ``--publish`` write
``ROOT/docs/bench/micro/results.json`` and render ``ROOT/BENCHMARKS.md``
again (:mod:`kvpush_lab.bench.render`)."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from kvpush.commands import run_subcommand


def main(argv: list[str]) -> int:
    """``kvpush bench-micro ARGV``: the ``kvpush.commands`` entry point."""
    return run_subcommand(add_parser, ["bench-micro", *argv])


def add_parser(sub: Any) -> None:
    """Add ``bench-micro`` to the ``kvpush`` command's subparsers."""
    p = sub.add_parser(
        "bench-micro",
        help="micro-benchmarks: descriptor build, NIXL calls, writer CPU",
    )
    p.add_argument("--rounds", type=int, default=30, help="build rounds (30)")
    p.add_argument("--nixl-rounds", type=int, default=10, help="NIXL rounds (10)")
    p.add_argument("--cpu-windows", type=int, default=5, help="writer CPU windows (5)")
    p.add_argument(
        "--cpu-window-s", type=float, default=2.0, help="seconds a window (2)"
    )
    p.add_argument("--skip-nixl", action="store_true", help="no NIXL agents")
    p.add_argument("--skip-writer", action="store_true", help="no writer CPU")
    p.add_argument("--step-rounds", type=int, default=5, help="decode step rounds (5)")
    p.add_argument(
        "--skip-decode-step", action="store_true", help="no decode step timing"
    )
    p.add_argument(
        "--machine", help="how to describe this machine (default: CPU model, cores)"
    )
    p.add_argument(
        "--note", action="append", default=[], help="a line under the tables"
    )
    p.add_argument(
        "--publish", nargs="?", const=Path("."), type=Path, metavar="ROOT",
        help="also write ROOT/docs/bench/micro/results.json and render "
        "ROOT/BENCHMARKS.md again (ROOT: .)",
    )  # fmt: skip
    p.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    from kvpush_lab.bench.micro.build import CASES, measure_build
    from kvpush_lab.bench.micro.report import MicroRun, render_section

    if min(args.rounds, args.nixl_rounds, args.cpu_windows, args.step_rounds) < 1:
        raise ValueError(
            "--rounds, --nixl-rounds, --cpu-windows and --step-rounds must be >= 1"
        )
    builds = [b for case in CASES for b in measure_build(case, args.rounds)]
    calls: list[Any] = []
    if not args.skip_nixl:
        from kvpush_lab.bench.micro.nixl_calls import measure_nixl

        calls = measure_nixl(args.nixl_rounds)
    cpu: list[Any] = []
    if not args.skip_writer:
        from kvpush_lab.bench.micro.writer_cpu import measure_writer_cpu

        cpu = measure_writer_cpu(args.cpu_windows, args.cpu_window_s)
    steps: list[Any] = []
    if not args.skip_decode_step:
        from kvpush_lab.bench.micro.decode_step import measure_decode_step

        steps = measure_decode_step(args.step_rounds, steps=500)
    run = MicroRun(
        command=_command(args),
        when=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        commit=_commit(),
        machine=args.machine or _machine(),
        builds=builds,
        calls=calls,
        cpu=cpu,
        steps=steps,
        notes=tuple(args.note),
    )
    print(render_section(run))
    if args.publish is not None:
        for path in publish(args.publish, run):
            print(f"wrote {path}")
    return 0


def publish(root: Path, run: Any) -> list[Path]:
    """Replace ``root/docs/bench/micro/results.json`` with ``run``'s and
    render ``root/BENCHMARKS.md`` again."""
    from kvpush_lab.bench.micro.report import micro_results
    from kvpush_lab.bench.outputs import publish_results

    return publish_results(micro_results(run), root)


def _command(args: argparse.Namespace) -> str:
    words = ["kvpush", "bench-micro", f"--rounds {args.rounds}"]
    words += [f"--nixl-rounds {args.nixl_rounds}"] if not args.skip_nixl else []
    if not args.skip_writer:
        words += [f"--cpu-windows {args.cpu_windows}"]
        words += [f"--cpu-window-s {args.cpu_window_s:g}"]
    if not args.skip_decode_step:
        words += [f"--step-rounds {args.step_rounds}"]
    return " ".join(words)


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [
                line.split(":", 1)[1] for line in f if line.startswith("model name")
            ]
        model = names[0].strip() if names else model
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"
