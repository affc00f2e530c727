"""Wait for the device work that wrote a step's KV before pushing it.

On vLLM's CPU backend the forward is synchronous: when ``wait_for_save``
runs, the KV is in memory (:class:`NoFence`). On an accelerator the forward
is only enqueued; the worker records an event right after it
(:func:`record_fence`) and the writer thread waits on that event, with a
deadline, before posting the WRITE (:class:`EventFence`).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

POLL_S = 50e-6


class ReadyFence(Protocol):
    def wait(self, timeout_s: float) -> bool:
        """True once the KV is written; False if ``timeout_s`` passed first."""
        ...


class NoFence:
    """The work is already complete (synchronous backends)."""

    def wait(self, timeout_s: float) -> bool:
        return True


class EventFence:
    """An accelerator event (anything with ``query() -> bool``), polled with
    short sleeps so that the waiting thread never spins a core."""

    def __init__(self, event: Any) -> None:
        self._event = event

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self._event.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True


def record_fence(device_type: str) -> ReadyFence:
    """Called on the worker's main thread right after the forward."""
    if device_type == "cpu":
        return NoFence()
    import torch

    module = getattr(torch, device_type)  # torch.cuda, torch.xpu, ...
    event = module.Event()
    event.record()
    return EventFence(event)
