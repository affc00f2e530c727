"""Tensor parallelism on real CPU clusters: kvpush with prefill TP 2 /
decode TP 1 and prefill TP 1 / decode TP 2 (the tiny model's 2 KV heads
split one per rank on the TP 2 side) must give a colocated TP 1
instance's greedy text and logprobs (within 1e-4), for every API shape,
with a partial prefix hit on decode, 32 at once, either leg first; no
blocks are held afterwards. The mapping itself is property-tested in
``tests/unit/test_transfer_heads.py``; what the CPU backend runs here is in
``docs/tensor-parallel-cpu.md``."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvpush import client
from tests.fakes.fake_nixl import wait_for
from tests.integration import faults, workload
from tests.integration.conftest import Cluster
from tests.integration.test_pd_matches_colocated import PDChecks

pytestmark = pytest.mark.integration

DEADLINE_S = 60.0


class TestKvPushPrefillTp2DecodeTp1(PDChecks):
    """Both prefill ranks write their head of the same decode blocks;
    decode waits for both Dones."""

    mode = "kvpush"
    cluster_options: ClassVar[dict[str, Any]] = {
        "max_num_batched_tokens": 256,
        "prefill_tp": 2,
        "decode_tp": 1,
        "verify_kv": "all",
    }


class TestKvPushPrefillTp1DecodeTp2(PDChecks):
    """Prefill's one rank writes each decode rank its head."""

    mode = "kvpush"
    cluster_options: ClassVar[dict[str, Any]] = {
        "max_num_batched_tokens": 256,
        "prefill_tp": 1,
        "decode_tp": 2,
        "verify_kv": "all",
    }


@pytest.mark.long
class TestKvPushPrefillTp2DecodeTp2(PDChecks):
    """Homogeneous TP: prefill rank i writes decode rank i (4 ranks on the
    2 cores: each instance's two ranks share its core, see
    docs/tensor-parallel-cpu.md). Long (not CI): each rank's slice is the
    plainest case of the two mixed pairs above, which CI runs."""

    mode = "kvpush"
    cluster_options: ClassVar[dict[str, Any]] = {
        "max_num_batched_tokens": 256,
        "prefill_tp": 2,
        "decode_tp": 2,
        "verify_kv": "all",
    }


# -- kill -9 of one prefill rank's worker -------------------------------------------


@pytest.fixture(scope="module")
def tp_fault_cluster(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    run_dir = tmp_path_factory.mktemp("tp-faults")
    with faults.fault_cluster(model_dir, run_dir, prefill_tp=2, decode_tp=1) as c:
        yield c


def test_kill_one_prefill_rank_during_its_transfer(tp_fault_cluster, reference):
    """Prefill TP 2 / decode TP 1: both ranks have the request's KV and hold
    their WRITEs (fault file); kill -9 rank 1's worker. Decode must not wait
    for the dead rank's Done: it fails the receive and answers by local
    recompute (or the router answers a clear error and decode's receive ends
    aborted), within the deadline, and holds no blocks afterwards. vLLM
    then takes the whole prefill engine down; a restarted prefill pushes
    again."""
    cluster = tp_fault_cluster
    name = "concurrent-26"
    path, body = workload.CONCURRENT[name]
    before = faults.counters(cluster)
    faults.set_faults(cluster, delay_post_s=30.0)
    client_id = f"kill-rank-{uuid.uuid4().hex[:6]}"
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            client.request, cluster.url, path, body, DEADLINE_S,
            {"X-Request-Id": client_id},
        )  # fmt: skip
        tid = faults.wait_transfer_phase(cluster, client_id, "kv_ready")
        os.kill(faults.rank_worker_pid(cluster, "prefill0", 1), signal.SIGKILL)
        reply = pending.result()
    assert "write_posted" not in faults.phases(cluster, tid)

    assert reply.total_s < 20.0, f"took {reply.total_s:.1f} s"
    if reply.status == 200:
        problem = workload.mismatch(reference[name], reply)
        assert problem is None, f"{name}: {problem}"
    else:
        faults.assert_clear_error(reply)

    def receive_ended() -> bool:
        """A 200 was recomputed by decode: its receive failed. An error ended
        the attempt and aborted decode's leg first (vLLM answered the prefill
        leg 500 as its engine died, rather than dropping the connection): the
        receive then ends aborted, once both ranks are proven gone, unless
        decode failed it before the abort."""
        now, then = faults.counters(cluster)["decode0"], before["decode0"]
        grown = {k: v - then[k] for k, v in now.items() if v > then[k]}
        failed = any(k.startswith("receive_failed.") for k in grown)
        if failed or (reply.status != 200 and "aborted.released" in grown):
            return True
        # counts reach /metrics with decode's next step; after an abort
        # decode is idle, so make it step
        faults.nudge(cluster, "decode0")
        return False

    assert wait_for(receive_ended, 10.0, step_s=0.5), "decode never ended the receive"
    decode_url = cluster.instance_url("decode0")
    held = wait_for(lambda: not workload.kv_cache_usage(decode_url), 30.0, step_s=0.5)
    assert held, "decode still holds KV blocks after the rank died"

    faults.set_faults(cluster)
    if not faults.wait_instance_gone(cluster, "prefill0", 30.0):
        faults.kill_instance(cluster, "prefill0")  # vLLM left part of it up
    cluster.restart("prefill0")
    faults.wait_router_routes(cluster)
    # As after any start (start_cluster): a fresh TP engine's first request
    # takes 10-20 s here (docs/tensor-parallel-cpu.md), past this suite's
    # 8 s registration deadline, so it may fall back; the next must push.
    workload.warm_up(cluster.url)
    faults.assert_pushed_named(cluster, reference, "concurrent-27", DEADLINE_S)
    faults.assert_no_blocks_held(cluster)
