"""Scores of candidate instances and the pick among them."""

from __future__ import annotations

import random

import pytest

from kvpush.router.scoring import (
    MIB,
    Load,
    ScoreWeights,
    decode_score,
    pick,
    prefill_score,
    queue_score,
    transfer_score,
)
from kvpush.router.signals import InstanceSignals, PairFigures

W = ScoreWeights()


def _load(in_flight: int = 0, waiting: int = 0, running: int = 0, kv: float = 0.0):
    return Load(in_flight, InstanceSignals(waiting, running, kv, read_at=0.0))


def test_an_unknown_instance_never_scores_as_idle() -> None:
    unknown = Load(num_in_flight=0, signals=None)
    assert queue_score(unknown, W) > queue_score(_load(), W)
    assert decode_score(unknown, 0.0, 0.0, W) > decode_score(_load(), 0.0, 0.0, W)


def test_the_queue_counts_the_router_legs_or_the_instance_whichever_is_more() -> None:
    assert queue_score(_load(in_flight=3, running=1), W) == 3
    assert queue_score(_load(in_flight=1, running=4), W) == 4
    assert queue_score(_load(waiting=2), W) == 2 + W.waiting * 2


def test_a_nearly_full_kv_cache_is_avoided_for_decode() -> None:
    full = decode_score(_load(kv=0.96), 0.0, 0.0, W)
    busy = decode_score(_load(running=20), 0.0, 0.0, W)
    assert full > busy


def test_transfer_cost_and_prefix_move_the_score() -> None:
    slow = PairFigures(handover_s=0.05, bytes_in_flight=64 * MIB)
    assert prefill_score(_load(), slow, W) == pytest.approx(
        W.handover_per_s * 0.05 + W.in_flight_per_mib * 64
    )
    assert prefill_score(_load(), None, W) == 0
    # not measured yet: the prefill's typical handover, not free
    assert transfer_score(None, W, 0.05) == pytest.approx(W.handover_per_s * 0.05)
    in_flight_only = PairFigures(handover_s=None, bytes_in_flight=MIB)
    assert transfer_score(in_flight_only, W, 0.05) == pytest.approx(
        W.handover_per_s * 0.05 + W.in_flight_per_mib
    )
    holds = decode_score(_load(running=2), 0.0, 1.0, W)
    empty = decode_score(_load(running=0), 0.0, 0.0, W)
    assert holds < empty  # holding the whole prompt outweighs two requests


def test_full_scan_picks_the_lowest_and_rotates_ties() -> None:
    names = ["a", "b", "c"]
    scores = {"a": 1.0, "b": 0.5, "c": 2.0}
    rng = random.Random(0)
    assert {pick(names, scores.__getitem__, t, rng) for t in range(6)} == {"b"}
    even = [pick(names, lambda _: 0.0, t, rng) for t in range(6)]
    assert even == ["a", "b", "c", "a", "b", "c"]  # equals take turns


def test_power_of_two_choices_above_the_full_scan_never_picks_the_worst() -> None:
    names = [f"i{k}" for k in range(10)]
    scores = {n: float(k) for k, n in enumerate(names)}
    rng = random.Random(7)
    picked = [
        pick(names, scores.__getitem__, t, rng, full_scan_max=4) for t in range(500)
    ]
    assert "i9" not in picked
    assert picked.count("i0") > picked.count("i8")
    assert len(set(picked)) > 3  # spread, not herded onto one


def test_pick_from_nothing_is_an_error() -> None:
    with pytest.raises(ValueError):
        pick([], lambda _: 0.0, 0, random.Random(0))
