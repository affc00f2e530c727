"""An operator's proof that a prefill is gone (issue "Silent corruption ...
review", item 8): ``kvpush forget ENGINE_ID`` writes a file into each
decode's control directory, and decode's worker, at its next step, treats
every rank of that prefill as a closed loopback connection would: its
pending receives fail and their quarantined blocks are released. Never on
a timer: without the file the blocks stay held however long decode waits.
A forget is spent once read: the prefill's next boot is not touched.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvpush.cli import main
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.control import (
    FORGET_DIR,
    ControlDir,
    read_forget,
    write_forget,
)
from kvpush.connector.decode import worker as worker_module
from kvpush.connector.metadata import DecodeMetadata
from kvpush.launcher.config import ClusterConfig
from kvpush.launcher.forget import forget
from kvpush.launcher.instances import kv_transfer_config, plan_instances
from kvpush.launcher.state import TOPOLOGY_FILE
from kvpush.topology import Topology
from kvpush.transfer.messages import Done, HelloReply, encode
from tests.unit.test_connector_worker import (
    BLOCKS,
    TTL_S,
    Decode,
    FakeTime,
    assert_idle,
    close_decode,
    make_config,
    make_decode,
    recv_expect,
)

REMOTE = ("10.0.0.2", 5600)  # p0, off loopback: a closed connection proves nothing
OTHER = ("10.0.0.3", 5600)  # p1
BLOCKS["t3"] = (9, 10, 11)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(worker_module, "time", fake)
    return fake


@pytest.fixture
def control(tmp_path: Path) -> Path:
    return tmp_path / "control" / "d0"


@pytest.fixture
def decode(clock: FakeTime, control: Path) -> Iterator[Decode]:
    rig = make_decode(clock, control_dir=str(control))
    yield rig
    close_decode(rig)


def expect_from(decode: Decode, tid: str, req_id: str, engine: str, address) -> None:
    expect = dataclasses.replace(
        recv_expect(tid, req_id, address), prefill_engine_id=engine
    )
    decode.worker.bind(DecodeMetadata(expects=[expect]))


def quarantine_behind_a_partition(decode: Decode) -> None:
    """p0 (boot-1) at REMOTE owes t3; its connection drops; decode's
    deadline passes: t3's blocks are quarantined, waiting for proof."""
    decode.peers.queue_reply(HelloReply("p0", True, "boot-1"), REMOTE)
    decode.step()
    expect_from(decode, "t3", "r3", "p0", REMOTE)
    decode.peers.connection(REMOTE, up=True)
    decode.step()
    decode.peers.connection(REMOTE, up=False)
    assert decode.run(TTL_S + 6) == set()
    assert decode.worker._receiver.quarantined_blocks() == 3


def test_the_control_directory_is_made_at_start(decode: Decode, control: Path):
    assert (control / FORGET_DIR).is_dir()


def test_a_quarantined_receive_is_released_by_a_forget_and_never_before(
    decode: Decode, control: Path
):
    quarantine_behind_a_partition(decode)
    assert decode.run(600) == set(), "no timer frees the blocks"
    assert decode.worker.reserved_blocks() == 3
    assert decode.worker.counters.get("forgotten") == 0

    write_forget(control, "p0", at=decode.clock.now)
    decode.clock.now += 0.1  # within the 0.5 s between two looks
    assert decode.step() == set()

    decode.clock.now += 0.5
    assert decode.step() == {"r3"}
    assert decode.worker.take_load_errors() == {9, 10, 11}
    counters = decode.worker.counters
    assert counters.get("forgotten") == 1
    assert counters.get("quarantine.released") == 1
    assert counters.get("receive_failed.peer_lost") == 1
    assert_idle(decode.worker)
    assert decode.worker.take_quarantined() == {}


def test_a_forget_touches_only_the_prefill_it_names(decode: Decode, control: Path):
    quarantine_behind_a_partition(decode)
    decode.peers.queue_reply(HelloReply("p1", True, "boot-7"), OTHER)
    decode.step()
    expect_from(decode, "t1", "r1", "p1", OTHER)
    assert decode.worker.take_quarantined() == {"p0": 3}

    write_forget(control, "p1", at=decode.clock.now)
    decode.clock.now += 1
    assert decode.step() == {"r1"}, "p1's receive fails"
    assert decode.worker.take_load_errors() == {3, 4, 5}
    assert decode.worker._receiver.quarantined_blocks() == 3, "p0's stay held"
    write_forget(control, "p9", at=decode.clock.now)  # nothing from it
    decode.clock.now += 1
    assert decode.step() == set()
    assert decode.worker.reserved_blocks() == 3
    assert decode.worker.take_quarantined() == {}, "unchanged since the last take"

    write_forget(control, "p0", at=decode.clock.now)
    decode.clock.now += 1
    assert decode.step() == {"r3"}
    assert decode.worker.take_quarantined() == {"p0": 0}
    assert decode.worker.take_load_errors() == {9, 10, 11}
    assert decode.worker.counters.get("forgotten") == 2
    assert_idle(decode.worker)


def test_a_forget_read_before_the_prefill_came_back_spares_its_new_boot(
    decode: Decode, control: Path
):
    quarantine_behind_a_partition(decode)
    write_forget(control, "p0", at=decode.clock.now)
    decode.clock.now += 1
    assert decode.step() == {"r3"}
    assert decode.worker.take_load_errors() == {9, 10, 11}

    decode.clock.now += 30  # p0's host is replaced; the same engine id returns
    decode.peers.queue_reply(HelloReply("p0", True, "boot-2"), REMOTE)
    decode.peers.connection(REMOTE, up=True)
    decode.step()
    expect_from(decode, "t2", "r2", "p0", REMOTE)
    assert decode.run(5) == set(), "the old forget file stays, spent"
    assert decode.worker.reserved_blocks() == 3

    decode.io.deliver(encode(Done("t2", "p0", num_blocks=3)))
    assert decode.step() == {"r2"}
    assert decode.worker.take_load_errors() == set(), "the new boot's KV is good"
    assert decode.worker.counters.get("forgotten") == 1
    assert_idle(decode.worker)


def test_a_forget_written_before_a_new_boot_was_heard_spares_that_boot(
    decode: Decode, control: Path
):
    """Read late (decode was busy), a forget still names only the processes
    that were there when it was written."""
    quarantine_behind_a_partition(decode)
    written_at = decode.clock.now
    decode.clock.now += 0.2
    decode.peers.queue_reply(HelloReply("p0", True, "boot-2"), REMOTE)
    assert decode.step() == {"r3"}, "the new boot proves the old one gone"
    expect_from(decode, "t2", "r2", "p0", REMOTE)
    write_forget(control, "p0", at=written_at)

    decode.clock.now += 1
    assert decode.step() == set()
    assert decode.worker.reserved_blocks() == 3
    assert decode.worker.counters.get("forgotten") == 0


def test_without_a_control_dir_nothing_is_read(clock: FakeTime, tmp_path: Path):
    assert not ControlDir("").enabled
    assert ControlDir("").poll(0.0) == []
    rig = make_decode(clock)
    try:
        assert not rig.worker._control.enabled
    finally:
        close_decode(rig)


def test_the_control_dir_reads_each_file_once_and_skips_bad_ones(tmp_path: Path):
    reader = ControlDir(str(tmp_path))
    assert reader.poll(0.0) == [], "no forget directory yet"
    write_forget(tmp_path, "p0", at=5.0)
    (tmp_path / FORGET_DIR / "p1.json").write_text("not json")
    (tmp_path / FORGET_DIR / "p2.json").write_text('{"engine_id": "p3", "at": 1}')
    assert reader.poll(0.1) == [], "looked at 0.1 s ago: not yet"
    (only,) = reader.poll(0.6)
    assert (only.engine_id, only.at) == ("p0", 5.0)
    assert reader.poll(1.2) == [], "spent"


# -- the command -----------------------------------------------------------------


def write_topology(run_dir: Path, mode: str = "kvpush") -> None:
    config = ClusterConfig(mode=mode, num_prefill=2, num_decode=2)
    specs = plan_instances(config, run_dir)
    topology = Topology(mode=mode, backends=tuple(s.backend() for s in specs))  # type: ignore[arg-type]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / TOPOLOGY_FILE).write_bytes(msgspec.json.encode(topology))


def test_forget_writes_into_every_decodes_control_dir(tmp_path, capsys):
    write_topology(tmp_path)

    assert main(["forget", "prefill1", "--run-dir", str(tmp_path), "--yes"]) == 0

    for name in ("decode0", "decode1"):
        path = tmp_path / "control" / name / FORGET_DIR / "prefill1.json"
        assert read_forget(path).engine_id == "prefill1"
        assert json.loads(path.read_text())["at"] > 0
    assert sorted(p.name for p in (tmp_path / "control").rglob("*")) == [
        "decode0", "decode1", "forget", "forget", "prefill1.json", "prefill1.json",
    ], "no temporary file left"  # fmt: skip
    out = capsys.readouterr().out
    assert "treat prefill prefill1 as gone" in out and "confirmed down" in out


def test_the_launchers_decodes_read_where_forget_writes(tmp_path: Path):
    write_topology(tmp_path)
    config = ClusterConfig(mode="kvpush", num_prefill=2, num_decode=2)
    prefill, _, decode0, _ = plan_instances(config, tmp_path)
    (path,) = forget("prefill0", run_dir=tmp_path)[:1]
    kv = kv_transfer_config(config, decode0)
    assert kv is not None
    assert path.parent.parent == Path(kv["kv_connector_extra_config"]["control_dir"])
    prefill_kv = kv_transfer_config(config, prefill)
    assert prefill_kv is not None
    assert "control_dir" not in prefill_kv["kv_connector_extra_config"]


def test_forget_also_reaches_prefills_that_receive_with_kv_both(tmp_path: Path):
    """A ``--kv-both`` prefill serves decode legs too; its connector made its
    control directory at start, so a forget of another prefill goes there
    as well (never to the forgotten one's)."""
    write_topology(tmp_path)
    for name in ("prefill0", "prefill1"):  # as their decode sides made them
        (tmp_path / "control" / name).mkdir(parents=True)

    paths = forget("prefill1", run_dir=tmp_path)

    owners = sorted(p.parent.parent.name for p in paths)
    assert owners == ["decode0", "decode1", "prefill0"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["decode0"], "'decode0' is not a prefill of the cluster"),
        (["prefill7"], "its prefills: prefill0, prefill1"),
        (["../x"], "cannot name a forget file"),
    ],
)
def test_forget_refuses_what_is_not_a_prefill_of_the_run(
    tmp_path, capsys, args, message
):
    write_topology(tmp_path)
    assert main(["forget", *args, "--run-dir", str(tmp_path), "--yes"]) != 0
    assert message in capsys.readouterr().err
    assert not (tmp_path / "control").exists()


def test_forget_refuses_a_run_without_kvpush_decodes(tmp_path, capsys):
    write_topology(tmp_path, mode="vllm-push")
    assert main(["forget", "prefill0", "--run-dir", str(tmp_path), "--yes"]) != 0
    assert "only kvpush's decodes read forget files" in capsys.readouterr().err
    assert main(["forget", "prefill0", "--run-dir", str(tmp_path / "no")]) != 0


def test_forget_into_one_control_dir_and_asks_first(tmp_path, capsys, monkeypatch):
    control = tmp_path / "d"
    argv = ["forget", "p0", "--control-dir", str(control)]
    assert main([*argv, "--yes"]) != 0, "no such control directory"
    control.mkdir()
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    assert main(argv) == 1
    assert not (control / FORGET_DIR).exists(), "not confirmed: nothing written"
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    assert main(argv) == 0
    assert read_forget(control / FORGET_DIR / "p0.json").engine_id == "p0"


# -- the connector's config --------------------------------------------------------


def test_control_dir_must_be_absolute_or_empty(tmp_path: Path):
    assert make_config("decode").control_dir == ""
    assert make_config("decode", control_dir=str(tmp_path)).control_dir
    for bad in ("relative/dir", "/a\0b"):
        with pytest.raises(ValueError, match="control_dir must be an absolute path"):
            make_config("decode", control_dir=bad)


def test_control_dir_from_vllms_config_must_be_a_string():
    from types import SimpleNamespace

    def vllm_config(extra: dict) -> SimpleNamespace:
        kv = SimpleNamespace(
            kv_role="kv_consumer", engine_id="d0", kv_connector_extra_config=extra
        )
        return SimpleNamespace(
            kv_transfer_config=kv,
            instance_id="i",
            cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
        )

    base = {"side_channel_port": 5600}
    config = ConnectorConfig.from_vllm(vllm_config({**base, "control_dir": "/r/c"}))
    assert config.control_dir == "/r/c"
    with pytest.raises(ValueError, match="control_dir must be a directory path"):
        ConnectorConfig.from_vllm(vllm_config({**base, "control_dir": 1}))
