"""The benchmark's one frozen config, validated at construction.

Values are layered: the field defaults, then a preset (``quick`` for CI),
then an optional JSON or TOML file whose keys are the field names, then
command-line flags. :func:`make_config` turns plain values from any of those
into a :class:`BenchConfig`, raising ``ValueError`` that says what to change.
"""

from __future__ import annotations

import dataclasses
import math
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.launcher.config import DP_KEYS, MAX_DP, TP_KEYS, check_tp_size
from kvpush.launcher.platform import PLATFORM_CHOICES
from kvpush.model.presets import PRESETS as MODEL_PRESETS
from kvpush.model.presets import preset as model_preset_of
from kvpush.router.binding import check_policy
from kvpush.settings_file import read_settings_file
from kvpush_lab.bench.lengths import LengthSpec
from kvpush_lab.bench.names import (
    BINDING_CONFIGS,
    CONFIG_NAMES,
    GRANULARITY_CONFIGS,
    OWN_CLUSTER_CONFIGS,
    cluster_of,
    unknown_names_message,
)
from kvpush_lab.bench.workloads import (
    SHARED_CLUSTER_WORKLOADS,
    WORKLOADS,
    check_workload,
    workload_defaults,
)

ARRIVALS = ("poisson", "concurrency")
HOSTS = ("local", "netns")  # as kvpush up --hosts
MAX_LINK_GBIT = 100.0  # as kvpush up --link-gbit
MAX_REPEAT = 20  # rounds
DEFAULT_CONFIGS = ("colocated", "vllm-pull", "vllm-push", "kvpush")
# Config-file keys as ``vllm bench serve`` names its flags -> the field they
# set (the field's own name stays a key too; both in one layer must agree).
KEY_ALIASES = {"request_rate": "qps", "num_prompts": "num_requests"}
__all__ = [
    "BINDING_CONFIGS", "CONFIG_NAMES", "GRANULARITY_CONFIGS", "WORKLOADS",
    "cluster_of",
]  # fmt: skip

# Presets are partial configs applied before the file and the flags.
PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "quick": {
        "qps": (4.0,),
        "prompt_len": "256",
        "output_len": "8",
        "num_requests": 6,
        "num_warmup": 2,
        "num_timeline_requests": 4,
    },
}


@dataclass(frozen=True)
class BenchConfig:
    """Everything ``kvpush bench`` needs.

    Each configuration in ``configs`` (a cluster mode) gets a fresh cluster
    of ``num_prefill`` + ``num_decode`` instances (one instance when
    colocated) and the same workload: for every sweep point,
    ``num_requests`` requests with prompt and output lengths drawn from
    ``prompt_len`` / ``output_len`` (see :mod:`kvpush_lab.bench.lengths`),
    arriving as a Poisson process at each of ``qps`` (``arrival="poisson"``)
    or kept at each of ``concurrency`` in flight. A non-empty
    ``prompt_len_sweep`` sweeps fixed prompt lengths instead, at the one
    load given. ``shared_prefix_fraction`` of every prompt is a prefix
    common to all requests of a point. ``model_*`` pick a model size other
    than the tiny default (built on first use); ``model`` a model directory;
    ``model_preset`` a named shape of :mod:`kvpush.model.presets` (made on
    first use, as ``kvpush up --model-preset``; :func:`make_config` takes its
    ``max_model_len`` and ``kv_cache_space_gb`` unless they are given).
    ``repeat`` > 1 runs every configuration once per round, in the same
    order each round, each time on a fresh cluster (:mod:`rounds`).

    ``max_concurrency`` caps the requests in flight at once (as ``vllm
    bench serve --max-concurrency``): a Poisson arrival past the cap waits
    for a slot, and its TTFT counts from when it is sent (None: no cap).

    ``base_url`` measures a deployment that is already running instead
    (:mod:`kvpush_lab.bench.endpoint`): no cluster is started, one
    configuration named ``label``; ``served_model`` is the ``model`` field
    of its requests (None: the first id of its ``/v1/models``) and
    ``tokenizer`` a local model directory whose vocabulary the prompts are
    drawn from. The settings that only mean something on clusters the
    benchmark starts are refused with it (:data:`ENDPOINT_REFUSED`).

    ``hosts="netns"`` runs every cluster on the multi-host rehearsal (each
    instance in its own network namespace, see
    :mod:`kvpush.launcher.netns`); each rate of ``link_gbit`` (Gbit/s, the
    hosts' shaped egress) then gets a fresh set of clusters, every
    configuration side by side at that rate. An empty ``link_gbit`` leaves
    the links unshaped.

    ``platform`` is what the clusters run on (``auto``: detected when the
    run is planned, see :mod:`kvpush.launcher.platform`); unset, ``dtype``
    is that platform's default (float32 on CPU, the model's on CUDA).
    ``kv_cache_space_gb`` sizes CPU instances only; on CUDA
    ``gpu_memory_utilization`` (None: vLLM's default) does. ``max_model_len``
    bounds the workload and is given to every instance on either platform.
    """

    configs: tuple[str, ...] = DEFAULT_CONFIGS
    num_prefill: int = 1
    num_decode: int = 1
    model: Path | None = None
    model_preset: str | None = None
    model_layers: int | None = None
    model_hidden_size: int | None = None
    model_kv_heads: int | None = None
    model_head_dim: int | None = None
    dtype: str | None = None
    max_model_len: int = 4096
    max_num_batched_tokens: int | None = None
    kv_cache_space_gb: int = 1
    arrival: str = "poisson"
    qps: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    concurrency: tuple[int, ...] = (1,)
    prompt_len: str = "1000"
    output_len: str = "32"
    prompt_len_sweep: tuple[int, ...] = ()
    num_requests: int = 40
    num_warmup: int = 4
    shared_prefix_fraction: float = 0.0
    seed: int = 0
    request_timeout_s: float = 120.0
    num_timeline_requests: int = 8
    output_dir: Path | None = None
    port: int = 28000
    base_http_port: int = 28100
    base_side_channel_port: int = 29000
    startup_timeout_s: float = 300.0
    hosts: str = "local"
    link_gbit: tuple[float, ...] = ()
    workload: str = "sweep"
    background_concurrency: int = 2
    background_prompt_len: int = 64
    background_output_len: int = 512
    background_decode: int = 0
    num_conversations: int = 4
    num_turns: int = 6
    conversation_concurrency: int = 2
    history_len: int = 1200
    turn_len: int = 130
    share_kvpush_cluster: bool | None = None
    repeat: int = 1
    block_size: int | None = None
    prefill_tp: int = 1
    decode_tp: int = 1
    colocated_tp: int = 1
    prefill_dp: int = 1
    decode_dp: int = 1
    churn_requests: int = 64
    churn_concurrency: int = 8
    churn_prompt_len: str = "64-2048"
    churn_output_len: str = "2-64"
    churn_abort_fraction: float = 0.33
    slo_ttft_ms: float = 250.0
    slo_tpot_ms: float = 20.0
    max_concurrency: int | None = None
    base_url: str | None = None
    label: str | None = None
    served_model: str | None = None
    tokenizer: Path | None = None
    platform: str = "auto"
    gpu_memory_utilization: float | None = None

    def __post_init__(self) -> None:
        self._check_endpoint()
        self._check_configs()
        self._check_workload()
        self._check_load()
        self._check_lengths()
        require(self.num_prefill >= 1, "num_prefill must be at least 1")
        require(self.num_decode >= 1, "num_decode must be at least 1")
        require(self.num_requests >= 1, "num_requests must be at least 1")
        require(self.num_warmup >= 1, "num_warmup must be at least 1 (handshake)")
        require(
            0.0 <= self.shared_prefix_fraction < 1.0,
            "shared_prefix_fraction must be in [0, 1)",
        )
        require(self.seed >= 0, "seed must be >= 0")
        require(self.request_timeout_s > 0, "request_timeout_s must be positive")
        require(self.num_timeline_requests >= 0, "num_timeline_requests must be >= 0")
        require(
            1 <= self.repeat <= MAX_REPEAT,
            f"repeat must be in 1..{MAX_REPEAT} rounds, not {self.repeat}",
        )
        self._check_model()
        self._check_hosts()
        require(
            self.platform in PLATFORM_CHOICES,
            f"platform must be one of {', '.join(PLATFORM_CHOICES)}, "
            f"not {self.platform!r}",
        )
        for name in TP_KEYS:
            check_tp_size(name, getattr(self, name))
        for name in DP_KEYS:
            value = getattr(self, name)
            require(1 <= value <= MAX_DP, f"{name} must be in 1..{MAX_DP}, not {value}")

    def _check_endpoint(self) -> None:
        """``base_url``'s own settings, and none that needs owned clusters."""
        if self.base_url is None:
            for name in ("label", "served_model", "tokenizer"):
                require(
                    getattr(self, name) is None,
                    f"{name} names what --base-url measures: add --base-url URL "
                    f"(or drop {name})",
                )
            return
        check_base_url(self.base_url)
        require(
            self.workload in ENDPOINT_WORKLOADS,
            f"workload {self.workload!r} cannot be used with --base-url: it "
            "drives and measures one decode instance of a cluster the benchmark "
            f"starts; with --base-url give one of {', '.join(ENDPOINT_WORKLOADS)}",
        )
        require(
            self.label is None or bool(self.label.strip()),
            "label must not be empty",
        )
        for name, why in ENDPOINT_REFUSED.items():
            if getattr(self, name) != _DEFAULTS[name]:
                raise ValueError(
                    f"{name} cannot be used with --base-url: {why}; drop it "
                    "(or --base-url)"
                )

    @property
    def endpoint_label(self) -> str:
        """The one configuration's name when measuring ``base_url``."""
        if self.base_url is None:
            raise ValueError("no base_url: the configurations are in configs")
        return self.label or label_of_url(self.base_url)

    @property
    def run_names(self) -> tuple[str, ...]:
        """What the run measures: ``configs``, or the endpoint's label."""
        return (self.endpoint_label,) if self.base_url else self.configs

    def _check_hosts(self) -> None:
        require(
            self.hosts in HOSTS,
            f"hosts must be one of {', '.join(HOSTS)}, not {self.hosts!r}",
        )
        if self.hosts == "local":
            require(
                not self.link_gbit,
                "link_gbit shapes the rehearsal hosts' links: add --hosts netns "
                "(or drop --link-gbit)",
            )
            return
        require(
            all(0 < g <= MAX_LINK_GBIT for g in self.link_gbit),
            f"link_gbit rates must be in (0, {MAX_LINK_GBIT:g}] Gbit/s, "
            f"not {list(self.link_gbit)}",
        )
        require(
            len(set(self.link_gbit)) == len(self.link_gbit),
            f"link_gbit lists a rate twice: {list(self.link_gbit)}",
        )

    @property
    def link_rates(self) -> tuple[float | None, ...]:
        """The link rate of each set of clusters, in order (None: unshaped,
        or not a rehearsal)."""
        return self.link_gbit or (None,)

    def _check_model(self) -> None:
        sizes = (
            "model_layers",
            "model_hidden_size",
            "model_kv_heads",
            "model_head_dim",
        )
        for name in sizes:
            value = getattr(self, name)
            require(value is None or value >= 1, f"{name} must be >= 1 (or unset)")
        require(
            self.model is None or all(getattr(self, n) is None for n in sizes),
            "give either model (a directory) or model_* sizes, not both",
        )
        if self.model_preset is None:
            return
        require(
            self.model_preset in MODEL_PRESETS,
            f"unknown model_preset {self.model_preset!r}; choose from "
            f"{', '.join(MODEL_PRESETS)}",
        )
        require(
            self.model is None and all(getattr(self, n) is None for n in sizes),
            "give model_preset alone: not with model or model_* sizes",
        )

    def _check_configs(self) -> None:
        names = ", ".join(CONFIG_NAMES)
        require(bool(self.configs), f"configs must name one or more of {names}")
        unknown = [c for c in self.configs if c not in CONFIG_NAMES]
        require(not unknown, unknown_names_message(unknown))
        require(
            len(set(self.configs)) == len(self.configs),
            f"configs lists a configuration twice: {list(self.configs)}",
        )
        for name in self.configs:
            if name in BINDING_CONFIGS:
                try:
                    check_policy(BINDING_CONFIGS[name])
                except ValueError as e:
                    raise ValueError(f"configuration {name}: {e}") from e

    def _check_workload(self) -> None:
        check_workload(self)
        if self.shares_kvpush_cluster:
            self._check_router_ports()
            own = [c for c in self.configs if c in OWN_CLUSTER_CONFIGS]
            require(
                not own,
                f"{own}: a push granularity (prefill's connector config) or a "
                "decode's scheduler class needs a cluster of its own; give "
                "--share-kvpush-cluster no (or drop them)",
            )

    @property
    def shares_kvpush_cluster(self) -> bool:
        """Whether the kvpush configurations share one cluster, each through
        a router of its own (None: for the skewed and multi-turn workloads)."""
        if self.share_kvpush_cluster is None:
            return self.workload in SHARED_CLUSTER_WORKLOADS
        return self.share_kvpush_cluster

    def _check_router_ports(self) -> None:
        """The shared cluster's extra routers listen on port+1, port+2, ..."""
        routers = set(range(self.port + 1, self.port + len(self.configs)))
        n = self.num_prefill + self.num_decode
        for name in ("base_http_port", "base_side_channel_port"):
            first = getattr(self, name)
            require(
                not routers & set(range(first, first + n)),
                f"the extra routers' ports {self.port + 1}.. collide with "
                f"{name}'s range; move --port or --{name.replace('_', '-')}",
            )

    def _check_load(self) -> None:
        require(
            self.arrival in ARRIVALS,
            f"arrival must be one of {ARRIVALS}, not {self.arrival!r}",
        )
        require(bool(self.loads), f"give at least one value for {self.arrival_key}")
        require(all(v > 0 for v in self.loads), f"{self.arrival_key} must be > 0")
        require(
            all(math.isfinite(v) for v in self.qps),
            "request_rate (qps) inf is not supported: summary.json and the plots "
            "need a finite rate; give a large one (e.g. 1000: every request at "
            "once) with --max-concurrency N, or --arrival concurrency "
            "--concurrency N",
        )
        self._check_max_concurrency()
        if self.arrival == "concurrency":
            require(
                all(float(v).is_integer() for v in self.concurrency),
                "concurrency values must be whole numbers",
            )
        if self.prompt_len_sweep:
            require(
                len(self.loads) == 1,
                f"a prompt_len_sweep runs at one load: give a single "
                f"{self.arrival_key} value, not {list(self.loads)}",
            )
            require(
                all(n >= 1 for n in self.prompt_len_sweep),
                "prompt_len_sweep lengths must be >= 1",
            )

    def _check_max_concurrency(self) -> None:
        cap = self.max_concurrency
        if cap is None:
            return
        require(cap >= 1, f"max_concurrency must be at least 1, not {cap}")
        require(
            self.workload != "multi-turn",
            "max_concurrency does not apply to the multi-turn workload: "
            "conversation_concurrency bounds its conversations in flight",
        )
        if self.arrival == "concurrency":
            require(
                cap >= max(self.concurrency),
                f"max_concurrency {cap} is below concurrency "
                f"{max(self.concurrency)}: the closed loop keeps exactly that "
                "many in flight; lower --concurrency instead",
            )

    def _check_lengths(self) -> None:
        prompt, output = self.prompt_spec, self.output_spec
        longest_prompt = max(self.prompt_len_sweep, default=prompt.max_value)
        if longest_prompt is not None and output.max_value is not None:
            require(
                longest_prompt + output.max_value <= self.max_model_len,
                f"longest prompt ({longest_prompt}) + output ({output.max_value}) "
                f"exceeds max_model_len {self.max_model_len}; shorten them or "
                f"raise max_model_len",
            )

    @property
    def prompt_spec(self) -> LengthSpec:
        return LengthSpec.parse(self.prompt_len)

    @property
    def output_spec(self) -> LengthSpec:
        return LengthSpec.parse(self.output_len)

    @property
    def arrival_key(self) -> str:
        """The field holding the load values: ``qps`` or ``concurrency``."""
        return "qps" if self.arrival == "poisson" else "concurrency"

    @property
    def loads(self) -> tuple[float, ...]:
        """The load values of the chosen arrival process."""
        return tuple(float(v) for v in getattr(self, self.arrival_key))

    @property
    def sweep_axis(self) -> str:
        """What varies between sweep points: qps, concurrency or prompt_len."""
        return "prompt_len" if self.prompt_len_sweep else self.arrival_key

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (paths as strings, tuples as lists)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = str(value) if isinstance(value, Path) else value
            if isinstance(value, tuple):
                out[f.name] = list(value)
        return out


def require(ok: bool, message: str) -> None:
    """Raise ValueError(message) unless ``ok`` (settings validation)."""
    if not ok:
        raise ValueError(message)


def check_base_url(url: str) -> str:
    """``url`` if it is an http(s) URL with a host (ValueError otherwise)."""
    parts = urllib.parse.urlsplit(url)
    require(
        parts.scheme in ("http", "https"),
        f"base_url {url!r} must start with http:// or https://",
    )
    try:
        _ = parts.port
    except ValueError as e:
        raise ValueError(f"base_url {url!r} has a bad port: {e}") from e
    require(bool(parts.hostname), f"base_url {url!r} names no host")
    require(
        not parts.query and not parts.fragment,
        f"base_url {url!r}: give the server's root (http://HOST:PORT), without "
        "?query or #fragment",
    )
    return url


def label_of_url(url: str) -> str:
    """The default label of a measured endpoint: its host[:port][/path]."""
    parts = urllib.parse.urlsplit(url)
    return (parts.netloc + parts.path).rstrip("/") or url


# Fields whose non-default value needs clusters the benchmark starts (they
# are refused with base_url), and why.
_CLUSTER = "it sets up the clusters kvpush bench starts, and --base-url starts none"
ENDPOINT_REFUSED: dict[str, str] = {
    "configs": "several configurations side by side need a cluster each; "
    "--base-url measures one endpoint (name it with --label)",
    "num_prefill": _CLUSTER,
    "num_decode": _CLUSTER,
    "model": "--base-url serves its own model (with --base-url, --model names "
    "the model field of the requests)",
    "model_preset": _CLUSTER,
    "model_layers": _CLUSTER,
    "model_hidden_size": _CLUSTER,
    "model_kv_heads": _CLUSTER,
    "model_head_dim": _CLUSTER,
    "dtype": _CLUSTER,
    "platform": _CLUSTER,
    "gpu_memory_utilization": _CLUSTER,
    "max_num_batched_tokens": _CLUSTER,
    "kv_cache_space_gb": _CLUSTER,
    "port": _CLUSTER,
    "base_http_port": _CLUSTER,
    "base_side_channel_port": _CLUSTER,
    "startup_timeout_s": _CLUSTER,
    "hosts": _CLUSTER,
    "link_gbit": "link rates are shaped on rehearsal hosts the benchmark starts",
    "block_size": _CLUSTER,
    "prefill_tp": _CLUSTER,
    "decode_tp": _CLUSTER,
    "colocated_tp": _CLUSTER,
    "prefill_dp": _CLUSTER,
    "decode_dp": _CLUSTER,
    "share_kvpush_cluster": _CLUSTER,
    "repeat": "rounds run every configuration on a fresh cluster; run the "
    "command again for another sample",
}
ENDPOINT_WORKLOADS = ("sweep", "saturation", "multi-turn")

FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(BenchConfig))
_DEFAULTS = {
    f.name: f.default
    for f in dataclasses.fields(BenchConfig)
    if f.default is not dataclasses.MISSING
}
_PATHS = ("model", "output_dir", "tokenizer")
_TUPLES = {
    "configs": str,
    "qps": float,
    "concurrency": int,
    "prompt_len_sweep": int,
    "link_gbit": float,
}
_STRINGS = (
    "prompt_len", "output_len", "hosts", "workload", "model_preset",
    "churn_prompt_len", "churn_output_len", "base_url", "label", "served_model",
    "platform",
)  # fmt: skip


def load_config_file(path: Path) -> dict[str, Any]:
    """Read a JSON or TOML file of BenchConfig fields into a dict (the keys
    are checked by :func:`make_config`)."""
    return read_settings_file(path)


def make_config(*layers: dict[str, Any]) -> BenchConfig:
    """A BenchConfig from value layers, later layers winning (preset, file,
    flags); converts lists, paths and numbers, naming the key on error."""
    values: dict[str, Any] = {}
    for layer in layers:
        layer = canonical_keys(layer)
        unknown = sorted(set(layer) - FIELD_NAMES)
        if unknown:
            known = sorted(FIELD_NAMES | set(KEY_ALIASES))
            raise ValueError(f"unknown bench settings {unknown}; known: {known}")
        values.update(layer)
    if values.get("base_url") is not None and values.get("model") is not None:
        # with --base-url, model names the served model, not a directory
        values.setdefault("served_model", str(values.pop("model")))
    values.update(workload_defaults(values))
    if values.get("model_preset") is not None:
        chosen = model_preset_of(str(values["model_preset"]))
        values.setdefault("max_model_len", chosen.max_model_len)
        values.setdefault("kv_cache_space_gb", chosen.kv_cache_space_gb)
    converted = {key: _convert(key, value) for key, value in values.items()}
    try:
        return BenchConfig(**converted)
    except TypeError as e:
        raise ValueError(f"bad bench setting: {e}") from e


def canonical_keys(layer: dict[str, Any]) -> dict[str, Any]:
    """``layer`` with ``vllm bench serve``'s names (:data:`KEY_ALIASES`) as
    the fields they set; ValueError where a layer gives both names with
    different values."""
    out = dict(layer)
    for alias, field in KEY_ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if field in out and _convert(field, out[field]) != _convert(field, value):
            raise ValueError(
                f"{alias} ({value!r}) and its older name {field} ({out[field]!r}) "
                "differ; give one of them"
            )
        out[field] = value
    return out


def _convert(key: str, value: Any) -> Any:
    try:
        if value is None:
            return None
        if key in _PATHS:
            return Path(value).expanduser()
        if key in _TUPLES:
            if isinstance(value, int | float) and not isinstance(value, bool):
                value = [value]  # one value where a list is allowed
            items = value.split(",") if isinstance(value, str) else value
            return tuple(_item(_TUPLES[key], v) for v in items)
        if key in _STRINGS:
            return str(value)
        return value
    except (TypeError, ValueError) as e:
        raise ValueError(f"bench setting {key}={value!r} is not valid: {e}") from e


def _item(kind: type, value: Any) -> Any:
    if kind is str:
        return str(value).strip()
    number = float(value)
    if kind is int and not number.is_integer():
        raise ValueError(f"{value!r} is not a whole number")
    return kind(number)


def preset(name: str) -> dict[str, Any]:
    """The values of a named preset."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return dict(PRESETS[name])
