"""A model with per-request state (Mamba, gated delta net, short conv): the
router sends a request its decode would compute whole anyway to decode
alone, instead of making prefill compute it too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kvpush.connector.decode.first_token import why_never
from kvpush.launcher.cluster import router_command
from kvpush.launcher.config import ClusterConfig
from kvpush.model import families
from kvpush.model.presets import preset
from kvpush.router.binding import BindingDecision, decide
from kvpush.router.config import RoutingConfig
from kvpush.router.requests import parse_request
from kvpush.telemetry import names
from tests.fakes import routed
from tests.fakes.metrics import metric

LONG_PROMPT = " ".join(f"word{i}" for i in range(40))  # 40 fake tokens
COMPLETION = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 4}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
PICTURE = [
    {"type": "text", "text": "what is this"},
    {"type": "image_url", "image_url": {"url": "data:,"}},
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]

# (endpoint, fields added to the body, what the router reads)
CASES: list[tuple[str, dict[str, Any], str | None]] = [
    ("completions", {}, None),
    ("completions", {"temperature": 0.7, "seed": 3}, None),
    ("completions", {"logprobs": 5}, None),
    ("completions", {"min_tokens": 0, "presence_penalty": 0.0}, None),
    ("completions", {"response_format": {"type": "text"}}, None),
    ("completions", {"min_tokens": 2}, "min_tokens"),
    ("completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": -0.2}, "frequency_penalty"),
    ("completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("completions", {"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("chat", {}, None),
    ("chat", {"logprobs": True, "top_logprobs": 3}, None),
    ("chat", {"tools": TOOLS, "tool_choice": "auto"}, None),
    ("chat", {"min_tokens": 1}, "min_tokens"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "logprobs"),
    ("chat", {"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ("chat", {"messages": [{"role": "user", "content": PICTURE}]}, "multimodal"),
]


def _parsed(endpoint: str, fields: dict[str, Any]):
    base = CHAT if endpoint == "chat" else COMPLETION
    raw = msgspec.json.encode({**base, **fields})
    return parse_request(raw, endpoint, allow_n=True)  # type: ignore[arg-type]


@pytest.mark.parametrize(("endpoint", "fields", "reason"), CASES)
def test_the_router_reads_which_requests_decode_computes_again(
    endpoint: str, fields: dict[str, Any], reason: str | None
) -> None:
    assert _parsed(endpoint, fields).first_token_recomputed == reason


# vLLM's request of a body that maps to sampling parameters alone (tools and
# media are set up by vLLM's serving layer, not by to_sampling_params).
_SAMPLING_ONLY = [
    (e, f, r) for e, f, r in CASES if r not in ("tool_choice", "multimodal")
]


@pytest.mark.parametrize(("endpoint", "fields", "reason"), _SAMPLING_ONLY)
def test_the_router_and_decode_agree_on_which_requests_continue(
    endpoint: str, fields: dict[str, Any], reason: str | None
) -> None:
    """The same body through vLLM's own request models to the ``Request``
    decode's scheduler sees: decode's ``why_never`` and the router's rule
    give the same verdict."""
    if endpoint == "chat":
        body = ChatCompletionRequest(**{**CHAT, **fields})
        params = body.to_sampling_params(16, {})
    else:
        params = CompletionRequest(**{**COMPLETION, **fields}).to_sampling_params(16)
    params.update_from_generation_config({}, eos_token_id=2)
    init_none_hash(sha256)
    request = Request(
        request_id="r",
        prompt_token_ids=list(range(3, 40)),
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(16, sha256),
    )
    assert (why_never(request) is None) == (reason is None), why_never(request)


def _decide(policy: str, **extra: Any) -> BindingDecision:
    return decide(
        policy,  # type: ignore[arg-type]
        num_held_tokens=0,
        block_size=128,
        skip_max_new_tokens=256,
        has_prefill=True,
        **{"num_prompt_tokens": 1000, **extra},
    )


def test_an_early_binding_of_a_recomputed_request_skips_instead() -> None:
    for policy, extra in (
        ("auto", {}),  # new_tokens
        ("auto", {"num_prompt_tokens": None}),  # tokens_unknown
        ("early", {}),  # forced
    ):
        assert _decide(policy, **extra).binding == "early"
        assert _decide(policy, state_recomputed=True, **extra) == BindingDecision(
            "skip", "state_recomputed"
        )


def test_other_bindings_of_a_recomputed_request_stay() -> None:
    for policy, extra in (
        ("auto", {"decode_busy": 10.0}),  # late: decode's prompt ends with t1
        ("late", {}),
        ("skip", {}),
        ("auto", {"one_token": True}),  # prefill answers alone
        ("auto", {"num_prompt_tokens": 100}),  # short: skips anyway
    ):
        want = _decide(policy, **extra)
        assert _decide(policy, state_recomputed=True, **extra) == want


async def test_a_state_models_recomputed_request_reaches_decode_alone() -> None:
    """Through the real router: with ``state_model`` a ``min_tokens`` request
    goes to decode alone, as the client sent it, and is counted; a plain
    one keeps both legs; without ``state_model`` both keep them."""
    asks = {**COMPLETION, "min_tokens": 2}
    for state_model, body, binding in (
        (True, asks, "skip"),
        (True, COMPLETION, "early"),
        (False, asks, "early"),
    ):
        config = RoutingConfig(binding="early", state_model=state_model)
        async with routed("kvpush", routing=config) as r:
            reply = await r.post("/v1/completions", body)
            assert reply.status == 200, reply.body
            metrics = (await r.get("/metrics")).body.decode()
            prefill_legs = r.cluster.prefills[0].received
            (served,) = r.cluster.decodes[0].received
        assert reply.headers["x-kvpush-binding"] == binding
        if binding == "skip":
            assert prefill_legs == []
            assert served.body == body, "the client's body, no kv_transfer_params"
            count = metric(
                metrics, names.ROUTER_BINDING, binding="skip", reason="state_recomputed"
            )
            assert count == 1
        else:
            assert len(prefill_legs) == 1


STATE_PRESETS = [("hybrid", True), ("gdn", True), ("shortconv", True),
                 ("swa", False), ("mla", False)]  # fmt: skip


@pytest.mark.parametrize(("name", "has_state"), STATE_PRESETS)
def test_up_tells_its_router_when_the_model_keeps_state(
    name: str, has_state: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpush.launcher import cluster

    spec = preset(name).spec
    families.hf_config(spec.family, spec, 4096, 2, 0).save_pretrained(tmp_path)
    seen: list[list[str]] = []
    monkeypatch.setattr(
        cluster.process, "spawn", lambda cmd, env, log: seen.append(cmd) or 7
    )
    kvpush = ClusterConfig(mode="kvpush")
    assert cluster._spawn_router(kvpush, tmp_path, tmp_path) == 7
    assert ("--state-model" in seen[0]) is has_state
    plain = router_command(ClusterConfig(mode="vllm-pull"), tmp_path, state_model=True)
    assert "--state-model" not in plain  # kvpush mode's routing only
