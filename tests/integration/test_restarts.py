"""Prefill restarts ten times under load, on a real kvpush 1P1D cluster.

Decodes that keep a restarted prefill's stale NIXL agent metadata crash or
serve corrupt tokens. Here a few client streams send greedy completions
without pause while prefill is killed (``kill -9`` of its whole process
group, as a crash) and started again (same engine id, a new boot id) ten
times, each time once the new prefill has pushed again. Every answer must
be colocated's (text and logprobs) or a clear OpenAI-shaped error; decode
never restarts and answers in every round; afterwards nothing is held
anywhere.

Every transfer's KV digest is checked (``verify_kv: all``): KV written from
or into stale memory is a mismatch, not a silent wrong token. Every request
carries a fresh ``cache_salt`` and the router binds every request early, so
each one is a push (no prefix-cache hit on either instance, no skipped
prefill leg) while prefill is up; while it is down the router answers 503.

Marked ``long``: about 7 minutes, nearly all of it ten prefill starts of
30 to 45 s each.
"""

from __future__ import annotations

import collections
import http.client
import itertools
import json
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpush import client
from kvpush.launcher import process as proc
from kvpush_lab.soak.leaks import read_kv, router_in_flight
from tests.fakes.fake_nixl import wait_for
from tests.fakes.metrics import metric
from tests.integration import faults, workload
from tests.integration.conftest import Cluster, start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.long]

NUM_RESTARTS = 10
NUM_STREAMS = 3
DEADLINE_S = 60.0  # no request may take longer, restart or not
PUSHES_PER_ROUND = 3  # verified pushes by the new prefill before the next kill
ERROR_PAUSE_S = 0.5  # a stream's pause after an error (prefill down: a 503)
OPTIONS: dict[str, Any] = {
    **faults.SHORT_DEADLINES,
    "verify_kv": "all",
    "binding": "early",
}
# Multi-block prompts (~400 to ~1,500 words; 128-token blocks, 64-token
# prefill chunks), streamed and not.
PROMPTS = [f"concurrent-{i}" for i in range(8, 32)] + [
    "completion-long",
    "chat-stream",
]
QUARANTINED = "vllm:kvpush_quarantined_blocks"
BYTES_IN_FLIGHT = "vllm:kvpush_peer_bytes_in_flight"


@dataclass(frozen=True)
class Answer:
    """How one request ended, in round ``round`` (0: before the first kill;
    ``k``: after the ``k``-th kill, before the next)."""

    round: int
    name: str
    kind: str  # "correct", "error" (clear) or "wrong"
    detail: str = ""


def judge(expected: client.Reply, reply: client.Reply) -> tuple[str, str]:
    """``correct`` (colocated's output), ``error`` (an HTTP error status with
    a message and a type) or ``wrong`` (anything else), and why."""
    problem = workload.mismatch(expected, reply)
    if problem is None:
        return "correct", ""
    error = reply.body.get("error", {}) if reply.status >= 400 else {}
    if error.get("message") and error.get("type"):
        return "error", f"{reply.status} {error['message']}"[:200]
    return "wrong", problem[:500]


class Load:
    """``NUM_STREAMS`` threads each sending the next of ``PROMPTS`` as soon
    as the last one ended, until :meth:`stop`. The test thread sets
    :attr:`round`; answers go to a queue the test reads after the stop."""

    def __init__(self, url: str, reference: workload.Outputs) -> None:
        self.round = 0
        self._url, self._reference = url, reference
        self._answers: queue.SimpleQueue[Answer] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"load-{i}")
            for i in range(NUM_STREAMS)
        ]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._end()

    def stop(self) -> list[Answer]:
        """Stop sending; every answer once each stream's last request ended."""
        self._end()
        assert not any(t.is_alive() for t in self._threads), "a request hung"
        answers = []
        while not self._answers.empty():
            answers.append(self._answers.get())
        return answers

    def _end(self) -> None:
        self._stopping.set()
        for t in self._threads:
            t.join(DEADLINE_S + 10.0)

    def _run(self, stream: int) -> None:
        for n in itertools.count(stream, NUM_STREAMS):
            if self._stopping.is_set():
                return
            name = PROMPTS[n % len(PROMPTS)]
            started_in = self.round
            kind, detail = send(self._url, self._reference, name)
            self._answers.put(Answer(started_in, name, kind, detail))
            if kind != "correct":  # the router answers at once: pace the retries
                self._stopping.wait(ERROR_PAUSE_S)


def send(url: str, reference: workload.Outputs, name: str) -> tuple[str, str]:
    """Send workload request ``name`` to ``url`` with a fresh cache salt;
    :func:`judge` its answer."""
    path, body = {**workload.SHAPES, **workload.CONCURRENT}[name]
    body = {**body, "cache_salt": uuid.uuid4().hex}  # no prefix-cache hit
    headers = {"X-Request-Id": f"restarts-{uuid.uuid4().hex}"}
    try:
        reply = client.request(url, path, body, DEADLINE_S, headers)
    except (OSError, http.client.HTTPException, ValueError) as e:
        return "wrong", f"no answer: {e!r}"
    return judge(reference[name], reply)


@pytest.fixture(scope="module")
def cluster(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    c = start_cluster(
        "kvpush", model_dir, tmp_path_factory.mktemp("restarts"), **OPTIONS
    )
    try:
        yield c
    finally:
        c.stop()


def decode_count(cluster: Cluster, event: str) -> int:
    return faults.counters(cluster)["decode0"][event]


def wait_pushes(cluster: Cluster, after: int, timeout_s: float = 60.0) -> int:
    """Wait until decode verified ``PUSHES_PER_ROUND`` more pushes than
    ``after`` (the load keeps its engine stepping); the count."""
    want = after + PUSHES_PER_ROUND
    seen = wait_for(
        lambda: decode_count(cluster, "digest_verified") >= want, timeout_s, 0.5
    )
    count = decode_count(cluster, "digest_verified")
    assert seen, f"decode verified {count - after} pushes in {timeout_s:.0f} s"
    return count


def readings(cluster: Cluster) -> dict[str, Any]:
    """What each process still holds: vLLM's KV usage and queues, decode's
    quarantined blocks, prefill's WRITE bytes in flight, the router's
    requests in flight."""
    text = {n: faults.instance_metrics(cluster, n) for n in ("prefill0", "decode0")}
    return {
        **{n: read_kv(n, n.rstrip("0"), t) for n, t in text.items()},
        "quarantined": metric(text["decode0"], QUARANTINED) or 0.0,
        "bytes_in_flight": metric(text["prefill0"], BYTES_IN_FLIGHT) or 0.0,
        "router_in_flight": router_in_flight(
            faults.instance_metrics(cluster, "router")
        ),
    }


def holds_nothing(r: dict[str, Any]) -> bool:
    return (
        r["prefill0"].is_clean
        and r["decode0"].is_clean
        and r["quarantined"] == 0
        and r["bytes_in_flight"] == 0
        and not r["router_in_flight"]
    )


def table(answers: list[Answer], pushes: list[int], restart_s: list[float]) -> str:
    """Per round: answers correct / error / wrong, decode's verified pushes,
    and how long prefill took to serve again after the kill that began it."""
    counts = collections.Counter((a.round, a.kind) for a in answers)
    lines = ["round  correct  error  wrong  pushes  restart_s"]
    for k, (num_pushes, seconds) in enumerate(
        zip(pushes, [0.0, *restart_s], strict=True)
    ):
        c = [counts[(k, kind)] for kind in ("correct", "error", "wrong")]
        lines.append(
            f"{k:5}  {c[0]:7}  {c[1]:5}  {c[2]:5}  {num_pushes:6}  {seconds:9.1f}"
        )
    return "\n".join(lines)


def log_of(cluster: Cluster, name: str) -> str:
    rec = next(p for p in cluster.state.processes if p.name == name)
    return Path(rec.log_path).read_text(errors="replace")


def test_prefill_restarts_ten_times_under_load(cluster, reference):
    decode_pids = sorted(proc.group_members(cluster.pid("decode0")))
    decode_url = cluster.instance_url("decode0")
    verified = [decode_count(cluster, "digest_verified")]
    restart_s, alone = [], []
    with Load(cluster.url, reference) as load:
        for k in range(1, NUM_RESTARTS + 1):
            verified.append(wait_pushes(cluster, verified[-1]))  # round k - 1's
            killed_at = time.monotonic()
            faults.kill_instance(cluster, "prefill0")
            load.round = k
            # Decode serves on its own while prefill is dead.
            alone.append(send(decode_url, reference, PROMPTS[k]))
            cluster.restart("prefill0")  # same engine id, a new boot id
            faults.wait_router_routes(cluster)
            restart_s.append(time.monotonic() - killed_at)
        verified.append(wait_pushes(cluster, verified[-1]))  # by the last boot
        answers = load.stop()

    pushes = [b - a for a, b in itertools.pairwise(verified)]
    summary = table(answers, pushes, restart_s)
    errors = collections.Counter(a.detail[:100] for a in answers if a.kind == "error")
    print(f"\n{summary}\nerrors: {dict(errors)}")
    wrong = [a for a in answers if a.kind == "wrong"]
    assert not wrong, f"{len(wrong)} wrong answers, first: {wrong[:3]}\n{summary}"
    rounds = {a.round for a in answers if a.kind == "correct"}
    assert rounds == set(range(NUM_RESTARTS + 1)), (
        f"a round without a correct answer\n{summary}"
    )
    assert alone == [("correct", "")] * NUM_RESTARTS, alone
    assert sorted(proc.group_members(cluster.pid("decode0"))) == decode_pids
    assert "Traceback" not in log_of(cluster, "decode0")

    settled = wait_for(lambda: holds_nothing(readings(cluster)), 30.0, 0.5)
    assert settled, f"held 30 s after the load: {readings(cluster)}"
    faults.assert_no_digest_mismatch(cluster)
    events = faults.counters(cluster)["decode0"]
    print(json.dumps(dict(sorted(events.items()))))
    assert events["peer_lost"] >= NUM_RESTARTS, events  # saw every boot end
