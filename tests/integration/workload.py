"""The requests every P/D mode must answer exactly like a colocated instance.

Greedy decoding in float32: the same text and per-token logprobs within
``LOGPROB_TOLERANCE`` (cpu-notes: a prefix-cache hit alone moves them by
~6e-6 in float32).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvpush import client

LOGPROB_TOLERANCE = 1e-4
Outputs = dict[str, client.Reply]

_WORDS = (
    "the cache moves between two engines while the router waits for a first token "
    "prefill reads every prompt token once and decode writes one token at a time "
    "blocks of keys and values travel over the network into memory that decode owns"
).split()


def text_of(num_words: int, seed: int) -> str:
    """Deterministic English-like text of ``num_words`` words."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def _completion(
    prompt: str, stream: bool, max_tokens: int = 16
) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "logprobs": 1, "stream": stream,
    }  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    return "/v1/completions", body


def _chat(
    content: str, stream: bool, max_tokens: int = 16
) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0.0,
        "logprobs": True, "top_logprobs": 1, "stream": stream,
    }  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    return "/v1/chat/completions", body


# One request per API shape, over short and multi-block (>128-token) prompts.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "completion-short": _completion("The quick brown fox", stream=False),
    "completion-long": _completion(text_of(700, seed=1), stream=False),
    "completion-stream": _completion(text_of(300, seed=2), stream=True),
    "chat": _chat("Tell me about the cache.", stream=False),
    "chat-stream": _chat(text_of(400, seed=3), stream=True),
}
# Sixteen mixed-length requests sent all at once in P/D.
CONCURRENT: dict[str, tuple[str, dict[str, Any]]] = {
    f"concurrent-{i}": _completion(text_of(5 + 97 * i, seed=100 + i), stream=i % 2 == 0)
    for i in range(16)
}


def send(url: str, path: str, body: dict[str, Any]) -> client.Reply:
    return client.request(url, path, body, timeout_s=180.0)


def warm_up(url: str) -> None:
    """One small request: the first after start pays NIXL's handshake."""
    reply = send(url, *_completion("warm up", stream=False, max_tokens=2))
    if reply.status != 200:
        raise RuntimeError(f"warm-up request failed: {reply.status} {reply.body}")


def run_all(url: str) -> Outputs:
    """Every request of the workload, one at a time."""
    return {name: send(url, *req) for name, req in {**SHAPES, **CONCURRENT}.items()}


def run_concurrent(url: str) -> Outputs:
    """The CONCURRENT requests, all in flight at once."""
    with ThreadPoolExecutor(max_workers=len(CONCURRENT)) as pool:
        futures = {
            name: pool.submit(send, url, *req) for name, req in CONCURRENT.items()
        }
        return {name: f.result() for name, f in futures.items()}


def mismatch(expected: client.Reply, actual: client.Reply) -> str | None:
    """Why ``actual`` differs from the reference ``expected`` (None if it
    matches: same status, same text, same token count, logprobs close)."""
    if actual.status != 200:
        return f"status {actual.status}: {actual.body}"
    if actual.text != expected.text:
        return f"text {actual.text!r} != reference {expected.text!r}"
    want, got = client.token_logprobs(expected), client.token_logprobs(actual)
    if not want or len(want) != len(got):
        return f"{len(got)} logprobs != reference {len(want)}"
    worst = max(abs(a - b) for a, b in zip(want, got, strict=True))
    if worst > LOGPROB_TOLERANCE:
        return f"logprob differs by {worst:.2e} > {LOGPROB_TOLERANCE}"
    return None
