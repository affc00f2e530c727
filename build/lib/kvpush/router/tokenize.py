"""Counting a prompt's tokens with an instance's own ``/tokenize``.

The skip decision and the prefix index need the prompt's token ids exactly
as the engine will see them (the chat template applied, special tokens as
vLLM adds them). vLLM's OpenAI server serves ``POST /tokenize`` for both a
completion prompt and chat messages, in its API server process (no engine
step), so the router asks an instance rather than loading a tokenizer of
its own: :func:`tokenize_request` builds the body (pure),
:func:`fetch_tokens` asks. A prompt given as token ids needs no call; a
batch of prompts is not counted (it binds early). Any failure (timeout, no
such endpoint, an unexpected answer) gives None: the request is then bound
early, never refused.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import msgspec

from kvpush.router.requests import ParsedRequest
from kvpush.topology import Backend

logger = logging.getLogger(__name__)

# Chat request fields that change how the messages are rendered to tokens.
CHAT_RENDER_KEYS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)


_JSON = {"Content-Type": "application/json"}


class _Tokenized(msgspec.Struct):
    tokens: list[int]


def given_tokens(parsed: ParsedRequest) -> tuple[int, ...] | None:
    """The prompt's token ids when the client sent them as such."""
    prompt = parsed.body.get("prompt")
    if parsed.endpoint != "completions" or not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return tuple(prompt)
    return None


def tokenize_request(parsed: ParsedRequest) -> dict[str, Any] | None:
    """The ``/tokenize`` body for ``parsed``; None when it cannot be counted
    this way (a batch of prompts, or a prompt given as token ids)."""
    body = parsed.body
    out: dict[str, Any] = {}
    if parsed.model is not None:
        out["model"] = parsed.model
    if parsed.endpoint == "chat":
        out["messages"] = body["messages"]
        out.update({k: body[k] for k in CHAT_RENDER_KEYS if k in body})
        return out
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return None
    out["prompt"] = prompt
    if "add_special_tokens" in body:
        out["add_special_tokens"] = body["add_special_tokens"]
    return out


async def fetch_tokens(
    session: aiohttp.ClientSession,
    backend: Backend,
    parsed: ParsedRequest,
    timeout_s: float,
) -> tuple[int, ...] | None:
    """The prompt's token ids, as ``backend`` tokenizes them (None: unknown)."""
    given = given_tokens(parsed)
    if given is not None:
        return given
    body = tokenize_request(parsed)
    if body is None:
        return None
    url = backend.url.rstrip("/") + "/tokenize"
    try:
        async with asyncio.timeout(timeout_s):
            data = msgspec.json.encode(body)
            async with session.post(url, data=data, headers=_JSON) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    logger.debug("tokenize: %s: %d", backend.engine_id, resp.status)
                    return None
        return tuple(msgspec.json.decode(raw, type=_Tokenized).tokens)
    except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError) as e:
        logger.debug("tokenize on %s: %s", backend.engine_id, e)
        return None
