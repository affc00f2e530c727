"""Model families other than dense GQA on real CPU clusters, one cluster per
preset with every check on it. What each family is on vLLM's CPU build,
and why the references below are what they are, is in
``docs/model-families.md``.

MLA (the ``mla`` preset, DeepSeek-V2-style): vLLM's CPU MLA gives a
different greedy token from its prefill path than from its decode path for
the same prefix, and its batched decode differs from one request alone, so
no P/D connector can equal a colocated instance, and concurrent requests
cannot be compared by text. The reference is therefore vLLM's own NIXL
connector (vllm-pull) on the same TP layout, one request at a time: kvpush
must give exactly its text and logprobs (within 1e-4), for every API shape
and either leg first; under concurrency every receive must arrive whole and
pass its KV digest.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvpush import env
from kvpush.model.presets import ensure_preset
from tests.integration import workload
from tests.integration.conftest import Cluster, start_cluster
from tests.integration.test_pd_matches_colocated import PDChecks

pytestmark = pytest.mark.integration

MLA_TP: dict[str, Any] = {"prefill_tp": 1, "decode_tp": 2}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_preset(env.kvpush_home(), "mla")


@pytest.fixture(scope="module")
def reference(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[workload.Outputs]:
    """vllm-pull's replies to every API shape, one at a time (the anchor:
    see the module docstring)."""
    run_dir = tmp_path_factory.mktemp("vllm-pull-mla")
    cluster = start_cluster("vllm-pull", model_dir, run_dir, **MLA_TP)
    try:
        yield {n: workload.send(cluster.url, *r) for n, r in workload.SHAPES.items()}
    finally:
        cluster.stop()


class TestKvPushMla(PDChecks):
    """One 576-value latent per token and layer, which every TP rank holds
    whole: decode runs TP 2, so prefill's one rank writes each decode rank
    its own copy of every block. vLLM's CPU build turns prefix caching and
    chunked prefill off for MLA and uses 16-token blocks, so each push is a
    whole prompt (per layer under ``auto``)."""

    mode = "kvpush"
    cluster_options: ClassVar[dict[str, Any]] = {**MLA_TP, "verify_kv": "all"}

    def test_thirty_two_concurrent_mixed_lengths(self, pd_cluster: Cluster) -> None:
        self._all_served(pd_cluster, workload.CONCURRENT)

    def test_concurrent_requests_sharing_a_prefix(self, pd_cluster: Cluster) -> None:
        for _ in (1, 2):
            self._all_served(pd_cluster, workload.SHARED_PREFIX)

    def test_no_blocks_held_after_the_run(self, pd_cluster: Cluster) -> None:
        super().test_no_blocks_held_after_the_run(pd_cluster)  # after the above

    def test_down_stops_every_process(self, pd_cluster: Cluster) -> None:
        super().test_down_stops_every_process(pd_cluster)  # last

    @staticmethod
    def _all_served(
        cluster: Cluster, requests: dict[str, tuple[str, dict[str, Any]]]
    ) -> None:
        """Every request answered; that its KV arrived whole, pushed and
        digest-verified, is checked after them
        (``test_no_blocks_held_after_the_run``)."""
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            replies = dict(
                zip(requests, pool.map(lambda r: workload.send(cluster.url, *r),
                                       requests.values()), strict=True)
            )  # fmt: skip
        bad = {n: r.status for n, r in replies.items() if r.status != 200 or not r.text}
        assert bad == {}
