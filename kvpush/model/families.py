"""Hugging Face configs for each model family kvpush makes tiny copies of.

A family is an architecture with its own KV-cache shape in vLLM:

- ``dense``: Qwen3 (``Qwen3ForCausalLM``), grouped-query full attention;
  the tiny and kv-heavy models.
- ``mla``: DeepSeek-V2 (``DeepseekV2ForCausalLM``), multi-head latent
  attention: one latent (``kv_lora_rank`` + ``qk_rope_head_dim`` values) per
  token and layer instead of per-head keys and values; one dense layer, then
  MoE layers with a few routed experts and one shared expert. vLLM's CPU MLA
  decode kernel only takes a 512 + 64 latent, so those two are fixed.
- ``swa``: Gemma 3 text (``Gemma3ForCausalLM``), sliding-window layers
  interleaved with full-attention ones (every third layer is full), a
  128-token window, smaller than a typical prompt.
- ``hybrid``: Nemotron-H (``NemotronHForCausalLM``), Mamba2 layers mixed
  with attention and MLP layers (pattern :data:`HYBRID_PATTERN`).
- ``moe``: Qwen3-MoE (``Qwen3MoeForCausalLM``), grouped-query full attention
  with a mixture-of-experts MLP in every layer.
- ``gdn``: Qwen3-Next (``Qwen3NextForCausalLM``), gated-delta-net layers
  (a per-request state, like Mamba2's) before a full-attention one, a
  mixture of experts in every layer. vLLM's CPU build runs gated delta net
  in bfloat16 only, with key and value heads of 64 or more (its kernel's
  sizes), so the preset is bfloat16 and those are fixed.

The spec's shape fields mean the same in every family where they apply
(``num_kv_heads`` is unused by ``mla``; ``head_dim`` is its
``qk_nope_head_dim`` and ``v_head_dim``). What a family fixes beyond the spec
is a constant here, so one spec names one model. transformers is imported
only when a config is built: ``kvpush``'s start and the spec stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FAMILIES: tuple[str, ...] = ("dense", "mla", "swa", "hybrid", "moe", "gdn", "shortconv")
ARCHITECTURES: dict[str, str] = {
    "dense": "Qwen3ForCausalLM",
    "mla": "DeepseekV2ForCausalLM",
    "swa": "Gemma3ForCausalLM",
    "hybrid": "NemotronHForCausalLM",
    "moe": "Qwen3MoeForCausalLM",
    "gdn": "Qwen3NextForCausalLM",
    "shortconv": "Lfm2ForCausalLM",
}

# mla: vLLM's CPU MLA decode kernel compiles for a 576-wide latent only.
MLA_KV_LORA_RANK = 512
MLA_ROPE_HEAD_DIM = 64
NUM_EXPERTS = 8
NUM_EXPERTS_PER_TOKEN = 2
# swa: a window smaller than a typical prompt, so windowed layers drop blocks.
SLIDING_WINDOW = 128
FULL_ATTENTION_EVERY = 3
# hybrid, Nemotron-H's letters: M Mamba2, * attention, - MLP.
HYBRID_PATTERN = "M-*-M-"
MAMBA_HEAD_DIM = 32
MAMBA_STATE_SIZE = 16
MAMBA_GROUPS = 1
# gdn, Qwen3-Next: three gated-delta-net layers, then a full-attention one;
# vLLM's CPU gated-delta-net kernel takes heads of 64 or 128 values.
GDN_LAYER_TYPES = ("linear_attention",) * 3 + ("full_attention",)
GDN_HEAD_DIM = 64
GDN_KEY_HEADS = 2
GDN_VALUE_HEADS = 4
# transformers' names of the layer kinds that keep a per-token KV cache
ATTENTION_KINDS = ("full_attention", "sliding_attention")
# shortconv, LFM2: short-convolution layers, every third one attention.
SHORTCONV_ATTENTION_EVERY = 3
SHORTCONV_KERNEL = 3


def hf_config(
    family: str, spec: Any, vocab_size: int, eos_id: int, pad_id: int
) -> PretrainedConfig:
    """The Hugging Face config of ``family`` with ``spec``'s shape."""
    if family not in _BUILDERS:
        raise ValueError(f"unknown model family {family!r}; choose from {FAMILIES}")
    common: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": spec.init_std,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "bos_token_id": None,
        "dtype": spec.dtype,
    }
    return _BUILDERS[family](spec, common)


def layers_problem(family: str, requested: int) -> str | None:
    """Why ``requested`` layers do not fit ``family``, or None."""
    if family == "hybrid" and requested != len(HYBRID_PATTERN):
        return (
            f"the hybrid family has {len(HYBRID_PATTERN)} layers "
            f"({HYBRID_PATTERN!r}); set num_layers {len(HYBRID_PATTERN)}"
        )
    if family == "gdn" and requested != len(GDN_LAYER_TYPES):
        return (
            f"the gdn family has {len(GDN_LAYER_TYPES)} layers "
            f"({GDN_LAYER_TYPES}); set num_layers {len(GDN_LAYER_TYPES)}"
        )
    if family == "swa" and requested < FULL_ATTENTION_EVERY:
        return (
            f"the swa family needs at least {FULL_ATTENTION_EVERY} layers "
            "(one full-attention layer after the windowed ones)"
        )
    if family == "shortconv" and requested < SHORTCONV_ATTENTION_EVERY:
        return (
            f"the shortconv family needs at least {SHORTCONV_ATTENTION_EVERY} "
            "layers (one attention layer after the short-conv ones)"
        )
    if family == "mla" and requested < 2:
        return "the mla family needs at least 2 layers (one dense, then MoE)"
    return None


def kv_bytes_per_token(spec: Any) -> int:
    """KV-cache bytes one token takes in every layer that keeps a per-token
    cache, in ``spec.dtype``: keys and values per KV head, or MLA's latent.
    Windowed layers count in full (vLLM keeps all their blocks when the
    hybrid KV cache manager is off); state layers (Mamba2, gated delta net,
    short conv) keep a per-request state instead, not counted."""
    element = 4 if spec.dtype == "float32" else 2
    if spec.family == "mla":
        return spec.num_layers * (MLA_KV_LORA_RANK + MLA_ROPE_HEAD_DIM) * element
    layers = sum(
        k in ATTENTION_KINDS for k in layer_types(spec.family, spec.num_layers)
    )
    return 2 * layers * spec.num_kv_heads * spec.head_dim * element


def layer_types(family: str, num_layers: int) -> list[str]:
    """Each layer's kind in ``family``'s model of ``num_layers`` layers, by
    transformers' ``layer_types`` names (Nemotron-H's letters as
    ``full_attention``, ``mamba`` and ``mlp``)."""
    if family == "hybrid":
        letters = {"*": "full_attention", "M": "mamba", "-": "mlp"}
        return [letters[c] for c in HYBRID_PATTERN]
    if family == "gdn":
        return list(GDN_LAYER_TYPES)
    if family == "shortconv":
        return shortconv_layer_types(num_layers)
    if family == "swa":
        return swa_layer_types(num_layers)
    return ["full_attention"] * num_layers


def swa_layer_types(num_layers: int) -> list[str]:
    """Gemma 3's pattern: every ``FULL_ATTENTION_EVERY``-th layer is full."""
    return [
        "full_attention" if (i + 1) % FULL_ATTENTION_EVERY == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def shortconv_layer_types(num_layers: int) -> list[str]:
    """LFM2's pattern: every ``SHORTCONV_ATTENTION_EVERY``-th layer attends."""
    return [
        "full_attention" if (i + 1) % SHORTCONV_ATTENTION_EVERY == 0 else "conv"
        for i in range(num_layers)
    ]


def _dense(spec: Any, common: dict[str, Any]) -> PretrainedConfig:
    from transformers import Qwen3Config

    return Qwen3Config(
        **common,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        tie_word_embeddings=True,
    )


def _mla(spec: Any, common: dict[str, Any]) -> PretrainedConfig:
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        **common,
        num_key_value_heads=spec.num_heads,
        kv_lora_rank=MLA_KV_LORA_RANK,
        q_lora_rank=None,
        qk_rope_head_dim=MLA_ROPE_HEAD_DIM,
        qk_nope_head_dim=spec.head_dim,
        v_head_dim=spec.head_dim,
        first_k_dense_replace=1,
        n_routed_experts=NUM_EXPERTS,
        n_shared_experts=1,
        num_experts_per_tok=NUM_EXPERTS_PER_TOKEN,
        moe_intermediate_size=spec.intermediate_size // 2,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        tie_word_embeddings=False,
    )


def _swa(spec: Any, common: dict[str, Any]) -> PretrainedConfig:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **common,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        query_pre_attn_scalar=spec.head_dim,
        sliding_window=SLIDING_WINDOW,
        layer_types=swa_layer_types(spec.num_layers),
        tie_word_embeddings=False,
    )


def _hybrid(spec: Any, common: dict[str, Any]) -> PretrainedConfig:
    from transformers import NemotronHConfig

    return NemotronHConfig(
        # the letters vLLM's Nemotron-H reads; transformers keeps them as
        # layers_block_type
        **_with(common, hybrid_override_pattern=HYBRID_PATTERN),
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        mamba_num_heads=2 * spec.hidden_size // MAMBA_HEAD_DIM,
        mamba_head_dim=MAMBA_HEAD_DIM,
        ssm_state_size=MAMBA_STATE_SIZE,
        n_groups=MAMBA_GROUPS,
        conv_kernel=4,
        chunk_size=128,
        tie_word_embeddings=False,
    )


def _moe(spec: Any, common: dict[str, Any]) -> PretrainedConfig:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        # head_dim is not a named argument of Qwen3MoeConfig
        **_with(common, head_dim=spec.head_dim),
        num_key_value_heads=spec.num_kv_heads,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=NUM_EXPERTS_PER_TOKEN,
        moe_intermediate_size=spec.intermediate_size // 2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        tie_word_embeddings=True,
    )


def _gdn(spec: Any, common: dict[str, Any]) -> PretrainedConfig:
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **common,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        layer_types=list(GDN_LAYER_TYPES),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=GDN_HEAD_DIM,
        linear_value_head_dim=GDN_HEAD_DIM,
        linear_num_key_heads=GDN_KEY_HEADS,
        linear_num_value_heads=GDN_VALUE_HEADS,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=NUM_EXPERTS_PER_TOKEN,
        moe_intermediate_size=spec.intermediate_size // 2,
        shared_expert_intermediate_size=spec.intermediate_size // 2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )


def _with(common: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {**common, **extra}


def _shortconv(spec: Any, common: dict[str, Any]) -> PretrainedConfig:
    from transformers import Lfm2Config

    return Lfm2Config(
        # vLLM reads the conv and block widths under the names of LFM2's
        # first configs (conv_dim, block_dim); transformers keeps them
        **_with(
            common,
            norm_eps=1e-5,
            conv_dim=spec.hidden_size,
            block_dim=spec.hidden_size,
        ),
        num_key_value_heads=spec.num_kv_heads,
        layer_types=shortconv_layer_types(spec.num_layers),
        conv_L_cache=SHORTCONV_KERNEL,
        conv_bias=False,
        block_auto_adjust_ff_dim=False,
        tie_word_embeddings=True,
    )


_BUILDERS = {
    "dense": _dense,
    "mla": _mla,
    "swa": _swa,
    "hybrid": _hybrid,
    "moe": _moe,
    "gdn": _gdn,
    "shortconv": _shortconv,
}
