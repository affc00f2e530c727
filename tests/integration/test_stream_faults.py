"""Faults in the middle of a streamed push (``--push-granularity chunk``
and ``layer``, 64-token prefill chunks, 128-token blocks: a long prompt is
pushed as many items; per layer, each of them a WRITE per layer). Each
request ends correct (decode recomputes what did not arrive) and no KV
blocks stay held; the pair then pushes again.

The writer's fault delay on ready KV (``delay_ready_s``) holds every chunk
before it reaches the writer, so the items of one transfer are posted over
about a second: room to act between two of them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvpush import client
from tests.integration import faults, workload
from tests.integration.conftest import Cluster, start_cluster

pytestmark = pytest.mark.integration

# Every receive's digest verified: a fault must not let corrupt KV through.
OPTIONS: dict[str, Any] = {**faults.SHORT_DEADLINES, "verify_kv": "all"}
DEADLINE_S = 60.0


@pytest.fixture(scope="module", params=["chunk", "layer"])
def cluster(
    request: pytest.FixtureRequest,
    model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    options = {**OPTIONS, "push_granularity": request.param}
    c = start_cluster(
        "kvpush", model_dir, tmp_path_factory.mktemp("sfaults"), **options
    )
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(autouse=True)
def clean_slate_after(cluster: Cluster) -> Iterator[None]:
    yield
    faults.restore(cluster)


def send(cluster: Cluster, name: str, client_id: str) -> client.Reply:
    path, body = workload.CONCURRENT[name]
    return client.request(
        cluster.url, path, body, DEADLINE_S, {"X-Request-Id": client_id}
    )


def test_a_streamed_push_matches_colocated(cluster, reference):
    faults.assert_pushed_named(cluster, reference, "concurrent-27", DEADLINE_S)


def test_kill_prefill_after_some_chunks_were_pushed(cluster, reference):
    before = faults.counters(cluster)
    faults.set_faults(cluster, delay_ready_s=2.0)
    client_id = f"kill-stream-{uuid.uuid4().hex[:6]}"
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(send, cluster, "concurrent-31", client_id)
        tid = faults.wait_transfer_phase(cluster, client_id, "write_posted")
        faults.kill_instance(cluster, "prefill0")
        reached = faults.phases(cluster, tid)
        reply = pending.result()
    assert "write_done" not in reached, f"the push had completed: {reached}"

    problem = workload.mismatch(reference["concurrent-31"], reply)
    assert problem is None, problem  # decode computed the prompt itself
    assert faults.delta(before, cluster, "decode0", "receive_failed.peer_lost") >= 1
    faults.set_faults(cluster)
    cluster.restart("prefill0")
    faults.wait_router_routes(cluster)
    faults.assert_pushed_named(cluster, reference, "concurrent-30", DEADLINE_S)
    faults.assert_no_blocks_held(cluster)


def test_a_client_abort_between_two_chunks_frees_both_sides(cluster, reference):
    faults.set_faults(cluster, delay_ready_s=2.0)
    path, body = workload.CONCURRENT["concurrent-29"]
    client_id = f"abort-stream-{uuid.uuid4().hex[:6]}"
    conn = faults.start(cluster.url, path, body, client_id)
    tid = faults.wait_transfer_phase(cluster, client_id, "write_posted")
    faults.cut(conn)
    assert "write_done" not in faults.phases(cluster, tid)

    faults.assert_no_blocks_held(cluster)
    faults.set_faults(cluster)
    faults.assert_pushed_named(cluster, reference, "concurrent-28", DEADLINE_S)


def test_no_kv_digest_mismatched_under_the_stream_faults(cluster):
    """Runs last: decode0 (never restarted in this module) verified every
    streamed receive of the faults above against prefill's digests."""
    faults.assert_no_digest_mismatch(cluster)
