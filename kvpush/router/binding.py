"""Per-request binding: whether and when a request gets a prefill leg.

- **early**: both legs at once, the decode named up front (kvpush's push);
- **skip**: no prefill leg; the chosen decode computes what it does not
  hold itself (a plain request, no ``kv_transfer_params``: vLLM's prefix
  cache serves the held part);
- **late**: the prefill leg first, naming no decode but carrying the hash
  of a claim token; the decode is chosen when prefill answers (its KV is
  computed and held), and the decode leg carries the token, which is what
  lets that one decode claim the ready KV (``kvpush.transfer.matcher``);
- **prefill**: no decode leg; a prefill answers the client's request
  alone (a plain request: nothing held, nothing moved). ``auto``'s choice
  for a request of one token at most (``max_tokens`` 1): it has no decode
  phase.

:func:`decide` is the policy, pure. The router's ``--binding`` is ``auto``
or forces one binding. ``auto`` skips when the decode chosen would have to
compute at most ``skip_max_new_tokens`` tokens itself, counting what the
router believes it holds, or when no prefill is usable; else it binds
early when the decode is clearly free (its busy score, see
:func:`kvpush.router.scoring.busy_score`, at most ``late_min_busy``) and
late when it is not: the decode is then chosen once the KV is ready, on
fresher load. Every decision has a reason, counted in
``kvpush_router_binding_total{binding,reason}``.

A request that asks for prompt logprobs (``prompt_logprobs``, or ``echo``:
:attr:`kvpush.router.requests.ParsedRequest.wants_prompt_logprobs`) always
skips, whatever the policy (reason ``prompt_logprobs``): vLLM computes such
a prompt in full and loads no KV for it (``skip_reading_prefix_cache``), so
a prefill leg would only compute and hold KV that decode never takes.

On a model with per-request state (Mamba, gated delta net, short conv) a
leg bound early loads only where decode continues from prefill's first
token: vLLM computes a loaded prompt's last token again, which would apply
it to the loaded state twice. A request decode would not continue
(``min_tokens``, penalties, structured output:
:attr:`kvpush.router.requests.ParsedRequest.first_token_recomputed`) is
computed by decode whole either way, so where it would bind early it skips
instead (reason ``state_recomputed``), forced or not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Binding = Literal["early", "late", "skip", "prefill"]
BindingPolicy = Literal["auto", "early", "late", "skip"]
POLICIES: tuple[str, ...] = ("auto", "early", "late", "skip")
DEFAULT_SKIP_MAX_NEW_TOKENS = 256  # two CPU blocks of 128 tokens
# auto binds late above this busy score of the best decode (request
# equivalents: an unknown, idle decode scores 4, one running 4 requests with
# an empty KV cache 4).
DEFAULT_LATE_MIN_BUSY = 4.0

Reason = Literal[
    "forced",  # --binding early|late|skip
    "prefix_held",  # decode holds the whole prompt but a partial block
    "few_new_tokens",  # decode holds a prefix; the rest is under the threshold
    "short_prompt",  # nothing held, the whole prompt is under the threshold
    "new_tokens",  # more new tokens than the threshold, decode clearly free
    "decode_busy",  # more new tokens than the threshold, every decode busy
    "tokens_unknown",  # the prompt could not be counted: bind early
    "no_prefill",  # no usable prefill: decode computes the prompt
    "prompt_logprobs",  # vLLM loads no KV for it: decode computes the prompt
    "one_token",  # max_tokens 1: no decode phase, prefill answers alone
    "state_recomputed",  # a state model's decode would compute it whole
]


@dataclass(frozen=True)
class BindingDecision:
    """A request's binding and why."""

    binding: Binding
    reason: Reason

    @property
    def has_prefill_leg(self) -> bool:
        """A prefill serves the request (with a decode leg or alone)."""
        return self.binding != "skip"


def check_policy(policy: str) -> None:
    """``ValueError`` naming what to use for an unknown policy."""
    if policy not in POLICIES:
        raise ValueError(
            f"unknown binding {policy!r}; use one of {', '.join(POLICIES)}"
        )


def num_new_tokens(num_prompt_tokens: int, num_held_tokens: int) -> int:
    """Tokens decode must compute itself (vLLM recomputes at least the last
    prompt token even on a full hit, so this is never below 1)."""
    return max(1, num_prompt_tokens - min(num_held_tokens, num_prompt_tokens - 1))


def decide(
    policy: BindingPolicy,
    *,
    num_prompt_tokens: int | None,
    num_held_tokens: int,
    block_size: int,
    skip_max_new_tokens: int,
    has_prefill: bool,
    decode_busy: float = 0.0,
    late_min_busy: float = DEFAULT_LATE_MIN_BUSY,
    prompt_logprobs: bool = False,
    one_token: bool = False,
    state_recomputed: bool = False,
) -> BindingDecision:
    """The binding of one request on its chosen decode.

    ``num_prompt_tokens`` is None when the prompt could not be counted;
    ``num_held_tokens`` is what the decode is believed to hold (whole
    blocks of ``block_size``); ``has_prefill`` whether any prefill is usable;
    ``decode_busy`` the chosen decode's busy score (the best decode's, as
    the decode is chosen by score first); ``prompt_logprobs`` whether the
    request asks for them (then vLLM loads no KV for it: skip);
    ``one_token`` whether it asks for one token at most (``auto``: a
    prefill answers it alone); ``state_recomputed`` whether decode would
    compute the whole prompt of an early-bound leg (skip instead).
    """
    if prompt_logprobs:
        return BindingDecision("skip", "prompt_logprobs")
    if policy == "early":
        return _early("forced", state_recomputed)
    if policy == "late" or policy == "skip":
        return BindingDecision(policy, "forced")
    if policy != "auto":
        check_policy(policy)
    if not has_prefill:
        return BindingDecision("skip", "no_prefill")
    if one_token:
        return BindingDecision("prefill", "one_token")
    if num_prompt_tokens is None:
        return _early("tokens_unknown", state_recomputed)
    new = num_new_tokens(num_prompt_tokens, num_held_tokens)
    if new > skip_max_new_tokens:
        if decode_busy > late_min_busy:
            return BindingDecision("late", "decode_busy")
        return _early("new_tokens", state_recomputed)
    if num_held_tokens <= 0:
        return BindingDecision("skip", "short_prompt")
    if new < block_size:
        return BindingDecision("skip", "prefix_held")
    return BindingDecision("skip", "few_new_tokens")


def _early(reason: Reason, state_recomputed: bool) -> BindingDecision:
    """An early binding, or a skip where decode would compute the prompt
    whole (``state_recomputed``)."""
    if state_recomputed:
        return BindingDecision("skip", "state_recomputed")
    return BindingDecision("early", reason)
