"""``kvpush serve``: one vLLM instance in the foreground, for one host.

For systemd units and Kubernetes pods: the same plan ``kvpush up`` makes for
each instance of a local cluster (:mod:`kvpush.launcher.instances`), for one
instance with the addresses of a real host. :func:`serve` replaces this
process with vLLM's API server (``exec``), so the service manager's SIGTERM
reaches vLLM itself; :func:`print_command` renders the same plan as one
shell line for users who start vLLM themselves.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvpush.connector.config import DEFAULT_PUSH_GRANULARITY
from kvpush.launcher.config import (
    Addresses,
    check_dp,
    check_instance_settings,
    check_secret,
    check_tp_size,
    set_platform,
)
from kvpush.launcher.instances import (
    InstanceSpec,
    instance_command,
    instance_env,
    instance_env_vars,
    rank_cores,
    serves_prefill_legs,
)
from kvpush.launcher.platform import Platform
from kvpush.side_channel_auth import SECRET_ENV
from kvpush.topology import Backend, Role, check_kv_events_endpoint
from kvpush.transfer.digest import DEFAULT_VERIFY_KV

ROLES: tuple[str, ...] = ("prefill", "decode", "colocated")
_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class ServeConfig:
    """One instance to serve on this host.

    ``role`` prefill, decode or colocated; ``mode`` the P/D transfer
    (kvpush, vllm-pull, vllm-push) or colocated. ``name`` is its engine id
    (default ``<role>-<advertised host>-<port>``, unique across hosts).
    ``host``/``advertise_host``/``side_channel_host``/
    ``side_channel_advertise_host``: see
    :class:`kvpush.launcher.config.Addresses`. ``port`` is its HTTP port,
    ``side_channel_port`` its side channel's (with ``tp`` ranks, it owns
    ``side_channel_port .. + tp - 1``). ``tp`` is its tensor-parallel size.
    ``dp`` > 1: it runs that many data-parallel engines behind its one HTTP
    port (vLLM's internal load balancer), each an endpoint of its own
    (``<name>_dp<d>``, side-channel ports from ``side_channel_port + d *
    tp``); with ``dp_rank`` it is DP rank ``dp_rank`` of ``dp`` alone, on
    an HTTP port of its own (vLLM's external load balancing: one
    ``kvpush serve`` per rank, all with the same ``name`` and
    ``side_channel_port``; vLLM allows it for mixture-of-experts models).
    ``kv_events_endpoint`` (a kvpush decode; None: none):
    ``tcp://ROUTER_HOST:PORT``, where the router listens for its engines'
    vLLM KV cache events (DP rank ``d`` on ``PORT + d``); its topology
    entries name it.
    ``cores`` the CPUs its ranks are bound to, rank ``r`` to
    ``cores[r % len(cores)]`` (as ``kvpush up`` binds a cluster's ranks);
    ``core`` is short for ``cores=(core,)`` (neither: not pinned).
    ``run_dir`` receives kvpush's traces (and the fault file); None: no
    traces. ``model`` a model directory or a hub id (None:
    the tiny model). The other fields are those of
    :class:`kvpush.launcher.config.ClusterConfig`; on CUDA the instance
    uses the GPUs its environment shows it (``CUDA_VISIBLE_DEVICES``, as a
    service manager or Kubernetes sets it), and ``cores`` only pin it.
    """

    role: Role
    mode: str
    name: str = ""
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    port: int = 8100
    side_channel_host: str | None = None
    side_channel_advertise_host: str | None = None
    side_channel_port: int = 5600
    model: str | None = None
    run_dir: Path | None = None
    core: int | None = None
    cores: tuple[int, ...] = ()
    tp: int = 1
    dp: int = 1
    dp_rank: int | None = None
    kv_events_endpoint: str | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_space_gb: int | None = None
    extra_vllm_args: tuple[str, ...] = ()
    kv_load_failure_policy: str = "recompute"
    registration_ttl_s: float | None = None
    ready_ttl_s: float | None = None
    peer_timeout_s: float | None = None
    fault_injection: bool = False
    nixl_backend: str = "UCX"
    push_granularity: str = DEFAULT_PUSH_GRANULARITY
    verify_kv: str = DEFAULT_VERIFY_KV
    verify_kv_sample: float | None = None
    kv_both: bool = False
    ucx_net_devices: str | None = None
    insecure_side_channel: bool = False
    side_channel_secret_file: Path | None = None
    platform: Platform = Platform.CPU
    gpu_memory_utilization: float | None = None

    def __post_init__(self) -> None:
        set_platform(self)
        if self.role not in ROLES:
            raise ValueError(
                f"role must be one of {', '.join(ROLES)}, not {self.role!r}"
            )
        check_instance_settings(self)
        if (self.role == "colocated") != (self.mode == "colocated"):
            raise ValueError(
                f"role {self.role!r} does not run in mode {self.mode!r}: a colocated "
                "instance runs mode colocated, a prefill or decode a P/D mode"
            )
        for what, port in (
            ("port", self.port),
            ("side_channel_port", self.side_channel_port),
        ):
            if not 1024 <= port <= 65535:
                raise ValueError(f"{what} must be in 1024..65535, not {port}")
        if self.port == self.side_channel_port:
            raise ValueError("port and side_channel_port must differ")
        if self.name and not _NAME_RE.fullmatch(self.name):
            raise ValueError(
                f"name {self.name!r} must be 1-64 characters of A-Z a-z 0-9 . _ -"
            )
        if self.core is not None and self.core < 0:
            raise ValueError(f"core must be a CPU number >= 0, not {self.core}")
        if self.core is not None and self.cores:
            raise ValueError("give core or cores, not both")
        if any(c < 0 for c in self.cores):
            raise ValueError(f"cores must be CPU numbers >= 0, not {self.cores}")
        check_tp_size("tp", self.tp)
        check_dp(self.role, self.dp, self.dp_rank)
        top = self.side_channel_port + self.dp * self.tp - 1
        if top > 65535 or self.port in range(self.side_channel_port, top + 1):
            raise ValueError(
                f"side-channel ports {self.side_channel_port}..{top} (one per "
                f"rank) must fit below 65536 and miss the HTTP port {self.port}"
            )
        self._check_kv_events_endpoint()
        _ = self.addresses  # validated when resolved

    def _check_kv_events_endpoint(self) -> None:
        endpoint = self.kv_events_endpoint
        if endpoint is None:
            return
        if self.role != "decode" or self.mode != "kvpush":
            raise ValueError("--kv-events-endpoint is for a kvpush decode")
        check_kv_events_endpoint("--kv-events-endpoint", endpoint)
        top = int(endpoint.rsplit(":", 1)[1]) + self.dp - 1
        if top > 65535:
            raise ValueError(
                f"--kv-events-endpoint {endpoint}: one port per DP engine runs "
                f"past 65535 ({top})"
            )

    @property
    def addresses(self) -> Addresses:
        return Addresses.resolve(
            self.host,
            self.advertise_host,
            self.side_channel_host,
            self.side_channel_advertise_host,
        )

    @property
    def engine_id(self) -> str:
        if self.name:
            return self.name
        host = re.sub(r"[^A-Za-z0-9.-]", "_", self.addresses.advertise_host)
        return f"{self.role}-{host}-{self.port}"[:64]

    def spec(self) -> InstanceSpec:
        """This instance, as ``kvpush up`` would plan one of a cluster."""
        return InstanceSpec(
            role=self.role,
            name=self.engine_id,
            addresses=self.addresses,
            http_port=self.port,
            side_channel_port=self.side_channel_port,
            cores=rank_cores(self._pool, self._ranks),
            run_dir=self.run_dir,
            tp=self.tp,
            dp=self.dp,
            dp_rank=self.dp_rank,
            kv_events_endpoint=self.kv_events_endpoint,
        )

    @property
    def _ranks(self) -> int:
        """Worker ranks of the process: ``tp`` per engine it runs."""
        return self.tp if self.dp_rank is not None else self.dp * self.tp

    @property
    def _pool(self) -> tuple[int, ...]:
        """The cores its ranks take in turn (empty: not pinned)."""
        return self.cores or (() if self.core is None else (self.core,))

    def backends(self) -> tuple[Backend, ...]:
        """The entries to put in the router's topology file for it: one per
        DP engine it serves."""
        return self.spec().backends(self.mode)

    def check_startable(self) -> None:
        """Refuse, before anything starts, a kvpush prefill (or any
        ``kv_both`` instance: it serves prefill legs too) whose side channel
        would listen off loopback without a secret."""
        if serves_prefill_legs(self, self.role):
            check_secret(self, self.addresses.side_channel_bind_host)


def model_path(config: ServeConfig, resolve_tiny: Callable[[], Path]) -> Path:
    """The model vLLM loads: a directory (it must hold ``config.json``), a
    hub id passed through as is, or the tiny model when none is given."""
    if config.model is None:
        return resolve_tiny()
    path = Path(config.model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"--model {path} is not a model directory (no config.json)")
    return path


def print_command(config: ServeConfig, model: Path) -> str:
    """The plan as one shell line: environment assignments, then vLLM's
    command. A secret file is read by the shell (``$(cat FILE)``) when the
    line runs, so the secret itself is never printed."""
    spec = config.spec()
    words = [
        f"{k}={shlex.quote(v)}"
        for k, v in instance_env_vars(config, spec, model).items()
    ]
    if config.side_channel_secret_file is not None:
        quoted = shlex.quote(str(config.side_channel_secret_file))
        words.append(f'{SECRET_ENV}="$(cat {quoted})"')
    return " ".join([*words, shlex.join(instance_command(config, spec, model))])


ExecFn = Callable[[str, list[str], dict[str, str]], None]


def serve(
    config: ServeConfig, model: Path, secret: str | None, exec_fn: ExecFn = os.execve
) -> None:
    """Replace this process with the instance's vLLM API server, pinned to
    its ranks' cores when set. Returns only when ``exec_fn`` does (tests)."""
    spec = config.spec()
    argv = instance_command(config, spec, model)
    env = instance_env(config, spec, secret, model)
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)
    sys.stdout.flush()
    sys.stderr.flush()
    exec_fn(argv[0], argv, env)
