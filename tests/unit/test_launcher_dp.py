"""Data parallelism in the launcher (``--prefill-dp``, ``--decode-dp``): each
DP instance gets vLLM's ``--data-parallel-size``, one core binding per rank
(DP-major, as vLLM reads them), one side-channel port per rank, and one
topology endpoint per DP rank, pinned by ``dp_rank`` at vLLM's engine id
for it; ``kvpush serve --dp`` plans the same instance, and ``--dp-rank``
one DP rank of it alone (vLLM's external load balancing). No vLLM is
started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpush.cli import _parser, up_config
from kvpush.launcher.cli import serve_config
from kvpush.launcher.config import ClusterConfig
from kvpush.launcher.instances import (
    check_dp_fits_model,
    instance_command,
    instance_env_vars,
    plan_instances,
)
from kvpush.launcher.platform import Platform
from kvpush.launcher.serve import ServeConfig

MODEL = Path("/models/tiny")


def _dp_arg(cmd: list[str]) -> str | None:
    flag = "--data-parallel-size"
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def test_each_role_runs_its_own_dp(tmp_path: Path) -> None:
    config = ClusterConfig(mode="kvpush", decode_dp=2, cores=(0, 1))
    prefill, decode = plan_instances(config, tmp_path)
    assert [_dp_arg(instance_command(config, s, MODEL)) for s in (prefill, decode)] == [
        None,
        "2",
    ]
    binds = [
        instance_env_vars(config, s)["VLLM_CPU_OMP_THREADS_BIND"]
        for s in (prefill, decode)
    ]
    assert binds == ["0", "1|1"]  # both engines of decode on its core


@pytest.mark.parametrize(
    ("mode", "ports"), [("kvpush", [5604, 5606]), ("vllm-pull", [5604, 5605])]
)
def test_each_dp_rank_is_an_endpoint_at_its_engine_id_and_port(
    tmp_path: Path, mode: str, ports: list[int]
) -> None:
    """kvpush's DP rank d listens after the TP ranks of the ranks before it;
    vLLM's NIXL connectors take one port per DP rank."""
    config = ClusterConfig(mode=mode, decode_dp=2, decode_tp=2)  # type: ignore[arg-type]
    prefill, decode = plan_instances(config, tmp_path)
    assert config.side_channel_stride == 4
    assert decode.side_channel_ports == range(5604, 5608)
    [alone] = prefill.backends(mode)
    assert (alone.engine_id, alone.dp_rank) == ("prefill0", None)
    endpoints = decode.backends(mode)
    assert [(b.engine_id, b.dp_rank, b.url, b.tp_size) for b in endpoints] == [
        ("decode0_dp0", 0, decode.url, 2),
        ("decode0_dp1", 1, decode.url, 2),
    ]
    assert [b.side_channel_port for b in endpoints] == ports


def test_up_takes_dp_flags_and_refuses_bad_ones() -> None:
    args = _parser().parse_args(["up", "--mode", "kvpush", "--decode-dp", "2"])
    assert up_config(args).decode_dp == 2
    with pytest.raises(ValueError, match="decode_dp must be between 1 and 8"):
        ClusterConfig(mode="kvpush", decode_dp=0)
    with pytest.raises(ValueError, match="colocated runs one engine"):
        ClusterConfig(mode="colocated", num_prefill=0, num_decode=0, prefill_dp=2)
    with pytest.raises(ValueError, match="must not set the TP or DP"):
        ClusterConfig(mode="kvpush", extra_vllm_args=("--data-parallel-size", "2"))


def test_dp_with_a_moe_model_on_cpu_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    """vLLM's CPU build runs a MoE model's layers across DP ranks with
    all_gatherv, which its CPU communicator lacks: every engine died at the
    first request (moe preset, decode DP 2, with and without
    --enable-expert-parallel). Dense models and DP 1 pass; CUDA is vLLM's."""
    moe, dense = tmp_path / "moe", tmp_path / "dense"
    for path, config in ((moe, {"num_experts": 8}), (dense, {})):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
    dp = ClusterConfig(mode="kvpush", decode_dp=2)
    specs = plan_instances(dp, tmp_path)
    with pytest.raises(ValueError, match=r"decode0 \(DP 2\): .* mixture-of-experts"):
        check_dp_fits_model(moe, Platform.CPU, specs)
    check_dp_fits_model(dense, Platform.CPU, specs)
    check_dp_fits_model(moe, Platform.CUDA, specs)
    check_dp_fits_model(
        moe, Platform.CPU, plan_instances(ClusterConfig(mode="kvpush"), tmp_path)
    )


# -- kvpush serve: one DP instance, or one DP rank of it ------------------------------


def _serve(*argv: str) -> ServeConfig:
    config: ServeConfig = serve_config(_parser().parse_args(["serve", *argv]))
    return config


def _models(tmp_path: Path) -> tuple[Path, Path]:
    moe, dense = tmp_path / "moe", tmp_path / "dense"
    for path, config in ((moe, {"num_experts": 8}), (dense, {})):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
    return moe, dense


def test_serve_dp_is_the_instance_up_plans(tmp_path: Path) -> None:
    """``kvpush serve --dp 2`` runs both engines behind its HTTP port, as
    ``kvpush up --decode-dp 2`` runs each decode, with the same endpoints."""
    cluster = ClusterConfig(mode="kvpush", decode_dp=2, decode_tp=2, cores=(0, 1))
    decode = plan_instances(cluster, tmp_path)[1]
    alone = _serve(
        "--role", "decode", "--name", "decode0", "--port", "8101",
        "--side-channel-port", "5604", "--tp", "2", "--dp", "2",
        "--cores", "1", "--run-dir", str(tmp_path), "--kv-events-endpoint",
        "tcp://127.0.0.1:5800",
    )  # fmt: skip
    assert alone.spec() == decode
    assert instance_command(alone, alone.spec(), MODEL) == instance_command(
        cluster, decode, MODEL
    )
    assert alone.backends() == decode.backends("kvpush")
    assert [b.kv_events_endpoint for b in alone.backends()] == [
        "tcp://127.0.0.1:5800",
        "tcp://127.0.0.1:5801",
    ]


@pytest.mark.parametrize(("mode", "port"), [("kvpush", 5604), ("vllm-pull", 5602)])
def test_serve_one_dp_rank_alone_is_its_own_endpoint(mode: str, port: int) -> None:
    """External load balancing: rank 2 of 4 on an HTTP port of its own.
    vLLM gets the group's size and the rank, names the engine
    ``<name>_dp2`` and binds its side channel after the ranks before it
    (kvpush: tp ports per rank; vLLM's connectors: one); the router reaches
    it by its own URL, unpinned."""
    config = _serve(
        "--role", "prefill", "--mode", mode, "--name", "p", "--port", "8102",
        "--side-channel-port", "5600", "--tp", "2", "--dp", "4", "--dp-rank", "2",
        "--cores", "0,1",
    )  # fmt: skip
    spec = config.spec()
    assert (spec.ranks, spec.cores) == (2, (0, 1))  # its own engine's TP ranks
    cmd = instance_command(config, spec, MODEL)
    assert cmd[cmd.index("--data-parallel-size") :][:4] == [
        "--data-parallel-size", "4", "--data-parallel-rank", "2",
    ]  # fmt: skip
    [entry] = config.backends()
    assert (entry.engine_id, entry.url, entry.dp_rank, entry.tp_size) == (
        "p_dp2", "http://127.0.0.1:8102", None, 2,
    )  # fmt: skip
    assert entry.side_channel_port == port


def test_serve_refuses_dp_settings_that_cannot_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--dp-rank must be one of 0\.\.1"):
        _serve("--role", "decode", "--dp", "2", "--dp-rank", "2")
    with pytest.raises(ValueError, match="give its size with --dp"):
        _serve("--role", "decode", "--dp-rank", "0")
    with pytest.raises(ValueError, match="colocated runs one engine"):
        _serve("--role", "colocated", "--dp", "2")
    with pytest.raises(ValueError, match="dp must be between 1 and 8"):
        _serve("--role", "decode", "--dp", "9")
    with pytest.raises(ValueError, match="must not set the TP or DP"):
        _serve("--role", "decode", "--", "--data-parallel-rank", "1")
    with pytest.raises(ValueError, match="miss the HTTP port 5601"):
        _serve("--role", "decode", "--dp", "2", "--port", "5601")


def test_one_dp_rank_alone_is_refused_for_a_dense_model(tmp_path: Path) -> None:
    """vLLM refuses external DP for a dense model ("Non-MoE models do not
    support external data parallel mode"): kvpush says so before starting,
    and what to do instead. On CPU a MoE model's DP is refused too
    (all_gatherv), so the CPU build runs no external DP at all; on CUDA a
    MoE rank passes, and a hub id is left to vLLM."""
    moe, dense = _models(tmp_path)
    rank = [_serve("--role", "decode", "--dp", "2", "--dp-rank", "1").spec()]
    with pytest.raises(ValueError, match=r"dense model.*instance of its own"):
        check_dp_fits_model(dense, Platform.CUDA, rank)
    with pytest.raises(ValueError, match=r"mixture-of-experts.*all_gatherv"):
        check_dp_fits_model(moe, Platform.CPU, rank)
    check_dp_fits_model(moe, Platform.CUDA, rank)
    check_dp_fits_model(tmp_path / "hub-id", Platform.CUDA, rank)
    shared = [_serve("--role", "decode", "--dp", "2").spec()]
    check_dp_fits_model(dense, Platform.CPU, shared)  # internal LB: independent
