"""Data parallelism in the launcher (``--prefill-dp``, ``--decode-dp``): each
DP instance gets vLLM's ``--data-parallel-size``, one core binding per rank
(DP-major, as vLLM reads them), one side-channel port per rank, and one
topology endpoint per DP rank, pinned by ``dp_rank`` at vLLM's engine id
for it (no vLLM is started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpush.cli import _parser, up_config
from kvpush.launcher.config import ClusterConfig
from kvpush.launcher.instances import (
    check_dp_fits_model,
    instance_command,
    instance_env_vars,
    plan_instances,
)
from kvpush.launcher.platform import Platform

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
