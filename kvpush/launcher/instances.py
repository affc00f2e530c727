"""Plan the vLLM instances of a cluster: ports, cores, command lines, env.

Pure functions of the config: nothing here starts a process.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.launcher.config import ClusterConfig
from kvpush.topology import Backend, Role

# vLLM connector class loaded into each instance, per mode. The module path
# always wins over vLLM's own registry.
_CONNECTORS: dict[str, tuple[str, str]] = {
    "vllm-pull": ("FairNixlConnector", "kvpush.baselines.fair_nixl"),
    "vllm-push": ("FairNixlPushConnector", "kvpush.baselines.fair_nixl"),
    "kvpush": ("KvPushConnector", "kvpush.connector.connector"),
}
_KV_ROLES: dict[str, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}


@dataclass(frozen=True)
class InstanceSpec:
    """One vLLM instance to start."""

    role: Role
    index: int
    host: str
    http_port: int
    side_channel_port: int
    core: int
    log_path: Path

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def backend(self) -> Backend:
        return Backend(
            role=self.role,
            url=self.url,
            engine_id=self.name,
            side_channel_host=self.host,
            side_channel_port=self.side_channel_port,
        )


def plan_instances(config: ClusterConfig, run_dir: Path) -> list[InstanceSpec]:
    """Every instance of the cluster, prefills first, each with its own
    ports, core and log file."""
    roles: list[tuple[Role, int]]
    if config.mode == "colocated":
        roles = [("colocated", 0)]
    else:
        roles = [("prefill", i) for i in range(config.num_prefill)]
        roles += [("decode", i) for i in range(config.num_decode)]
    cores = config.cores or tuple(sorted(os.sched_getaffinity(0)))
    return [
        InstanceSpec(
            role=role,
            index=index,
            host=config.host,
            http_port=config.base_http_port + i,
            side_channel_port=config.base_side_channel_port + i,
            core=cores[i % len(cores)],
            log_path=run_dir / f"{role}{index}.log",
        )
        for i, (role, index) in enumerate(roles)
    ]


FAULT_FILE = "faults.json"  # in the run dir, with fault_injection
_VLLM_POLICY = {"recompute": "recompute", "error": "fail"}


def kv_transfer_config(
    config: ClusterConfig, spec: InstanceSpec
) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of an instance, None when colocated.
    kvpush's connector also gets its side channel, a trace directory
    (``RUN_DIR/traces``) for per-transfer timelines, any
    deadlines set in the config, and the fault file when asked for."""
    if spec.role == "colocated":
        return None
    if config.mode not in _CONNECTORS:
        raise ValueError(f"mode {config.mode!r} has no connector available yet")
    connector, module = _CONNECTORS[config.mode]
    kv: dict[str, Any] = {
        "kv_connector": connector,
        "kv_connector_module_path": module,
        "kv_role": _KV_ROLES[spec.role],
        "kv_buffer_device": "cpu",
        "engine_id": spec.name,
        "kv_load_failure_policy": _VLLM_POLICY[config.kv_load_failure_policy],
    }
    if config.mode == "kvpush":
        run_dir = spec.log_path.parent
        extra: dict[str, Any] = {
            "side_channel_host": spec.host,
            "side_channel_port": spec.side_channel_port,
            "trace_dir": str(run_dir / "traces"),
        }
        for name in ("registration_ttl_s", "ready_ttl_s", "peer_timeout_s"):
            if getattr(config, name) is not None:
                extra[name] = getattr(config, name)
        if config.fault_injection:
            extra["fault_file"] = str(run_dir / FAULT_FILE)
        kv["kv_connector_extra_config"] = extra
    return kv


def instance_command(
    config: ClusterConfig, spec: InstanceSpec, model: Path
) -> list[str]:
    """The command line that starts one instance's OpenAI API server."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--served-model-name", model.name,
        "--host", spec.host,
        "--port", str(spec.http_port),
        "--dtype", config.dtype,
        "--max-model-len", str(config.max_model_len),
        "--enforce-eager",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if config.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(config.max_num_batched_tokens)]
    kv_config = kv_transfer_config(config, spec)
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config)]
    return cmd + list(config.extra_vllm_args)


def instance_env(config: ClusterConfig, spec: InstanceSpec) -> dict[str, str]:
    """The environment of one instance: this process's, plus its pinning,
    KV cache size and side-channel address."""
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(config.kv_cache_space_gb),
        VLLM_CPU_OMP_THREADS_BIND=str(spec.core),
        VLLM_NIXL_SIDE_CHANNEL_HOST=spec.host,
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(spec.side_channel_port),
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env
