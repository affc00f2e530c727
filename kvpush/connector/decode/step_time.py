"""How long a lone decode step takes on this instance, measured: how long
an idle decode waits for prefill's first token
(:mod:`kvpush.connector.decode.first_token`).

Waiting for ``t1`` pays while it costs less than computing it, and
computing it is one step of a lone request (one token). So the wait is
that step's time, measured here rather than fixed: a few milliseconds for
a tiny model on a CPU, tens for a large one on a GPU. A step is timed from
the ``schedule()`` that made it to the ``update_from_output`` of its
result (the same object for both, so async scheduling, where the next
``schedule()`` comes before this step's output, times each step by its
own start). Only steps that ran exactly one token are lone steps; the
figure is their moving average, within :data:`FLOOR_S` and
:data:`CEILING_S`, and :data:`DEFAULT_S` until one was timed.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_S = 0.005  # before any lone step was timed: the tiny model's, here
FLOOR_S = 0.001
CEILING_S = 0.05  # no idle request waits longer than this for t1
WEIGHT = 0.2  # of the newest lone step in the moving average
MAX_PENDING = 64  # steps started and not yet ended that are remembered


class LoneStepTime:
    """The moving average of lone steps' wall time (one per scheduler)."""

    def __init__(self) -> None:
        self.seconds = DEFAULT_S
        self.timed = 0  # lone steps timed so far
        self._started: OrderedDict[int, float] = OrderedDict()

    def started(self, step: int, now: float) -> None:
        """Step ``step`` (the id of its scheduler output) was scheduled at
        ``now``."""
        self._started[step] = now
        while len(self._started) > MAX_PENDING:  # an output never ended
            self._started.popitem(last=False)

    def ended(self, step: int, num_tokens: int, now: float) -> None:
        """Step ``step``'s output came at ``now``; it ran ``num_tokens``."""
        start = self._started.pop(step, None)
        if start is None or num_tokens != 1:
            return
        took = min(max(now - start, FLOOR_S), CEILING_S)
        if self.timed == 0:
            self.seconds = took
        else:
            self.seconds += WEIGHT * (took - self.seconds)
        self.timed += 1
