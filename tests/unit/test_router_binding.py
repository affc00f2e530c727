"""The binding policy: early, skip, and why."""

from __future__ import annotations

import pytest

from kvpush.router.binding import BindingDecision, check_policy, decide, num_new_tokens
from kvpush.router.config import RoutingConfig


def _auto(prompt: int | None, held: int = 0, has_prefill: bool = True):
    return decide(
        "auto",
        num_prompt_tokens=prompt,
        num_held_tokens=held,
        block_size=128,
        skip_max_new_tokens=256,
        has_prefill=has_prefill,
    )


def test_auto_skips_at_the_threshold_and_binds_early_above_it() -> None:
    assert _auto(1000, held=744) == BindingDecision("skip", "few_new_tokens")
    assert _auto(1000, held=743) == BindingDecision("early", "new_tokens")


def test_auto_skips_when_decode_holds_all_but_a_partial_block() -> None:
    assert _auto(1000, held=896) == BindingDecision("skip", "prefix_held")
    assert _auto(1024, held=1024) == BindingDecision("skip", "prefix_held")


def test_auto_skips_a_short_fresh_prompt_and_binds_a_long_one_early() -> None:
    assert _auto(200) == BindingDecision("skip", "short_prompt")
    assert _auto(257) == BindingDecision("early", "new_tokens")


def test_auto_lets_prefill_answer_a_request_for_one_token_alone() -> None:
    def one(policy: str, has_prefill: bool = True, logprobs: bool = False):
        return decide(
            policy,  # type: ignore[arg-type]
            num_prompt_tokens=None,
            num_held_tokens=0,
            block_size=128,
            skip_max_new_tokens=256,
            has_prefill=has_prefill,
            prompt_logprobs=logprobs,
            one_token=True,
        )

    assert one("auto") == BindingDecision("prefill", "one_token")
    assert one("auto").has_prefill_leg
    assert one("auto", has_prefill=False) == BindingDecision("skip", "no_prefill")
    assert one("auto", logprobs=True) == BindingDecision("skip", "prompt_logprobs")
    assert one("early") == BindingDecision("early", "forced")  # forced stays


def test_auto_binds_early_when_the_prompt_was_not_counted() -> None:
    assert _auto(None, held=0) == BindingDecision("early", "tokens_unknown")


def test_auto_skips_when_no_prefill_is_usable() -> None:
    assert _auto(5000, has_prefill=False) == BindingDecision("skip", "no_prefill")


@pytest.mark.parametrize("policy", ["early", "skip"])
def test_a_forced_binding_ignores_the_prompt(policy: str) -> None:
    decision = decide(
        policy,  # type: ignore[arg-type]
        num_prompt_tokens=10,
        num_held_tokens=0,
        block_size=128,
        skip_max_new_tokens=256,
        has_prefill=True,
    )
    assert decision == BindingDecision(policy, "forced")  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["auto", "early", "late", "skip"])
def test_a_request_asking_for_prompt_logprobs_always_skips(policy: str) -> None:
    decision = decide(
        policy,  # type: ignore[arg-type]
        num_prompt_tokens=5000,
        num_held_tokens=0,
        block_size=128,
        skip_max_new_tokens=256,
        has_prefill=True,
        prompt_logprobs=True,
    )
    assert decision == BindingDecision("skip", "prompt_logprobs")
    assert not decision.has_prefill_leg


def test_decode_always_computes_at_least_the_last_prompt_token() -> None:
    assert num_new_tokens(512, 512) == 1
    assert num_new_tokens(512, 9999) == 1
    assert num_new_tokens(512, 0) == 512


def test_every_binding_can_be_configured_and_others_are_refused() -> None:
    for policy in ("auto", "early", "late", "skip"):
        check_policy(policy)
        assert RoutingConfig(binding=policy).binding == policy  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown binding 'sometimes'"):
        check_policy("sometimes")
    with pytest.raises(ValueError, match="late_min_busy"):
        RoutingConfig(late_min_busy=-1.0)


def test_auto_binds_late_only_when_the_decode_is_busy_and_a_prefill_runs() -> None:
    def auto(busy: float, held: int = 0, tokens: int | None = 1000) -> BindingDecision:
        return decide(
            "auto", num_prompt_tokens=tokens, num_held_tokens=held, block_size=128,
            skip_max_new_tokens=256, has_prefill=True, decode_busy=busy,
            late_min_busy=4.0,
        )  # fmt: skip

    assert auto(4.0) == BindingDecision("early", "new_tokens")  # idle, unknown
    assert auto(4.5) == BindingDecision("late", "decode_busy")
    assert auto(100.0, held=768) == BindingDecision("skip", "few_new_tokens")
    assert auto(100.0, tokens=None) == BindingDecision("early", "tokens_unknown")


def test_routing_config_refuses_a_read_age_below_the_interval() -> None:
    with pytest.raises(ValueError, match="signal_max_age_s"):
        RoutingConfig(signal_interval_s=2.0, signal_max_age_s=1.0)
    with pytest.raises(ValueError, match="skip_max_new_tokens"):
        RoutingConfig(skip_max_new_tokens=-1)
