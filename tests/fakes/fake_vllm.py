"""A fake vLLM OpenAI server, shared by every router test.

:class:`FakeVllm` speaks vLLM's ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health``, ``/metrics`` (with the kvpush connector's
``vllm:kvpush_events_total`` of :attr:`FakeVllm.connector_events`, as vLLM
writes them, and the load gauges of :attr:`FakeVllm.load`) and, when
``serves_tokenize``, ``/tokenize`` (one token per word, :func:`fake_tokens`)
on 127.0.0.1 (a free port), records every
request it receives, and can be told to misbehave (:class:`Fault`, a failing
``health_status``, or :meth:`FakeVllm.close` then :meth:`FakeVllm.start` on
the same port to refuse connections for a while). Its
answer text is derived from the prompt (:func:`expected_text`), so a test can
check that the client got decode's answer unchanged.

Fakes given the same :class:`KvFabric` act like a P/D pair: a prefill
(``do_remote_decode``) publishes "KV" for its X-Request-Id when it answers, and
a decode (``do_remote_prefill``) waits for that KV before generating, whichever
request arrived first, as vLLM's NIXL connectors do.
"""

from __future__ import annotations

import asyncio
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import prometheus_client
from aiohttp import web
from multidict import CIMultiDict

from kvpush.telemetry import names
from kvpush.topology import Backend, Role

DEFAULT_MAX_TOKENS = 8


def prompt_text(body: dict[str, Any]) -> str:
    """The text a request's output is derived from (prompt or chat contents)."""
    if "messages" in body:
        return " ".join(str(m.get("content", "")) for m in body["messages"])
    return str(body.get("prompt", ""))


def fake_tokens(text: str) -> list[int]:
    """What a fake's ``/tokenize`` answers: one id per word of ``text``."""
    return [zlib.crc32(w.encode()) % 30000 for w in re.findall(r"\w+", text)]


@dataclass
class Load:
    """The load gauges a fake's ``/metrics`` reports (None: left out)."""

    num_waiting: int | None = None
    num_running: int | None = None
    kv_usage: float = 0.0


def expected_text(text: str, max_tokens: int = DEFAULT_MAX_TOKENS) -> str:
    """The completion every fake produces for ``text``: its words, upper-cased."""
    return "".join(_tokens(text, max_tokens))


def _tokens(text: str, max_tokens: int) -> list[str]:
    words = re.findall(r"\w+", text) or ["EMPTY"]
    return [f" {words[i % len(words)].upper()}" for i in range(max_tokens)]


def _output_tokens(rec: Received, fault: Fault | None) -> list[str]:
    """A request's output tokens (the first one changed by a diverging fault)."""
    if rec.continues is not None:  # the pushed prompt's output, from further on
        skip = len(rec.body["prompt"]) - len(fake_tokens(rec.continues))
        return _tokens(rec.continues, skip + _max_tokens(rec.body))[skip:]
    tokens = _tokens(prompt_text(rec.body), _max_tokens(rec.body))
    if fault is not None and fault.diverge and rec.kv_transfer_params is not None:
        tokens[0] = " DIVERGED"
    return tokens


def _wants_ids(rec: Received) -> bool:
    return bool(rec.body.get("return_token_ids"))


@dataclass
class Fault:
    """Misbehaviour for the generation requests a fake receives next.

    ``arrival_delay_s`` delays the request's *recorded arrival* (and all its
    handling), which forces the order in which concurrent legs arrive.
    ``is_reset`` drops the connection before any answer; ``reset_after_chunks``
    drops it after that many SSE events (a crash mid-stream). ``diverge``: a
    decode leg (one with ``kv_transfer_params``) answers ``DIVERGED`` for its
    first token (as a sampled decode could, where prefill sampled another).
    ``legs_only``: the fault spares requests without ``kv_transfer_params``
    (the router's continuations). ``hold_eof_s`` holds a stream's end that
    long after its last event (``[DONE]``), as a slow network could.
    ``stops_at_first``: a whole (not streamed) answer ends with
    ``finish_reason`` "stop", as when the first token is end-of-sequence.
    """

    status: int | None = None
    body: bytes | None = None
    arrival_delay_s: float = 0.0
    delay_s: float = 0.0
    is_hang: bool = False
    hang_after_chunks: int | None = None
    reset_after_chunks: int | None = None
    is_reset: bool = False
    chunk_delay_s: float = 0.0
    diverge: bool = False
    legs_only: bool = False
    hold_eof_s: float = 0.0
    stops_at_first: bool = False


@dataclass
class Received:
    """One request as the fake saw it."""

    path: str
    headers: CIMultiDict[str]
    body: Any
    arrived_at: float
    answered_at: float | None = None
    is_cancelled: bool = False
    answer: dict[str, Any] | None = None
    # A decode leg whose prompt is token ids (a continuation from the first
    # token): the prompt text whose KV it received, the ids' first part.
    continues: str | None = None

    @property
    def request_id(self) -> str | None:
        return self.headers.get("X-Request-Id")

    @property
    def kv_transfer_params(self) -> Any:
        return (
            self.body.get("kv_transfer_params") if isinstance(self.body, dict) else None
        )


class KvFabric:
    """Where fake prefills leave KV for fake decodes, keyed by request id."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}
        self._prompts: dict[str, str] = {}

    def publish(self, request_id: str, prompt: str) -> None:
        self._prompts[request_id] = prompt
        self._event(request_id).set()

    async def wait(self, request_id: str, timeout_s: float) -> str | None:
        """The prompt prefilled under ``request_id``, or None after the timeout."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._event(request_id).wait()
        except TimeoutError:
            return None
        return self._prompts[request_id]

    def _event(self, request_id: str) -> asyncio.Event:
        return self._events.setdefault(request_id, asyncio.Event())


@dataclass
class FakeVllm:
    """One fake instance; ``start()`` before use and ``close()`` after."""

    engine_id: str
    role: Role = "colocated"
    fabric: KvFabric | None = None
    side_channel_port: int = 5600
    kv_wait_s: float = 5.0
    # kvpush decode: when the KV never comes, compute the prompt locally (as
    # kvpush's connector does under kv_load_failure_policy=recompute).
    kv_fallback: bool = False
    health_status: int = 200
    is_kv_producer: bool = True  # False: no kv_transfer_params, like no connector
    fault: Fault | None = None
    connector_events: dict[str, float] = field(default_factory=dict)
    metrics_delay_s: float = 0.0  # before /metrics answers
    load: Load = field(default_factory=Load)
    serves_tokenize: bool = False  # else /tokenize answers 404, as without it
    received: list[Received] = field(default_factory=list)
    metrics_served: int = 0  # /metrics answers built (each reads ``load``)
    tokenized: list[dict[str, Any]] = field(default_factory=list)
    _runner: web.AppRunner | None = None
    url: str = ""

    async def start(self, port: int = 0) -> FakeVllm:
        """Listen on ``port`` (0: a free one; a restart passes its old port)."""
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        self._runner = web.AppRunner(
            app, handler_cancellation=True, shutdown_timeout=0.2
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def restart(self) -> None:
        """Listen again on the same port after :meth:`close`."""
        await self.start(port=int(self.url.rsplit(":", 1)[1]))

    def backend(self) -> Backend:
        """This fake as a topology entry."""
        return Backend(
            role=self.role,
            url=self.url,
            engine_id=self.engine_id,
            side_channel_host="127.0.0.1",
            side_channel_port=self.side_channel_port,
        )

    async def wait_until(
        self, predicate: Callable[[list[Received]], bool], timeout_s: float = 3.0
    ) -> None:
        """Poll (every 5 ms) until ``predicate(self.received)`` or fail."""
        deadline = time.monotonic() + timeout_s
        while not predicate(self.received):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.engine_id}: condition not met: {self.received}"
                )
            await asyncio.sleep(0.005)

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": "fake-model", "object": "model", "owned_by": self.engine_id}
        return web.json_response({"object": "list", "data": [model]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.metrics_delay_s)
        text = vllm_metrics_text(self.connector_events, self.load)
        self.metrics_served += 1
        return web.Response(text=text, content_type="text/plain")

    async def _tokenize(self, request: web.Request) -> web.Response:
        if not self.serves_tokenize:
            return web.Response(status=404)
        body = await request.json()
        self.tokenized.append(body)
        tokens = fake_tokens(prompt_text(body))
        answer = {"count": len(tokens), "max_model_len": 4096, "tokens": tokens}
        return web.json_response(answer)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        fault = self.fault or Fault()
        raw = await request.read()
        body = msgspec.json.decode(raw)
        if fault.legs_only and not (
            isinstance(body, dict) and "kv_transfer_params" in body
        ):
            fault = Fault()
        if fault.arrival_delay_s:
            await asyncio.sleep(fault.arrival_delay_s)
        rec = Received(
            path=request.path,
            headers=CIMultiDict(request.headers),
            body=body,
            arrived_at=time.monotonic(),
        )
        self.received.append(rec)
        try:
            return await self._answer(request, rec, fault)
        except (asyncio.CancelledError, ConnectionResetError):
            rec.is_cancelled = True
            raise

    async def _answer(
        self, request: web.Request, rec: Received, fault: Fault
    ) -> web.StreamResponse:
        if fault.delay_s:
            await asyncio.sleep(fault.delay_s)
        if fault.is_hang:
            await asyncio.sleep(3600)
        if fault.is_reset:
            return _drop_connection(request)
        if fault.status is not None:
            rec.answered_at = time.monotonic()
            body = fault.body or _vllm_error(fault.status, "injected fault")
            return web.Response(status=fault.status, body=body)
        kv_error = await self._await_kv(rec)
        if kv_error is not None:
            return web.Response(status=500, body=_vllm_error(500, kv_error))
        if rec.body.get("stream"):
            return await self._stream(request, rec, fault)
        rec.answer = self._completion(rec, fault)
        rec.answered_at = time.monotonic()
        if self._is_prefill_leg(rec) and self.fabric is not None:
            self.fabric.publish(_pairing_key(rec), prompt_text(rec.body))
        return web.json_response(rec.answer)

    def _is_prefill_leg(self, rec: Received) -> bool:
        params = rec.kv_transfer_params
        return isinstance(params, dict) and (
            bool(params.get("do_remote_decode")) or params.get("role") == "prefill"
        )

    async def _await_kv(self, rec: Received) -> str | None:
        """A decode leg waits for its KV; returns an error text or None."""
        params = rec.kv_transfer_params
        if not isinstance(params, dict) or not (
            params.get("do_remote_prefill") or params.get("role") == "decode"
        ):
            return None
        if self.fabric is None:
            return "decode leg sent to a fake without a KvFabric"
        remote_id = _pairing_key(rec)
        prompt = await self.fabric.wait(remote_id, self.kv_wait_s)
        if prompt is None and self.kv_fallback and params.get("role") == "decode":
            return None
        if prompt is None:
            return f"KV for {remote_id} never arrived"
        num_kv_tokens = params.get("num_kv_tokens")
        if num_kv_tokens is not None:  # the prompt: those ids, then more
            ids = rec.body.get("prompt")
            if not isinstance(ids, list) or ids[:num_kv_tokens] != fake_tokens(prompt):
                return f"KV for {remote_id} is not the first {num_kv_tokens} tokens"
            rec.continues = prompt
            return None
        if prompt != prompt_text(rec.body):
            return f"KV for {remote_id} belongs to another prompt"
        return None

    def _completion(self, rec: Received, fault: Fault) -> dict[str, Any]:
        body, is_chat = rec.body, rec.path.endswith("/chat/completions")
        tokens = _output_tokens(rec, fault)
        if fault.stops_at_first:
            tokens = tokens[:1]
        text = "".join(tokens)
        finish = "stop" if fault.stops_at_first else "length"
        answer = _envelope(rec, self.engine_id, is_chat, "completion")
        if is_chat:
            message = {"role": "assistant", "content": text}
            answer["choices"] = [
                {"index": 0, "message": message, "finish_reason": finish}
            ]
        else:
            answer["choices"] = [{"index": 0, "text": text, "finish_reason": finish}]
        if _wants_ids(rec):  # where vLLM puts them
            ids = fake_tokens(prompt_text(body))
            answer["choices"][0]["token_ids"] = fake_tokens(text)
            if is_chat:
                answer["prompt_token_ids"] = ids
            else:
                answer["choices"][0]["prompt_token_ids"] = ids
        answer["usage"] = _usage(body)
        if (
            self._is_prefill_leg(rec)
            and self.is_kv_producer
            and "role" not in (rec.kv_transfer_params or {})
        ):
            answer["kv_transfer_params"] = self._returned_kv_params(rec)
        return answer

    def _returned_kv_params(self, rec: Received) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [3, 4, 5],
            "remote_engine_id": self.engine_id,
            "remote_host": "127.0.0.1",
            "remote_port": self.side_channel_port,
            "remote_request_id": rec.request_id,
            "tp_size": 1,
        }

    async def _stream(
        self, request: web.Request, rec: Received, fault: Fault
    ) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for number, event in enumerate(_stream_events(rec, self.engine_id, fault)):
            if (
                fault.hang_after_chunks is not None
                and number >= fault.hang_after_chunks
            ):
                await asyncio.sleep(3600)
            if fault.reset_after_chunks == number:
                return _drop_connection(request)
            if fault.chunk_delay_s:
                await asyncio.sleep(fault.chunk_delay_s)
            await out.write(event)
        rec.answered_at = time.monotonic()
        await asyncio.sleep(fault.hold_eof_s)
        await out.write_eof()
        return out


def vllm_metrics_text(
    connector_events: dict[str, float], load: Load | None = None
) -> str:
    """A vLLM ``/metrics`` with the connector's events and the load gauges."""
    load = load or Load()
    registry = prometheus_client.CollectorRegistry()
    engine = ("fake-model", "0")  # vLLM's labels: model_name, engine
    for family, value in (
        (names.KV_CACHE_USAGE, load.kv_usage),
        (names.NUM_REQUESTS_WAITING, load.num_waiting),
        (names.NUM_REQUESTS_RUNNING, load.num_running),
    ):
        if value is not None:
            gauge = prometheus_client.Gauge(
                family.name, family.name, family.label_names, registry=registry
            )
            gauge.labels(*engine).set(value)
    events = prometheus_client.Counter(
        names.KVPUSH_EVENTS.name, "kvpush connector events.",
        names.KVPUSH_EVENTS.label_names, registry=registry,
    )  # fmt: skip
    for event, count in connector_events.items():
        events.labels(*engine, event).inc(count)
    return prometheus_client.generate_latest(registry).decode()


def _drop_connection(request: web.Request) -> web.Response:
    """Close the client's connection without (further) answer."""
    if request.transport is not None:
        request.transport.abort()
    return web.Response(status=500)  # never sent: the connection is gone


def _stream_events(rec: Received, engine_id: str, fault: Fault) -> list[bytes]:
    body, is_chat = rec.body, rec.path.endswith("/chat/completions")
    chunks: list[dict[str, Any]] = []
    tokens = _output_tokens(rec, fault)
    if is_chat:
        tokens = ["", *tokens]  # vLLM's chat stream opens with the role delta
    for i, token in enumerate(tokens):
        finish = "length" if i == len(tokens) - 1 else None
        chunk = _envelope(rec, engine_id, is_chat, "chunk")
        if is_chat:
            delta = (
                {"role": "assistant", "content": ""} if i == 0 else {"content": token}
            )
            chunk["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}]
        else:
            chunk["choices"] = [{"index": 0, "text": token, "finish_reason": finish}]
        if _wants_ids(rec):  # as vLLM: the prompt's with the first event
            choice = chunk["choices"][0]
            is_role = is_chat and i == 0
            choice["token_ids"] = [] if is_role else fake_tokens(token)
            if i == 0:
                ids = fake_tokens(prompt_text(body))
                (chunk if is_chat else choice)["prompt_token_ids"] = ids
        chunks.append(chunk)
    if (body.get("stream_options") or {}).get("include_usage"):
        usage_chunk = _envelope(rec, engine_id, is_chat, "chunk")
        usage_chunk.update(choices=[], usage=_usage(body))
        chunks.append(usage_chunk)
    return [b"data: " + msgspec.json.encode(c) + b"\n\n" for c in chunks] + [
        b"data: [DONE]\n\n"
    ]


def _envelope(
    rec: Received, engine_id: str, is_chat: bool, kind: str
) -> dict[str, Any]:
    if is_chat:
        obj = "chat.completion.chunk" if kind == "chunk" else "chat.completion"
    else:
        obj = "text_completion"
    return {
        "id": f"cmpl-{rec.request_id}",
        "object": obj,
        "created": 0,
        "model": rec.body.get("model", "fake-model"),
        "system_fingerprint": engine_id,
    }


def _max_tokens(body: dict[str, Any]) -> int:
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return int(value) if value else DEFAULT_MAX_TOKENS


def _usage(body: dict[str, Any]) -> dict[str, int]:
    num_prompt = len(re.findall(r"\w+", prompt_text(body)))
    num_completion = _max_tokens(body)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
    }


def _vllm_error(status: int, message: str) -> bytes:
    error = {
        "message": message,
        "type": "BadRequestError",
        "param": None,
        "code": status,
    }
    return msgspec.json.encode({"error": error})


def _pairing_key(rec: Received) -> str:
    """What a fake P/D pair matches legs by: kvpush's transfer id when the
    leg has one, else (vLLM push) the request id decode names or carries."""
    params = rec.kv_transfer_params if isinstance(rec.kv_transfer_params, dict) else {}
    if "transfer_id" in params:
        return str(params["transfer_id"])
    return str(params.get("remote_request_id") or rec.request_id)
