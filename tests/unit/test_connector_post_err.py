"""A WRITE NIXL refuses at post time, after giving it a handle, is a WRITE
in flight that already failed: prefill's source blocks stay held, and
decode hears nothing, until NIXL released that handle.

Before the fix ``NixlIO.write`` released such a handle inline and dropped
it when that release raised; the pipeline then freed the source blocks and
told decode ``write_failed`` at once, so decode could reuse blocks a partly
posted WRITE still wrote into.

The pipeline is driven directly (no writer thread, no sleeps; the shared
rig of :mod:`tests.unit.prefill_pipeline_rig`): each ``tick(now)`` runs its
steps once at an explicit time.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np
import pytest

from kvpush.connector.nixl_io import NixlIO, WriteRefused
from kvpush.connector.prefill.writes import RETRY_S
from kvpush.transfer.messages import Cause
from tests.unit.prefill_pipeline_rig import PipelineRig
from tests.unit.test_connector_writer import SRC_BASE, layout


class PostRig(PipelineRig):
    """The shared pure rig (:mod:`tests.unit.prefill_pipeline_rig`), pushing t1."""

    def push(self, now: float) -> None:
        """Decode's Hello and Registration, then prefill's KV for ``t1``."""
        self.hello(now)
        self.register(now)
        self.ready(now)

    def assert_held(self) -> None:
        """The refused WRITE's handle is held: blocks kept, decode not told."""
        (write,) = self.writes()
        assert write.refused and not write.released
        assert self.finished == [], "source blocks freed while NIXL holds the WRITE"
        assert self.failures() == [], "decode told while NIXL holds the WRITE"

    def assert_ended_once(self) -> None:
        """Released: blocks freed, exactly one Failure(write_failed)."""
        (write,) = self.writes()
        assert write.released and not write.cancelled
        assert self.finished == ["req-1"]
        assert self.failures() == [("t1", Cause.WRITE_FAILED)]
        assert len(self.pipeline._writes) == 0
        assert self.notifications() == [], "a refused WRITE says no Done"
        assert self.io.misuse == [], self.io.misuse


def held_until_released(rig: PostRig) -> None:
    """NIXL refuses the first two releases (at the post's tick, then
    RETRY_S later) and lets go at the third."""
    rig.push(now=0.0)
    rig.tick(0.0)  # posted, refused; its release tried at once: refused
    rig.assert_held()
    rig.tick(RETRY_S / 2)  # not yet time to try again
    rig.assert_held()
    rig.tick(RETRY_S)  # second try: refused
    rig.assert_held()
    rig.tick(2 * RETRY_S)  # third try: released
    rig.assert_ended_once()
    rig.tick(3 * RETRY_S)
    rig.assert_ended_once()  # nothing said or freed twice
    rig.tracer.close()


def test_a_write_nixl_says_err_for_at_post_holds_the_blocks_until_released():
    rig = PostRig()
    rig.io.refuse_next_write()  # transfer() returns ERR
    rig.io.release_failures = 2
    held_until_released(rig)


def test_a_write_whose_transfer_raises_holds_the_blocks_until_released():
    rig = PostRig()
    rig.io.refuse_next_write(RuntimeError("nixlRemoteDisconnectError"))
    rig.io.raise_next("release", times=2)  # release_xfer_handle raises
    held_until_released(rig)


def test_a_write_without_a_handle_fails_at_once():
    rig = PostRig()
    rig.io.fail_next_write(RuntimeError("initialize_xfer: no route to peer"))
    rig.push(now=0.0)
    rig.tick(0.0)
    assert rig.writes() == []
    assert rig.finished == ["req-1"]
    assert rig.failures() == [("t1", Cause.WRITE_FAILED)]
    assert len(rig.pipeline._writes) == 0
    rig.tracer.close()


# -- NixlIO.write against a fake nixl agent ----------------------------------


class FakeAgent:
    """The ``nixl_agent`` calls :class:`NixlIO` makes; ``transfer`` returns
    ``state`` or raises ``transfer_error``; ``initialize_xfer`` raises
    ``init_error`` if set."""

    def __init__(self) -> None:
        self.state = "PROC"
        self.transfer_error: Exception | None = None
        self.init_error: Exception | None = None
        self.handle = object()
        self.released: list[Any] = []
        self.remote_calls: list[tuple[str, str]] = []  # (call, agent name)

    def add_remote_agent(self, metadata: bytes) -> bytes:
        name = metadata.split(b"|")[0]  # "name|boot": the test's metadata
        self.remote_calls.append(("add", name.decode()))
        return name

    def remove_remote_agent(self, name: str) -> None:
        self.remote_calls.append(("remove", name))

    def get_reg_descs(self, regions: Any, mem_type: str) -> Any:
        return regions

    def register_memory(self, reg: Any) -> None:
        pass

    def get_agent_metadata(self) -> bytes:
        return b"fake-agent"

    def get_xfer_descs(self, descs: Any, mem_type: str) -> Any:
        return descs

    def initialize_xfer(self, *args: Any) -> Any:
        if self.init_error is not None:
            raise self.init_error
        return self.handle

    def transfer(self, handle: Any) -> str:
        if self.transfer_error is not None:
            raise self.transfer_error
        return self.state

    def release_xfer_handle(self, handle: Any) -> None:
        self.released.append(handle)


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> FakeAgent:
    """A :class:`FakeAgent` that ``NixlIO`` gets for ``nixl_agent(...)``."""
    fake = FakeAgent()
    api = types.ModuleType("nixl._api")
    api.nixl_agent = lambda name, config: fake  # type: ignore[attr-defined]
    api.nixl_agent_config = lambda **kwargs: kwargs  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nixl._api", api)
    return fake


def write(io: NixlIO) -> Any:
    descs = np.zeros((1, 3), dtype=np.uint64)
    return io.write(descs, descs, "kvpush-d0", b"done")


def test_nixl_io_write_returns_the_handle_of_an_accepted_write(agent: FakeAgent):
    io = NixlIO("kvpush-p0", layout(SRC_BASE), "DRAM")
    assert write(io) is agent.handle
    assert agent.released == []


def test_nixl_io_write_hands_an_err_handle_to_the_caller_unreleased(
    agent: FakeAgent,
):
    io = NixlIO("kvpush-p0", layout(SRC_BASE), "DRAM")
    agent.state = "ERR"
    with pytest.raises(WriteRefused) as refused:
        write(io)
    assert refused.value.handle is agent.handle
    assert agent.released == [], "released inline: the caller cannot retry it"


def test_nixl_io_write_hands_the_handle_of_a_raising_transfer_to_the_caller(
    agent: FakeAgent,
):
    io = NixlIO("kvpush-p0", layout(SRC_BASE), "DRAM")
    agent.transfer_error = RuntimeError("nixlRemoteDisconnectError")
    with pytest.raises(WriteRefused) as refused:
        write(io)
    assert refused.value.handle is agent.handle
    assert refused.value.__cause__ is agent.transfer_error
    assert agent.released == []


def test_nixl_io_write_without_a_handle_raises_the_error_itself(agent: FakeAgent):
    io = NixlIO("kvpush-p0", layout(SRC_BASE), "DRAM")
    agent.init_error = ValueError("bad descriptors")
    with pytest.raises(ValueError, match="bad descriptors"):
        write(io)
    assert agent.released == []
