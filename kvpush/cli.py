"""The ``kvpush`` command: make-model, up, serve, down, status, router,
drain, forget, and the lab's bench, bench-micro, project, soak (``kvpush[bench]``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvpush import env
from kvpush.commands import (
    LAB_COMMANDS,
    optional_commands,
    run_optional,
    run_parsed,
)

RUN_DIR_HELP = (
    "run directory of the cluster (default: $KVPUSH_RUN_DIR or $KVPUSH_HOME/run)"
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else ""
    if _is_optional(command):  # the lab's (an entry point): it parses its options
        return run_optional(command, argv[1:])
    return run_parsed(_parser(argv[:1]).parse_args(argv))


def _is_optional(command: str) -> bool:
    """Whether ``command`` is one of the ``kvpush.commands`` entry points,
    installed or not (the lab's), rather than the product's own."""
    if command in _COMMANDS or not command or command.startswith("-"):
        return False
    return command in LAB_COMMANDS or command in optional_commands()


def _installed_version() -> str:
    """The installed distribution's version (the source tree's when run
    from a checkout that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvpush")
    except PackageNotFoundError:
        from kvpush import __version__

        return __version__


def _parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """Every subcommand is listed; only those in ``commands`` (all when None)
    get their options, whose modules are imported to add them: so
    ``kvpush --help`` imports none of them (nor torch)."""
    chosen = set(_COMMANDS if commands is None else commands)
    parser = argparse.ArgumentParser(prog="kvpush", description=__doc__)
    parser.add_argument(
        "--version", action="version", version=f"kvpush {_installed_version()}"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_options) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name in chosen:
            add_options(p)
    for name, help_text in LAB_COMMANDS.items():
        lab = sub.add_parser(
            name,
            help=help_text,
            add_help=False,  # its own parser (the entry point's) answers --help
        )
        lab.set_defaults(func=None)  # handed over whole in main()
    return parser


def _add_down(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", type=Path, help=RUN_DIR_HELP)
    p.set_defaults(func=_cmd_down)


def _add_status(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", type=Path, help=RUN_DIR_HELP)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_status)


def _add_router(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--topology",
        type=Path,
        required=True,
        help="topology JSON: written by 'up', or by hand for remote instances "
        "(format: kvpush/topology.py)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    _add_router_health_options(p)
    _add_router_routing_options(p)
    p.set_defaults(func=_cmd_router)


def _add_serve(p: argparse.ArgumentParser) -> None:
    from kvpush.launcher.cli import add_serve_options

    add_serve_options(p)


def _add_router_health_options(p: argparse.ArgumentParser) -> None:
    """Fault-tolerance options; unset ones keep RouterConfig's defaults."""
    p.add_argument(
        "--health-interval-s",
        type=float,
        help="seconds between health probes of each instance (default 1.0)",
    )
    p.add_argument(
        "--unhealthy-after",
        type=int,
        help="consecutive failed probes before an instance is avoided (default 2)",
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        help="attempts per request, retries on other instances included "
        "(default 2; 1 disables retries)",
    )


ROUTING_OPTIONS = (
    "binding",
    "skip_max_new_tokens",
    "late_min_busy",
    "block_size",
    "prefix_index_entries",
    "session_header",
    "signal_interval_s",
    "signal_max_age_s",
    "first_token_from",
    "state_model",
)


def _add_router_routing_options(p: argparse.ArgumentParser) -> None:
    """kvpush mode's routing options; unset ones keep RoutingConfig's defaults."""
    p.add_argument(
        "--binding",
        choices=["auto", "early", "late", "skip"],
        help="kvpush mode: auto decides per request (no prefill leg when the "
        "chosen decode has few tokens to compute, late when every decode is "
        "busy, else early), early always sends both legs at once, late sends "
        "the prefill leg first and chooses the decode when its KV is ready, "
        "skip never sends a prefill leg (default auto; other modes always "
        "bind early)",
    )
    p.add_argument(
        "--first-token-from",
        choices=["prefill", "decode"],
        help="kvpush mode: a streamed request with a prefill leg gets its "
        "first token from prefill's answer, as soon as it comes, or from "
        "decode (default prefill)",
    )
    p.add_argument(
        "--state-model",
        action="store_true",
        default=None,
        help="kvpush mode: the model keeps per-request state (Mamba, gated "
        "delta net, short conv layers): send a request whose decode would "
        "compute its prompt again (min_tokens, penalties, structured output) "
        "to decode alone ('kvpush up' sets it from the model's config)",
    )
    p.add_argument(
        "--skip-max-new-tokens",
        type=int,
        help="auto: skip the prefill leg when decode would compute at most this "
        "many tokens itself (default 256)",
    )
    p.add_argument(
        "--late-min-busy",
        type=float,
        help="auto: bind late when the chosen decode's busy score (requests "
        "running + waiting, +waiting, +100 near a full KV cache) is above this "
        "(default 4)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        help="tokens per block of the router's prefix index: the decodes' vLLM "
        "--block-size (default 128, vLLM's CPU default)",
    )
    p.add_argument(
        "--prefix-index-entries",
        type=int,
        help="bound of the prefix index, in (decode, block) entries; least "
        "recently used evicted (default 65536, about 7 MB)",
    )
    p.add_argument(
        "--session-header",
        help="request header naming a conversation for decode affinity; the "
        "OpenAI 'user' field is the fallback (default x-session-id)",
    )
    p.add_argument(
        "--signal-interval-s",
        type=float,
        help="seconds between reads of each instance's /metrics (default 1.0)",
    )
    p.add_argument(
        "--signal-max-age-s",
        type=float,
        help="a read older than this counts as unknown load (default 3.0)",
    )


def _add_drain(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="the instance's engine id (kvpush status)")
    p.add_argument(
        "--router",
        default="http://127.0.0.1:8000",
        help="the router's URL (default http://127.0.0.1:8000)",
    )
    p.add_argument(
        "--wait",
        action="store_true",
        help="wait until no request is in flight on it",
    )
    p.add_argument(
        "--timeout-s", type=float, default=600.0, help="--wait deadline (600)"
    )
    p.add_argument(
        "--undrain", action="store_true", help="route new requests to it again"
    )
    p.set_defaults(func=_cmd_drain)


def _cmd_drain(args: argparse.Namespace) -> int:
    from kvpush.router.admin_client import drain

    wait_s = args.timeout_s if args.wait else None
    drain(args.router, args.name, undrain=args.undrain, wait_s=wait_s)
    return 0


def _add_forget(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Tell decode that a prefill is gone for good (its host is confirmed "
        "down): its pending receives fail and its quarantined blocks are "
        "released. Never needed for a prefill on decode's own host, nor for "
        "one that restarts (a new boot id proves it)."
    )
    p.add_argument("engine_id", help="the prefill's engine id (kvpush status)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--run-dir", type=Path, help=RUN_DIR_HELP)
    where.add_argument(
        "--control-dir",
        type=Path,
        help="one decode's kv_connector_extra_config.control_dir (an "
        "instance not started by 'kvpush up')",
    )
    p.add_argument("--yes", action="store_true", help="do not ask to confirm")
    p.set_defaults(func=_cmd_forget)


def _cmd_forget(args: argparse.Namespace) -> int:
    from kvpush.connector.control import write_forget
    from kvpush.launcher.forget import meaning, targets

    run_dir = None
    if args.control_dir is None:
        run_dir = args.run_dir or env.default_run_dir()
    dirs = targets(args.engine_id, run_dir=run_dir, control_dir=args.control_dir)
    if not dirs:
        print(f"no decode instance in {run_dir}: nothing written", file=sys.stderr)
        return 1
    if not args.yes:
        print(meaning(args.engine_id), file=sys.stderr)
        try:
            answer = input(f"forget prefill {args.engine_id}? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing written", file=sys.stderr)
            return 1
    for control_dir in dirs:
        print(f"wrote {write_forget(control_dir, args.engine_id)}")
    print(meaning(args.engine_id))
    return 0


def _add_make_model(p: argparse.ArgumentParser) -> None:
    from kvpush.model.presets import PRESETS

    p.add_argument("dir", type=Path, help="output directory")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (default 2)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="a named shape instead of the flags: kv-heavy is 8 layers, 8 KV "
        "heads of 128, hidden 256 (64 KiB of KV per token, 32x tiny)",
    )
    p.set_defaults(func=_cmd_make_model)


def _add_up(p: argparse.ArgumentParser) -> None:
    from kvpush.launcher.cli import add_instance_options, gpu_list
    from kvpush.launcher.config import HOSTS
    from kvpush.model.presets import PRESETS
    from kvpush.topology import MODES

    p.add_argument("--mode", choices=MODES, help="cluster mode (default vllm-pull)")
    p.add_argument(
        "--prefill", dest="num_prefill", type=int, help="prefill instances (default 1)"
    )
    p.add_argument(
        "--decode", dest="num_decode", type=int, help="decode instances (default 1)"
    )
    for role in ("prefill", "decode", "colocated"):
        p.add_argument(
            f"--{role}-tp",
            type=int,
            help=f"tensor-parallel ranks of each {role} instance (default 1)",
        )
    for role in ("prefill", "decode"):
        p.add_argument(
            f"--{role}-dp",
            type=int,
            help=f"data-parallel engines of each {role} instance, behind its one "
            "HTTP port; each is an endpoint the router pins legs to (default 1)",
        )
    p.add_argument("--port", type=int, help="router port (default 8000)")
    p.add_argument(
        "--base-http-port", type=int, help="first instance HTTP port (default 8100)"
    )
    p.add_argument(
        "--base-side-channel-port",
        type=int,
        help="first NIXL side-channel port (default 5600); instance i owns "
        "one port per rank from base + i * (the cluster's largest DP x TP)",
    )
    p.add_argument(
        "--base-kv-events-port",
        type=int,
        help="kvpush mode: first port the decodes publish vLLM's KV cache "
        "events on (default 5800), one per DP engine",
    )
    p.add_argument(
        "--no-kv-events",
        dest="kv_events",
        action="store_false",
        default=None,
        help="kvpush mode: the decodes publish no KV cache events (the "
        "router then knows only the prompts it sent them)",
    )
    p.add_argument("--startup-timeout-s", type=float)
    p.add_argument(
        "--hosts",
        choices=HOSTS,
        help="local (default), or netns: rehearse several hosts on this "
        "machine, each instance in its own network namespace (root only)",
    )
    p.add_argument(
        "--link-gbit",
        type=float,
        help="with --hosts netns: shape each host's egress to this rate (tbf)",
    )
    p.add_argument(
        "--binding",
        choices=["auto", "early", "skip"],
        help="kvpush mode: the router's --binding (default: the router's, auto)",
    )
    p.add_argument(
        "--first-token-from",
        choices=["prefill", "decode"],
        help="kvpush mode: the router's --first-token-from (default: the "
        "router's, prefill)",
    )
    p.add_argument(
        "--gpus",
        type=gpu_list,
        help="CUDA: comma-separated GPUs the instances take in turn, TP-many "
        "each, as their CUDA_VISIBLE_DEVICES (default 0,1,2,...; an exported "
        "CUDA_VISIBLE_DEVICES is replaced)",
    )
    p.add_argument(
        "--model-preset",
        choices=sorted(PRESETS),
        help="serve a named model shape, made on first use under "
        "$KVPUSH_HOME/models (kv-heavy: 64 KiB of KV per token; on CPU it also "
        "sets --kv-cache-space-gb 4 and --max-model-len 8192 unless given)",
    )
    add_instance_options(p)
    p.set_defaults(func=_cmd_up)


def _cmd_make_model(args: argparse.Namespace) -> int:
    from kvpush.model import ModelSpec, make_model
    from kvpush.model.presets import preset

    if args.preset is not None:
        out = make_model(args.dir, preset(args.preset).spec)
        print(f"model written to {out}")
        return 0
    spec = ModelSpec(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        seed=args.seed,
        dtype=args.dtype,
    )
    out = make_model(args.dir, spec)
    print(f"model written to {out}")
    return 0


# up's own options; up_config adds the TP ranks' and every instance's.
_UP_KEYS = (
    "mode", "num_prefill", "num_decode", "port", "base_http_port",
    "base_side_channel_port", "base_kv_events_port", "kv_events",
    "startup_timeout_s", "hosts", "link_gbit", "binding", "first_token_from",
    "gpus",
)  # fmt: skip


def up_config(args: argparse.Namespace) -> Any:
    """The ClusterConfig from an optional file overlaid with given flags."""
    from kvpush.launcher.cli import INSTANCE_KEYS
    from kvpush.launcher.config import DP_KEYS, TP_KEYS, load_config_file, make_config
    from kvpush.launcher.platform import resolve_platform

    values: dict[str, Any] = load_config_file(args.config) if args.config else {}
    keys = (*_UP_KEYS, *TP_KEYS, *DP_KEYS, *INSTANCE_KEYS)
    values.update({k: getattr(args, k) for k in keys if getattr(args, k) is not None})
    values["platform"] = resolve_platform(values.get("platform", "auto"))
    if getattr(args, "model_preset", None) is not None:
        _apply_model_preset(values, args.model_preset)
    if values.get("mode") == "colocated":
        values.setdefault("num_prefill", 0)
        values.setdefault("num_decode", 0)
    return make_config(values)


def _apply_model_preset(values: dict[str, Any], name: str) -> None:
    """The preset's model (made on first use) and the CPU sizes and dtype
    it needs (on CUDA the model's context, dtype and vLLM's GPU memory do),
    unless the file or the flags gave them."""
    from kvpush.launcher.platform import Platform
    from kvpush.model.presets import ensure_preset, preset

    if values.get("model") is not None:
        raise ValueError("give --model or --model-preset, not both")
    chosen = preset(name)
    print(f"kvpush: model preset {name} (made on first use)", file=sys.stderr)
    values["model"] = ensure_preset(env.kvpush_home(), name)
    if values["platform"] == Platform.CPU:
        values.setdefault("kv_cache_space_gb", chosen.kv_cache_space_gb)
        values.setdefault("max_model_len", chosen.max_model_len)
        values.setdefault("dtype", chosen.spec.dtype)  # gdn: bfloat16 only


def _cmd_up(args: argparse.Namespace) -> int:
    from kvpush.launcher import up

    state = up(up_config(args))
    print(f"kvpush {state.mode} cluster ready; router at {state.router_url}")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from kvpush.launcher import down

    run_dir = args.run_dir or env.default_run_dir()
    stopped = down(run_dir)
    print(
        f"stopped {', '.join(stopped)}" if stopped else f"nothing running in {run_dir}"
    )
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from kvpush.launcher import status

    run_dir = args.run_dir or env.default_run_dir()
    info = status(run_dir)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0 if info else 1
    if info is None:
        print(f"nothing running in {run_dir}")
        return 1
    print(f"mode {info['mode']}  router {info['router_url']}  model {info['model']}")
    for p in info["processes"]:  # type: ignore[attr-defined]
        side = p["side_channel_port"] if p["side_channel_port"] is not None else "-"
        alive = "up" if p["alive"] else "DOWN"
        ranks = f"tp {p['tp']} dp {p['dp']}" if p["role"] != "router" else ""
        print(
            f"  {p['name']:<10} {p['role']:<9} {p['url']:<26} side {side!s:<6} "
            f"{ranks:<10} host {p['host']:<22} pid {p['pid']:<7} {alive:<4} "
            f"{p['log_path']}"
        )
    return 0


def _cmd_router(args: argparse.Namespace) -> int:
    from kvpush.router import RouterConfig, run_router
    from kvpush.router.config import RoutingConfig
    from kvpush.topology import load_topology

    options = {
        name: getattr(args, name)
        for name in (
            "health_interval_s",
            "unhealthy_after",
            "max_attempts",
        )
        if getattr(args, name) is not None
    }
    routing = {
        name: getattr(args, name)
        for name in ROUTING_OPTIONS
        if getattr(args, name) is not None
    }
    config = RouterConfig(
        topology=load_topology(args.topology),
        host=args.host,
        port=args.port,
        routing=RoutingConfig(**_routing_values(routing)),
        **options,
    )
    run_router(config)
    return 0


def _routing_values(options: dict[str, Any]) -> dict[str, Any]:
    """The routing options as RoutingConfig takes them (enums for names)."""
    from kvpush.router.config import FirstTokenFrom

    if "first_token_from" in options:
        options = {
            **options,
            "first_token_from": FirstTokenFrom(options["first_token_from"]),
        }
    return options


# The product's subcommands, in ``kvpush --help``'s order: name -> (help line,
# what adds its options; modules it needs are imported there, when chosen).
_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "make-model": ("build the tiny local Qwen3 model", _add_make_model),
    "up": ("start a local cluster in the background", _add_up),
    "serve": (
        "run one vLLM instance in the foreground (systemd, Kubernetes)",
        _add_serve,
    ),
    "down": ("stop the cluster that 'up' started", _add_down),
    "status": ("list the running cluster's processes", _add_status),
    "router": ("run the OpenAI-compatible router in the foreground", _add_router),
    "drain": (
        "stop routing new requests to an instance (rolling restarts)",
        _add_drain,
    ),
    "forget": (
        "tell decode a prefill whose host is down is gone (frees its blocks)",
        _add_forget,
    ),
}
