"""Decode continues from prefill's first token: kvpush's vLLM scheduler class.

When a request's whole prompt arrives from outside, vLLM's scheduler
computes its last prompt token again (``_update_waiting_for_remote_kv``
sets ``num_computed_tokens`` to the prompt's length − 1) so that decode's
first step samples the first token ``t1``. Bound early, prefill already
sampled ``t1`` and the router streamed it to the client (docs/architecture.md,
"The first token from prefill"): that step's token is thrown away.

With this class, decode spends no step on it. Prefill tells decode's
connector ``t1`` (:class:`~kvpush.transfer.messages.FirstToken`, a step
after the KV). When the request's KV has landed and ``t1`` is there,
:func:`continue_from` makes ``t1`` the prompt's last token before vLLM
looks at the request: ``N + 1`` tokens, ``N`` of them loaded, so vLLM
rewinds nothing and the first step computes ``t1``'s KV and samples the
second token. The request's first output gets ``t1`` in front, so decode's
API server detokenizes, counts and stop-checks the very tokens a colocated
instance would have (and the router drops ``t1`` as it always has).

Prefill sends ``t1`` a step after its forward, so on an idle decode the KV
often lands first. An idle decode (nothing running) then waits for ``t1``
up to one lone decode step, as measured on this instance
(:mod:`~kvpush.connector.decode.step_time`), rather than spend that step
computing it; a busy one never waits (its next step would carry the
recompute anyway).

It is only an optimisation: a request goes the old way (``t1`` computed
again; correct, one step slower) when ``t1`` did not come in time, or
when :func:`why_not` names a reason it cannot be given: vLLM would treat
``t1`` as a prompt token where it must be an output one (prompt logprobs,
``min_tokens``, presence and frequency penalties, repetition detection,
structured output), ``t1`` ends the request, or the prompt is not plain
token ids; or when the request asks sample logprobs and ``t1`` came
without them (:func:`logprobs_missing`).
``vllm:kvpush_events_total{event="first_token.*"}`` counts each outcome.

Logprobs: the same class on prefill keeps the sample logprobs of each
request's first token (``update_from_output``, before vLLM finishes the
request), cut to what the request asked, for the connector to send with
``t1``; decode puts them in front of its first output's own, so its API
server reports prefill's for ``t1``, as a colocated instance would its own.

For a model with per-request state (Mamba2, gated delta net) the
continuation is a rule, not an optimisation: vLLM computing the last
prompt token again would apply it to the loaded state twice. A request
that loaded such a state (the connector's ``requires_first_token``) waits
for ``t1`` busy or not, up to :data:`STATE_FIRST_TOKEN_WAIT_S`; without it
its load is failed and vLLM computes the prompt whole
(``first_token.recomputed.state_without_t1``).

vLLM's scheduler interface is not public; the mixin's overrides
(``_update_waiting_for_remote_kv``, ``_handle_blocked_waiting_request``,
``update_from_output``; ``schedule`` only times steps) are the hook,
pinned to vLLM 0.32 (``requirements``) and tested against its real
schedulers (``tests/unit/test_decode_first_token.py``). Use
:class:`KvPushScheduler` with vLLM's synchronous scheduling (the CPU
build's only one) and :class:`KvPushAsyncScheduler` with async scheduling
(GPUs' default): ``--scheduler-cls`` replaces vLLM's own choice of the two.
``kvpush up`` sets it on every prefill and decode of a pair.
"""

from __future__ import annotations

import enum
import logging
import time
from typing import Any

import numpy as np
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kvpush.connector.decode.step_time import LoneStepTime
from kvpush.transfer.messages import MAX_SAMPLE_LOGPROBS, FirstToken, SampleLogprobs

logger = logging.getLogger(__name__)

# How long a request that loaded a model's state (Mamba) waits for prefill's
# first token, busy decode or not, before it is computed whole instead.
STATE_FIRST_TOKEN_WAIT_S = 5.0


class NotGiven(enum.Enum):
    """Why decode computes ``t1`` itself though prefill's came."""

    PARTIAL_LOAD = "partial_load"  # the load failed, or left tokens to compute
    NOT_FIRST = "not_first"  # the request has output tokens already
    NOT_TOKENS = "not_tokens"  # prompt embeddings, multimodal or pooling
    LOGPROBS = "logprobs"  # prompt logprobs, or t1's logprobs did not come
    READS_OUTPUT = "reads_output"  # min_tokens, penalties, repetition, grammar
    ENDS = "ends"  # t1 stops the request, or it may have only one token
    TOO_LONG = "too_long"  # t1 reaches the model's length
    STATE_RECOMPUTED = "state_without_t1"  # a loaded state, no t1: all again
    STATE_REWOUND = "state_rewound"  # never: a loaded state saw its last token twice


def why_not(request: Any, token_id: int, max_model_len: int) -> NotGiven | None:
    """Why ``request`` (its KV landed) cannot continue from ``token_id``,
    or None when :func:`continue_from` may make it its prompt's last."""
    if request.num_computed_tokens != request.num_tokens:
        return NotGiven.PARTIAL_LOAD
    if request.num_output_tokens > 0:
        return NotGiven.NOT_FIRST
    reason = why_never(request)
    if reason is not None:
        return reason
    sp = request.sampling_params
    if token_id == sp.eos_token_id or token_id in (sp.stop_token_ids or ()):
        return NotGiven.ENDS
    if request.num_tokens + 1 >= max_model_len:
        return NotGiven.TOO_LONG
    return None


def why_never(request: Any) -> NotGiven | None:
    """Why ``request`` could not continue from any first token, known when
    it arrives (what it asks, not what it loads or samples), or None."""
    sp = request.sampling_params
    if (
        sp is None
        or request.prompt_token_ids is None
        or request.prompt_embeds is not None
        or request.prompt_is_token_ids is not None
        or request.mm_features
    ):
        return NotGiven.NOT_TOKENS
    k = sp.num_logprobs
    if sp.prompt_logprobs is not None or (k is not None and not sends_logprobs(k)):
        return NotGiven.LOGPROBS
    if (
        sp.min_tokens > 0
        or sp.presence_penalty != 0.0
        or sp.frequency_penalty != 0.0
        or sp.repetition_detection is not None
        or request.use_structured_output
    ):
        return NotGiven.READS_OUTPUT
    if request.max_tokens < 2:
        return NotGiven.ENDS
    return None


def sends_logprobs(k: int) -> bool:
    """Whether prefill sends ``t1``'s logprobs for a request asking ``k``
    top ones (``-1``, the whole vocabulary, and more than a ``FirstToken``
    carries are computed again on decode)."""
    return 0 <= k <= MAX_SAMPLE_LOGPROBS


def logprobs_missing(request: Any, logprobs: SampleLogprobs | None) -> bool:
    """Whether ``request`` asks for sample logprobs that prefill's
    ``logprobs`` of ``t1`` do not cover (none came: prefill runs without
    kvpush's scheduler class)."""
    k = request.sampling_params.num_logprobs
    return k is not None and (logprobs is None or len(logprobs.token_ids) < k + 1)


def sample_logprobs(lists: Any, index: int, k: int) -> SampleLogprobs:
    """Request ``index``'s first row of vLLM's ``LogprobsLists`` (the
    sampled token first, then the top ones), cut to the ``k + 1`` the
    request asked for."""
    row = lists.slice_request(index, 1)
    return SampleLogprobs(
        token_ids=tuple(int(t) for t in row.logprob_token_ids[0][: k + 1]),
        logprobs=tuple(float(x) for x in row.logprobs[0][: k + 1]),
        rank=int(row.sampled_token_ranks[0]),
    )


def with_first_logprobs(lists: Any, first: SampleLogprobs) -> Any:
    """vLLM's ``LogprobsLists`` of one request's new tokens with ``first``'s
    row in front (both cut to the narrower width: each holds at least the
    ``k + 1`` entries the request asked for, and vLLM reads no more)."""
    width = min(len(first.token_ids), lists.logprob_token_ids.shape[1])
    ids, values, ranks = (
        lists.logprob_token_ids,
        lists.logprobs,
        lists.sampled_token_ranks,
    )
    head_ids = np.asarray([first.token_ids[:width]], dtype=ids.dtype)
    head_values = np.asarray([first.logprobs[:width]], dtype=values.dtype)
    head_rank = np.asarray([first.rank], dtype=ranks.dtype)
    return type(lists)(
        np.vstack([head_ids, ids[:, :width]]),
        np.vstack([head_values, values[:, :width]]),
        np.concatenate([head_rank, ranks]),
        None,
    )


def continue_from(request: Any, token_id: int) -> None:
    """Make ``token_id`` the last prompt token of ``request`` (whose whole
    prompt is computed), and count it against ``max_tokens``: vLLM then
    computes it in the request's first step and samples the next one."""
    request.prompt_token_ids.append(token_id)
    request._all_token_ids.append(token_id)  # what all_token_ids shows
    request.num_prompt_tokens += 1
    request.max_tokens -= 1
    request.update_block_hashes()


def _requires(connector: Any, request: Any) -> bool:
    """The connector says ``request`` may only continue from ``t1``."""
    hook = getattr(connector, "requires_first_token", None)
    return callable(hook) and bool(hook(request))


class FirstTokenMixin:
    """The overrides, over either of vLLM's schedulers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kvpush_given: dict[str, FirstToken] = {}  # req id -> t1 it lacks
        self._kvpush_waits: dict[str, float] = {}  # req id -> wait deadline
        self._kvpush_clock = time.monotonic
        self._kvpush_step = LoneStepTime()  # how long an idle wait for t1 lasts

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        started = self._kvpush_clock()
        out: SchedulerOutput = super().schedule(throttle_prefills)  # type: ignore[misc]
        self._kvpush_step.started(id(out), started)
        return out

    def _handle_blocked_waiting_request(self, request: Any) -> bool:
        if self._waits_for_first_token(request):
            return False  # this step; the next asks again
        self._kvpush_waits.pop(request.request_id, None)
        return super()._handle_blocked_waiting_request(request)  # type: ignore[misc]

    def _waits_for_first_token(self, request: Any) -> bool:
        """Whether a request whose KV landed waits for prefill's ``t1``: the
        decode is idle, the request could continue from it, it is expected
        and has not come, and the wait's deadline has not passed."""
        rid = request.request_id
        connector: Any = self.connector  # type: ignore[attr-defined]
        if (
            request.status != RequestStatus.WAITING_FOR_REMOTE_KVS
            or rid not in self.finished_recving_kv_req_ids  # type: ignore[attr-defined]
            or rid in self.failed_recving_kv_req_ids  # type: ignore[attr-defined]
            or not hasattr(connector, "awaits_first_token")
        ):
            return False
        now = self._kvpush_clock()
        wait_s = self._kvpush_step.seconds
        if _requires(connector, request):
            wait_s = STATE_FIRST_TOKEN_WAIT_S  # busy or not: see the module
        elif self.running:  # type: ignore[attr-defined]
            return False
        deadline = self._kvpush_waits.setdefault(rid, now + wait_s)
        if now >= deadline or not connector.awaits_first_token(request):
            return False
        return why_not(request, -1, self.max_model_len) is None  # type: ignore[attr-defined]

    def _update_waiting_for_remote_kv(self, request: Any) -> None:
        given = self._give_first_token(request)
        connector: Any = self.connector  # type: ignore[attr-defined]
        required = _requires(connector, request)
        if required and not given:
            # a loaded state must not see its last prompt token again: fail
            # the load, vLLM frees the blocks and computes the prompt whole
            request.num_computed_tokens = 0
            self.failed_recving_kv_req_ids.add(request.request_id)  # type: ignore[attr-defined]
            connector.first_token_outcome(NotGiven.STATE_RECOMPUTED)
        super()._update_waiting_for_remote_kv(request)  # type: ignore[misc]
        rewound = request.num_computed_tokens == request.num_tokens - 1
        if required and not given and rewound:  # (given: t1 is to compute)
            logger.error(  # never: the rule above forbids it
                "kvpush: %s computes its last prompt token again over a loaded state",
                request.request_id,
            )
            connector.first_token_outcome(NotGiven.STATE_REWOUND)

    def _give_first_token(self, request: Any) -> bool:
        """Continue ``request`` from prefill's first token where it can;
        whether it did."""
        connector: Any = self.connector  # type: ignore[attr-defined]
        if not hasattr(connector, "first_token"):  # not kvpush's connector
            return False
        first: FirstToken | None = connector.first_token(request)
        if first is None:
            return False
        if request.request_id in self.failed_recving_kv_req_ids:  # type: ignore[attr-defined]
            reason: NotGiven | None = NotGiven.PARTIAL_LOAD
        else:
            reason = why_not(request, first.token_id, self.max_model_len)  # type: ignore[attr-defined]
        if reason is None and logprobs_missing(request, first.logprobs):
            reason = NotGiven.LOGPROBS
        connector.first_token_outcome(reason)
        if reason is None:
            continue_from(request, first.token_id)
            self._kvpush_given[request.request_id] = first
        return reason is None

    def _keep_first_logprobs(self, model_runner_output: Any) -> None:
        """Prefill's part: the logprobs of each request's first sampled
        token, for the connector to tell its decode with the token."""
        connector: Any = self.connector  # type: ignore[attr-defined]
        lists = model_runner_output.logprobs
        if lists is None or not hasattr(connector, "wants_first_logprobs"):
            return
        sampled = model_runner_output.sampled_token_ids
        for rid, index in model_runner_output.req_id_to_index.items():
            request = self.requests.get(rid)  # type: ignore[attr-defined]
            if request is None or request.num_output_tokens or not sampled[index]:
                continue  # not its first token (or none: a prompt's chunk)
            k = request.sampling_params.num_logprobs
            if k is None or not sends_logprobs(k):
                continue
            if connector.wants_first_logprobs(request):  # a leg prefilled here
                connector.keep_first_logprobs(request, sample_logprobs(lists, index, k))

    def update_from_output(
        self, scheduler_output: Any, model_runner_output: Any
    ) -> Any:
        self._keep_first_logprobs(model_runner_output)
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        self._kvpush_step.ended(
            id(scheduler_output),
            scheduler_output.total_num_scheduled_tokens,
            self._kvpush_clock(),
        )
        given = self._kvpush_given
        if given:
            for engine_outputs in outputs.values():
                for out in engine_outputs.outputs:
                    first = given.pop(out.request_id, None)
                    if first is None:
                        continue
                    out.new_token_ids = [first.token_id, *out.new_token_ids]
                    if out.new_logprobs is not None and first.logprobs is not None:
                        out.new_logprobs = with_first_logprobs(
                            out.new_logprobs, first.logprobs
                        )
        for kept in (given, self._kvpush_waits):  # of requests finished since
            for rid in [r for r in kept if r not in self.requests]:  # type: ignore[attr-defined]
                del kept[rid]
        return outputs


class KvPushScheduler(FirstTokenMixin, Scheduler):
    """vLLM's synchronous scheduler, continuing from prefill's first token."""


class KvPushAsyncScheduler(FirstTokenMixin, AsyncScheduler):
    """vLLM's async scheduler, continuing from prefill's first token."""
