"""A model's shape, read from a Hugging Face ``config.json``: what the
projection needs to know about it (KV bytes per token, weight bytes,
prefill FLOPs, descriptors per transfer).

Two public configs are built in, their fields as published on the Hugging
Face hub: Qwen3-32B (the model of the published TTFT/TPOT result) and
Llama-3.3-70B (the model of the published fragmented-descriptor figures).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
REGIONS_PER_LAYER = 2  # K and V in separate tensors (vLLM's GPU attention backends)

BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-32b": {
        "num_hidden_layers": 64,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "llama-3.3-70b": {
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}


@dataclass(frozen=True)
class ModelShape:
    """The fields of a dense decoder-only transformer that the model uses."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in ELEMENT_BYTES:
            raise ValueError(
                f"unknown dtype {self.dtype!r}; known: {sorted(ELEMENT_BYTES)}"
            )
        counts = (self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim)
        if min(counts) < 1:
            raise ValueError(f"{self.name}: layers, heads and head_dim must be >= 1")

    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of every layer and KV head, one token."""
        per_layer = REGIONS_PER_LAYER * self.num_kv_heads * self.head_dim
        return self.num_layers * per_layer * self.element_bytes

    @property
    def num_params(self) -> int:
        """Weights: attention (q, k, v, o), gated MLP (3 matrices), embeddings.
        Norms and biases are left out (well under 0.1 %)."""
        q_dim = self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        attention = 2 * self.hidden_size * q_dim + 2 * self.hidden_size * kv_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        embeddings = self.vocab_size * self.hidden_size
        embeddings *= 1 if self.tied_embeddings else 2
        return self.num_layers * (attention + mlp) + embeddings

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.element_bytes

    def prefill_flops(self, num_tokens: int) -> float:
        """One causal forward over ``num_tokens``: 2 FLOPs per weight and
        token, plus the attention scores and their weighted sum (causal:
        half of ``n^2``, two matmuls of ``2 n^2 d / 2`` each, per layer)."""
        dense = 2.0 * self.num_params * num_tokens
        attention_dim = self.num_heads * self.head_dim
        attention = 2.0 * self.num_layers * num_tokens**2 * attention_dim
        return dense + attention

    def descriptors(self, num_runs: int) -> int:
        """NIXL descriptors of one transfer whose blocks form ``num_runs``
        runs contiguous on both sides: one per run, layer and region (the
        published 18,880 for Llama-3.3-70B is 118 blocks x 80 layers x 2)."""
        return num_runs * self.num_layers * REGIONS_PER_LAYER

    @classmethod
    def from_hf_config(cls, name: str, config: Mapping[str, Any]) -> ModelShape:
        """From a ``config.json``'s fields (``head_dim`` defaults to
        ``hidden_size / num_attention_heads``, KV heads to attention heads,
        the dtype to ``torch_dtype`` or bfloat16)."""
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            return cls(
                name=name,
                num_layers=int(config["num_hidden_layers"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads", heads)),
                head_dim=int(config.get("head_dim") or hidden // heads),
                vocab_size=int(config["vocab_size"]),
                tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                dtype=str(config.get("torch_dtype") or "bfloat16"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"cannot read the shape of {name}: {e}") from e


def load_shape(model: str) -> ModelShape:
    """A built-in model by name, or a ``config.json`` (or a directory
    holding one) by path."""
    if model in BUILTIN_CONFIGS:
        return ModelShape.from_hf_config(model, BUILTIN_CONFIGS[model])
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"--model {model!r}: not a built-in model ({', '.join(BUILTIN_CONFIGS)}) "
            "nor a config.json or a directory holding one"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    return ModelShape.from_hf_config(str(path.parent.name or path), config)
