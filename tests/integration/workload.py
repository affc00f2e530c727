"""The requests every P/D mode must answer exactly like a colocated instance.

Greedy decoding in float32: the same text and per-token logprobs within
``LOGPROB_TOLERANCE`` (cpu-notes: a prefix-cache hit alone moves them by
~6e-6 in float32).
"""

from __future__ import annotations

import random
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from kvpush import client
from kvpush.launcher.state import TOPOLOGY_FILE
from kvpush.router.legs import DP_RANK_HEADER
from kvpush.router.requests import PushDecodeParams, RemoteDecodeParams
from kvpush.telemetry import names
from kvpush.telemetry.reader import Exposition
from kvpush.topology import Backend, load_topology
from kvpush.transfer.messages import DecodeLeg, PrefillLeg

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


def completion(
    prompt: str, stream: bool, max_tokens: int = 16
) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "logprobs": 1, "stream": stream,
    }  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    return "/v1/completions", body


def chat(
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


def plain(shape: tuple[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """``shape`` asking no logprobs (as most clients do)."""
    path, body = shape
    drop = ("logprobs", "top_logprobs")
    return path, {k: v for k, v in body.items() if k not in drop}


# One request per API shape, over short and multi-block (>128-token) prompts.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "completion-short": completion("The quick brown fox", stream=False),
    "completion-long": completion(text_of(700, seed=1), stream=False),
    "completion-stream": completion(text_of(300, seed=2), stream=True),
    "chat": chat("Tell me about the cache.", stream=False),
    "chat-stream": chat(text_of(400, seed=3), stream=True),
    # Shares its first 500 words with completion-long: a partial prefix-cache
    # hit on whichever instances saw that one first.
    "completion-shared-prefix": completion(
        text_of(700, seed=1).rsplit(" ", 200)[0] + " " + text_of(200, seed=4),
        stream=False,
    ),
    # No logprobs asked (decode continues from prefill's first token).
    "completion-stream-plain": plain(completion(text_of(300, seed=8), stream=True)),
    "chat-plain": plain(chat(text_of(250, seed=9), stream=False)),
}
PLAIN = frozenset({"completion-stream-plain", "chat-plain"})  # no logprobs
# Thirty-two mixed-length requests sent all at once in P/D.
CONCURRENT: dict[str, tuple[str, dict[str, Any]]] = {
    f"concurrent-{i}": completion(text_of(5 + 47 * i, seed=100 + i), stream=i % 2 == 0)
    for i in range(32)
}

# Requests sharing a prefix, sent all at once. With 256-token chunks, a
# short request (its ~1-block prefix and a few words) leaves budget in its
# step for a long one, admitted after it in the same step, whose prefix hit
# is the block that step's forward is still filling; the long one is then
# chunked. Four more share a ~700-word (7-block) prefix, short and long.
_ONE_BLOCK, _SEVEN_BLOCKS = text_of(100, seed=6), text_of(700, seed=7)
SHARED_PREFIX: dict[str, tuple[str, dict[str, Any]]] = {
    f"shared-prefix-{i}": completion(
        f"{prefix} {text_of(words, seed=300 + i)}", stream=i % 3 == 0
    )
    for i, (prefix, words) in enumerate(
        [(_ONE_BLOCK, n) for n in (5, 300, 4, 250)]
        + [(_SEVEN_BLOCKS, n) for n in (3, 400, 130, 260)]
    )
}


def send(url: str, path: str, body: dict[str, Any]) -> client.Reply:
    return client.request(url, path, body, timeout_s=180.0)


def warm_up(url: str) -> None:
    """One small request: the first after start pays NIXL's handshake."""
    reply = send(url, *completion("warm up", stream=False, max_tokens=2))
    if reply.status != 200:
        raise RuntimeError(f"warm-up request failed: {reply.status} {reply.body}")


def every_request() -> dict[str, tuple[str, dict[str, Any]]]:
    """The whole workload, by name."""
    return {**SHAPES, **CONCURRENT, **SHARED_PREFIX}


def run_all(url: str) -> Outputs:
    """Every request of the workload, one at a time."""
    return {name: send(url, *req) for name, req in every_request().items()}


def run_concurrent(
    url: str, requests: dict[str, tuple[str, dict[str, Any]]] = CONCURRENT
) -> Outputs:
    """``requests`` (default: the CONCURRENT ones), all in flight at once."""
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        futures = {name: pool.submit(send, url, *req) for name, req in requests.items()}
        return {name: f.result() for name, f in futures.items()}


def mismatch(expected: client.Reply, actual: client.Reply) -> str | None:
    """Why ``actual`` differs from the reference ``expected`` (None if it
    matches: same status, same text, same token count, logprobs close;
    a request that asked no logprobs: same text and usage)."""
    if actual.status != 200:
        return f"status {actual.status}: {actual.body}"
    if actual.text != expected.text:
        return f"text {actual.text!r} != reference {expected.text!r}"
    want, got = client.token_logprobs(expected), client.token_logprobs(actual)
    if not want and not got and expected.usage is not None:  # none asked
        if actual.usage != expected.usage:
            return f"usage {actual.usage} != reference {expected.usage}"
        return None
    if not want or len(want) != len(got):
        return f"{len(got)} logprobs != reference {len(want)}"
    worst = max(abs(a - b) for a, b in zip(want, got, strict=True))
    if worst > LOGPROB_TOLERANCE:
        return f"logprob differs by {worst:.2e} > {LOGPROB_TOLERANCE}"
    return None


def kv_cache_usage(instance_url: str) -> float:
    """vLLM's ``vllm:kv_cache_usage_perc`` of one instance: the fraction of
    KV blocks held by requests (prefix-cached free blocks do not count)."""
    with urllib.request.urlopen(f"{instance_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    usage = Exposition.parse(text).highest(names.KV_CACHE_USAGE)
    if usage is None:
        raise AssertionError(
            f"{instance_url}/metrics has no {names.KV_CACHE_USAGE.name}"
        )
    return usage


def kvpush_legs(cluster: Any, tid: str) -> tuple[PrefillLeg, DecodeLeg]:
    """kvpush's (prefill leg, decode leg) for transfer ``tid``, built with the
    router's own parameter types from the cluster's topology."""
    topology = load_topology(cluster.run_dir / TOPOLOGY_FILE)
    prefill, decode = topology.prefills[0], topology.decodes[0]
    return (
        PrefillLeg(transfer_id=tid, decode_engine_id=decode.engine_id),
        DecodeLeg(transfer_id=tid, prefill_engine_id=prefill.engine_id,
                  prefill_host=prefill.side_channel_host,
                  prefill_port=prefill.side_channel_port,
                  prefill_tp=prefill.tp_size),
    )  # fmt: skip


def _pinned(backend: Backend) -> dict[str, str]:
    """The header that pins a leg to ``backend``'s DP rank, if it is one."""
    return {} if backend.dp_rank is None else {DP_RANK_HEADER: str(backend.dp_rank)}


def leg_bodies(
    body: dict[str, Any], prefill_params: Any, decode_params: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The bodies the router would send each leg of ``body``."""
    prefill_body = {k: v for k, v in body.items() if k != "stream_options"}
    prefill_body.update(
        max_tokens=1,
        stream=False,
        kv_transfer_params=msgspec.to_builtins(prefill_params),
    )
    decode_body = dict(body, kv_transfer_params=msgspec.to_builtins(decode_params))
    return prefill_body, decode_body


def _leg_params(mode: str, cluster: Any, request_id: str) -> tuple[Any, Any]:
    """kv_transfer_params of (prefill leg, decode leg), built with the
    router's own parameter types from the cluster's topology."""
    if mode == "kvpush":
        return kvpush_legs(cluster, uuid.uuid4().hex)
    topology = load_topology(cluster.run_dir / TOPOLOGY_FILE)
    prefill = topology.prefills[0]
    return RemoteDecodeParams(), PushDecodeParams.for_prefill(prefill, request_id)


def send_legs_in_order(
    cluster: Any, mode: str, path: str, body: dict[str, Any], first: str
) -> client.Reply:
    """Send one request's two legs straight to the instances (no router),
    ``first`` one leg, the other only once the first has had time to arrive
    (prefill: after it answered, i.e. its KV is ready; decode: 1 s later, when
    its blocks are registered). Returns decode's reply. Each leg goes to the
    first endpoint of its instance (a DP instance's rank 0, pinned as the
    router pins it)."""
    prefill_url, decode_url = (
        cluster.instance_url("prefill0"),
        cluster.instance_url("decode0"),
    )
    request_id = uuid.uuid4().hex
    topology = load_topology(cluster.run_dir / TOPOLOGY_FILE)
    prefill_headers, headers = (
        {"X-Request-Id": request_id, **_pinned(backend)}
        for backend in (topology.prefills[0], topology.decodes[0])
    )
    prefill_params, decode_params = _leg_params(mode, cluster, request_id)
    prefill_body, decode_body = leg_bodies(body, prefill_params, decode_params)

    def send_prefill() -> client.Reply:
        return client.request(prefill_url, path, prefill_body, 180.0, prefill_headers)

    with ThreadPoolExecutor(max_workers=1) as pool:
        if first == "prefill":
            prefill = send_prefill()
            if mode == "vllm-pull":
                decode_body["kv_transfer_params"] = prefill.body["kv_transfer_params"]
            return client.request(decode_url, path, decode_body, 180.0, headers)
        decode = pool.submit(
            client.request, decode_url, path, decode_body, 180.0, headers
        )
        time.sleep(1.0)
        prefill = send_prefill()
        if prefill.status != 200:
            raise AssertionError(f"prefill leg failed: {prefill.status} {prefill.body}")
        return decode.result()
