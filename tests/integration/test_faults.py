"""Fault injection on a real kvpush 1P1D cluster.

For each fault, every request ends either correct (the same greedy output
as ``colocated``: text and logprobs) or with a clear OpenAI-shaped error,
within its deadline; nothing hangs; and afterwards both instances hold no
KV blocks (vLLM's ``kv_cache_usage_perc`` back to 0).

Deadlines are short so the suite takes minutes: registrations live 8 s,
finished KV waits 4 s for its registration, a silent decode is dead after
3 s. Prefill runs 64-token chunks so that a long prompt takes many steps
(room to kill it mid-prefill). Faults that need no kill use the fault file
(``kvpush.connector.faults``) on the running cluster; kill tests use
``kill -9`` on the whole instance and restart it. Tests share one cluster
and run in file order; each uses prompts no earlier test sent, so that no
prefix-cache hit on decode skips the transfer under test.
"""

from __future__ import annotations

import http.client
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvpush import client
from kvpush.telemetry import names
from tests.fakes.fake_nixl import wait_for
from tests.integration import faults, workload
from tests.integration.conftest import Cluster, start_cluster

pytestmark = pytest.mark.integration

# Every transfer's KV digest checked: the other faults run with it on (no
# false positive), and the self-test's fault needs it.
OPTIONS: dict[str, Any] = {**faults.SHORT_DEADLINES, "verify_kv": "all"}
DEADLINE_S = 60.0  # no request may take longer, whatever the fault


@pytest.fixture(scope="module")
def cluster(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    c = start_cluster("kvpush", model_dir, tmp_path_factory.mktemp("faults"), **OPTIONS)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(autouse=True)
def clean_slate_after(cluster: Cluster) -> Iterator[None]:
    """After each test: no faults, and every process running again (a kill
    test that failed before its restart must not fail the tests after it)."""
    yield
    faults.restore(cluster)


def prompt(i: int) -> tuple[str, str, dict[str, Any]]:
    """Workload prompt ``concurrent-i`` (5 + 47 i words): name, path, body."""
    name = f"concurrent-{i}"
    path, body = workload.CONCURRENT[name]
    return name, path, body


def send(cluster: Cluster, i: int, client_id: str = "") -> client.Reply:
    _, path, body = prompt(i)
    headers = {"X-Request-Id": client_id or uuid.uuid4().hex}
    return client.request(cluster.url, path, body, DEADLINE_S, headers)


def assert_correct(reference: workload.Outputs, i: int, reply: client.Reply) -> None:
    name = prompt(i)[0]
    problem = workload.mismatch(reference[name], reply)
    assert problem is None, f"{name}: {problem}"


def assert_pushed(cluster: Cluster, reference: workload.Outputs, i: int) -> None:
    """Request ``i`` is answered correctly through a push, not a fallback."""
    faults.assert_pushed_named(cluster, reference, prompt(i)[0], DEADLINE_S)


def finished(reply: client.Reply) -> bool:
    """Whether the answer came whole (a stream the router's death cut off
    ends early, without a finish reason)."""
    sources = reply.events or [reply.body]
    return any(
        c.get("finish_reason") for src in sources for c in src.get("choices", [])
    )


# -- metrics on vLLM's own /metrics ------------------------------------------------


def test_a_push_is_timed_on_both_instances_vllm_metrics(cluster, reference):
    """Each instance's vLLM ``/metrics`` carries the connector's
    ``vllm:kvpush_*`` families: one push is timed on both sides, each side
    with its own clock, per phase and per peer."""
    assert_pushed(cluster, reference, 27)

    def seen(name: str, sample: str | names.Family, **labels: str) -> float:
        return faults.instance_metric(cluster, name, sample, **labels)

    phase = names.KVPUSH_PHASE_SECONDS.count
    pair = names.KVPUSH_PEER_HANDOVER_SECONDS
    for p in ("registration", "write_setup", "transfer", "push"):
        assert seen("prefill0", phase, phase=p) >= 1, p
    assert seen("prefill0", pair.count, peer="decode0") >= 1
    assert seen("prefill0", names.KVPUSH_WRITE_BYTES.sum) > 0
    assert seen("prefill0", names.KVPUSH_WRITE_DESCRIPTORS.count) >= 1
    for p in ("handover", "decode_wait"):
        assert seen("decode0", phase, phase=p) >= 1, p
    assert seen("decode0", pair.count, peer="prefill0") >= 1
    assert seen("decode0", pair.sum, peer="prefill0") > 0
    bytes_in_flight = names.KVPUSH_PEER_BYTES_IN_FLIGHT
    assert seen("prefill0", bytes_in_flight, peer="decode0") == 0  # all landed


# -- faults on a running cluster ---------------------------------------------------


def test_dropped_registration_falls_back_to_local_prefill(cluster, reference):
    before = faults.counters(cluster)
    faults.set_faults(cluster, drop_registrations=True)

    reply = send(cluster, 20)

    assert_correct(reference, 20, reply)
    # Prefill's KV expired unmatched after 4 s and it told decode then;
    # decode's own deadline (8 + 5 s) did not have to pass.
    assert reply.total_s < 8.0, f"took {reply.total_s:.1f} s"
    assert faults.delta(before, cluster, "prefill0", "expired.ready") == 1
    assert faults.delta(before, cluster, "decode0", "fallback") >= 1
    faults.assert_no_blocks_held(cluster)


def test_write_delayed_past_its_deadline_falls_back(cluster, reference):
    before = faults.counters(cluster)
    faults.set_faults(cluster, delay_post_s=9.0)  # post deadline: 8 - 1 s

    reply = send(cluster, 21)

    assert_correct(reference, 21, reply)
    assert reply.total_s < 13.0, "decode was told before its own deadline"
    assert faults.delta(before, cluster, "prefill0", "expired.matched") == 1
    assert faults.delta(before, cluster, "decode0", "receive_failed.expired") == 1
    faults.assert_no_blocks_held(cluster)


def test_corrupted_kv_is_caught_and_recomputed(cluster, reference):
    """KV digests' self-test: decode inverts one byte of the KV it received
    (the fault file's ``corrupt_received``, right before the check). The
    digest must catch it and fail the receive, and vLLM recompute the
    prompt: the answer is still colocated's."""
    before = faults.counters(cluster)
    faults.set_faults(cluster, corrupt_received=True)
    reply = send(cluster, 29)
    assert_correct(reference, 29, reply)
    assert faults.delta(before, cluster, "decode0", "digest_mismatch") == 1
    mismatch = "receive_failed.digest_mismatch"
    assert faults.delta(before, cluster, "decode0", mismatch) == 1
    assert faults.delta(before, cluster, "decode0", "fallback") == 1
    faults.assert_no_blocks_held(cluster)
    faults.set_faults(cluster)
    assert_pushed(cluster, reference, 31)  # and the next one is verified, intact


@pytest.mark.parametrize(
    ("phase", "i", "fault", "wait_event"),
    [
        ("immediately", 22, {}, None),
        ("registered, KV not ready", 23, {"delay_ready_s": 3.0}, "reg_received"),
        ("matched, before the WRITE", 24, {"delay_post_s": 3.0}, "kv_ready"),
        ("during decode", 25, {}, None),
    ],
)
def test_client_abort_at_each_phase_frees_both_sides(
    cluster, phase, i, fault, wait_event
):
    # Counts reach /metrics with an engine step: step both instances first,
    # so a count left by the test before (a Cancel prefill took while idle)
    # is in ``before``, not in this test's delta.
    for name in ("prefill0", "decode0"):
        faults.nudge(cluster, name)
    before = faults.counters(cluster)
    faults.set_faults(cluster, **fault)
    _, path, body = prompt(i)
    client_id = f"abort-{i}-{uuid.uuid4().hex[:6]}"
    if phase == "during decode":
        body = {**body, "stream": True, "max_tokens": 200}
    conn = faults.start(cluster.url, path, body, client_id)
    tid = None
    if wait_event is not None:
        tid = faults.wait_transfer_phase(cluster, client_id, wait_event)
    elif phase == "during decode":
        faults.first_chunk(conn)
    faults.cut(conn)

    faults.assert_no_blocks_held(cluster)
    if tid is not None:  # held in that phase: it never got as far as a WRITE
        assert "write_posted" not in faults.phases(cluster, tid)
        # decode kept the blocks until prefill answered its Cancel
        assert faults.delta(before, cluster, "decode0", "aborted.released") == 1
        assert faults.delta(before, cluster, "prefill0", "cancelled.by_decode") == 1


def test_malformed_side_channel_burst_during_load(cluster, reference):
    before = faults.counters(cluster)
    host, port = faults.side_channel(cluster, "prefill0")
    names = [f"concurrent-{i}" for i in range(12)]
    with ThreadPoolExecutor(len(names) + 1) as pool:
        burst = pool.submit(faults.send_garbage, host, port, rounds=20)
        replies = {
            n: pool.submit(workload.send, cluster.url, *workload.CONCURRENT[n])
            for n in names
        }
        burst.result()
        problems = {
            n: workload.mismatch(reference[n], r.result()) for n, r in replies.items()
        }
    assert {n: p for n, p in problems.items() if p} == {}
    kinds = ("malformed", "oversize", "version", "unknown_type")

    def rejected() -> int:
        now = faults.counters(cluster)["prefill0"]
        return sum(
            now[f"rejected.{k}"] - before["prefill0"][f"rejected.{k}"] for k in kinds
        )

    def all_rejected() -> bool:
        if rejected() >= expected:
            return True
        faults.nudge(cluster, "prefill0")  # counted on an idle engine's thread
        return False

    expected = 20 * faults.NUM_MALFORMED  # every one counted, none let through
    assert wait_for(all_rejected, 10.0), rejected()
    assert faults.delta(before, cluster, "prefill0", "rejected.duplicate") >= 1
    faults.assert_no_blocks_held(cluster)


# -- crafted legs and paused peers (issue 9 items 4 and 8) --------------------------


def shape(name: str) -> tuple[str, dict[str, Any]]:
    return workload.SHAPES[name]


def send_shape(cluster: Cluster, name: str, client_id: str = "") -> client.Reply:
    return faults.send_named(cluster, name, DEADLINE_S, client_id)


def assert_shape_pushed(cluster: Cluster, reference: workload.Outputs, name: str):
    """Workload request ``name`` is answered correctly through a push."""
    faults.assert_pushed_named(cluster, reference, name, DEADLINE_S)


def test_crafted_legs_reusing_a_live_transfer_id_hold_nothing(cluster, reference):
    """Anyone who reaches the instances' HTTP ports can reuse a transfer id.
    The second leg on each side is served locally (on decode as a sibling,
    the rule for n > 1: it waits until the first's receive ended, registers
    nothing, then computes what its own prefix cache lacks); the first
    transfer is unharmed; nothing is held afterwards (before the fix, the
    second KV overwrote the first's bookkeeping and the first was held
    forever)."""
    before = faults.counters(cluster)
    prefill_leg, decode_leg = workload.kvpush_legs(cluster, uuid.uuid4().hex)
    first, twin = "completion-shared-prefix", "chat"
    p1, d1 = workload.leg_bodies(shape(first)[1], prefill_leg, decode_leg)
    p2, d2 = workload.leg_bodies(shape(twin)[1], prefill_leg, decode_leg)
    prefill_url, decode_url = (
        cluster.instance_url("prefill0"),
        cluster.instance_url("decode0"),
    )

    def at(url: str, name: str, body: dict[str, Any]) -> client.Reply:
        return client.request(url, shape(name)[0], body, DEADLINE_S)

    with ThreadPoolExecutor(4) as pool:
        decode1 = pool.submit(at, decode_url, first, d1)
        time.sleep(1.0)  # registered: the transfer id is live on both sides
        prefill1 = pool.submit(at, prefill_url, first, p1)
        time.sleep(0.05)  # while the first prompt is being computed
        prefill2 = pool.submit(at, prefill_url, twin, p2)
        decode2 = pool.submit(at, decode_url, twin, d2)
        replies = {n: f.result() for n, f in [("p1", prefill1), ("p2", prefill2)]}
        outputs = {first: decode1.result(), twin: decode2.result()}

    assert {n: r.status for n, r in replies.items()} == {"p1": 200, "p2": 200}
    for name, reply in outputs.items():
        assert workload.mismatch(reference[name], reply) is None, name
    assert faults.delta(before, cluster, "prefill0", "rejected.duplicate") >= 1
    assert faults.delta(before, cluster, "decode0", "sibling.after_first") >= 1
    faults.assert_no_blocks_held(cluster)


PAUSE_S = 5.0  # longer than the peer timeout (3 s), within the deadlines


@pytest.mark.parametrize(
    ("side", "name", "after"),
    [
        ("prefill0", "completion-long", "completion-stream"),
        ("decode0", "chat-stream", "completion-short"),
    ],
)
def test_a_paused_instance_and_its_peer_converge_by_themselves(
    cluster, reference, side, name, after
):
    """An operator stops one side (SIGSTOP) for longer than the peer timeout
    while a transfer is pending, then resumes it. Before the fix the pair
    stayed broken: prefill forgot the decode, decode never greeted again,
    and every later request waited out its deadline and recomputed."""
    faults.set_faults(cluster, delay_ready_s=1.5)  # the transfer stays pending
    client_id = f"pause-{side}-{uuid.uuid4().hex[:6]}"
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(send_shape, cluster, name, client_id)
        faults.wait_transfer_phase(cluster, client_id, "reg_received")
        os.killpg(cluster.pid(side), signal.SIGSTOP)
        try:
            time.sleep(PAUSE_S)
        finally:
            os.killpg(cluster.pid(side), signal.SIGCONT)
        reply = pending.result()
    faults.set_faults(cluster)

    assert workload.mismatch(reference[name], reply) is None, name
    faults.wait_router_routes(cluster)
    assert_shape_pushed(cluster, reference, after)  # the pair works again
    faults.assert_no_blocks_held(cluster)


# -- kill -9 ------------------------------------------------------------------------


def _kill_prefill_then_check(
    cluster: Cluster,
    reference: workload.Outputs,
    i: int,
    fault: dict[str, Any],
    wait_event: str,
) -> set[str]:
    """Send request ``i``, kill prefill once its transfer reached
    ``wait_event`` (and before its WRITE), check decode answered correctly
    alone, restart prefill and check the cluster serves again."""
    before = faults.counters(cluster)
    faults.set_faults(cluster, **fault)
    client_id = f"kill-prefill-{i}-{uuid.uuid4().hex[:6]}"
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(send, cluster, i, client_id)
        tid = faults.wait_transfer_phase(cluster, client_id, wait_event)
        reached = faults.phases(cluster, tid)
        faults.kill_instance(cluster, "prefill0")
        reply = pending.result()
    assert "write_posted" not in reached, reached

    assert_correct(reference, i, reply)  # decode prefilled it itself
    assert reply.total_s < 15.0, f"took {reply.total_s:.1f} s"
    assert faults.delta(before, cluster, "decode0", "receive_failed.peer_lost") >= 1
    faults.set_faults(cluster)
    cluster.restart("prefill0")
    faults.wait_router_routes(cluster)
    assert_pushed(cluster, reference, i + 1)  # by the new prefill
    faults.assert_no_blocks_held(cluster)
    return reached


def test_kill_prefill_mid_prefill(cluster, reference):
    # The post delay keeps the streamed push (the default) from posting the
    # chunks already computed, or taken from prefill's prefix cache, before
    # the kill: this test is about a prefill that dies before any WRITE
    # (kills mid-stream are test_stream_faults.py's).
    reached = _kill_prefill_then_check(
        cluster, reference, 30, {"delay_post_s": 30.0}, "reg_received"
    )
    # The trace shows whether prefill had finished computing when it died.
    assert "kv_ready" not in reached, f"prefill had finished: {reached}"


def test_kill_prefill_with_the_transfer_matched_before_its_write(cluster, reference):
    reached = _kill_prefill_then_check(
        cluster, reference, 28, {"delay_post_s": 30.0}, "kv_ready"
    )
    assert "reg_received" in reached, reached


def test_kill_decode_while_it_waits_for_kv(cluster, reference):
    before = faults.counters(cluster)
    faults.set_faults(cluster, delay_ready_s=6.0)
    client_id = f"kill-decode-{uuid.uuid4().hex[:6]}"
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(send, cluster, 18, client_id)
        # Prefill has computed the KV (held back by the fault) and holds the
        # registration: only decode's silence can free them now.
        faults.wait_transfer_phase(cluster, client_id, "kv_ready")
        faults.kill_instance(cluster, "decode0")
        reply = pending.result()

    faults.assert_clear_error(reply)  # no other decode to retry on
    assert reply.total_s < 15.0
    # Prefill frees the request's blocks on its own (decode went silent).
    assert faults.delta(before, cluster, "prefill0", "peer_lost") >= 1
    faults.set_faults(cluster)
    cluster.restart("decode0")
    faults.wait_router_routes(cluster)
    assert_pushed(cluster, reference, 19)  # into the new decode boot
    faults.assert_no_blocks_held(cluster)


def test_router_restart_with_requests_in_flight(cluster, reference):
    names = [f"concurrent-{i}" for i in (12, 13, 14, 15, 16, 17)]
    results: dict[str, Any] = {}

    def run(n: str) -> None:
        try:
            results[n] = client.request(
                cluster.url, *workload.CONCURRENT[n], DEADLINE_S
            )
        except (OSError, http.client.HTTPException) as e:  # the router died
            results[n] = e

    threads = [threading.Thread(target=run, args=(n,)) for n in names]
    for t in threads:
        t.start()
    time.sleep(0.5)
    faults.kill_instance(cluster, "router")
    for t in threads:
        t.join(DEADLINE_S)
    assert not any(t.is_alive() for t in threads), "a request hung"

    faults.assert_no_blocks_held(cluster)  # vLLM aborted the orphaned legs
    cluster.restart("router")
    for n, result in results.items():
        if isinstance(result, client.Reply) and finished(result):  # before the kill
            assert workload.mismatch(reference[n], result) is None
    assert_correct(reference, 26, send(cluster, 26))
