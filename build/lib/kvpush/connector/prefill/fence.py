"""Whether the device work that wrote a step's KV has finished.

On vLLM's CPU backend the forward is synchronous: when ``wait_for_save``
runs, the KV is in memory (:class:`NoFence`). On an accelerator the forward
is only enqueued; the worker records an event right after it
(:func:`record_fence`) and the writer thread asks the event, on each of its
ticks, whether it has completed (:class:`EventFence`). Nothing ever blocks
on an event: one transfer's slow forward must not stall another's WRITE.

Pushed per layer (``--push-granularity layer``, or ``auto`` for a large
chunk), a forward's KV becomes ready layer by layer: the worker records one
fence per layer in ``save_kv_layer``, right after that layer's attention
wrote its KV, and one for the whole forward in ``wait_for_save``; the
writer collects them in a :class:`LayerFences` (see there).

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


NO_FENCE = NoFence()  # stateless: one for every synchronous forward

ALL_LAYERS = -1  # LayerFences.saved: the whole forward ended


class LayerFences:
    """One forward's KV, layer by layer: which leading layers are written.

    Made by the worker's main thread before the forward (at
    ``bind_connector_metadata``) and handed, with the chunks that forward
    computes, to the writer thread, which owns it from then on: the main
    thread only names it in the writer's inbox events (one per layer saved,
    and one at ``wait_for_save`` for the whole forward, which also covers
    any layer whose ``save_kv_layer`` never came). Layers count as ready as
    a prefix (layer ``L`` once ``0..L`` are): decoder models run their
    layers in order, and a layer saved out of order only waits for the
    ones before it (or the forward's end)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._fences: dict[int, ReadyFence] = {}
        self._whole: ReadyFence | None = None
        self._num_ready = 0

    def saved(self, layer: int, fence: ReadyFence) -> None:
        """Layer ``layer``'s KV is written once ``fence`` says so
        (``ALL_LAYERS``: every layer's; the forward ended). Writer thread."""
        if layer == ALL_LAYERS:
            self._whole = fence
        elif 0 <= layer < self.num_layers:
            self._fences.setdefault(layer, fence)

    def num_ready(self) -> int:
        """How many leading layers are written (never blocks)."""
        if self._num_ready < self.num_layers:
            if self._whole is not None and self._whole.is_ready():
                self._num_ready = self.num_layers
            while self._num_ready < self.num_layers:
                fence = self._fences.get(self._num_ready)
                if fence is None or not fence.is_ready():
                    break
                self._num_ready += 1
        return self._num_ready

    def is_ready(self) -> bool:
        return self.num_ready() == self.num_layers

    def waits_on_device(self) -> bool:
        """Whether the next layer is only waiting for device work (the
        writer polls) rather than for the next inbox event (it sleeps)."""
        if self.is_ready():
            return False
        return self._whole is not None or self._num_ready in self._fences


def record_fence(device_type: str) -> ReadyFence:
    """Called on the worker's main thread right after the forward (or,
    pushed per layer, right after one layer's attention)."""
    if device_type == "cpu":
        return NO_FENCE
    import torch

    module = getattr(torch, device_type)  # torch.cuda, torch.xpu, ...
    event = module.Event()
    event.record()
    return EventFence(event)
