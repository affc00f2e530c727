"""Tools of the fault-injection suite: the fault file, the connector's
counters (from each instance's vLLM ``/metrics``) and trace, client aborts,
hostile side-channel input, and waiting for an instance to hold no KV
blocks."""

from __future__ import annotations

import collections
import contextlib
import http.client
import json
import os
import random
import signal
import socket
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvpush import client
from kvpush.launcher import process as proc
from kvpush.launcher.instances import FAULT_FILE
from kvpush.router.connector_stats import events_of
from kvpush.router.first_token import Outcome
from kvpush.telemetry.names import CACHE_CONFIG_INFO, ROUTER_FIRST_TOKEN
from kvpush.telemetry.reader import Exposition, Name
from kvpush.transfer.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Cancel,
    Registration,
    encode,
)
from tests.fakes.fake_nixl import wait_for
from tests.fakes.metrics import metric
from tests.integration import workload
from tests.integration.conftest import Cluster, start_cluster

# The fault suites' cluster settings: short deadlines so each fault takes
# seconds (registrations live 8 s, finished KV waits 4 s for its
# registration, a silent decode is dropped after 3 s), and 64-token prefill
# chunks so that a long prompt takes many steps.
SHORT_DEADLINES: dict[str, Any] = {
    "fault_injection": True,
    "registration_ttl_s": 8.0,
    "ready_ttl_s": 4.0,
    "peer_timeout_s": 3.0,
    "max_num_batched_tokens": 64,
}
FAULT_RELOAD_S = 0.3  # the connector looks at the fault file every 0.1 s
# How long :func:`writes_held` holds each WRITE back: many times prefill's
# answer to its leg (tens of ms), far below any deadline of a transfer.
WRITE_HOLD_S = 1.0


@contextlib.contextmanager
def fault_cluster(model_dir: Path, run_dir: Path, **options: Any) -> Iterator[Cluster]:
    """A kvpush cluster with :data:`SHORT_DEADLINES` and ``options``; no
    fault left set when it stops."""
    c = start_cluster("kvpush", model_dir, run_dir, **{**SHORT_DEADLINES, **options})
    try:
        yield c
    finally:
        set_faults(c)
        c.stop()


def restore(cluster: Cluster) -> None:
    """After a fault test: no faults, and every process running again (a
    kill test that failed before its restart must not fail the tests after
    it)."""
    set_faults(cluster)
    for rec in cluster.state.processes:
        if not proc.is_alive(rec.pid):
            cluster.restart(rec.name)


def assert_clear_error(reply: client.Reply) -> None:
    """An OpenAI-shaped error (a message and a type): with a 4xx/5xx status,
    or, when the client's stream had begun (the router sends prefill's first
    token before decode answers), as the stream's last event, with no
    finish reason before it."""
    if reply.status == 200 and reply.events:
        *before, last = reply.events
        error = last.get("error", {})
        finished = [
            c for e in before for c in e.get("choices", []) if c.get("finish_reason")
        ]
        assert not finished, f"the stream finished before its error: {finished}"
    else:
        assert reply.status >= 400, reply.status
        error = reply.body.get("error", {})
    assert error.get("message") and error.get("type"), reply


def set_faults(cluster: Cluster, **faults: Any) -> None:
    """Make the connectors of ``cluster`` misbehave (see kvpush.connector.faults)."""
    (cluster.run_dir / FAULT_FILE).write_text(json.dumps(faults))
    time.sleep(FAULT_RELOAD_S)


@contextlib.contextmanager
def writes_held(cluster: Cluster) -> Iterator[None]:
    """Prefill holds every WRITE back :data:`WRITE_HOLD_S` from its match,
    so that a decode waiting for a prompt's KV cannot have its own first
    token before prefill answered: which of the two reaches the router
    first is otherwise a race (streamed per layer, the KV can land before
    prefill's answer does)."""
    set_faults(cluster, delay_post_s=WRITE_HOLD_S)
    try:
        yield
    finally:
        set_faults(cluster)


def first_token_outcomes(url: str) -> dict[str, float]:
    """The router at ``url``: how many first tokens it served, by outcome."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    counts = Exposition.parse(text).by_label(ROUTER_FIRST_TOKEN, "outcome")
    return {o.value: counts.get(o.value, 0.0) for o in Outcome}


def first_tokens_since(
    url: str, before: dict[str, float], count: int, timeout_s: float = 10.0
) -> dict[str, float]:
    """The outcomes the router at ``url`` counted since ``before`` (those
    that grew), once ``count`` were, or as they are at the deadline: a
    request's is counted when decode's stream has ended, which its client
    may have read a moment before."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = first_token_outcomes(url)
        grown = {o: now[o] - before[o] for o in now if now[o] > before[o]}
        if sum(grown.values()) >= count or time.monotonic() >= deadline:
            return grown
        time.sleep(0.1)


def instance_metrics(cluster: Cluster, name: str) -> str:
    """The text of instance ``name``'s vLLM ``/metrics``."""
    url = cluster.instance_url(name) + "/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def instance_metric(cluster: Cluster, name: str, sample: Name, **labels: str) -> float:
    """One sample (a family or a sample name; summed over vLLM's engines) of
    instance ``name``; 0 if absent."""
    return metric(instance_metrics(cluster, name), sample, **labels) or 0.0


def cache_config(cluster: Cluster, name: str) -> dict[str, str]:
    """Instance ``name``'s KV cache settings as vLLM resolved them (the
    labels of ``vllm:cache_config_info``: ``block_size``, ...)."""
    text = instance_metrics(cluster, name)
    for sample in Exposition.parse(text).samples(CACHE_CONFIG_INFO):
        return dict(sample.labels)
    raise AssertionError(f"{name} exports no {CACHE_CONFIG_INFO.name}")


def counters(cluster: Cluster) -> dict[str, collections.Counter[str]]:
    """The connector counters of every instance (``vllm:kvpush_events_total``
    on its ``/metrics``; since it last started). One that does not answer
    reads as no counts."""
    out: dict[str, collections.Counter[str]] = collections.defaultdict(
        collections.Counter
    )
    for rec in cluster.state.processes:
        if rec.role == "router":
            continue
        try:
            events = events_of(instance_metrics(cluster, rec.name))
        except (OSError, ValueError):
            continue
        out[rec.name].update({k: round(v) for k, v in events.items()})
    return out


def assert_no_digest_mismatch(cluster: Cluster, decode: str = "decode0") -> None:
    """Every receive ``decode`` verified since it started matched its
    digest (a suite run with ``verify_kv: all``): at least one was checked,
    none mismatched, none came without a digest."""
    nudge(cluster, decode)  # counts reach /metrics with the step after them
    events = counters(cluster)[decode]
    assert events["digest_verified"] >= 1, events
    assert events["digest_mismatch"] == 0, (events, kvpush_warnings(cluster))


def kvpush_warnings(cluster: Cluster, last: int = 60) -> dict[str, list[str]]:
    """The last ``last`` of kvpush's own log lines (its warnings and errors:
    dropped peers, failed WRITEs, corrupt KV) of every instance, for a
    failure message: CI keeps no cluster logs."""
    out = {}
    for rec in cluster.state.processes:
        lines = [
            line
            for line in read_lines(Path(rec.log_path))
            if "kvpush: " in line and "FAULT INJECTION" not in line
        ]
        out[rec.name] = lines[-last:]
    return out


def nudge(cluster: Cluster, name: str) -> None:
    """Make instance ``name``'s engine step once with a plain local request
    (no KV transfer, no counter): counts reach ``/metrics`` with the engine
    step after them, so one made on an idle engine's thread waits for this."""
    body = json.dumps({"prompt": "nudge", "max_tokens": 1}).encode()
    request = urllib.request.Request(
        cluster.instance_url(name) + "/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        resp.read()


def wait_counter(
    cluster: Cluster, engine: str, name: str, at_least: int, timeout_s: float = 10.0
) -> int:
    """Wait until counter ``name`` of ``engine`` reaches ``at_least`` (nudging
    the engine between reads); its value."""

    def reached() -> bool:
        if counters(cluster)[engine][name] >= at_least:
            return True
        nudge(cluster, engine)
        return False

    wait_for(reached, timeout_s, step_s=0.2)
    return counters(cluster)[engine][name]


def delta(before: dict[str, Any], cluster: Cluster, engine: str, name: str) -> int:
    """How much counter ``name`` of ``engine`` grew since ``before``, waiting
    (up to 10 s) for it to grow at all: counts reach /metrics with the
    engine step after them."""
    target = before[engine][name] + 1
    return wait_counter(cluster, engine, name, target) - before[engine][name]


def send_named(
    cluster: Cluster, name: str, deadline_s: float, client_id: str = ""
) -> client.Reply:
    """Send workload request ``name`` (a SHAPES or CONCURRENT entry)."""
    path, body = {**workload.SHAPES, **workload.CONCURRENT}[name]
    headers = {"X-Request-Id": client_id or uuid.uuid4().hex}
    return client.request(cluster.url, path, body, deadline_s, headers)


def assert_pushed_named(
    cluster: Cluster, reference: workload.Outputs, name: str, deadline_s: float
) -> None:
    """Workload request ``name`` is answered correctly through a push, not
    a fallback: its Done reached decode, and decode counted no fallback.
    Counts reach /metrics with the engine step after them, so decode steps
    (:func:`nudge`) before each read: an earlier request's late count is
    not taken for this one's, and nothing rests on a sleep."""
    nudge(cluster, "decode0")
    before = counters(cluster)["decode0"]["fallback"]
    client_id = f"pushed-{uuid.uuid4().hex[:8]}"
    reply = send_named(cluster, name, deadline_s, client_id)
    problem = workload.mismatch(reference[name], reply)
    assert problem is None, f"{name}: {problem}"
    wait_transfer_phase(cluster, client_id, "notif_received")
    nudge(cluster, "decode0")
    assert counters(cluster)["decode0"]["fallback"] == before, f"{name} fell back"


def trace_events(cluster: Cluster) -> list[dict[str, Any]]:
    events = []
    for path in (cluster.run_dir / "traces").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue  # a line being written
    return events


def transfer_of(cluster: Cluster, client_id: str) -> str | None:
    """The transfer id of the request sent with X-Request-Id ``client_id``
    (decode traces it with its leg's request id when it registers)."""
    for e in trace_events(cluster):
        if e["event"] == "reg_sent" and client_id in str(e.get("request_id", "")):
            return str(e["transfer_id"])
    return None


def phases(cluster: Cluster, transfer_id: str) -> set[str]:
    """The timeline events the transfer reached."""
    return {
        e["event"] for e in trace_events(cluster) if e["transfer_id"] == transfer_id
    }


def wait_transfer_phase(
    cluster: Cluster, client_id: str, event: str, timeout_s: float = 20.0
) -> str:
    """Wait until the request's transfer reached ``event``; its transfer id."""

    def reached() -> str | None:
        tid = transfer_of(cluster, client_id)
        return tid if tid is not None and event in phases(cluster, tid) else None

    tid = wait_for(reached, timeout_s)
    if not tid:  # say how far it got, and what each instance counted
        seen = transfer_of(cluster, client_id)
        got = sorted(phases(cluster, seen)) if seen else "no registration"
        raise AssertionError(
            f"request {client_id} never reached {event}: {seen} reached {got};"
            f" counts: {dict(counters(cluster))}"
        )
    return str(tid)


def kill_instance(cluster: Cluster, name: str) -> None:
    """kill -9 every process of instance ``name`` (API server, engine, worker)."""
    os.killpg(cluster.pid(name), signal.SIGKILL)


def assert_no_blocks_held(cluster: Cluster, timeout_s: float = 30.0) -> None:
    """Every instance's KV usage returns to 0 (requests all ended)."""
    names = [p.name for p in cluster.state.processes if p.role != "router"]

    def usage() -> dict[str, float]:
        return {n: workload.kv_cache_usage(cluster.instance_url(n)) for n in names}

    held = wait_for(lambda: not any(usage().values()), timeout_s, step_s=0.5)
    assert held, f"KV blocks still held {timeout_s:.0f} s after the fault: {usage()}"


def wait_router_routes(cluster: Cluster, timeout_s: float = 30.0) -> None:
    """The router's /ready says ``ok``: it probed every instance healthy."""

    def ok() -> bool:
        try:
            url = urllib.parse.urlsplit(cluster.url)
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=5)
            conn.request("GET", "/ready")
            reply = conn.getresponse()
            return reply.status == 200 and json.loads(reply.read())["status"] == "ok"
        except (OSError, ValueError, KeyError):
            return False

    assert wait_for(ok, timeout_s, step_s=0.5), "the router never routed again"


def start(
    url: str, path: str, body: dict[str, Any], client_id: str
) -> http.client.HTTPConnection:
    """Send a request and return its open connection (see :func:`cut`)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    headers = {"Content-Type": "application/json", "X-Request-Id": client_id}
    conn.request("POST", path, json.dumps(body), headers)
    return conn


def first_chunk(conn: http.client.HTTPConnection) -> None:
    """Read a streamed reply's first SSE line."""
    response = conn.getresponse()
    assert response.status == 200
    assert response.fp.readline()


def cut(conn: http.client.HTTPConnection) -> None:
    """The client goes away: close the connection mid-request."""
    assert conn.sock is not None
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def garbage_messages() -> list[list[bytes]]:
    """One of each kind of hostile side-channel input (frames to send)."""
    reg = Registration(
        transfer_id="evil-1",
        decode_engine_id="evil",
        decode_boot_id="evil-boot",
        dst_block_ids=((2**31 - 1,),),
        num_tokens=16,
        ttl_s=1.5,
    )
    envelope = msgspec.msgpack.encode
    return [
        [random.Random(1).randbytes(100)],  # malformed
        [b""],  # empty
        [b"\x00" * (MAX_MESSAGE_BYTES + 1)],  # oversized
        [envelope((PROTOCOL_VERSION + 1, {"type": "registration"}))],  # version
        [envelope((PROTOCOL_VERSION, {"type": "launch_missiles"}))],  # unknown type
        [envelope((PROTOCOL_VERSION, {"type": "registration", "x": 1}))],  # invalid
        [encode(reg), b"extra frame"],  # framing
        [encode(reg)],  # unknown transfer from an unknown engine, blocks far away
        [encode(reg)],  # the same again: a duplicate
        [encode(Cancel(transfer_id="evil-2", engine_id="evil"))],  # unknown transfer
    ]


NUM_MALFORMED = 7  # the messages above that must be rejected as malformed


def send_garbage(host: str, port: int, rounds: int) -> None:
    """``rounds`` bursts of :func:`garbage_messages` to a side channel."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{host}:{port}")
    try:
        for _ in range(rounds):
            for frames in garbage_messages():
                sock.send_multipart(frames)
            time.sleep(0.05)
    finally:
        sock.close(linger=0)


def side_channel(cluster: Cluster, name: str) -> tuple[str, int]:
    rec = next(p for p in cluster.state.processes if p.name == name)
    assert rec.side_channel_port is not None
    return urllib.parse.urlsplit(rec.url).hostname or "127.0.0.1", rec.side_channel_port


def read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def rank_worker_pid(
    cluster: Cluster, name: str, rank: int, timeout_s: float = 10.0
) -> int:
    """The PID of instance ``name``'s TP worker ``rank`` (vLLM titles it
    ``VLLM::Worker_TP<rank>``), found among the instance's process group."""
    return titled_pid(cluster, name, f"::Worker_TP{rank}", timeout_s)


def dp_engine_pid(
    cluster: Cluster, name: str, dp_rank: int, timeout_s: float = 10.0
) -> int:
    """The PID of instance ``name``'s data-parallel engine ``dp_rank`` (vLLM
    titles it ``VLLM::EngineCore_DP<rank>``)."""
    return titled_pid(cluster, name, f"::EngineCore_DP{dp_rank}", timeout_s)


def titled_pid(cluster: Cluster, name: str, suffix: str, timeout_s: float) -> int:
    """The PID of the process of instance ``name``'s group whose title
    (``argv[0]``) holds ``suffix``."""
    title = suffix.encode()

    def find() -> int | None:
        for pid in proc.group_members(cluster.pid(name)):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if title in cmdline.split(b"\0")[0]:
                return pid
        return None

    pid = wait_for(find, timeout_s)
    assert pid, f"{name} has no process titled *{suffix}"
    return int(pid)


def wait_instance_gone(cluster: Cluster, name: str, timeout_s: float) -> bool:
    """Whether every process of instance ``name`` ended within ``timeout_s``."""
    return bool(
        wait_for(
            lambda: not proc.group_members(cluster.pid(name)), timeout_s, step_s=0.5
        )
    )
