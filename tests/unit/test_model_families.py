"""The model-family presets (mla, swa, hybrid, moe, gdn): configs transformers and
vLLM accept, the KV-cache groups vLLM 0.32 makes of their layers, and what
kvpush's start-up check says about those groups.

Each layer's KV-cache spec is built with vLLM's own classes as its layers
build them on the CPU backend (the values a colocated run of each preset
reported, docs/model-families.md); the groups come from vLLM's own
``get_kv_cache_groups``, with the hybrid KV cache manager on (vLLM's default
without a connector) and off (what vLLM does for kvpush's connector, which
lacks ``SupportsHMA``). No engine starts here."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoConfig, PretrainedConfig
from vllm.config import CacheConfig, ParallelConfig
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.model_executor.models.registry import ModelRegistry
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvpush.connector.config import kv_groups_of
from kvpush.connector.support import UnsupportedConfig, check_supported
from kvpush.model import families
from kvpush.model.kv_size import kv_bytes_per_token
from kvpush.model.presets import PRESETS, preset
from kvpush.model.spec import ModelSpec

FAMILY_PRESETS = ("mla", "swa", "hybrid", "moe", "gdn", "shortconv")
VOCAB = 4096
# Block sizes vLLM 0.32's CPU platform picked in a colocated run: 128 by
# default, 16 forced for its CPU MLA kernel; for the hybrid model the
# attention block grows until its page holds one Mamba state.
CPU_BLOCK = 128
CPU_MLA_BLOCK = 16


@pytest.fixture(scope="module")
def hf_configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each family preset's config, saved and loaded back by transformers."""
    loaded = {}
    for name in FAMILY_PRESETS:
        spec = preset(name).spec
        directory = tmp_path_factory.mktemp(name)
        families.hf_config(spec.family, spec, VOCAB, 2, 0).save_pretrained(directory)
        loaded[name] = AutoConfig.from_pretrained(directory)
    return loaded


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_each_family_has_a_preset_of_its_own_architecture(name: str, hf_configs):
    chosen = preset(name)
    assert chosen.spec.family == name
    assert hf_configs[name].architectures == [families.ARCHITECTURES[name]]
    assert chosen.max_model_len <= chosen.spec.max_position_embeddings


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_the_config_round_trips_through_transformers(name: str, tmp_path: Path):
    spec = preset(name).spec
    built = families.hf_config(spec.family, spec, VOCAB, 2, 0)
    built.save_pretrained(tmp_path)
    again = AutoConfig.from_pretrained(tmp_path)
    assert type(again) is type(built)
    assert _without_version(again) == _without_version(built)


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_vllm_registers_each_architecture(name: str):
    assert families.ARCHITECTURES[name] in ModelRegistry.get_supported_archs()


def test_the_mla_latent_is_the_one_size_the_cpu_mla_kernel_takes(hf_configs):
    config = hf_configs["mla"]
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    assert latent in CPUMLABackend.get_supported_head_sizes()
    assert config.q_lora_rank is None
    assert config.first_k_dense_replace == 1 < config.num_hidden_layers
    assert (config.n_routed_experts, config.num_experts_per_tok) == (8, 2)
    # vLLM's CPU router asserts a group count; None makes its MoE layer fail
    assert (config.n_group, config.topk_group) == (1, 1)


def test_swa_interleaves_windowed_and_full_layers_with_a_small_window(hf_configs):
    config = hf_configs["swa"]
    assert config.layer_types == ["sliding_attention", "sliding_attention",
                                  "full_attention"] * 2  # fmt: skip
    # 1k-token prompts in 128-token blocks: most of them fall out of the window
    assert config.sliding_window == CPU_BLOCK
    assert not config.tie_word_embeddings, "Gemma's scaled embeddings would echo"


def test_hybrid_mixes_mamba2_attention_and_mlp_layers(hf_configs):
    config = hf_configs["hybrid"]
    assert config.hybrid_override_pattern == "M-*-M-"
    assert config.num_hidden_layers == len(config.hybrid_override_pattern)
    assert config.mamba_num_heads * config.mamba_head_dim == 2 * config.hidden_size


def test_gdn_puts_gated_delta_nets_before_attention_in_the_cpu_kernels_sizes(
    hf_configs,
):
    config = hf_configs["gdn"]
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert config.linear_key_head_dim == config.linear_value_head_dim == 64
    assert str(config.dtype).endswith("bfloat16")  # the CPU build's one dtype
    assert preset("gdn").spec.dtype == "bfloat16"


def test_moe_routes_each_token_to_two_of_eight_experts(hf_configs):
    config = hf_configs["moe"]
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    assert config.decoder_sparse_step == 1 and not config.mlp_only_layers


@pytest.mark.parametrize(
    ("name", "per_token"),
    [
        ("tiny", 2 * 2 * 2 * 64 * 4),
        ("mla", 2 * (512 + 64) * 4),  # one latent per layer, no per-head K/V
        ("swa", 6 * 2 * 2 * 64 * 4),  # every layer, as kvpush's vLLM keeps them
        ("hybrid", 1 * 2 * 2 * 64 * 4),  # the one attention layer
        ("moe", 2 * 2 * 2 * 64 * 4),
        ("gdn", 1 * 2 * 2 * 64 * 2),  # the one attention layer, bfloat16
    ],
)
def test_kv_bytes_per_token_counts_the_layers_that_keep_per_token_kv(
    name: str, per_token: int
):
    assert PRESETS[name].kv_bytes_per_token == per_token


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_kv_size_reads_the_same_bytes_per_token_from_config_json(
    name: str, tmp_path: Path
):
    spec = preset(name).spec
    families.hf_config(spec.family, spec, VOCAB, 2, 0).save_pretrained(tmp_path)
    from_file = kv_bytes_per_token(tmp_path, spec.dtype)
    assert from_file == PRESETS[name].kv_bytes_per_token


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_make_model_builds_each_family_with_norms_that_scale_by_one(
    name: str, tmp_path: Path
):
    from safetensors.torch import load_file

    from kvpush.model import make_model

    small = dataclasses.replace(
        preset(name).spec, hidden_size=64, head_dim=16, intermediate_size=128,
        vocab_size=1024, corpus_bytes=100_000,
    )  # fmt: skip
    make_model(tmp_path, small)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [families.ARCHITECTURES[name]]
    weights = load_file(tmp_path / "model.safetensors")
    norms = {
        k: set(w.float().flatten().tolist()) for k, w in weights.items() if "norm" in k
    }
    # each its identity: ones, or zeros where it multiplies by 1 + weight
    zero_centred = {"swa": "", "gdn": "layernorm|model.norm|q_norm|k_norm"}
    for key, values in norms.items():
        pattern = zero_centred.get(name)
        centred = pattern is not None and re.search(pattern or ".", key) is not None
        assert values == ({0.0} if centred else {1.0}), key


def test_a_spec_without_a_family_is_the_dense_model():
    # markers written before families existed still match the tiny model
    document = json.loads(ModelSpec().to_json())
    del document["spec"]["family"]
    assert ModelSpec.from_json(json.dumps(document)) == ModelSpec()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"family": "rwkv"}, "ModelSpec.family must be one of"),
        ({"family": "hybrid", "num_layers": 4}, "set num_layers 6"),
        ({"family": "swa", "num_layers": 2}, "at least 3 layers"),
        ({"family": "mla", "num_layers": 1}, "at least 2 layers"),
    ],
)
def test_a_family_spec_that_cannot_be_built_is_refused(fields: dict, message: str):
    with pytest.raises(ValueError, match=message):
        ModelSpec(**fields)


# What vLLM groups, and what kvpush says about it.


def layer_specs(name: str, config: PretrainedConfig) -> dict[str, KVCacheSpec]:
    """Each attention or Mamba layer's spec, as vLLM's CPU backend builds it."""
    dtype = torch.float32
    if name == "mla":
        latent = config.kv_lora_rank + config.qk_rope_head_dim
        return {
            f"model.layers.{i}.self_attn.attn": MLAAttentionSpec(
                block_size=CPU_MLA_BLOCK,
                num_kv_heads=1,
                head_size=latent,
                dtype=dtype,
                cache_dtype_str="auto",
            )
            for i in range(config.num_hidden_layers)
        }
    if name == "hybrid":
        return _hybrid_specs(config, dtype)
    if name == "gdn":
        return _gdn_specs(config)
    if name == "shortconv":
        return _shortconv_specs(config)
    attention = {"num_kv_heads": config.num_key_value_heads, "head_size": 64}
    types = getattr(config, "layer_types", None) or ["full_attention"] * (
        config.num_hidden_layers
    )
    return {
        f"model.layers.{i}.self_attn.attn": (
            SlidingWindowSpec(
                block_size=CPU_BLOCK,
                dtype=dtype,
                sliding_window=config.sliding_window,
                **attention,
            )
            if kind == "sliding_attention"
            else FullAttentionSpec(block_size=CPU_BLOCK, dtype=dtype, **attention)
        )
        for i, kind in enumerate(types)
    }


def _hybrid_specs(config: PretrainedConfig, dtype: torch.dtype) -> dict:
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=1,
        intermediate_size=config.mamba_num_heads * config.mamba_head_dim,
        n_groups=config.n_groups,
        num_heads=config.mamba_num_heads,
        head_dim=config.mamba_head_dim,
        state_size=config.ssm_state_size,
        conv_kernel=config.conv_kernel,
    )
    state_bytes = sum(4 * torch.Size(s).numel() for s in shapes)
    token_bytes = 2 * config.num_key_value_heads * config.head_dim * 4
    block = -(-state_bytes // token_bytes // CPU_BLOCK) * CPU_BLOCK
    specs: dict[str, KVCacheSpec] = {}
    for i, letter in enumerate(config.hybrid_override_pattern):
        if letter == "M":
            specs[f"backbone.layers.{i}.mixer"] = MambaSpec(
                block_size=block,
                shapes=tuple(shapes),
                dtypes=(dtype, dtype),
                page_size_padded=block * token_bytes,
                mamba_cache_mode="align",  # prefix caching on, as logged
            )
        elif letter == "*":
            specs[f"backbone.layers.{i}.mixer.attn"] = FullAttentionSpec(
                block_size=block,
                num_kv_heads=config.num_key_value_heads,
                head_size=config.head_dim,
                dtype=dtype,
            )
    return specs


def _shortconv_specs(config: PretrainedConfig) -> dict:
    """LFM2's layers as vLLM's CPU build gives them: a short-conv state
    (float32, one conv state) per conv layer, padded to a 128-token
    attention block; prefix caching off."""
    (shape,) = MambaStateShapeCalculator.short_conv_state_shape(
        tp_world_size=1,
        intermediate_size=config.conv_dim,
        conv_kernel=config.conv_L_cache,
    )
    token_bytes = 2 * config.num_key_value_heads * 64 * 4
    specs: dict[str, KVCacheSpec] = {}
    for i, kind in enumerate(config.layer_types):
        if kind == "conv":
            specs[f"model.layers.{i}.conv"] = MambaSpec(
                block_size=CPU_BLOCK,
                shapes=(shape,),
                dtypes=(torch.float32,),
                page_size_padded=CPU_BLOCK * token_bytes,
                mamba_type=MambaAttentionBackendEnum.SHORT_CONV,
                mamba_cache_mode="none",
            )
        else:
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=CPU_BLOCK,
                num_kv_heads=config.num_key_value_heads,
                head_size=64,
                dtype=torch.float32,
            )
    return specs


def _gdn_specs(config: PretrainedConfig) -> dict:
    """Qwen3-Next's layers as the colocated run logged them: bfloat16 conv
    state, float32 recurrent state, 256-token attention blocks (the page
    holding one state), prefix caching off ('none')."""
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp_world_size=1,
        num_k_heads=config.linear_num_key_heads,
        num_v_heads=config.linear_num_value_heads,
        head_k_dim=config.linear_key_head_dim,
        head_v_dim=config.linear_value_head_dim,
        conv_kernel_size=config.linear_conv_kernel_dim,
    )
    block, token_bytes = 256, 2 * config.num_key_value_heads * config.head_dim * 2
    specs: dict[str, KVCacheSpec] = {}
    for i, kind in enumerate(config.layer_types):
        if kind == "linear_attention":
            specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                block_size=block,
                shapes=tuple(shapes),
                dtypes=(torch.bfloat16, torch.float32),
                page_size_padded=block * token_bytes,
                mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                mamba_cache_mode="none",
            )
        else:
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=block,
                num_kv_heads=config.num_key_value_heads,
                head_size=config.head_dim,
                dtype=torch.bfloat16,
            )
    return specs


def vllm_groups(name: str, config: PretrainedConfig, hma: bool) -> KVCacheConfig:
    """The kv_cache_config vLLM hands a connector for this preset."""
    specs = layer_specs(name, config)
    block = next(iter(specs.values())).block_size
    namespace = _vllm_config(block, hma)
    groups = get_kv_cache_groups(namespace, specs)
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        kv_cache_layout="LBHNC",
    )


def _vllm_config(
    block_size: int, hma: bool, dtype: torch.dtype = torch.float32
) -> SimpleNamespace:
    cache_config = CacheConfig(block_size=block_size)
    cache_config.kv_cache_layout = "LBHNC"  # resolved by EngineCore
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=not hma),
        attention_config=SimpleNamespace(hisparse_config=None),
        speculative_config=None,
        cache_config=cache_config,
        parallel_config=ParallelConfig(),
        model_config=SimpleNamespace(dtype=dtype),
    )


def kinds(kv_cache_config: KVCacheConfig) -> list[str]:
    return [type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups]


def refusal(name: str, config: PretrainedConfig, hma: bool) -> str:
    kv = vllm_groups(name, config, hma)
    block = kv.kv_cache_groups[0].kv_cache_spec.block_size
    with pytest.raises(UnsupportedConfig) as info:
        check_supported(_vllm_config(block, hma), kv)
    return str(info.value)


def test_moe_is_one_full_attention_group_that_kvpush_serves(hf_configs):
    kv = vllm_groups("moe", hf_configs["moe"], hma=True)
    assert kinds(kv) == ["FullAttentionSpec"]
    assert check_supported(_vllm_config(CPU_BLOCK, hma=False), kv) is None


@pytest.mark.parametrize("hma", [True, False])
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_mla_is_one_latent_group_that_kvpush_serves(hma: bool, layout: str, hf_configs):
    # The CPU MLA backend resolves LBNHC ("NHD"): with one latent "head" per
    # token both orders are the same bytes, so the layout check lets it pass.
    kv = vllm_groups("mla", hf_configs["mla"], hma)
    assert kinds(kv) == ["MLAAttentionSpec"]
    spec = kv.kv_cache_groups[0].kv_cache_spec
    assert (spec.num_kv_heads, spec.head_size, spec.block_size) == (1, 576, 16)
    config = _vllm_config(spec.block_size, hma)
    config.cache_config.kv_cache_layout = layout
    assert check_supported(config, kv) is None


def test_swa_with_the_hybrid_manager_has_a_group_and_block_table_per_window(
    hf_configs,
):
    kv = vllm_groups("swa", hf_configs["swa"], hma=True)
    assert kinds(kv) == ["SlidingWindowSpec", "SlidingWindowSpec", "FullAttentionSpec"]
    assert [len(g.layer_names) for g in kv.kv_cache_groups] == [2, 2, 2]
    assert check_supported(_vllm_config(CPU_BLOCK, hma=True), kv) is None
    window = f"sliding_window:{families.SLIDING_WINDOW}"
    assert [g.kind for g in kv_groups_of(kv)] == [window, window, "full"]


def test_swa_with_the_hybrid_manager_refuses_per_layer_pushes(hf_configs):
    kv = vllm_groups("swa", hf_configs["swa"], hma=True)
    config = _vllm_config(CPU_BLOCK, hma=True)
    config.kv_transfer_config = SimpleNamespace(
        kv_connector_extra_config={"push_granularity": "layer"}
    )
    with pytest.raises(UnsupportedConfig, match="push_granularity layer with 3"):
        check_supported(config, kv)


def test_swa_as_kvpush_runs_it_is_one_full_group_that_kvpush_serves(hf_configs):
    kv = vllm_groups("swa", hf_configs["swa"], hma=False)
    assert kinds(kv) == ["FullAttentionSpec"]
    assert kv.kv_cache_groups[0].kv_cache_spec.sliding_window == CPU_BLOCK
    assert check_supported(_vllm_config(CPU_BLOCK, hma=False), kv) is None


def test_hybrid_with_prefix_caching_keeps_state_checkpoints_kvpush_refuses(hf_configs):
    kv = vllm_groups("hybrid", hf_configs["hybrid"], hma=True)
    # as the colocated run logged: one group per Mamba layer, then attention,
    # all 128-token blocks of one 128 KiB page (the 38 KiB state padded)
    assert kinds(kv) == ["MambaSpec", "MambaSpec", "FullAttentionSpec"]
    specs = [g.kv_cache_spec for g in kv.kv_cache_groups]
    assert {(s.block_size, s.page_size_bytes) for s in specs} == {(128, 131072)}
    message = refusal("hybrid", hf_configs["hybrid"], hma=True)
    assert "3 KV-cache groups" in message
    assert "MambaSpec layers: MAMBA2 state, mamba cache mode 'align'" in message
    assert "--no-enable-prefix-caching" in message


def test_gdn_state_groups_are_served_beside_attention(hf_configs):
    kv = vllm_groups("gdn", hf_configs["gdn"], hma=True)
    assert kinds(kv) == ["MambaSpec"] * 3 + ["FullAttentionSpec"]
    assert check_supported(_vllm_config(256, True, torch.bfloat16), kv) is None
    groups = kv_groups_of(kv)
    assert [g.is_state for g in groups] == [True] * 3 + [False]
    assert groups[0].kind.startswith("state:gdn_attn:")


@pytest.mark.parametrize("mamba_type", ["MAMBA1", "LINEAR"])
def test_other_state_kinds_are_refused_by_name(hf_configs, mamba_type: str):
    kv = vllm_groups("gdn", hf_configs["gdn"], hma=True)
    for group in kv.kv_cache_groups:
        if isinstance(group.kv_cache_spec, MambaSpec):
            group.kv_cache_spec = dataclasses.replace(
                group.kv_cache_spec, mamba_type=MambaAttentionBackendEnum[mamba_type]
            )
    with pytest.raises(
        UnsupportedConfig, match=f"MambaSpec layers: {mamba_type} state"
    ):
        check_supported(_vllm_config(256, True, torch.bfloat16), kv)


def test_hybrid_without_the_hybrid_manager_fails_in_vllm_before_kvpush(hf_configs):
    # with --disable-hybrid-kv-cache-manager (or a connector without
    # SupportsHMA): EngineCore stops while grouping, before any connector
    with pytest.raises(ValueError, match="Failed to promote local KV cache specs"):
        vllm_groups("hybrid", hf_configs["hybrid"], hma=False)


def _without_version(config: PretrainedConfig) -> dict:
    values = config.to_dict()
    for key in ("transformers_version", "_name_or_path"):
        values.pop(key, None)
    return values


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_up_and_make_model_take_each_family_preset(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    import kvpush.model.presets as presets
    from kvpush.cli import _parser, up_config

    monkeypatch.setattr(presets, "ensure_preset", lambda home, chosen: tmp_path)
    args = _parser().parse_args(["up", "--mode", "kvpush", "--model-preset", name])
    assert up_config(args).model == tmp_path
    made = _parser().parse_args(["make-model", "--preset", name, str(tmp_path)])
    assert made.preset == name
