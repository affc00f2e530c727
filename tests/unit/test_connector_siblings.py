"""Parallel sampling (``n > 1``) on decode: one prefill, one transfer, and
every child request of the fan-out samples from the same pushed KV.

vLLM's AsyncLLM turns a request with ``n > 1`` into ``n`` children
(``f"{i}_{parent}"``) that carry the same ``kv_transfer_params``. The first
child seen registers and receives; a sibling gets ``None`` from
``get_num_new_matched_tokens`` (vLLM skips it this step and asks again)
while that receive is pending, and ``(0, False)`` once it ended (done,
failed, or the first gone), or once its own wait passed the registration's
ttl: vLLM's prefix cache then serves what the first received. A sibling
never registers, cancels, or holds anything.

The scheduler is driven as vLLM's scheduler drives it (the stand-ins of
``test_connector_scheduler.py``); the last test wires it to a decode worker
over the fake NIXL (the ``decode`` fixture of ``test_connector_worker.py``)
and checks that nothing is held afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpush.connector.decode.scheduler import DecodeScheduler
from kvpush.transfer.messages import Cancel, Done, Registration, encode
from tests.fakes.fake_nixl import FakePeers, leftovers
from tests.unit.test_connector_scheduler import (
    DECODE_PARAMS,
    PROMPT,
    FakeBlocks,
    FakeRequest,
    config_for,
    empty_step,
)
from tests.unit.test_connector_worker import (  # noqa: F401 (fixtures)
    Decode,
    assert_idle,
    clock,
    decode,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Decoding:
    """Decode's scheduler with a clock the test moves, and its n children."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.sched = DecodeScheduler(config_for("decode"), clock=self.clock)
        self.sched._peers.close()
        self.peers = FakePeers()
        self.sched._peers = self.peers  # type: ignore[assignment]
        self.sched._send = self.peers.send
        self.first, *self.siblings = (
            FakeRequest(f"{i}_parent", DECODE_PARAMS) for i in range(3)
        )

    def ask(self, req: FakeRequest) -> tuple[int | None, bool]:
        return self.sched.get_num_new_matched_tokens(req, 0)

    def admit_first(self) -> None:
        assert self.ask(self.first) == (PROMPT, True)
        self.sched.update_state_after_alloc(
            self.first, FakeBlocks([5, 6, 7, 8, 9]), PROMPT
        )

    def receive_ended(self) -> None:
        """The worker reported the first's receive over (done or failed)."""
        self.sched.update_connector_output(set(), {self.first.request_id})

    def finish(self, *reqs: FakeRequest) -> list[tuple[bool, None]]:
        return [self.sched.request_finished(r) for r in reqs]

    def assert_idle(self) -> None:
        """Every request finished: nothing is held for any of them."""
        assert leftovers(self.sched, ignore={"_peers"}) == {}
        assert leftovers(self.sched._legs, ignore={"_ended"}) == {}


@pytest.fixture
def d() -> Iterator[Decoding]:
    decoding = Decoding()
    yield decoding
    decoding.sched.close()


def test_siblings_wait_while_the_first_receives_then_take_the_prefix_cache(
    d: Decoding,
):
    d.admit_first()
    for _ in range(3):  # vLLM asks again every step
        assert [d.ask(s) for s in d.siblings] == [(None, False)] * 2

    d.receive_ended()

    assert [d.ask(s) for s in d.siblings] == [(0, False)] * 2
    assert [d.ask(s) for s in d.siblings] == [(0, False)] * 2, "and stays so"
    for s in d.siblings:  # vLLM allocates them with no external tokens
        d.sched.update_state_after_alloc(s, FakeBlocks([5, 6, 7, 8, 1]), 0)
    assert len(d.peers.messages(Registration)) == 1, "registered once"
    assert [e.req_id for e in empty_step(d.sched).expects] == ["0_parent"]
    assert d.sched.counters.get("sibling.wait") == 2, "counted once per sibling"
    assert d.sched.counters.get("sibling.after_first") == 2

    assert d.finish(d.first, *d.siblings) == [(False, None)] * 3
    assert d.peers.messages(Cancel) == [], "nobody gives the transfer up"
    d.assert_idle()


def test_siblings_seen_before_the_first_registered_wait_too(d: Decoding):
    assert d.ask(d.first) == (PROMPT, True)  # its blocks not allocated yet
    assert d.ask(d.siblings[0]) == (None, False)
    d.sched.update_state_after_alloc(d.first, FakeBlocks([5, 6, 7, 8, 9]), PROMPT)
    assert d.ask(d.siblings[0]) == (None, False)


def test_when_the_first_receive_fails_siblings_compute_the_prompt(d: Decoding):
    d.admit_first()
    assert d.ask(d.siblings[0]) == (None, False)

    d.receive_ended()  # a Failure: the worker reports it finished, as load errors

    assert [d.ask(s) for s in d.siblings] == [(0, False)] * 2
    assert len(d.peers.messages(Registration)) == 1, "siblings never register"


def test_when_the_first_is_aborted_siblings_go_on_and_only_it_cancels(d: Decoding):
    d.admit_first()
    assert d.ask(d.siblings[0]) == (None, False)

    assert d.finish(d.first) == [(True, None)]  # its blocks wait for the word

    assert d.ask(d.siblings[0]) == (0, False)
    assert empty_step(d.sched).recv_cancels == ["t1"], "the first's own cancel"
    assert d.finish(*d.siblings) == [(False, None)] * 2
    assert d.peers.messages(Cancel) == []
    d.receive_ended()  # prefill's final word released the first's blocks
    d.assert_idle()


def test_a_sibling_waits_at_most_the_registrations_ttl(d: Decoding):
    d.admit_first()
    ttl = d.sched.config.registration_ttl_s
    assert d.ask(d.siblings[0]) == (None, False)
    d.clock.now += ttl - 0.1
    assert d.ask(d.siblings[0]) == (None, False)

    d.clock.now += 0.1

    assert d.ask(d.siblings[0]) == (0, False)
    assert d.sched.counters.get("sibling.expired") == 1
    assert d.ask(d.siblings[1]) == (None, False), "its own deadline, from now"


def test_a_sibling_aborted_while_waiting_leaves_nothing_and_cancels_nothing(
    d: Decoding,
):
    d.admit_first()
    assert d.ask(d.siblings[0]) == (None, False)

    assert d.finish(d.siblings[0]) == [(False, None)]

    assert d.peers.messages(Cancel) == []
    assert d.sched._sibling_until == {}
    d.receive_ended()
    d.finish(d.first, d.siblings[1])
    d.assert_idle()


def test_a_transfer_id_whose_first_request_finished_is_served_locally(d: Decoding):
    d.admit_first()
    d.receive_ended()
    d.finish(d.first)

    late = FakeRequest("9_other", DECODE_PARAMS)
    assert d.ask(late) == (0, False)
    d.sched.update_state_after_alloc(late, FakeBlocks([1, 2, 3, 4, 10]), 0)

    assert len(d.peers.messages(Registration)) == 1, "not registered again"
    assert d.sched.counters.get("rejected.duplicate") == 1
    assert d.finish(late) == [(False, None)]
    assert d.peers.messages(Cancel) == []


def test_n_children_through_scheduler_and_worker_hold_nothing_afterwards(
    decode: Decode,  # noqa: F811 (the fixture)
):
    d = Decoding()
    try:
        d.admit_first()
        assert [d.ask(s) for s in d.siblings] == [(None, False)] * 2
        decode.worker.bind(empty_step(d.sched))
        assert decode.worker.reserved_blocks() == 5, "the first's blocks only"

        decode.io.deliver(encode(Done("t1", "p0", num_blocks=5)))
        received = decode.worker.get_finished()
        d.sched.update_connector_output(set(), received)

        assert received == {"0_parent"}
        assert [d.ask(s) for s in d.siblings] == [(0, False)] * 2
        assert d.finish(d.first, *d.siblings) == [(False, None)] * 3
        decode.worker.bind(empty_step(d.sched))
        assert decode.worker.get_finished() == set()
        assert_idle(decode.worker)
        d.assert_idle()
    finally:
        d.sched.close()
