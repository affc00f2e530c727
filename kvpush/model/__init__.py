"""Tiny, locally generated Qwen3 model used for kvpush tests and demos."""

from kvpush.model.make import ensure_model, is_complete, make_model
from kvpush.model.spec import ModelSpec, default_model_dir

__all__ = [
    "ModelSpec",
    "default_model_dir",
    "ensure_model",
    "is_complete",
    "make_model",
]
