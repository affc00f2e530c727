"""Describe a vLLM Mamba layer's state page as a
:class:`~kvpush.transfer.state_pages.StatePage`, the same at every TP size,
so that two instances of different TP sizes can split it alike.

From vLLM 0.32's ``MambaSpec`` of one rank (its two state shapes and
dtypes, the conv layout vLLM resolved) and the model's config:

* Mamba2 (``MambaStateShapeCalculator.mamba2_state_shape``): conv
  ``x | B | C``, x = the rank's heads x ``head_dim`` channels, B and C its
  groups x ``state_size`` (vLLM pads ``n_groups`` to the TP size when it
  does not divide it: each rank then holds a copy of one group); recurrent
  ``(heads, head_dim, state_size)``. ``n_groups`` comes from the config.
* gated delta net (``gated_delta_net_state_shape``): conv ``Q | K | V``,
  Q and K the rank's key heads x ``head_k_dim``, V its value heads x
  ``head_v_dim``; recurrent ``(value heads, head_v_dim, head_k_dim)``. All
  read from the shapes.
* short convolution (LFM2, ``short_conv_state_shape``): a conv state
  alone, the rank's share of ``conv_dim`` channels.

Anything else (another state kind, more than two states, shapes that do
not add up) is described as None: its pages copy whole, between equal TP
sizes only (:meth:`kvpush.connector.decode.scheduler` says so per leg).
"""

from __future__ import annotations

from typing import Any

from kvpush.transfer.state_pages import ConvLayout, StatePage, StatePart

# the config names of Mamba2's group count across vLLM's Mamba2 models
_GROUP_NAMES = ("n_groups", "mamba_n_groups", "mamba_ngroups")


def state_page_of(spec: Any, model_config: Any, tp_size: int) -> StatePage | None:
    """``spec``'s page (a ``MambaSpec`` of one rank of TP ``tp_size``), or
    None when kvpush cannot describe it (see the module)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.utils.torch_utils import get_dtype_size

    shapes, dtypes = tuple(spec.shapes), tuple(spec.dtypes)
    kind = spec.mamba_type.name.lower()
    if not shapes or len(shapes[0]) != 2:
        return None
    layout = ConvLayout.DS if is_conv_state_dim_first() else ConvLayout.SD
    dim, rows = shapes[0] if layout is ConvLayout.DS else reversed(shapes[0])
    parts: tuple[StatePart, ...]
    recurrent: StatePart | None
    if kind == "short_conv" and len(shapes) == 1:
        parts, recurrent = (StatePart(dim * tp_size, 1),), None
    elif len(shapes) == 2 and len(shapes[1]) == 3:
        heads, a, b = shapes[1]
        found = _conv_parts(kind, dim, heads, a, b, tp_size, model_config)
        if found is None:
            return None
        parts = found
        recurrent = StatePart(heads * tp_size, a * b * get_dtype_size(dtypes[1]))
    else:
        return None
    page = StatePage(
        kind=kind,
        cache_mode=str(spec.mamba_cache_mode),
        conv_layout=layout,
        conv_rows=rows,
        conv_item_bytes=get_dtype_size(dtypes[0]),
        conv_parts=parts,
        recurrent=recurrent,
        dtypes=tuple(str(d).removeprefix("torch.") for d in dtypes),
    )
    if page.problem(tp_size) or page.conv_dim(tp_size) != dim:
        return None
    if page.content_bytes(tp_size) != spec.state_content_size_bytes:
        return None
    return page


def _conv_parts(
    kind: str, dim: int, heads: int, a: int, b: int, tp: int, model_config: Any
) -> tuple[StatePart, ...] | None:
    """The conv state's sub-projections for state kind ``kind``, or None."""
    if kind == "mamba2":
        groups = _n_groups(model_config)
        if groups is None:
            return None
        x, bc = StatePart(heads * tp, a), StatePart(groups, b)
        return (x, bc, bc)
    if kind == "gdn_attn":
        v_channels = heads * a
        qk = dim - v_channels
        if qk <= 0 or qk % (2 * b):
            return None
        q = StatePart(qk // (2 * b) * tp, b)
        return (q, q, StatePart(heads * tp, a))
    return None


def _n_groups(model_config: Any) -> int | None:
    hf = getattr(model_config, "hf_text_config", None) or getattr(
        model_config, "hf_config", None
    )
    for name in _GROUP_NAMES:
        value = getattr(hf, name, None)
        if isinstance(value, int) and value >= 1:
            return value
    return None
