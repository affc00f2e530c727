"""Tensor parallelism in the launcher: each instance's TP on vLLM's command
line, its ranks bound to cores, and side-channel port ranges that never
overlap (no vLLM is started)."""

from __future__ import annotations

import itertools
import json
import socket
from pathlib import Path

import pytest

from kvpush.cli import _parser, up_config
from kvpush.launcher import cluster
from kvpush.launcher.cli import serve_config
from kvpush.launcher.config import ClusterConfig
from kvpush.launcher.instances import (
    InstanceSpec,
    check_tp_fits_model,
    instance_command,
    instance_env_vars,
    plan_instances,
)
from kvpush.launcher.serve import ServeConfig

MODEL = Path("/models/tiny")


def _tp_arg(cmd: list[str]) -> str:
    assert cmd.count("--tensor-parallel-size") == 1
    return cmd[cmd.index("--tensor-parallel-size") + 1]


def _plan(tmp_path: Path, **fields: object) -> list[InstanceSpec]:
    return plan_instances(ClusterConfig(**fields), tmp_path)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["vllm-pull", "vllm-push", "kvpush"])
def test_each_role_runs_its_own_tp(tmp_path: Path, mode: str) -> None:
    config = ClusterConfig(mode=mode, num_prefill=2, prefill_tp=2, decode_tp=1)
    specs = plan_instances(config, tmp_path)
    assert [s.tp for s in specs] == [2, 2, 1]
    assert [_tp_arg(instance_command(config, s, MODEL)) for s in specs] == [
        "2", "2", "1",
    ]  # fmt: skip


def test_colocated_runs_colocated_tp(tmp_path: Path) -> None:
    config = ClusterConfig(mode="colocated", num_prefill=0, colocated_tp=2)
    (only,) = plan_instances(config, tmp_path)
    assert _tp_arg(instance_command(config, only, MODEL)) == "2"
    assert config.side_channel_stride == 2


@pytest.mark.parametrize(
    ("fields", "binds"),
    [
        # TP 1 everywhere: one core per instance, in turn, as always
        ({"num_prefill": 2, "cores": (0, 1)}, ["0", "1", "0"]),
        ({"cores": (0, 1, 2, 3)}, ["0", "1"]),
        # enough cores: every rank its own, instances apart
        ({"prefill_tp": 2, "cores": (0, 1, 2)}, ["0|1", "2"]),
        ({"prefill_tp": 2, "decode_tp": 2, "cores": (4, 5, 6, 7)}, ["4|5", "6|7"]),
        ({"prefill_tp": 2, "cores": (0, 1, 2, 3, 4)}, ["0|1", "2"]),
        # this machine (2 cores): instances apart, ranks of one instance share
        ({"prefill_tp": 2, "cores": (0, 1)}, ["0|0", "1"]),
        ({"decode_tp": 2, "cores": (0, 1)}, ["0", "1|1"]),
        ({"prefill_tp": 2, "decode_tp": 2, "cores": (0, 1)}, ["0|0", "1|1"]),
        # spare cores go to the instance with the most ranks per core
        ({"prefill_tp": 2, "decode_tp": 4, "cores": (0, 1, 2, 3)}, ["0|1", "2|3|2|3"]),
        ({"prefill_tp": 2, "decode_tp": 2, "cores": (0, 1, 2)}, ["0|1", "2|2"]),
        # fewer cores than instances: each instance one core, in turn
        ({"num_prefill": 2, "prefill_tp": 2, "cores": (0, 1)}, ["0|0", "1|1", "0"]),
        ({"prefill_tp": 2, "cores": (3,)}, ["3|3", "3"]),
    ],
)
def test_instances_get_their_own_cores_and_ranks_share_within_them(
    tmp_path: Path, fields: dict, binds: list[str]
) -> None:
    config = ClusterConfig(mode="vllm-pull", **fields)
    specs = plan_instances(config, tmp_path)
    env = [instance_env_vars(config, s)["VLLM_CPU_OMP_THREADS_BIND"] for s in specs]
    assert env == binds
    for spec, bind in zip(specs, binds, strict=True):
        # the process may run on every core its ranks are bound to
        assert spec.cpus == {int(c) for c in bind.split("|")}


def test_colocated_ranks_spread_over_every_core(tmp_path: Path) -> None:
    for tp, bind in ((2, "0|1"), (4, "0|1|0|1")):
        config = ClusterConfig(
            mode="colocated", num_prefill=0, colocated_tp=tp, cores=(0, 1)
        )
        (only,) = plan_instances(config, tmp_path)
        assert instance_env_vars(config, only)["VLLM_CPU_OMP_THREADS_BIND"] == bind


def test_the_whole_instance_is_pinned_to_all_its_ranks_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ClusterConfig(mode="vllm-pull", prefill_tp=2, cores=(0, 1, 2))
    prefill, decode = plan_instances(config, tmp_path)
    pinned: list[frozenset[int]] = []

    def spawn(cmd: list[str], env: dict, log: Path, cpus: frozenset[int]) -> int:
        assert env["VLLM_CPU_OMP_THREADS_BIND"] in ("0|1", "2")
        pinned.append(cpus)
        return 1

    monkeypatch.setattr(cluster.process, "spawn", spawn)
    for spec in (prefill, decode):
        cluster._spawn_instance(config, spec, MODEL, None, None)
    assert pinned == [frozenset({0, 1}), frozenset({2})]


def test_tp_1_keeps_todays_ports(tmp_path: Path) -> None:
    specs = _plan(tmp_path, mode="kvpush", num_prefill=2, num_decode=2)
    assert [s.side_channel_port for s in specs] == [5600, 5601, 5602, 5603]
    assert [list(s.side_channel_ports) for s in specs] == [
        [5600], [5601], [5602], [5603],
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "num_prefill", "num_decode"),
    list(itertools.product([1, 2, 4], [1, 2, 8], [1, 3], [1, 2])),
)
def test_side_channel_ranges_never_overlap(
    tmp_path: Path, prefill_tp: int, decode_tp: int, num_prefill: int, num_decode: int
) -> None:
    config = ClusterConfig(
        mode="kvpush",
        num_prefill=num_prefill,
        num_decode=num_decode,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
    )
    specs = plan_instances(config, tmp_path)
    ranges = [set(s.side_channel_ports) for s in specs]
    assert [len(r) for r in ranges] == [s.tp for s in specs]
    taken: set[int] = set()
    for r in ranges:
        assert not r & taken
        taken |= r
    http = {s.http_port for s in specs}
    assert not taken & http and config.port not in taken | http
    stride = max(prefill_tp, decode_tp)
    assert [s.side_channel_port for s in specs] == [
        5600 + i * stride for i in range(len(specs))
    ]


def test_side_channel_ranges_that_reach_the_http_ports_are_refused() -> None:
    # 2 instances x stride 8 from 8090 would cover 8100..8105
    with pytest.raises(
        ValueError,
        match=r"base_http_port and base_side_channel_port ranges overlap "
        r"\(8100\.\.8101 and 8090\.\.8105",
    ):
        ClusterConfig(mode="kvpush", decode_tp=8, base_side_channel_port=8090)
    with pytest.raises(ValueError, match="65535"):
        ClusterConfig(mode="kvpush", prefill_tp=4, base_side_channel_port=65530)
    with pytest.raises(ValueError, match=r"port and base_side_channel_port .*5603"):
        ClusterConfig(mode="kvpush", prefill_tp=4, port=5603)


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _hold_a_port_after_a_free_one() -> socket.socket:
    """A listening socket on a port whose predecessor is free (another
    process on the machine may hold any one ephemeral port)."""
    for _ in range(100):
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        if _is_free(holder.getsockname()[1] - 1):
            holder.listen()
            return holder
        holder.close()
    raise AssertionError("no free port pair found")


def test_every_ranks_side_channel_port_must_be_free(tmp_path: Path) -> None:
    with _hold_a_port_after_a_free_one() as holder:
        taken = holder.getsockname()[1]
        config = ClusterConfig(
            mode="kvpush", prefill_tp=2, num_decode=1, base_side_channel_port=taken - 1
        )
        specs = plan_instances(config, tmp_path)
        with pytest.raises(ValueError, match=f"port {taken} .prefill0 side channel"):
            cluster._check_ports_free(config, specs)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prefill_tp": 0}, "prefill_tp must be between 1 and 64, not 0"),
        ({"decode_tp": -2}, "decode_tp must be between 1 and 64"),
        ({"decode_tp": 65}, "decode_tp must be between 1 and 64"),
        ({"mode": "colocated", "num_prefill": 0, "prefill_tp": 2}, "--colocated-tp"),
        ({"mode": "vllm-push", "colocated_tp": 2}, "--colocated-tp is for colocated"),
        (
            {"extra_vllm_args": ("--tensor-parallel-size", "2")},
            "must not set the TP",
        ),
        ({"extra_vllm_args": ("-tp=2",)}, "must not set the TP"),
    ],
)
def test_bad_tp_settings_say_what_to_change(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**fields)


def test_up_takes_tp_from_flags_and_config_files(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text('mode = "vllm-pull"\nprefill_tp = 2\ndecode_tp = 2\n')
    args = _parser().parse_args(["up", "--config", str(path), "--decode-tp", "1"])
    config = up_config(args)
    assert (config.prefill_tp, config.decode_tp) == (2, 1)
    colocated = _parser().parse_args(
        ["up", "--mode", "colocated", "--colocated-tp", "2"]
    )
    assert up_config(colocated).colocated_tp == 2
    json_file = tmp_path / "c.json"
    json_file.write_text(json.dumps({"mode": "kvpush", "decode_tp": 2}))
    assert (
        up_config(_parser().parse_args(["up", "--config", str(json_file)])).decode_tp
        == 2
    )


def _model(tmp_path: Path, heads: int, kv_heads: int) -> Path:
    (tmp_path / "config.json").write_text(
        json.dumps({"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    )
    return tmp_path


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tps_the_tiny_models_heads_allow(tmp_path: Path, tp: int) -> None:
    # 4 heads, 2 KV heads: at TP 4 each KV head is replicated on two ranks
    check_tp_fits_model(_model(tmp_path, 4, 2), {"prefill0": tp})


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "message"),
    [
        (4, 2, 3, "prefill0: TP 3 does not divide the model's 4 attention heads"),
        (4, 2, 8, "TP 8 does not divide the model's 4 attention heads"),
        (12, 3, 2, "TP 2 and the model's 3 KV heads"),
        (12, 4, 6, "TP 6 and the model's 4 KV heads"),
    ],
)
def test_tps_the_heads_do_not_allow_are_refused_before_start(
    tmp_path: Path, heads: int, kv_heads: int, tp: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_tp_fits_model(_model(tmp_path, heads, kv_heads), {"prefill0": tp})


def test_a_model_without_head_counts_is_left_to_vllm(tmp_path: Path) -> None:
    check_tp_fits_model(tmp_path / "no-such-model", {"prefill0": 3})
    (tmp_path / "config.json").write_text("{}")
    check_tp_fits_model(tmp_path, {"prefill0": 3})


def test_serve_binds_its_ranks_as_up_does(tmp_path: Path) -> None:
    argv = ["serve", "--role", "prefill", "--tp", "2", "--cores", "0,1"]
    config = serve_config(_parser().parse_args(argv))
    spec = config.spec()
    assert (spec.tp, spec.cores, list(spec.side_channel_ports)) == (
        2, (0, 1), [5600, 5601],
    )  # fmt: skip
    assert _tp_arg(instance_command(config, spec, MODEL)) == "2"
    assert instance_env_vars(config, spec)["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    one_core = ServeConfig(role="decode", mode="vllm-pull", tp=2, core=3)
    assert (
        instance_env_vars(one_core, one_core.spec())["VLLM_CPU_OMP_THREADS_BIND"]
        == "3|3"
    )
    unpinned = ServeConfig(role="decode", mode="vllm-pull", tp=2)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in instance_env_vars(
        unpinned, unpinned.spec()
    )
    # the cluster's prefill0 and the same instance served alone agree
    cluster_spec = _plan(tmp_path, mode="kvpush", prefill_tp=2, cores=(0, 1, 2))[0]
    alone = ServeConfig(
        role="prefill", mode="kvpush", name="prefill0", tp=2, cores=(0, 1),
        run_dir=tmp_path,
    )  # fmt: skip
    assert alone.spec() == cluster_spec


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tp": 0}, "tp must be between 1 and 64"),
        ({"tp": 65}, "tp must be between 1 and 64, not 65"),
        ({"tp": 2.0}, "tp must be between 1 and 64, not 2.0"),  # as the launcher
        ({"core": 0, "cores": (0, 1)}, "core or cores, not both"),
        ({"cores": (-1,)}, "cores must be CPU numbers"),
        ({"tp": 4, "port": 5602}, "miss the HTTP port 5602"),
    ],
)
def test_bad_serve_tp_settings_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServeConfig(role="prefill", mode="kvpush", **fields)


def test_state_records_each_instances_tp_and_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpush.launcher.state import RunState, load_state

    monkeypatch.setattr(cluster, "_spawn_router", lambda config, run_dir, model: 2)
    monkeypatch.setattr(
        cluster, "_spawn_instance", lambda config, spec, model, secret, host: 1
    )
    config = ClusterConfig(
        mode="vllm-pull", prefill_tp=2, cores=(0, 1), run_dir=tmp_path
    )
    specs = plan_instances(config, tmp_path)
    state = RunState(mode="vllm-pull", model="m", router_url="u", processes=())
    cluster._start_all(config, specs, MODEL, tmp_path, state, None)
    saved = load_state(tmp_path)
    assert saved is not None
    prefill, decode, _router = saved.processes
    assert (prefill.tp, prefill.cores, prefill.side_channel_port) == (2, (0, 0), 5600)
    assert (decode.tp, decode.cores, decode.side_channel_port) == (1, (1,), 5602)


def test_the_topology_names_each_instances_tp(tmp_path: Path) -> None:
    # the router puts prefill's TP in decode's leg: decode registers with
    # every prefill rank, at the prefill's side-channel port + rank
    specs = _plan(tmp_path, mode="kvpush", prefill_tp=2, decode_tp=1)
    assert {s.name: s.backend().tp_size for s in specs} == {
        "prefill0": 2,
        "decode0": 1,
    }
