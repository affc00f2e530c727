"""Whether the device work that wrote a step's KV has finished.

On vLLM's CPU backend the forward is synchronous: when ``wait_for_save``
runs, the KV is in memory (:class:`NoFence`). On an accelerator the forward
is only enqueued; the worker records an event right after it
(:func:`record_fence`) and the writer thread asks the event, on each of its
ticks, whether it has completed (:class:`EventFence`). Nothing ever blocks
on an event: one transfer's slow forward must not stall another's WRITE.

Only ``record()`` (at creation) and ``query()`` are used, which exist on
``torch.cuda.Event`` and on the other accelerators' event types
(``torch.xpu.Event``, ...).
"""

from __future__ import annotations

from typing import Any, Protocol


class ReadyFence(Protocol):
    def is_ready(self) -> bool:
        """True once the KV is written (never blocks)."""
        ...


class NoFence:
    """The work is already complete (synchronous backends)."""

    def is_ready(self) -> bool:
        return True


class EventFence:
    """An accelerator event recorded after the forward (anything with
    ``query() -> bool``); once it said True it is not asked again."""

    def __init__(self, event: Any) -> None:
        self._event = event
        self._ready = False

    def is_ready(self) -> bool:
        if not self._ready:
            self._ready = bool(self._event.query())
        return self._ready


def record_fence(device_type: str) -> ReadyFence:
    """Called on the worker's main thread right after the forward."""
    if device_type == "cpu":
        return NoFence()
    import torch

    module = getattr(torch, device_type)  # torch.cuda, torch.xpu, ...
    event = module.Event()
    event.record()
    return EventFence(event)
