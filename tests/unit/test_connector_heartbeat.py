"""Decode's heartbeats do not ride on the engine step (issue 9 item 7): a
forward longer than prefill's peer timeout must not make prefill drop the
decode. Before the fix heartbeats went out only from ``get_finished``; here
the main thread does nothing at all while beats keep arriving."""

from __future__ import annotations

import time

from kvpush.connector.counters import Counters
from kvpush.connector.decode.heartbeat import Heartbeats
from kvpush.connector.side_channel import Listener
from kvpush.transfer.messages import Heartbeat
from tests.fakes.fake_nixl import wait_for
from tests.unit.test_connector_side_channel import HOST, Inbox, free_port


def beats(inbox: Inbox) -> list[Heartbeat]:
    out = []
    while not inbox.items.empty():
        _, message = inbox.items.get_nowait()
        assert isinstance(message, Heartbeat)
        out.append(message)
    return out


def test_heartbeats_keep_going_while_the_engine_step_is_stuck():
    inbox, port = Inbox(), free_port()
    listener = Listener(HOST, port, inbox)
    heartbeats = Heartbeats("d0", "boot-1", b"", 0.05, Counters())
    try:
        heartbeats.set_targets(frozenset({(HOST, port)}))

        time.sleep(0.5)  # "a long forward": no get_finished, no bind

        got = wait_for(lambda: beats(inbox), 2.0)
        assert len(got) >= 3, got
        assert got[0] == Heartbeat(engine_id="d0", boot_id="boot-1")
    finally:
        heartbeats.close()
        listener.close()


def test_no_heartbeats_when_nothing_is_awaited():
    inbox, port = Inbox(), free_port()
    listener = Listener(HOST, port, inbox)
    heartbeats = Heartbeats("d0", "boot-1", b"", 0.02, Counters())
    try:
        heartbeats.set_targets(frozenset({(HOST, port)}))
        assert wait_for(lambda: not inbox.items.empty(), 2.0)
        heartbeats.set_targets(frozenset())
        time.sleep(0.1)
        beats(inbox)

        time.sleep(0.2)

        assert beats(inbox) == []
    finally:
        heartbeats.close()
        listener.close()
