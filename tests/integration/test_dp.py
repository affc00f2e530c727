"""Data parallelism on a real CPU cluster: a prefill and a decode that each
run two engines behind their one HTTP port (``--prefill-dp 2 --decode-dp
2``: vLLM's ``--data-parallel-size 2`` and its internal load balancer).
Each engine is an endpoint of its own (engine id ``<name>_dp<rank>``; a
prefill engine listens on side-channel ports of its own); kvpush's router
picks one of each per request and pins each leg to it
(``X-data-parallel-rank``). Every check of :class:`PDChecks` against
colocated, and every engine pushed or received."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvpush.router import admin_client
from tests.fakes.fake_nixl import wait_for
from tests.integration import faults, workload
from tests.integration.conftest import Cluster
from tests.integration.test_pd_matches_colocated import PDChecks

pytestmark = pytest.mark.integration


class TestKvPushDp2(PDChecks):
    mode = "kvpush"
    cluster_options: ClassVar[dict[str, Any]] = {
        "max_num_batched_tokens": 256,
        "prefill_dp": 2,
        "decode_dp": 2,
        "verify_kv": "all",
    }

    def test_every_engine_pushed_or_received(self, pd_cluster: Cluster) -> None:
        def count(instance: str, phase: str, engine: int) -> float:
            return faults.instance_metric(
                pd_cluster,
                instance,
                "vllm:kvpush_phase_seconds_count",
                phase=phase,
                engine=str(engine),
            )

        pushed = [count("prefill0", "push", e) for e in (0, 1)]
        received = [count("decode0", "handover", e) for e in (0, 1)]
        assert all(n >= 1 for n in pushed + received), (pushed, received)

    # Declared again so that it runs after the check above.
    def test_down_stops_every_process(self, pd_cluster: Cluster) -> None:
        super().test_down_stops_every_process(pd_cluster)


# -- kill -9 of one DP engine ---------------------------------------------------------
# vLLM's internal load balancer serves an instance's DP engines from one API
# server, and that server shuts down when any of its engines dies (its
# engine monitor): one engine's death takes its sibling with it. These tests
# check what kvpush owes then: the request is answered correctly or with a
# clear error, the surviving instance holds nothing, and the restarted
# instance's engines push again. The router drains rank 0 of the instance
# under test so that the request runs on rank 1, the one killed.

DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def dp_fault_cluster(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    run_dir = tmp_path_factory.mktemp("dp-faults")
    # Registrations live 20 s, not the fault suites' 8: on 2 cores a DP
    # engine took 5 s to prefill a prompt in 64-token chunks, the
    # registration expired (decode would compute it) before decode's engine
    # was killed, and the transfer under test was already over (CI, stop 35).
    with faults.fault_cluster(
        model_dir, run_dir, prefill_dp=2, decode_dp=2, registration_ttl_s=20.0
    ) as c:
        yield c


@contextlib.contextmanager
def only_rank_1(cluster: Cluster, instance: str) -> Iterator[None]:
    """The router sends ``instance``'s legs to its DP rank 1 only."""
    admin_client.call(cluster.url, "POST", f"/admin/drain/{instance}_dp0")
    try:
        yield
    finally:
        admin_client.call(cluster.url, "POST", f"/admin/undrain/{instance}_dp0")


def _restart(cluster: Cluster, name: str) -> None:
    """vLLM took the instance down after one engine died; start it again."""
    if not faults.wait_instance_gone(cluster, name, 30.0):
        faults.kill_instance(cluster, name)  # vLLM left part of it up
    cluster.restart(name)
    faults.wait_router_routes(cluster)
    workload.warm_up(cluster.url)


def test_kill_one_decode_dp_engine_while_it_waits_for_kv(dp_fault_cluster, reference):
    """Decode's DP engine 1 waits for the request's KV (prefill holds its
    ready KV back, fault file) when it is killed: the client gets a clear
    error, prefill frees the request's blocks by itself (its peer went
    silent), and the restarted decode's engines receive again."""
    cluster = dp_fault_cluster
    before = faults.counters(cluster)
    client_id = f"kill-decode-dp-{uuid.uuid4().hex[:6]}"
    with only_rank_1(cluster, "decode0"), ThreadPoolExecutor(1) as pool:
        faults.set_faults(cluster, delay_ready_s=6.0)
        pending = pool.submit(  # not streamed: the error is the status
            faults.send_named, cluster, "concurrent-31", DEADLINE_S, client_id
        )
        faults.wait_transfer_phase(cluster, client_id, "kv_ready")
        os.kill(faults.dp_engine_pid(cluster, "decode0", 1), signal.SIGKILL)
        reply = pending.result()
        faults.set_faults(cluster)

    faults.assert_clear_error(reply)  # the instance's other engine died too
    assert reply.total_s < 15.0, f"took {reply.total_s:.1f} s"
    assert faults.delta(before, cluster, "prefill0", "peer_lost") >= 1
    prefill_url = cluster.instance_url("prefill0")
    held = wait_for(lambda: not workload.kv_cache_usage(prefill_url), 30.0, step_s=0.5)
    assert held, "prefill still holds KV blocks after decode's engine died"

    _restart(cluster, "decode0")
    faults.assert_pushed_named(cluster, reference, "concurrent-30", DEADLINE_S)
    faults.assert_no_blocks_held(cluster)


def test_kill_one_prefill_dp_engine_during_its_transfer(dp_fault_cluster, reference):
    """Prefill's DP engine 1 has computed the request's KV and holds its
    WRITE (fault file) when it is killed: decode's receive fails (its peer
    is lost) and decode answers by local recompute, correctly, well within
    the deadline, holding no blocks afterwards. (The last test of the
    module: the prefill is not started again, as the decode test above
    already checked a restarted DP instance.)"""
    cluster = dp_fault_cluster
    name = "concurrent-28"
    before = faults.counters(cluster)
    client_id = f"kill-prefill-dp-{uuid.uuid4().hex[:6]}"
    with only_rank_1(cluster, "prefill0"), ThreadPoolExecutor(1) as pool:
        faults.set_faults(cluster, delay_post_s=30.0)
        pending = pool.submit(faults.send_named, cluster, name, DEADLINE_S, client_id)
        tid = faults.wait_transfer_phase(cluster, client_id, "kv_ready")
        os.kill(faults.dp_engine_pid(cluster, "prefill0", 1), signal.SIGKILL)
        reply = pending.result()
        faults.set_faults(cluster)
    assert "write_posted" not in faults.phases(cluster, tid)

    problem = workload.mismatch(reference[name], reply)
    assert problem is None, f"{name}: {problem}"
    assert reply.total_s < 15.0, f"took {reply.total_s:.1f} s"
    assert faults.delta(before, cluster, "decode0", "receive_failed.peer_lost") >= 1
    decode_url = cluster.instance_url("decode0")
    held = wait_for(lambda: not workload.kv_cache_usage(decode_url), 30.0, step_s=0.5)
    assert held, "decode still holds KV blocks after prefill's engine died"
