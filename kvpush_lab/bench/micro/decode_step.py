"""Part d: what decode's NIXL progress thread costs an engine step.

A stand-in engine step (pure Python, holding the GIL as a model runner's
scheduling and input preparation do) is timed in one process, with decode's
:class:`~kvpush.connector.decode.progress.Progress` thread in three states:

* ``none``: no thread (a decode without kvpush's connector);
* ``idle``: the thread with no receive awaited (what an idle pair, or a
  decode between transfers, runs: it sleeps on an event);
* ``polling``: the thread reading a real NIXL agent (UCX, no progress
  thread of NIXL's own) every millisecond, as it does while a receive is
  awaited.

Rounds are interleaved (each round times the three states in turn) and
each state's step time is the median of its steps in that round; the
ratios to ``none`` are taken within a round and summarised over rounds.
Measurements of this machine, never assertions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvpush.connector.counters import Counters
from kvpush.connector.decode.progress import Progress
from kvpush_lab.bench.micro.stats import Spread

STATES = ("none", "idle", "polling")
STEP_WORK = 20_000  # loop iterations of the stand-in step (~1-2 ms here)
SETTLE_S = 0.05  # after the thread changed state, before timing


@dataclass(frozen=True)
class StepTiming:
    """One state's step time over rounds (ms) and its ratio to ``none``."""

    state: str
    step_ms: Spread  # the per-round medians
    ratio_to_none: Spread  # per round: this state's median / none's


def stand_in_step(work: int = STEP_WORK) -> int:
    """Pure-Python work that holds the GIL throughout, like the Python
    part of an engine step."""
    total = 0
    for i in range(work):
        total += i * i % 7
    return total


class _RealNotifications:
    """A real NIXL agent whose notifications the thread reads (nothing is
    ever sent to it: each read finds none, as on an idle decode)."""

    def __init__(self) -> None:
        from kvpush.nixl_build import nixl_api

        api = nixl_api()
        nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent: Any = nixl_agent("kvpush-bench-decode", config)

    def notifications(self) -> list[bytes]:
        notifs = self._agent.get_new_notifs()
        return [m for msgs in notifs.values() for m in msgs]


def _time_steps(steps: int, step: Callable[[], object]) -> float:
    """Median seconds of ``steps`` calls of ``step``."""
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure_decode_step(
    rounds: int, steps: int, source: Any = None, work: int = STEP_WORK
) -> list[StepTiming]:
    """Per state, the step time over ``rounds`` interleaved rounds of
    ``steps`` steps each (``source``: what the thread reads; a real NIXL
    agent by default)."""
    if rounds < 1 or steps < 1:
        raise ValueError("rounds and steps must be >= 1")
    source = source if source is not None else _RealNotifications()
    per_state: dict[str, list[float]] = {s: [] for s in STATES}
    ratios: dict[str, list[float]] = {s: [] for s in STATES}
    for _ in range(rounds):
        medians = {}
        for state in STATES:
            progress = None
            if state != "none":
                progress = Progress(source, Counters())
                progress.want(state == "polling")
            try:
                time.sleep(SETTLE_S)
                medians[state] = _time_steps(steps, lambda: stand_in_step(work))
            finally:
                if progress is not None and not progress.close():
                    raise RuntimeError("the progress thread did not stop")
        for state in STATES:
            per_state[state].append(medians[state])
            ratios[state].append(medians[state] / medians["none"])
    return [
        StepTiming(s, Spread.of(per_state[s]).scaled(1e3), Spread.of(ratios[s]))
        for s in STATES
    ]


def render(timings: list[StepTiming]) -> str:
    lines = [
        "| decode's progress thread | step p50 ms, median [min-max] over rounds "
        "| ratio to no thread |",
        "|---|---|---|",
    ]
    for t in timings:
        s, r = t.step_ms, t.ratio_to_none
        lines.append(
            f"| {t.state} | {s.median:.3f} [{s.low:.3f}-{s.high:.3f}] "
            f"| {r.median:.3f} [{r.low:.3f}-{r.high:.3f}] |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvpush_lab.bench.micro.decode_step",
        description="decode step time with kvpush's NIXL progress thread "
        "absent, idle and polling (interleaved rounds)",
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=500, help="steps per state a round")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    timings = measure_decode_step(args.rounds, args.steps)
    print(render(timings))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(t) for t in timings], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
