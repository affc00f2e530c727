"""layout_of: which KV-cache tensors kvpush maps, to which addresses, and
which it refuses. Tensors are real CPU tensors laid out as vLLM 0.32 lays
them out (one allocation viewed per layer as [blocks, heads, tokens, K|V] in
the order a KVCacheLayout names), plus the older 5-D shapes."""

from __future__ import annotations

import pytest
import torch

from kvpush.connector.config import KvGroup
from kvpush.connector.kv_memory import layout_of
from kvpush.transfer.layout import compat_problem

BS = 32  # tokens per block
NB = 8  # blocks
H, C = 2, 16  # kv heads, K|V elements per token and head
LAYERS = 3


def name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def vllm_views(
    order: str = "LBHNC",
    num_blocks: int = NB,
    tokens: int = BS,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Per-layer [B, H, N, C] views of one buffer whose memory order is
    ``order`` (a KVCacheLayout name), as vLLM's allocate_kv_cache makes."""
    sizes = dict(zip("LBHNC", (LAYERS, num_blocks, H, tokens, C), strict=True))
    strides, step = {}, 1
    for dim in reversed(order):
        strides[dim] = step
        step *= sizes[dim]
    whole = torch.zeros(step, dtype=dtype).as_strided(
        [sizes[d] for d in "LBHNC"], [strides[d] for d in "LBHNC"]
    )
    return {name(layer): whole[layer] for layer in range(LAYERS)}


def refusal(caches: dict[str, torch.Tensor], num_blocks: int = NB) -> str:
    with pytest.raises(ValueError) as info:
        layout_of(caches, BS, num_blocks)
    return str(info.value)


# -- mapped ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "kv_dtype"),
    [(torch.float32, "float32"), (torch.bfloat16, "bfloat16"),
     (torch.float8_e4m3fn, "float8_e4m3fn")],
)  # fmt: skip
def test_the_cpu_layout_maps_every_block_of_every_layer(dtype, kv_dtype):
    caches = vllm_views("LBHNC", dtype=dtype)
    layout = layout_of(caches, BS, NB)
    tensors = list(caches.values())
    assert layout.num_blocks == NB and layout.block_size == BS
    assert layout.regions_per_layer == 1 and layout.num_layers == LAYERS
    assert layout.block_bytes == H * BS * C * dtype.itemsize
    assert layout.kv_dtype == kv_dtype
    for layer, t in enumerate(tensors):
        for block in (0, 3, NB - 1):
            assert layout.block_addr(layer, block) == t[block].data_ptr()
    # views into one allocation: layer 1 starts right after layer 0's blocks
    assert layout.base_addrs[1] - layout.base_addrs[0] == NB * layout.block_bytes


def test_an_fp8_cache_in_bytes_is_sized_by_its_element_and_named_by_its_format():
    layout = layout_of(vllm_views(dtype=torch.uint8), BS, NB, cache_dtype="fp8_e5m2")
    assert layout.block_bytes == H * BS * C
    assert layout.kv_dtype == "fp8_e5m2/uint8"
    other = layout_of(vllm_views(dtype=torch.uint8), BS, NB, cache_dtype="fp8_e4m3")
    assert compat_problem(layout, other) == (
        "kv_dtype differs: local 'fp8_e5m2/uint8', remote 'fp8_e4m3/uint8'"
    )


def test_a_typed_cache_is_named_by_its_dtype_whatever_the_setting_says():
    layout = layout_of(vllm_views(dtype=torch.bfloat16), BS, NB, cache_dtype="bfloat16")
    assert layout.kv_dtype == "bfloat16"  # same as "auto" on a bfloat16 model


def test_a_k_v_first_cache_maps_two_regions_per_layer():
    whole = torch.zeros(LAYERS, 2, NB, BS, H, C)  # FlashAttention before 0.32
    caches = {name(i): whole[i] for i in range(LAYERS)}
    layout = layout_of(caches, BS, NB)
    assert layout.regions_per_layer == 2 and layout.num_layers == LAYERS
    assert layout.block_bytes == whole.stride(2) * whole.element_size()
    for layer, t in enumerate(caches.values()):
        k, v = layout.regions(layer)
        assert layout.base_addrs[k] == t[0].data_ptr()
        assert layout.base_addrs[v] == t[1].data_ptr()
        assert layout.block_addr(v, 5) == t[1, 5].data_ptr()


def test_a_block_first_cache_with_k_and_v_inside_maps_one_region_per_layer():
    whole = torch.zeros(LAYERS, NB, 2, H, BS, C)  # FlashInfer HND before 0.32
    caches = {name(i): whole[i] for i in range(LAYERS)}
    layout = layout_of(caches, BS, NB)
    assert layout.regions_per_layer == 1
    assert layout.block_bytes == 2 * H * BS * C * 4
    assert layout.block_addr(2, 7) == whole[2, 7].data_ptr()


def test_a_layer_sharing_another_layers_cache_is_mapped_once():
    caches = vllm_views()
    caches["model.layers.9.self_attn.attn"] = caches[name(0)]  # KV sharing
    layout = layout_of(caches, BS, NB)
    assert layout.num_layers == LAYERS


def two_groups(caches: dict[str, torch.Tensor]) -> tuple[KvGroup, ...]:
    """A windowed group over layers 0..2 and a full one over 3..5, as vLLM's
    hybrid manager groups them (layer k of each group in slot k)."""
    window = KvGroup("sliding_window:64", tuple(name(k) for k in range(LAYERS)))
    full = KvGroup("full", tuple(name(LAYERS + k) for k in range(LAYERS)))
    return window, full


def test_kv_cache_groups_aliasing_one_allocation_share_the_slots():
    caches = vllm_views()
    for k in range(LAYERS):  # vLLM's allocate_kv_cache: same-slot views
        caches[name(LAYERS + k)] = caches[name(k)]
    layout = layout_of(caches, BS, NB, groups=two_groups(caches))
    assert layout.num_layers == LAYERS
    assert layout.kv_groups == ("sliding_window:64", "full")


def test_kv_cache_groups_in_separate_memory_are_refused_naming_the_layer():
    caches = vllm_views()
    other = vllm_views()
    for k in range(LAYERS):
        caches[name(LAYERS + k)] = other[name(k)]
    with pytest.raises(ValueError, match=r"group 1's layer 0 \(model.layers.3"):
        layout_of(caches, BS, NB, groups=two_groups(caches))


def test_layouts_grouped_differently_cannot_copy():
    caches = vllm_views()
    for k in range(LAYERS):
        caches[name(LAYERS + k)] = caches[name(k)]
    grouped = layout_of(caches, BS, NB, groups=two_groups(caches))
    one = layout_of(vllm_views(), BS, NB)
    assert one.kv_groups == ("full",)
    assert "kv_groups differs" in (compat_problem(grouped, one) or "")
    assert compat_problem(grouped, grouped) is None


# -- refused -------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_every_other_vllm_layout_is_refused_naming_shape_and_strides(order: str):
    caches = vllm_views(order)
    message = refusal(caches)
    first = caches[name(0)]
    assert f"layer {name(0)}" in message
    assert f"{tuple(first.shape)} with strides {first.stride()}" in message
    assert "VLLM_KV_CACHE_LAYOUT=LBHNC" in message


def test_a_block_that_is_not_one_chunk_is_refused():
    whole = torch.zeros(H, NB, BS, C)  # heads outside blocks
    message = refusal({name(0): whole.transpose(0, 1)})
    assert "does not store each block as one contiguous row-major chunk" in message


def test_kernel_blocks_smaller_than_the_logical_block_are_refused():
    caches = vllm_views(num_blocks=NB * 4, tokens=BS // 4)  # vLLM's kernel split
    message = refusal(caches)
    assert f"has {NB * 4} blocks, 4 times vLLM's {NB}" in message
    assert f"kernel block size ({BS // 4}) to equal the logical block size ({BS})" in (
        message
    )
    assert f"--block-size {BS // 4}" in message


def test_a_k_v_first_cache_split_into_kernel_blocks_is_refused():
    whole = torch.zeros(2, NB * 2, BS // 2, H, C)
    assert "2 times vLLM's" in refusal({name(0): whole})


def test_a_token_dimension_other_than_the_block_size_is_refused():
    message = refusal(vllm_views(tokens=BS // 2))
    assert f"holds {BS // 2} tokens per block, not --block-size {BS}" in message
    assert f"--block-size {BS // 2}" in message


def test_layers_laid_out_differently_are_refused_naming_both():
    caches = vllm_views()
    caches[name(2)] = torch.zeros(NB, H, BS, C, dtype=torch.bfloat16)
    message = refusal(caches)
    assert f"layer {name(2)} has" in message and f"layer {name(0)}" in message


def test_layers_whose_memory_overlaps_are_refused():
    whole = torch.zeros(NB + 1, H, BS, C)
    message = refusal({name(0): whole[:NB], name(1): whole[1:]})
    assert "overlap" in message


def test_a_cache_without_a_block_dimension_is_refused():
    message = refusal({name(0): torch.zeros(NB + 1, H, BS, C)})
    assert "has no dimension of num_blocks=8" in message


def test_a_shape_where_blocks_and_k_v_cannot_be_told_apart_is_refused():
    message = refusal({name(0): torch.zeros(2, 2, BS, H, C)}, num_blocks=2)
    assert "ambiguous" in message


def test_no_caches_at_all_are_refused():
    assert "no KV-cache tensors" in refusal({})


# -- Mamba state pages (vLLM's hybrid manager, prefix caching off) ---------------


def hybrid_caches() -> tuple[dict[str, torch.Tensor], tuple[KvGroup, ...]]:
    """What vLLM 0.32's own grouping and allocation give the ``hybrid``
    preset (Nemotron-H, ``M-*-M-``, mode 'none'): two Mamba groups and one
    attention group, one slot, all three views at one address."""
    from types import SimpleNamespace

    from vllm.config import CacheConfig, ParallelConfig
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvpush.connector.config import kv_groups_of

    def mamba() -> MambaSpec:
        return MambaSpec(
            block_size=4096,
            shapes=((3, 544), (16, 32, 16)),
            dtypes=(torch.float32, torch.float32),
            page_size_padded=131072,
            mamba_cache_mode="none",
        )

    specs = {
        "model.layers.0.mixer": mamba(),
        "model.layers.2.mixer.attn": FullAttentionSpec(
            block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32
        ),
        "model.layers.4.mixer": mamba(),
    }
    cache = CacheConfig(block_size=128)
    cache.kv_cache_layout = "LBHNC"
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        attention_config=SimpleNamespace(hisparse_config=None),
        speculative_config=None,
        cache_config=cache,
        parallel_config=ParallelConfig(),
        model_config=SimpleNamespace(dtype=torch.float32, max_model_len=4096),
    )
    groups = get_kv_cache_groups(config, specs)
    kv_config = get_kv_cache_config_from_groups(config, groups, 16 * 131072)
    caches = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout.LBHNC)
    return caches, kv_groups_of(kv_config)


def test_mamba_state_pages_are_mapped_as_the_attention_slot_they_share():
    caches, groups = hybrid_caches()
    assert [g.is_state for g in groups] == [True, True, False]
    layout = layout_of(caches, 128, 16, groups=groups)
    attention = caches["model.layers.2.mixer.attn"]
    assert layout.num_layers == 1 and layout.block_bytes == 131072
    assert layout.base_addrs == (attention.data_ptr(),)
    assert layout.kv_groups == tuple(g.kind for g in groups)
    # a state copies its 39,296 bytes (conv then SSM state), not the padding
    assert layout.group_copy_bytes == ((3 * 544 + 16 * 32 * 16) * 4,) * 2 + (0,)
    assert groups[0].kind == groups[1].kind
    assert groups[0].kind.startswith("state:mamba2:")


def test_state_pages_of_another_meaning_are_another_kind():
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvpush.connector.config import kv_group_kind

    def kind(shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype) -> str:
        spec = MambaSpec(
            block_size=4096,
            shapes=shapes,
            dtypes=(dtype, dtype),
            page_size_padded=131072,
        )
        return kv_group_kind(spec)

    sd = kind(((3, 544), (16, 32, 16)), torch.float32)
    assert sd != kind(((544, 3), (16, 32, 16)), torch.float32), "conv layout DS"
    assert sd != kind(((3, 544), (16, 32, 16)), torch.bfloat16)


def test_a_state_page_elsewhere_is_refused_naming_the_layer():
    caches, groups = hybrid_caches()
    caches["model.layers.4.mixer"] = torch.zeros_like(caches["model.layers.4.mixer"])
    with pytest.raises(ValueError, match=r"state layer model.layers.4.mixer"):
        layout_of(caches, 128, 16, groups=groups)
