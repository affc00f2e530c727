"""Refuse, at start-up, every vLLM configuration kvpush cannot copy correctly.

kvpush copies a request's KV block for block: block ``b`` of every layer on
the prefill is written over block ``b'`` of the same layer on the decode.
That is only right when one block id names the same tokens in every layer,
each block is one contiguous chunk laid out identically on both sides, and
each worker rank's slice of it is copied by the same rank of the other side.
:func:`check_supported` checks the settings that decide this;
:func:`kvpush.connector.kv_memory.layout_of` checks the tensors themselves
once vLLM has allocated them.

Who calls it: the connector's constructor, in both roles: SCHEDULER in
EngineCore (``kv_cache_config`` is the scheduler's copy of worker 0's config)
and WORKER in each Worker (``kv_cache_config`` is that worker's own, passed
before the KV cache is allocated). It reads its arguments and changes nothing.

Accepted, and why the copy is right:

- PP, DCP and PCP all 1: each worker holds every layer and token of its
  own KV heads.
- Any DP size: each DP rank is an engine of its own, with its own KV cache,
  engine id (vLLM appends ``_dp<rank>``) and side-channel ports
  (:class:`~kvpush.connector.config.ConnectorConfig`): a transfer endpoint
  like an instance, and its TP ranks map as an instance's do.
- Any TP size: every worker rank is a transfer endpoint
  (:mod:`kvpush.transfer.ranks`). Equal TP sizes map rank ``r`` to rank
  ``r``; different ones map head slices (:mod:`kvpush.transfer.heads`)
  when the model's KV heads divide by both sizes (or both are multiples of
  them), in this LBHNC layout, without MLA. Neither side can know the
  other's TP size at start-up, so what remains unsupported is refused per
  pair: a decode serves locally a leg whose ``prefill_tp`` it cannot map,
  and prefill refuses a Hello (or Registration) it cannot map, or of
  another head count, with the reason (``rejected.incompatible``; decode
  falls back and counts ``receive_failed.incompatible``).
- KV-cache groups whose specs are exactly ``FullAttentionSpec``,
  ``MLAAttentionSpec`` (below) or ``SlidingWindowSpec``, at least one of
  them not windowed. kvpush supports vLLM's hybrid KV-cache manager, so a
  model with sliding-window layers beside full ones (Gemma 2/3, gpt-oss)
  has one group per kind of layer, each with its own block table, all
  aliasing one allocation (layer ``k`` of every group in slot ``k``,
  checked by :func:`kvpush.connector.kv_memory.layout_of`). A windowed
  group's table holds vLLM's null block where the window has let go of a
  block, on either side: a push writes exactly the blocks decode's tables
  keep (:func:`kvpush.transfer.groups.aligned`). With the manager off
  (``--disable-hybrid-kv-cache-manager``) windowed layers arrive as a
  ``FullAttentionSpec`` with ``sliding_window`` set, every block kept, and
  copy like full attention. Several groups push per chunk, never per
  layer (:mod:`kvpush.connector.config`); all-windowed models are refused.
- A cache dtype whose element size is known (:func:`kv_element_size`): the
  model's own, float16, bfloat16, float32, or a per-tensor-scaled fp8 (one
  byte; the scales are model constants, the same on both sides).
- The ``LBHNC`` layout (:data:`REQUIRED_KV_CACHE_LAYOUT`, vLLM's "HND"): each
  block is one contiguous ``[heads, tokens, K|V]`` chunk.
- MLA (``MLAAttentionSpec``: DeepSeek-V2/V3, Kimi-K2): one group whose cache
  holds one latent (``kv_lora_rank + qk_rope_head_dim`` values) per token
  and layer, every TP rank holding all of it. That is a one-head cache, so
  any token order is the same bytes (the layout check is skipped), and the
  TP mapping treats it as one KV head replicated on every rank: any pair of
  TP sizes maps, each decode rank written whole by one prefill rank
  (``total_kv_heads`` 1, :mod:`kvpush.connector.config`). Sparse or aligned
  MLA caches (DeepSeek-V3.2/V4's indexer, ``model_version`` set) and packed
  formats (``fp8_ds_mla``, refused by its cache dtype) are not mapped.

- Per-request states (``MambaSpec`` of :data:`MAPPED_STATES`: Mamba2,
  as Nemotron-H and Granite 4; gated delta net, as Qwen3-Next; short
  conv, as LFM2) beside full attention, in vLLM's mode 'none' (prefix
  caching off): each request's state is one page, its bytes copied once
  with the prompt's last block (``docs/design.md``, state groups); across
  TP sizes each decode rank takes its pieces of it
  (:mod:`kvpush.transfer.state_pages`), where the page can be described
  (:mod:`kvpush.connector.state_spec`), else equal TP sizes only.

Refused: anything else, with a message naming the setting and what to change.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvpush.connector.config import granularity_of
from kvpush.transfer import layout

# The one layout kvpush maps. vLLM asks the connector class for it
# (``get_required_kvcache_layout``) and uses it when the backends allow.
REQUIRED_KV_CACHE_LAYOUT = layout.REQUIRED_KV_CACHE_LAYOUT
_LAYOUT_ALIASES = {"HND": "LBHNC", "NHD": "LBNHC"}

# vLLM's --kv-cache-dtype strings that kvpush copies, by their element type
# (fp8 caches are stored as one-byte elements with per-tensor scales).
_CACHE_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
    "fp8": torch.uint8,
    "fp8_e4m3": torch.uint8,
    "fp8_e5m2": torch.uint8,
    "fp8_inc": torch.float8_e4m3fn,
}
_MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class UnsupportedConfig(ValueError):
    """A vLLM setting kvpush cannot serve correctly; the message says which
    setting and what to change."""


def check_supported(vllm_config: Any, kv_cache_config: Any) -> None:
    """Raise :class:`UnsupportedConfig` listing every unsupported setting of
    this instance, or return ``None`` when kvpush can serve it."""
    problems = [
        *_parallel_problems(vllm_config.parallel_config),
        *_dtype_problems(vllm_config),
        *_layout_problems(vllm_config.cache_config, kv_cache_config),
        *_group_problems(vllm_config, kv_cache_config),
    ]
    _refuse(problems)


def _refuse(problems: list[str]) -> None:
    if problems:
        raise UnsupportedConfig(
            "kvpush cannot serve this vLLM configuration:\n- " + "\n- ".join(problems)
        )


def check_model(vllm_config: Any) -> None:
    """Refuse, before vLLM groups the KV-cache layers, a model whose layers
    kvpush cannot copy: a hybrid model with Mamba-style state layers
    (refused here, where the model is known, rather than later by its
    ``MambaSpec`` groups)."""
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    if getattr(model, "is_hybrid", False) is True and (
        getattr(cache, "enable_prefix_caching", False) is not False
    ):
        _refuse([
            f"model {getattr(model, 'model', '?')}: a hybrid model with prefix "
            "caching on keeps Mamba state checkpoints per block; kvpush copies "
            "the one running state: run with --no-enable-prefix-caching"
        ])  # fmt: skip


def kv_element_size(cache_dtype: str, model_dtype: torch.dtype) -> int:
    """Bytes per element of a KV cache stored as ``--kv-cache-dtype
    cache_dtype`` ("auto": the model's dtype); :class:`UnsupportedConfig` for
    a format kvpush does not copy."""
    return kv_storage_dtype(cache_dtype, model_dtype).itemsize


def kv_storage_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype vLLM stores a ``cache_dtype`` KV cache in."""
    if cache_dtype == "auto":
        if model_dtype not in _MODEL_DTYPES:
            raise UnsupportedConfig(
                f"--dtype {model_dtype} with --kv-cache-dtype auto: kvpush copies "
                "float16, bfloat16 and float32 caches; set --kv-cache-dtype"
            )
        return model_dtype
    if cache_dtype in _CACHE_DTYPES:
        return _CACHE_DTYPES[cache_dtype]
    raise UnsupportedConfig(
        f"--kv-cache-dtype {cache_dtype}: kvpush copies only caches of known "
        f"element size ({', '.join(['auto', *_CACHE_DTYPES])}); packed or "
        "per-token-scaled formats are not mapped. Use one of those."
    )


def _parallel_problems(parallel: Any) -> list[str]:
    sizes = {
        "PP": ("--pipeline-parallel-size", parallel.pipeline_parallel_size),
        "DCP": (
            "--decode-context-parallel-size",
            parallel.decode_context_parallel_size,
        ),
        "PCP": (
            "--prefill-context-parallel-size",
            parallel.prefill_context_parallel_size,
        ),
    }
    problems = [
        f"{flag} {size}: kvpush supports {name} 1 only until it is designed "
        f"(each worker must hold every layer and token of its heads); run "
        f"with {flag} 1"
        for name, (flag, size) in sizes.items()
        if size != 1
    ]
    return problems


def _dtype_problems(vllm_config: Any) -> list[str]:
    cache = vllm_config.cache_config
    try:
        kv_storage_dtype(cache.cache_dtype, vllm_config.model_config.dtype)
    except UnsupportedConfig as e:
        return [str(e)]
    if cache.cache_dtype != "auto" and cache.kv_cache_dtype_skip_layers:
        return [
            f"--kv-cache-dtype-skip-layers {cache.kv_cache_dtype_skip_layers}: "
            "kvpush needs every layer's cache in one dtype; drop that option"
        ]
    return []


def _layout_problems(cache_config: Any, kv_cache_config: Any) -> list[str]:
    name = getattr(kv_cache_config, "kv_cache_layout", None) or (
        cache_config.kv_cache_layout
    )
    if name is None:  # not resolved yet: layout_of checks the tensors
        return []
    if _is_latent(kv_cache_config):  # one head: HND and NHD are the same bytes
        return []
    if _LAYOUT_ALIASES.get(name, name) == REQUIRED_KV_CACHE_LAYOUT:
        return []
    return [
        f"KV cache layout {name} (VLLM_KV_CACHE_LAYOUT or the attention "
        f"backend's choice): kvpush maps {REQUIRED_KV_CACHE_LAYOUT} (HND) only, "
        "where each block is one contiguous chunk; set "
        f"VLLM_KV_CACHE_LAYOUT={REQUIRED_KV_CACHE_LAYOUT} with a backend that "
        "supports it"
    ]


def _group_problems(vllm_config: Any, kv_cache_config: Any) -> list[str]:
    if kv_cache_config is None:
        return [
            "vLLM passed the connector no kv_cache_config, so kvpush cannot check "
            "the KV cache; use the vLLM version kvpush is built for"
        ]
    groups = kv_cache_config.kv_cache_groups
    specs = [g.kv_cache_spec for g in groups]
    refused = [r for r in map(_refused_kind, specs) if r is not None]
    if refused or not groups:
        return [_groups_problem(specs) if len(groups) != 1 else refused[0]]
    problems = [p for spec in specs for p in _spec_problems(spec, vllm_config)]
    if any(g.host_resident or not g.enable_kv_transfer for g in groups):
        problems.append(
            "a KV-cache group is host-resident or excluded from KV transfer; "
            "kvpush copies only transferable device groups"
        )
    states = [s for s in specs if type(s) is MambaSpec]
    if states and any(
        type(s) is not FullAttentionSpec for s in specs if s not in states
    ):
        problems.append(
            "Mamba state beside sliding-window or MLA layers is not mapped by "
            "kvpush (a windowed prompt may load all but its last token, which "
            "a loaded state must not see again); serve a model without them"
        )
    if not any(isinstance(s, FullAttentionSpec | MLAAttentionSpec) for s in specs):
        problems.append(
            f"KV-cache groups {', '.join(type(s).__name__ for s in specs)}: no "
            "full-attention or MLA layer (every layer windowed or state); "
            "kvpush maps models with at least one, serve one or, for windows, "
            "turn vLLM's hybrid KV-cache manager off "
            "(--disable-hybrid-kv-cache-manager: every block kept)"
        )
    granularity = granularity_of(
        getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None)
        if getattr(vllm_config, "kv_transfer_config", None) is not None
        else None
    )
    if len(groups) > 1 and granularity == "layer":
        problems.append(
            f"push_granularity layer with {len(groups)} KV-cache groups: the "
            "groups share each layer's tensor, so no one layer's attention "
            "completes it; use auto or chunk (both push per chunk here)"
        )
    return problems


def _spec_problems(spec: Any, vllm_config: Any) -> list[str]:
    kind = _refused_kind(spec)
    if kind is not None:
        return [kind]
    if type(spec) is MambaSpec:  # one page a request: no tokens, no dtype
        return []
    cache_config = vllm_config.cache_config
    problems = []
    if spec.block_size != cache_config.block_size:
        problems.append(
            f"--block-size {cache_config.block_size} but the KV cache uses "
            f"{spec.block_size}-token blocks: kvpush needs them equal; set "
            f"--block-size {spec.block_size}"
        )
    if (
        spec.page_size_padded is not None
        or spec.num_head_slots is not None
        or spec.state_content_bytes is not None
        or spec.tokens_per_state != 1
    ):
        problems.append(
            f"{type(spec).__name__} with padded or packed pages: kvpush maps "
            "dense [heads, tokens, K|V] blocks only"
        )
    try:
        expected = kv_storage_dtype(
            cache_config.cache_dtype, vllm_config.model_config.dtype
        )
    except UnsupportedConfig:
        return problems  # reported by _dtype_problems
    if spec.dtype.itemsize != expected.itemsize:
        problems.append(
            f"--kv-cache-dtype {cache_config.cache_dtype} means {expected} but the "
            f"KV cache is {spec.dtype}; kvpush cannot tell the element size"
        )
    return problems


def _groups_problem(specs: list[Any]) -> str:
    """Why several KV-cache groups (or none) cannot be copied, naming the
    model family the first non-full-attention group belongs to."""
    kinds = ", ".join(type(s).__name__ for s in specs) or "none"
    head = (
        f"{len(specs)} KV-cache groups ({kinds}): kvpush maps groups of full "
        "attention, MLA and sliding-window attention"
    )
    reasons = (_refused_kind(s) for s in specs)
    reason = next((r for r in reasons if r is not None), None)
    if reason is None:
        return (
            f"{head}; layers with mixed page sizes or separate draft layers are "
            "not mapped yet, serve a model without them"
        )
    return f"{head}; {reason}"


def _is_latent(kv_cache_config: Any) -> bool:
    """The instance's one KV-cache group is MLA's latent cache."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return len(groups) == 1 and isinstance(groups[0].kv_cache_spec, MLAAttentionSpec)


_MAMBA_REASON = (
    "per-request states of this kind are not mapped by kvpush; the "
    "MambaSpec states of Mamba2 (Nemotron-H) and gated delta net "
    "(Qwen3-Next) are, serve a model without them"
)


# Per-request states kvpush copies (vLLM's MambaAttentionBackendEnum names):
# each run on a cluster here (docs/model-families.md).
MAPPED_STATES: tuple[str, ...] = ("MAMBA2", "GDN_ATTN", "SHORT_CONV")


def _state_problem(spec: Any) -> str | None:
    """Why a Mamba layer's per-request state cannot be copied whole, once,
    as one page a request, or None (``docs/design.md``, state groups)."""
    name = f"MambaSpec layers: {spec.mamba_type.name} state, "
    if spec.mamba_type.name not in MAPPED_STATES:
        return name + (
            "only Mamba2 (Nemotron-H, Granite 4, Zamba 2), gated-delta-net "
            "(Qwen3-Next, Qwen3.5) and short-conv (LFM2) states are mapped by "
            "kvpush; linear-attention and Mamba1 states are not (vLLM's CPU "
            "build runs neither, so kvpush could not test them), serve a "
            "model without them"
        )
    if spec.mamba_cache_mode != "none":
        return name + (
            f"mamba cache mode {spec.mamba_cache_mode!r} (prefix caching on) "
            "keeps state checkpoints per block; kvpush copies the one running "
            "state: run with --no-enable-prefix-caching"
        )
    if spec.num_speculative_blocks:  # (prefill checkpoints: 'align' only)
        return name + (
            "speculative state blocks are not mapped by kvpush; run without "
            "speculative decoding"
        )
    return None


def _refused_kind(spec: Any) -> str | None:
    """Why layers of this spec cannot be copied block for block, naming the
    model family, or None."""
    name = f"{type(spec).__name__} layers: "
    if isinstance(spec, MLAAttentionSpec):
        if spec.model_version is not None or spec.alignment is not None:
            return name + (
                f"sparse or aligned MLA caches (model_version "
                f"{spec.model_version!r}, alignment {spec.alignment}: "
                "DeepSeek-V3.2/V4-style indexer caches) are not mapped by kvpush; "
                "serve a model with plain MLA (DeepSeek-V2/V3, Kimi-K2) or GQA"
            )
        if type(spec) is MLAAttentionSpec:
            return None  # one latent "head" per token, copied whole (module doc)
    if type(spec) is SlidingWindowSpec:
        return None  # copied as decode's table keeps it (null blocks left out)
    if isinstance(spec, SlidingWindowSpec | ChunkedLocalAttentionSpec):
        return name + (
            "chunked local attention (Llama 4-style) and other windowed "
            "variants are not mapped by kvpush; plain sliding windows are"
        )
    if type(spec) is MambaSpec:
        return _state_problem(spec)
    if isinstance(spec, MambaSpec):
        return name + _MAMBA_REASON
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return name + "layers with different KV shapes are not mapped by kvpush"
    if type(spec) is not FullAttentionSpec:
        return name + (
            "only plain full attention (FullAttentionSpec) or MLA "
            "(MLAAttentionSpec) is mapped by kvpush"
        )
    return None
