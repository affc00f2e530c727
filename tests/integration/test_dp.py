"""Data parallelism on a real CPU cluster: one prefill and one decode that
runs two engines behind its one HTTP port (``--decode-dp 2``: vLLM's
``--data-parallel-size 2`` and its internal load balancer). Each engine is
an endpoint of its own (engine id ``decode0_dp<rank>``, its own
side-channel ports); kvpush's router picks one per request and pins the
decode leg to it (``X-data-parallel-rank``). Every check of
:class:`PDChecks` against colocated, and both engines received pushes."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from tests.integration import faults
from tests.integration.conftest import Cluster
from tests.integration.test_pd_matches_colocated import PDChecks

pytestmark = pytest.mark.integration


class TestKvPushDecodeDp2(PDChecks):
    mode = "kvpush"
    cluster_options: ClassVar[dict[str, Any]] = {
        "max_num_batched_tokens": 256,
        "decode_dp": 2,
        "verify_kv": "all",
    }

    def test_both_decode_engines_received_pushes(self, pd_cluster: Cluster) -> None:
        def handovers(engine: int) -> float:
            return faults.instance_metric(
                pd_cluster,
                "decode0",
                "vllm:kvpush_phase_seconds_count",
                phase="handover",
                engine=str(engine),
            )

        arrived = [handovers(engine) for engine in (0, 1)]
        assert all(n >= 1 for n in arrived), f"pushes per decode engine: {arrived}"

    # Declared again so that it runs after the check above.
    def test_down_stops_every_process(self, pd_cluster: Cluster) -> None:
        super().test_down_stops_every_process(pd_cluster)
