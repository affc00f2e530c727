"""The launcher's one frozen config, validated at construction.

Values come from flags and, optionally, one JSON or TOML file whose keys are
the field names below; flags given on the command line win over the file.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvpush.connector.config import (
    DEFAULT_PUSH_GRANULARITY,
    check_nixl_backend,
    check_push_granularity,
)
from kvpush.launcher.netns import MAX_LINK_GBIT
from kvpush.launcher.platform import (
    Platform,
    as_platform,
    check_kv_memory,
    resolve_platform,
)
from kvpush.router.binding import check_policy
from kvpush.router.config import FirstTokenFrom
from kvpush.settings_file import read_settings_file
from kvpush.side_channel_auth import SECRET_ENV, check_side_channel_auth, is_wildcard
from kvpush.topology import MODES
from kvpush.transfer.digest import (
    DEFAULT_VERIFY_KV,
    DEFAULT_VERIFY_SAMPLE,
    check_verify_kv,
)
from kvpush.transfer.ranks import MAX_TP_SIZE

# auto: vLLM's choice from the model's config (on CPU a float32 model then
# runs in bfloat16, so the CPU default stays float32).
DTYPES = ("float32", "bfloat16", "float16", "auto")
HOSTS = ("local", "netns")
FAILURE_POLICIES = ("recompute", "error")
_MAX_PORT = 65535
TP_KEYS = ("prefill_tp", "decode_tp", "colocated_tp")
DP_KEYS = ("prefill_dp", "decode_dp")
MAX_DP = 8
# vLLM options the launcher sets itself from its TP and DP settings.
_TP_FLAGS = (
    "--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp",
    "--data-parallel-rank", "-dpn",
)  # fmt: skip

FIRST_TOKEN_FROM: tuple[str, ...] = tuple(f.value for f in FirstTokenFrom)


@dataclass(frozen=True)
class ClusterConfig:
    """Everything ``kvpush up`` needs to start a cluster.

    ``model`` None means the tiny model under ``$KVPUSH_HOME`` (made on first
    use). Instance ``i`` (prefills first, then decodes) listens for HTTP on
    ``base_http_port + i``.

    Tensor parallelism: every prefill runs ``prefill_tp`` ranks, every decode
    ``decode_tp``, the colocated instance ``colocated_tp`` (``--prefill-tp``
    and ``--decode-tp`` are for P/D modes, ``--colocated-tp`` for colocated
    mode; each must be 1 where it does not apply). vLLM gets
    ``--tensor-parallel-size``, one worker process per rank.

    Data parallelism (P/D modes): every prefill runs ``prefill_dp`` engines,
    every decode ``decode_dp`` (``--prefill-dp``, ``--decode-dp``), behind
    the instance's one HTTP port (vLLM's ``--data-parallel-size`` and its
    internal load balancer). Each DP rank is an endpoint of its own in the
    topology (engine id ``<name>_dp<rank>``, its own side-channel ports);
    the router pins every leg to one. An instance has ``dp * tp`` ranks.

    Side-channel ports: every rank is a transfer endpoint, so instance ``i``
    owns the range ``[base_side_channel_port + i * stride, ... + its
    ranks)`` with ``stride`` = :attr:`side_channel_stride`, the largest
    ``dp * tp`` of the cluster; TP rank ``r`` of DP rank ``d`` may listen on
    ``its base + d * tp + r``.
    No two instances' ranges overlap, and with TP 1 everywhere instance ``i``
    gets ``base_side_channel_port + i`` as before. (vLLM's own NIXL
    connectors listen on the instance's base port only, one listener per
    engine answering for every rank.)

    Cores (``cores``; empty: all cores this process may use): while there
    are at least as many cores as instances, instances never share a core:
    each gets a contiguous share (one core each, spare cores to the instance
    with the most ranks per core until every rank has its own), and rank
    ``r`` of an instance is bound to ``share[r % len(share)]`` -- its own core
    where the share allows, else sharing with its instance's other ranks.
    With fewer cores than instances instance ``i`` gets ``cores[i %
    len(cores)]`` alone, as with TP 1. See
    :func:`kvpush.launcher.instances.core_shares` for why.

    ``kv_load_failure_policy`` (P/D modes): what decode does when KV does not
    arrive: ``recompute`` the prompt locally (default) or fail the request
    with an ``error``. ``registration_ttl_s``, ``ready_ttl_s`` and
    ``peer_timeout_s`` (kvpush mode; None: the connector's defaults of 60,
    30 and 10 s) are the deadlines of :mod:`kvpush.connector.config`.
    ``fault_injection`` gives kvpush's connectors the fault file
    ``RUN_DIR/faults.json`` (tests only; see :mod:`kvpush.connector.faults`).

    Addresses (see :class:`Addresses`): ``host`` is what the router and the
    instances bind; ``advertise_host`` what the topology names (default
    ``host``); ``side_channel_host`` what the side channels bind (default
    ``host``) and ``side_channel_advertise_host`` what decode connects to.
    ``push_granularity`` (kvpush mode) is prefill's push unit: ``auto`` (the
    default), ``request``, ``chunk`` or ``layer`` (see
    :mod:`kvpush.connector.config`).
    ``kv_both`` (kvpush mode): every instance gets vLLM's ``kv_role``
    ``kv_both`` instead of ``kv_producer``/``kv_consumer``, so any of them
    serves either leg of a request (the topology still names each one's
    role for kvpush's router; see :mod:`kvpush.connector.connector`).
    ``verify_kv`` (kvpush mode, given to both roles): KV digests, ``off``
    (default), ``sample`` (the fraction ``verify_kv_sample`` of
    transfers; None: the connector's 0.01) or ``all`` (see
    :mod:`kvpush.transfer.digest`).
    ``nixl_backend`` is NIXL's transport (UCX or LIBFABRIC) and
    ``ucx_net_devices`` the NIC(s) UCX may use (``UCX_NET_DEVICES``), both
    for kvpush and the baselines. A kvpush side channel off loopback needs
    ``KVPUSH_SIDE_CHANNEL_SECRET`` (or ``side_channel_secret_file``) unless
    ``insecure_side_channel``.

    ``hosts``: ``local`` runs every instance here, on ``host``; ``netns``
    rehearses several hosts on this machine, each instance in its own
    network namespace with its own address (see
    :mod:`kvpush.launcher.netns`), its egress shaped to ``link_gbit`` Gbit/s
    when that is set. The router stays on ``host``.

    ``binding`` (kvpush mode) is the router's ``--binding`` (None: the
    router's default); see :mod:`kvpush.router.binding`.
    ``first_token_from`` (kvpush mode) is the router's
    ``--first-token-from``, prefill or decode (None: the router's default,
    prefill); see :mod:`kvpush.router.first_token`.

    ``kv_events`` (kvpush mode, local hosts): every decode engine sends
    vLLM's KV cache events to the router, which learns from them what each
    decode holds (:mod:`kvpush.router.kv_feed`); the router listens for
    decode ``j``'s DP rank ``d`` on ``base_kv_events_port + j * decode_dp +
    d``. Not on rehearsal hosts: their instances cannot reach the router's
    loopback address.

    ``platform`` (:mod:`kvpush.launcher.platform`) is what the instances run
    on; the CLI detects it, a config built in code says it (default CPU).
    Unset, ``dtype``, ``max_model_len`` and ``kv_cache_space_gb`` take its
    defaults (CPU: float32, 4096, 1 GB; CUDA: the model's dtype and context
    length; the KV space is CPU-only). On CUDA instance ``i`` gets the next
    TP-many GPUs of ``gpus`` (default 0, 1, 2, ...) as
    ``CUDA_VISIBLE_DEVICES``, no instance shares one, and cores are pinned
    only when ``cores`` is given; ``gpu_memory_utilization`` (CUDA only) is
    vLLM's ``--gpu-memory-utilization`` (None: vLLM's default).
    """

    mode: str = "vllm-pull"
    num_prefill: int = 1
    num_decode: int = 1
    model: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    base_http_port: int = 8100
    base_side_channel_port: int = 5600
    kv_events: bool = True
    base_kv_events_port: int = 5800
    run_dir: Path | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_space_gb: int | None = None
    cores: tuple[int, ...] = ()
    startup_timeout_s: float = 300.0
    extra_vllm_args: tuple[str, ...] = ()
    kv_load_failure_policy: str = "recompute"
    registration_ttl_s: float | None = None
    ready_ttl_s: float | None = None
    peer_timeout_s: float | None = None
    fault_injection: bool = False
    advertise_host: str | None = None
    side_channel_host: str | None = None
    side_channel_advertise_host: str | None = None
    nixl_backend: str = "UCX"
    ucx_net_devices: str | None = None
    insecure_side_channel: bool = False
    side_channel_secret_file: Path | None = None
    push_granularity: str = DEFAULT_PUSH_GRANULARITY
    verify_kv: str = DEFAULT_VERIFY_KV
    verify_kv_sample: float | None = None
    kv_both: bool = False
    hosts: str = "local"
    link_gbit: float | None = None
    binding: str | None = None
    first_token_from: str | None = None
    prefill_tp: int = 1
    decode_tp: int = 1
    colocated_tp: int = 1
    prefill_dp: int = 1
    decode_dp: int = 1
    platform: Platform = Platform.CPU
    gpu_memory_utilization: float | None = None
    gpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        set_platform(self)
        _check_mode(self.mode)
        self._check_counts()
        self._check_tp()
        self._check_dp()
        self._check_gpus()
        self._check_ports()
        self._check_hosts()
        if self.binding is not None:
            _require(self.mode == "kvpush", "--binding is for kvpush mode")
            check_policy(self.binding)
        if self.first_token_from is not None:
            _require(self.mode == "kvpush", "--first-token-from is for kvpush mode")
            _require(
                self.first_token_from in FIRST_TOKEN_FROM,
                f"first_token_from must be one of {', '.join(FIRST_TOKEN_FROM)}, "
                f"not {self.first_token_from!r}",
            )
        check_instance_settings(self)
        _require(self.startup_timeout_s > 0, "startup_timeout_s must be positive")
        _require(all(c >= 0 for c in self.cores), "cores must be CPU numbers >= 0")
        _ = self.addresses  # validated when resolved

    @property
    def addresses(self) -> Addresses:
        """The bind and advertised addresses of every instance."""
        return Addresses.resolve(
            self.host,
            self.advertise_host,
            self.side_channel_host,
            self.side_channel_advertise_host,
        )

    def _check_counts(self) -> None:
        if self.mode == "colocated":
            _require(
                self.num_prefill <= 1 and self.num_decode <= 1,
                "colocated mode runs one instance; drop --prefill/--decode",
            )
            return
        _require(1 <= self.num_prefill <= 8, "--prefill must be between 1 and 8")
        _require(1 <= self.num_decode <= 8, "--decode must be between 1 and 8")

    def _check_tp(self) -> None:
        for name in TP_KEYS:
            check_tp_size(name, getattr(self, name))
        if self.mode == "colocated":
            _require(
                self.prefill_tp == 1 and self.decode_tp == 1,
                "colocated mode runs one instance: set its TP with "
                "--colocated-tp (colocated_tp), not --prefill-tp/--decode-tp",
            )
        else:
            _require(
                self.colocated_tp == 1,
                f"--colocated-tp is for colocated mode; {self.mode} takes "
                "--prefill-tp and --decode-tp",
            )

    def _check_dp(self) -> None:
        for name in DP_KEYS:
            check_dp_size(name, getattr(self, name))
        _require(
            self.mode != "colocated" or (self.prefill_dp, self.decode_dp) == (1, 1),
            "--prefill-dp/--decode-dp are for P/D modes; colocated runs one engine",
        )

    def dp_of(self, role: str) -> int:
        """The data-parallel size (engines) of an instance of ``role``."""
        return {"prefill": self.prefill_dp, "decode": self.decode_dp}.get(role, 1)

    def ranks_of(self, role: str) -> int:
        """Worker ranks of an instance of ``role``: its DP times its TP."""
        return self.dp_of(role) * self.tp_of(role)

    def tp_of(self, role: str) -> int:
        """The tensor-parallel size of an instance of ``role``."""
        return {
            "prefill": self.prefill_tp,
            "decode": self.decode_tp,
            "colocated": self.colocated_tp,
        }[role]

    @property
    def num_ranks(self) -> int:
        """Worker ranks of the whole cluster (on CUDA, one GPU each)."""
        if self.mode == "colocated":
            return self.colocated_tp
        return self.num_prefill * self.ranks_of("prefill") + self.num_decode * (
            self.ranks_of("decode")
        )

    def _check_gpus(self) -> None:
        if self.platform == Platform.CPU:
            _require(not self.gpus, "gpus are for --platform cuda; drop --gpus")
            return
        _require(
            all(g >= 0 for g in self.gpus) and len(set(self.gpus)) == len(self.gpus),
            f"gpus must be distinct GPU numbers >= 0, not {list(self.gpus)}",
        )
        _require(
            not self.gpus or len(self.gpus) >= self.num_ranks,
            f"the cluster runs {self.num_ranks} ranks, one GPU each, but gpus "
            f"lists {len(self.gpus)}; give more GPUs or fewer instances/ranks",
        )

    @property
    def side_channel_stride(self) -> int:
        """Side-channel ports each instance owns: the cluster's largest
        ``dp * tp`` (1 when every instance runs one rank)."""
        if self.mode == "colocated":
            return self.colocated_tp
        return max(self.ranks_of("prefill"), self.ranks_of("decode"))

    @property
    def publishes_kv_events(self) -> bool:
        """Whether the decodes publish KV cache events for the router."""
        return self.kv_events and self.mode == "kvpush" and self.hosts == "local"

    def _port_ranges(self) -> dict[str, range]:
        """Every range of ports the cluster listens on, by setting."""
        n = self.num_instances
        ranges = {
            "port": range(self.port, self.port + 1),
            "base_http_port": range(self.base_http_port, self.base_http_port + n),
            "base_side_channel_port": range(
                self.base_side_channel_port,
                self.base_side_channel_port + n * self.side_channel_stride,
            ),
        }
        if self.publishes_kv_events:
            first = self.base_kv_events_port
            ranges["base_kv_events_port"] = range(
                first, first + self.num_decode * self.decode_dp
            )
        return ranges

    def _check_ports(self) -> None:
        ranges = self._port_ranges()
        for name, ports in ranges.items():
            _require(
                ports.start >= 1024 and ports[-1] <= _MAX_PORT,
                f"{name} must leave ports {ports.start}..{ports[-1]} within "
                "1024..65535",
            )
        for a, b in itertools.combinations(ranges, 2):
            overlap = set(ranges[a]) & set(ranges[b])
            _require(
                not overlap,
                f"{a} and {b} ranges overlap ({_span(ranges[a])} and "
                f"{_span(ranges[b])}, at {min(overlap) if overlap else 0}); "
                "move one",
            )

    def _check_hosts(self) -> None:
        _require(
            self.hosts in HOSTS,
            f"hosts must be one of {', '.join(HOSTS)}, not {self.hosts!r}",
        )
        if self.hosts == "local":
            _require(
                self.link_gbit is None, "--link-gbit shapes links of --hosts netns"
            )
            return
        given = [
            name
            for name in (
                "advertise_host",
                "side_channel_host",
                "side_channel_advertise_host",
            )
            if getattr(self, name) is not None
        ]
        _require(
            not given,
            f"--hosts netns gives every instance its own address; drop {given}",
        )
        _require(
            self.link_gbit is None or 0 < self.link_gbit <= MAX_LINK_GBIT,
            f"link_gbit must be in (0, {MAX_LINK_GBIT:g}] Gbit/s, "
            f"not {self.link_gbit!r}",
        )

    @property
    def num_instances(self) -> int:
        return 1 if self.mode == "colocated" else self.num_prefill + self.num_decode


class InstanceSettings(Protocol):
    """The settings every vLLM instance is built from, whether one of a
    cluster (:class:`ClusterConfig`) or one served alone
    (:class:`kvpush.launcher.serve.ServeConfig`)."""

    @property
    def mode(self) -> str: ...

    @property
    def platform(self) -> Platform: ...

    @property
    def dtype(self) -> str | None: ...

    @property
    def max_model_len(self) -> int | None: ...

    @property
    def max_num_batched_tokens(self) -> int | None: ...

    @property
    def kv_cache_space_gb(self) -> int | None: ...

    @property
    def gpu_memory_utilization(self) -> float | None: ...

    @property
    def extra_vllm_args(self) -> tuple[str, ...]: ...

    @property
    def kv_load_failure_policy(self) -> str: ...

    @property
    def registration_ttl_s(self) -> float | None: ...

    @property
    def ready_ttl_s(self) -> float | None: ...

    @property
    def peer_timeout_s(self) -> float | None: ...

    @property
    def fault_injection(self) -> bool: ...

    @property
    def nixl_backend(self) -> str: ...

    @property
    def ucx_net_devices(self) -> str | None: ...

    @property
    def insecure_side_channel(self) -> bool: ...

    @property
    def side_channel_secret_file(self) -> Path | None: ...

    @property
    def push_granularity(self) -> str: ...

    @property
    def verify_kv(self) -> str: ...

    @property
    def kv_both(self) -> bool: ...

    @property
    def verify_kv_sample(self) -> float | None: ...


def check_instance_settings(s: InstanceSettings) -> None:
    """Raise ValueError, saying what to change, unless ``s`` is valid."""
    _check_mode(s.mode)
    _require(
        s.dtype is None or s.dtype in DTYPES,
        f"dtype must be one of {', '.join(DTYPES)}, not {s.dtype!r}",
    )
    _require(
        s.max_model_len is None or s.max_model_len >= 16,
        "max_model_len must be at least 16 (or unset)",
    )
    _require(
        s.max_num_batched_tokens is None or s.max_num_batched_tokens >= 16,
        "max_num_batched_tokens must be at least 16 (or unset)",
    )
    check_kv_memory(s.platform, s.kv_cache_space_gb, s.gpu_memory_utilization)
    _require(
        s.kv_load_failure_policy in FAILURE_POLICIES,
        "kv_load_failure_policy must be recompute or error, "
        f"not {s.kv_load_failure_policy!r}",
    )
    for name in ("registration_ttl_s", "ready_ttl_s", "peer_timeout_s"):
        value = getattr(s, name)
        _require(
            value is None or 0 < value <= 3600,
            f"{name} must be in (0, 3600] seconds, not {value!r}",
        )
    tp_flags = [a for a in s.extra_vllm_args if a.split("=")[0] in _TP_FLAGS]
    _require(
        not tp_flags,
        f"extra vLLM options must not set the TP or DP ({tp_flags[:1]}): give "
        "them with --prefill-tp/--decode-tp/--colocated-tp (serve: --tp) and "
        "--prefill-dp/--decode-dp (serve: --dp, --dp-rank), which also bind "
        "each rank to its core",
    )
    _require(
        not s.kv_both or s.mode == "kvpush",
        "kv_both is for kvpush mode (vLLM's own NIXL connectors deprecate it)",
    )
    check_nixl_backend(s.nixl_backend)
    check_push_granularity(s.push_granularity)
    sample = DEFAULT_VERIFY_SAMPLE if s.verify_kv_sample is None else s.verify_kv_sample
    check_verify_kv(s.verify_kv, sample)
    _require(
        s.ucx_net_devices is None or bool(s.ucx_net_devices.strip()),
        "ucx_net_devices must name devices (e.g. mlx5_0:1 or eth0), or be unset",
    )


def set_platform(settings: InstanceSettings) -> None:
    """Turn a frozen config's ``platform`` field into a :class:`Platform`
    (``auto`` is resolved where settings are read)."""
    object.__setattr__(settings, "platform", as_platform(settings.platform))


def check_secret(s: InstanceSettings, side_channel_bind_host: str) -> None:
    """Before starting a kvpush prefill whose side channel binds
    ``side_channel_bind_host``: refuse, in one line, to run it
    unauthenticated off loopback. Reads the environment, never the file."""
    if s.mode != "kvpush":
        return
    has_secret = (
        bool(os.environ.get(SECRET_ENV)) or s.side_channel_secret_file is not None
    )
    check_side_channel_auth(side_channel_bind_host, has_secret, s.insecure_side_channel)


@dataclass(frozen=True)
class Addresses:
    """Where an instance listens and what others are told to connect to.

    ``bind_host``: its HTTP server (and, in a cluster, the router);
    ``advertise_host``: its URL in the topology; ``side_channel_bind_host``:
    kvpush's side-channel listener; ``side_channel_host``: the side-channel
    address the topology names (decode connects there; vLLM's baselines
    bind and advertise this one address).
    """

    bind_host: str
    advertise_host: str
    side_channel_bind_host: str
    side_channel_host: str

    @classmethod
    def resolve(
        cls,
        host: str,
        advertise_host: str | None = None,
        side_channel_host: str | None = None,
        side_channel_advertise_host: str | None = None,
    ) -> Addresses:
        """Fill the unset addresses: the advertised host defaults to the bind
        host, the side channel binds the HTTP bind host, and advertises its
        own bind host when that is a real address, else the advertised host."""
        _require(bool(host), "host must be an address to listen on, e.g. 127.0.0.1")
        advertised = advertise_host or host
        _require(
            not is_wildcard(advertised),
            f"listening on {host!r} needs --advertise-host: the address other "
            "hosts reach this one at",
        )
        sc_bind = side_channel_host or host
        sc_advertised = side_channel_advertise_host or (
            sc_bind if side_channel_host and not is_wildcard(sc_bind) else advertised
        )
        _require(
            not is_wildcard(sc_advertised),
            f"side_channel_advertise_host {sc_advertised!r} is not an address "
            "peers can connect to",
        )
        return cls(host, advertised, sc_bind, sc_advertised)


def _check_mode(mode: str) -> None:
    _require(mode in MODES, f"mode must be one of {', '.join(MODES)}, not {mode!r}")


def _span(ports: range) -> str:
    return f"{ports.start}..{ports[-1]}"


def check_dp_size(name: str, value: object) -> None:
    """ValueError unless ``value`` is a DP size the launcher plans."""
    _require(
        isinstance(value, int) and 1 <= value <= MAX_DP,
        f"{name} must be between 1 and {MAX_DP}, not {value!r}",
    )


def check_dp(role: str, dp: int, dp_rank: int | None) -> None:
    """ValueError unless ``kvpush serve``'s ``dp`` and ``dp_rank`` fit: a
    P/D instance (colocated runs one engine), a rank of the DP group."""
    check_dp_size("dp", dp)
    _require(
        role != "colocated" or dp == 1,
        "--dp is for prefill and decode instances; colocated runs one engine",
    )
    if dp_rank is None:
        return
    _require(
        dp > 1,
        "--dp-rank serves one rank of a DP group: give its size with --dp (> 1)",
    )
    _require(
        isinstance(dp_rank, int) and 0 <= dp_rank < dp,
        f"--dp-rank must be one of 0..{dp - 1} (--dp {dp}), not {dp_rank!r}",
    )


def check_tp_size(name: str, value: object) -> None:
    """ValueError unless ``value`` is a TP size an instance can run (the
    launcher's, ``kvpush serve``'s and the benchmark's settings alike; the
    bound is what the wire takes)."""
    _require(
        isinstance(value, int) and 1 <= value <= MAX_TP_SIZE,
        f"{name} must be between 1 and {MAX_TP_SIZE}, not {value!r}",
    )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def load_config_file(path: Path) -> dict[str, Any]:
    """Read a JSON or TOML config file into a dict of ClusterConfig fields."""
    data = read_settings_file(path)
    known = {f.name for f in dataclasses.fields(ClusterConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(
            f"config file {path}: unknown keys {unknown}; known: {sorted(known)}"
        )
    return data


def make_config(values: dict[str, Any]) -> ClusterConfig:
    """Build a ClusterConfig from plain values (file or flags), converting
    paths and lists and resolving ``platform`` (unset: ``auto``, detected);
    type errors become ValueErrors naming the key."""
    values = dict(values)
    for key in ("model", "run_dir", "side_channel_secret_file"):
        if values.get(key) is not None:
            values[key] = Path(values[key]).expanduser()
    for key in ("cores", "extra_vllm_args", "gpus"):
        if key in values:
            values[key] = tuple(values[key])
    values["platform"] = resolve_platform(values.get("platform", "auto"))
    try:
        return ClusterConfig(**values)
    except TypeError as e:
        raise ValueError(f"bad cluster setting: {e}") from e
