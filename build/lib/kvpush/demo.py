"""``make demo``: the same prompts through colocated, vLLM pull, vLLM push
and kvpush.

Starts each cluster in turn (1 prefill + 1 decode for the P/D modes), sends
a warm-up request (the first one pays NIXL's handshake), then a few
streaming requests; prints each mode's outputs, TTFTs, and whether the
outputs equal the colocated instance's; stops everything.
"""

from __future__ import annotations

import statistics
import sys

from rich.console import Console
from rich.table import Table

from kvpush import client, env
from kvpush.launcher import ClusterConfig, down, up

MODES = ("colocated", "vllm-pull", "vllm-push", "kvpush")
PROMPTS = (
    "The quick brown fox",
    "Write a short story about a robot who learns to paint.",
    "def fibonacci(n):\n    # return the n-th Fibonacci number\n",
    " ".join(
        ["Disaggregated serving moves the prompt's KV cache between instances."] * 40
    ),
)


def run_mode(mode: str, console: Console) -> list[client.Reply]:
    """Start ``mode``, warm up, send the prompts one by one, stop. Ports of
    its own, so that the demo never meets a cluster started by hand."""
    run_dir = env.kvpush_home() / "demo-run"
    num = 0 if mode == "colocated" else 1
    config = ClusterConfig(
        mode=mode,
        num_prefill=num,
        num_decode=num,
        run_dir=run_dir,
        port=8010,
        base_http_port=8110,
        base_side_channel_port=5610,
    )
    console.rule(f"[bold]{mode}")
    state = up(config, console)
    try:
        _send(state.router_url, "warm-up", max_tokens=2)
        return [_send(state.router_url, p, max_tokens=24) for p in PROMPTS]
    finally:
        down(run_dir)


def _send(url: str, prompt: str, max_tokens: int) -> client.Reply:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    reply = client.request(url, "/v1/completions", body)
    if reply.status != 200:
        raise RuntimeError(f"request failed with {reply.status}: {reply.body}")
    return reply


def main() -> int:
    console = Console()
    results = {mode: run_mode(mode, console) for mode in MODES}
    table = Table(title="TTFT per mode (streaming, after warm-up)")
    for column in (
        "mode",
        "TTFT p50 (ms)",
        "TTFT per prompt (ms)",
        "same text as colocated",
    ):
        table.add_column(column)
    reference = [r.text for r in results["colocated"]]
    for mode, replies in results.items():
        ttfts = [1000 * (r.ttft_s or 0.0) for r in replies]
        same = [r.text for r in replies] == reference
        table.add_row(
            mode,
            f"{statistics.median(ttfts):.0f}",
            " ".join(f"{t:.0f}" for t in ttfts),
            "yes" if same else "NO",
        )
    for prompt, reply in zip(PROMPTS, results["kvpush"], strict=True):
        console.print(f"[dim]{prompt[:60]!r}[/dim] -> {reply.text!r}")
    console.print(table)
    return 0 if all([r.text for r in v] == reference for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
