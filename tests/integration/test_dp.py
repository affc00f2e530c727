"""Data parallelism on a real CPU cluster: a prefill and a decode that each
run two engines behind their one HTTP port (``--prefill-dp 2 --decode-dp
2``: vLLM's ``--data-parallel-size 2`` and its internal load balancer).
Each engine is an endpoint of its own (engine id ``<name>_dp<rank>``; a
prefill engine listens on side-channel ports of its own); kvpush's router
picks one of each per request and pins each leg to it
(``X-data-parallel-rank``). Every check of :class:`PDChecks` against
colocated, and every engine pushed or received."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from tests.integration import faults
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
