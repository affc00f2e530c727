"""Mamba state groups through vLLM's real ``Scheduler`` and the real
``KvPushConnector`` (prefill): a state group (one block a request, its
state updated in place by every forward) beside a full-attention group,
prefix caching off (vLLM's mode 'none'), a 200-token prompt in 64-token
chunks. Work in progress (``plans/mamba.md``): support.py still refuses
state groups, so the tests lift the refusal."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager

import kvpush.connector.connector as connector_module
from kvpush.connector import state_spec
from kvpush.connector.decode.first_token import (
    STATE_FIRST_TOKEN_WAIT_S,
    KvPushScheduler,
)
from kvpush.connector.metadata import PrefillMetadata
from kvpush.model import make_model
from kvpush.transfer import groups
from kvpush.transfer.messages import DecodeLeg, FirstToken, PrefillLeg, Registration
from tests.unit import test_connector_hma as hma
from tests.unit.test_model import SMALL

NULL = groups.NULL_BLOCK
PAGE = 4096


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_model(tmp_path_factory.mktemp("hma_state") / "model", SMALL)


def _prefill(model_dir: pathlib.Path, monkeypatch: Any, granularity: str) -> Scheduler:
    return _with_state(model_dir, monkeypatch, "kv_producer", granularity, Scheduler)


def _with_state(
    model_dir: pathlib.Path,
    monkeypatch: Any,
    role: str,
    granularity: str,
    cls: type,
) -> Any:
    """vLLM's scheduler ``cls`` over a state group and a full one."""
    monkeypatch.setattr(connector_module, "check_supported", lambda *a: None)
    config = hma._scheduler(model_dir, role, granularity).vllm_config
    config.cache_config.enable_prefix_caching = False
    if cls is not Scheduler:
        config.scheduler_config.scheduler_cls = f"{cls.__module__}.{cls.__name__}"
    state = MambaSpec(
        block_size=hma.MAX_MODEL_LEN,
        shapes=((3, 64), (2, 16, 8)),
        dtypes=(torch.float32, torch.float32),
        page_size_padded=PAGE,
        mamba_cache_mode="none",
    )
    full = FullAttentionSpec(
        block_size=hma.BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32
    )
    kv = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.mixer"], state),
            KVCacheGroupSpec(["model.layers.1.self_attn.attn"], full),
        ],
        kv_cache_layout="LBHNC",
    )
    return cls(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=hma.MAX_MODEL_LEN,  # the lcm of the groups' block sizes
    )


@pytest.mark.parametrize("granularity", ["chunk", "request"])
def test_the_state_goes_once_with_the_prompts_last_block(
    model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch, granularity: str
) -> None:
    scheduler = _prefill(model_dir, monkeypatch, granularity)
    leg = PrefillLeg(transfer_id="t1", decode_engine_id="d0").to_dict()
    request = hma._request(leg, max_tokens=1)

    seen = hma._prefill(scheduler, request)

    (state_block,) = groups.real(seen[0][1][:1])  # vLLM's one state block
    last = seen[-1][0]
    assert last.final and last.src_block_ids[0][-1] == state_block
    earlier = [b for t, _ in seen[:-1] for b in t.src_block_ids[0]]
    assert set(earlier) <= {NULL}, "never before the last chunk's forward"
    assert set(last.src_block_ids[0][:-1]) <= {NULL}
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.blocks[state_block].ref_cnt >= 1, "pinned past the finish"


def test_a_leg_that_would_forward_again_is_not_pushed(
    model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = _prefill(model_dir, monkeypatch, "chunk")
    leg = PrefillLeg(transfer_id="t1", decode_engine_id="d0").to_dict()
    scheduler.add_request(hma._request(leg, max_tokens=4))

    out = scheduler.schedule()

    meta = out.kv_connector_metadata
    assert isinstance(meta, PrefillMetadata)
    assert meta.triggers == [] and meta.cancels == ["t1"]


def _decode(model_dir: pathlib.Path, monkeypatch: Any, cls: type) -> tuple[Any, list]:
    scheduler = _with_state(model_dir, monkeypatch, "kv_consumer", "request", cls)
    decode = scheduler.connector._decode
    sent: list[Any] = []
    monkeypatch.setattr(
        decode, "_send", lambda host, port, msg: sent.append(msg) or True
    )
    return scheduler, sent


LEG = DecodeLeg(
    transfer_id="t1",
    prefill_engine_id="p0",
    prefill_host="127.0.0.1",
    prefill_port=5601,
).to_dict()


def test_decode_registers_the_state_as_the_prompts_last_block(
    model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler, sent = _decode(model_dir, monkeypatch, KvPushScheduler)
    scheduler.add_request(hma._request(LEG))

    scheduler.schedule()

    (registration,) = sent
    state, full = registration.dst_block_ids
    assert len(state) == len(full) == hma.NUM_BLOCKS
    assert state[:-1] == (NULL,) * (hma.NUM_BLOCKS - 1) and state[-1] != NULL


@pytest.mark.parametrize(
    ("cls", "sampling"),
    [(Scheduler, {}), (KvPushScheduler, {"min_tokens": 4})],
    ids=["vllm's scheduler", "min_tokens"],
)
def test_a_leg_that_would_be_computed_again_is_served_locally(
    model_dir: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    cls: type,
    sampling: dict[str, Any],
) -> None:
    """vLLM would compute the whole loaded prompt's last token again,
    applying it to the loaded state twice: decode loads nothing."""
    scheduler, sent = _decode(model_dir, monkeypatch, cls)
    request = hma._request(LEG)
    for name, value in sampling.items():
        setattr(request.sampling_params, name, value)
    scheduler.add_request(request)

    out = scheduler.schedule()

    assert not any(isinstance(m, Registration) for m in sent)
    assert out.num_scheduled_tokens.get("r1", 0) > 0, "computed on decode"
    counters = scheduler.connector._decode.counters
    assert counters.get("rejected.state_rewind") == 1


def _landed(scheduler: Any, request: Any) -> None:
    """The whole prompt's KV (and state) landed on decode."""
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {}, "it waits for the remote KV"
    runner = ModelRunnerOutput(
        req_ids=[], req_id_to_index={}, sampled_token_ids=[],
        kv_connector_output=KVConnectorOutput(finished_recving={"r1"}),
    )  # fmt: skip
    scheduler.update_from_output(out, runner)


def test_a_loaded_state_continues_from_prefills_first_token(
    model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler, _ = _decode(model_dir, monkeypatch, KvPushScheduler)
    request = hma._request(LEG)
    _landed(scheduler, request)
    scheduler.connector._decode._first_tokens["t1"] = FirstToken("t1", "prefill0", 77)

    out = scheduler.schedule()

    assert out.num_scheduled_tokens == {"r1": 1}, "t1 only: nothing again"
    assert request.num_computed_tokens == len(hma.PROMPT) + 1
    counters = scheduler.connector._decode.counters
    assert counters.get("first_token.continued") == 1
    assert not counters.get("first_token.recomputed.state_rewound")


def test_a_loaded_state_whose_first_token_never_came_is_computed_whole(
    model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler, _ = _decode(model_dir, monkeypatch, KvPushScheduler)
    now = [100.0]
    scheduler._kvpush_clock = lambda: now[0]
    request = hma._request(LEG)
    _landed(scheduler, request)
    assert scheduler.schedule().num_scheduled_tokens == {}, "waits for t1"

    now[0] += STATE_FIRST_TOKEN_WAIT_S
    out = scheduler.schedule()

    assert out.num_scheduled_tokens == {"r1": hma.CHUNK}, "from token 0"
    counters = scheduler.connector._decode.counters
    assert counters.get("first_token.recomputed.state_without_t1") == 1
    assert not counters.get("first_token.recomputed.state_rewound")


def test_a_state_kvpush_cannot_split_is_not_loaded_from_another_tp_size(
    model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model's config names no Mamba2 group count: the page is not
    described (connector/state_spec.py), so it copies between equal TP
    sizes only; decode computes the request itself."""
    scheduler, sent = _decode(model_dir, monkeypatch, KvPushScheduler)
    assert scheduler.connector._decode.config.kv_groups[0].page is None
    leg = dict(LEG, prefill_tp=2)
    scheduler.add_request(hma._request(leg))

    scheduler.schedule()

    assert not any(isinstance(m, Registration) for m in sent)
    assert scheduler.connector._decode.counters.get("rejected.state_rewind") == 1


def test_a_described_state_is_loaded_from_another_tp_size(
    model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the group count known (2 groups of 8, 2 heads of 16: the
    spec's shapes) the page splits over prefill TP 2: decode registers."""
    monkeypatch.setattr(state_spec, "_n_groups", lambda model_config: 2)
    scheduler, sent = _decode(model_dir, monkeypatch, KvPushScheduler)
    page = scheduler.connector._decode.config.kv_groups[0].page
    assert page is not None and page.problem(2) is None
    leg = dict(LEG, prefill_tp=2)
    scheduler.add_request(hma._request(leg))

    scheduler.schedule()

    registrations = [m for m in sent if isinstance(m, Registration)]
    assert len(registrations) == 2, "one to each prefill rank"
    assert all(r.dst_block_ids[0][-1] != NULL for r in registrations)
    assert not scheduler.connector._decode.counters.get("rejected.state_rewind")
