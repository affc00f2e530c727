"""The connector's one frozen config, read from vLLM's kv-transfer config.

The launcher sets these through ``kv_connector_extra_config``::

    {"side_channel_host": "127.0.0.1", "side_channel_port": 5600,
     "trace_dir": "RUN_DIR/traces"}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

ConnectorRole = Literal["prefill", "decode"]
_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}


@dataclass(frozen=True)
class ConnectorConfig:
    """What one instance's connector needs to know about itself."""

    role: ConnectorRole
    engine_id: str
    side_channel_host: str
    side_channel_port: int
    block_size: int
    trace_dir: str = ""
    registration_ttl_s: float = 60.0  # decode keeps destination blocks this long
    ready_ttl_s: float = 30.0  # prefill keeps finished KV this long unmatched
    hello_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise ValueError("kv-transfer-config needs a non-empty engine_id")
        if not 1 <= self.side_channel_port <= 65535:
            raise ValueError(
                "kv_connector_extra_config.side_channel_port must be a port "
                f"number (1..65535), not {self.side_channel_port!r}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, not {self.block_size}")

    @property
    def agent_name(self) -> str:
        """This instance's NIXL agent name: derived from the engine id so that
        decode's scheduler can name it in registrations without asking."""
        return f"kvpush-{self.engine_id}"

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> ConnectorConfig:
        """Read the config of the instance vLLM is building."""
        kv = vllm_config.kv_transfer_config
        if kv.kv_role not in _ROLES:
            raise ValueError(
                f"KvPushConnector needs kv_role kv_producer (prefill) or "
                f"kv_consumer (decode), not {kv.kv_role!r}"
            )
        extra = kv.kv_connector_extra_config or {}
        try:
            return cls(
                role=_ROLES[kv.kv_role],  # type: ignore[arg-type]
                engine_id=str(kv.engine_id or ""),
                side_channel_host=str(extra.get("side_channel_host", "127.0.0.1")),
                side_channel_port=int(extra.get("side_channel_port", 0)),
                block_size=int(vllm_config.cache_config.block_size),
                trace_dir=str(extra.get("trace_dir", "")),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad KvPushConnector config: {e}") from e
