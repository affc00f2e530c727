"""The launcher's command-line options: those every instance takes (shared
by ``kvpush up`` and ``kvpush serve``) and ``kvpush serve`` itself."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from kvpush.connector.config import NIXL_BACKENDS, PUSH_GRANULARITIES
from kvpush.launcher.config import DTYPES, FAILURE_POLICIES
from kvpush.launcher.platform import PLATFORM_CHOICES, resolve_platform
from kvpush.settings_file import read_settings_file
from kvpush.topology import MODES
from kvpush.transfer.digest import VERIFY_MODES

# Options of add_instance_options, as config fields (ClusterConfig and
# ServeConfig share them).
INSTANCE_KEYS = (
    "model", "host", "advertise_host", "side_channel_host",
    "side_channel_advertise_host", "run_dir", "dtype", "max_model_len",
    "max_num_batched_tokens", "kv_cache_space_gb", "kv_load_failure_policy",
    "registration_ttl_s", "ready_ttl_s", "peer_timeout_s", "fault_injection",
    "nixl_backend", "ucx_net_devices", "insecure_side_channel",
    "side_channel_secret_file", "push_granularity", "verify_kv",
    "verify_kv_sample", "platform", "gpu_memory_utilization", "kv_both",
)  # fmt: skip


def add_instance_options(p: argparse.ArgumentParser) -> None:
    """Options of every vLLM instance; unset ones keep the config's default."""
    p.add_argument("--model", help="model directory (default: the tiny model)")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--advertise-host",
        help="address others reach this host at, written to the topology "
        "(default: --host; required when --host is 0.0.0.0)",
    )
    p.add_argument(
        "--side-channel-host",
        help="address kvpush's side channel listens on (default: --host)",
    )
    p.add_argument(
        "--side-channel-advertise-host",
        help="side-channel address decode connects to (default: "
        "--side-channel-host when it is an address, else --advertise-host); "
        "vLLM's baselines listen on this one",
    )
    p.add_argument("--run-dir", type=Path, help="logs, traces and state")
    p.add_argument(
        "--platform",
        choices=PLATFORM_CHOICES,
        help="what vLLM runs on: cpu or cuda; auto (default): cpu with vLLM's "
        "CPU build, cuda with its CUDA build, without vLLM cuda when an "
        "NVIDIA GPU is visible",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="default float32 on CPU, auto (the model's) on CUDA; on CPU auto "
        "runs a float32 model in bfloat16",
    )
    p.add_argument(
        "--max-model-len", type=int, help="default 4096 on CPU, the model's on CUDA"
    )
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument(
        "--kv-cache-space-gb",
        type=int,
        help="CPU: VLLM_CPU_KVCACHE_SPACE per instance (default 1)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="CUDA: vLLM's --gpu-memory-utilization (default: vLLM's)",
    )
    p.add_argument(
        "--kv-load-failure-policy",
        choices=FAILURE_POLICIES,
        help="when KV does not arrive, decode recomputes it (default) or errors",
    )
    for flag, default in (("registration", 60), ("ready", 30), ("peer-timeout", 10)):
        name = flag if flag == "peer-timeout" else f"{flag}-ttl"
        p.add_argument(
            f"--{name}-s", type=float, help=f"kvpush deadline (default {default} s)"
        )
    p.add_argument(
        "--fault-injection",
        action="store_true",
        default=None,
        help="tests only: connectors obey RUN_DIR/faults.json",
    )
    p.add_argument(
        "--nixl-backend",
        choices=NIXL_BACKENDS,
        help="NIXL transport (default UCX; LIBFABRIC for AWS EFA)",
    )
    p.add_argument(
        "--push-granularity",
        choices=PUSH_GRANULARITIES,
        help="kvpush: auto (default: per layer where a chunk's KV per layer "
        "reaches layer_push_min_bytes, else per chunk), push each prompt whole "
        "(request), per prefill chunk (chunk) or per chunk and layer (layer)",
    )
    p.add_argument(
        "--verify-kv",
        choices=VERIFY_MODES,
        help="kvpush: KV digests, checked by decode before it uses the KV "
        "(a mismatch recomputes or errors, by --kv-load-failure-policy): off "
        "(default), sample (--verify-kv-sample of transfers) or all",
    )
    p.add_argument(
        "--kv-both",
        action="store_true",
        default=None,
        help="kvpush: give every instance kv_role kv_both (as vLLM's NIXL "
        "deployments do): each serves prefill legs and decode legs alike, "
        "whichever a router sends it",
    )
    p.add_argument(
        "--verify-kv-sample",
        type=float,
        help="kvpush: the fraction of transfers --verify-kv sample checks "
        "(default 0.01)",
    )
    p.add_argument(
        "--ucx-net-devices",
        help="UCX_NET_DEVICES of the instance: the NIC(s) UCX may use, "
        "e.g. mlx5_0:1 (kvpush and the baselines)",
    )
    p.add_argument(
        "--insecure-side-channel",
        action="store_true",
        default=None,
        help="let a kvpush side channel listen off loopback without a secret",
    )
    p.add_argument(
        "--side-channel-secret-file",
        type=Path,
        help="file holding the side-channel secret (instead of exporting "
        "KVPUSH_SIDE_CHANNEL_SECRET); read once, never put on a command line",
    )
    p.add_argument(
        "--config", type=Path, help="JSON or TOML file of these settings; flags win"
    )


def given(args: argparse.Namespace, keys: tuple[str, ...]) -> dict[str, Any]:
    """The options among ``keys`` that were given on the command line."""
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def add_serve_options(p: argparse.ArgumentParser) -> None:
    """``kvpush serve``'s description and options, on its parser."""
    p.description = (
        "Run one vLLM instance with its connector configured, "
        "in the foreground; vLLM options go after '--'."
    )
    p.add_argument("--role", choices=("prefill", "decode", "colocated"), required=True)
    p.add_argument(
        "--mode",
        choices=MODES,
        help="P/D transfer (default kvpush; colocated for --role colocated)",
    )
    p.add_argument("--name", help="engine id (default <role>-<advertise host>-<port>)")
    p.add_argument("--port", type=int, help="HTTP port (default 8100)")
    p.add_argument(
        "--side-channel-port", type=int, help="side-channel port (default 5600)"
    )
    p.add_argument(
        "--kv-events-endpoint",
        help="kvpush decode: tcp://ROUTER_HOST:PORT where the router listens "
        "for its vLLM KV cache events (one port per DP engine from PORT); "
        "named in its topology entries (default: none)",
    )
    p.add_argument("--core", type=int, help="pin the instance to this CPU")
    p.add_argument(
        "--cores",
        type=core_list,
        help="comma-separated CPUs its TP ranks are bound to, rank r to the "
        "r-th (wrapping around when there are fewer CPUs than ranks)",
    )
    p.add_argument(
        "--tp", type=int, help="tensor-parallel size: worker ranks (default 1)"
    )
    p.add_argument(
        "--dp",
        type=int,
        help="data-parallel size: engines behind this HTTP port (vLLM's "
        "--data-parallel-size; default 1); with --dp-rank, the DP group's size",
    )
    p.add_argument(
        "--dp-rank",
        type=int,
        help="serve only this rank of the --dp group, on this HTTP port "
        "(vLLM's external load balancing, mixture-of-experts models): one "
        "kvpush serve per rank, each with the same --name and "
        "--side-channel-port; vLLM's coordination flags go after '--'",
    )
    add_instance_options(p)
    p.add_argument(
        "--print-command",
        action="store_true",
        help="print the equivalent shell line (environment, then vLLM) and exit",
    )
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- vLLM options")
    p.set_defaults(func=cmd_serve)


_SERVE_ONLY = (
    "role", "mode", "name", "port", "side_channel_port", "core", "cores", "tp",
    "dp", "dp_rank", "kv_events_endpoint",
)  # fmt: skip


def core_list(text: str) -> tuple[int, ...]:
    """``--cores 0,1`` as CPU numbers."""
    return _numbers(text, "--cores takes CPU numbers")


def gpu_list(text: str) -> tuple[int, ...]:
    """``--gpus 0,1`` as GPU numbers."""
    return _numbers(text, "--gpus takes GPU numbers")


def _numbers(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(c) for c in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"{what} separated by commas, not {text!r}"
        ) from e


def serve_config(args: argparse.Namespace) -> Any:
    """The ServeConfig from an optional file overlaid with given flags."""
    from kvpush.launcher.serve import ServeConfig

    values: dict[str, Any] = read_settings_file(args.config) if args.config else {}
    known = {f.name for f in dataclasses.fields(ServeConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"config file {args.config}: unknown keys {unknown}")
    values.update(given(args, _SERVE_ONLY + INSTANCE_KEYS))
    values["platform"] = resolve_platform(values.get("platform", "auto"))
    values.setdefault(
        "mode", "colocated" if values.get("role") == "colocated" else "kvpush"
    )
    extra = list(args.vllm_args or [])
    if extra[:1] == ["--"]:
        extra = extra[1:]
    if extra:
        values["extra_vllm_args"] = tuple(extra)
    for key in ("run_dir", "side_channel_secret_file"):
        if values.get(key) is not None:
            values[key] = Path(values[key]).expanduser()
    if "cores" in values:
        values["cores"] = tuple(values["cores"])
    if values.get("model") is not None:
        values["model"] = str(values["model"])
    try:
        return ServeConfig(**values)
    except TypeError as e:
        raise ValueError(f"bad serve setting: {e}") from e


def cmd_serve(args: argparse.Namespace) -> int:
    from kvpush.launcher.cluster import read_secret, tiny_model
    from kvpush.launcher.instances import check_dp_fits_model, check_tp_fits_model
    from kvpush.launcher.serve import model_path, print_command, serve

    config = serve_config(args)
    config.check_startable()
    model = model_path(config, tiny_model)
    check_tp_fits_model(model, {config.engine_id: config.tp})
    check_dp_fits_model(model, config.platform, [config.spec()])
    if args.print_command:
        print(print_command(config, model))
        return 0
    secret = read_secret(config)
    import msgspec

    entries = [msgspec.json.encode(b).decode() for b in config.backends()]
    print(
        f"kvpush serve: {config.engine_id}; topology entries:\n  "
        + "\n  ".join(entries),
        file=sys.stderr,
    )
    serve(config, model, secret)
    return 0
