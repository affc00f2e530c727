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

from kvpush.model.families import ATTENTION_KINDS

_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# transformers' names of a layer's kind (layer_types; Nemotron-H's
# layers_block_type names its Mamba2 layers, letter M, "mamba" or
# "linear_attention", as Qwen3-Next names its gated-delta-net ones)
_KINDS = {
    "full_attention": "full_attention",
    "attention": "full_attention",
    "sliding_attention": "sliding_attention",
    "mamba": "state",
    "linear_attention": "state",
    "conv": "state",  # LFM2's short convolution
}


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


def layer_kinds(config: dict[str, Any]) -> list[str]:
    """Each decoder layer's kind: ``full_attention``, ``sliding_attention``,
    ``state`` (Mamba2 or gated-delta-net: a per-request state) or ``other``
    (an MLP-only layer), from ``layer_types`` (Gemma 3, Qwen3-Next),
    Nemotron-H's ``layers_block_type``, else ``num_hidden_layers`` of full
    attention."""
    names = _layer_names(config)
    if not names:
        return ["full_attention"] * int(config["num_hidden_layers"])
    return [_KINDS.get(str(n), "other") for n in names]


def _layer_names(config: dict[str, Any]) -> list[Any]:
    """transformers' per-layer names: ``layer_types``, or Nemotron-H's
    ``layers_block_type``; empty when the config has neither."""
    return list(config.get("layer_types") or config.get("layers_block_type") or ())


def num_layers(config: dict[str, Any]) -> int:
    """The model's decoder layers."""
    return len(layer_kinds(config))


def is_mla(model_dir: Path) -> bool:
    """The model keeps MLA latents (its config names a ``kv_lora_rank``)."""
    text = text_config(model_dir)
    return text is not None and bool(text.get("kv_lora_rank"))


def has_state(model_dir: Path) -> bool:
    """The model has state layers (Mamba2, gated delta net: :func:`layer_kinds`;
    or Nemotron-H's ``hybrid_override_pattern`` letter M)."""
    text = text_config(model_dir)
    if text is None:
        return False
    pattern = text.get("hybrid_override_pattern") or ""
    states = (_KINDS.get(str(n)) == "state" for n in _layer_names(text))
    return "M" in str(pattern) or any(states)


def is_moe(model_dir: Path) -> bool:
    """The model has mixture-of-experts layers (its config counts experts)."""
    text = text_config(model_dir)
    return text is not None and any(text.get(k) for k in _EXPERT_KEYS)


def _values_per_token(config: dict[str, Any]) -> int:
    layers = sum(1 for k in layer_kinds(config) if k in ATTENTION_KINDS)
    if config.get("kv_lora_rank"):
        return layers * (int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"]))
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    return 2 * layers * kv_heads * head_dim


def pushed_bytes(
    model_dir: Path,
    dtype: str,
    num_tokens: int,
    block_size: int,
    ssm_dtype: str | None = None,
    kv_dtype: str | None = None,
) -> int:
    """The KV bytes decode keeps of a ``num_tokens`` prompt it holds none
    of, in ``block_size``-token blocks, with vLLM's hybrid KV-cache manager
    on: every block of a full-attention layer; of a sliding-window layer
    (``layer_types`` ``sliding_attention``, Gemma 3 and gpt-oss style) the
    blocks from the one holding the first token its window still reads
    for the next token (token ``num_tokens - sliding_window + 1``; one
    earlier where that is a block's first token) on.
    Each state layer's state once (:func:`state_bytes`; ``ssm_dtype``:
    vLLM's ``mamba_ssm_cache_dtype`` as the instance resolved it, which a
    platform may choose). Attention KV in ``kv_dtype`` (vLLM's
    ``--kv-cache-dtype``: ``fp8`` formats one byte a value; None or
    ``auto``: ``dtype``).
    What a push must write, no more (vLLM pads a last short group with
    unused layer slots, which a push also writes: not counted here)."""
    if num_tokens < 1 or block_size < 1:
        raise ValueError(f"num_tokens {num_tokens} and block_size {block_size}")
    config = text_config(model_dir)
    if config is None:
        raise ValueError(f"cannot read the KV shape of {model_dir}")
    per_token = kv_bytes_per_token(model_dir, dtype)
    if kv_dtype and kv_dtype.startswith("fp8"):
        per_token //= _ELEMENT_BYTES[dtype]  # one byte a value
    all_kinds = layer_kinds(config)
    kinds = [k for k in all_kinds if k in ATTENTION_KINDS]
    states = all_kinds.count("state")
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
    return kv + (states * state_bytes(config, dtype, ssm_dtype) if states else 0)


def state_bytes(
    config: dict[str, Any], dtype: str, ssm_dtype: str | None = None
) -> int:
    """One request's state in one state layer: its conv state, ``kernel -
    1`` columns of the conv's channels, in ``dtype``, and its recurrent
    state, in ``ssm_dtype`` (else the config's ``mamba_ssm_cache_dtype``;
    ``auto`` or unset: ``dtype``). Mamba2
    (Nemotron-H's keys): channels are the heads' values then B and C of
    every group, the SSM state ``head_dim x ssm_state_size`` per head.
    Gated delta net (Qwen3-Next's ``linear_*`` keys): channels are the
    keys twice (q and k) and the values, the state ``value dim x key dim``
    per value head. Short convolution (LFM2's ``conv_L_cache``): the
    conv state alone, over ``conv_dim`` channels."""
    if "conv_L_cache" in config:
        channels = int(config.get("conv_dim") or config["hidden_size"])
        kernel, recurrent = int(config["conv_L_cache"]), 0
    elif "linear_num_value_heads" in config:
        k_heads, k_dim = config["linear_num_key_heads"], config["linear_key_head_dim"]
        v_heads, v_dim = (
            config["linear_num_value_heads"],
            config["linear_value_head_dim"],
        )
        channels = 2 * int(k_heads) * int(k_dim) + int(v_heads) * int(v_dim)
        kernel = int(config["linear_conv_kernel_dim"])
        recurrent = int(v_heads) * int(v_dim) * int(k_dim)
    else:
        heads, head_dim = int(config["mamba_num_heads"]), int(config["mamba_head_dim"])
        groups, size = int(config["n_groups"]), int(config["ssm_state_size"])
        channels = heads * head_dim + 2 * groups * size
        kernel = int(config["conv_kernel"])
        recurrent = heads * head_dim * size
    ssm_dtype = ssm_dtype or config.get("mamba_ssm_cache_dtype") or dtype
    ssm_dtype = ssm_dtype if ssm_dtype in _ELEMENT_BYTES else dtype
    conv = channels * (kernel - 1) * _ELEMENT_BYTES[dtype]
    return conv + recurrent * _ELEMENT_BYTES[ssm_dtype]
