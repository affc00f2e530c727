"""The launcher's config, instance plan and process groups (no vLLM)."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from kvpush.cli import _parser, up_config
from kvpush.connector.connector import KvPushConnector
from kvpush.launcher import process
from kvpush.launcher.cluster import _healthy
from kvpush.launcher.config import ClusterConfig, load_config_file, make_config
from kvpush.launcher.instances import kv_transfer_config, plan_instances


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mode": "magic"}, "mode must be one of"),
        ({"num_prefill": 0}, "--prefill must be between 1 and 8"),
        ({"num_decode": 9}, "--decode must be between 1 and 8"),
        ({"port": 8100}, r"port and base_http_port ranges overlap .*8100\)"),
        ({"base_side_channel_port": 8101}, "ranges overlap"),
        (
            {"mode": "kvpush", "base_kv_events_port": 5601},
            r"base_side_channel_port and base_kv_events_port ranges overlap",
        ),
        ({"mode": "vllm-pull", "base_kv_events_port": 5601}, None),  # not used
        ({"port": 80}, "within 1024..65535"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"mode": "colocated", "num_prefill": 2}, "colocated mode runs one instance"),
        ({"startup_timeout_s": 0}, "startup_timeout_s must be positive"),
    ],
)
def test_bad_settings_say_what_to_change(fields: dict, message: str | None) -> None:
    if message is None:
        ClusterConfig(**fields)
        return
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**fields)


def test_each_instance_gets_its_own_ports_core_and_log(tmp_path: Path) -> None:
    config = ClusterConfig(mode="vllm-push", num_prefill=2, num_decode=1, cores=(0, 1))
    specs = plan_instances(config, tmp_path)
    assert [s.name for s in specs] == ["prefill0", "prefill1", "decode0"]
    assert [s.http_port for s in specs] == [8100, 8101, 8102]
    assert [s.side_channel_port for s in specs] == [5600, 5601, 5602]
    assert [s.cores for s in specs] == [(0,), (1,), (0,)]
    assert len({s.log_path for s in specs}) == 3


def test_kv_transfer_config_per_mode(tmp_path: Path) -> None:
    kvpush = ClusterConfig(mode="kvpush")
    prefill, decode = plan_instances(kvpush, tmp_path)
    kv = kv_transfer_config(kvpush, prefill)
    assert kv is not None
    assert (kv["kv_connector"], kv["kv_role"], kv["engine_id"]) == (
        "KvPushConnector", "kv_producer", "prefill0",
    )  # fmt: skip
    assert kv["kv_load_failure_policy"] == "recompute"
    assert kv["kv_connector_extra_config"]["side_channel_port"] == 5600
    assert "fault_file" not in kv["kv_connector_extra_config"]
    assert "ready_ttl_s" not in kv["kv_connector_extra_config"]
    pull_config = ClusterConfig(mode="vllm-pull", kv_load_failure_policy="error")
    pull = kv_transfer_config(pull_config, decode)
    assert pull is not None and pull["kv_connector"] == "FairNixlConnector"
    assert pull["kv_load_failure_policy"] == "fail"
    assert "kv_connector_extra_config" not in pull
    colocated_config = ClusterConfig(mode="colocated", num_prefill=0, num_decode=0)
    (colocated,) = plan_instances(colocated_config, tmp_path)
    assert kv_transfer_config(colocated_config, colocated) is None


def test_kvpush_deadlines_and_fault_file_reach_the_connector(tmp_path: Path) -> None:
    config = ClusterConfig(
        mode="kvpush", ready_ttl_s=3.0, peer_timeout_s=2.0, fault_injection=True
    )
    _, decode = plan_instances(config, tmp_path)
    kv = kv_transfer_config(config, decode)
    assert kv is not None
    extra = kv["kv_connector_extra_config"]
    assert (extra["ready_ttl_s"], extra["peer_timeout_s"]) == (3.0, 2.0)
    assert "registration_ttl_s" not in extra
    assert extra["fault_file"] == str(tmp_path / "faults.json")


@pytest.mark.parametrize(
    "fields",
    [{"kv_load_failure_policy": "retry"}, {"ready_ttl_s": 0}, {"peer_timeout_s": -1}],
)
def test_bad_failure_settings_are_refused(fields: dict) -> None:
    with pytest.raises(ValueError):
        ClusterConfig(mode="kvpush", **fields)


def test_config_file_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text('mode = "vllm-push"\nport = 9000\nnum_decode = 2\n')
    args = _parser().parse_args(["up", "--config", str(path), "--port", "9100"])
    config = up_config(args)
    assert (config.mode, config.port, config.num_decode) == ("vllm-push", 9100, 2)


def test_bad_config_files_are_refused(tmp_path: Path) -> None:
    unknown = tmp_path / "a.json"
    unknown.write_text(json.dumps({"mode": "vllm-pull", "prefils": 2}))
    with pytest.raises(ValueError, match="unknown keys"):
        load_config_file(unknown)
    broken = tmp_path / "b.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config_file(broken)
    with pytest.raises(ValueError, match="cannot read"):
        load_config_file(tmp_path / "missing.toml")
    with pytest.raises(ValueError, match="bad cluster setting"):
        make_config({"num_prefill": "two"})


def test_stop_group_ends_the_process_and_its_children(tmp_path: Path) -> None:
    # A parent that forks a child, like vLLM's API server and its EngineCore.
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    pid = process.spawn([sys.executable, "-c", code], {}, tmp_path / "p.log")
    deadline = time.monotonic() + 10
    while len(process.group_members(pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(process.group_members(pid)) == 2
    assert process.stop_group(pid, grace_s=5)
    assert process.group_members(pid) == []


@pytest.mark.parametrize("granularity", ["chunk", "layer", "auto"])
def test_push_granularity_reaches_the_connector(
    tmp_path: Path, granularity: str
) -> None:
    config = ClusterConfig(mode="kvpush", push_granularity=granularity)
    prefill, decode = plan_instances(config, tmp_path)
    kv = kv_transfer_config(config, prefill)
    assert kv is not None
    assert kv["kv_connector_extra_config"]["push_granularity"] == granularity
    # decode pushes nothing: no per-layer push named, so vLLM keeps its
    # CUDA graphs FULL there
    decode_kv = kv_transfer_config(config, decode)
    assert decode_kv is not None
    assert not KvPushConnector.requires_piecewise_for_cudagraph(
        decode_kv["kv_connector_extra_config"]
    )
    with pytest.raises(ValueError, match="one of"):
        ClusterConfig(mode="kvpush", push_granularity="layers")


@pytest.mark.parametrize("name", ["auto", "request", "chunk", "layer"])
def test_up_and_serve_accept_every_push_granularity(name: str) -> None:
    from kvpush.launcher.cli import serve_config

    up = _parser().parse_args(["up", "--mode", "kvpush", "--push-granularity", name])
    assert up_config(up).push_granularity == name
    serve = ["serve", "--role", "prefill", "--push-granularity", name]
    assert serve_config(_parser().parse_args(serve)).push_granularity == name


def test_up_passes_the_binding_to_its_router(tmp_path: Path) -> None:
    from kvpush.launcher.cluster import router_command

    args = _parser().parse_args(["up", "--mode", "kvpush", "--binding", "auto"])
    config = up_config(args)
    cmd = router_command(config, tmp_path)
    assert cmd[cmd.index("--binding") + 1] == "auto"
    assert "--binding" not in router_command(ClusterConfig(mode="kvpush"), tmp_path)
    with pytest.raises(ValueError, match="for kvpush mode"):
        ClusterConfig(mode="vllm-pull", binding="auto")
    assert ClusterConfig(mode="kvpush", binding="late").binding == "late"
    with pytest.raises(ValueError, match="unknown binding"):
        ClusterConfig(mode="kvpush", binding="never")


def test_up_passes_where_the_first_token_comes_from_to_its_router(
    tmp_path: Path,
) -> None:
    from kvpush.launcher.cluster import router_command

    argv = ["up", "--mode", "kvpush", "--first-token-from", "decode"]
    cmd = router_command(up_config(_parser().parse_args(argv)), tmp_path)
    assert cmd[cmd.index("--first-token-from") + 1] == "decode"
    plain = router_command(ClusterConfig(mode="kvpush"), tmp_path)
    assert "--first-token-from" not in plain
    with pytest.raises(ValueError, match="for kvpush mode"):
        ClusterConfig(mode="vllm-pull", first_token_from="decode")
    with pytest.raises(ValueError, match="prefill, decode"):
        ClusterConfig(mode="kvpush", first_token_from="router")


def test_kv_both_gives_every_kvpush_instance_both_roles(tmp_path: Path) -> None:
    """``--kv-both``: prefill and decode alike get kv_role kv_both, prefill's
    granularity (either may push) and a control directory (either may
    receive)."""
    config = ClusterConfig(mode="kvpush", kv_both=True, push_granularity="chunk")
    for spec in plan_instances(config, tmp_path):
        kv = kv_transfer_config(config, spec)
        assert kv is not None and kv["kv_role"] == "kv_both"
        extra = kv["kv_connector_extra_config"]
        assert extra["push_granularity"] == "chunk"
        assert extra["control_dir"].endswith(f"control/{spec.name}")


def test_kv_both_is_for_kvpush_mode_and_reaches_up_and_serve() -> None:
    from kvpush.launcher.cli import serve_config

    with pytest.raises(ValueError, match="kv_both is for kvpush mode"):
        ClusterConfig(mode="vllm-pull", kv_both=True)
    up = _parser().parse_args(["up", "--mode", "kvpush", "--kv-both"])
    assert up_config(up).kv_both
    assert not up_config(_parser().parse_args(["up", "--mode", "kvpush"])).kv_both
    serve = ["serve", "--role", "decode", "--mode", "kvpush", "--kv-both"]
    assert serve_config(_parser().parse_args(serve)).kv_both


def test_a_poll_that_reads_no_http_answer_is_not_ready() -> None:
    """Before an instance listens, polling a port in the ephemeral range can
    connect the socket to itself: it reads its own request back as the
    status line. Start-up must keep waiting, not crash (CI, stop 32)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]

    def echo_the_request() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(conn.recv(4096))

    thread = threading.Thread(target=echo_the_request, daemon=True)
    thread.start()
    try:
        assert not _healthy(f"http://127.0.0.1:{port}", "/health")
    finally:
        thread.join(timeout=5.0)
        server.close()
