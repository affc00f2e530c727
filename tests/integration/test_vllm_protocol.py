"""kvpush's instances behind a router that speaks only vLLM's P/D protocol
(:mod:`tests.integration.vllm_proxy`: vLLM's pull proxy, its push proxy,
and concurrent legs paired by a router-set ``transfer_id``) answer exactly
like a colocated instance, one request at a time and several at once, and
every prompt's KV is pushed: decode counts a handover per request and
computes no prompt itself.

The checks run on the cluster of an existing kvpush class
(:class:`~tests.integration.test_pd_matches_colocated.TestKvPush` mixes
them in), not on a cluster of their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest

from kvpush.launcher.state import TOPOLOGY_FILE
from kvpush.topology import load_topology
from tests.integration import faults, workload
from tests.integration.conftest import Cluster
from tests.integration.vllm_proxy import STYLES, BackgroundProxy, ProxyConfig

pytestmark = pytest.mark.integration

# One at a time: every API shape, streamed or not, short and multi-block
# prompts; then eight mixed lengths at once.
ONE_BY_ONE = tuple(sorted(workload.SHAPES))
AT_ONCE = {f"concurrent-{i}": workload.CONCURRENT[f"concurrent-{i}"] for i in range(8)}
# Decode events that mean a prompt was not pushed (computed on decode).
NOT_PUSHED = ("fallback", "receive_failed.", "rejected.", "skipped.")


@contextmanager
def proxy_for(
    cluster: Cluster, style: str, prefill: str = "prefill0", decode: str = "decode0"
) -> Iterator[str]:
    """A vLLM-protocol router of ``style`` in front of the cluster's
    instances ``prefill`` and ``decode`` (the prefill's address from the
    topology, as a router's configuration would have it); yields its URL."""
    backends = load_topology(cluster.run_dir / TOPOLOGY_FILE).backends
    (prefill_backend,) = (b for b in backends if b.engine_id == prefill)
    proxy = BackgroundProxy(
        ProxyConfig(
            style=style,
            prefill_url=cluster.instance_url(prefill),
            decode_url=cluster.instance_url(decode),
            prefill_engine_id=prefill_backend.engine_id,
            prefill_host=prefill_backend.side_channel_host,
            prefill_port=prefill_backend.side_channel_port,
            prefill_tp=prefill_backend.tp_size,
        )
    )
    try:
        yield proxy.url
    finally:
        proxy.close()


def pushes(cluster: Cluster, receiver: str = "decode0") -> tuple[float, dict[str, Any]]:
    """``receiver``'s handovers so far, and every instance's connector events."""
    faults.nudge(cluster, receiver)  # counts reach /metrics with a step
    handovers = faults.instance_metric(
        cluster, receiver, "vllm:kvpush_phase_seconds_count", phase="handover"
    )
    return handovers, faults.counters(cluster)


def new_events(before: dict[str, Any], after: dict[str, Any]) -> dict[Any, int]:
    """The connector events counted between two :func:`pushes`."""
    return {
        (name, event): n - before[name][event]
        for name, counts in after.items()
        for event, n in counts.items()
        if n > before[name][event]
    }


class VllmProtocolChecks:
    """Mixed into a kvpush P/D class (ahead of its last checks: pytest runs
    a base class's tests before the subclass's own and its other bases')."""

    @pytest.mark.parametrize("style", STYLES)
    def test_vllm_protocol_router_matches_colocated(
        self, pd_cluster: Cluster, reference: workload.Outputs, style: str
    ) -> None:
        handovers, events = pushes(pd_cluster)
        with proxy_for(pd_cluster, style) as url:
            replies = {n: workload.send(url, *workload.SHAPES[n]) for n in ONE_BY_ONE}
            replies.update(workload.run_concurrent(url, AT_ONCE))
        problems = {n: workload.mismatch(reference[n], r) for n, r in replies.items()}
        assert {n: p for n, p in problems.items() if p} == {}

        handovers_after, events_after = pushes(pd_cluster)
        assert handovers_after - handovers == len(replies), "one push per request"
        new = new_events(events, events_after)
        not_pushed = {k: n for k, n in new.items() if k[1].startswith(NOT_PUSHED)}
        assert not_pushed == {}, f"not every prompt was pushed: {new}"


class KvBothChecks:
    """Mixed into a kvpush class whose cluster runs ``--kv-both`` (vLLM's
    ``kv_role: kv_both`` on every instance): either instance serves either
    leg, both at the same time."""

    def test_each_instance_is_prefill_and_decode_at_once(
        self, pd_cluster: Cluster, reference: workload.Outputs
    ) -> None:
        # Eight requests prefilled on prefill0 and decoded on decode0 (a
        # concurrent router), eight the other way round (a pull router),
        # all sixteen in flight together.
        before = {n: pushes(pd_cluster, n)[0] for n in ("prefill0", "decode0")}
        _, events = pushes(pd_cluster)
        with (
            proxy_for(pd_cluster, "concurrent") as forward,
            proxy_for(pd_cluster, "pull", "decode0", "prefill0") as backward,
            ThreadPoolExecutor(max_workers=2) as pool,
        ):
            ways = {
                url: pool.submit(workload.run_concurrent, url, AT_ONCE)
                for url in (forward, backward)
            }
            replies = {
                (u, n): r for u, f in ways.items() for n, r in f.result().items()
            }
        problems = {
            k: workload.mismatch(reference[k[1]], r) for k, r in replies.items()
        }
        assert {k: p for k, p in problems.items() if p} == {}

        after = {n: pushes(pd_cluster, n)[0] for n in ("prefill0", "decode0")}
        received = {n: after[n] - before[n] for n in after}
        assert received == {"prefill0": len(AT_ONCE), "decode0": len(AT_ONCE)}
        new = new_events(events, pushes(pd_cluster)[1])
        not_pushed = {k: n for k, n in new.items() if k[1].startswith(NOT_PUSHED)}
        assert not_pushed == {}, f"not every prompt was pushed: {new}"
