"""The projection drawn with rich: the label, the result table, the
assumptions next to it, the comparison with the published claims, and
(``--breakdown``) every phase of every configuration."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvpush_lab.project.compare import Comparison, explanations
from kvpush_lab.project.estimate import Scenario
from kvpush_lab.project.inputs import Inputs
from kvpush_lab.project.report import LABEL, assumptions, derived_rows


def render(
    console: Console,
    inputs: Inputs,
    prompts: list[int],
    scenarios: list[Scenario],
    comparisons: list[Comparison],
    breakdown: bool = False,
) -> None:
    console.print(f"[bold yellow]{LABEL}[/]")
    console.print(_result_table(inputs, scenarios))
    console.print(_first_token_table(scenarios))
    _print_assumptions(console, inputs)
    console.print(_derived_table(inputs, prompts))
    _print_comparisons(console, comparisons)
    if breakdown:
        for s in scenarios:
            console.print(_phase_table(s))


def _result_table(inputs: Inputs, scenarios: list[Scenario]) -> Table:
    t = Table(
        title=f"Projected TTFT and TPOT, {inputs.model.name}, 1P1D",
        caption="ms; descs: NIXL descriptors per transfer and TP rank; "
        "pull ÷: vllm-pull's value over this row's (> 1: faster than pull); "
        "stall: added to each decode step by posts in decode's loop",
    )
    t.add_column("scenario", no_wrap=True)
    t.add_column("prompt", justify="right")
    t.add_column("descs", justify="right")
    t.add_column("config", no_wrap=True)
    for col in ("TTFT", "handover", "pull ÷", "TPOT", "stall", "pull ÷"):
        t.add_column(col, justify="right")
    for s in scenarios:
        for i, e in enumerate(s.estimates):
            first = i == 0
            t.add_row(
                s.name if first else "",
                f"{s.prompt_tokens:,}" if first else "",
                f"{s.descriptors:,}" if first else "",
                e.config,
                f"{e.ttft_ms:.1f}",
                f"{e.handover_ms:.1f}",
                f"{s.ttft_ratio(e.config):.2f}",
                f"{e.tpot_ms:.2f}",
                f"{e.stall_ms:.2f}",
                f"{s.tpot_ratio(e.config):.2f}",
                end_section=i == len(s.estimates) - 1,
            )
    return t


def _first_token_table(scenarios: list[Scenario]) -> Table:
    t = Table(
        title="kvpush with the first token from prefill (the router's default)",
        caption="ms; early binding: decode's first step computes that token "
        "again, its second samples the second token; ÷ pull: over vllm-pull's TTFT",
    )
    for col in ("scenario", "prompt", "TTFT", "÷ pull", "second token", "÷ pull"):
        t.add_column(col, justify="right" if col != "scenario" else "left")
    for s in scenarios:
        e, pull = s.get("kvpush"), s.get("vllm-pull").ttft_ms
        first, second = e.first_from_prefill_ms, e.second_token_ms
        if first is None or second is None:
            continue  # no prefill leg
        t.add_row(
            s.name,
            f"{s.prompt_tokens:,}",
            f"{first:.1f}",
            f"{first / pull:.2f}",
            f"{second:.1f}",
            f"{second / pull:.2f}",
        )
    return t


def _print_assumptions(console: Console, inputs: Inputs) -> None:
    console.print("[bold]Assumptions[/] (each NAME is the option --NAME, dashes for _)")
    for a in assumptions(inputs):
        console.print(
            f"  [bold]{a.name}[/] = {a.value}  [dim]({a.source})[/] {a.basis}"
        )


def _derived_table(inputs: Inputs, prompts: list[int]) -> Table:
    t = Table(title="Derived per prompt length")
    cols = ["prompt", "KV MiB", "per rank", "blocks", "wire ms", "prefill ms"]
    cols += ["decode step ms", "joining / step"]
    for col in cols:
        t.add_column(col, justify="right")
    for r in derived_rows([inputs.with_prompt(n) for n in prompts]):
        t.add_row(
            f"{r['prompt_tokens']:,}",
            f"{r['kv_mib']:,.0f}",
            f"{r['kv_mib_per_rank']:,.0f}",
            f"{r['blocks']:,}",
            f"{r['wire_ms']:.2f}",
            f"{r['prefill_ms']:.1f}",
            f"{r['decode_step_ms']:.2f}",
            f"{r['transfers_per_step']:.3f}",
        )
    t.caption = (
        "wire: one rank's shard over its link share (ranks in parallel); "
        "joining / step: decode_batch ÷ output_tokens"
    )
    return t


def _print_comparisons(console: Console, comparisons: list[Comparison]) -> None:
    console.print("[bold]Against the published claims[/] (vLLM push over pull)")
    for c in comparisons:
        console.print(
            f"  [bold]{c.claim.name}[/], {c.prompt_tokens:,} tokens: published "
            f"{c.claim.range_text}; model {c.push_ratio:.2f}x (kvpush "
            f"{c.kvpush_ratio:.2f}x): [bold]{c.verdict}[/]. {c.why}. "
            f"[dim]({c.claim.source})[/]"
        )
    for paragraph in explanations(comparisons):
        console.print(f"  {paragraph}.")


def _phase_table(s: Scenario) -> Table:
    t = Table(title=f"Critical path, {s.name}, {s.prompt_tokens:,} tokens")
    t.add_column("configuration")
    t.add_column("phase")
    t.add_column("ms", justify="right")
    t.add_column("on decode's loop")
    for e in s.estimates:
        for p in e.phases:
            t.add_row(
                e.config, p.label, f"{p.ms:.2f}", "yes" if p.on_decode_loop else ""
            )
        t.add_row(e.config, "[bold]TTFT[/]", f"[bold]{e.ttft_ms:.2f}[/]", "")
    return t
