"""Through vLLM's pull and push connectors and kvpush's own connector
(behind kvpush's router), greedy outputs equal a colocated instance's, for
every API shape, streamed or not, one at a time and 32 at once, and
requests sharing a prefix sent together and again; ``down``
leaves no process behind. kvpush runs at each push granularity: the default
(auto), whole request, per chunk and per chunk and layer."""

from __future__ import annotations

import time
from typing import Any, ClassVar

import pytest

from kvpush.router.first_token import Outcome
from tests.integration import faults, workload
from tests.integration.conftest import Cluster
from tests.integration.test_vllm_protocol import KvBothChecks, VllmProtocolChecks

pytestmark = pytest.mark.integration


class PDChecks:
    """Checks every P/D mode must pass; subclasses name the mode."""

    mode = ""
    cluster_options: ClassVar[dict[str, Any]] = {}
    arrival_orders: tuple[str, ...] = ("prefill", "decode")  # first leg to arrive

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

    def test_thirty_two_concurrent_mixed_lengths(
        self, pd_cluster: Cluster, reference: workload.Outputs
    ) -> None:
        replies = workload.run_concurrent(pd_cluster.url)
        problems = {n: workload.mismatch(reference[n], r) for n, r in replies.items()}
        assert {n: p for n, p in problems.items() if p} == {}

    def test_concurrent_requests_sharing_a_prefix(
        self, pd_cluster: Cluster, reference: workload.Outputs
    ) -> None:
        # Round 1 arrives together: prefill admits some in the step that
        # fills the prefix's blocks for another. Round 2 repeats it: decode's
        # prefix cache, filled by round 1's pushes, must hold correct KV.
        for round_ in (1, 2):
            replies = workload.run_concurrent(pd_cluster.url, workload.SHARED_PREFIX)
            problems = {
                n: workload.mismatch(reference[n], r) for n, r in replies.items()
            }
            assert {n: p for n, p in problems.items() if p} == {}, f"round {round_}"

    def test_either_arrival_order(
        self, pd_cluster: Cluster, reference: workload.Outputs, first_leg: str
    ) -> None:
        # Legs sent straight to the instances, one clearly before the other.
        name = "completion-long"
        path, body = workload.SHAPES[name]
        reply = workload.send_legs_in_order(
            pd_cluster, self.mode, path, body, first_leg
        )
        assert workload.mismatch(reference[name], reply) is None, workload.mismatch(
            reference[name], reply
        )

    def test_no_blocks_held_after_the_run(self, pd_cluster: Cluster) -> None:
        # Runs after every request of the class has finished.
        for name in ("prefill0", "decode0"):
            usage = workload.kv_cache_usage(pd_cluster.instance_url(name))
            assert usage == 0.0, f"{name} still holds KV blocks ({usage:.2%})"
        if self.mode == "kvpush":
            self._every_receive_was_pushed(pd_cluster)

    @staticmethod
    def _every_receive_was_pushed(cluster: Cluster) -> None:
        """A receive that failed falls back to decode's own prefill, which
        gives the same text: only the connector's counters tell P/D from
        colocated. None may have failed, and some must have arrived. The
        kvpush classes run with ``verify_kv: all``: no KV digest may have
        mismatched (no false positive under load, at every granularity and
        TP), and every receive's was checked."""
        faults.nudge(cluster, "decode0")  # counts reach /metrics with a step
        events = faults.counters(cluster)["decode0"]
        failed = {
            k: v
            for k, v in events.items()
            if v and (k == "fallback" or k.startswith(("receive_failed.", "rejected.")))
        }
        assert failed == {}, f"decode computed prompts itself: {failed}"
        arrived = faults.instance_metric(
            cluster, "decode0", "vllm:kvpush_phase_seconds_count", phase="handover"
        )
        assert arrived >= len(workload.SHAPES), f"only {arrived:g} receives arrived"
        assert events["digest_mismatch"] == 0, events
        assert events["digest_missing"] == 0, events
        assert events["digest_verified"] >= arrived, events

    def test_down_stops_every_process(self, pd_cluster: Cluster) -> None:
        # Runs last in the class (pytest keeps definition order).
        pd_cluster.stop()


class FirstTokenChecks:
    """kvpush's router: the first token from prefill (its default). A base
    after :class:`PDChecks`, so that its test runs before the nothing-held
    and ``down`` checks."""

    def test_decode_continues_from_prefills_first_token(
        self, pd_cluster: Cluster, reference: workload.Outputs
    ) -> None:
        # Bound early, prefill tells decode the token it sampled (and its
        # logprobs, where asked); with the WRITE held back it is there before
        # the KV lands, so decode makes it the prompt's last token (kvpush's
        # scheduler class) rather than computing it again: colocated's output
        # all the same, streamed and not (the router relays decode's whole
        # answer when not streamed), its logprobs included.
        names = ("completion-stream-plain", "chat-plain", "completion-stream", "chat")
        continued = _continued(pd_cluster)
        with faults.writes_held(pd_cluster):
            replies = {
                n: workload.send(pd_cluster.url, *workload.SHAPES[n]) for n in names
            }
        problems = {n: workload.mismatch(reference[n], r) for n, r in replies.items()}
        assert {n: p for n, p in problems.items() if p} == {}
        assert _continued(pd_cluster) - continued == len(names)

    def test_a_first_token_from_prefill_joins_decodes_stream(
        self, pd_cluster: Cluster
    ) -> None:
        # The router's default: a streamed request's first token is prefill's,
        # the rest decode's (without its copy of that token). Each prompt is
        # new to the cluster and prefill's WRITEs are held back, so decode
        # cannot have its first token before prefill answered: every request
        # must be joined. Sent again (nothing held), decode holds the prompt
        # and answers alone: both replies must be the same greedy output.
        before, seed = faults.first_token_outcomes(pd_cluster.url), int(time.time())
        requests = [
            shape(workload.text_of(300, seed=seed + i), stream=True)
            for i, shape in enumerate((workload.completion, workload.chat) * 2)
        ]
        with faults.writes_held(pd_cluster):
            joined = [workload.send(pd_cluster.url, *r) for r in requests]
        served = faults.first_tokens_since(pd_cluster.url, before, len(requests))
        assert served == {Outcome.PREFILL.value: len(requests)}, served
        for request, first in zip(requests, joined, strict=True):
            again = workload.send(pd_cluster.url, *request)
            assert workload.mismatch(again, first) is None, workload.mismatch(
                again, first
            )


def _continued(cluster: Cluster) -> int:
    """How many requests decode0 continued from prefill's first token."""
    faults.nudge(cluster, "decode0")  # counts reach /metrics with a step
    return faults.counters(cluster)["decode0"].get("first_token.continued", 0)


class TestVllmPull(PDChecks):
    mode = "vllm-pull"
    arrival_orders = ("prefill",)  # decode needs prefill's answer to start


@pytest.mark.long
class TestVllmPush(PDChecks):
    """Long (not CI): vLLM's own push behind kvpush's router; CI checks it
    on the rehearsal hosts (``test_netns.py``) and measures it in the bench."""

    mode = "vllm-push"


class TestKvPush(PDChecks, FirstTokenChecks, VllmProtocolChecks):
    """kvpush's connector as users get it, with chunked prefill (256-token
    chunks, so the long prompts take several): the default granularity,
    ``auto``, which on the tiny model pushes per chunk (a chunk's KV per layer,
    256 KiB, is below ``layer_push_min_bytes``) with the per-layer hooks on.
    Also behind a router speaking vLLM's own P/D protocol (its checks run
    first: a later base's tests come before an earlier one's)."""

    mode = "kvpush"
    cluster_options: ClassVar[dict[str, Any]] = {
        "max_num_batched_tokens": 256,
        "verify_kv": "all",
        "fault_injection": True,  # FirstTokenChecks holds WRITEs back
    }


class TestKvPushWholeRequest(TestKvPush, KvBothChecks):
    """kvpush's connector pushing each prompt whole
    (``--push-granularity request``), once its last chunk is computed, on
    instances that run ``--kv-both`` (vLLM's ``kv_role: kv_both``, as its
    NIXL deployments configure every instance): every check of
    :class:`TestKvPush` with the roles kvpush's router gives them, then
    each instance serving both legs at once."""

    cluster_options: ClassVar[dict[str, Any]] = {
        "max_num_batched_tokens": 256,
        "push_granularity": "request",
        "verify_kv": "all",
        "kv_both": True,
        "fault_injection": True,
    }


@pytest.mark.long
class TestKvPushStreamed(TestKvPush):
    """kvpush's connector streaming per prefill chunk
    (``--push-granularity chunk``): each 256-token chunk's two 128-token
    blocks are pushed as that chunk's forward ends. Long (not CI): on the
    tiny model :class:`TestKvPush`'s ``auto`` takes this same path for every
    chunk, with the per-layer hooks on besides."""

    cluster_options: ClassVar[dict[str, Any]] = {
        "max_num_batched_tokens": 256,
        "push_granularity": "chunk",
        "verify_kv": "all",
        "fault_injection": True,  # FirstTokenChecks holds WRITEs back
    }


class TestKvPushPerLayer(TestKvPush):
    """kvpush's connector streaming per prefill chunk and layer
    (``--push-granularity layer``): each layer of each 256-token chunk is
    pushed from ``save_kv_layer``, right after that layer's attention."""

    cluster_options: ClassVar[dict[str, Any]] = {
        "max_num_batched_tokens": 256,
        "push_granularity": "layer",
        "verify_kv": "all",
        "fault_injection": True,  # FirstTokenChecks holds WRITEs back
    }
