"""Tiny, locally generated models (Qwen3 and one per family of
:mod:`kvpush.model.families`) used for kvpush tests and demos.

``make_model``, ``ensure_model`` and ``is_complete`` (``make.py``) need torch
and transformers, so they are imported on first use: the package itself, and
``presets``, stay light for the ``kvpush`` command's start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpush.model.spec import ModelSpec, default_model_dir

if TYPE_CHECKING:
    from kvpush.model.make import ensure_model, is_complete, make_model

__all__ = [
    "ModelSpec",
    "default_model_dir",
    "ensure_model",
    "is_complete",
    "make_model",
]
_FROM_MAKE = ("ensure_model", "is_complete", "make_model")


def __getattr__(name: str) -> Any:
    if name in _FROM_MAKE:
        from kvpush.model import make

        return getattr(make, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
