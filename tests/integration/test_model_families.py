"""Model families other than dense GQA on real CPU clusters, one cluster per
preset with every check of :class:`PDChecks` on it (every API shape, 32 at
once, shared prefixes, either leg first, every receive pushed and its KV
digest verified, nothing held). What each family is on vLLM's CPU build is
in ``docs/model-families.md``.

The reference is colocated greedy output, computed where it costs no
cluster of its own: the P/D cluster's prefill instance answering each
request alone (no transfer), before any P/D request reaches it. That is a
colocated instance: same model, settings and vLLM. MLA is the exception:
vLLM's CPU MLA gives a different greedy token from its prefill path than
from its decode path for the same prefix, and its batched decode differs
from one request alone, so no P/D connector can equal colocated and
concurrent replies cannot be compared by text. Its reference is vLLM's own
NIXL connector (vllm-pull) on the same TP layout, one request at a time;
under concurrency every receive must arrive whole and pass its digest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvpush import env
from kvpush.model import kv_size
from kvpush.model.presets import ensure_preset
from kvpush.router.config import FirstTokenFrom
from kvpush.router.first_token import Outcome
from kvpush.telemetry import names
from tests.integration import faults, workload
from tests.integration.conftest import Cluster, start_cluster
from tests.integration.test_pd_matches_colocated import PDChecks

pytestmark = pytest.mark.integration
CPU_BLOCK = 128  # vLLM's CPU attention block (docs/model-families.md)


@pytest.fixture(scope="class")
def model_dir(request: pytest.FixtureRequest) -> Path:
    return ensure_preset(env.kvpush_home(), request.cls.preset)


@pytest.fixture(scope="class")
def reference(request: pytest.FixtureRequest, model_dir: Path) -> workload.Outputs:
    return request.cls.reference_outputs(request, model_dir)


class FamilyChecks(PDChecks):
    """:class:`PDChecks` on the model preset ``preset``."""

    mode = "kvpush"
    preset = ""

    @classmethod
    def reference_outputs(
        cls, request: pytest.FixtureRequest, model_dir: Path
    ) -> workload.Outputs:
        """The whole workload, answered by prefill0 alone, one at a time."""
        cluster: Cluster = request.getfixturevalue("pd_cluster")
        return workload.run_all(cluster.instance_url("prefill0"))


# In CI: one cluster per preset (about 75 s each here, fp8 40 s).
class TestKvPushMoe(FamilyChecks):
    """Qwen3-MoE-style experts: one full-attention group, as dense."""

    preset = "moe"
    cluster_options: ClassVar[dict[str, Any]] = {
        "max_num_batched_tokens": 256,
        "verify_kv": "all",
    }


class TestKvPushSlidingWindow(FamilyChecks):
    """Gemma-3-style sliding-window layers (window 128) between full ones,
    with vLLM's hybrid KV-cache manager on (its default with kvpush): three
    KV-cache groups, the windowed ones keeping only their window's blocks
    on both sides; pushed per chunk (``auto``, chunked prefill on)."""

    preset = "swa"
    cluster_options: ClassVar[dict[str, Any]] = {
        "max_num_batched_tokens": 256,
        "verify_kv": "all",
    }

    @pytest.mark.parametrize("seed", [2501, 2503])  # 1023 (an edge) and 1028 tokens
    def test_pushes_only_the_blocks_decode_keeps(
        self, pd_cluster: Cluster, model_dir: Path, seed: int
    ) -> None:
        """A prompt decode holds none of: the WRITEs carry every block of the
        full layers and only the window's blocks of the windowed ones."""
        name = names.KVPUSH_WRITE_BYTES.sum
        before = faults.instance_metric(pd_cluster, "prefill0", name)
        prompt = workload.text_of(700, seed=seed)  # in no earlier request
        reply = workload.send(pd_cluster.url, *workload.completion(prompt, False, 2))
        assert reply.status == 200, reply.body
        num_tokens = int(reply.body["usage"]["prompt_tokens"])
        want = kv_size.pushed_bytes(model_dir, "float32", num_tokens, CPU_BLOCK)
        all_blocks = (
            -(-num_tokens // CPU_BLOCK)
            * CPU_BLOCK
            * kv_size.kv_bytes_per_token(model_dir, "float32")
        )
        assert want < all_blocks, "the prompt must be longer than the window"
        written = _written_since(pd_cluster, before, want)
        assert written == want, f"wrote {written} bytes, decode keeps {want}"

    @pytest.mark.parametrize("num_tokens", [255, 383])
    def test_a_window_starting_on_a_block_edge_equals_colocated(
        self, pd_cluster: Cluster, num_tokens: int
    ) -> None:
        """``N - w + 1`` a multiple of the block: decode computes the last
        prompt token (logprobs requests do) with the window vLLM's rewind
        would have cut a block short (logprobs off by 0.13 before)."""
        ids = [(i * 37 + num_tokens) % 3000 + 10 for i in range(num_tokens)]
        path, body = workload.completion("", False, 8)
        body["prompt"] = ids
        want = workload.send(pd_cluster.instance_url("prefill0"), path, body)
        got = workload.send(pd_cluster.url, path, body)
        assert workload.mismatch(want, got) is None, workload.mismatch(want, got)

    # Declared again so that it runs after the check above.
    def test_down_stops_every_process(self, pd_cluster: Cluster) -> None:
        super().test_down_stops_every_process(pd_cluster)


# Long (not CI, for time): the same families with decode at TP 2, so that
# prefill's one rank writes each decode rank its own head of every layer
# (2 KV heads; the mapping CI runs with the dense model in test_tp.py).
@pytest.mark.long
class TestKvPushMoeDecodeTp2(TestKvPushMoe):
    """MoE with decode at TP 2 (experts split by TP on decode)."""

    cluster_options: ClassVar[dict[str, Any]] = {
        **TestKvPushMoe.cluster_options,
        "decode_tp": 2,
    }


@pytest.mark.long
class TestKvPushSlidingWindowDecodeTp2(TestKvPushSlidingWindow):
    """Sliding window + full layers with decode at TP 2."""

    cluster_options: ClassVar[dict[str, Any]] = {
        **TestKvPushSlidingWindow.cluster_options,
        "decode_tp": 2,
    }


# Long (not CI, for time): the same families pushed per layer (``auto``
# pushes these prompts per chunk: chunked prefill is on).
@pytest.mark.long
class TestKvPushMoePerLayer(TestKvPushMoe):
    """MoE, each chunk's layers pushed as its forward passes them."""

    cluster_options: ClassVar[dict[str, Any]] = {
        **TestKvPushMoe.cluster_options,
        "push_granularity": "layer",
    }


@pytest.mark.long
class TestKvPushSlidingWindowPerLayer(FamilyChecks):
    """Sliding window + full layers, pushed per layer: with vLLM's hybrid
    KV-cache manager off (one group, every block kept and pushed), as
    per-layer pushes of several groups are refused."""

    preset = "swa"
    cluster_options: ClassVar[dict[str, Any]] = {
        **TestKvPushSlidingWindow.cluster_options,
        "push_granularity": "layer",
        "extra_vllm_args": ("--disable-hybrid-kv-cache-manager",),
    }


@pytest.mark.long
class TestKvPushSlidingWindowWhole(TestKvPushSlidingWindow):
    """Sliding window + full layers with the hybrid manager, pushed once per
    request: the trigger reads vLLM's current tables, where the windowed
    groups have already let go of the prompt's first blocks."""

    cluster_options: ClassVar[dict[str, Any]] = {
        **TestKvPushSlidingWindow.cluster_options,
        "push_granularity": "request",
    }


def _no_fp8_kv_here() -> bool:
    """vLLM's CPU build keeps an fp8 KV cache only on x86 with AVX-512 or
    AMX ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX")."""
    try:
        return " avx512f" not in Path("/proc/cpuinfo").read_text()
    except OSError:
        return True


@pytest.mark.skipif(_no_fp8_kv_here(), reason="this CPU has no AVX-512: no fp8 KV")
class TestKvPushFp8Kv(FamilyChecks):
    """The dense model with a per-tensor fp8 KV cache (``--kv-cache-dtype
    fp8``: one byte per value, scales fixed by the model on both sides):
    the pushed bytes are decode's cache as colocated would have it."""

    preset = "tiny"
    cluster_options: ClassVar[dict[str, Any]] = {
        "max_num_batched_tokens": 256,
        "verify_kv": "all",
        "extra_vllm_args": ("--kv-cache-dtype", "fp8"),
    }

    def test_both_caches_are_fp8(self, pd_cluster: Cluster) -> None:
        for name in ("prefill0", "decode0"):
            info = faults.instance_metric(
                pd_cluster, name, "vllm:cache_config_info", cache_dtype="fp8"
            )
            assert info == 1, f"{name} does not keep an fp8 cache"

    # Declared again so that it runs after the check above.
    def test_down_stops_every_process(self, pd_cluster: Cluster) -> None:
        super().test_down_stops_every_process(pd_cluster)


# Long (not CI, for time): the MoE and sliding-window presets on fp8 caches.
@pytest.mark.long
class TestKvPushMoeFp8Kv(TestKvPushFp8Kv):
    """MoE on a per-tensor fp8 KV cache."""

    preset = "moe"


@pytest.mark.long
class TestKvPushSlidingWindowFp8Kv(TestKvPushFp8Kv):
    """Sliding window + full layers on a per-tensor fp8 KV cache."""

    preset = "swa"


MLA_TP: dict[str, Any] = {"prefill_tp": 1, "decode_tp": 2}


# The workload as requests decode cannot continue from prefill's first token
# (min_tokens reads the output): decode computes it, as vllm-pull's does.
MLA_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    n: (path, {**body, "min_tokens": 1}) for n, (path, body) in workload.SHAPES.items()
}


class TestKvPushMla(FamilyChecks):
    """DeepSeek-V2-style MLA: one 576-value latent per token and layer,
    which every TP rank holds whole. Decode runs TP 2, so prefill's one rank
    writes each decode rank its own copy of every block. vLLM's CPU build
    turns prefix caching and chunked prefill off for MLA and uses 16-token
    blocks, so each push is a whole prompt (per layer under ``auto``)."""

    preset = "mla"
    # Its reference, vllm-pull, streams decode's first token: so does this
    # router, but for the check of prefill's first token below.
    cluster_options: ClassVar[dict[str, Any]] = {
        **MLA_TP,
        "verify_kv": "all",
        "first_token_from": FirstTokenFrom.DECODE.value,
        "fault_injection": True,  # the first-token check holds WRITEs back
    }

    @classmethod
    def reference_outputs(
        cls, request: pytest.FixtureRequest, model_dir: Path
    ) -> workload.Outputs:
        """vllm-pull's answers to every API shape, one at a time (see the
        module docstring), from a cluster of its own, stopped once they
        are in."""
        run_dir = request.getfixturevalue("tmp_path_factory").mktemp("pull-mla")
        cluster = start_cluster("vllm-pull", model_dir, run_dir, **MLA_TP)
        try:
            return {n: workload.send(cluster.url, *r) for n, r in MLA_SHAPES.items()}
        finally:
            cluster.stop()

    # A request continues from prefill's first token when it comes before
    # the KV lands (kvpush's scheduler class on decode): on CPU MLA that is
    # colocated's token, not the reference's (vllm-pull computes it on
    # decode's decode path), and whether it comes first is timing. So these
    # checks send requests that cannot continue (MLA_SHAPES), and the
    # continuation is checked with the WRITEs held back, in
    # test_the_first_token_from_prefill.
    @pytest.mark.parametrize("name", sorted(MLA_SHAPES))
    def test_matches_colocated(
        self, pd_cluster: Cluster, reference: workload.Outputs, name: str
    ) -> None:
        reply = workload.send(pd_cluster.url, *MLA_SHAPES[name])
        assert workload.mismatch(reference[name], reply) is None, workload.mismatch(
            reference[name], reply
        )

    def test_either_arrival_order(
        self, pd_cluster: Cluster, reference: workload.Outputs, first_leg: str
    ) -> None:
        name = "completion-long"
        path, body = MLA_SHAPES[name]
        reply = workload.send_legs_in_order(
            pd_cluster, self.mode, path, body, first_leg
        )
        assert workload.mismatch(reference[name], reply) is None, workload.mismatch(
            reference[name], reply
        )

    def test_thirty_two_concurrent_mixed_lengths(self, pd_cluster: Cluster) -> None:
        _all_served(pd_cluster, workload.CONCURRENT)

    def test_concurrent_requests_sharing_a_prefix(self, pd_cluster: Cluster) -> None:
        for _ in (1, 2):
            _all_served(pd_cluster, workload.SHARED_PREFIX)

    def test_the_first_token_from_prefill(self, pd_cluster: Cluster) -> None:
        # The router's default streams prefill's first token, which on CPU
        # MLA is the colocated one (prefill0's own) and may differ from
        # decode's (see the module docstring): each streamed reply must begin
        # with prefill0's token and come whole, decode's stream followed when
        # it agrees and the rest continued from that token when it does not.
        streamed = [n for n, (_, body) in workload.SHAPES.items() if body["stream"]]
        firsts = {
            n: workload.send(pd_cluster.instance_url("prefill0"), *_first_only(n)).text
            for n in streamed
        }
        with _router_with(pd_cluster, FirstTokenFrom.PREFILL):
            before = faults.first_token_outcomes(pd_cluster.url)
            with faults.writes_held(pd_cluster):  # prefill's answer comes first
                replies = {
                    n: workload.send(pd_cluster.url, *workload.SHAPES[n])
                    for n in streamed
                }
            served = faults.first_tokens_since(pd_cluster.url, before, len(streamed))
        for name, reply in replies.items():
            assert reply.status == 200 and reply.text.startswith(firsts[name]), (
                name, firsts[name], reply.text,
            )  # fmt: skip
            assert reply.usage and reply.usage["completion_tokens"] == 16, reply.usage
        assert sum(served.values()) == len(streamed), served
        assert set(served) <= {Outcome.PREFILL.value, Outcome.CONTINUED.value}, served

    def test_each_decode_rank_is_written_one_copy_of_the_prompt(
        self, pd_cluster: Cluster, model_dir: Path
    ) -> None:
        # No replicated MLA copies and no more than decode needs: a prompt
        # of 101 tokens is 7 blocks of 16 (whether decode loads 100 or 101
        # of them), each one latent per token and layer in float32, written
        # once to each of decode's 2 ranks (it holds the latent whole).
        config = json.loads((model_dir / "config.json").read_text())
        latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        num_blocks, block_size, float32 = 7, 16, 4
        expected = (
            num_blocks * block_size * latent * float32
            * config["num_hidden_layers"] * MLA_TP["decode_tp"]
        )  # fmt: skip
        written = names.KVPUSH_WRITE_BYTES.sum
        before = faults.instance_metric(pd_cluster, "prefill0", written)
        body = {"prompt": list(range(10, 111)), "max_tokens": 2, "temperature": 0}
        reply = workload.send(pd_cluster.url, "/v1/completions", body)
        assert reply.status == 200, reply.text
        prefill = pd_cluster.instance_url("prefill0")
        grown = 0.0
        deadline = time.monotonic() + 10.0
        while grown < expected and time.monotonic() < deadline:
            # A count reaches /metrics with prefill's next engine step.
            workload.send(prefill, *_first_only("completion-short"))
            grown = faults.instance_metric(pd_cluster, "prefill0", written) - before
        assert grown == expected, (grown, expected)

    # Declared again so that they run after the four above.
    def test_no_blocks_held_after_the_run(self, pd_cluster: Cluster) -> None:
        super().test_no_blocks_held_after_the_run(pd_cluster)

    def test_down_stops_every_process(self, pd_cluster: Cluster) -> None:
        super().test_down_stops_every_process(pd_cluster)


def _written_since(cluster: Cluster, before: float, want: float) -> float:
    """Prefill0's KV bytes written since ``before``, once they reach
    ``want`` or 10 s passed (vLLM reports stats after a step)."""
    name = names.KVPUSH_WRITE_BYTES.sum
    deadline = time.monotonic() + 10
    while True:
        written = faults.instance_metric(cluster, "prefill0", name) - before
        if written == want or time.monotonic() > deadline:
            return written
        time.sleep(0.2)


def _first_only(name: str) -> tuple[str, dict[str, Any]]:
    """Workload shape ``name`` cut to its first token, not streamed."""
    path, body = workload.SHAPES[name]
    body = {k: v for k, v in body.items() if k != "stream_options"}
    return path, {**body, "stream": False, "max_tokens": 1}


@contextlib.contextmanager
def _router_with(cluster: Cluster, first: FirstTokenFrom) -> Iterator[None]:
    """The cluster's router restarted with ``first_token_from=first``, then
    as it was."""
    config = cluster.config
    cluster.config = dataclasses.replace(config, first_token_from=first.value)
    try:
        cluster.restart("router")
        yield
    finally:
        cluster.config = config
        cluster.restart("router")


def _all_served(
    cluster: Cluster, requests: dict[str, tuple[str, dict[str, Any]]]
) -> None:
    """Every request answered; that its KV arrived whole, pushed and
    digest-verified, is checked after them (``test_no_blocks_held_after_the_run``)."""
    replies = workload.run_concurrent(cluster.url, requests)
    bad = {n: r.status for n, r in replies.items() if r.status != 200 or not r.text}
    assert bad == {}


class TestKvPushHybrid:
    """Nemotron-H-style Mamba2 + attention, prefix caching off (the
    launcher's choice for state models). A request that can continue from
    prefill's first token (its logprobs too: prefill sends them) loads the
    attention KV and the Mamba state; one that cannot (``min_tokens``) is
    computed by decode alone."""

    mode = "kvpush"
    preset = "hybrid"
    dtype = "float32"
    batch_invariant = True  # a batched reply equals the one-at-a-time one
    cluster_options: ClassVar[dict[str, Any]] = {
        "max_num_batched_tokens": 256,
        "verify_kv": "all",
    }

    @classmethod
    def reference_outputs(
        cls, request: pytest.FixtureRequest, model_dir: Path
    ) -> workload.Outputs:
        """The whole workload, answered by prefill0 alone, one at a time."""
        return FamilyChecks.reference_outputs(request, model_dir)

    @pytest.mark.parametrize("name", sorted(workload.SHAPES))
    def test_equals_colocated(
        self, pd_cluster: Cluster, reference: workload.Outputs, name: str
    ) -> None:
        got = workload.send(pd_cluster.url, *workload.SHAPES[name])
        assert workload.mismatch(reference[name], got) is None, workload.mismatch(
            reference[name], got
        )

    def test_concurrent_requests_equal_colocated(
        self, pd_cluster: Cluster, reference: workload.Outputs
    ) -> None:
        # thirty-two mixed lengths at once, then the shared-prefix rounds:
        # each state pushed into decode's batch equals prefill's alone
        for requests in (workload.CONCURRENT, workload.SHARED_PREFIX):
            if not self.batch_invariant:
                _all_served(pd_cluster, requests)
                continue
            replies = workload.run_concurrent(pd_cluster.url, requests)
            problems = {
                n: workload.mismatch(reference[n], r) for n, r in replies.items()
            }
            assert {n: p for n, p in problems.items() if p} == {}

    def test_pushes_the_attention_blocks_and_each_state_once(
        self, pd_cluster: Cluster, model_dir: Path
    ) -> None:
        """The WRITEs carry every attention block of the prompt and each
        Mamba layer's state, its bytes only (not the page it is padded to)."""
        before = faults.instance_metric(
            pd_cluster, "prefill0", names.KVPUSH_WRITE_BYTES.sum
        )
        prompt = workload.text_of(700, seed=2601)  # in no earlier request
        reply = workload.send(pd_cluster.url, *workload.completion(prompt, False, 2))
        assert reply.status == 200, reply.body
        num_tokens = int(reply.body["usage"]["prompt_tokens"])
        cache = faults.cache_config(pd_cluster, "prefill0")  # as vLLM resolved it
        want = kv_size.pushed_bytes(
            model_dir, self.dtype, num_tokens, int(cache["block_size"]),
            ssm_dtype=cache["mamba_ssm_cache_dtype"],
            kv_dtype=cache["cache_dtype"],
        )  # fmt: skip
        written = _written_since(pd_cluster, before, want)
        assert written == want, f"wrote {written} bytes, decode needs {want}"

    def test_a_request_that_cannot_continue_is_computed_by_decode(
        self, pd_cluster: Cluster
    ) -> None:
        """Decode would compute its prompt whole (``min_tokens``: decode's
        output counts, not ``t1``), so the router sends it to decode alone
        (``kvpush up`` tells it the model keeps state)."""
        path, body = workload.SHAPES["completion-long"]
        body = {**body, "min_tokens": 4}
        want = workload.send(pd_cluster.instance_url("prefill0"), path, body)
        got = workload.send(pd_cluster.url, path, body)
        assert got.headers["x-kvpush-binding"] == "skip", got.headers
        assert workload.mismatch(want, got) is None, workload.mismatch(want, got)

    def test_states_were_pushed_and_never_saw_their_last_token_twice(
        self, pd_cluster: Cluster
    ) -> None:
        faults.nudge(pd_cluster, "decode0")
        events = faults.counters(pd_cluster)["decode0"]
        # every shape, those asking logprobs too (the min_tokens one skipped)
        assert events["first_token.continued"] >= len(workload.SHAPES), events
        assert events.get("first_token.recomputed.logprobs", 0) == 0, events
        assert events.get("rejected.state_rewind", 0) == 0, events
        assert events["digest_verified"] >= len(workload.SHAPES), events
        assert events["digest_mismatch"] == 0, events
        assert events["first_token.recomputed.state_rewound"] == 0, events
        assert not any(k.startswith("receive_failed.") and v for k, v in events.items())

    def test_no_blocks_held_after_the_run(self, pd_cluster: Cluster) -> None:
        for name in ("prefill0", "decode0"):
            usage = workload.kv_cache_usage(pd_cluster.instance_url(name))
            assert usage == 0.0, f"{name} still holds KV blocks ({usage:.2%})"

    def test_down_stops_every_process(self, pd_cluster: Cluster) -> None:
        pd_cluster.stop()


class TestKvPushGdn(TestKvPushHybrid):
    """Qwen3-Next-style gated delta net + attention (MoE): its per-request
    state (conv and recurrent) copied as the Mamba2 one. vLLM's CPU build
    runs gated delta net in bfloat16 only."""

    preset = "gdn"
    dtype = "bfloat16"
    cluster_options: ClassVar[dict[str, Any]] = {
        **TestKvPushHybrid.cluster_options,
        "dtype": "bfloat16",
    }
    # In bfloat16 vLLM's own colocated instance answers 28 of the 32
    # concurrent requests differently from one at a time (text, or logprobs
    # by up to 0.15; 2026-12-05): batched replies say nothing about a push.
    batch_invariant = False


class TestKvPushHybridDecodeTp2:
    """Mamba2 + attention, prefill TP 1 and decode TP 2: each decode rank
    takes its share of the state pages (its heads of x and of the
    recurrent state, the one group whole) and of the KV heads from prefill
    rank 0, and continues from prefill's first token; every shape equals
    prefill alone."""

    mode = "kvpush"
    preset = "hybrid"
    cluster_options: ClassVar[dict[str, Any]] = {
        **TestKvPushHybrid.cluster_options,
        "decode_tp": 2,
    }

    @pytest.mark.parametrize("name", sorted(workload.SHAPES))
    def test_equals_colocated(self, pd_cluster: Cluster, name: str) -> None:
        path, body = workload.SHAPES[name]
        want = workload.send(pd_cluster.instance_url("prefill0"), path, body)
        got = workload.send(pd_cluster.url, path, body)
        assert workload.mismatch(want, got) is None, workload.mismatch(want, got)

    def test_states_were_split_over_the_decode_ranks_and_continued(
        self, pd_cluster: Cluster
    ) -> None:
        faults.nudge(pd_cluster, "decode0")
        events = faults.counters(pd_cluster)["decode0"]
        assert events["first_token.continued"] >= len(workload.SHAPES), events
        assert events.get("rejected.state_rewind", 0) == 0, events
        assert events["digest_verified"] >= 2 * len(workload.SHAPES), events
        assert events["digest_mismatch"] == 0, events
        assert events["first_token.recomputed.state_rewound"] == 0, events

    def test_down_stops_every_process(self, pd_cluster: Cluster) -> None:
        pd_cluster.stop()


@pytest.mark.long
class TestKvPushHybridPrefillTp2(TestKvPushHybridDecodeTp2):
    """The other way: prefill TP 2, decode TP 1. Decode's one rank takes
    each prefill rank's half of the heads of x, of the recurrent state and
    of the KV heads, and the one group (held by both prefill ranks) from
    prefill rank 0."""

    cluster_options: ClassVar[dict[str, Any]] = {
        **TestKvPushHybrid.cluster_options,
        "prefill_tp": 2,
    }


@pytest.mark.long
class TestKvPushGdnDecodeTp2:
    """Gated delta net at decode TP 2: the split states are loaded,
    verified and continued. No exact reference exists in bfloat16: vLLM's
    own TP 1 and TP 2 instances answer every shape differently (logprobs by
    0.17-0.24, text in 4 of 8), and P/D equals decode's TP 2 instance
    computing alone in 4 of 8 shapes (2026-12-05, ``docs/model-families.md``),
    so each shape is checked answered."""

    mode = "kvpush"
    preset = "gdn"
    cluster_options: ClassVar[dict[str, Any]] = {
        **TestKvPushGdn.cluster_options,
        "decode_tp": 2,
    }

    @pytest.mark.parametrize("name", sorted(workload.SHAPES))
    def test_every_shape_is_answered(self, pd_cluster: Cluster, name: str) -> None:
        path, body = workload.SHAPES[name]
        reply = workload.send(pd_cluster.url, path, body)
        assert reply.status == 200, reply.body

    def test_states_were_split_over_the_decode_ranks_and_continued(
        self, pd_cluster: Cluster
    ) -> None:
        TestKvPushHybridDecodeTp2.test_states_were_split_over_the_decode_ranks_and_continued(
            self,  # type: ignore[arg-type]
            pd_cluster,
        )

    def test_down_stops_every_process(self, pd_cluster: Cluster) -> None:
        pd_cluster.stop()


class TestKvPushShortConv(TestKvPushHybrid):
    """LFM2-style short convolutions + attention: each request's conv state
    (no recurrent state) copied as a Mamba2 one, in CI like it."""

    preset = "shortconv"
    # vLLM's own colocated instance answers all 32 concurrent requests
    # differently from one at a time (text on most; 2026-12-05, float32):
    # batched replies say nothing about a push.
    batch_invariant = False


@pytest.mark.long
class TestKvPushHybridFp8Kv(TestKvPushHybrid):
    """The hybrid preset with a per-tensor fp8 attention cache: the Mamba
    states keep the model's dtype (vLLM's ``mamba_cache_dtype`` auto), the
    attention blocks are one byte a value; bytes written = decode's need."""

    cluster_options: ClassVar[dict[str, Any]] = {
        **TestKvPushHybrid.cluster_options,
        "extra_vllm_args": ("--kv-cache-dtype", "fp8"),
    }


@pytest.mark.long
class TestKvPushShortConvDecodeTp2(TestKvPushGdnDecodeTp2):
    """Short convolutions at decode TP 2: each decode rank takes its half
    of every conv state's channels from prefill's one rank. No exact
    reference here either: vLLM's own TP 1 and TP 2 LFM2 instances differ
    on 7 of 8 shapes in float32 (logprobs by 0.07-0.11, text on 3), P/D
    lying between them (2026-12-05), so each shape is checked answered."""

    preset = "shortconv"
    cluster_options: ClassVar[dict[str, Any]] = {
        **TestKvPushShortConv.cluster_options,
        "decode_tp": 2,
    }
