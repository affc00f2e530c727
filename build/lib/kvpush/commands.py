"""Running a ``kvpush`` subcommand, and finding the optional ones.

The product's subcommands are in ``kvpush/cli.py``. The lab's (``bench``,
``bench-micro``, ``project``, ``soak``: a package of its own, installed with
the ``bench`` extra) are entry points of the group ``kvpush.commands``
(``pyproject.toml``), each a ``main(argv) -> int`` given the words after its
name. One is looked up and imported only when its name is the command, so
``kvpush --help`` imports none of them; one that is absent or fails to
import (its extra's dependencies missing) is a one-line error saying what
to install, exit status 2. The product never imports the lab by name.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

GROUP = "kvpush.commands"
INSTALL = "pip install 'kvpush[bench]'"
# The lab's commands, listed by ``kvpush --help`` without importing them (and
# named with INSTALL when absent): name -> help line.
LAB_COMMANDS: dict[str, str] = {
    "bench": "compare configurations side by side on one workload",
    "bench-micro": "micro-benchmarks: descriptor build, NIXL calls, writer CPU",
    "project": "model (not measurement) of pull / vLLM push / kvpush TTFT and "
    "TPOT at the published H200 + EFA setup",
    "soak": "sustained load with client aborts: nothing lost, nothing leaked",
}


def optional_commands() -> dict[str, EntryPoint]:
    """The installed ``kvpush.commands`` entry points, by command name
    (nothing is imported)."""
    from importlib.metadata import entry_points  # about 0.1 s: not for --help

    return {ep.name: ep for ep in entry_points(group=GROUP)}


def run_optional(name: str, argv: list[str]) -> int:
    """``kvpush NAME ARGV`` for a command of the group: its ``main(argv)``.
    Absent, or failing to import: says what to install, returns 2."""
    found = optional_commands().get(name)
    try:
        if found is None:
            raise ModuleNotFoundError(f"no {GROUP!r} entry point {name!r}")
        command_main: Callable[[list[str]], int] = found.load()
    except ImportError as e:
        print(
            f"kvpush {name}: the lab is not installed ({e}); install it: {INSTALL}",
            file=sys.stderr,
        )
        return 2
    return int(command_main(argv) or 0)


def run_parsed(args: argparse.Namespace) -> int:
    """Run the subcommand ``args`` chose (``args.func``): ValueError is a
    usage error (2), RuntimeError a failure (1), Ctrl-C 130."""
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"kvpush {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # LaunchError and failed stops
        print(f"kvpush {args.command}: failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def run_subcommand(add_parser: Callable[[Any], None], argv: list[str]) -> int:
    """``kvpush ARGV`` for a command whose ``add_parser(subparsers)`` adds it
    (a lab command's ``main``): parsed as ``kvpush`` parses, run by
    :func:`run_parsed`."""
    parser = argparse.ArgumentParser(prog="kvpush")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run_parsed(parser.parse_args(argv))
