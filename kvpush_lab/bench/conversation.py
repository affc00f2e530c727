"""The multi-turn workload: conversations whose turns extend each other.

Pure: every conversation is drawn from the seed (and a salt, see
:func:`build_conversations`) before anything runs. Turn 1's prompt is a
history of ``history_len`` token ids; turn *t+1*'s prompt is turn *t*'s
prompt, then turn *t*'s answer (the token ids the server generated, as a
chat server keeps its history), then a new user message of ``turn_len``
token ids (:func:`next_prompt`). Each conversation names itself with the
session id ``conv-<i>`` so a router can keep it on one decode.

Results fall into two points: every conversation's first turn (nothing
cached anywhere) and all later turns (the history is on some instance).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpush_lab.bench.config import BenchConfig
from kvpush_lab.bench.lengths import LengthSpec
from kvpush_lab.bench.workload import (
    WARMUP_POINT,
    PointWorkload,
    RequestSpec,
    SweepPoint,
    random_tokens,
    rng_for,
)

FIRST_TURN_POINT, LATER_TURNS_POINT = 0, 1


@dataclass(frozen=True)
class Conversation:
    """One conversation's drawn parts: its first prompt, the user message
    of each later turn and the answer length of every turn."""

    index: int
    history: tuple[int, ...]
    user_messages: tuple[tuple[int, ...], ...]  # turns 2..T
    output_lens: tuple[int, ...]  # turns 1..T

    @property
    def session(self) -> str:
        return f"conv-{self.index}"

    @property
    def num_turns(self) -> int:
        return len(self.output_lens)

    def request(self, turn: int, prompt: Sequence[int]) -> RequestSpec:
        """Turn ``turn``'s request (from 1), given its prompt."""
        if not 1 <= turn <= self.num_turns:
            raise ValueError(f"turn {turn} is not within 1..{self.num_turns}")
        later = self.num_turns - 1
        index = self.index if turn == 1 else self.index * later + turn - 2
        return RequestSpec(
            index=index,
            bench_id=f"kvb-c{self.index}-t{turn}",
            prompt=tuple(prompt),
            output_len=self.output_lens[turn - 1],
            session=self.session,
            turn=turn,
            wants_token_ids=turn < self.num_turns,
        )

    def prompt_after(
        self, turn: int, prompt: Sequence[int], answer: Sequence[int]
    ) -> tuple[int, ...]:
        """Turn ``turn + 1``'s prompt, from turn ``turn``'s prompt and answer."""
        return next_prompt(prompt, answer, self.user_messages[turn - 1])


def next_prompt(
    prompt: Sequence[int], answer: Sequence[int], user_message: Sequence[int]
) -> tuple[int, ...]:
    """The next turn's prompt: this one, its answer, the new user message."""
    return (*prompt, *answer, *user_message)


def point_of(spec: RequestSpec) -> int:
    """The point a turn's record belongs to."""
    return FIRST_TURN_POINT if spec.turn == 1 else LATER_TURNS_POINT


def build_conversations(
    config: BenchConfig, vocab: Sequence[int], salt: str = ""
) -> tuple[Conversation, ...]:
    """``num_conversations`` conversations of ``num_turns`` turns. ``salt``
    names an independent draw of token ids (the lengths stay the same), for
    configurations that share instances and must not hit each other's
    prefix cache."""
    if not vocab:
        raise ValueError("the tokenizer has no normal (non-special) tokens")
    out = []
    for i in range(config.num_conversations):
        tokens = rng_for(config.seed, "conversation", salt, i)
        lengths = rng_for(config.seed, "conversation", i, "output_len")
        history = random_tokens(config.history_len, vocab, tokens)
        messages = [
            tuple(random_tokens(config.turn_len, vocab, tokens))
            for _ in range(config.num_turns - 1)
        ]
        outputs = config.output_spec.sample(config.num_turns, lengths)
        out.append(Conversation(i, tuple(history), tuple(messages), tuple(outputs)))
    return tuple(out)


def turn_points(config: BenchConfig) -> tuple[PointWorkload, PointWorkload]:
    """The two points results fall into. Their requests are made as the
    conversations go (prompts hold the answers), so only counts are planned."""
    live, n = float(config.conversation_concurrency), config.num_conversations
    first = SweepPoint(
        FIRST_TURN_POINT, "turn", 1.0, "conversation", live,
        LengthSpec.parse(str(config.history_len)),
    )  # fmt: skip
    later = SweepPoint(
        LATER_TURNS_POINT, "turn", 2.0, "conversation", live,
        LengthSpec.parse(str(config.history_len)),
    )  # fmt: skip
    return (
        PointWorkload(first, num_planned=n),
        PointWorkload(later, num_planned=n * (config.num_turns - 1)),
    )


def build_warmup(config: BenchConfig, vocab: Sequence[int]) -> PointWorkload:
    """``num_warmup`` single requests shaped like a first turn, with token
    ids of their own (no session: they warm the transport, not a cache)."""
    rng = rng_for(config.seed, "warmup", "conversation")
    out = config.output_spec.sample(config.num_warmup, rng)
    requests = tuple(
        RequestSpec(
            i, f"kvb-w-{i}", tuple(random_tokens(config.history_len, vocab, rng)), n
        )
        for i, n in enumerate(out)
    )
    point = SweepPoint(
        WARMUP_POINT, "warmup", 0.0, "concurrency", 1.0,
        LengthSpec.parse(str(config.history_len)),
    )  # fmt: skip
    return PointWorkload(point, requests)
