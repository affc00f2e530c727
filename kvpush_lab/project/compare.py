"""The published claims, and how the model's ratios compare with them.

Sources (vLLM pull request 35264, "Support KV push from Prefill to Decode
node using Nixl KV Connector", by its author):

* its description: ``vllm bench serve`` with the sonnet dataset on AWS
  P5en (H200, EFA), 1P1D, several input and output lengths: push's TTFT
  1.2-3.0x better than pull's;
* its comment of 2026-04-10: 3x or more when decode already holds the
  whole prompt in its prefix cache; 1.3-2x TTFT and about 30 % better TPOT
  when the KV cache is fragmented (Llama-3.3-70B: 118 -> 18,880
  descriptors, ``postXfer`` 0.46 -> 46 ms, in decode's loop in pull mode).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpush_lab.project.estimate import Scenario

SOURCE = "vllm-project/vllm#35264"


@dataclass(frozen=True)
class Claim:
    name: str
    scenario: str
    metric: str  # "ttft" or "tpot": pull's value over push's
    low: float
    high: float  # math.inf: "or more"
    source: str

    @property
    def range_text(self) -> str:
        if math.isinf(self.high):
            return f">= {self.low:g}x"
        return f"{self.low:g}-{self.high:g}x"


CLAIMS: tuple[Claim, ...] = (
    Claim("TTFT over input/output lengths", "contiguous", "ttft", 1.2, 3.0,
          f"{SOURCE}, description (sonnet, P5en, Qwen3-32B)"),
    Claim("TTFT, fragmented KV", "fragmented", "ttft", 1.3, 2.0,
          f"{SOURCE}, comment 2026-04-10 (Llama-3.3-70B)"),
    Claim("TPOT, fragmented KV ('about 30 %', read as 1.2-1.4x)", "fragmented",
          "tpot", 1.2, 1.4, f"{SOURCE}, comment 2026-04-10 (Llama-3.3-70B)"),
    Claim("TTFT, decode holds the prompt", "decode-prefix-hit", "ttft", 3.0,
          math.inf, f"{SOURCE}, comment 2026-04-10"),
)  # fmt: skip


@dataclass(frozen=True)
class Comparison:
    claim: Claim
    prompt_tokens: int
    push_ratio: float  # vLLM push: what the claim is about
    kvpush_ratio: float
    verdict: str  # "inside", "below" or "above" the published range
    why: str


def compare(scenarios: list[Scenario]) -> list[Comparison]:
    """Every claim against every prompt length's matching scenario."""
    out = []
    for claim in CLAIMS:
        for s in scenarios:
            if s.name == claim.scenario:
                out.append(_compare_one(claim, s))
    return out


def _compare_one(claim: Claim, s: Scenario) -> Comparison:
    ratio = s.ttft_ratio if claim.metric == "ttft" else s.tpot_ratio
    push = ratio("vllm-push")
    if push < claim.low:
        verdict = "below"
    elif push > claim.high:
        verdict = "above"
    else:
        verdict = "inside"
    why = _why(claim, s, verdict)
    return Comparison(claim, s.prompt_tokens, push, ratio("kvpush"), verdict, why)


EXPLANATIONS = {
    ("ttft", "below"): (
        "TTFT below the published range: at the published scale prefill's "
        "compute is most of pull's TTFT, and the phases that push removes (the "
        "second leg's hop, the step that READ waits for, pull's stalled steps) "
        "are a few decode steps, a small share. What the model leaves out and "
        "the published runs had: queueing under load (requests joining a decode "
        "whose loop is stalled by posts wait for it; each READ post waits for "
        "the ones before it; vLLM PR 45211 reports 1.6x TTFT for pull alone from "
        "moving the post to a thread at 2048/128 tokens, QPS 8), and prefill "
        "times shorter than this FLOP estimate"
    ),
    ("ttft", "above"): (
        "TTFT above the published range: the model's prefill is short against "
        "the handover (high TP, short prompt, or high MFU assumed)"
    ),
    ("tpot", "above"): (
        "TPOT above the published range: the model's stall (post x requests "
        "joining per step) is larger than the published runs saw; their "
        "figure implies fewer requests joining decode per step (longer "
        "outputs or a smaller batch than assumed) or fewer descriptors"
    ),
    ("tpot", "below"): (
        "TPOT below the published range: more requests joining per step "
        "(shorter outputs, a larger batch) or a slower post per descriptor "
        "would reach it"
    ),
}


def explanations(comparisons: list[Comparison]) -> list[str]:
    """One paragraph per (metric, verdict) met outside a published range."""
    keys = dict.fromkeys((c.claim.metric, c.verdict) for c in comparisons)
    return [EXPLANATIONS[k] for k in keys if k in EXPLANATIONS]


def _why(claim: Claim, s: Scenario, verdict: str) -> str:
    pull, push = s.get("vllm-pull"), s.get("vllm-push")
    if claim.metric == "tpot":
        return _why_tpot(claim, s)
    prefill = pull.ttft_ms - pull.handover_ms
    text = (
        f"pull {pull.ttft_ms:.0f} ms (prefill {prefill:.0f} = "
        f"{prefill / pull.ttft_ms:.0%}, handover {pull.handover_ms:.0f}), "
        f"push {push.ttft_ms:.0f} ms"
    )
    if verdict == "below":
        missing = claim.low * push.ttft_ms - pull.ttft_ms
        text += f"; {claim.low:g}x needs {missing:.0f} ms more on pull's path"
    return text


def _why_tpot(claim: Claim, s: Scenario) -> str:
    pull = s.get("vllm-pull")
    post = pull.stall_ms / s.joining_per_step if s.joining_per_step else 0.0
    text = (
        f"pull's post ({s.descriptors:,} descriptors, {post:.1f} ms) x "
        f"{s.joining_per_step:.3g} joining per step adds {pull.stall_ms:.1f} ms "
        f"to a {pull.decode_step_ms:.1f} ms step"
    )
    if post:
        implied = (1.3 - 1) * pull.decode_step_ms / post
        text += f"; 1.3x would be {implied:.3g} joining per step"
    return text
