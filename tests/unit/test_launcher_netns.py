"""The multi-host rehearsal's plan and settings (no namespaces are made
here; tests/integration/test_netns.py makes real ones)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpush.cli import _parser, up_config
from kvpush.launcher import netns
from kvpush.launcher.cluster import cluster_secret
from kvpush.launcher.config import ClusterConfig
from kvpush.launcher.instances import instance_command, plan_instances
from kvpush.launcher.serve import ServeConfig
from kvpush.side_channel_auth import SECRET_ENV


def _plan(tmp_path: Path, gbit: float | None = 4.0) -> netns.NetPlan:
    return netns.plan_network(tmp_path, ["prefill0", "decode0"], 7, gbit)


def test_each_host_gets_its_own_namespace_address_and_link(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    tag = netns.run_dir_tag(tmp_path)
    assert plan.bridge == f"kvp{tag}br" and plan.bridge_address == "10.250.7.1/24"
    assert [h.namespace for h in plan.hosts] == [
        f"kvpush-{tag}-prefill0",
        f"kvpush-{tag}-decode0",
    ]
    assert [h.address for h in plan.hosts] == ["10.250.7.10", "10.250.7.11"]
    assert [h.root_device for h in plan.hosts] == [f"kvp{tag}h0", f"kvp{tag}h1"]
    # Linux caps interface names at 15 characters (the inner end adds "n").
    assert all(len(h.root_device) + 1 <= 15 for h in plan.hosts)
    assert plan.host("decode0").address == "10.250.7.11"
    with pytest.raises(KeyError, match="router"):
        plan.host("router")


def test_two_run_directories_never_share_names(tmp_path: Path) -> None:
    a, b = _plan(tmp_path / "a"), _plan(tmp_path / "b")
    assert a.tag != b.tag
    assert not {h.namespace for h in a.hosts} & {h.namespace for h in b.hosts}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"link_gbit": 1.0}, "--link-gbit shapes links of --hosts netns"),
        ({"hosts": "docker"}, "hosts must be one of local, netns"),
        ({"hosts": "netns", "link_gbit": 0.0}, "link_gbit must be in"),
        ({"hosts": "netns", "link_gbit": 1000.0}, "link_gbit must be in"),
        (
            {"hosts": "netns", "advertise_host": "10.0.0.1"},
            "gives every instance its own address",
        ),
    ],
)
def test_bad_rehearsal_settings_say_what_to_change(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**fields)


def test_instances_bind_and_advertise_their_host_address(tmp_path: Path) -> None:
    config = ClusterConfig(mode="kvpush", hosts="netns", link_gbit=1.0)
    plan = _plan(tmp_path)
    prefill, decode = plan_instances(config, tmp_path, plan)
    assert prefill.url == "http://10.250.7.10:8100"
    assert prefill.backend().side_channel_host == "10.250.7.10"
    cmd = instance_command(config, decode, tmp_path)
    assert cmd[cmd.index("--host") + 1] == "10.250.7.11"
    prefix = netns.exec_prefix(plan.host("decode0"))
    assert prefix[:4] == ["ip", "netns", "exec", plan.host("decode0").namespace]
    assert prefix[-3:] == ["unshare", "--ipc", "--"]  # UCX sees another node


def test_up_flags_reach_the_config() -> None:
    args = _parser().parse_args(["up", "--hosts", "netns", "--link-gbit", "2.5"])
    config = up_config(args)
    assert (config.hosts, config.link_gbit) == ("netns", 2.5)


def test_a_kvpush_rehearsal_gets_a_secret_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    config = ClusterConfig(mode="kvpush", hosts="netns")
    secret = cluster_secret(config, tmp_path)
    assert secret is not None and len(secret) == 64
    assert cluster_secret(config, tmp_path) == secret  # restarts reuse it
    mode = os.stat(tmp_path / "side-channel.secret").st_mode & 0o777
    assert mode == 0o600
    assert cluster_secret(ClusterConfig(mode="kvpush"), tmp_path / "x") is None
    insecure = ClusterConfig(mode="kvpush", hosts="netns", insecure_side_channel=True)
    assert cluster_secret(insecure, tmp_path / "y") is None


def test_a_rehearsal_host_runs_what_kvpush_serve_runs_there(tmp_path: Path) -> None:
    """README's claim: each rehearsal instance gets the command line that
    ``kvpush serve`` would run on a real host with that address."""
    config = ClusterConfig(mode="kvpush", hosts="netns", cores=(0,))
    prefill = plan_instances(config, tmp_path, _plan(tmp_path))[0]
    alone = ServeConfig(
        role="prefill",
        mode="kvpush",
        name="prefill0",
        host="10.250.7.10",
        core=0,
        run_dir=tmp_path,
    )
    assert alone.spec() == prefill
    model = tmp_path / "model"
    assert instance_command(alone, prefill, model) == instance_command(
        config, prefill, model
    )
