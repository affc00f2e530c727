"""What the benchmark sends and when: pure functions of the config and seed.

Every prompt is a list of token ids drawn from the model's normal (not
special) vocabulary, so its token count is exact, and every request asks
for exactly its output length (``max_tokens`` with ``ignore_eos``). Each
sweep point and the warm-up get prompts of their own, so no point hits the
prefix cache another one filled; every configuration gets the very same
requests. Random streams are seeded by name, so changing one setting (say
the output lengths) leaves the others' draws (the prompts) unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from random import Random
from typing import Any

from kvpush_lab.bench.config import BenchConfig
from kvpush_lab.bench.lengths import LengthSpec

WARMUP_POINT = -1
FRESH, CHURNED = 0.0, 1.0  # the fragmented workload's two points, on axis cache


@dataclass(frozen=True)
class RequestSpec:
    """One request: its id, exact prompt tokens, output length, arrival."""

    index: int
    bench_id: str
    prompt: tuple[int, ...]
    output_len: int
    arrival_s: float = 0.0  # offset from the point's start (Poisson only)
    session: str | None = None  # sent as x-session-id (conversations)
    turn: int | None = None  # a conversation's turn, from 1
    wants_token_ids: bool = False  # ask for the answer's token ids
    abort_after_tokens: int | None = None  # the client hangs up after so many

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def body(self) -> dict[str, Any]:
        """The streaming /v1/completions body."""
        body: dict[str, Any] = {
            "prompt": list(self.prompt),
            "max_tokens": self.output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.wants_token_ids:
            body["return_token_ids"] = True
        return body


@dataclass(frozen=True)
class SweepPoint:
    """One load (or prompt length) at which every configuration is measured."""

    index: int
    axis: str  # qps | concurrency | prompt_len | turn | cache | churn
    x: float  # the value on that axis
    arrival: str  # poisson | concurrency
    load: float  # requests/s (poisson) or requests in flight (concurrency)
    prompt_len: LengthSpec

    @property
    def label(self) -> str:
        if self.axis == "prompt_len":
            return f"prompt {int(self.x)}"
        if self.axis == "turn":
            return "turn 1" if self.x == 1 else f"turns {int(self.x)}+"
        if self.axis == "cache":
            return "fresh cache" if self.x == FRESH else "after churn"
        if self.axis == "churn":
            return "churn (aborts count as errors)"
        return f"qps {self.x:g}" if self.axis == "qps" else f"concurrency {self.x:g}"

    @property
    def concurrency(self) -> int:
        return int(self.load)


@dataclass(frozen=True)
class PointWorkload:
    """A point's requests; or, where they are made as the run goes (a
    conversation's later turns), only how many are planned."""

    point: SweepPoint
    requests: tuple[RequestSpec, ...] = field(default_factory=tuple)
    num_planned: int = 0

    @property
    def num_requests(self) -> int:
        return len(self.requests) or self.num_planned


@dataclass(frozen=True)
class Traces:
    """Lengths read from trace files (empty when no trace is used)."""

    prompt_lens: tuple[int, ...] = ()
    output_lens: tuple[int, ...] = ()


def sweep_points(config: BenchConfig) -> list[SweepPoint]:
    """The points in the order they run."""
    arrival, loads = config.arrival, config.loads
    if config.workload == "fragmented":  # the same load before and after a churn
        return [
            SweepPoint(i, "cache", x, arrival, loads[0], config.prompt_spec)
            for i, x in enumerate((FRESH, CHURNED))
        ]
    if config.prompt_len_sweep:
        return [
            SweepPoint(i, "prompt_len", n, arrival, loads[0], LengthSpec.parse(str(n)))
            for i, n in enumerate(config.prompt_len_sweep)
        ]
    return [
        SweepPoint(i, config.arrival_key, load, arrival, load, config.prompt_spec)
        for i, load in enumerate(loads)
    ]


def rng_for(seed: int, *names: object) -> Random:
    """An independent random stream named by ``names`` (stable across runs)."""
    return Random("/".join(["kvpush-bench", str(seed), *map(str, names)]))


def random_tokens(num: int, vocab: Sequence[int], rng: Random) -> list[int]:
    return [vocab[rng.randrange(len(vocab))] for _ in range(num)]


def poisson_offsets(num: int, qps: float, rng: Random) -> list[float]:
    """Send times of a Poisson process at ``qps``: the first at 0, then
    exponential gaps of mean ``1/qps``."""
    offsets, now = [], 0.0
    for i in range(num):
        if i:
            now += rng.expovariate(qps)
        offsets.append(now)
    return offsets


def build_point(
    config: BenchConfig,
    point: SweepPoint,
    vocab: Sequence[int],
    traces: Traces,
    salt: str = "",
) -> PointWorkload:
    """The requests of one sweep point. A ``salt`` draws token ids of its
    own (lengths and arrivals unchanged): for configurations that share
    instances and must not hit each other's prefix cache."""
    num, seed, tag = config.num_requests, config.seed, point.index
    prompt_lens = point.prompt_len.sample(
        num, rng_for(seed, tag, "prompt_len"), traces.prompt_lens
    )
    output_lens = config.output_spec.sample(
        num, rng_for(seed, tag, "output_len"), traces.output_lens
    )
    prompts = make_prompts(
        prompt_lens,
        vocab,
        config.shared_prefix_fraction,
        rng_for(seed, tag, "tokens", salt) if salt else rng_for(seed, tag, "tokens"),
    )
    arrivals = (
        poisson_offsets(num, point.load, rng_for(seed, tag, "arrivals"))
        if point.arrival == "poisson"
        else [0.0] * num
    )
    requests = tuple(
        RequestSpec(i, f"kvb-{tag}-{i}", prompt, out, at)
        for i, (prompt, out, at) in enumerate(
            zip(prompts, output_lens, arrivals, strict=True)
        )
    )
    return PointWorkload(point, requests)


def make_prompts(
    lengths: Sequence[int], vocab: Sequence[int], shared_fraction: float, rng: Random
) -> list[tuple[int, ...]]:
    """Prompts of exactly ``lengths`` tokens; the first
    ``round(shared_fraction * length)`` tokens of each come from one prefix
    common to all of them."""
    if not vocab:
        raise ValueError("the tokenizer has no normal (non-special) tokens")
    prefix = random_tokens(max(lengths, default=0), vocab, rng)
    prompts = []
    for length in lengths:
        shared = round(shared_fraction * length)
        tail = random_tokens(length - shared, vocab, rng)
        prompts.append(tuple(prefix[:shared] + tail))
    return prompts


def build_warmup(
    config: BenchConfig, points: Sequence[PointWorkload], vocab: Sequence[int]
) -> PointWorkload:
    """``num_warmup`` requests shaped like the first point's first requests,
    with prompts of their own (the warm-up must not fill the prefix cache
    for measured requests)."""
    first = points[0]
    shapes = [first.requests[i % len(first.requests)] for i in range(config.num_warmup)]
    rng = rng_for(config.seed, "warmup", "tokens")
    requests = tuple(
        RequestSpec(
            i,
            f"kvb-w-{i}",
            tuple(random_tokens(s.prompt_len, vocab, rng)),
            s.output_len,
        )
        for i, s in enumerate(shapes)
    )
    warm_point = SweepPoint(
        WARMUP_POINT, "warmup", 0.0, "concurrency", 1.0, first.point.prompt_len
    )
    return PointWorkload(warm_point, requests)


def check_fits(workloads: Sequence[PointWorkload], max_model_len: int) -> None:
    """Raise ValueError if a request (as drawn, e.g. from a trace) is too long."""
    for workload in workloads:
        for req in workload.requests:
            if req.prompt_len + req.output_len > max_model_len:
                raise ValueError(
                    f"request {req.bench_id}: prompt {req.prompt_len} + output "
                    f"{req.output_len} tokens exceed max_model_len {max_model_len}; "
                    "shorten the lengths or raise max_model_len"
                )
