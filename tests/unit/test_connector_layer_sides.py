"""Per-layer push on prefill's worker side and in the config: which chunks
go per layer (the ``auto`` rule), what ``save_kv_layer`` hands the writer
(and that it does nothing in a step with no such chunk), what vLLM is told
about CUDA graphs, and how a forward's layers become ready.

Uses the recording writer of ``test_connector_worker.py`` and a fake NIXL
agent for the KV layout (2 layers of 256-byte blocks).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace

import pytest

from kvpush.connector.config import DEFAULT_LAYER_PUSH_MIN_BYTES, ConnectorConfig
from kvpush.connector.connector import KvPushConnector
from kvpush.connector.metadata import PrefillMetadata, PushTrigger
from kvpush.connector.prefill.fence import (
    ALL_LAYERS,
    NO_FENCE,
    EventFence,
    LayerFences,
    NoFence,
)
from kvpush.connector.prefill.worker import PrefillWorker
from kvpush.transfer.groups import one
from kvpush.transfer.matcher import ReadyKv
from tests.fakes.fake_nixl import FakeNixlIO
from tests.unit.test_connector_worker import RecordingWriter, make_config
from tests.unit.test_connector_writer import BLOCK_BYTES, SRC_BASE, layout

LAYER_NAMES = {"model.layers.0.self_attn.attn": 0, "model.layers.1.self_attn.attn": 1}
NAME_0, NAME_1 = LAYER_NAMES


def trigger(tid: str, blocks: tuple[int, ...], **kw) -> PushTrigger:
    return PushTrigger(
        req_id=f"r-{tid}",
        transfer_id=tid,
        src_block_ids=one(blocks),
        num_tokens=600,
        decode_engine_id="d0",
        final=False,
        **kw,
    )


def worker_for(granularity: str, min_bytes: int = DEFAULT_LAYER_PUSH_MIN_BYTES):
    config = replace(
        make_config("prefill"),
        push_granularity=granularity,
        layer_push_min_bytes=min_bytes,
    )
    worker = PrefillWorker(config)
    writer = RecordingWriter()
    worker._writer = writer  # type: ignore[assignment]
    worker._io = FakeNixlIO("kvpush-p0", layout(SRC_BASE))  # type: ignore[assignment]
    worker._layer_of = dict(LAYER_NAMES)
    return worker, writer


@pytest.fixture
def auto() -> Iterator[tuple[PrefillWorker, RecordingWriter]]:
    # a chunk goes per layer from 3 blocks' KV in one layer
    worker, writer = worker_for("auto", min_bytes=3 * BLOCK_BYTES)
    yield worker, writer
    worker.close()


def test_auto_pushes_a_large_chunk_per_layer_and_a_small_one_per_chunk(auto):
    worker, writer = auto
    big, small = trigger("big", (1, 2, 3)), trigger("small", (7, 8))
    worker.bind(PrefillMetadata(triggers=[big, small]))

    ((ready, _, fences),) = writer.ready
    assert ready.transfer_id == "big", "handed over before the forward"
    assert isinstance(fences, LayerFences) and fences.num_layers == 2

    worker.save_kv_layer(NAME_0)
    worker.save_kv_layer(NAME_1)
    assert writer.layers == [(fences, 0, NO_FENCE), (fences, 1, NO_FENCE)]

    worker.wait_for_save()
    assert [r.transfer_id for r, _, _ in writer.ready] == ["big", "small"]
    assert isinstance(writer.ready[1][2], NoFence), "small: one fence per chunk"
    assert writer.layers[-1] == (fences, ALL_LAYERS, NO_FENCE), "every layer"


def test_save_kv_layer_does_nothing_in_a_step_with_no_chunk_per_layer(auto):
    worker, writer = auto
    worker.bind(PrefillMetadata(triggers=[trigger("small", (7, 8))]))
    worker.save_kv_layer(NAME_0)
    worker.wait_for_save()
    worker.bind(PrefillMetadata())  # an ordinary step: nothing to push
    worker.save_kv_layer(NAME_0)
    worker.wait_for_save()

    assert writer.layers == []
    assert [r.transfer_id for r, _, _ in writer.ready] == ["small"]


def test_a_layer_name_not_in_the_cache_is_ignored(auto):
    worker, writer = auto
    worker.bind(PrefillMetadata(triggers=[trigger("big", (1, 2, 3))]))
    worker.save_kv_layer("draft.layers.0.attn")  # e.g. a drafter's own layer
    assert writer.layers == []
    worker.wait_for_save()
    assert [layer for _, layer, _ in writer.layers] == [ALL_LAYERS]


def test_layer_pushes_even_a_one_block_chunk_per_layer_and_chunk_never():
    for granularity, per_layer in (("layer", True), ("chunk", False)):
        worker, writer = worker_for(granularity, min_bytes=1 << 30)
        try:
            worker.bind(PrefillMetadata(triggers=[trigger("t", (1,))]))
            assert bool(writer.ready) is per_layer, granularity
            worker.wait_for_save()
            assert len(writer.ready) == 1
        finally:
            worker.close()


def test_the_final_chunk_per_layer_marks_kv_ready_after_its_forward():
    worker, writer = worker_for("layer")
    try:
        last = replace(trigger("t", (1, 2)), final=True)
        worker.bind(PrefillMetadata(triggers=[last]))
        assert writer.computed == [], "handed over, not yet computed"
        worker.wait_for_save()
        assert writer.computed == [
            ReadyKv("t", one((1, 2)), 600, "d0", first_block=0, final=True)
        ]
    finally:
        worker.close()


# -- the rule and the config ----------------------------------------------------


@pytest.mark.parametrize(
    ("granularity", "layer_bytes", "per_layer"),
    [
        ("auto", DEFAULT_LAYER_PUSH_MIN_BYTES, True),
        ("auto", DEFAULT_LAYER_PUSH_MIN_BYTES - 1, False),
        ("layer", 1, True),
        ("chunk", 1 << 40, False),
        ("request", 1 << 40, False),
    ],
)
def test_auto_goes_per_layer_from_layer_push_min_bytes(
    granularity, layer_bytes, per_layer
):
    config = replace(make_config("prefill"), push_granularity=granularity)
    assert config.pushes_per_layer(layer_bytes) is per_layer


def test_layer_push_min_bytes_is_read_from_the_extra_config_and_checked():
    def vllm_config(extra: dict) -> SimpleNamespace:
        kv = SimpleNamespace(
            kv_role="kv_producer", engine_id="p0", kv_connector_extra_config=extra
        )
        cache = SimpleNamespace(block_size=16, cache_dtype="auto")
        return SimpleNamespace(
            kv_transfer_config=kv,
            cache_config=cache,
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
            instance_id="i",
        )

    extra = {"side_channel_port": 5600, "push_granularity": "auto"}
    config = ConnectorConfig.from_vllm(vllm_config({**extra}))
    assert config.layer_push_min_bytes == DEFAULT_LAYER_PUSH_MIN_BYTES == 2 << 20
    config = ConnectorConfig.from_vllm(
        vllm_config({**extra, "layer_push_min_bytes": 65536})
    )
    assert config.layer_push_min_bytes == 65536
    with pytest.raises(ValueError, match="layer_push_min_bytes must be >= 1"):
        ConnectorConfig.from_vllm(vllm_config({**extra, "layer_push_min_bytes": 0}))


@pytest.mark.parametrize(
    ("extra", "piecewise"),
    [
        ({}, True),  # the default, auto
        ({"push_granularity": "request"}, False),
        ({"push_granularity": "chunk"}, False),
        ({"push_granularity": "layer"}, True),
        ({"push_granularity": "auto"}, True),
    ],
)
def test_per_layer_push_asks_vllm_for_piecewise_cuda_graphs(extra, piecewise):
    assert KvPushConnector.requires_piecewise_for_cudagraph(extra) is piecewise


def test_the_piecewise_need_is_logged_once_at_start_up(caplog):
    from kvpush.connector.connector import _log_cudagraph_needs

    with caplog.at_level("WARNING", logger="kvpush.connector.connector"):
        _log_cudagraph_needs(replace(make_config("prefill"), push_granularity="auto"))
        _log_cudagraph_needs(
            replace(make_config("prefill"), push_granularity="request")
        )  # nothing to say
    (record,) = caplog.records
    assert "PIECEWISE" in record.getMessage() and "'auto'" in record.getMessage()


# -- a forward's layers ---------------------------------------------------------


class Pending:
    """A device fence that completes when told to."""

    def __init__(self) -> None:
        self.done = False

    def is_ready(self) -> bool:
        return self.done


def test_layers_are_ready_as_a_prefix_and_the_forward_covers_them_all():
    fences = LayerFences(4)
    assert fences.num_ready() == 0 and not fences.waits_on_device()
    fences.saved(0, NO_FENCE)
    fences.saved(2, NO_FENCE)  # out of order: waits for layer 1
    assert fences.num_ready() == 1
    device = Pending()
    fences.saved(1, EventFence(SimpleNamespace(query=lambda: device.done)))
    assert fences.num_ready() == 1 and fences.waits_on_device(), "polled"
    device.done = True
    assert fences.num_ready() == 3 and not fences.waits_on_device()

    fences.saved(ALL_LAYERS, NO_FENCE)  # layer 3 was never saved
    assert fences.num_ready() == 4 and fences.is_ready()
    fences.saved(9, NO_FENCE)  # out of range: ignored
    assert fences.num_ready() == 4
