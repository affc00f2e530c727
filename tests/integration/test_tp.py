"""Tensor parallelism on real CPU clusters: kvpush with prefill TP 2 /
decode TP 1 and prefill TP 1 / decode TP 2 (the tiny model's 2 KV heads
split one per rank on the TP 2 side) must give a colocated TP 1
instance's greedy text and logprobs (within 1e-4), for every API shape,
with a partial prefix hit on decode, 32 at once, either leg first; no
blocks are held afterwards. The mapping itself is property-tested in
``tests/unit/test_transfer_heads.py``; what the CPU backend runs here is in
``docs/tensor-parallel-cpu.md``."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from tests.integration.test_pd_matches_colocated import PDChecks

pytestmark = pytest.mark.integration


class TestKvPushPrefillTp2DecodeTp1(PDChecks):
    """Both prefill ranks write their head of the same decode blocks;
    decode waits for both Dones."""

    mode = "kvpush"
    cluster_options: ClassVar[dict[str, Any]] = {
        "max_num_batched_tokens": 256,
        "prefill_tp": 2,
        "decode_tp": 1,
    }


class TestKvPushPrefillTp1DecodeTp2(PDChecks):
    """Prefill's one rank writes each decode rank its head."""

    mode = "kvpush"
    cluster_options: ClassVar[dict[str, Any]] = {
        "max_num_batched_tokens": 256,
        "prefill_tp": 1,
        "decode_tp": 2,
    }
