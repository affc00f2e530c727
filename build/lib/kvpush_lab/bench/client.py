"""The benchmark's streaming OpenAI client (asyncio + aiohttp).

:func:`send` posts one request to ``/v1/completions`` through the router and
returns its :class:`RequestRecord`, whatever happens: an HTTP error, a broken
connection, an error event in the stream, a stream cut short or the
deadline passing all end as a record whose ``error`` says which, and whose
``error_message`` is set when the server explained the error in OpenAI's
shape (``{"error": {"message": ...}}``). A chunk counts as a token when it
carries a choice (its text may be empty: a byte-level token can end
mid-character); the usage chunk does not. The choice's ``finish_reason``
is kept, and so are the generated token ids when the request asked for them
(``return_token_ids``), the router's ``x-kvpush-binding`` and
``x-kvpush-decode`` headers, and a conversation's ``x-session-id`` is sent.
A request planned to be aborted (``abort_after_tokens``) closes its
connection after that many token chunks and ends as error ``aborted``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from kvpush_lab.bench.bindings import BINDING_HEADER, DECODE_HEADER
from kvpush_lab.bench.records import (
    ABORTED,
    CONNECT,
    INCOMPLETE,
    NO_TOKENS,
    STREAM_ERROR,
    TIMEOUT,
    RequestRecord,
)
from kvpush_lab.bench.workload import RequestSpec

TRANSPORT = "transport"
REQUEST_ID_HEADER = "X-Request-Id"
SESSION_HEADER = "x-session-id"
_MAX_DETAIL = 300


def make_session() -> aiohttp.ClientSession:
    """One session for a whole configuration run: no connection limit, no
    session-wide timeout (each request has its own deadline)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None),
    )


async def send(
    session: aiohttp.ClientSession,
    url: str,
    spec: RequestSpec,
    record: RequestRecord,
    timeout_s: float,
    point_start: float,
) -> RequestRecord:
    """Send ``spec`` and fill ``record`` (times relative to ``point_start``,
    a ``time.perf_counter()`` value)."""
    start = time.perf_counter()
    record.sent_s = start - point_start
    record.sent_wall = time.time()
    try:
        async with asyncio.timeout(timeout_s):
            await _exchange(session, url, spec, record, start)
    except TimeoutError:
        _fail(record, TIMEOUT, f"no complete answer within {timeout_s:g} s")
    except aiohttp.ClientConnectorError as e:
        _fail(record, CONNECT, str(e))
    except (aiohttp.ClientError, ConnectionError) as e:
        _fail(record, TRANSPORT, f"{type(e).__name__}: {e}")
    record.end_s = time.perf_counter() - start
    return record


async def _exchange(
    session: aiohttp.ClientSession,
    url: str,
    spec: RequestSpec,
    record: RequestRecord,
    start: float,
) -> None:
    headers = {REQUEST_ID_HEADER: spec.bench_id}
    if spec.session is not None:
        headers[SESSION_HEADER] = spec.session
    endpoint = url.rstrip("/") + "/v1/completions"
    async with session.post(endpoint, json=spec.body(), headers=headers) as resp:
        record.status = resp.status
        record.binding = resp.headers.get(BINDING_HEADER)
        record.decode = resp.headers.get(DECODE_HEADER)
        if resp.status != 200:
            text = await resp.text(errors="replace")
            _fail(record, f"http_{resp.status}", text)
            _note_error_message(record, _decode(text.encode()))
            return
        await _read_stream(resp, record, start, spec.abort_after_tokens)


async def _read_stream(
    resp: aiohttp.ClientResponse,
    record: RequestRecord,
    start: float,
    abort_after_tokens: int | None = None,
) -> None:
    """Read SSE lines until ``[DONE]``, timing every token chunk; or, given
    ``abort_after_tokens``, until that many token chunks came, then close
    the connection (the server sees the client gone and aborts)."""
    async for raw in resp.content:
        now = time.perf_counter() - start
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[len(b"data:") :].strip()
        if payload == b"[DONE]":
            if not record.token_times_s:
                _fail(record, NO_TOKENS, "the stream ended without any token")
            return
        event = _decode(payload)
        if event is None or "error" in event:
            _fail(record, STREAM_ERROR, payload.decode(errors="replace"))
            _note_error_message(record, event)
            return
        choices = event.get("choices")
        if choices:
            record.token_times_s.append(now)
            _note_finish(record, choices)
            _note_token_ids(record, choices)
            if abort_after_tokens is not None and (
                len(record.token_times_s) >= abort_after_tokens
            ):
                resp.close()
                _fail(record, ABORTED, f"closed after {abort_after_tokens} tokens")
                return
        _note_usage(record, event.get("usage"))
    _fail(record, INCOMPLETE, "the stream ended without [DONE]")


def _decode(payload: bytes) -> dict[str, Any] | None:
    try:
        event = json.loads(payload)
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) else None


def openai_error_message(body: dict[str, Any] | None) -> str | None:
    """The message of an OpenAI-shaped error, ``{"error": {"message": ...}}``
    (None for anything else)."""
    error = body.get("error") if body is not None else None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else None


def _note_error_message(record: RequestRecord, body: dict[str, Any] | None) -> None:
    message = openai_error_message(body)
    record.error_message = None if message is None else message[:_MAX_DETAIL]


def _note_finish(record: RequestRecord, choices: Any) -> None:
    last = choices[-1] if isinstance(choices, list) else None
    reason = last.get("finish_reason") if isinstance(last, dict) else None
    if isinstance(reason, str) and reason:
        record.finish_reason = reason


def _note_token_ids(record: RequestRecord, choices: Any) -> None:
    """Keep the generated token ids a chunk carries (``return_token_ids``)."""
    for choice in choices if isinstance(choices, list) else ():
        ids = choice.get("token_ids") if isinstance(choice, dict) else None
        if isinstance(ids, list):
            record.output_token_ids += [i for i in ids if isinstance(i, int)]


def _note_usage(record: RequestRecord, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if isinstance(prompt, int):
        record.prompt_tokens = prompt
    if isinstance(completion, int):
        record.output_tokens = completion


def _fail(record: RequestRecord, kind: str, detail: str) -> None:
    record.error = kind
    record.error_detail = detail[:_MAX_DETAIL]
