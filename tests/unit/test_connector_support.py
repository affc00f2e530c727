"""check_supported: what kvpush refuses at start-up, and that each refusal
names the vLLM setting to change. Built from vLLM's own ParallelConfig,
CacheConfig and KV-cache specs (cheap to construct); the top-level VllmConfig
is a namespace, as building one needs a model."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.config import CacheConfig, ParallelConfig
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvpush.connector.config import ConnectorConfig
from kvpush.connector.connector import KvPushConnector
from kvpush.connector.support import (
    REQUIRED_KV_CACHE_LAYOUT,
    UnsupportedConfig,
    check_supported,
    kv_element_size,
)

BS = 128
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def full_spec(dtype: torch.dtype = torch.bfloat16, **kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=kw.pop("block_size", BS),
        num_kv_heads=2,
        head_size=64,
        dtype=dtype,
        **kw,
    )


def kv_config(*specs: KVCacheSpec, layout: str | None = "LBHNC") -> KVCacheConfig:
    """A worker's kv_cache_config as vLLM passes it (tensors are not read)."""
    groups = [KVCacheGroupSpec(list(LAYERS), spec) for spec in specs]
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        kv_cache_layout=layout,
    )


def vllm_config(
    model_dtype: torch.dtype = torch.bfloat16,
    layout: str | None = "LBHNC",
    parallel: dict[str, int] | None = None,
    **cache: Any,
) -> SimpleNamespace:
    cache_config = CacheConfig(block_size=cache.pop("block_size", BS), **cache)
    cache_config.kv_cache_layout = layout  # resolved by EngineCore before connectors
    return SimpleNamespace(
        parallel_config=ParallelConfig(**(parallel or {})),
        cache_config=cache_config,
        model_config=SimpleNamespace(dtype=model_dtype),
    )


def refusal(config: Any, kv_cache_config: Any) -> str:
    with pytest.raises(UnsupportedConfig) as info:
        check_supported(config, kv_cache_config)
    return str(info.value)


def test_a_single_full_attention_group_on_one_worker_is_accepted():
    assert check_supported(vllm_config(), kv_config(full_spec())) is None


def test_unsupported_config_is_a_value_error():
    assert issubclass(UnsupportedConfig, ValueError)


@pytest.mark.parametrize(
    ("field", "flag", "until"),
    [
        (
            "pipeline_parallel_size",
            "--pipeline-parallel-size 2",
            "until it is designed",
        ),
        ("decode_context_parallel_size", "--decode-context-parallel-size 2", ""),
        ("prefill_context_parallel_size", "--prefill-context-parallel-size 2", ""),
    ],
)
def test_any_parallelism_is_refused_naming_the_flag(field: str, flag: str, until: str):
    parallel = {field: 2}
    if field == "decode_context_parallel_size":  # vLLM: TP must be a multiple
        parallel["tensor_parallel_size"] = 2
    message = refusal(vllm_config(parallel=parallel), kv_config(full_spec()))
    assert flag in message
    assert until in message
    assert f"run with {flag.split()[0]} 1" in message


def test_tensor_parallelism_is_accepted_at_start_up():
    # the peer's TP size is checked at its Hello (kvpush.transfer.ranks)
    config = vllm_config(parallel={"tensor_parallel_size": 4})
    assert check_supported(config, kv_config(full_spec())) is None


@pytest.mark.parametrize("dp_size", [1, 2])
def test_each_data_parallel_rank_is_accepted_as_an_engine_of_its_own(dp_size: int):
    """vLLM runs each DP rank of a dense model as its own engine with
    data_parallel_size reset to 1 (only the rank index is left); a MoE
    model's engines keep the size. Either way the engine's KV cache is its
    own: it is served, on ports of its own (test_connector_dp.py)."""
    config = vllm_config(parallel={"data_parallel_size": dp_size})
    config.parallel_config.data_parallel_index = 1
    assert check_supported(config, kv_config(full_spec())) is None


def test_every_problem_is_listed_at_once():
    config = vllm_config(parallel={"pipeline_parallel_size": 2}, layout="LBNHC")
    mamba = MambaSpec(BS, ((4,),), (torch.float32,), mamba_cache_mode="align")
    message = refusal(config, kv_config(full_spec(), mamba, layout="LBNHC"))
    assert "--pipeline-parallel-size 2" in message
    assert "KV cache layout LBNHC" in message
    assert "2 KV-cache groups (FullAttentionSpec, MambaSpec)" in message


@pytest.mark.parametrize(
    ("cache_dtype", "model_dtype", "size"),
    [
        ("auto", torch.bfloat16, 2),
        ("auto", torch.float32, 4),
        ("float16", torch.bfloat16, 2),
        ("half", torch.bfloat16, 2),
        ("float", torch.bfloat16, 4),
        ("fp8", torch.bfloat16, 1),
        ("fp8_e4m3", torch.float16, 1),
        ("fp8_e5m2", torch.float16, 1),
        ("fp8_inc", torch.bfloat16, 1),
    ],
)
def test_cache_dtypes_map_to_their_element_size(cache_dtype, model_dtype, size):
    assert kv_element_size(cache_dtype, model_dtype) == size


@pytest.mark.parametrize(
    "cache_dtype",
    ["nvfp4", "int8_per_token_head", "fp8_per_token_head", "turboquant_k8v4",
     "fp8_ds_mla", "int3", ""],
)  # fmt: skip
def test_cache_dtypes_without_a_known_element_size_are_refused(cache_dtype: str):
    with pytest.raises(UnsupportedConfig, match=f"--kv-cache-dtype {cache_dtype}:"):
        kv_element_size(cache_dtype, torch.bfloat16)


def test_an_fp8_cache_is_accepted_when_vllm_stores_it_in_bytes():
    config = vllm_config(cache_dtype="fp8_e5m2")
    assert check_supported(config, kv_config(full_spec(torch.uint8))) is None


def test_a_packed_cache_dtype_is_refused_at_start_up():
    message = refusal(
        vllm_config(cache_dtype="nvfp4"), kv_config(full_spec(torch.uint8))
    )
    assert (
        "--kv-cache-dtype nvfp4: kvpush copies only caches of known element size"
        in (message)
    )


def test_auto_with_a_model_dtype_kvpush_does_not_copy_is_refused():
    message = refusal(vllm_config(model_dtype=torch.float64), kv_config(full_spec()))
    assert "--kv-cache-dtype auto" in message


def test_a_cache_whose_dtype_contradicts_the_setting_is_refused():
    message = refusal(
        vllm_config(cache_dtype="fp8"), kv_config(full_spec(torch.bfloat16))
    )
    assert (
        "--kv-cache-dtype fp8 means torch.uint8 but the KV cache is torch.bfloat16"
        in (message)
    )


def test_mixed_precision_layers_are_refused_naming_the_skip_option():
    config = vllm_config(cache_dtype="fp8", kv_cache_dtype_skip_layers=["0"])
    message = refusal(config, kv_config(full_spec(torch.uint8)))
    assert "--kv-cache-dtype-skip-layers ['0']" in message


@pytest.mark.parametrize("layout", ["LBNHC", "NHD", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_layouts_other_than_lbhnc_are_refused(layout: str):
    message = refusal(vllm_config(layout=layout), kv_config(full_spec(), layout=layout))
    assert f"KV cache layout {layout}" in message
    assert f"VLLM_KV_CACHE_LAYOUT={REQUIRED_KV_CACHE_LAYOUT}" in message


@pytest.mark.parametrize("layout", ["LBHNC", "HND", None])
def test_lbhnc_or_a_layout_not_resolved_yet_is_accepted(layout: str | None):
    config, kv = vllm_config(layout=layout), kv_config(full_spec(), layout=layout)
    assert check_supported(config, kv) is None


def test_the_layout_vllm_resolved_for_the_workers_wins_over_the_cache_config():
    message = refusal(vllm_config(layout=None), kv_config(full_spec(), layout="BLHNC"))
    assert "KV cache layout BLHNC" in message


def test_no_kv_cache_config_is_refused():
    assert "no kv_cache_config" in refusal(vllm_config(), None)


def test_no_kv_cache_group_is_refused():
    assert "0 KV-cache groups" in refusal(vllm_config(), kv_config())


def test_several_full_attention_groups_are_accepted():
    # vLLM's hybrid manager splits full layers into groups of its group
    # size; the groups alias one allocation (checked on the tensors).
    assert check_supported(vllm_config(), kv_config(full_spec(), full_spec())) is None


def test_sliding_window_groups_beside_a_full_one_are_accepted():
    swa = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=64,
                            dtype=torch.bfloat16, sliding_window=1024)  # fmt: skip
    assert check_supported(vllm_config(), kv_config(swa, swa, full_spec())) is None


def test_a_model_whose_every_layer_is_windowed_is_refused():
    swa = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=64,
                            dtype=torch.bfloat16, sliding_window=1024)  # fmt: skip
    for kv in (kv_config(swa), kv_config(swa, swa)):
        assert "no full-attention or MLA layer" in refusal(vllm_config(), kv)


def test_a_host_resident_group_is_refused():
    kv = kv_config(full_spec())
    kv.kv_cache_groups[0].host_resident = True
    assert "host-resident" in refusal(vllm_config(), kv)


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576,
                          dtype=torch.bfloat16, model_version="deepseek_v4"),
         "sparse or aligned MLA caches"),
        (ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64,
                                   dtype=torch.bfloat16, attention_chunk_size=512),
         "chunked local attention"),
        (MambaSpec(BS, ((4, 8),), (torch.float32,), mamba_cache_mode="align"),
         "mamba cache mode 'align'"),
        (UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs={"a": full_spec()}),
         "different KV shapes"),
        (SinkFullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64,
                               dtype=torch.bfloat16, sink_len=4),
         "only plain full attention"),
    ],
)  # fmt: skip
def test_layers_that_are_not_plain_full_attention_are_refused(spec, reason):
    message = refusal(vllm_config(), kv_config(spec))
    assert f"{type(spec).__name__} layers: " in message
    assert reason in message


def test_sliding_window_layers_allocated_as_full_attention_are_accepted():
    # vLLM's promotion when the hybrid manager is off: every block is kept.
    kv = kv_config(full_spec(sliding_window=4096))
    assert check_supported(vllm_config(), kv) is None


def test_a_cache_block_size_other_than_the_setting_is_refused():
    message = refusal(vllm_config(block_size=64), kv_config(full_spec(block_size=128)))
    assert "--block-size 64 but the KV cache uses 128-token blocks" in message


def test_padded_pages_are_refused():
    kv = kv_config(full_spec(page_size_padded=BS * 2 * 128 * 2 + 4096))
    assert "padded or packed pages" in refusal(vllm_config(), kv)


def mla_spec(**kw: Any) -> MLAAttentionSpec:
    return MLAAttentionSpec(
        block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, **kw
    )


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_mla_latent_caches_are_accepted_in_either_token_order(layout: str):
    # One latent "head" per token: [heads][tokens] and [tokens][heads] are
    # the same bytes, so the order the MLA backend chose does not matter.
    kv = kv_config(mla_spec(), layout=layout)
    assert check_supported(vllm_config(layout=layout), kv) is None
    # ... while a per-head cache in LBNHC stays refused.
    assert "KV cache layout LBNHC" in refusal(
        vllm_config(layout="LBNHC"), kv_config(full_spec(), layout="LBNHC")
    )


def test_a_packed_mla_format_is_refused_by_its_cache_dtype():
    message = refusal(vllm_config(cache_dtype="fp8_ds_mla"), kv_config(mla_spec()))
    assert "--kv-cache-dtype fp8_ds_mla" in message


@pytest.mark.parametrize(("use_mla", "heads"), [(True, 1), (False, 8)])
def test_the_tp_mapping_counts_an_mla_latent_as_one_kv_head(use_mla: bool, heads):
    extra = {"side_channel_port": 5600}
    kv = SimpleNamespace(
        kv_role="kv_producer", engine_id="p0", kv_connector_extra_config=extra
    )
    config = SimpleNamespace(
        kv_transfer_config=kv,
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=2),
        model_config=SimpleNamespace(use_mla=use_mla, get_total_num_kv_heads=lambda: 8),
        instance_id="i",
    )
    assert ConnectorConfig.from_vllm(config).total_kv_heads == heads


def test_a_hybrid_model_with_prefix_caching_is_refused_before_vllm_groups_it():
    # vLLM asks the connector class for its layout while the workers set up
    # attention, before it groups the layers: prefix caching on keeps Mamba
    # state checkpoints per block, which kvpush does not copy.
    def model(hybrid: bool, caching: bool) -> SimpleNamespace:
        return SimpleNamespace(
            model_config=SimpleNamespace(is_hybrid=hybrid, model="nh"),
            cache_config=SimpleNamespace(enable_prefix_caching=caching),
        )

    with pytest.raises(UnsupportedConfig, match="--no-enable-prefix-caching"):
        KvPushConnector.get_required_kvcache_layout(model(True, True))
    assert KvPushConnector.get_required_kvcache_layout(model(True, False)) == "LBHNC"
    assert KvPushConnector.get_required_kvcache_layout(model(False, True)) == "LBHNC"
