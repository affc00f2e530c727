"""Incoming request bodies: parsed and checked once, at the edge.

``app.py`` calls :func:`parse_request` on every generation request before any
backend is contacted; the flows in ``dispatch.py`` then ask the resulting
:class:`ParsedRequest` for each leg's body. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from kvpush.router.errors import bad_gateway, bad_request
from kvpush.topology import Backend

Endpoint = Literal["completions", "chat"]
ENDPOINT_PATHS: dict[Endpoint, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}


class RemoteDecodeParams(msgspec.Struct, frozen=True, kw_only=True):
    """``kv_transfer_params`` of a prefill leg: compute, keep the KV for decode."""

    do_remote_decode: bool = True
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None


class PushDecodeParams(msgspec.Struct, frozen=True, kw_only=True):
    """``kv_transfer_params`` of a vLLM-push decode leg: KV will be pushed here."""

    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    tp_size: int = 1

    @classmethod
    def for_prefill(cls, prefill: Backend, request_id: str) -> PushDecodeParams:
        return cls(
            remote_engine_id=prefill.engine_id,
            remote_request_id=request_id,
            remote_host=prefill.side_channel_host,
            remote_port=prefill.side_channel_port,
            tp_size=prefill.tp_size,  # vLLM's push maps heads by prefill's TP
        )


@dataclass(frozen=True)
class ParsedRequest:
    """A checked completions or chat request.

    ``raw`` is the body exactly as received (colocated mode forwards it
    unchanged); ``body`` is its decoded JSON object, never mutated.
    """

    endpoint: Endpoint
    raw: bytes
    body: dict[str, Any]
    model: str | None
    is_stream: bool

    @property
    def path(self) -> str:
        return ENDPOINT_PATHS[self.endpoint]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """vLLM (0.32) computes this request's prompt logprobs, so it computes
        the whole prompt itself and loads no KV (``skip_reading_prefix_cache``:
        neither its prefix cache nor a connector): ``prompt_logprobs`` set, or
        ``echo`` with ``logprobs`` (completions) or ``echo`` at all (chat,
        whose ``top_logprobs`` defaults to 0, not null)."""
        body = self.body
        if body.get("prompt_logprobs") is not None:
            return True
        if not is_true(body.get("echo")):
            return False
        return self.endpoint == "chat" or body.get("logprobs") is not None

    @property
    def first_token_recomputed(self) -> str | None:
        """Why decode would sample this request's first token itself rather
        than continue from prefill's (what the body asks; the same rule as
        ``why_never`` of :mod:`kvpush.connector.decode.first_token`, which
        reads vLLM's request), or None. The router reads it for a model with
        per-request state, whose decode then computes the prompt again
        (``binding.decide``)."""
        body = self.body
        for key in _READS_OUTPUT:
            if body.get(key) not in (None, 0):
                return key
        response_format = body.get("response_format")
        if response_format is not None and not is_text_format(response_format):
            return "response_format"
        for key in STRUCTURED_OUTPUT_FIELDS:
            if body.get(key) is not None:
                return key
        choice = body.get("tool_choice")
        if body.get("tools") and (choice == "required" or isinstance(choice, dict)):
            return "tool_choice"  # vLLM constrains the output to the tool's schema
        if -1 in (body.get("logprobs"), body.get("top_logprobs")):
            return "logprobs"  # the whole vocabulary: more than prefill sends
        if body.get("prompt_embeds") is not None:
            return "prompt_embeds"
        if self.endpoint == "chat" and any(
            _has_media(m.get("content")) for m in body["messages"]
        ):
            return "multimodal"
        return None

    def prefill_body(
        self, kv_transfer_params: Any = None, extra: dict[str, Any] | None = None
    ) -> bytes:
        """The prefill leg: one token, no streaming, KV kept for a remote
        decode (vLLM's ``do_remote_decode`` unless other params are given);
        ``extra`` fields added (the first token's, ``first_token.py``)."""
        body = {**self.body, **(extra or {})}
        for key in ("max_completion_tokens", "stream_options", "min_tokens"):
            body.pop(key, None)
        body["max_tokens"] = 1
        body["stream"] = False
        body["n"] = 1  # the prompt is computed once; decode samples n
        params = (
            RemoteDecodeParams() if kv_transfer_params is None else kv_transfer_params
        )
        body["kv_transfer_params"] = msgspec.to_builtins(params)
        return msgspec.json.encode(body)

    def decode_body(
        self, kv_transfer_params: Any, extra: dict[str, Any] | None = None
    ) -> bytes:
        """The client's body plus ``kv_transfer_params`` (a dict or a struct)
        and the ``extra`` fields."""
        body = {**self.body, **(extra or {})}
        body["kv_transfer_params"] = msgspec.to_builtins(kv_transfer_params)
        return msgspec.json.encode(body)


def parse_request(raw: bytes, endpoint: Endpoint, allow_n: bool) -> ParsedRequest:
    """Decode and check a body; raise a 400 ``RouterError`` saying what is wrong.

    ``allow_n`` is true only where the mode can serve ``n`` > 1 (colocated,
    and kvpush, whose prefill leg computes the prompt once, ``n`` 1, and
    whose decode samples ``n`` from the one pushed KV).
    """
    body = _decode_object(raw)
    _check_payload(body, endpoint)
    _check_token_limits(body)
    _check_n(body, allow_n)
    if "kv_transfer_params" in body:
        raise bad_request(
            "kv_transfer_params is reserved for the router; remove it from the request",
            "kv_transfer_params",
        )
    return ParsedRequest(
        endpoint=endpoint,
        raw=raw,
        body=body,
        model=_check_model(body),
        is_stream=_check_stream(body),
    )


def returned_kv_params(answer: bytes, prefill: Backend) -> dict[str, Any]:
    """The top-level ``kv_transfer_params`` of a prefill answer, unchanged.

    The pull flow calls this on prefill's answer and forwards the result to
    decode as is; anything else is a 502 naming the prefill.
    """
    try:
        decoded = msgspec.json.decode(answer)
    except msgspec.DecodeError as e:
        raise bad_gateway("prefill", prefill, f"answer is not JSON: {e}") from e
    params = decoded.get("kv_transfer_params") if isinstance(decoded, dict) else None
    if not isinstance(params, dict):
        raise bad_gateway(
            "prefill",
            prefill,
            "answer has no kv_transfer_params object; is the instance started "
            "with a NixlConnector as kv_producer?",
        )
    return params


# Fields a request's output is sampled under that prefill's one-token leg
# does not apply (``first_token_recomputed``).
_READS_OUTPUT = ("min_tokens", "presence_penalty", "frequency_penalty",
                 "repetition_detection")  # fmt: skip
# The fields that ask vLLM for structured output, beside a ``response_format``
# other than text (:func:`is_text_format`).
STRUCTURED_OUTPUT_FIELDS = ("structured_outputs", "guided_json", "guided_regex",
                            "guided_choice", "guided_grammar")  # fmt: skip


def is_text_format(value: Any) -> bool:
    """Whether a ``response_format`` asks for plain text (no structure)."""
    return isinstance(value, dict) and value.get("type") == "text"


def _has_media(content: Any) -> bool:
    """Whether a chat message's content holds a part other than text."""
    return isinstance(content, list) and any(
        isinstance(part, dict) and part.get("type") != "text" for part in content
    )


_TRUE_STRINGS = frozenset({"1", "on", "t", "true", "y", "yes"})


def is_true(value: Any) -> bool:
    """Whether vLLM's request model (pydantic, lax) reads ``value`` as true."""
    if isinstance(value, str):
        return value.strip().lower() in _TRUE_STRINGS
    return value is True or (isinstance(value, int | float) and value == 1)


def _decode_object(raw: bytes) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise bad_request(
            f"request body must be a JSON object, not {type(body).__name__}"
        )
    return body


def _check_model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is None:
        return None
    if not isinstance(model, str) or not model:
        raise bad_request("model must be a non-empty string", "model")
    return model


def _check_payload(body: dict[str, Any], endpoint: Endpoint) -> None:
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages must be a non-empty list", "messages")
        if not all(isinstance(m, dict) for m in messages):
            raise bad_request("every entry of messages must be an object", "messages")
        return
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("prompt is required for /v1/completions", "prompt")
    if not isinstance(prompt, str | list) or not prompt:
        raise bad_request(
            "prompt must be a non-empty string, list of strings or list of token ids",
            "prompt",
        )


def _check_stream(body: dict[str, Any]) -> bool:
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    return stream


def _check_token_limits(body: dict[str, Any]) -> None:
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad_request(f"{key} must be an integer >= 1, not {value!r}", key)


GREEDY_BELOW = 1e-5  # vLLM treats a temperature below this as greedy


def _check_n(body: dict[str, Any], allow_n: bool) -> None:
    n = body.get("n")
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise bad_request(f"n must be an integer >= 1, not {n!r}", "n")
    temperature = body.get("temperature")
    if n > 1 and isinstance(temperature, int | float) and temperature < GREEDY_BELOW:
        # vLLM refuses it too, but only on decode: a prefill leg would have
        # computed (and held) the prompt's KV for nothing.
        raise bad_request(
            f"n > 1 needs sampling: temperature {temperature} is greedy, so "
            "every choice would be the same (vLLM refuses it); raise the "
            "temperature or send n=1",
            "n",
        )
    if n > 1 and not allow_n:
        raise bad_request(
            "n > 1 is not supported with vLLM's own P/D connectors "
            "(vllm-pull, vllm-push); send n=1, several requests, or use kvpush",
            "n",
        )
