"""Decode continues from prefill's first token (kvpush's scheduler class),
driven through vLLM's real schedulers, synchronous and async, with a
stand-in connector: the KV of the whole prompt lands, prefill's ``t1`` is
there, and decode's first step computes ``t1`` and samples the second
token; its first output carries both."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, LogprobsLists, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvpush.connector.decode.first_token import (
    KvPushAsyncScheduler,
    KvPushScheduler,
    NotGiven,
    why_not,
)
from kvpush.connector.decode.step_time import DEFAULT_S
from kvpush.model import make_model
from kvpush.transfer.messages import FirstToken, SampleLogprobs
from tests.unit.test_model import SMALL

BLOCK = 16
PROMPT = list(range(3, 43))  # 40 tokens: two full blocks and a partial one
T1, T2 = 77, 78
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_model(tmp_path_factory.mktemp("first_token") / "model", SMALL)


def _scheduler(model_dir: pathlib.Path, cls: type) -> Any:
    model = ModelConfig(
        model=str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0
    )
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=MAX_MODEL_LEN,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="FirstTokenConnector",
            kv_role="kv_consumer",
            kv_connector_module_path="tests.unit.fake_first_token_connector",
        ),
    )
    config.cache_config.num_gpu_blocks = 64
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=model.dtype
    )
    kv_cache = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    return cls(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def _request(rid: str = "r1", **sampling: Any) -> Request:
    init_none_hash(sha256)
    params = SamplingParams(**{"max_tokens": 8, "temperature": 0.0, **sampling})
    params.update_from_generation_config({}, eos_token_id=2)
    return Request(
        request_id=rid,
        prompt_token_ids=list(PROMPT),
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def _step(scheduler: Any, out: SchedulerOutput, sampled: dict[str, list[int]],
          recved: set[str] | None = None,
          logprobs: LogprobsLists | None = None) -> dict[str, list[int]]:  # fmt: skip
    """Finish ``out`` as a model runner would: ``sampled`` tokens for the
    requests it sampled, ``recved`` loads landed, ``logprobs`` one row per
    scheduled request; the new tokens per request."""
    return {
        rid: tokens
        for rid, (tokens, _) in _step_logprobs(
            scheduler, out, sampled, recved, logprobs
        ).items()
    }


def _step_logprobs(scheduler: Any, out: SchedulerOutput,
                   sampled: dict[str, list[int]], recved: set[str] | None = None,
                   logprobs: LogprobsLists | None = None,
                   ) -> dict[str, tuple[list[int], Any]]:  # fmt: skip
    """:func:`_step`, each request's new tokens with their logprobs."""
    ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[sampled.get(r, []) for r in ids],
        logprobs=logprobs,
        kv_connector_output=KVConnectorOutput(finished_recving=recved or set()),
    )
    engine_outputs = scheduler.update_from_output(out, runner)
    return {
        o.request_id: (list(o.new_token_ids), o.new_logprobs)
        for outputs in engine_outputs.values()
        for o in outputs.outputs
    }


def _rows(token_ids: list[list[int]], logprobs: list[list[float]],
          ranks: list[int]) -> LogprobsLists:  # fmt: skip
    return LogprobsLists(
        np.asarray(token_ids, dtype=np.int32),
        np.asarray(logprobs, dtype=np.float32),
        np.asarray(ranks, dtype=np.int32),
    )


def _land(scheduler: Any, request: Request) -> None:
    """Admit ``request``, its prompt claimed as arriving, and report it landed."""
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {}  # it waits for the remote KV
    assert _step(scheduler, out, {}, {request.request_id}) == {}


@pytest.mark.parametrize("cls", [KvPushScheduler, KvPushAsyncScheduler])
def test_decode_continues_from_prefills_first_token(
    model_dir: pathlib.Path, cls: type
) -> None:
    scheduler = _scheduler(model_dir, cls)
    request = _request()
    _land(scheduler, request)
    scheduler.connector.tokens["r1"] = T1

    out = scheduler.schedule()

    # one token computed (t1's KV), none recomputed; then t2 is sampled
    assert out.num_scheduled_tokens == {"r1": 1}
    new = out.scheduled_new_reqs[0]
    assert new.prompt_token_ids == [*PROMPT, T1]
    assert new.num_computed_tokens == len(PROMPT)
    assert scheduler.connector.outcomes == [None]
    assert _step(scheduler, out, {"r1": [T2]}) == {"r1": [T1, T2]}
    assert list(request.output_token_ids) == [T2]  # t1 is its prompt's, t2 its output
    assert request.max_tokens == 7  # ... and t1 counts against max_tokens


@pytest.mark.parametrize("cls", [KvPushScheduler, KvPushAsyncScheduler])
def test_without_prefills_token_decode_computes_it_again(
    model_dir: pathlib.Path, cls: type
) -> None:
    scheduler = _scheduler(model_dir, cls)
    _land(scheduler, _request())

    out = scheduler.schedule()

    assert out.num_scheduled_tokens == {"r1": 1}  # the prompt's last, again
    assert out.scheduled_new_reqs[0].prompt_token_ids == PROMPT
    assert out.scheduled_new_reqs[0].num_computed_tokens == len(PROMPT) - 1
    assert scheduler.connector.outcomes == []
    assert _step(scheduler, out, {"r1": [T1]}) == {"r1": [T1]}


@pytest.mark.parametrize("cls", [KvPushScheduler, KvPushAsyncScheduler])
def test_a_logprobs_request_continues_with_prefills_logprobs_of_t1(
    model_dir: pathlib.Path, cls: type
) -> None:
    scheduler = _scheduler(model_dir, cls)
    _land(scheduler, _request(logprobs=2))
    prefills = SampleLogprobs((T1, 5, T1), (-0.25, -1.5, -0.25), rank=1)
    scheduler.connector.tokens["r1"] = FirstToken("t-r1", "prefill0", T1, prefills)

    out = scheduler.schedule()

    assert out.num_scheduled_tokens == {"r1": 1}  # t1's KV only
    assert scheduler.connector.outcomes == [None]
    # decode's batch asked for 3 top logprobs (another request): rows of 4
    decodes = _rows([[T2, 9, T2, 11]], [[-0.5, -0.75, -0.5, -3.0]], [2])
    tokens, logprobs = _step_logprobs(scheduler, out, {"r1": [T2]}, None, decodes)["r1"]
    assert tokens == [T1, T2]
    assert logprobs.logprob_token_ids.tolist() == [[T1, 5, T1], [T2, 9, T2]]
    assert logprobs.logprobs.tolist() == [[-0.25, -1.5, -0.25], [-0.5, -0.75, -0.5]]
    assert logprobs.sampled_token_ranks.tolist() == [1, 2]


def test_a_logprobs_request_without_prefills_logprobs_computes_t1(
    model_dir: pathlib.Path,
) -> None:
    """Prefill without kvpush's scheduler class sends t1 alone."""
    scheduler = _scheduler(model_dir, KvPushScheduler)
    _land(scheduler, _request(logprobs=1))
    scheduler.connector.tokens["r1"] = T1

    out = scheduler.schedule()

    assert out.scheduled_new_reqs[0].prompt_token_ids == PROMPT
    assert out.scheduled_new_reqs[0].num_computed_tokens == len(PROMPT) - 1
    assert scheduler.connector.outcomes == [NotGiven.LOGPROBS]
    assert _step(scheduler, out, {"r1": [T1]}) == {"r1": [T1]}


def test_max_tokens_counts_the_given_token(model_dir: pathlib.Path) -> None:
    scheduler = _scheduler(model_dir, KvPushScheduler)
    request = _request(max_tokens=3)
    _land(scheduler, request)
    scheduler.connector.tokens["r1"] = T1
    tokens = _step(scheduler, scheduler.schedule(), {"r1": [T2]})["r1"]
    while not request.is_finished():
        tokens += _step(scheduler, scheduler.schedule(), {"r1": [T2 + len(tokens)]})[
            "r1"
        ]
    assert tokens == [T1, T2, T2 + 2]  # three tokens, t1 one of them


def _landed(rid: str = "r1", **sampling: Any) -> Request:
    request = _request(rid, **sampling)
    request.num_computed_tokens = request.num_tokens  # the whole prompt loaded
    return request


@pytest.mark.parametrize(
    ("sampling", "token", "reason"),
    [
        ({}, T1, None),
        ({"temperature": 1.0, "seed": 3}, T1, None),
        ({"repetition_penalty": 1.2}, T1, None),  # reads prompt and output alike
        ({"logprobs": 0}, T1, None),  # prefill sends t1's (logprobs_missing)
        ({"logprobs": -1}, T1, NotGiven.LOGPROBS),  # the whole vocabulary
        ({"prompt_logprobs": 0}, T1, NotGiven.LOGPROBS),
        ({"min_tokens": 4}, T1, NotGiven.READS_OUTPUT),
        ({"presence_penalty": 0.5}, T1, NotGiven.READS_OUTPUT),
        ({"frequency_penalty": 0.5}, T1, NotGiven.READS_OUTPUT),
        ({"max_tokens": 1}, T1, NotGiven.ENDS),
        ({}, 2, NotGiven.ENDS),  # end of sequence
        ({"stop_token_ids": [T1]}, T1, NotGiven.ENDS),
        ({"ignore_eos": True}, 2, None),  # end of sequence does not end it
    ],
)
def test_why_not(sampling: dict[str, Any], token: int, reason: NotGiven | None) -> None:
    assert why_not(_landed(**sampling), token, MAX_MODEL_LEN) is reason


def test_why_not_a_partial_load_or_a_later_token() -> None:
    partial = _request()
    partial.num_computed_tokens = len(PROMPT) - BLOCK
    assert why_not(partial, T1, MAX_MODEL_LEN) is NotGiven.PARTIAL_LOAD
    later = _landed()
    later.append_output_token_ids(T1)
    later.num_computed_tokens = later.num_tokens
    assert why_not(later, T2, MAX_MODEL_LEN) is NotGiven.NOT_FIRST
    assert why_not(_landed(), T1, len(PROMPT) + 1) is NotGiven.TOO_LONG


# -- an idle decode waits (a little) for a token that is on its way -------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _idle_with_a_landed_request(
    model_dir: pathlib.Path, cls: type
) -> tuple[Any, Clock]:
    scheduler = _scheduler(model_dir, cls)
    clock = Clock()
    scheduler._kvpush_clock = clock
    scheduler.connector.expected.add("r1")
    _land(scheduler, _request())
    return scheduler, clock


@pytest.mark.parametrize("cls", [KvPushScheduler, KvPushAsyncScheduler])
def test_an_idle_decode_waits_for_a_first_token_on_its_way(
    model_dir: pathlib.Path, cls: type
) -> None:
    scheduler, clock = _idle_with_a_landed_request(model_dir, cls)

    assert scheduler.schedule().num_scheduled_tokens == {}  # waits
    clock.now += DEFAULT_S / 2
    assert scheduler.schedule().num_scheduled_tokens == {}  # still within
    scheduler.connector.tokens["r1"] = T1  # it came

    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r1": 1}
    assert out.scheduled_new_reqs[0].prompt_token_ids == [*PROMPT, T1]
    assert scheduler.connector.outcomes == [None]


def test_the_wait_ends_at_its_deadline(model_dir: pathlib.Path) -> None:
    scheduler, clock = _idle_with_a_landed_request(model_dir, KvPushScheduler)
    assert scheduler.schedule().num_scheduled_tokens == {}
    clock.now += DEFAULT_S

    out = scheduler.schedule()  # computes t1 itself

    assert out.num_scheduled_tokens == {"r1": 1}
    assert out.scheduled_new_reqs[0].num_computed_tokens == len(PROMPT) - 1


@pytest.mark.parametrize("cls", [KvPushScheduler, KvPushAsyncScheduler])
def test_the_wait_lasts_a_lone_step_as_measured(
    model_dir: pathlib.Path, cls: type
) -> None:
    """On a decode whose lone steps take 20 ms (a large model), an idle
    request waits for t1 that long, not the tiny model's 5 ms."""
    scheduler = _scheduler(model_dir, cls)
    clock = Clock()
    scheduler._kvpush_clock = clock
    other = _request("r0", max_tokens=4)
    _land(scheduler, other)
    scheduler.connector.tokens["r0"] = T1
    for token in range(T2, T2 + 3):  # r0's lone steps, 20 ms each
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens == 1
        clock.now += 0.020
        _step(scheduler, out, {"r0": [token]})
    assert "r0" not in scheduler.requests  # it finished: the decode is idle
    scheduler.connector.expected.add("r1")
    _land(scheduler, _request())

    assert scheduler.schedule().num_scheduled_tokens == {}  # waits
    clock.now += 0.015  # past the default, within the step measured
    assert scheduler.schedule().num_scheduled_tokens == {}
    clock.now += 0.005
    out = scheduler.schedule()  # a step's worth: computes t1 itself
    assert out.num_scheduled_tokens == {"r1": 1}
    assert out.scheduled_new_reqs[0].num_computed_tokens == len(PROMPT) - 1


def test_a_busy_decode_does_not_wait(model_dir: pathlib.Path) -> None:
    scheduler = _scheduler(model_dir, KvPushScheduler)
    other = _request("r0")
    _land(scheduler, other)
    scheduler.connector.tokens["r0"] = T1
    _step(scheduler, scheduler.schedule(), {"r0": [T2]})  # r0 now runs
    scheduler.connector.expected.add("r1")
    scheduler.add_request(_request())
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r0": 1}  # r1 waits for its KV
    _step(scheduler, out, {"r0": [T2 + 1]}, {"r1"})  # ... which lands

    out = scheduler.schedule()

    assert out.num_scheduled_tokens == {"r0": 1, "r1": 1}  # r1 computes t1
    assert out.scheduled_new_reqs[0].num_computed_tokens == len(PROMPT) - 1


def test_a_request_that_could_not_continue_does_not_wait(
    model_dir: pathlib.Path,
) -> None:
    scheduler = _scheduler(model_dir, KvPushScheduler)
    scheduler.connector.expected.add("r1")
    _land(scheduler, _request(min_tokens=4))
    assert scheduler.schedule().num_scheduled_tokens == {"r1": 1}


# -- prefill's part: the logprobs of the first token it samples ------------------


@pytest.mark.parametrize("cls", [KvPushScheduler, KvPushAsyncScheduler])
def test_prefill_keeps_its_first_tokens_logprobs_for_the_connector(
    model_dir: pathlib.Path, cls: type
) -> None:
    scheduler = _scheduler(model_dir, cls)
    scheduler.connector.claimed.update({"p1", "p2", "d1"})  # computed here
    scheduler.connector.prefilled.update({"p1", "p2"})  # d1: a leg it decodes
    scheduler.add_request(_request("p1", logprobs=1))
    scheduler.add_request(_request("p2"))  # no logprobs asked
    scheduler.add_request(_request("d1", logprobs=1))
    out = scheduler.schedule()
    assert set(out.num_scheduled_tokens) == {"p1", "p2", "d1"}  # whole prompts
    rows = _rows([[T1, 5, 6], [T2, 7, 8], [T1, 5, 6]],
                 [[-0.25, -1.0, -2.0], [-0.5, -1.0, -2.0], [-0.25, -1.0, -2.0]],
                 [1, 1, 1])  # fmt: skip

    _step(scheduler, out, {"p1": [T1], "p2": [T2], "d1": [T1]}, None, rows)

    # cut to what p1 asked: the sampled token and its 1 top logprob; none
    # built for d1, whose first token this instance does not tell anyone
    assert scheduler.connector.kept == {"p1": SampleLogprobs((T1, 5), (-0.25, -1.0), 1)}
    scheduler.connector.kept.clear()
    out = scheduler.schedule()
    _step(scheduler, out, {"p1": [T2], "p2": [T1], "d1": [T2]}, None, rows)
    assert scheduler.connector.kept == {}  # only the first token's
