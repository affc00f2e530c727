"""The :class:`ModelSpec` describing a tiny, locally generated model."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.model.corpus import DEFAULT_CORPUS_BYTES
from kvpush.model.families import FAMILIES, layers_problem

ALLOWED_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
SPEC_FILENAME = "kvpush_model.json"
SPEC_FORMAT_VERSION = 1

_POSITIVE_INT_FIELDS: tuple[str, ...] = (
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "corpus_bytes",
)

# Byte-level BPE always holds the 256 byte symbols plus the special tokens.
MIN_VOCAB_SIZE = 512


def default_model_dir(home: Path) -> Path:
    """Return the default model directory below a kvpush home directory."""
    return Path(home) / "models" / "tiny-qwen3"


@dataclass(frozen=True)
class ModelSpec:
    """Shape, initialisation and storage settings for the tiny model.

    Attributes:
        family: Architecture (:data:`kvpush.model.families.FAMILIES`):
            ``dense`` (Qwen3, the default), ``mla``, ``swa``, ``hybrid``,
            ``moe`` or ``gdn``.
        num_layers: Number of decoder layers.
        hidden_size: Width of the residual stream.
        num_heads: Number of attention (query) heads.
        num_kv_heads: Number of key/value heads; must divide ``num_heads``.
        head_dim: Size of each attention head.
        intermediate_size: Width of the MLP.
        vocab_size: Target vocabulary size of the trained tokenizer.
        max_position_embeddings: Longest sequence the config advertises.
        init_std: Standard deviation of the normal weight initialisation.
        seed: Seed for corpus generation and weight initialisation.
        dtype: Torch dtype name of the saved weights.
        corpus_bytes: Approximate size of the generated tokenizer training
            text; smaller values train faster (useful in tests).
    """

    num_layers: int = 2
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 4096
    max_position_embeddings: int = 8192
    init_std: float = 0.2
    seed: int = 0
    dtype: str = "float32"
    corpus_bytes: int = DEFAULT_CORPUS_BYTES
    family: str = "dense"

    def __post_init__(self) -> None:
        """Validate every field, raising ``ValueError`` with a fix hint."""
        for name in _POSITIVE_INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"ModelSpec.{name} must be a positive int, got {value!r}"
                )
        _validate_shapes(self)
        _validate_scalars(self)

    def to_dict(self) -> dict[str, Any]:
        """Return the spec as a plain JSON-serialisable dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        """Build a spec from :meth:`to_dict` output; unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(
                f"unknown ModelSpec fields {unknown}; remove them "
                f"(allowed: {sorted(names)})"
            )
        return cls(**data)

    def to_json(self) -> str:
        """Return a canonical JSON document (sorted keys, trailing newline)."""
        payload = {"format_version": SPEC_FORMAT_VERSION, "spec": self.to_dict()}
        return json.dumps(payload, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        """Parse a document produced by :meth:`to_json`."""
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"model spec is not valid JSON: {exc}") from exc
        if (
            not isinstance(payload, dict)
            or payload.get("format_version") != SPEC_FORMAT_VERSION
        ):
            raise ValueError(
                "model spec must be a JSON object with format_version "
                f"{SPEC_FORMAT_VERSION}"
            )
        spec = payload.get("spec")
        if not isinstance(spec, dict):
            raise ValueError("model spec JSON lacks a 'spec' object")
        return cls.from_dict(spec)


def _validate_shapes(spec: ModelSpec) -> None:
    """Check the relations between the integer shape fields."""
    if spec.num_heads % spec.num_kv_heads != 0:
        raise ValueError(
            f"ModelSpec.num_heads ({spec.num_heads}) must be a multiple of "
            f"num_kv_heads ({spec.num_kv_heads}); change one of them"
        )
    if spec.vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"ModelSpec.vocab_size must be at least {MIN_VOCAB_SIZE} "
            f"(256 byte tokens plus merges), got {spec.vocab_size}"
        )
    if spec.head_dim % 2 != 0:
        raise ValueError(
            f"ModelSpec.head_dim must be even (rotary embeddings), got {spec.head_dim}"
        )


def _validate_scalars(spec: ModelSpec) -> None:
    """Check init_std, seed and dtype."""
    std = spec.init_std
    if (
        isinstance(std, bool)
        or not isinstance(std, (int, float))
        or not 0 < std < float("inf")
    ):
        raise ValueError(
            f"ModelSpec.init_std must be a positive finite number, got {std!r}"
        )
    seed = spec.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"ModelSpec.seed must be a non-negative int, got {seed!r}")
    if spec.dtype not in ALLOWED_DTYPES:
        raise ValueError(
            f"ModelSpec.dtype must be one of {list(ALLOWED_DTYPES)}, got {spec.dtype!r}"
        )
    if spec.family not in FAMILIES:
        raise ValueError(
            f"ModelSpec.family must be one of {list(FAMILIES)}, got {spec.family!r}"
        )
    problem = layers_problem(spec.family, spec.num_layers)
    if problem is not None:
        raise ValueError(f"ModelSpec.num_layers {spec.num_layers}: {problem}")
