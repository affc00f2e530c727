"""A small synchronous OpenAI-API client for the demo and the tests.

Streams server-sent events and records when the first content arrives, so
callers can measure time to first token the way a user sees it.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Reply:
    """One finished request: status, body or SSE events, and timings."""

    status: int
    body: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    ttft_s: float | None = None
    total_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)  # names lower-cased

    @property
    def text(self) -> str:
        """The generated text (completions or chat, streamed or not)."""
        if self.events:
            return "".join(_delta_text(e) for e in self.events)
        choice = self.body["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]

    @property
    def usage(self) -> dict[str, Any] | None:
        if self.events:
            usages = [e["usage"] for e in self.events if e.get("usage")]
            return usages[-1] if usages else None
        return self.body.get("usage")


def _delta_text(event: dict[str, Any]) -> str:
    parts = []
    for choice in event.get("choices", []):
        if "delta" in choice:
            parts.append(choice["delta"].get("content") or "")
        else:
            parts.append(choice.get("text") or "")
    return "".join(parts)


def request(
    base_url: str,
    path: str,
    body: dict[str, Any],
    timeout_s: float = 120.0,
    headers: dict[str, str] | None = None,
) -> Reply:
    """POST ``body`` to ``base_url + path``; streams when ``body['stream']``."""
    url = urllib.parse.urlsplit(base_url)
    if url.hostname is None:
        raise ValueError(f"not an http URL: {base_url!r}")
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    start = time.perf_counter()
    try:
        conn.request(
            "POST",
            path,
            body=json.dumps(body),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        resp = conn.getresponse()
        if resp.status != 200 or not body.get("stream"):
            data = resp.read()
            reply = Reply(status=resp.status, body=json.loads(data) if data else {})
            reply.ttft_s = time.perf_counter() - start
        else:
            reply = _read_stream(resp, start)
        reply.headers = {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()
    reply.total_s = time.perf_counter() - start
    return reply


def _read_stream(resp: http.client.HTTPResponse, start: float) -> Reply:
    reply = Reply(status=resp.status)
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            break
        event = json.loads(payload)
        reply.events.append(event)
        if reply.ttft_s is None and _delta_text(event):
            reply.ttft_s = time.perf_counter() - start
    return reply


def token_logprobs(reply: Reply) -> list[float]:
    """Per-token logprobs of the generated tokens, in order."""
    sources = reply.events or [reply.body]
    values: list[float] = []
    for source in sources:
        for choice in source.get("choices", []):
            lp = choice.get("logprobs")
            if not lp:
                continue
            if "content" in lp:  # chat
                values += [item["logprob"] for item in lp["content"] or []]
            else:  # completions
                values += list(lp.get("token_logprobs") or [])
    return values
