"""The side channel delivers valid kvpush messages from decode's DEALER
sockets to prefill's listener and its replies back to the socket that sent
them, and drops (and counts) anything else without missing a beat.

Real ZMQ sockets on 127.0.0.1, each test on a fresh free port.
"""

from __future__ import annotations

import queue
import random
import socket
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq

from kvpush.connector import side_channel
from kvpush.connector.counters import Counters
from kvpush.connector.side_channel import Listener, Peers
from kvpush.transfer.groups import one
from kvpush.transfer.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Cancel,
    HelloReply,
    HelloRequest,
    Message,
    Registration,
    encode,
)
from tests.fakes.fake_nixl import wait_for

HOST = "127.0.0.1"
WAIT_S = 3.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def registration(tid: str = "t1") -> Registration:
    return Registration(
        transfer_id=tid,
        decode_engine_id="d0",
        decode_boot_id="b0",
        dst_block_ids=one((1, 2)),
        num_tokens=20,
        ttl_s=10.0,
    )


class Inbox:
    """The listener's ``on_message``: queues what it is given."""

    def __init__(self) -> None:
        self.items: queue.Queue[tuple[bytes, Message]] = queue.Queue()
        self.fail_next = False

    def __call__(self, route: bytes, message: Message) -> None:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("handler bug")
        self.items.put((route, message))

    def next(self) -> tuple[bytes, Message]:
        return self.items.get(timeout=WAIT_S)


@pytest.fixture
def channel() -> Iterator[tuple[Listener, Inbox, int]]:
    inbox = Inbox()
    port = free_port()
    listener = Listener(HOST, port, inbox)
    yield listener, inbox, port
    listener.close()
    assert not listener._thread.is_alive(), "listener thread did not stop"


@pytest.fixture
def peers() -> Iterator[Peers]:
    p = Peers()
    yield p
    p.close()


@pytest.fixture
def raw_dealer(channel) -> Iterator[zmq.Socket[bytes]]:
    _, _, port = channel
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{HOST}:{port}")
    yield sock
    sock.close(linger=0)


def test_a_registration_sent_through_peers_reaches_the_listener(channel, peers):
    _, inbox, port = channel

    assert peers.send(HOST, port, registration())

    route, message = inbox.next()
    assert message == registration()
    assert route, "the sender's route comes with the message"


def test_a_reply_reaches_the_socket_that_sent_the_message(channel, peers):
    listener, inbox, port = channel
    other = Peers()
    try:
        other.send(HOST, port, Cancel(transfer_id="t0", engine_id="d1"))
        inbox.next()
        peers.send(HOST, port, registration())
        route, _ = inbox.next()

        listener.reply(route, HelloReply(engine_id="p0", accepted=True, boot_id="pb"))

        got: list[tuple[tuple[str, int], Message]] = []
        assert wait_for(lambda: got.extend(peers.receive()) or got, WAIT_S)
        reply = HelloReply(engine_id="p0", accepted=True, boot_id="pb")
        assert got == [((HOST, port), reply)], "with the address it came from"
        assert other.receive() == [], "only the sender gets the reply"
    finally:
        other.close()


def wrong_version() -> bytes:
    return msgspec.msgpack.encode((PROTOCOL_VERSION + 1, registration()))


GARBAGE: dict[str, Callable[[], list[bytes]]] = {
    "random bytes": lambda: [random.Random(7).randbytes(64)],
    "empty": lambda: [b""],
    "oversized": lambda: [encode(registration()) + b"\0" * MAX_MESSAGE_BYTES],
    "wrong version": lambda: [wrong_version()],
    "unknown type": lambda: [
        msgspec.msgpack.encode((PROTOCOL_VERSION, {"type": "evil"}))
    ],
    "invalid body": lambda: [
        msgspec.msgpack.encode((PROTOCOL_VERSION, {"type": "registration"}))
    ],
    "three frames": lambda: [encode(registration("t9")), b"extra"],
}


@pytest.mark.parametrize("frames", GARBAGE.values(), ids=GARBAGE.keys())
def test_garbage_is_counted_and_dropped_and_the_next_message_gets_through(
    channel, raw_dealer, frames
):
    listener, inbox, _ = channel

    raw_dealer.send_multipart(frames())
    raw_dealer.send(encode(registration("t2")))

    _, message = inbox.next()
    assert message == registration("t2"), "the garbage was not delivered"
    assert listener.num_rejected == 1
    assert inbox.items.empty()


def test_a_failing_handler_does_not_stop_the_listener(channel, raw_dealer):
    listener, inbox, _ = channel
    inbox.fail_next = True

    raw_dealer.send(encode(registration("t1")))
    raw_dealer.send(encode(registration("t2")))

    assert inbox.next()[1] == registration("t2")
    assert listener.num_rejected == 0


def test_peers_receive_drops_malformed_replies(peers):
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port(f"tcp://{HOST}")
    try:
        peers.send(HOST, port, registration())
        assert router.poll(int(WAIT_S * 1000)), "the registration never arrived"
        route, _ = router.recv_multipart()
        router.send_multipart([route, b"not a message"])
        router.send_multipart(
            [route, encode(HelloReply(engine_id="p0", accepted=True, boot_id="pb"))]
        )

        got: list[tuple[tuple[str, int], Message]] = []
        assert wait_for(lambda: got.extend(peers.receive()) or got, WAIT_S)
        assert [m for _, m in got] == [
            HelloReply(engine_id="p0", accepted=True, boot_id="pb")
        ]
    finally:
        router.close(linger=0)


def test_with_a_shared_secret_only_sealed_messages_get_through():
    inbox = Inbox()
    port = free_port()
    counters = Counters()
    listener = Listener(HOST, port, inbox, counters, secret=b"s3cret")
    good, wrong, plain = Peers(b"s3cret"), Peers(b"guess"), Peers()
    try:
        wrong.send(HOST, port, registration("t-wrong"))
        plain.send(HOST, port, registration("t-plain"))
        good.send(HOST, port, registration("t-good"))

        route, message = inbox.next()
        assert message == registration("t-good")
        # the wrong MAC, and the unsealed message (no MAC at all)
        assert wait_for(lambda: counters.get("rejected.auth") == 2, WAIT_S)
        assert listener.num_rejected == 2
        listener.reply(route, HelloReply(engine_id="p0", accepted=True, boot_id="pb"))
        got: list[tuple[tuple[str, int], Message]] = []
        assert wait_for(lambda: got.extend(good.receive()) or got, WAIT_S)
        assert [m for _, m in got] == [
            HelloReply(engine_id="p0", accepted=True, boot_id="pb")
        ]
        assert inbox.items.empty()
    finally:
        for p in (good, wrong, plain):
            p.close()
        listener.close()


def test_peers_report_a_connection_coming_up_and_going_down(peers):
    port = free_port()
    monitored = Peers(monitor=True)
    listener = Listener(HOST, port, Inbox())
    try:
        monitored.send(HOST, port, registration())
        events: list = []
        assert wait_for(lambda: events.extend(monitored.connection_events()) or events)
        assert events[0].up and events[0].address == (HOST, port)
        listener.close()
        down: list = []
        assert wait_for(
            lambda: down.extend(monitored.connection_events()) or down, WAIT_S
        )
        assert not down[0].up
    finally:
        monitored.close()


def test_a_reply_leaves_at_once_not_at_the_next_poll(monkeypatch, peers):
    """A reply from another thread wakes the listener: with a poll period
    far longer than the wait, the reply still arrives, and close() ends
    the thread at once."""
    monkeypatch.setattr(side_channel, "POLL_MS", 600_000)
    inbox = Inbox()
    port = free_port()
    listener = Listener(HOST, port, inbox)
    try:
        peers.send(HOST, port, registration())
        route, _ = inbox.next()  # the listener now sleeps in its poll

        listener.reply(route, HelloRequest("p0", "boot", "t1"))

        got: list[tuple[tuple[str, int], Message]] = []
        assert wait_for(lambda: got.extend(peers.receive()) or got, WAIT_S)
        assert got == [((HOST, port), HelloRequest("p0", "boot", "t1"))]
    finally:
        listener.close(timeout_s=WAIT_S)
    assert not listener._thread.is_alive()
