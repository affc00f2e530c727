"""The shape of a running cluster, shared by the launcher and the router.

The launcher writes a :class:`Topology` into its run directory; the router
reads it to learn which instances exist and how to address each one (HTTP
URL for requests, engine id and side-channel address for KV transfer). For
instances on other hosts (``kvpush serve``), write the file by hand::

    {"mode": "kvpush",
     "backends": [
       {"role": "prefill", "url": "http://10.0.0.1:8100", "engine_id": "prefill-a",
        "side_channel_host": "10.0.0.1", "side_channel_port": 5600},
       {"role": "decode", "url": "http://10.0.0.2:8100", "engine_id": "decode-b",
        "side_channel_host": "10.0.0.2", "side_channel_port": 5600}]}

``mode`` is colocated, vllm-pull, vllm-push or kvpush; each backend's
``role`` prefill, decode or colocated; ``url`` its HTTP address as the router
reaches it; ``engine_id`` the instance's kv-transfer engine id (``kvpush
serve`` prints its entry at start-up); ``side_channel_host``/``_port`` the
*advertised* side-channel address of a prefill (vllm-push and kvpush send it
to decode; without it their transfers fail, and loading warns); ``tp_size``
the instance's ``--tensor-parallel-size`` (default 1; a kvpush prefill's
rank ``r`` listens on ``side_channel_port + r``, and decode's leg carries
it). ``dp_rank``: for one data-parallel rank of an instance that runs
several behind one URL (vLLM's ``--data-parallel-size``, its internal load
balancer): the router pins each leg to that rank (vLLM's
``X-data-parallel-rank`` header); its ``engine_id`` is vLLM's for the rank,
``<engine id>_dp<rank>``, and its side channel starts
``side_channel_port + dp_rank * tp_size`` (kvpush) or
``side_channel_port + dp_rank`` (vLLM's NIXL connectors).
``kv_events_endpoint`` (a decode, kvpush mode): ``tcp://HOST:PORT``, an
address of the router's host where the router listens for the engine's
vLLM KV cache events and the engine's publisher connects (the decode's
``--kv-events-config`` endpoint; a DP engine's port is that plus its DP
rank, as vLLM offsets it); the router learns from them what the decode
holds. Unknown keys are
refused, and every error names the backend and the field.
"""

from __future__ import annotations

import logging
import urllib.parse
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from kvpush.side_channel_auth import is_wildcard
from kvpush.transfer.ranks import MAX_TP_SIZE

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode", "colocated"]
Mode = Literal["colocated", "vllm-pull", "vllm-push", "kvpush"]
MODES: tuple[str, ...] = ("colocated", "vllm-pull", "vllm-push", "kvpush")


class Backend(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One vLLM instance as the router sees it."""

    role: Role
    url: str
    engine_id: str
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)] = 1
    dp_rank: Annotated[int, msgspec.Meta(ge=0)] | None = None
    kv_events_endpoint: str | None = None


class Topology(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
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
        """Raise ValueError unless the backends suit the mode and each is
        addressable."""
        self._check_roles()
        engine_ids = [b.engine_id for b in self.backends]
        if len(set(engine_ids)) != len(engine_ids) or not all(engine_ids):
            raise ValueError(
                f"backend engine ids must be unique and non-empty, got "
                f"{engine_ids}; rename duplicates"
            )
        for i, backend in enumerate(self.backends):
            _check_backend(f"backends[{i}] ({backend.engine_id!r})", backend)

    def missing_side_channels(self) -> list[str]:
        """Prefills without a side-channel port in a mode that sends it to
        decode (vllm-push, kvpush): their transfers cannot work."""
        if self.mode not in ("vllm-push", "kvpush"):
            return []
        return [b.engine_id for b in self.prefills if not b.side_channel_port]

    def _check_roles(self) -> None:
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


def _check_backend(where: str, backend: Backend) -> None:
    url = urllib.parse.urlsplit(backend.url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(
            f"{where}: url {backend.url!r} must start with http:// or https:// "
            "and name a host, e.g. http://10.0.0.1:8100"
        )
    try:
        _ = url.port
    except ValueError as e:
        raise ValueError(f"{where}: url {backend.url!r} has a bad port: {e}") from e
    if is_wildcard(url.hostname) or is_wildcard(backend.side_channel_host):
        raise ValueError(
            f"{where}: 0.0.0.0 and :: are bind addresses; give the address the "
            "router and peers reach the instance at"
        )
    if not 0 <= backend.side_channel_port <= 65535:
        raise ValueError(
            f"{where}: side_channel_port must be in 1..65535 (0: none), "
            f"not {backend.side_channel_port}"
        )
    if backend.kv_events_endpoint is not None:
        check_kv_events_endpoint(
            f"{where}: kv_events_endpoint", backend.kv_events_endpoint
        )


def check_kv_events_endpoint(where: str, endpoint: str) -> None:
    """ValueError unless ``endpoint`` is ``tcp://HOST:PORT`` with a host
    that is not a wildcard."""
    url = urllib.parse.urlsplit(endpoint)
    try:
        port = url.port
    except ValueError:
        port = None
    if url.scheme != "tcp" or not url.hostname or not port:
        raise ValueError(
            f"{where} {endpoint!r} must be tcp://HOST:PORT, e.g. tcp://10.0.0.1:5800"
        )
    if is_wildcard(url.hostname):
        raise ValueError(
            f"{where} {endpoint!r} names a wildcard; give the router's address, "
            "where the router listens and the decode's engines connect"
        )


def load_topology(path: Path) -> Topology:
    """Read and validate a topology JSON file; ValueError naming the file
    and what is wrong in it."""
    try:
        topo = msgspec.json.decode(path.read_bytes(), type=Topology)
    except OSError as e:
        raise ValueError(f"cannot read topology file {path}: {e}") from e
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"topology file {path}: {e}") from e
    try:
        topo.validate()
    except ValueError as e:
        raise ValueError(f"topology file {path}: {e}") from e
    if missing := topo.missing_side_channels():
        logger.warning(
            "topology file %s: prefill(s) %s have no side_channel_port; mode %s "
            "sends it to decode, so their KV transfers will fail",
            path,
            ", ".join(missing),
            topo.mode,
        )
    return topo


def dump_topology(topo: Topology, path: Path) -> None:
    """Write a topology JSON file atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(topo)))
    tmp.replace(path)
