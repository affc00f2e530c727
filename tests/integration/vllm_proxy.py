"""A minimal router that speaks only vLLM's P/D request protocol.

Written from vLLM's documented protocol, not from kvpush (it imports
nothing of kvpush): what a router built for vLLM's NixlConnector sends.
One prefill, one decode, three styles:

* ``pull``: prefill first (``do_remote_decode``, ``max_tokens`` 1,
  ``stream`` false), then decode with prefill's ``kv_transfer_params``
  forwarded whole (vLLM's ``toy_proxy_server.py``);
* ``push``: prefill first, then decode with ``do_remote_prefill`` and
  only ``remote_engine_id``, ``remote_request_id``, ``remote_host``,
  ``remote_port`` and ``tp_size`` of prefill's answer
  (``toy_push_proxy_server.py``);
* ``concurrent``: both legs at once, paired by a ``transfer_id`` the
  router draws (uuid4 hex); decode's leg names the prefill from the
  router's own configuration.

Both legs carry the same ``X-Request-Id``. Decode's answer, streamed or
not, is passed back as it comes.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

STYLES = ("pull", "push", "concurrent")
PUSH_FIELDS = (
    "remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size",
)  # fmt: skip


@dataclass(frozen=True)
class ProxyConfig:
    """The instances, and (``concurrent`` only) what the router knows of
    the prefill: its engine id, side-channel address and TP size."""

    style: str
    prefill_url: str
    decode_url: str
    prefill_engine_id: str = ""
    prefill_host: str = ""
    prefill_port: int = 0
    prefill_tp: int = 1

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, not {self.style!r}")


def prefill_body(body: dict[str, Any], transfer_id: str | None) -> dict[str, Any]:
    """The prefill leg of ``body``."""
    params: dict[str, Any] = {
        "do_remote_decode": True, "do_remote_prefill": False,
        "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None,
    }  # fmt: skip
    if transfer_id is not None:
        params["transfer_id"] = transfer_id
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    leg.update(max_tokens=1, stream=False, kv_transfer_params=params)
    return leg


def decode_params(
    config: ProxyConfig, answer: dict[str, Any] | None, transfer_id: str | None
) -> dict[str, Any] | None:
    """The decode leg's ``kv_transfer_params`` (None: prefill gave none,
    and decode computes the prompt itself)."""
    if config.style == "concurrent":
        return {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": config.prefill_engine_id,
            "remote_host": config.prefill_host, "remote_port": config.prefill_port,
            "tp_size": config.prefill_tp, "transfer_id": transfer_id,
        }  # fmt: skip
    if not answer or config.style == "pull":
        return answer or None
    kept = {name: answer.get(name) for name in PUSH_FIELDS}
    return {"do_remote_prefill": True, "do_remote_decode": False, **kept}


class Proxy:
    """The router's HTTP server: ``/v1/completions``, ``/v1/chat/completions``."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` (0: a free port); returns the base URL."""
        timeout = aiohttp.ClientTimeout(total=None, sock_read=180)
        self._session = aiohttp.ClientSession(timeout=timeout)
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0]
        return f"http://{bound[0]}:{bound[1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        headers = {"X-Request-Id": uuid.uuid4().hex}
        is_concurrent = self.config.style == "concurrent"
        tid = uuid.uuid4().hex if is_concurrent else None
        prefill = asyncio.create_task(self._prefill(request.path, body, headers, tid))
        answer = None if is_concurrent else await prefill
        params = decode_params(self.config, answer, tid)
        decode = dict(body, kv_transfer_params=params) if params else body
        try:
            return await self._relay(request, decode, headers)
        finally:  # concurrent: prefill's answer is discarded
            await asyncio.gather(prefill, return_exceptions=True)

    async def _prefill(
        self, path: str, body: dict[str, Any], headers: dict[str, str], tid: str | None
    ) -> dict[str, Any] | None:
        """Send the prefill leg; its answer's ``kv_transfer_params``."""
        assert self._session is not None
        url = self.config.prefill_url + path
        leg = prefill_body(body, tid)
        async with self._session.post(url, json=leg, headers=headers) as resp:
            resp.raise_for_status()
            reply = await resp.json()
        answer: dict[str, Any] | None = reply.get("kv_transfer_params")
        return answer

    async def _relay(
        self, request: web.Request, body: dict[str, Any], headers: dict[str, str]
    ) -> web.StreamResponse:
        """Send the decode leg; pass its answer back chunk by chunk."""
        assert self._session is not None
        url = self.config.decode_url + request.path
        async with self._session.post(url, json=body, headers=headers) as resp:
            kind = resp.headers.get("Content-Type", "application/json")
            out = web.StreamResponse(status=resp.status, headers={"Content-Type": kind})
            await out.prepare(request)
            try:
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
            except ConnectionResetError:  # the client stopped at its last event
                pass
            return out


class BackgroundProxy:
    """A :class:`Proxy` on its own event loop, in a thread (for tests)."""

    def __init__(self, config: ProxyConfig) -> None:
        self._proxy = Proxy(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vllm-proxy", daemon=True
        )
        self._thread.start()
        self.url = self._call(self._proxy.start())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(60)

    def close(self) -> None:
        try:
            self._call(self._proxy.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
