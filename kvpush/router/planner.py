"""kvpush mode's routing plan: which decode, which binding, which prefill.

Following llm-d, the decode is chosen first, then the binding from what
that decode holds, then (only when a prefill leg runs) the prefill:

1. **Decode.** Usable decodes (healthy, not drained, not blamed for an
   earlier attempt) are scored (``scoring.decode_score``: queue, free KV,
   the expected transfer from the cheapest prefill unless the binding is
   forced to skip, minus the share of the prompt it holds). A request that
   names a session goes to its rendezvous decode (``prefix.py``) unless that
   one scores more than ``affinity_slack`` worse than the best (then it
   spills to the best).
2. **Binding.** ``binding.decide`` on the prompt's token count and what the
   chosen decode holds (per the router's prefix index).
3. **Prefill.** Only for a prefill leg: usable prefills scored by queue
   plus the transfer figures of the pair with the chosen decode.

A late binding (forced, or ``auto`` when even the best decode is busy)
keeps the plan's decode only as the one the binding was decided on: the
prefill is chosen without a pair (no transfer term), and the flow chooses
the decode at prefill's answer with :meth:`Planner.choose_late_decode`
(the same scoring, on the load of that moment, the transfer term of the
prefill that holds the KV).

Pure: the caller passes the prompt's tokens and the time; runs on the
router's event loop only (no locks anywhere on this path).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from kvpush.router.binding import BindingDecision, decide
from kvpush.router.config import RoutingConfig
from kvpush.router.errors import no_healthy_instance
from kvpush.router.health import HealthBoard
from kvpush.router.prefix import PrefixIndex, block_hashes, rendezvous_order
from kvpush.router.scoring import (
    Load,
    busy_score,
    decode_score,
    pick,
    prefill_score,
    transfer_score,
)
from kvpush.router.selection import usable
from kvpush.router.signals import SignalBoard
from kvpush.topology import Backend

DecodeReason = Literal["affinity", "spill", "prefix", "load"]


@dataclass(frozen=True)
class Prompt:
    """What the planner knows of a request: its token ids (None: not
    counted), the session it names (None: none), and whether it asks for
    prompt logprobs (vLLM then loads no KV for it: it is served by decode
    alone, chosen without a transfer term)."""

    tokens: tuple[int, ...] | None
    session: str | None = None
    prompt_logprobs: bool = False
    one_token: bool = False  # max_tokens 1: no decode phase
    state_recomputed: bool = False  # a state model's decode computes it whole


@dataclass(frozen=True)
class RoutePlan:
    """One attempt's route. ``prefill`` is None exactly when skipping;
    ``hashes`` are the prompt's full-block hashes (recorded on success).
    Bound late, ``decode`` is the one the binding was decided on until the
    flow replaces it with the decode it claims for (``dataclasses.replace``);
    bound to ``prefill`` alone, no decode serves it."""

    decode: Backend
    prefill: Backend | None
    decision: BindingDecision
    decode_reason: DecodeReason
    num_held_tokens: int
    hashes: tuple[int, ...]


class Planner:
    """Chooses instances and binding from the boards the router keeps."""

    def __init__(
        self,
        config: RoutingConfig,
        health: HealthBoard,
        signals: SignalBoard,
        index: PrefixIndex,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.health = health
        self.signals = signals
        self.index = index
        self._rng = rng or random.Random()
        self._num_prefill_picks = 0
        self._num_decode_picks = 0

    def plan(
        self,
        prefills: Sequence[Backend],
        decodes: Sequence[Backend],
        avoided: Collection[str],
        prompt: Prompt,
        now: float,
    ) -> RoutePlan:
        """The route of one attempt; a 503 ``RouterError`` when no decode is
        usable, or no prefill is while the binding needs one."""
        ready_decodes = usable(decodes, self.health, avoided)
        if not ready_decodes:
            raise no_healthy_instance("decode", len(decodes))
        ready_prefills = usable(prefills, self.health, avoided)
        tokens = prompt.tokens
        hashes = block_hashes(tokens, self.config.block_size) if tokens else ()
        decode, reason, held = self.choose_decode(
            ready_decodes, [d.engine_id for d in decodes], ready_prefills, prompt,
            hashes, now,
        )  # fmt: skip
        decision = decide(
            self.config.binding,
            num_prompt_tokens=None if tokens is None else len(tokens),
            num_held_tokens=held,
            block_size=self.config.block_size,
            skip_max_new_tokens=self.config.skip_max_new_tokens,
            has_prefill=bool(ready_prefills),
            decode_busy=busy_score(self._load(decode, now), self.config.weights),
            late_min_busy=self.config.late_min_busy,
            prompt_logprobs=prompt.prompt_logprobs,
            one_token=prompt.one_token,
            state_recomputed=prompt.state_recomputed,
        )
        if decision.binding not in ("late", "prefill"):  # late: its turn comes later
            self._num_decode_picks += 1
        prefill = None
        if decision.has_prefill_leg:
            if not ready_prefills:
                raise no_healthy_instance("prefill", len(prefills))
            pair = decode if decision.binding == "early" else None
            prefill = self.choose_prefill(ready_prefills, pair, now)
        return RoutePlan(decode, prefill, decision, reason, held, hashes)

    def choose_late_decode(
        self,
        decodes: Sequence[Backend],
        avoided: Collection[str],
        prompt: Prompt,
        prefill: Backend,
        hashes: Sequence[int],
        now: float,
    ) -> tuple[Backend, DecodeReason, int]:
        """A late-bound request's decode, chosen once ``prefill`` holds its
        KV: as :meth:`choose_decode`, on the load of now, with the transfer
        term of that prefill only. A 503 ``RouterError`` when none is usable."""
        candidates = usable(decodes, self.health, avoided)
        if not candidates:
            raise no_healthy_instance("decode", len(decodes))
        chosen = self.choose_decode(
            candidates, [d.engine_id for d in decodes], [prefill], prompt, hashes,
            now,
        )  # fmt: skip
        self._num_decode_picks += 1
        return chosen

    def choose_decode(
        self,
        candidates: Sequence[Backend],
        all_decode_ids: Sequence[str],
        prefills: Sequence[Backend],
        prompt: Prompt,
        hashes: Sequence[int],
        now: float,
    ) -> tuple[Backend, DecodeReason, int]:
        """The decode among ``candidates``, why, and the tokens it holds
        (equal scores: the one whose turn it is; the caller advances the
        turn once per decode it uses)."""
        num_tokens = len(prompt.tokens) if prompt.tokens else 0
        bs = self.config.block_size
        held = {
            d.engine_id: self.index.num_held_blocks(d.engine_id, hashes) * bs
            for d in candidates
        }
        with_transfer = (
            self.config.binding != "skip"
            and not prompt.prompt_logprobs
            and bool(prefills)
        )
        w = self.config.weights

        def score(d: Backend) -> float:
            transfer = self._cheapest_transfer(prefills, d, now) if with_transfer else 0
            fraction = held[d.engine_id] / num_tokens if num_tokens else 0.0
            return decode_score(self._load(d, now), transfer, fraction, w)

        best = pick(
            candidates, score, self._num_decode_picks, self._rng,
            self.config.full_scan_max,
        )  # fmt: skip
        chosen = best
        reason: DecodeReason = "prefix" if held[best.engine_id] else "load"
        if prompt.session is not None:
            affine = _first_usable(prompt.session, all_decode_ids, candidates)
            if score(affine) <= score(best) + self.config.affinity_slack:
                chosen, reason = affine, "affinity"
            else:
                reason = "spill"
        return chosen, reason, held[chosen.engine_id]

    def choose_prefill(
        self, candidates: Sequence[Backend], decode: Backend | None, now: float
    ) -> Backend:
        """The prefill among ``candidates`` for a leg pushing to ``decode``
        (None: bound late, no pair known yet: by load alone)."""
        w = self.config.weights

        def score(p: Backend) -> float:
            if decode is None:
                return prefill_score(self._load(p, now), None, w)
            pair = self.signals.pair(p.engine_id, decode.engine_id, now)
            typical = self.signals.typical_handover(p.engine_id, now)
            return prefill_score(self._load(p, now), pair, w, typical)

        prefill = pick(
            candidates, score, self._num_prefill_picks, self._rng,
            self.config.full_scan_max,
        )  # fmt: skip
        self._num_prefill_picks += 1
        return prefill

    def served(self, plan: RoutePlan) -> None:
        """The plan's decode answered: it now holds the prompt's blocks."""
        self.index.record(plan.decode.engine_id, plan.hashes)

    def forget(self, engine_id: str) -> None:
        """``engine_id`` went down: it holds nothing, its reads are void."""
        self.index.forget(engine_id)
        self.signals.forget(engine_id)

    def _load(self, backend: Backend, now: float) -> Load:
        return Load(
            num_in_flight=self.health.num_in_flight(backend.engine_id),
            signals=self.signals.signals(backend.engine_id, now),
        )

    def _cheapest_transfer(
        self, prefills: Sequence[Backend], decode: Backend, now: float
    ) -> float:
        w = self.config.weights
        return min(
            transfer_score(
                self.signals.pair(p.engine_id, decode.engine_id, now),
                w,
                self.signals.typical_handover(p.engine_id, now),
            )
            for p in prefills
        )


def _first_usable(
    session: str, all_decode_ids: Sequence[str], candidates: Sequence[Backend]
) -> Backend:
    """The session's rendezvous decode among the usable ``candidates``
    (ranked over every decode, so that losing one moves only its sessions)."""
    by_id = {d.engine_id: d for d in candidates}
    for engine_id in rendezvous_order(session, all_decode_ids):
        if engine_id in by_id:
            return by_id[engine_id]
    raise ValueError("no usable decode for the session")  # callers pass >= 1
