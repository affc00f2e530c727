"""kvpush.connector.state_spec against vLLM's own state shapes: the page a
rank of any TP size describes is the same description, its content the
bytes vLLM's MambaSpec holds, and what it cannot describe is None."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers.mamba import mamba_utils
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MambaSpec

from kvpush.connector.state_spec import state_page_of
from kvpush.transfer.state_pages import ConvLayout


@pytest.fixture(params=["SD", "DS"])
def conv_layout(request, monkeypatch) -> ConvLayout:
    dim_first = request.param == "DS"
    monkeypatch.setattr(mamba_utils, "is_conv_state_dim_first", lambda: dim_first)
    return ConvLayout(request.param)


def mamba2_spec(tp: int, n_groups: int, heads: int = 16) -> MambaSpec:
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=tp, intermediate_size=heads * 32, n_groups=n_groups,
        num_heads=heads, head_dim=32, state_size=16, conv_kernel=4,
    )  # fmt: skip
    return MambaSpec(
        block_size=64, shapes=tuple(shapes), dtypes=(torch.float32, torch.float32)
    )


def gdn_spec(tp: int) -> MambaSpec:
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp_world_size=tp, num_k_heads=4, num_v_heads=8, head_k_dim=64,
        head_v_dim=64, conv_kernel_size=4,
    )  # fmt: skip
    return MambaSpec(
        block_size=64,
        shapes=tuple(shapes),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
    )


def model(n_groups: int | None) -> SimpleNamespace:
    hf = SimpleNamespace() if n_groups is None else SimpleNamespace(n_groups=n_groups)
    return SimpleNamespace(hf_config=hf)


@pytest.mark.parametrize("n_groups", [1, 4, 8])  # vLLM: 1, or a multiple of TP
def test_mamba2_pages_are_one_description_at_every_tp(conv_layout, n_groups) -> None:
    pages = {}
    for tp in (1, 2, 4):
        spec = mamba2_spec(tp, n_groups)
        page = state_page_of(spec, model(n_groups), tp)
        assert page is not None
        assert page.conv_layout is conv_layout
        assert page.content_bytes(tp) == spec.state_content_size_bytes
        pages[tp] = page
    assert pages[1] == pages[2] == pages[4]
    assert pages[1].conv_parts[1].units == n_groups


def test_gdn_pages_are_one_description_at_every_tp(conv_layout) -> None:
    pages = [state_page_of(gdn_spec(tp), model(None), tp) for tp in (1, 2, 4)]
    assert pages[0] is not None and pages[0] == pages[1] == pages[2]
    assert pages[0].dtypes == ("bfloat16", "float32")
    assert [p.units for p in pages[0].conv_parts] == [4, 4, 8]


def test_short_conv_pages_are_one_description_at_every_tp(conv_layout) -> None:
    pages = []
    for tp in (1, 2, 4):
        (shape,) = MambaStateShapeCalculator.short_conv_state_shape(
            tp_world_size=tp, intermediate_size=256, conv_kernel=3
        )
        spec = MambaSpec(
            block_size=64,
            shapes=(shape,),
            dtypes=(torch.float32,),
            mamba_type=MambaAttentionBackendEnum.SHORT_CONV,
        )
        page = state_page_of(spec, model(None), tp)
        assert page is not None and page.recurrent is None
        assert page.content_bytes(tp) == spec.state_content_size_bytes
        pages.append(page)
    assert pages[0] == pages[1] == pages[2]


def test_what_cannot_be_described_is_none(conv_layout) -> None:
    # Mamba2 without a group count in the config
    assert state_page_of(mamba2_spec(2, 1), model(None), 2) is None
    # a group count that does not add up to the shapes
    assert state_page_of(mamba2_spec(1, 2), model(4), 1) is None
    # a state of one shape (Mamba1-like short conv)
    one = MambaSpec(block_size=64, shapes=((3, 64),), dtypes=(torch.float32,))
    assert state_page_of(one, model(1), 1) is None
