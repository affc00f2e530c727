"""The network's faults, on a kvpush 1P1D cluster of rehearsal hosts
(``--hosts netns``, 1 Gbit/s links, the KV over UCX's TCP transport).

For each fault, like the rest of the fault suite: every request ends either
correct (the greedy output of ``colocated``) or with a clear OpenAI-shaped
error, within its deadline; nothing hangs; afterwards neither instance holds
KV blocks, and the pair pushes again. Deadlines are those of
``test_faults.py`` (registrations 8 s, so decode's own deadline is 13 s;
finished KV waits 4 s; a silent decode is dropped after 3 s).

Skipped, with the reason, only where this machine cannot make network
namespaces.
"""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvpush import client
from kvpush.launcher import netns
from tests.integration import faults, workload
from tests.integration.conftest import Cluster, start_cluster

pytestmark = pytest.mark.integration

LINK_GBIT = 1.0
OPTIONS: dict[str, Any] = {
    **faults.SHORT_DEADLINES,
    "hosts": "netns",
    "link_gbit": LINK_GBIT,
    "verify_kv": "all",  # no fault may let corrupt KV through unnoticed
}
DEADLINE_S = 60.0  # no request may take longer, whatever the fault
DECODE_DEADLINE_S = 8.0 + 5.0  # registration ttl + decode's grace


@pytest.fixture(scope="module")
def cluster(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    c = start_cluster("kvpush", model_dir, tmp_path_factory.mktemp("netf"), **OPTIONS)
    try:
        yield c
    finally:
        c.stop()


def host(cluster: Cluster, name: str) -> netns.HostNet:
    assert cluster.state.network is not None
    return cluster.state.network.host(name)


@pytest.fixture(autouse=True)
def links_restored_after(cluster: Cluster) -> Iterator[None]:
    """After each test: no faults, every link up at its rate."""
    yield
    faults.set_faults(cluster)
    for name in ("prefill0", "decode0"):
        netns.set_link(host(cluster, name), up=True)
        netns.shape(host(cluster, name), LINK_GBIT * 1000.0)


def send_all(
    cluster: Cluster, names: list[str], during: Any, tag: str
) -> dict[str, client.Reply]:
    """Send ``names`` at once, run ``during(first_client_id)`` while they
    are in flight, and return every reply (each within its deadline)."""
    ids = {n: f"{tag}-{n}-{uuid.uuid4().hex[:6]}" for n in names}
    with ThreadPoolExecutor(len(names)) as pool:
        pending = {
            n: pool.submit(faults.send_named, cluster, n, DEADLINE_S, ids[n])
            for n in names
        }
        during(ids[names[0]])
        return {n: f.result(timeout=DEADLINE_S + 10) for n, f in pending.items()}


def assert_correct_or_clear_error(
    reference: workload.Outputs, replies: dict[str, client.Reply]
) -> int:
    """Every reply is the reference's, or a clear error; how many erred."""
    errors = 0
    for name, reply in replies.items():
        if reply.status >= 400:
            error = reply.body.get("error", {})
            assert error.get("message") and error.get("type"), (name, reply.body)
            errors += 1
            continue
        problem = workload.mismatch(reference[name], reply)
        assert problem is None, f"{name}: {problem}"
        assert reply.total_s < DEADLINE_S, f"{name} took {reply.total_s:.1f} s"
    return errors


def pair_works_again(cluster: Cluster, reference: workload.Outputs, name: str) -> None:
    faults.assert_no_blocks_held(cluster, timeout_s=45.0)
    faults.wait_router_routes(cluster)
    faults.assert_pushed_named(cluster, reference, name, DEADLINE_S)


def partition(cluster: Cluster, name: str, seconds: float) -> None:
    """Cut ``name``'s host off the network (both ways) for ``seconds``."""
    netns.set_link(host(cluster, name), up=False)
    try:
        time.sleep(seconds)
    finally:
        netns.set_link(host(cluster, name), up=True)


def test_a_three_second_partition_during_transfers(cluster, reference):
    """Decode's link goes down while its transfers are registered and their
    KV is being computed; the WRITEs posted into the partition resume when
    it heals."""
    faults.set_faults(cluster, delay_ready_s=1.0)  # KV ready inside the cut

    def cut(first: str) -> None:
        faults.wait_transfer_phase(cluster, first, "reg_received")
        partition(cluster, "decode0", 3.0)

    names = [f"concurrent-{i}" for i in (20, 21, 22, 23)]
    replies = send_all(cluster, names, cut, "part3")
    assert assert_correct_or_clear_error(reference, replies) == 0
    pair_works_again(cluster, reference, "concurrent-24")


def test_a_partition_longer_than_the_peer_timeout(cluster, reference):
    """An 8 s cut, over the 3 s peer timeout: prefill drops the silent
    decode's unposted transfers and its Failures are lost in the partition.
    On reconnect (same prefill boot) the two sides reconcile: decode learns
    those transfers will never be written and falls back then, not at its
    own deadline."""
    before = faults.counters(cluster)
    faults.set_faults(cluster, delay_post_s=5.0)  # matched, not yet posted
    started = time.monotonic()

    def cut(first: str) -> None:
        faults.wait_transfer_phase(cluster, first, "kv_ready")
        partition(cluster, "decode0", 8.0)

    replies = send_all(cluster, ["concurrent-25", "concurrent-26"], cut, "part8")
    assert assert_correct_or_clear_error(reference, replies) == 0
    assert faults.delta(before, cluster, "prefill0", "peer_lost") >= 1
    healed = max(r.total_s for r in replies.values())
    assert healed < DECODE_DEADLINE_S, (
        f"answered {healed:.1f} s after sending ({time.monotonic() - started:.1f}"
        " s ago): decode waited for its own deadline instead of reconciling"
    )
    pair_works_again(cluster, reference, "concurrent-27")


def test_a_flapping_link(cluster, reference):
    """Decode's link goes down and up five times in 10 s under load."""
    stop = threading.Event()

    def flap(first: str) -> None:
        del first
        for _ in range(5):
            partition(cluster, "decode0", 1.0)
            if stop.wait(1.0):
                return

    names = [f"concurrent-{i}" for i in (28, 29, 30, 31)]
    replies = send_all(cluster, names, flap, "flap")
    stop.set()
    assert_correct_or_clear_error(reference, replies)
    pair_works_again(cluster, reference, "chat-stream")


def test_a_link_shaped_to_ten_mbit_under_load(cluster, reference):
    """Prefill's egress drops to 10 Mbit/s (1.2 MB/s) with about 16 MB of KV
    to move: the later transfers blow decode's deadline. Decode quarantines
    their blocks and asks; prefill lets each WRITE run to its end (a
    cancelled WRITE over TCP still lands what UCX had sent: before that
    fix, one of these requests came back with another's KV) and its Done
    completes the request, late but correct."""
    before = faults.counters(cluster)
    netns.shape(host(cluster, "prefill0"), 10.0)
    names = [f"concurrent-{i}" for i in range(8, 20)]
    replies = send_all(cluster, names, lambda first: None, "slow")
    assert assert_correct_or_clear_error(reference, replies) == 0
    netns.shape(host(cluster, "prefill0"), LINK_GBIT * 1000.0)
    assert max(r.total_s for r in replies.values()) > DECODE_DEADLINE_S
    assert faults.delta(before, cluster, "decode0", "quarantined.blocks") >= 1
    pair_works_again(cluster, reference, "completion-stream")


def reset_side_channel(cluster: Cluster) -> int:
    """Kill decode's TCP connections to prefill's side channel (``ss -K``);
    how many ``ss`` saw."""
    assert cluster.state.network is not None
    prefill, decode = host(cluster, "prefill0"), host(cluster, "decode0")
    port = next(
        p.side_channel_port for p in cluster.state.processes if p.name == "prefill0"
    )
    done = subprocess.run(
        ["ip", "netns", "exec", decode.namespace, "ss", "-K", "-t", "-n",
         "dst", prefill.address, "dport", "=", f":{port}"],
        capture_output=True, text=True, timeout=10, check=True,
    )  # fmt: skip
    return sum(1 for line in done.stdout.splitlines() if "ESTAB" in line)


def test_a_side_channel_reset_in_a_burst_of_registrations(cluster, reference):
    """Decode's side-channel connections are reset (``ss -K``) while eight
    registrations are on their way; ZMQ reconnects."""
    killed: list[int] = []

    def reset(first: str) -> None:
        del first
        for _ in range(3):
            time.sleep(0.2)
            killed.append(reset_side_channel(cluster))

    names = [f"concurrent-{i}" for i in range(8)]
    replies = send_all(cluster, names, reset, "reset")
    assert sum(killed) >= 1, "ss -K found no side-channel connection to reset"
    assert_correct_or_clear_error(reference, replies)
    pair_works_again(cluster, reference, "completion-shared-prefix")


def test_kill_prefill_off_loopback_waits_for_its_new_boot(cluster, reference):
    """kill -9 of prefill on its own host while a transfer is matched but
    not posted. Off loopback a closed connection proves nothing (a partition
    looks the same), so decode keeps the blocks until the restarted prefill
    answers (its HelloReply's new boot id proves the old one gone; its
    answer to decode's Reconcile says it never heard of the transfer), and
    decode computes the prompt itself."""
    before = faults.counters(cluster)
    faults.set_faults(cluster, delay_post_s=30.0)  # matched, held back

    def kill_and_restart(first: str) -> None:
        tid = faults.wait_transfer_phase(cluster, first, "kv_ready")
        assert "write_posted" not in faults.phases(cluster, tid)
        faults.kill_instance(cluster, "prefill0")
        faults.set_faults(cluster)
        cluster.restart("prefill0")

    replies = send_all(cluster, ["concurrent-5"], kill_and_restart, "kill")
    assert assert_correct_or_clear_error(reference, replies) == 0
    faults.nudge(cluster, "decode0")
    time.sleep(1.0)
    assert faults.delta(before, cluster, "decode0", "fallback") >= 1, faults.counters(
        cluster
    )
    pair_works_again(cluster, reference, "concurrent-6")


def test_no_kv_digest_mismatched_under_the_network_faults(cluster):
    """Runs last: decode0 (never restarted in this module) verified every
    receive of the faults above against prefill's digest; none differed."""
    faults.assert_no_digest_mismatch(cluster)
