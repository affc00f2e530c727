"""The fragmented workload's churn: what scatters decode's free KV blocks.

Between the fragmented workload's two points (a fresh cache, then after
the churn) the benchmark sends ``churn_requests`` requests through the
router, ``churn_concurrency`` in flight at once (closed loop), prompts and
outputs of mixed lengths. A seeded subset, ``churn_abort_fraction`` of
those that ask for 2 tokens or more, is aborted by the client: it closes
its connection after a random number of tokens, 1 to output − 1, while
the request is decoding on decode. Requests of mixed lengths ending at
mixed times, some cut short, return their blocks to vLLM's free queue in
an order unlike the one they were handed out in, so the next long prompts
get block ids in many short runs.

Pure: the same seed gives the same schedule; token ids come from a stream
of their own (a salt draws other ids, same lengths and aborts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpush_lab.bench.config import BenchConfig
from kvpush_lab.bench.lengths import LengthSpec
from kvpush_lab.bench.workload import (
    PointWorkload,
    RequestSpec,
    SweepPoint,
    random_tokens,
    rng_for,
)

CHURN_POINT = -3
CHURN_FILE = "churn.jsonl"  # its records, beside requests.jsonl
_TAG = "churn"


@dataclass(frozen=True)
class Churn:
    """How many requests, how many at once, their lengths, the aborted share."""

    num_requests: int
    concurrency: int
    prompt_len: LengthSpec
    output_len: LengthSpec
    abort_fraction: float
    seed: int = 0

    @classmethod
    def of(cls, config: BenchConfig) -> Churn:
        return cls(
            num_requests=config.churn_requests,
            concurrency=config.churn_concurrency,
            prompt_len=LengthSpec.parse(config.churn_prompt_len),
            output_len=LengthSpec.parse(config.churn_output_len),
            abort_fraction=config.churn_abort_fraction,
            seed=config.seed,
        )

    def describe(self) -> str:
        return (
            f"{self.num_requests} requests, {self.concurrency} in flight at once, "
            f"prompts {self.prompt_len.describe()} tokens, outputs "
            f"{self.output_len.describe()} tokens; {self.abort_fraction:.0%} of "
            "those of 2+ output tokens aborted by the client after a random "
            "1 to output − 1 tokens (it closes the connection)"
        )


def abort_points(
    output_lens: Sequence[int], fraction: float, seed: int
) -> list[int | None]:
    """Per request, after how many tokens the client hangs up (None: never):
    ``round(fraction x eligible)`` of the requests of 2+ tokens, drawn."""
    eligible = [i for i, n in enumerate(output_lens) if n >= 2]
    picks = rng_for(seed, _TAG, "aborts")
    chosen = set(picks.sample(eligible, round(fraction * len(eligible))))
    after = rng_for(seed, _TAG, "abort_after")
    return [
        after.randint(1, n - 1) if i in chosen else None
        for i, n in enumerate(output_lens)
    ]


def churn_workload(churn: Churn, vocab: Sequence[int], salt: str = "") -> PointWorkload:
    """The churn's requests, as a closed-loop point of its own."""
    n, seed = churn.num_requests, churn.seed
    prompt_lens = churn.prompt_len.sample(n, rng_for(seed, _TAG, "prompt_len"))
    output_lens = churn.output_len.sample(n, rng_for(seed, _TAG, "output_len"))
    aborts = abort_points(output_lens, churn.abort_fraction, seed)
    tokens = rng_for(seed, _TAG, "tokens", salt) if salt else rng_for(seed, _TAG)
    requests = tuple(
        RequestSpec(
            i,
            f"kvb-churn-{i}",
            tuple(random_tokens(length, vocab, tokens)),
            out,
            abort_after_tokens=abort,
        )
        for i, (length, out, abort) in enumerate(
            zip(prompt_lens, output_lens, aborts, strict=True)
        )
    )
    point = SweepPoint(
        CHURN_POINT, "churn", 0.0, "concurrency", float(churn.concurrency),
        churn.prompt_len,
    )  # fmt: skip
    return PointWorkload(point, requests)
