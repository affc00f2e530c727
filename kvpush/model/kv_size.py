"""How many bytes of KV cache a model keeps per token, from its config.json.

Keys and values (2) for every layer and KV head: ``2 * layers * kv_heads *
head_dim * element size`` of the dtype it is served in. The tiny model (2
layers, 2 KV heads of 64, float32) keeps exactly 2048 bytes per token. An MLA
model keeps one latent (``kv_lora_rank + qk_rope_head_dim``) per layer
instead; a Nemotron-H hybrid keeps per-token KV only in its attention layers
(its Mamba layers keep a per-request state: :func:`state_bytes`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_ATTENTION_BLOCKS = ("attention", "full_attention")
# transformers' names of Nemotron-H's Mamba2 layers (its letter M)
_STATE_BLOCKS = ("mamba", "linear_attention")


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """KV bytes per token of the model in ``model_dir`` served as ``dtype``."""
    if dtype not in _ELEMENT_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_ELEMENT_BYTES)}")
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        values = _values_per_token(config)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read the KV shape of {model_dir}: {e}") from e
    return values * _ELEMENT_BYTES[dtype]


_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def text_config(model_dir: Path) -> dict[str, Any] | None:
    """The language model's part of ``model_dir``'s config.json (its
    ``text_config`` where it has one); None when there is no readable one
    (a hub id, a broken file)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config") or config
    return text if isinstance(text, dict) else None


def num_layers(config: dict[str, Any]) -> int:
    """The model's decoder layers (Nemotron-H names them in
    ``layers_block_type`` and has no ``num_hidden_layers``)."""
    blocks = config.get("layers_block_type")
    return len(blocks) if blocks else int(config["num_hidden_layers"])


def is_mla(model_dir: Path) -> bool:
    """The model keeps MLA latents (its config names a ``kv_lora_rank``)."""
    text = text_config(model_dir)
    return text is not None and bool(text.get("kv_lora_rank"))


def has_state(model_dir: Path) -> bool:
    """The model has Mamba-style state layers (Nemotron-H's
    ``hybrid_override_pattern`` letter M, or its ``layers_block_type``)."""
    text = text_config(model_dir)
    if text is None:
        return False
    pattern = text.get("hybrid_override_pattern") or ""
    blocks = text.get("layers_block_type") or ()
    return "M" in str(pattern) or any(b in _STATE_BLOCKS for b in blocks)


def is_moe(model_dir: Path) -> bool:
    """The model has mixture-of-experts layers (its config counts experts)."""
    text = text_config(model_dir)
    return text is not None and any(text.get(k) for k in _EXPERT_KEYS)


def _values_per_token(config: dict[str, Any]) -> int:
    blocks = config.get("layers_block_type")  # Nemotron-H: no num_hidden_layers
    if blocks:
        layers = sum(1 for b in blocks if b in _ATTENTION_BLOCKS)
    else:
        layers = int(config["num_hidden_layers"])
    if config.get("kv_lora_rank"):
        return layers * (int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"]))
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    return 2 * layers * kv_heads * head_dim


def pushed_bytes(model_dir: Path, dtype: str, num_tokens: int, block_size: int) -> int:
    """The KV bytes decode keeps of a ``num_tokens`` prompt it holds none
    of, in ``block_size``-token blocks, with vLLM's hybrid KV-cache manager
    on: every block of a full-attention layer; of a sliding-window layer
    (``layer_types`` ``sliding_attention``, Gemma 3 and gpt-oss style) the
    blocks from the one holding the first token its window still reads
    for the next token (token ``num_tokens - sliding_window + 1``; one
    earlier where that is a block's first token) on.
    What a push must write, no more (vLLM pads a last short group with
    unused layer slots, which a push also writes: not counted here)."""
    if num_tokens < 1 or block_size < 1:
        raise ValueError(f"num_tokens {num_tokens} and block_size {block_size}")
    config = text_config(model_dir)
    if config is None:
        raise ValueError(f"cannot read the KV shape of {model_dir}")
    per_token = kv_bytes_per_token(model_dir, dtype)
    blocks_types = config.get("layers_block_type") or ()
    kinds = config.get("layer_types") or ["full_attention"] * (
        sum(1 for b in blocks_types if b in _ATTENTION_BLOCKS)
        or int(config["num_hidden_layers"])
    )
    states = sum(1 for b in blocks_types if b in _STATE_BLOCKS)
    blocks = -(-num_tokens // block_size)
    window = config.get("sliding_window")
    skipped = 0 if not window else max(0, num_tokens - int(window) + 1)
    if skipped and skipped % block_size == 0:
        # decode loads all but the last token and computes that one itself,
        # its window reaching one block further back
        # (kvpush.connector.config.rewind_reads_a_skipped_block)
        skipped -= 1
    skipped //= block_size
    kept = [blocks - skipped if k == "sliding_attention" else blocks for k in kinds]
    kv = sum(kept) * block_size * per_token // len(kinds)
    return kv + (states * state_bytes(config, dtype) if states else 0)


def state_bytes(config: dict[str, Any], dtype: str) -> int:
    """One request's Mamba2 state in one state layer (Nemotron-H's config
    keys): the conv state, ``conv_kernel - 1`` columns of the conv's
    channels (the heads' values, then B and C of every group), in
    ``dtype``, and the SSM state, ``head_dim x ssm_state_size`` per head,
    in ``mamba_ssm_cache_dtype`` (``dtype`` when unset)."""
    heads, head_dim = int(config["mamba_num_heads"]), int(config["mamba_head_dim"])
    groups, size = int(config["n_groups"]), int(config["ssm_state_size"])
    conv = (heads * head_dim + 2 * groups * size) * (int(config["conv_kernel"]) - 1)
    ssm_dtype = config.get("mamba_ssm_cache_dtype") or dtype
    ssm_dtype = ssm_dtype if ssm_dtype in _ELEMENT_BYTES else dtype
    return (
        conv * _ELEMENT_BYTES[dtype]
        + heads * head_dim * size * _ELEMENT_BYTES[ssm_dtype]
    )
