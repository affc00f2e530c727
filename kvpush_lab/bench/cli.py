"""``kvpush bench``: its flags, and the command that runs it.

Every flag except ``--preset``/``--quick``, ``--config``, ``--publish``,
``--section``, ``--title`` and ``--render`` is a :class:`BenchConfig` field
(the same names in a config file). Lists are comma-separated
(``--request-rate 1,2,4``). Load flags carry ``vllm bench serve``'s names
(``--request-rate``, ``--num-prompts``, ``--max-concurrency``); the older
``--qps`` and ``--num-requests`` stay as aliases (:data:`ALIASES`), and
giving both names with different values is refused. ``--base-url URL``
measures a running deployment (:mod:`kvpush_lab.bench.endpoint`).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from rich.console import Console

from kvpush.commands import run_subcommand
from kvpush_lab.bench.config import PRESETS, load_config_file, make_config, preset

# Rounds of a --publish run unless --repeat (or a config file) says otherwise:
# enough for a median and a min-max on this machine.
PUBLISH_REPEAT = 3


def _yes_no(text: str) -> bool:
    if text.lower() in ("yes", "true", "1"):
        return True
    if text.lower() in ("no", "false", "0"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r}: give yes or no")


# (flag, field, type, help); type None means a string taken as is.
_FLAGS: tuple[tuple[str, str, Any, str], ...] = (
    ("--configs", "configs", None, "configurations to compare, comma-separated "
     "(default colocated,vllm-pull,vllm-push,kvpush; kvpush-auto, kvpush-early, "
     "kvpush-late, kvpush-skip: kvpush with that router --binding; "
     "kvpush-first-token-decode: kvpush's router with --first-token-from "
     "decode (kvpush-late-first-token-decode: and --binding late); "
     "kvpush-t1-recomputed, kvpush-early-t1-recomputed: decode on vLLM's own "
     "scheduler class, computing prefill's first token again (a cluster each); "
     "kvpush.request, kvpush.chunk, kvpush.layer, kvpush.auto: kvpush with "
     "prefill at that --push-granularity, a cluster each)"),
    ("--prefill", "num_prefill", int, "prefill instances of P/D configurations (1)"),
    ("--decode", "num_decode", int, "decode instances of P/D configurations (1)"),
    ("--model", "model", None, "model directory (default: the tiny model); "
     "with --base-url: the model name the requests carry"),
    ("--model-preset", "model_preset", None, "a named model shape, made on first "
     "use (kv-heavy: 64 KiB of KV per token; it also sets --max-model-len 8192 "
     "and --kv-cache-space-gb 4 unless given)"),
    ("--model-layers", "model_layers", int, "generate a model with this many layers"),
    ("--model-hidden-size", "model_hidden_size", int, "... and this hidden size"),
    ("--model-kv-heads", "model_kv_heads", int, "... and this many KV heads"),
    ("--model-head-dim", "model_head_dim", int, "... of this size (64)"),
    ("--platform", "platform", None, "what the clusters run on: cpu, cuda or "
     "auto (default: detected, as kvpush up --platform)"),
    ("--dtype", "dtype", None, "model dtype (float32 on CPU, auto on CUDA)"),
    ("--max-model-len", "max_model_len", int, "per instance (4096)"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "per instance"),
    ("--kv-cache-space-gb", "kv_cache_space_gb", int, "per CPU instance (1)"),
    ("--gpu-memory-utilization", "gpu_memory_utilization", float, "CUDA: vLLM's "
     "--gpu-memory-utilization per instance (vLLM's default)"),
    ("--arrival", "arrival", None, "poisson (open loop, --qps) or concurrency"),
    ("--request-rate", "qps", None, "request rates to sweep, requests/s, "
     "Poisson arrivals (1,2,4,8; alias --qps)"),
    ("--max-concurrency", "max_concurrency", int, "cap on requests in flight "
     "at once, as vllm bench serve's: an arrival past it waits for a slot "
     "(default: no cap)"),
    ("--concurrency", "concurrency", None, "with --arrival concurrency: requests "
     "in flight to sweep, a closed loop (each sent when one ends)"),
    ("--prompt-len", "prompt_len", None, "N, A-B (uniform) or trace:FILE.jsonl (1000)"),
    ("--output-len", "output_len", None, "N, A-B or trace:FILE.jsonl (32)"),
    ("--prompt-len-sweep", "prompt_len_sweep", None, "sweep these prompt lengths "
     "instead, at a single load"),
    ("--num-prompts", "num_requests", int, "requests per sweep point (40; "
     "alias --num-requests)"),
    ("--num-warmup", "num_warmup", int, "warm-up requests per configuration (4)"),
    ("--shared-prefix-fraction", "shared_prefix_fraction", float,
     "leading fraction of each prompt shared by all requests of a point (0)"),
    ("--seed", "seed", int, "workload seed (0)"),
    ("--request-timeout-s", "request_timeout_s", float, "per request (120)"),
    ("--num-timeline-requests", "num_timeline_requests", int,
     "requests drawn in the timeline plot (8)"),
    ("--output", "output_dir", Path, "results directory (bench-results/<time>)"),
    ("--port", "port", int, "router port (28000)"),
    ("--base-http-port", "base_http_port", int, "first instance port (28100)"),
    ("--base-side-channel-port", "base_side_channel_port", int,
     "first NIXL side-channel port (29000)"),
    ("--startup-timeout-s", "startup_timeout_s", float, "per cluster (300)"),
    ("--hosts", "hosts", None, "local (default) or netns: each instance on its "
     "own rehearsal host (network namespace; needs root)"),
    ("--link-gbit", "link_gbit", None, "with --hosts netns: the hosts' shaped "
     "link rates in Gbit/s, e.g. 1,4,10; each rate a fresh set of clusters"),
    ("--workload", "workload", None, "sweep (default); skewed: the sweep with one "
     "decode kept busy by long plain requests; multi-turn: conversations; "
     "fragmented: long prompts on a fresh KV cache and again after a churn "
     "that scatters decode's free blocks, plain requests decoding meanwhile "
     "(defaults: --block-size 32, --model-preset kv-heavy, --kv-cache-space-gb "
     "2, --prompt-len 4000, --concurrency 1, --num-requests 4); saturation: "
     "decode-bound load past saturation, with goodput (defaults: --prompt-len "
     "1000, --output-len 256, --qps 2,4,8,12,16)"),
    ("--background-concurrency", "background_concurrency", int,
     "skewed, fragmented: plain requests kept in flight on the busy decode (2)"),
    ("--background-prompt-len", "background_prompt_len", int,
     "skewed, fragmented: their prompt tokens (64)"),
    ("--background-output-len", "background_output_len", int,
     "skewed, fragmented: their output tokens, ignore_eos (512)"),
    ("--background-decode", "background_decode", int,
     "skewed, fragmented: which decode is kept busy (0)"),
    ("--block-size", "block_size", int, "vLLM's --block-size on every instance "
     "(vLLM's default; the CPU backend takes multiples of 32)"),
    ("--churn-requests", "churn_requests", int,
     "fragmented: requests of the churn between the two points (64)"),
    ("--churn-concurrency", "churn_concurrency", int,
     "fragmented: churn requests in flight at once (8)"),
    ("--churn-prompt-len", "churn_prompt_len", None,
     "fragmented: churn prompt tokens, N or A-B (64-2048)"),
    ("--churn-output-len", "churn_output_len", None,
     "fragmented: churn output tokens, N or A-B (2-64)"),
    ("--churn-abort-fraction", "churn_abort_fraction", float,
     "fragmented: share of churn requests the client aborts after a random "
     "number of tokens, closing its connection (0.33)"),
    ("--num-conversations", "num_conversations", int, "multi-turn: conversations (4)"),
    ("--num-turns", "num_turns", int, "multi-turn: turns per conversation (6)"),
    ("--conversation-concurrency", "conversation_concurrency", int,
     "multi-turn: conversations in flight at once (2)"),
    ("--history-len", "history_len", int, "multi-turn: turn 1's prompt tokens (1200)"),
    ("--turn-len", "turn_len", int,
     "multi-turn: new user tokens per later turn (130, about 100 words)"),
    ("--slo-ttft-ms", "slo_ttft_ms", float, "saturation: a request meets the "
     "goodput SLO with TTFT at most this (250)"),
    ("--slo-tpot-ms", "slo_tpot_ms", float, "saturation: ... and TPOT at most "
     "this (20)"),
    ("--prefill-tp", "prefill_tp", int, "tensor-parallel ranks of every prefill, "
     "in every P/D configuration (1)"),
    ("--decode-tp", "decode_tp", int, "... of every decode (1)"),
    ("--colocated-tp", "colocated_tp", int, "... of the colocated instance (1)"),
    ("--prefill-dp", "prefill_dp", int, "data-parallel engines of every prefill, "
     "in every P/D configuration (1)"),
    ("--decode-dp", "decode_dp", int, "... of every decode (1)"),
    ("--repeat", "repeat", int, "rounds: every configuration once per round, "
     "in the same order (A B C D, A B C D, ...), each on a fresh cluster; ratios "
     "to vllm-pull as median [min-max] over rounds (1; with --publish "
     f"{PUBLISH_REPEAT})"),
    ("--share-kvpush-cluster", "share_kvpush_cluster", _yes_no,
     "yes|no: run the kvpush configurations on one cluster, a router each "
     "(default: yes for skewed and multi-turn)"),
    ("--base-url", "base_url", None, "measure the deployment already running "
     "at URL (kvpush's router or any OpenAI-compatible server; its "
     "/v1/completions): no cluster is started, one configuration; with it "
     "--model NAME is the requests' model field (default: the first of "
     "URL/v1/models)"),
    ("--label", "label", None, "with --base-url: the configuration's name in "
     "the report (default: HOST:PORT of the URL)"),
    ("--tokenizer", "tokenizer", Path, "with --base-url: a local model "
     "directory whose vocabulary the prompts' token ids come from (default: "
     "the served model's, where its id is a local directory, else ids "
     "1000-1999)"),
)  # fmt: skip
# Older flag names that stay: alias -> the flag it stands for.
ALIASES = {"--qps": "--request-rate", "--num-requests": "--num-prompts"}
_NOT_IN_COMMAND = ("output_dir",)


def main(argv: list[str]) -> int:
    """``kvpush bench ARGV``: the ``kvpush.commands`` entry point."""
    return run_subcommand(add_parser, ["bench", *argv])


def add_parser(sub: Any) -> None:
    """Add ``bench`` to the ``kvpush`` command's subparsers."""
    p = sub.add_parser(
        "bench",
        help="compare configurations side by side on one workload",
        description=(
            "Run each configuration in turn (fresh cluster, warm-up, the same "
            "requests) and write raw records, summary.json, results.json, "
            "report.md and plots. "
            "With --base-url URL, measure a deployment that is already running "
            "instead, starting nothing."
        ),
    )
    p.add_argument("--preset", choices=sorted(PRESETS), help="base settings (default)")
    p.add_argument(
        "--quick", action="store_const", const="quick", dest="preset",
        help="the CI preset: one point, a handful of short requests",
    )  # fmt: skip
    p.add_argument("--config", type=Path, help="JSON or TOML file of settings")
    for flag, dest, kind, text in _FLAGS:
        p.add_argument(flag, dest=dest, type=kind, help=text, metavar=_metavar(dest))
    for alias, flag in ALIASES.items():
        dest, kind = _dest_of(flag)
        p.add_argument(alias, dest=_alias_dest(dest), type=kind, help=argparse.SUPPRESS)
    p.add_argument(
        "--publish", nargs="?", const=Path("."), type=Path, metavar="ROOT",
        help="also replace ROOT/docs/bench/SECTION/ (results.json and the "
        "plots) and render ROOT/BENCHMARKS.md again from every section (ROOT: .)",
    )  # fmt: skip
    p.add_argument(
        "--section", metavar="NAME",
        help="the run's section name in results.json and under docs/bench "
        "(default: the workload's, e.g. qps-sweep, saturation)",
    )  # fmt: skip
    p.add_argument("--title", help="the report's title")
    p.add_argument(
        "--render", type=Path, metavar="DIR",
        help="redo report and plots of an earlier run in DIR; runs nothing",
    )  # fmt: skip
    p.set_defaults(func=run_command)


def _dest_of(flag: str) -> tuple[str, Any]:
    return next((d, kind) for f, d, kind, _ in _FLAGS if f == flag)


def _alias_dest(dest: str) -> str:
    return f"{dest}_by_alias"


def _flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The BenchConfig fields the flags gave; ValueError where a flag and its
    alias (``--request-rate`` and ``--qps``) give different values."""
    values = {
        dest: getattr(args, dest)
        for _, dest, _, _ in _FLAGS
        if getattr(args, dest) is not None
    }
    for alias, flag in ALIASES.items():
        dest, _ = _dest_of(flag)
        value = getattr(args, _alias_dest(dest), None)
        if value is None:
            continue
        if dest in values and make_config({dest: values[dest]}) != make_config(
            {dest: value}
        ):
            raise ValueError(
                f"{flag} {values[dest]} and its alias {alias} {value} differ; "
                "give one of them"
            )
        values[dest] = value
    return values


def _metavar(dest: str) -> str:
    if dest in ("configs", "qps", "concurrency", "prompt_len_sweep", "link_gbit"):
        return "LIST"
    if dest in ("prompt_len", "output_len"):
        return "LENGTHS"
    if dest in ("model", "output_dir", "tokenizer"):
        return "DIR"
    if dest.startswith("num_") or dest in ("seed", "max_concurrency"):
        return "N"
    return "S" if dest.endswith("_s") else dest.rsplit("_", 1)[-1].upper()


def command_line(args: argparse.Namespace) -> str:
    """The flags given, as a command (output location left out)."""
    words = ["kvpush", "bench"]
    if args.preset:
        words += ["--preset", args.preset]
    if args.config:
        words += ["--config", str(args.config)]
    values = _flag_values(args)
    for flag, dest, _, _ in _FLAGS:
        value = values.get(dest)
        if value is not None and dest not in _NOT_IN_COMMAND:
            words += [flag, str(value)]
    if args.publish is not None:
        words += ["--publish"] + (
            [] if args.publish == Path(".") else [str(args.publish)]
        )
    for flag, value in (("--section", args.section), ("--title", args.title)):
        if value is not None:
            words += [flag, value]
    return shlex.join(words)


def config_from_args(args: argparse.Namespace) -> Any:
    """Preset, then file, then flags; a --publish run repeats
    ``PUBLISH_REPEAT`` rounds unless a layer sets ``repeat`` (or it measures
    a ``--base-url``, which has no rounds)."""
    layers = [preset(args.preset or "default")]
    if args.config:
        layers.append(load_config_file(args.config))
    layers.append(_flag_values(args))
    measures_endpoint = any(layer.get("base_url") is not None for layer in layers)
    if (
        getattr(args, "publish", None) is not None
        and not measures_endpoint  # rounds need clusters of their own
        and not any("repeat" in layer for layer in layers)
    ):
        layers.append({"repeat": PUBLISH_REPEAT})
    return make_config(*layers)


def run_command(args: argparse.Namespace) -> int:
    from kvpush_lab.bench.outputs import publish, write_outputs
    from kvpush_lab.bench.results import check_section_name
    from kvpush_lab.bench.screen import print_summary
    from kvpush_lab.bench.summary import load_summary

    console = Console()
    if args.section is not None:
        check_section_name(args.section)
    if args.render:
        out_dir, summary = args.render, load_summary(args.render)
    else:
        out_dir, summary = _run(args, console)
    files = write_outputs(out_dir, summary, args.title, args.section)
    if args.publish is not None:
        files += publish(out_dir, summary, args.publish, args.section, args.title)
    print_summary(console, summary, files)
    return 0 if all(c.status == "ok" for c in summary.configs) else 1


def _run(args: argparse.Namespace, console: Console) -> tuple[Path, Any]:
    from kvpush_lab.bench.runner import prepare, run_bench

    config = config_from_args(args)
    if config.base_url is not None:
        return _run_endpoint(args, config, console)
    plan = prepare(config, console)
    each = _each(config, len(plan.points))
    console.print(
        f"benchmarking {', '.join(config.configs)}: {each}; results in {plan.out_dir}"
    )
    return plan.out_dir, run_bench(plan, console, command_line(args))


def _run_endpoint(
    args: argparse.Namespace, config: Any, console: Console
) -> tuple[Path, Any]:
    from kvpush_lab.bench.endpoint import prepare_endpoint, run_endpoint

    plan = prepare_endpoint(config, console)
    console.print(
        f"benchmarking {plan.url} as {config.endpoint_label} (model "
        f"{plan.served_model}): {_each(config, len(plan.points))}; no cluster "
        f"started; results in {plan.out_dir}"
    )
    return plan.out_dir, run_endpoint(plan, console, command_line(args))


def _each(config: Any, num_points: int) -> str:
    if config.workload == "multi-turn":
        return f"{config.num_conversations} conversations x {config.num_turns} turns"
    return f"{num_points} points x {config.num_requests} requests each"
