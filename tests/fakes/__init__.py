"""Shared test doubles: the fake vLLM server, and a cluster of them behind a router.

:func:`routed` starts fake backends for a mode, a real ``kvpush.router`` in
front of them on a free port, and an HTTP client; every router test uses it.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from multidict import CIMultiDict

from kvpush.router import RouterConfig, start_router
from kvpush.topology import Mode, Role, Topology
from tests.fakes.fake_vllm import (
    FakeVllm,
    Fault,
    KvFabric,
    Load,
    Received,
    expected_text,
    fake_tokens,
    prompt_text,
)

__all__ = [
    "FakeCluster",
    "FakeVllm",
    "Fault",
    "KvFabric",
    "Load",
    "Received",
    "Reply",
    "Routed",
    "dead_url",
    "expected_text",
    "fake_tokens",
    "prompt_text",
    "routed",
]


@dataclass
class FakeCluster:
    """Fake backends for one mode, sharing one KV fabric."""

    mode: Mode
    fabric: KvFabric = field(default_factory=KvFabric)
    fakes: list[FakeVllm] = field(default_factory=list)

    def by_role(self, role: Role) -> list[FakeVllm]:
        return [f for f in self.fakes if f.role == role]

    @property
    def prefills(self) -> list[FakeVllm]:
        return self.by_role("prefill")

    @property
    def decodes(self) -> list[FakeVllm]:
        return self.by_role("decode")

    @property
    def colocated(self) -> list[FakeVllm]:
        return self.by_role("colocated")

    async def add(self, role: Role, count: int) -> None:
        for i in range(count):
            fake = FakeVllm(
                engine_id=f"{role}{i}",
                role=role,
                fabric=self.fabric,
                side_channel_port=5600 + len(self.fakes),
            )
            self.fakes.append(await fake.start())

    def topology(self, url_overrides: dict[str, str] | None = None) -> Topology:
        overrides = url_overrides or {}
        backends = tuple(
            msgspec.structs.replace(f.backend(), url=overrides.get(f.engine_id, f.url))
            for f in self.fakes
        )
        return Topology(mode=self.mode, backends=backends)

    async def close(self) -> None:
        for fake in self.fakes:
            await fake.close()


@dataclass
class Reply:
    status: int
    headers: CIMultiDict[str]
    body: bytes

    def json(self) -> Any:
        return msgspec.json.decode(self.body)

    def events(self) -> list[bytes]:
        """The SSE ``data:`` payloads, in order."""
        return [
            line[len(b"data: ") :]
            for line in self.body.split(b"\n\n")
            if line.startswith(b"data: ")
        ]


@dataclass
class Routed:
    """A fake cluster with the router in front and a client to talk to it."""

    cluster: FakeCluster
    url: str
    http: aiohttp.ClientSession

    async def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> Reply:
        data = body if isinstance(body, bytes) else msgspec.json.encode(body)
        async with self.http.post(self.url + path, data=data, headers=headers) as resp:
            return Reply(resp.status, CIMultiDict(resp.headers), await resp.read())

    async def get(self, path: str) -> Reply:
        async with self.http.get(self.url + path) as resp:
            return Reply(resp.status, CIMultiDict(resp.headers), await resp.read())


@asynccontextmanager
async def routed(
    mode: Mode,
    *,
    num_prefills: int = 1,
    num_decodes: int = 1,
    url_overrides: dict[str, str] | None = None,
    **config: Any,
) -> AsyncIterator[Routed]:
    """Fakes for ``mode`` (colocated: ``num_decodes`` of them) plus a router."""
    cluster = FakeCluster(mode)
    if mode == "colocated":
        await cluster.add("colocated", num_decodes)
    else:
        await cluster.add("prefill", num_prefills)
        await cluster.add("decode", num_decodes)
    config.setdefault("shutdown_timeout_s", 0.2)
    router_config = RouterConfig(
        topology=cluster.topology(url_overrides), port=0, **config
    )
    router = await start_router(router_config)
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    try:
        yield Routed(cluster, router.url, http)
    finally:
        await http.close()
        await router.close()
        await cluster.close()


def dead_url() -> str:
    """A loopback URL nobody listens on (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"
