"""``kvpush project``: the projection to the published setup, printed with
its assumptions (rich tables, or ``--json``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console

from kvpush.commands import run_subcommand
from kvpush_lab.project.compare import compare
from kvpush_lab.project.estimate import Scenario, project
from kvpush_lab.project.inputs import INT_PARAMS, PARAMS, Inputs
from kvpush_lab.project.report import to_json
from kvpush_lab.project.shape import BUILTIN_CONFIGS, load_shape

DESCRIPTION = """\
Project pull (vLLM NixlConnector), vLLM push (NixlPushConnector) and
kvpush TTFT and TPOT to the published setup (Qwen3-32B, 1P1D, H200 with
EFA). This is a MODEL, NOT A MEASUREMENT: TTFT = prefill compute + the
critical-path phases of each configuration (decode-step waits, hops,
descriptor posts, wire time); TPOT = a memory-bound decode step plus, for
pull only, the READ posts that run inside decode's loop. Three scenarios:
contiguous KV, fragmented KV (one descriptor per block, layer and K/V),
and decode already holding the prompt. Every input below is printed next
to the result with its source (measured here, published, assumed);
docs/projection.md explains the model."""


def main(argv: list[str]) -> int:
    """``kvpush project ARGV``: the ``kvpush.commands`` entry point."""
    return run_subcommand(add_parser, ["project", *argv])


def add_parser(sub: Any) -> None:
    """Add ``project`` to the ``kvpush`` command's subparsers."""
    p = sub.add_parser(
        "project",
        help="model (not measurement) of pull / vLLM push / kvpush TTFT and "
        "TPOT at the published H200 + EFA setup",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="qwen3-32b",
        metavar="NAME|PATH",
        help=f"built-in ({', '.join(BUILTIN_CONFIGS)}) or a path to a Hugging "
        "Face config.json or its directory (default qwen3-32b)",
    )
    p.add_argument(
        "--prompt-tokens",
        default="2048",
        metavar="N[,N...]",
        help="prompt lengths, comma-separated (default 2048, assumed: vLLM PR "
        "45211's Qwen3-32B runs; the published push result swept lengths)",
    )
    for param in PARAMS:
        p.add_argument(
            param.option,
            type=int if param.name in INT_PARAMS else float,
            default=param.default,
            metavar="N" if param.name in INT_PARAMS else "X",
            help=f"{param.basis} [{param.source}; {param.unit}; "
            f"default {param.default:g}]",
        )
    p.add_argument("--breakdown", action="store_true", help="print every phase")
    p.add_argument("--json", action="store_true", help="print JSON instead")
    p.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    inputs, prompts = inputs_from_args(args)
    scenarios = project_all(inputs, prompts)
    comparisons = compare(scenarios)
    if args.json:
        print(json.dumps(to_json(inputs, prompts, scenarios, comparisons), indent=2))
        return 0
    from kvpush_lab.project.render import render

    render(Console(), inputs, prompts, scenarios, comparisons, args.breakdown)
    return 0


def inputs_from_args(args: argparse.Namespace) -> tuple[Inputs, list[int]]:
    prompts = parse_prompts(args.prompt_tokens)
    values = {p.name: getattr(args, p.name) for p in PARAMS}
    inputs = Inputs(model=load_shape(args.model), prompt_tokens=prompts[0], **values)
    return inputs, prompts


def parse_prompts(text: str) -> list[int]:
    try:
        prompts = [int(word) for word in text.split(",") if word.strip()]
    except ValueError:
        msg = f"--prompt-tokens {text!r}: give integers, e.g. 1024,8192"
        raise ValueError(msg) from None
    if not prompts or min(prompts) < 1:
        raise ValueError("--prompt-tokens needs at least one length >= 1")
    return prompts


def project_all(inputs: Inputs, prompts: list[int]) -> list[Scenario]:
    """Every scenario at every prompt length, grouped by scenario."""
    scenarios = [s for n in prompts for s in project(inputs.with_prompt(n))]
    order = {"contiguous": 0, "fragmented": 1, "decode-prefix-hit": 2}
    return sorted(scenarios, key=lambda s: (order[s.name], s.prompt_tokens))
