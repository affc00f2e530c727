"""``kvpush serve``: one instance planned exactly as ``kvpush up`` plans each
of a cluster, its addresses, its shell line, and the secret check."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvpush.cli import _parser, up_config
from kvpush.connector.config import ConnectorConfig
from kvpush.launcher.cli import serve_config
from kvpush.launcher.config import Addresses, ClusterConfig
from kvpush.launcher.instances import (
    SCHEDULER_CLASS,
    instance_command,
    instance_env,
    instance_env_vars,
    plan_instances,
)
from kvpush.launcher.serve import ServeConfig, print_command, serve
from kvpush.side_channel_auth import SECRET_ENV

MODEL = Path("/models/tiny")


def _serve(*argv: str) -> ServeConfig:
    config: ServeConfig = serve_config(_parser().parse_args(["serve", *argv]))
    return config


def _kv(cmd: list[str]) -> dict:
    config: dict = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    return config


def test_serve_plans_the_instance_up_would_plan(tmp_path: Path) -> None:
    cluster = ClusterConfig(mode="kvpush", cores=(0,))
    prefill = plan_instances(cluster, tmp_path)[0]
    alone = ServeConfig(
        role="prefill", mode="kvpush", name="prefill0", core=0, run_dir=tmp_path
    )
    assert alone.spec() == prefill
    assert instance_command(alone, alone.spec(), MODEL) == instance_command(
        cluster, prefill, MODEL
    )
    assert instance_env_vars(alone, alone.spec()) == instance_env_vars(cluster, prefill)


@pytest.mark.parametrize(
    ("role", "mode", "connector", "kv_role"),
    [
        ("prefill", "kvpush", "KvPushConnector", "kv_producer"),
        ("decode", "kvpush", "KvPushConnector", "kv_consumer"),
        ("prefill", "vllm-pull", "FairNixlConnector", "kv_producer"),
        ("decode", "vllm-pull", "FairNixlConnector", "kv_consumer"),
        ("prefill", "vllm-push", "FairNixlPushConnector", "kv_producer"),
        ("decode", "vllm-push", "FairNixlPushConnector", "kv_consumer"),
    ],
)
def test_exact_argv_and_env_per_role_and_mode(
    role: str, mode: str, connector: str, kv_role: str
) -> None:
    config = _serve(
        "--role", role, "--mode", mode, "--host", "0.0.0.0",
        "--advertise-host", "10.250.0.1", "--port", "8200",
        "--side-channel-port", "5700", "--model", str(MODEL),
        "--insecure-side-channel", "--", "--block-size", "16",
    )  # fmt: skip
    cmd = instance_command(config, config.spec(), MODEL)
    name = f"{role}-10.250.0.1-8200"
    kv = {
        "kv_connector": connector,
        "kv_role": kv_role,
        "kv_buffer_device": "cpu",
        "engine_id": name,
        "kv_load_failure_policy": "recompute",
    }
    if mode == "kvpush":
        extra: dict[str, object] = {
            "side_channel_host": "0.0.0.0",
            "side_channel_port": 5700,
            "nixl_backend": "UCX",
        }
        if role == "prefill":  # its answer to a vLLM P/D leg names this host
            extra["side_channel_advertise_host"] = "10.250.0.1"
        kv["kv_connector_extra_config"] = extra | {
            "insecure_side_channel": True,
            # prefill streams by default; decode pushes nothing
            "push_granularity": "auto" if role == "prefill" else "request",
        }
    scheduler = []  # a kvpush decode continues from prefill's first token,
    if mode == "kvpush":  # ... whose logprobs a kvpush prefill sends
        scheduler = ["--scheduler-cls", SCHEDULER_CLASS]
    assert cmd == [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(MODEL), "--served-model-name", "tiny",
        "--host", "0.0.0.0", "--port", "8200", "--dtype", "float32",
        "--max-model-len", "4096", "--tensor-parallel-size", "1",
        "--enforce-eager", "--disable-uvicorn-access-log",
        "--kv-transfer-config", json.dumps(kv), *scheduler, "--block-size", "16",
    ]  # fmt: skip
    assert instance_env_vars(config, config.spec()) == {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # vLLM's baselines bind and advertise this one address.
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.250.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5700",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    (backend,) = config.backends()
    assert (backend.url, backend.engine_id) == ("http://10.250.0.1:8200", name)
    assert (backend.side_channel_host, backend.side_channel_port) == (
        "10.250.0.1",
        5700,
    )


def test_colocated_has_no_connector_and_a_role_needs_its_mode() -> None:
    config = _serve("--role", "colocated", "--model", str(MODEL))
    assert config.mode == "colocated"
    assert "--kv-transfer-config" not in instance_command(config, config.spec(), MODEL)
    with pytest.raises(ValueError, match="does not run in mode"):
        ServeConfig(role="prefill", mode="colocated")
    with pytest.raises(ValueError, match="does not run in mode"):
        ServeConfig(role="colocated", mode="kvpush")


def test_print_command_is_one_shell_line_env_first(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cr3t\n")
    config = _serve(
        "--role", "prefill", "--host", "10.250.0.1", "--model", str(MODEL),
        "--ucx-net-devices", "veth0", "--side-channel-secret-file", str(secret),
    )  # fmt: skip
    line = print_command(config, MODEL)
    assert "s3cr3t" not in line
    words = shlex.split(line)
    env_words = words[: words.index(sys.executable)]
    assert env_words == [
        "VLLM_CPU_KVCACHE_SPACE=1",
        "VLLM_NIXL_SIDE_CHANNEL_HOST=10.250.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT=5600",
        "PYTHONUNBUFFERED=1",
        "TOKENIZERS_PARALLELISM=false",
        "UCX_NET_DEVICES=veth0",
        f"{SECRET_ENV}=$(cat {secret})",  # expanded by the shell, when it runs
    ]
    assert words[words.index(sys.executable) :] == instance_command(
        config, config.spec(), MODEL
    )


def test_print_command_exits_0_and_prints_only_the_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvpush.cli import main

    assert (
        main(["serve", "--role", "decode", "--model", str(MODEL), "--print-command"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "vllm.entrypoints.openai.api_server" in out


def test_serve_execs_vllm_with_its_env_and_the_secret() -> None:
    config = ServeConfig(
        role="prefill", mode="kvpush", host="10.250.0.1", insecure_side_channel=False
    )
    calls: list[tuple[str, list[str], dict[str, str]]] = []
    serve(
        config, MODEL, "s3cr3t", lambda path, argv, env: calls.append((path, argv, env))
    )
    ((path, argv, env),) = calls
    assert path == sys.executable and argv == instance_command(
        config, config.spec(), MODEL
    )
    assert env[SECRET_ENV] == "s3cr3t"
    assert env == instance_env(config, config.spec(), "s3cr3t")
    assert "s3cr3t" not in " ".join(argv)


@pytest.mark.parametrize(
    ("allowlist", "expected"),
    [(None, None), ("", "kvpush"), ("lora", "lora,kvpush"), ("kvpush,x", "kvpush,x")],
)
def test_vllms_plugin_allowlist_keeps_kvpush_in(
    allowlist: str | None, expected: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connectors are named as kvpush's vLLM plugin registers them: an
    instance whose VLLM_PLUGINS left the plugin out would not find them."""
    if allowlist is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", allowlist)
    config = ServeConfig(role="decode", mode="kvpush")
    assert instance_env(config, config.spec()).get("VLLM_PLUGINS") == expected


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("127.0.0.1",), Addresses("127.0.0.1", "127.0.0.1", "127.0.0.1", "127.0.0.1")),
        (
            ("0.0.0.0", "10.0.0.1"),
            Addresses("0.0.0.0", "10.0.0.1", "0.0.0.0", "10.0.0.1"),
        ),
        (
            ("0.0.0.0", "10.0.0.1", "10.1.0.1"),
            Addresses("0.0.0.0", "10.0.0.1", "10.1.0.1", "10.1.0.1"),
        ),
        (
            ("0.0.0.0", "10.0.0.1", "0.0.0.0", "10.1.0.1"),
            Addresses("0.0.0.0", "10.0.0.1", "0.0.0.0", "10.1.0.1"),
        ),
    ],
)
def test_bind_and_advertised_addresses_are_separate(
    args: tuple[str, ...], expected: Addresses
) -> None:
    assert Addresses.resolve(*args) == expected


def test_up_takes_the_same_address_options(tmp_path: Path) -> None:
    args = _parser().parse_args(
        [
            "up",
            "--mode",
            "vllm-push",
            "--host",
            "0.0.0.0",
            "--advertise-host",
            "10.0.0.1",
        ]
    )
    config = up_config(args)
    prefill, _ = plan_instances(config, tmp_path)
    assert prefill.url == "http://10.0.0.1:8100"
    assert instance_command(config, prefill, MODEL)[7:9] == ["--host", "0.0.0.0"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"host": "0.0.0.0"}, "needs --advertise-host"),
        ({"port": 5600}, "must differ"),
        ({"port": 80}, "1024..65535"),
        ({"name": "a b"}, "name 'a b' must be"),
        ({"nixl_backend": "TCP"}, "nixl_backend must be one of UCX, LIBFABRIC"),
        ({"ucx_net_devices": " "}, "ucx_net_devices must name devices"),
        ({"core": -1}, "core must be"),
    ],
)
def test_bad_serve_settings_say_what_to_change(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServeConfig(role="decode", mode="kvpush", **fields)


# -- the side-channel secret, by default off loopback -------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "localhost"])
def test_loopback_needs_no_secret(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    ServeConfig(role="prefill", mode="kvpush", host=host).check_startable()
    connector_config(host)  # starts


@pytest.mark.parametrize("host", ["0.0.0.0", "10.250.0.1", "::", "prefill-a.internal"])
def test_off_loopback_kvpush_prefill_refuses_without_a_secret(
    host: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    config = ServeConfig(
        role="prefill", mode="kvpush", host=host, advertise_host="10.250.0.1"
    )
    with pytest.raises(ValueError, match=f"{SECRET_ENV}.*--insecure-side-channel"):
        config.check_startable()
    with pytest.raises(ValueError, match="--insecure-side-channel"):
        connector_config(host)  # the prefill worker refuses too
    # Any of the three ways out starts it.
    connector_config(host, insecure=True)
    ServeConfig(
        role="prefill", mode="kvpush", host=host, advertise_host="10.250.0.1",
        insecure_side_channel=True,
    ).check_startable()  # fmt: skip
    secret = tmp_path / "secret"
    ServeConfig(
        role="prefill", mode="kvpush", host=host, advertise_host="10.250.0.1",
        side_channel_secret_file=secret,
    ).check_startable()  # fmt: skip
    monkeypatch.setenv(SECRET_ENV, "s3cr3t")
    config.check_startable()
    connector_config(host, secret=b"s3cr3t")


def test_off_loopback_kv_both_decode_refuses_without_a_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With --kv-both a decode serves prefill legs too: its side channel
    listens, so it needs the secret as a prefill does."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    plain = {"role": "decode", "mode": "kvpush", "host": "10.250.0.1"}
    ServeConfig(**plain).check_startable()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--insecure-side-channel"):
        ServeConfig(**plain, kv_both=True).check_startable()  # type: ignore[arg-type]


def test_up_checks_the_secret_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from kvpush.launcher import up

    monkeypatch.delenv(SECRET_ENV, raising=False)
    config = ClusterConfig(
        mode="kvpush", host="0.0.0.0", advertise_host="127.0.0.1", run_dir=tmp_path
    )
    with pytest.raises(ValueError, match=SECRET_ENV):
        up(config)
    assert list(tmp_path.iterdir()) == []


def test_only_a_kvpush_prefill_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    for role, mode in (("decode", "kvpush"), ("prefill", "vllm-pull")):
        ServeConfig(
            role=role,
            mode=mode,
            host="0.0.0.0",
            advertise_host="10.250.0.1",  # type: ignore[arg-type]
        ).check_startable()
    connector_config("0.0.0.0", role="decode")


def test_secret_file_is_read_once_and_must_hold_a_secret(tmp_path: Path) -> None:
    from kvpush.launcher.cluster import read_secret

    path = tmp_path / "secret"
    path.write_text("  s3cr3t\n")
    assert (
        read_secret(
            ServeConfig(role="decode", mode="kvpush", side_channel_secret_file=path)
        )
        == "s3cr3t"
    )
    path.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        read_secret(
            ServeConfig(role="decode", mode="kvpush", side_channel_secret_file=path)
        )
    with pytest.raises(ValueError, match="cannot read side-channel secret file"):
        read_secret(
            ServeConfig(
                role="decode", mode="kvpush", side_channel_secret_file=tmp_path / "no"
            )
        )


def test_nixl_backend_reaches_the_connector_and_is_validated() -> None:
    config = ServeConfig(role="prefill", mode="kvpush", nixl_backend="LIBFABRIC")
    kv = _kv(instance_command(config, config.spec(), MODEL))
    assert kv["kv_connector_extra_config"]["nixl_backend"] == "LIBFABRIC"
    assert (
        connector_config("127.0.0.1", backend="LIBFABRIC").nixl_backend == "LIBFABRIC"
    )
    with pytest.raises(ValueError, match="nixl_backend must be one of UCX, LIBFABRIC"):
        connector_config("127.0.0.1", backend="ucx")
    pull = ServeConfig(role="decode", mode="vllm-pull", nixl_backend="LIBFABRIC")
    kv = _kv(instance_command(pull, pull.spec(), MODEL))
    assert kv["kv_connector_extra_config"] == {"backends": ["LIBFABRIC"]}


def connector_config(
    host: str,
    *,
    role: str = "prefill",
    secret: bytes = b"",
    insecure: bool = False,
    backend: str = "UCX",
) -> ConnectorConfig:
    """The connector's own config, as its prefill worker builds it."""

    kv = SimpleNamespace(
        kv_role="kv_producer" if role == "prefill" else "kv_consumer",
        engine_id="prefill0",
        kv_connector_extra_config={
            "side_channel_host": host,
            "side_channel_port": 5600,
            "nixl_backend": backend,
            "insecure_side_channel": insecure,
        },
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=kv,
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        instance_id="boot",
    )
    old = os.environ.pop(SECRET_ENV, None)
    try:
        if secret:
            os.environ[SECRET_ENV] = secret.decode()
        return ConnectorConfig.from_vllm(vllm_config)
    finally:
        os.environ.pop(SECRET_ENV, None)
        if old is not None:
            os.environ[SECRET_ENV] = old
