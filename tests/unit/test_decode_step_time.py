"""A lone decode step's time, as the idle wait for prefill's first token
uses it (:mod:`kvpush.connector.decode.step_time`)."""

from __future__ import annotations

import pytest

from kvpush.connector.decode.step_time import (
    CEILING_S,
    DEFAULT_S,
    FLOOR_S,
    MAX_PENDING,
    WEIGHT,
    LoneStepTime,
)


def test_the_default_until_a_lone_step_was_timed() -> None:
    steps = LoneStepTime()
    steps.started(1, 10.0)
    steps.ended(1, num_tokens=64, now=10.2)  # a prefill chunk: not lone
    steps.ended(2, num_tokens=1, now=10.3)  # never started
    assert (steps.seconds, steps.timed) == (DEFAULT_S, 0)


def test_the_first_lone_step_then_a_moving_average() -> None:
    steps = LoneStepTime()
    steps.started(1, 10.0)
    steps.ended(1, num_tokens=1, now=10.020)
    assert steps.seconds == pytest.approx(0.020)
    steps.started(2, 11.0)
    steps.ended(2, num_tokens=1, now=11.030)
    assert steps.seconds == pytest.approx(0.020 + WEIGHT * 0.010)


def test_async_steps_are_timed_each_from_its_own_start() -> None:
    steps = LoneStepTime()
    steps.started(1, 10.000)
    steps.started(2, 10.004)  # scheduled before step 1's output came
    steps.ended(1, num_tokens=1, now=10.010)
    steps.ended(2, num_tokens=1, now=10.014)
    assert steps.seconds == pytest.approx(0.010)
    assert steps.timed == 2


def test_within_its_floor_and_ceiling() -> None:
    steps = LoneStepTime()
    steps.started(1, 10.0)
    steps.ended(1, num_tokens=1, now=12.0)  # a stall, not a step
    assert steps.seconds == CEILING_S
    fast = LoneStepTime()
    fast.started(1, 10.0)
    fast.ended(1, num_tokens=1, now=10.0)
    assert fast.seconds == FLOOR_S


def test_steps_whose_output_never_came_are_not_kept() -> None:
    steps = LoneStepTime()
    for step in range(MAX_PENDING + 10):
        steps.started(step, float(step))
    assert len(steps._started) == MAX_PENDING
    steps.ended(0, num_tokens=1, now=100.0)  # forgotten: not timed
    assert steps.timed == 0
