"""A decode's NIXL agent is loaded once per decode process.

A Hello from the same process (after a reconnect, or after prefill dropped
it as silent) used to reload the agent: NIXL then dials a new connection
while the old one drains in the background, two connections carrying
WRITEs to one decode for nothing. (Found while looking for the cause of a
KV digest mismatch seen once under network faults; NIXL's UCX plugin lets
WRITEs in flight finish across a reload, so it was not shown to be that
cause: see "Known gap" in docs/design.md.)
"""

from __future__ import annotations

from kvpush.connector.nixl_io import NixlIO
from tests.unit.test_connector_post_err import FakeAgent, agent  # noqa: F401
from tests.unit.test_connector_writer import SRC_BASE, layout

DECODE = "kvpush-d0-rank0"


def test_the_same_decode_saying_hello_again_keeps_its_agent_loaded(
    agent: FakeAgent,  # noqa: F811
):
    io = NixlIO("kvpush-p0", layout(SRC_BASE), "DRAM")
    metadata = f"{DECODE}|boot-1".encode()
    assert io.load_peer(DECODE, metadata) == DECODE
    assert io.load_peer(DECODE, metadata) == DECODE  # Hello again, same process
    assert agent.remote_calls == [("add", DECODE)], "reloaded a live decode's agent"


def test_a_restarted_decode_replaces_its_old_agent(agent: FakeAgent):  # noqa: F811
    io = NixlIO("kvpush-p0", layout(SRC_BASE), "DRAM")
    io.load_peer(DECODE, f"{DECODE}|boot-1".encode())
    assert io.load_peer(DECODE, f"{DECODE}|boot-2".encode()) == DECODE
    assert agent.remote_calls == [
        ("add", DECODE),
        ("remove", DECODE),
        ("add", DECODE),
    ]
    io.close()  # unloads what is loaded: the new agent only
    assert agent.remote_calls[-1] == ("remove", DECODE)
    assert agent.remote_calls.count(("remove", DECODE)) == 2
