"""Through vLLM's pull and push connectors (behind kvpush's router), greedy
outputs equal a colocated instance's, for every API shape, streamed or not,
one at a time and sixteen at once; ``down`` leaves no process behind."""

from __future__ import annotations

import pytest

from tests.integration import workload
from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration


class PDChecks:
    """Checks every P/D mode must pass; subclasses name the mode."""

    mode = ""

    @pytest.mark.parametrize("name", sorted(workload.SHAPES))
    def test_matches_colocated(
        self, pd_cluster: Cluster, reference: workload.Outputs, name: str
    ) -> None:
        reply = workload.send(pd_cluster.url, *workload.SHAPES[name])
        assert workload.mismatch(reference[name], reply) is None, workload.mismatch(
            reference[name], reply
        )

    def test_usage_reported(
        self, pd_cluster: Cluster, reference: workload.Outputs
    ) -> None:
        for name in ("completion-long", "chat-stream"):
            reply = workload.send(pd_cluster.url, *workload.SHAPES[name])
            assert reply.usage is not None, name
            assert reply.usage == reference[name].usage, name

    def test_sixteen_concurrent_mixed_lengths(
        self, pd_cluster: Cluster, reference: workload.Outputs
    ) -> None:
        replies = workload.run_concurrent(pd_cluster.url)
        problems = {n: workload.mismatch(reference[n], r) for n, r in replies.items()}
        assert {n: p for n, p in problems.items() if p} == {}

    def test_down_stops_every_process(self, pd_cluster: Cluster) -> None:
        # Runs last in the class (pytest keeps definition order).
        pd_cluster.stop()


class TestVllmPull(PDChecks):
    mode = "vllm-pull"


class TestVllmPush(PDChecks):
    mode = "vllm-push"
