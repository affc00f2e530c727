"""The shape of a running cluster, shared by the launcher and the router.

The launcher writes a :class:`Topology` into its run directory; the router
reads it to learn which instances exist and how to address each one (HTTP
URL for requests, engine id and side-channel address for KV transfer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

Role = Literal["prefill", "decode", "colocated"]
Mode = Literal["colocated", "vllm-pull", "vllm-push", "kvpush"]
MODES: tuple[str, ...] = ("colocated", "vllm-pull", "vllm-push", "kvpush")


class Backend(msgspec.Struct, frozen=True, kw_only=True):
    """One vLLM instance as the router sees it."""

    role: Role
    url: str
    engine_id: str
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0


class Topology(msgspec.Struct, frozen=True, kw_only=True):
    """Every backend of one cluster and the mode the router runs in."""

    mode: Mode
    backends: tuple[Backend, ...]

    @property
    def prefills(self) -> tuple[Backend, ...]:
        return tuple(b for b in self.backends if b.role == "prefill")

    @property
    def decodes(self) -> tuple[Backend, ...]:
        return tuple(b for b in self.backends if b.role == "decode")

    @property
    def colocated(self) -> tuple[Backend, ...]:
        return tuple(b for b in self.backends if b.role == "colocated")

    def validate(self) -> None:
        """Raise ValueError unless the backends suit the mode."""
        if self.mode == "colocated":
            if not self.colocated or self.prefills or self.decodes:
                raise ValueError(
                    "mode 'colocated' needs one or more colocated backends and "
                    "no prefill/decode backends"
                )
            return
        if not self.prefills or not self.decodes:
            raise ValueError(
                f"mode {self.mode!r} needs at least one prefill and one decode backend"
            )
        if self.colocated:
            raise ValueError(f"mode {self.mode!r} takes no colocated backends")


def load_topology(path: Path) -> Topology:
    """Read and validate a topology JSON file."""
    try:
        topo = msgspec.json.decode(path.read_bytes(), type=Topology)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"cannot read topology file {path}: {e}") from e
    topo.validate()
    return topo


def dump_topology(topo: Topology, path: Path) -> None:
    """Write a topology JSON file atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(topo)))
    tmp.replace(path)
