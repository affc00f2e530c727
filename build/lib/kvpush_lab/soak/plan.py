"""What the soak sends and when: pure functions of the config and seed.

The schedule is a Poisson process at ``qps`` over ``duration_s``; each
request draws its prompt length and whether (and how late) the client
aborts it. Aborts are drawn as a fraction of the abort window, so the
schedule is fixed before the window is measured in the warm-up. Prompt
tokens are drawn when the request is sent (a long soak holds thousands of
requests), from a stream named by the request's index: the same seed sends
the same prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpush_lab.bench.lengths import LengthSpec
from kvpush_lab.bench.workload import RequestSpec, random_tokens, rng_for
from kvpush_lab.soak.config import SoakConfig

SOAK_TAG = "soak"


@dataclass(frozen=True)
class SoakRequest:
    """One planned request. ``abort_at`` is when the client aborts it, as a
    fraction (0..1) of the abort window; None: it is never aborted."""

    index: int
    arrival_s: float
    prompt_len: int
    abort_at: float | None = None

    @property
    def bench_id(self) -> str:
        return f"{SOAK_TAG}-{self.index}"

    def abort_after_s(self, window_s: float) -> float | None:
        """Seconds after the send at which the client aborts it."""
        return None if self.abort_at is None else self.abort_at * window_s


def poisson_until(duration_s: float, qps: float, seed: int) -> list[float]:
    """Send times of a Poisson process at ``qps`` within ``[0, duration_s)``:
    the first at 0, then exponential gaps of mean ``1/qps``."""
    rng = rng_for(seed, SOAK_TAG, "arrivals")
    offsets, now = [], 0.0
    while now < duration_s:
        offsets.append(now)
        now += rng.expovariate(qps)
    return offsets


def schedule(config: SoakConfig) -> list[SoakRequest]:
    """Every request of the soak, in sending order."""
    arrivals = poisson_until(config.duration_s, config.qps, config.seed)
    lengths = config.prompt_spec.sample(
        len(arrivals), rng_for(config.seed, SOAK_TAG, "prompt_len")
    )
    aborts = rng_for(config.seed, SOAK_TAG, "aborts")
    requests = []
    for i, (at, length) in enumerate(zip(arrivals, lengths, strict=True)):
        is_aborted = aborts.random() < config.abort_fraction
        abort_at = aborts.random()  # drawn either way: stable when fraction changes
        requests.append(SoakRequest(i, at, length, abort_at if is_aborted else None))
    return requests


def request_spec(
    request: SoakRequest, vocab: Sequence[int], seed: int, max_tokens: int
) -> RequestSpec:
    """The request's exact prompt tokens and body."""
    rng = rng_for(seed, SOAK_TAG, request.index, "tokens")
    prompt = tuple(random_tokens(request.prompt_len, vocab, rng))
    return RequestSpec(
        request.index, request.bench_id, prompt, max_tokens, request.arrival_s
    )


def warmup_specs(
    num: int, prompt_len: LengthSpec, vocab: Sequence[int], seed: int, max_tokens: int
) -> tuple[RequestSpec, ...]:
    """``num`` requests shaped like the soak's, with prompts of their own."""
    lengths = prompt_len.sample(num, rng_for(seed, SOAK_TAG, "warmup", "prompt_len"))
    rng = rng_for(seed, SOAK_TAG, "warmup", "tokens")
    return tuple(
        RequestSpec(i, f"{SOAK_TAG}-w-{i}", tuple(random_tokens(n, vocab, rng)),
                    max_tokens)
        for i, n in enumerate(lengths)
    )  # fmt: skip
