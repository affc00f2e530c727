"""kvpush with vLLM's hybrid KV-cache manager, through vLLM's real
``Scheduler`` and the real ``KvPushConnector`` on both sides: a model with a
sliding-window group (32-token window) beside a full-attention one, 16-token
blocks, a 200-token prompt (13 blocks) prefilled in 64-token chunks.

What it pins down: prefill's triggers carry the blocks the request holds
at that moment (vLLM's current tables, where the window has let go of a
block: the null block), every real one pinned; decode registers its tables
with the null block where its window keeps nothing; and prefill's final
tables cover every block decode keeps, so the pairing
(:func:`kvpush.transfer.groups.aligned`) writes exactly those.
"""

from __future__ import annotations

import pathlib
from dataclasses import replace
from typing import Any

import pytest
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvpush.connector.config import KvGroup
from kvpush.connector.connector import KvPushConnector
from kvpush.connector.metadata import PrefillMetadata, PushTrigger
from kvpush.model import make_model
from kvpush.transfer import groups
from kvpush.transfer.messages import DecodeLeg, PrefillLeg
from tests.unit.test_connector_scheduler import config_for
from tests.unit.test_model import SMALL

BLOCK = 16
WINDOW = 32
CHUNK = 64
PROMPT = list(range(3, 203))  # 200 tokens: 13 blocks, the last holds 8
NUM_BLOCKS = -(-len(PROMPT) // BLOCK)
MAX_MODEL_LEN = 512
NULL = groups.NULL_BLOCK


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_model(tmp_path_factory.mktemp("hma") / "model", SMALL)


def _scheduler(model_dir: pathlib.Path, role: str, granularity: str) -> Scheduler:
    model = ModelConfig(
        model=str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0
    )
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=CHUNK,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvPushConnector",
            kv_role=role,
            engine_id="p0" if role == "kv_producer" else "d0",
            kv_connector_module_path="kvpush.connector.connector",
            kv_connector_extra_config={
                "side_channel_port": 5601,
                "push_granularity": granularity,
            },
        ),
    )
    config.cache_config.num_gpu_blocks = 64

    def spec(cls: type, **more: Any) -> Any:
        return cls(
            block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=model.dtype, **more
        )

    kv_cache = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["model.layers.0.self_attn.attn"],
                spec(SlidingWindowSpec, sliding_window=WINDOW),
            ),
            KVCacheGroupSpec(
                ["model.layers.1.self_attn.attn"], spec(FullAttentionSpec)
            ),
        ],
        kv_cache_layout="LBHNC",
    )
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def _request(
    params: dict[str, Any], prompt: list[int] = PROMPT, max_tokens: int = 4
) -> Request:
    init_none_hash(sha256)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        extra_args={"kv_transfer_params": params},
    )
    sampling.update_from_generation_config({}, eos_token_id=2)
    return Request(
        request_id="r1",
        prompt_token_ids=list(prompt),
        sampling_params=sampling,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def _finish_step(scheduler: Scheduler, out: Any, sampled: dict[str, list[int]]) -> None:
    ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[sampled.get(r, []) for r in ids],
        kv_connector_output=KVConnectorOutput(),
    )
    scheduler.update_from_output(out, runner)


def _prefill(scheduler: Scheduler, request: Request) -> list[tuple[PushTrigger, Any]]:
    """Prefill ``request`` chunk by chunk; each trigger with the request's
    tables as vLLM held them in that step."""
    scheduler.add_request(request)
    seen = []
    n = request.num_prompt_tokens
    while request.num_computed_tokens < n:  # one chunk a step
        out = scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, PrefillMetadata)
        tables = scheduler.kv_cache_manager.get_block_ids(request.request_id)
        seen += [(t, tables) for t in meta.triggers]
        last = request.num_computed_tokens >= n  # schedule() advanced it
        _finish_step(scheduler, out, {"r1": [77]} if last else {})
    return seen


def _pool(scheduler: Scheduler) -> Any:
    return scheduler.kv_cache_manager.block_pool


def test_kvpush_is_a_hybrid_manager_connector() -> None:
    assert issubclass(KvPushConnector, SupportsHMA)


@pytest.mark.parametrize("granularity", ["chunk", "request"])
def test_prefill_triggers_the_blocks_the_request_holds_and_pins_them(
    model_dir: pathlib.Path, granularity: str
) -> None:
    scheduler = _scheduler(model_dir, "kv_producer", granularity)
    request = _request(PrefillLeg(transfer_id="t1", decode_engine_id="d0").to_dict())

    seen = _prefill(scheduler, request)

    assert seen, "no trigger"
    assert seen[-1][0].final
    for trigger, tables in seen:
        start, end = (
            trigger.first_block,
            trigger.first_block + len(trigger.src_block_ids[1]),
        )
        assert trigger.src_block_ids == groups.span(tables, start, end)
    held = set(groups.real(scheduler.kv_cache_manager.get_block_ids("r1")))
    for b in {b for t, _ in seen for b in groups.real(t.src_block_ids)}:
        # our pin, and the request's while its window still holds the block
        want = 1 + (b in held)
        assert _pool(scheduler).blocks[b].ref_cnt == want, f"block {b}"
    window = tuple(b for t, _ in seen for b in t.src_block_ids[0])
    full = tuple(b for t, _ in seen for b in t.src_block_ids[1])
    assert len(full) == len(window) == NUM_BLOCKS and NULL not in full
    if granularity == "request":
        # the window (32 tokens) had let go of the prompt's first blocks
        # before the last chunk: they are null, never a stale id
        assert window[:8] == (NULL,) * 8 and NULL not in window[-2:]
    else:
        assert NULL not in window, "each chunk goes while its blocks are held"


def _decode_registers(
    model_dir: pathlib.Path, monkeypatch: Any, prompt: list[int] = PROMPT
) -> Any:
    scheduler = _scheduler(model_dir, "kv_consumer", "request")
    decode = scheduler.connector._decode  # type: ignore[union-attr]
    sent: list[Any] = []
    monkeypatch.setattr(
        decode, "_send", lambda host, port, msg: sent.append(msg) or True
    )
    leg = DecodeLeg(
        transfer_id="t1",
        prefill_engine_id="p0",
        prefill_host="127.0.0.1",
        prefill_port=5601,
    )
    scheduler.add_request(_request(leg.to_dict(), prompt))
    scheduler.schedule()
    (registration,) = sent
    return registration


def test_decode_registers_null_blocks_where_its_window_keeps_none(
    model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registration = _decode_registers(model_dir, monkeypatch)

    window, full = registration.dst_block_ids
    assert registration.first_block == 0
    assert len(window) == len(full) == NUM_BLOCKS
    assert NULL not in full
    kept = [b for b in window if b != NULL]
    assert window[: NUM_BLOCKS - len(kept)] == (NULL,) * (NUM_BLOCKS - len(kept))
    assert 1 <= len(kept) <= WINDOW // BLOCK + 1


EDGE = 11 * BLOCK + WINDOW - 1  # N - w + 1 on a block edge: 207 tokens


@pytest.mark.parametrize(("num_tokens", "kept_from"), [(len(PROMPT), 10), (EDGE, 10)])
def test_decode_keeps_the_blocks_its_first_step_reads(
    model_dir: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    num_tokens: int,
    kept_from: int,
) -> None:
    """vLLM computes the prompt's last token (``N - 1``) again on decode,
    its window reaching token ``N - w``. On the edge (``N - w + 1`` a
    multiple of the block) a whole-prompt load would leave that token's
    block out: decode loads all but the last token there instead."""
    registration = _decode_registers(
        model_dir, monkeypatch, list(range(3, 3 + num_tokens))
    )
    window = registration.dst_block_ids[0]
    assert next(i for i, b in enumerate(window) if b != NULL) == kept_from
    assert (num_tokens - WINDOW) // BLOCK == kept_from, "token N - w is kept"


@pytest.mark.parametrize("granularity", ["chunk", "request"])
@pytest.mark.parametrize(
    "num_tokens",
    [len(PROMPT), EDGE],
)
def test_prefill_holds_every_block_decode_keeps_past_its_finish(
    model_dir: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    granularity: str,
    num_tokens: int,
) -> None:
    """vLLM frees a finished request's windowed blocks below token
    ``N - w + 1`` before kvpush's finish hook runs; decode, computing token
    ``N - 1`` again, may keep the block holding ``N - w``. Every block
    decode keeps is in prefill's triggers and still allocated (pinned)
    once prefill's request finished."""
    prompt = list(range(3, 3 + num_tokens))
    registration = _decode_registers(model_dir, monkeypatch, prompt)
    prefill = _scheduler(model_dir, "kv_producer", granularity)
    leg = PrefillLeg(transfer_id="t1", decode_engine_id="d0").to_dict()
    request = _request(leg, prompt, max_tokens=1)
    seen = _prefill(prefill, request)
    assert request.is_finished(), "vLLM finished it (and freed what it let go)"
    src = groups.of(
        [[b for t, _ in seen for b in t.src_block_ids[g]] for g in range(2)]
    )
    dst = registration.dst_block_ids
    n = -(-num_tokens // BLOCK)

    s, d = groups.aligned(src, dst, 0, n, 0)

    assert d == tuple(tuple(b for b in g if b != NULL) for g in dst)
    for b in groups.real(s):
        assert _pool(prefill).blocks[b].ref_cnt >= 1, f"block {b} was freed"


def test_several_groups_push_per_chunk_never_per_layer() -> None:
    two = (KvGroup("sliding_window:32"), KvGroup("full"))
    for granularity in ("auto", "layer"):
        config = replace(config_for("prefill"), push_granularity=granularity)
        assert config.may_push_per_layer
        grouped = replace(config, kv_groups=two)
        assert not grouped.may_push_per_layer
        assert not grouped.pushes_per_layer(1 << 30)
