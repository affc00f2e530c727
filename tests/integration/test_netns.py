"""The multi-host rehearsal (``kvpush up --hosts netns``): every mode, each
instance on its own namespace "host" behind a shaped link, answers exactly
like a colocated instance; the KV really crosses the links; ``down`` (and
the next ``up`` after a crash) leaves no namespace, link or qdisc behind.

Skipped, with the reason, only where this machine cannot make network
namespaces (not root, no ``ip``/``tc``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvpush.launcher import netns
from kvpush.launcher import process as proc
from kvpush.launcher.cluster import check_run_dir_free, status
from kvpush.launcher.state import ProcessRecord, RunState, load_state, save_state
from kvpush.model.kv_size import kv_bytes_per_token
from tests.integration import workload
from tests.integration.conftest import Cluster, start_cluster

pytestmark = pytest.mark.integration

LINK_GBIT = 4.0
BLOCK_TOKENS = 128  # the CPU backend's default block size, which the launcher keeps


@pytest.fixture(scope="module", autouse=True)
def _needs_namespaces() -> None:
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def leftovers(tag: str) -> list[str]:
    """Namespaces and links named for run-directory ``tag`` that exist."""
    links = subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True, check=True
    ).stdout
    spaces = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=True
    ).stdout
    return sorted(
        {
            word.split("@")[0].rstrip(":")
            for word in (links + spaces).split()
            if word.startswith((f"kvp{tag}", f"kvpush-{tag}-"))
        }
    )


def _qdisc(host: netns.HostNet) -> str:
    return subprocess.run(
        ["tc", "-n", host.namespace, "qdisc", "show", "dev", netns.HOST_DEVICE],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def _check_hosts(cluster: Cluster) -> netns.NetPlan:
    """Each instance on its own host at its own address; links shaped."""
    network = cluster.state.network
    assert network is not None
    info: Any = status(cluster.run_dir)
    instances = [p for p in info["processes"] if p["role"] != "router"]
    assert len({p["host"] for p in instances}) == len(instances), instances
    for p in instances:
        host = network.host(p["name"])
        assert p["host"] == host.namespace
        assert p["url"].startswith(f"http://{host.address}:"), p
        assert f"rate {LINK_GBIT:g}Gbit" in _qdisc(host)
    router = next(p for p in info["processes"] if p["role"] == "router")
    assert router["host"] == "local" and "127.0.0.1" in router["url"]
    return network


def _kv_crossed_the_link(cluster: Cluster, model_dir: Path) -> None:
    """A fresh prompt's KV left prefill's host over its link: at least its
    full blocks' bytes, and decode received them."""
    assert cluster.state.network is not None
    prefill = cluster.state.network.host("prefill0")
    decode = cluster.state.network.host("decode0")
    before = netns.link_bytes(prefill), netns.link_bytes(decode)
    path, body = workload.SHAPES["completion-long"]
    fresh = dict(body, prompt="netns " + workload.text_of(900, seed=77))
    reply = workload.send(cluster.url, path, fresh)
    assert reply.status == 200, reply.body
    after = netns.link_bytes(prefill), netns.link_bytes(decode)
    assert reply.usage is not None
    tokens = reply.usage["prompt_tokens"] // BLOCK_TOKENS * BLOCK_TOKENS
    needed = tokens * kv_bytes_per_token(model_dir, "float32")
    sent = after[0].sent - before[0].sent
    received = after[1].received - before[1].received
    assert sent >= needed, f"prefill sent {sent} B for {needed} B of KV"
    assert received >= needed, f"decode received {received} B for {needed} B of KV"


# colocated and vllm-pull on rehearsal hosts: make long (CI's budget; the
# other P/D modes there carry the same host and link set-up, the bench test
# runs kvpush on one, and CI runs vllm-pull on one host)
@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("colocated", marks=pytest.mark.long),
        pytest.param("vllm-pull", marks=pytest.mark.long),
        "vllm-push",
        "kvpush",
    ],
)
def test_rehearsal_matches_colocated(
    mode: str, model_dir: Path, reference: workload.Outputs, tmp_path: Path
) -> None:
    options: dict[str, Any] = {"hosts": "netns", "link_gbit": LINK_GBIT}
    if mode == "kvpush":
        options["max_num_batched_tokens"] = 256
    cluster = start_cluster(mode, model_dir, tmp_path, **options)
    try:
        network = _check_hosts(cluster)
        for name, req in workload.SHAPES.items():
            reply = workload.send(cluster.url, *req)
            assert workload.mismatch(reference[name], reply) is None, (
                name,
                workload.mismatch(reference[name], reply),
            )
        replies = workload.run_concurrent(cluster.url)
        problems = {n: workload.mismatch(reference[n], r) for n, r in replies.items()}
        assert {n: p for n, p in problems.items() if p} == {}
        if mode != "colocated":
            _kv_crossed_the_link(cluster, model_dir)
        for p in cluster.state.processes:
            if p.role != "router":
                usage = workload.kv_cache_usage(p.url)
                assert usage == 0.0, f"{p.name} still holds KV blocks ({usage:.2%})"
    finally:
        cluster.stop()
    assert leftovers(network.tag) == []


def test_up_after_a_crash_removes_what_it_left(tmp_path: Path) -> None:
    # A "crashed" rehearsal: its hosts exist, its state names a dead process.
    network = netns.plan_network(
        tmp_path, ["prefill0", "decode0"], netns.free_subnet_index(), 1.0
    )
    netns.create(network)
    try:
        assert len(leftovers(network.tag)) == 2 * 2 + 1  # 2 ns, 2 links, bridge
        dead = subprocess.Popen(["true"])
        dead.wait()
        record = ProcessRecord(
            name="prefill0", role="prefill", pid=dead.pid, url="-", log_path="-"
        )
        save_state(
            RunState(
                mode="kvpush",
                model="-",
                router_url="-",
                processes=(record,),
                network=network,
            ),
            tmp_path,
        )
        assert not proc.is_alive(dead.pid)
        check_run_dir_free(tmp_path)  # what the next `up` does first
        assert leftovers(network.tag) == []
        assert load_state(tmp_path) is None
    finally:
        netns.destroy(network)
