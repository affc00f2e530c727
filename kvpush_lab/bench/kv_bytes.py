"""KV bytes written per request, against what decode needs.

The P/D connectors count the bytes they move on the instances' ``/metrics``:
kvpush's prefill its WRITEs (``vllm:kvpush_write_bytes``), vLLM's NIXL
connectors every transfer (``vllm:nixl_bytes_transferred``). The benchmark
reads the histograms' sums before and after each point (:mod:`meters`); the
difference over the point's answered requests is the bytes moved per
request. What decode needs is :func:`kvpush.model.kv_size.pushed_bytes` of
each prompt (whole blocks of the full-attention layers, a windowed layer's
window only, with vLLM's hybrid KV-cache manager on), times the decode TP
size for an MLA model, whose every rank keeps the whole latent. A ratio of
1 is the minimum; a request the router served without a transfer (``auto``
binding) lowers it. Pure apart from the readers' inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec

from kvpush.model.kv_size import is_mla, pushed_bytes
from kvpush.telemetry import names
from kvpush.telemetry.names import Family
from kvpush.telemetry.reader import Exposition

# The histogram whose sum is a configuration's bytes moved.
BYTES_FAMILY: dict[str, Family] = {
    "kvpush": names.KVPUSH_WRITE_BYTES,
    "vllm-push": names.NIXL_BYTES_TRANSFERRED,
    "vllm-pull": names.NIXL_BYTES_TRANSFERRED,
}


class KvBytes(msgspec.Struct, frozen=True, kw_only=True):
    """One point's KV bytes per answered request: moved and needed."""

    num_requests: int
    written: float  # bytes moved per request (mean)
    needed: float | None  # decode's need per request (mean); None: not known

    @property
    def of_needed(self) -> float | None:
        if not self.needed:
            return None
        return self.written / self.needed


def bytes_moved(text: str, mode: str) -> float | None:
    """The bytes ``mode``'s connector moved so far, from one ``/metrics``
    text (0 where it exports none); None for a mode that moves none."""
    family = BYTES_FAMILY.get(mode)
    if family is None:
        return None
    return Exposition.parse(text).total(family.sum) or 0.0


def block_size(text: str) -> int | None:
    """The instance's KV block size (``vllm:cache_config_info``)."""
    for sample in Exposition.parse(text).samples(names.CACHE_CONFIG_INFO):
        value = sample.labels.get("block_size", "")
        if value.isdigit():
            return int(value)
    return None


def kv_bytes(
    moved: float,
    prompt_lens: Sequence[int],
    model: Path,
    dtype: str,
    block: int | None,
    decode_tp: int,
) -> KvBytes | None:
    """Per request of ``prompt_lens`` (the point's answered requests):
    ``moved`` bytes over them, and decode's need (None where the dtype or
    the block size is not known)."""
    if not prompt_lens:
        return None
    needed = None
    if block is not None and dtype != "auto":
        copies = decode_tp if is_mla(model) else 1
        total = sum(pushed_bytes(model, dtype, n, block) for n in prompt_lens)
        needed = copies * total / len(prompt_lens)
    return KvBytes(
        num_requests=len(prompt_lens),
        written=moved / len(prompt_lens),
        needed=needed,
    )
