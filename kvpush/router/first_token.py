"""The first token from prefill: what the client reads before decode answers.

A kvpush prefill leg samples the request's first token ``t1`` (``max_tokens``
1) and answers at once. With ``first_token_from = prefill`` the router
streams ``t1`` to the client the moment that answer arrives, instead of when
decode has received the KV and computed ``t1`` again. Decode runs the
client's request as before; the router drops decode's copy of ``t1`` after
checking it is the same token, and relays the rest. Both legs ask vLLM for
their token ids (``return_token_ids``). Decode computes the same ``t1`` for
a greedy request, and for a sampled one with a seed (both legs carry it); a
sampled request without one keeps decode's first token. The router does not
add a seed of its own: vLLM's CPU build (0.32) kills its engine on a seeded
request whose prompt spans several prefill chunks ("CPU Generator does not
use offset", ``_bookkeeping_sync``), and on GPUs seeded sampling is slower.

When decode's ``t1`` differs, or decode fails after ``t1`` went out, the
router continues from the prompt plus every token the client already has,
with a plain completions request (token ids) to a decode, and rewrites its
events into the client's format: the client never reads a text that does
not follow what it got.

Everything here is pure (bytes and dicts in, bytes out); ``head_start.py``
does the I/O. Requests for which this cannot be exact keep their first token
from decode (:func:`blocker` says why).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import msgspec

from kvpush.router.requests import (
    GREEDY_BELOW,
    STRUCTURED_OUTPUT_FIELDS,
    ParsedRequest,
    is_text_format,
    is_true,
)

DONE_EVENT = b"data: [DONE]\n\n"


class Outcome(Enum):
    """How one request's first token was served (the router counts each)."""

    PREFILL = "prefill"  # from prefill; decode's copy matched and was dropped
    ENDED = "ended"  # the request ended at its first token; no decode work
    CONTINUED = "continued"  # decode diverged or failed; continued from t1
    UNAVAILABLE = "unavailable"  # prefill's answer had no token ids: decode's


class Diverged(Exception):
    """Decode's stream does not follow the first token the client got."""


# Fields that make a streamed first token inexact, and why.
_BLOCKING_FIELDS: tuple[tuple[str, str], ...] = (
    ("stop", "stop strings hold text back"),
    ("min_tokens", "prefill's leg samples without min_tokens"),
    ("echo", "echo"),
    ("suffix", "suffix"),
    ("tools", "tool calls are parsed from the whole stream"),
    ("response_format", "structured output"),
    *((key, "structured output") for key in STRUCTURED_OUTPUT_FIELDS),
)


def blocker(parsed: ParsedRequest) -> str | None:
    """Why this request's first token cannot come from prefill (None: it can)."""
    body = parsed.body
    if not parsed.is_stream:
        return "not streamed"
    if body.get("n") not in (None, 1):
        return "n > 1"
    if parsed.wants_prompt_logprobs:
        return "prompt logprobs"
    if parsed.endpoint == "completions" and not _is_one_prompt(body.get("prompt")):
        return "a batch of prompts"
    if not _is_greedy(body) and body.get("seed") is None:
        return "sampled without a seed (decode would sample its own first token)"
    for key, why in _BLOCKING_FIELDS:
        value = body.get(key)
        if value not in (None, False, 0, "", [], {}) and not (
            key == "response_format" and is_text_format(value)
        ):
            return why
    return None


def leg_fields(parsed: ParsedRequest) -> dict[str, Any]:
    """The fields both legs add to the client's body: their token ids."""
    return {"return_token_ids": True}


def _is_greedy(body: dict[str, Any]) -> bool:
    """Greedy as vLLM reads it: a temperature below its threshold (absent:
    the model's default, which may sample)."""
    temperature = body.get("temperature")
    return isinstance(temperature, int | float) and temperature < GREEDY_BELOW


@dataclass(frozen=True)
class FirstToken:
    """Prefill's answer, as much of it as the client's stream needs."""

    token_id: int
    prompt_token_ids: list[int]
    text: str
    logprobs: Any  # the answer choice's, in the endpoint's format (or None)
    finish_reason: str | None
    stop_reason: Any
    id: str
    created: int
    model: str
    usage: dict[str, Any] | None


def read_answer(answer: bytes, parsed: ParsedRequest) -> FirstToken | None:
    """Prefill's one-token answer, or None when it lacks what is needed
    (token ids: an instance that ignores ``return_token_ids``)."""
    try:
        decoded = msgspec.json.decode(answer)
        choice = decoded["choices"][0]
        (token_id,) = choice["token_ids"]
        prompt_ids = decoded.get("prompt_token_ids") or choice.get("prompt_token_ids")
        if parsed.endpoint == "chat":
            text = choice["message"].get("content") or ""
        else:
            text = choice["text"]
        if not isinstance(prompt_ids, list) or not isinstance(token_id, int):
            return None
        return FirstToken(
            token_id=token_id,
            prompt_token_ids=prompt_ids,
            text=str(text),
            logprobs=choice.get("logprobs"),
            finish_reason=choice.get("finish_reason"),
            stop_reason=choice.get("stop_reason"),
            id=str(decoded["id"]),
            created=int(decoded.get("created", 0)),
            model=str(decoded.get("model", "")),
            usage=decoded.get("usage"),
        )
    except (msgspec.DecodeError, KeyError, IndexError, TypeError, ValueError):
        return None


def max_new_tokens(parsed: ParsedRequest) -> int | None:
    """The client's output limit (None: vLLM's default, the context's rest)."""
    body = parsed.body
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return value if isinstance(value, int) else None


def asks_one_token(parsed: ParsedRequest) -> bool:
    """Whether the client asked for one token at most (``max_tokens`` 1): the
    request is whole at ``t1``, whatever its finish reason."""
    return max_new_tokens(parsed) == 1


def ends_at_first(first: FirstToken, parsed: ParsedRequest) -> bool:
    """Whether the request is complete with ``t1``: it stopped (end of
    sequence or a stop token) or may produce only one token."""
    return first.finish_reason == "stop" or asks_one_token(parsed)


def opening_events(first: FirstToken, parsed: ParsedRequest) -> bytes:
    """The events the client gets from prefill's answer: its stream's start
    and ``t1`` (then, for a request that ends there, its end)."""
    ends = ends_at_first(first, parsed)
    finish = (first.finish_reason or "length") if ends else None
    wants_ids = wants_token_ids(parsed)
    continuous = _stream_option(parsed, "continuous_usage_stats")
    usage = _usage(first, 1) if continuous else None
    choice: dict[str, Any]
    events = []
    if parsed.endpoint == "chat":
        role: dict[str, Any] = {
            "index": 0,
            "delta": {"role": _chat_role(parsed), "content": ""},
        }
        role.update(logprobs=None, finish_reason=None)
        extra = {"prompt_token_ids": first.prompt_token_ids} if wants_ids else {}
        events.append(
            _chunk(
                first, parsed, [role], extra, _usage(first, 0) if continuous else None
            )
        )
        choice = {"index": 0, "delta": {"content": first.text}}
    else:
        choice = {"index": 0, "text": first.text}
        if wants_ids:
            choice["prompt_token_ids"] = first.prompt_token_ids
    choice.update(logprobs=first.logprobs, finish_reason=finish)
    if finish is not None:
        choice["stop_reason"] = first.stop_reason
    if wants_ids:
        choice["token_ids"] = [first.token_id]
    events.append(_chunk(first, parsed, [choice], {}, usage))
    if ends:
        if _stream_option(parsed, "include_usage"):
            events.append(_chunk(first, parsed, [], {}, _usage(first, 1)))
        events.append(DONE_EVENT)
    return b"".join(events)


def _chat_role(parsed: ParsedRequest) -> str:
    """The role vLLM's chat stream opens with: the answer's, or with
    ``add_generation_prompt`` false the last message's (which it continues)."""
    if is_true(parsed.body.get("add_generation_prompt", True)):
        return "assistant"
    return str(parsed.body["messages"][-1].get("role", "assistant"))


def wants_token_ids(parsed: ParsedRequest) -> bool:
    return is_true(parsed.body.get("return_token_ids"))


@dataclass
class Progress:
    """What the client has of its output so far, after ``t1``: the token ids
    relayed, the length of their text (completions' ``text_offset``) and
    whether the stream has ended (its last event, or ``[DONE]``)."""

    token_ids: list[int] = field(default_factory=list)
    text_len: int = 0
    is_finished: bool = False
    is_done: bool = False  # [DONE] relayed


class DecodeEcho:
    """Decode's stream, rewritten for a client that got ``t1`` from prefill.

    :meth:`feed` takes decode's bytes as they come and returns what to send
    the client: decode's opening role event (chat) and its copy of ``t1`` are
    dropped, after checking the token id and text match (else
    :class:`Diverged`); token ids are kept only if the client asked. With
    ``first`` None (decode answered first, or prefill's answer had no ids)
    it only strips the token ids the legs asked for. An error event raises
    :class:`Diverged` too: decode failed after the client's stream began.
    """

    def __init__(self, parsed: ParsedRequest, first: FirstToken | None) -> None:
        self._parsed = parsed
        self._first = first
        self._wants_ids = wants_token_ids(parsed)
        self._events = _EventBuffer()
        self._is_t1_seen = first is None
        self.progress = Progress()

    def feed(self, data: bytes) -> bytes:
        out = []
        for payload in self._events.feed(data):
            event = self._rewrite(payload)
            if event is not None:
                out.append(event)
        return b"".join(out)

    def _rewrite(self, payload: bytes) -> bytes | None:
        if payload == b"[DONE]":
            self.progress.is_done = True
            return DONE_EVENT
        try:
            chunk = _decode(payload)
        except Diverged:
            if self._first is None:  # only stripping: not ours to judge
                return b"data: " + payload + b"\n\n"
            raise
        if "error" in chunk:
            if self._first is None:
                return _sse(chunk)
            raise Diverged(f"decode's stream failed: {chunk['error']}")
        choices = chunk.get("choices") or []
        if not choices:  # the usage event
            return _sse(chunk) if self._is_t1_seen else None
        choice = choices[0]
        ids = choice.get("token_ids") or []
        carried_t1 = not self._is_t1_seen
        if carried_t1:
            if not ids:
                if _has_text(choice, self._parsed) or choice.get("finish_reason"):
                    raise Diverged("decode's first text carries no token ids")
                return None  # chat's opening role event: the client has ours
            self._drop_t1(choice, ids)
            ids = ids[1:]
        self.progress.token_ids.extend(ids)
        self.progress.text_len += len(_text(choice, self._parsed))
        if choice.get("finish_reason") is not None:
            self.progress.is_finished = True
        if not self._wants_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
            chunk.pop("prompt_token_ids", None)
        elif "prompt_token_ids" in chunk or "prompt_token_ids" in choice:
            chunk.pop("prompt_token_ids", None)  # the client got them with t1
            choice.pop("prompt_token_ids", None)
        if carried_t1 and not ids and _is_idle(choice, self._parsed):
            return None  # it carried only t1
        return _sse(chunk)

    def _drop_t1(self, choice: dict[str, Any], ids: list[int]) -> None:
        first = self._first
        assert first is not None
        if ids[0] != first.token_id:
            raise Diverged(f"decode's first token {ids[0]} is not {first.token_id}")
        text = _text(choice, self._parsed)
        if not text.startswith(first.text):
            raise Diverged(
                f"decode's first text {text!r} does not start with {first.text!r}"
            )
        _set_text(choice, self._parsed, text[len(first.text) :])
        choice["token_ids"] = ids[1:]
        _drop_first_logprob(choice, self._parsed)
        if self._parsed.endpoint == "chat":
            choice["delta"].pop("role", None)
        self._is_t1_seen = True


def continuation_body(
    parsed: ParsedRequest,
    first: FirstToken,
    progress: Progress,
    kv_transfer_params: Any = None,
) -> bytes:
    """A completions request for the rest of the output: the prompt, ``t1``
    and what followed it as token ids, the client's sampling, the tokens
    left (``max_tokens``); with ``kv_transfer_params`` when decode gets the
    prompt's KV pushed (a struct or a dict)."""
    body = {k: v for k, v in parsed.body.items() if k not in _CHAT_ONLY_FIELDS}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = msgspec.to_builtins(kv_transfer_params)
    body["prompt"] = [*first.prompt_token_ids, first.token_id, *progress.token_ids]
    body["stream"] = True
    body["return_token_ids"] = True
    body.pop("max_completion_tokens", None)
    limit = max_new_tokens(parsed)
    if limit is not None:
        body["max_tokens"] = max(1, limit - 1 - len(progress.token_ids))
    if parsed.endpoint == "chat":
        top = parsed.body.get("top_logprobs")
        wants = is_true(parsed.body.get("logprobs"))
        body.pop("logprobs", None)
        if wants:
            body["logprobs"] = top if isinstance(top, int) else 0
    return msgspec.json.encode(body)


class Continuation:
    """A continuation's completions stream, rewritten as the rest of the
    client's stream: the client's id, endpoint format and counts (prompt
    tokens of the original prompt, ``t1`` and what followed it counted as
    output), token ids only if asked, text offsets after the text it has.
    :attr:`progress` is the client's, this stream's relayed part included."""

    def __init__(
        self, parsed: ParsedRequest, first: FirstToken, progress: Progress
    ) -> None:
        self._parsed = parsed
        self._first = first
        self._num_before = 1 + len(progress.token_ids)
        self._offset = len(first.text) + progress.text_len
        self._wants_ids = wants_token_ids(parsed)
        self._events = _EventBuffer()
        self.progress = Progress(list(progress.token_ids), progress.text_len)

    def feed(self, data: bytes) -> bytes:
        return b"".join(self._rewrite(p) for p in self._events.feed(data))

    def _rewrite(self, payload: bytes) -> bytes:
        if payload == b"[DONE]":
            self.progress.is_done = True
            return DONE_EVENT
        chunk = _decode(payload)
        if "error" in chunk:
            return _sse(chunk)
        for choice in chunk.get("choices") or []:
            self.progress.token_ids.extend(choice.get("token_ids") or [])
            self.progress.text_len += len(choice.get("text") or "")
            if choice.get("finish_reason") is not None:
                self.progress.is_finished = True
        out: dict[str, Any] = {
            "id": self._first.id,
            "object": "chat.completion.chunk"
            if self._parsed.endpoint == "chat"
            else "text_completion",
            "created": self._first.created,
            "model": self._first.model,
            "choices": [self._choice(c) for c in chunk.get("choices") or []],
        }
        usage = chunk.get("usage")
        if usage:
            prompt = len(self._first.prompt_token_ids)
            done = usage.get("completion_tokens", 0) + self._num_before
            out["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": done,
                "total_tokens": prompt + done,
            }
        return _sse(out)

    def _choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        text = choice.get("text") or ""
        out: dict[str, Any]
        logprobs = choice.get("logprobs")
        if self._parsed.endpoint == "chat":
            out = {"index": 0, "delta": {"content": text}}
            out["logprobs"] = (
                None
                if logprobs is None
                else {"content": list(_chat_logprobs(logprobs))}
            )
        else:
            out = {"index": 0, "text": text}
            if logprobs is not None:
                logprobs = dict(logprobs)
                logprobs["text_offset"] = [
                    o + self._offset for o in logprobs.get("text_offset") or []
                ]
            out["logprobs"] = logprobs
        out["finish_reason"] = choice.get("finish_reason")
        if choice.get("finish_reason") is not None:
            out["stop_reason"] = choice.get("stop_reason")
        if self._wants_ids:
            out["token_ids"] = choice.get("token_ids") or []
        return out


# -- helpers ---------------------------------------------------------------

_CHAT_ONLY_FIELDS = frozenset({
    "messages", "add_generation_prompt", "continue_final_message",
    "chat_template", "chat_template_kwargs", "documents", "top_logprobs",
    "parallel_tool_calls", "tool_choice", "reasoning_effort",
    "include_reasoning", "kv_transfer_params",
})  # fmt: skip


class _EventBuffer:
    """Splits a byte stream into SSE ``data:`` payloads, whole events only."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> Iterator[bytes]:
        self._pending += data.replace(b"\r\n", b"\n")
        *events, self._pending = self._pending.split(b"\n\n")
        for event in events:
            lines = [
                ln[5:].lstrip() for ln in event.split(b"\n") if ln.startswith(b"data:")
            ]
            if lines:
                yield b"\n".join(lines)


def _decode(payload: bytes) -> dict[str, Any]:
    try:
        chunk = msgspec.json.decode(payload)
    except msgspec.DecodeError as e:
        raise Diverged(f"decode's stream is not JSON: {e}") from e
    if not isinstance(chunk, dict):
        raise Diverged("decode's stream event is not an object")
    return chunk


def _sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


def _chunk(
    first: FirstToken,
    parsed: ParsedRequest,
    choices: list[dict[str, Any]],
    extra: dict[str, Any],
    usage: dict[str, Any] | None,
) -> bytes:
    chunk: dict[str, Any] = {
        "id": first.id,
        "object": "chat.completion.chunk"
        if parsed.endpoint == "chat"
        else "text_completion",
        "created": first.created,
        "model": first.model,
        "choices": choices,
        **extra,
    }
    if usage is not None:
        chunk["usage"] = usage
    return _sse(chunk)


def _usage(first: FirstToken, num_output: int) -> dict[str, int]:
    prompt = len(first.prompt_token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": num_output,
        "total_tokens": prompt + num_output,
    }


def _stream_option(parsed: ParsedRequest, name: str) -> bool:
    options = parsed.body.get("stream_options") or {}
    return is_true(options.get(name))


def _text(choice: dict[str, Any], parsed: ParsedRequest) -> str:
    if parsed.endpoint == "chat":
        return str((choice.get("delta") or {}).get("content") or "")
    return str(choice.get("text") or "")


def _set_text(choice: dict[str, Any], parsed: ParsedRequest, text: str) -> None:
    if parsed.endpoint == "chat":
        choice.setdefault("delta", {})["content"] = text
    else:
        choice["text"] = text


def _has_text(choice: dict[str, Any], parsed: ParsedRequest) -> bool:
    if parsed.endpoint == "chat":
        delta = choice.get("delta") or {}
        return any(
            delta.get(k)
            for k in ("content", "reasoning", "reasoning_content", "tool_calls")
        )
    return bool(choice.get("text"))


def _is_idle(choice: dict[str, Any], parsed: ParsedRequest) -> bool:
    """Nothing left in the choice for the client: no text, end or logprobs."""
    logprobs = choice.get("logprobs")
    has_logprobs = bool(
        logprobs and (logprobs.get("content") or logprobs.get("tokens"))
    )
    return (
        choice.get("finish_reason") is None
        and not has_logprobs
        and not _has_text(choice, parsed)
    )


def _drop_first_logprob(choice: dict[str, Any], parsed: ParsedRequest) -> None:
    logprobs = choice.get("logprobs")
    if not logprobs:
        return
    if parsed.endpoint == "chat":
        logprobs["content"] = (logprobs.get("content") or [])[1:]
        return
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        if isinstance(logprobs.get(key), list):
            logprobs[key] = logprobs[key][1:]


def _chat_logprobs(logprobs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Completions' logprobs of a chunk as chat's ``content`` entries."""
    tops = logprobs.get("top_logprobs") or []
    for i, (token, logprob) in enumerate(
        zip(
            logprobs.get("tokens") or [],
            logprobs.get("token_logprobs") or [],
            strict=False,
        )
    ):
        top = tops[i] if i < len(tops) and tops[i] else {}
        yield {
            "token": token,
            "logprob": logprob,
            "bytes": list(token.encode()),
            "top_logprobs": [
                {"token": t, "logprob": lp, "bytes": list(t.encode())}
                for t, lp in top.items()
            ],
        }


def _is_one_prompt(prompt: Any) -> bool:
    """A string or one list of token ids (a batch gives several choices)."""
    return isinstance(prompt, str) or (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(t, int) for t in prompt)
    )
