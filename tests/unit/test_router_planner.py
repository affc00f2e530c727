"""kvpush's routing plan: decode first (affinity, prefix, load), then the
binding from what it holds, then the prefill by load and transfer cost."""

from __future__ import annotations

import random

import pytest

from kvpush.router.config import RoutingConfig
from kvpush.router.errors import RouterError
from kvpush.router.health import HealthBoard
from kvpush.router.planner import Planner, Prompt
from kvpush.router.prefix import PrefixIndex, rendezvous_order
from kvpush.router.signals import Scrape, SignalBoard
from kvpush.topology import Backend

P = tuple(
    Backend(role="prefill", url=f"http://p{i}", engine_id=f"p{i}") for i in (0, 1)
)
D = tuple(Backend(role="decode", url=f"http://d{i}", engine_id=f"d{i}") for i in (0, 1))
BS = 4


def _planner(binding: str = "auto", **routing: object) -> Planner:
    config = RoutingConfig(
        binding=binding,  # type: ignore[arg-type]
        block_size=BS,
        skip_max_new_tokens=8,
        **routing,  # type: ignore[arg-type]
    )
    signals = SignalBoard(max_age_s=3.0)
    for b in (*P, *D):
        signals.record(b.engine_id, Scrape(num_waiting=0, num_running=0), now=0.0)
    board = HealthBoard((*P, *D), unhealthy_after=1)
    return Planner(config, board, signals, PrefixIndex(1000), random.Random(0))


def _plan(planner: Planner, prompt: Prompt, avoided: tuple[str, ...] = ()):
    return planner.plan(P, D, avoided, prompt, now=1.0)


def _busy(planner: Planner, engine_id: str, waiting: int) -> None:
    scrape = Scrape(num_waiting=waiting, num_running=4)
    planner.signals.record(engine_id, scrape, now=1.0)


LONG = tuple(range(40))  # 10 blocks: too many new tokens to skip


def test_a_fresh_long_prompt_binds_early_and_a_short_one_skips() -> None:
    planner = _planner()
    plan = _plan(planner, Prompt(LONG))
    assert plan.decision.binding == "early" and plan.prefill is not None
    short = _plan(planner, Prompt(tuple(range(100, 106))))
    assert short.decision.binding == "skip" and short.prefill is None


def test_the_next_turn_goes_to_the_decode_holding_it_and_skips() -> None:
    planner = _planner()
    first = _plan(planner, Prompt(LONG))
    planner.served(first)
    for _ in range(3):  # whatever the rotation, the prefix wins
        turn = _plan(planner, Prompt((*LONG, 1, 2, 3, 4, 5)))
        assert turn.decode == first.decode and turn.decode_reason == "prefix"
        assert turn.decision.reason == "few_new_tokens" and turn.prefill is None
        assert turn.num_held_tokens == 40


def test_a_session_sticks_to_its_rendezvous_decode_across_replicas() -> None:
    one, two = _planner(), _planner()
    session = "conversation-7"
    wanted = rendezvous_order(session, ["d0", "d1"])[0]
    for planner in (one, two):
        for _ in range(3):
            plan = _plan(planner, Prompt(LONG, session))
            assert plan.decode.engine_id == wanted
            assert plan.decode_reason == "affinity"


def test_a_session_spills_off_a_decode_far_busier_than_the_best() -> None:
    planner = _planner()
    session = "conversation-7"
    wanted = rendezvous_order(session, ["d0", "d1"])[0]
    _busy(planner, wanted, waiting=10)
    plan = _plan(planner, Prompt(LONG, session))
    assert plan.decode.engine_id != wanted and plan.decode_reason == "spill"


def test_decode_by_load_then_prefill_by_load() -> None:
    planner = _planner(binding="early")
    _busy(planner, "d0", waiting=3)
    _busy(planner, "p1", waiting=3)
    for _ in range(4):
        plan = _plan(planner, Prompt(None))
        assert plan.decode.engine_id == "d1" and plan.prefill == P[0]
        assert plan.decision.reason == "forced"


def test_a_stale_read_makes_an_instance_unknown_and_less_preferred() -> None:
    planner = _planner(binding="early")
    planner.signals.record("d1", Scrape(num_waiting=0, num_running=0), now=100.0)
    plans = [planner.plan(P, D, (), Prompt(None), now=101.0) for _ in range(4)]
    assert {p.decode.engine_id for p in plans} == {"d1"}  # d0's read is stale


def test_the_router_own_legs_count_before_the_next_read() -> None:
    planner = _planner(binding="early")
    planner.health.begin("d0")
    planner.health.begin("d0")
    assert {_plan(planner, Prompt(None)).decode.engine_id for _ in range(4)} == {"d1"}


def test_the_pair_transfer_cost_steers_prefill() -> None:
    planner = _planner(binding="early")
    slow = Scrape(
        num_waiting=0, num_running=0,
        handover_sum_s={"d0": 1.0, "d1": 1.0}, handover_count={"d0": 2, "d1": 2},
    )  # fmt: skip
    planner.signals.record("p0", slow, now=1.0)
    planner.health.begin("d1")  # d0 is the decode
    assert {_plan(planner, Prompt(None)).prefill for _ in range(4)} == {P[1]}


def test_a_pair_not_measured_yet_costs_what_the_prefills_measured_ones_do() -> None:
    """Bound late, p0 holds the KV; d0 is busy and p0 has pushed to d1 only:
    d0's transfer is unknown, not free, so the busy decode does not win on
    it (a measured pair always lost to an unmeasured one, and the late
    router split evenly between a busy and a free decode)."""
    planner = _planner(binding="late")
    _busy(planner, "d0", waiting=0)  # 4 running
    measured = Scrape(
        num_waiting=0, num_running=0,
        handover_sum_s={"d1": 0.1}, handover_count={"d1": 2},  # 50 ms each
    )  # fmt: skip
    planner.signals.record("p0", measured, now=1.0)
    for i in range(4):
        prompt = Prompt(tuple(range(i * 100, i * 100 + 40)))
        plan = _plan(planner, prompt)
        decode, _, _ = planner.choose_late_decode(D, (), prompt, P[0], plan.hashes, 1.0)
        assert decode == D[1]


def test_avoided_and_unhealthy_instances_are_not_chosen() -> None:
    planner = _planner(binding="early")
    planner.health.mark_unreachable("d0", "refused")
    plan = _plan(planner, Prompt(None), avoided=("p0",))
    assert plan.decode == D[1] and plan.prefill == P[1]


def test_no_decode_is_503_and_no_prefill_skips_in_auto_only() -> None:
    planner = _planner()
    with pytest.raises(RouterError) as err:
        _plan(planner, Prompt(LONG), avoided=("d0", "d1"))
    assert err.value.status == 503
    plan = _plan(planner, Prompt(LONG), avoided=("p0", "p1"))
    assert plan.decision.reason == "no_prefill" and plan.prefill is None
    early = _planner(binding="early")
    with pytest.raises(RouterError) as err:
        _plan(early, Prompt(LONG), avoided=("p0", "p1"))
    assert err.value.status == 503


def test_forgetting_a_decode_drops_what_it_held() -> None:
    planner = _planner()
    first = _plan(planner, Prompt(LONG))
    planner.served(first)
    planner.forget(first.decode.engine_id)
    assert _plan(planner, Prompt((*LONG, 1))).num_held_tokens == 0
