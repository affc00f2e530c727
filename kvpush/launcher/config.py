"""The launcher's one frozen config, validated at construction.

Values come from flags and, optionally, one JSON or TOML file whose keys are
the field names below; flags given on the command line win over the file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.settings_file import read_settings_file
from kvpush.topology import MODES

DTYPES = ("float32", "bfloat16", "float16")
FAILURE_POLICIES = ("recompute", "error")
_MAX_PORT = 65535


@dataclass(frozen=True)
class ClusterConfig:
    """Everything ``kvpush up`` needs to start a cluster.

    ``model`` None means the tiny model under ``$KVPUSH_HOME`` (made on first
    use). Instance ``i`` (prefills first, then decodes) listens for HTTP on
    ``base_http_port + i`` and for NIXL's side channel on
    ``base_side_channel_port + i``; it is pinned to ``cores[i % len(cores)]``
    (all cores this process may use when ``cores`` is empty).

    ``kv_load_failure_policy`` (P/D modes): what decode does when KV does not
    arrive: ``recompute`` the prompt locally (default) or fail the request
    with an ``error``. ``registration_ttl_s``, ``ready_ttl_s`` and
    ``peer_timeout_s`` (kvpush mode; None: the connector's defaults of 60,
    30 and 10 s) are the deadlines of :mod:`kvpush.connector.config`.
    ``fault_injection`` gives kvpush's connectors the fault file
    ``RUN_DIR/faults.json`` (tests only; see :mod:`kvpush.connector.faults`).
    """

    mode: str = "vllm-pull"
    num_prefill: int = 1
    num_decode: int = 1
    model: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    base_http_port: int = 8100
    base_side_channel_port: int = 5600
    run_dir: Path | None = None
    dtype: str = "float32"
    max_model_len: int = 4096
    max_num_batched_tokens: int | None = None
    kv_cache_space_gb: int = 1
    cores: tuple[int, ...] = ()
    startup_timeout_s: float = 300.0
    extra_vllm_args: tuple[str, ...] = ()
    kv_load_failure_policy: str = "recompute"
    registration_ttl_s: float | None = None
    ready_ttl_s: float | None = None
    peer_timeout_s: float | None = None
    fault_injection: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"mode must be one of {', '.join(MODES)}, not {self.mode!r}"
            )
        self._check_counts()
        self._check_ports()
        if self.dtype not in DTYPES:
            raise ValueError(
                f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}"
            )
        _require(self.max_model_len >= 16, "max_model_len must be at least 16")
        _require(
            self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 16,
            "max_num_batched_tokens must be at least 16 (or unset)",
        )
        _require(self.kv_cache_space_gb >= 1, "kv_cache_space_gb must be at least 1")
        _require(self.startup_timeout_s > 0, "startup_timeout_s must be positive")
        _require(all(c >= 0 for c in self.cores), "cores must be CPU numbers >= 0")
        _require(
            self.kv_load_failure_policy in FAILURE_POLICIES,
            "kv_load_failure_policy must be recompute or error, "
            f"not {self.kv_load_failure_policy!r}",
        )
        for name in ("registration_ttl_s", "ready_ttl_s", "peer_timeout_s"):
            value = getattr(self, name)
            _require(
                value is None or 0 < value <= 3600,
                f"{name} must be in (0, 3600] seconds, not {value!r}",
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

    def _check_ports(self) -> None:
        n = self.num_instances
        for name, first in (
            ("port", self.port),
            ("base_http_port", self.base_http_port),
            ("base_side_channel_port", self.base_side_channel_port),
        ):
            last = first if name == "port" else first + n - 1
            _require(
                first >= 1024 and last <= _MAX_PORT,
                f"{name} must leave ports {first}..{last} within 1024..65535",
            )
        http = set(range(self.base_http_port, self.base_http_port + n))
        side = set(range(self.base_side_channel_port, self.base_side_channel_port + n))
        _require(
            not http & side, "base_http_port and base_side_channel_port ranges overlap"
        )
        _require(
            self.port not in http | side,
            f"router port {self.port} collides with an instance port; change --port",
        )

    @property
    def num_instances(self) -> int:
        return 1 if self.mode == "colocated" else self.num_prefill + self.num_decode


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
    paths and lists; type errors become ValueErrors naming the key."""
    values = dict(values)
    for key in ("model", "run_dir"):
        if values.get(key) is not None:
            values[key] = Path(values[key]).expanduser()
    for key in ("cores", "extra_vllm_args"):
        if key in values:
            values[key] = tuple(values[key])
    try:
        return ClusterConfig(**values)
    except TypeError as e:
        raise ValueError(f"bad cluster setting: {e}") from e
