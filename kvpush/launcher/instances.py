"""Plan vLLM instances: ports, cores, command lines, env.

Pure functions of the settings: nothing here starts a process. ``kvpush up``
plans a whole cluster (:func:`plan_instances`); ``kvpush serve`` plans one
instance (:meth:`kvpush.launcher.serve.ServeConfig.spec`); both build the
command line and environment with :func:`instance_command` and
:func:`instance_env_vars`.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from kvpush.launcher.config import Addresses, ClusterConfig, InstanceSettings
from kvpush.launcher.netns import NetPlan
from kvpush.launcher.platform import Platform
from kvpush.model.kv_size import has_state, is_mla, is_moe, text_config
from kvpush.side_channel_auth import SECRET_ENV
from kvpush.topology import Backend, Role
from kvpush.transfer.ranks import dp_engine_port

# vLLM connector loaded into each instance, per mode, by the name kvpush's
# vLLM plugin registers (kvpush.vllm_plugin; no kv_connector_module_path).
_CONNECTORS: dict[str, str] = {
    "vllm-pull": "FairNixlConnector",
    "vllm-push": "FairNixlPushConnector",
    "kvpush": "KvPushConnector",
}
# On CUDA the baselines are vLLM's own connectors, unpatched, from its registry
# (the fixes in kvpush.baselines are for CPU hosts).
_VLLM_CONNECTORS: dict[str, str] = {
    "vllm-pull": "NixlConnector",
    "vllm-push": "NixlPushConnector",
}
# vLLM's NIXL connector moves Mamba conv states channel-first only ("3-read
# Mamba conv transfer requires DS conv state layout"); vLLM's CPU platform
# picks that layout for its connectors' names, not for the baselines' (the
# same connectors under kvpush's names), so the launcher does.
_STATE_LAYOUT_ENV = "VLLM_SSM_CONV_STATE_LAYOUT"
PLUGINS_ENV = "VLLM_PLUGINS"  # vLLM's allowlist of plugins, when set
PLUGIN = "kvpush"  # our entry point's name in vllm.general_plugins
_KV_ROLES: dict[str, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}


def serves_prefill_legs(config: InstanceSettings, role: str) -> bool:
    """An instance of ``role`` pushes (prefill legs): a prefill, or any
    instance with ``kv_both``; its side channel listens."""
    return role == "prefill" or config.kv_both


def serves_decode_legs(config: InstanceSettings, role: str) -> bool:
    """An instance of ``role`` receives (decode legs): a decode, or any
    instance with ``kv_both``."""
    return role == "decode" or config.kv_both


@dataclass(frozen=True)
class InstanceSpec:
    """One vLLM instance to start.

    ``name`` is its engine id (with ``dp`` > 1, its DP rank ``d``'s is
    ``<name>_dp<d>``, as vLLM names it); ``addresses`` where it binds and
    what the topology names; ``side_channel_port`` the first of its
    side-channel ports, one per rank (TP rank ``r`` of DP rank ``d`` may
    listen on ``side_channel_port + d * tp + r``); ``cores`` the CPU each of
    its ranks is bound to, DP-major as vLLM reads them (empty: not pinned);
    ``gpus`` (CUDA) the GPUs its ranks use, its ``CUDA_VISIBLE_DEVICES``
    (empty: whatever its environment shows it); ``run_dir`` holds its log,
    traces and fault file (None: none of them).

    ``dp_rank`` None: the process runs all ``dp`` engines behind its HTTP
    port (vLLM's internal load balancer; ``dp * tp`` ranks). Else it is DP
    rank ``dp_rank`` of ``dp`` alone, with an HTTP port of its own (vLLM's
    external load balancing, ``--data-parallel-rank``; ``tp`` ranks), and
    ``side_channel_port`` is still the DP group's first port.

    ``kv_events_endpoint`` (None: none): ``tcp://HOST:PORT`` on the
    router's host, where its engines' publishers connect to send vLLM's KV
    cache events to the router (DP rank ``d`` to ``PORT + d``, as vLLM
    offsets it; :mod:`kvpush.router.kv_feed`).
    """

    role: Role
    name: str
    addresses: Addresses
    http_port: int
    side_channel_port: int
    cores: tuple[int, ...]
    run_dir: Path | None
    tp: int = 1
    gpus: tuple[int, ...] = ()
    dp: int = 1
    dp_rank: int | None = None
    kv_events_endpoint: str | None = None

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1:
            raise ValueError(
                f"instance {self.name}: tp and dp must be >= 1, not {self.tp}, "
                f"{self.dp}"
            )
        if self.dp_rank is not None and not 0 <= self.dp_rank < self.dp:
            raise ValueError(
                f"instance {self.name}: DP rank {self.dp_rank} is not one of "
                f"0..{self.dp - 1} (DP size {self.dp})"
            )
        for what, ids in (("cores", self.cores), ("gpus", self.gpus)):
            if ids and len(ids) != self.ranks:
                raise ValueError(
                    f"instance {self.name}: {len(ids)} {what} for {self.ranks} ranks"
                )

    @property
    def ranks(self) -> int:
        """Worker ranks of the process: ``tp`` in each of its engines."""
        return self.tp if self.dp_rank is not None else self.dp * self.tp

    @property
    def cpus(self) -> frozenset[int]:
        """The process's CPU affinity: every rank's core (empty: unpinned)."""
        return frozenset(self.cores)

    @property
    def omp_threads_bind(self) -> str | None:
        """``VLLM_CPU_OMP_THREADS_BIND``: each rank's core, ranks separated
        by ``|`` (None: not pinned; vLLM then binds by NUMA node itself)."""
        return "|".join(str(c) for c in self.cores) if self.cores else None

    @property
    def side_channel_ports(self) -> range:
        """The side-channel ports this process owns, one per rank (kvpush's
        numbering: a DP rank served alone owns its rank's share)."""
        first = dp_engine_port(self.side_channel_port, self.dp_rank or 0, self.tp)
        return range(first, first + self.ranks)

    @property
    def url(self) -> str:
        return f"http://{self.addresses.advertise_host}:{self.http_port}"

    @property
    def log_path(self) -> Path:
        if self.run_dir is None:
            raise ValueError(f"instance {self.name} has no run directory")
        return self.run_dir / f"{self.name}.log"

    def _kv_events_base(self) -> tuple[str, int] | None:
        """``kv_events_endpoint`` as (``tcp://HOST``, PORT): DP rank 0's."""
        if self.kv_events_endpoint is None:
            return None
        host, port = self.kv_events_endpoint.rsplit(":", 1)
        return host, int(port)

    def engine_kv_events_endpoint(self, dp_rank: int = 0) -> str | None:
        """Where DP rank ``dp_rank``'s KV cache events go (None: nowhere)."""
        base = self._kv_events_base()
        return None if base is None else f"{base[0]}:{base[1] + dp_rank}"

    @property
    def kv_events_ports(self) -> range:
        """The router's ports for its engines' KV cache events (may be none)."""
        base = self._kv_events_base()
        if base is None:
            return range(0)
        first = base[1] + (self.dp_rank or 0)
        return range(first, first + (1 if self.dp_rank is not None else self.dp))

    def backend(self) -> Backend:
        """This instance as the router's topology names it."""
        return Backend(
            role=self.role,
            url=self.url,
            engine_id=self.name,
            side_channel_host=self.addresses.side_channel_host,
            side_channel_port=self.side_channel_port,
            tp_size=self.tp,  # decode registers with each prefill rank
            kv_events_endpoint=self.engine_kv_events_endpoint(),
        )

    def backends(self, mode: str) -> tuple[Backend, ...]:
        """This instance's endpoints in the router's topology: itself, or
        with ``dp`` > 1 each DP rank it serves at its engine id and first
        side-channel port (kvpush: after the TP ranks of the DP ranks before
        it; vLLM's NIXL connectors: one port per DP rank). Behind a shared
        HTTP port each is pinned by ``dp_rank``; a rank served alone
        (``dp_rank`` set) is reached by its own URL and needs no pin."""
        if self.dp == 1:
            return (self.backend(),)
        ports_per_engine = self.tp if mode == "kvpush" else 1
        served = range(self.dp) if self.dp_rank is None else (self.dp_rank,)
        return tuple(
            msgspec.structs.replace(
                self.backend(),
                engine_id=f"{self.name}_dp{d}",
                side_channel_port=dp_engine_port(
                    self.side_channel_port, d, ports_per_engine
                ),
                dp_rank=d if self.dp_rank is None else None,
                kv_events_endpoint=self.engine_kv_events_endpoint(d),
            )
            for d in served
        )


def instance_names(config: ClusterConfig) -> list[tuple[Role, str]]:
    """Each instance's role and name (its engine id), prefills first."""
    if config.mode == "colocated":
        return [("colocated", "colocated0")]
    names: list[tuple[Role, str]] = [
        ("prefill", f"prefill{i}") for i in range(config.num_prefill)
    ]
    return names + [("decode", f"decode{i}") for i in range(config.num_decode)]


def plan_instances(
    config: ClusterConfig, run_dir: Path, network: NetPlan | None = None
) -> list[InstanceSpec]:
    """Every instance of the cluster, prefills first, each with its own
    ports, cores and log file; on ``network``'s hosts, each at its host's
    address (bound and advertised alike), else at ``config``'s. Ports follow
    :class:`ClusterConfig`'s rule, cores :func:`core_shares`' (on CUDA only
    the cores given), GPUs :func:`gpu_shares`'."""
    cores = config.cores
    if not cores and config.platform == Platform.CPU:
        cores = tuple(sorted(os.sched_getaffinity(0)))
    stride = config.side_channel_stride
    names = instance_names(config)
    tps = [config.tp_of(role) for role, _ in names]
    ranks = [config.ranks_of(role) for role, _ in names]
    shares = core_shares(cores, ranks)
    gpus = gpu_shares(config, ranks)
    specs = []
    for i, (role, name) in enumerate(names):
        addresses = config.addresses
        if network is not None:
            addresses = Addresses.resolve(network.host(name).address)
        specs.append(
            InstanceSpec(
                role=role,
                name=name,
                addresses=addresses,
                http_port=config.base_http_port + i,
                side_channel_port=config.base_side_channel_port + i * stride,
                cores=rank_cores(shares[i], ranks[i]),
                run_dir=run_dir,
                tp=tps[i],
                gpus=gpus[i],
                dp=config.dp_of(role),
                kv_events_endpoint=_kv_events_endpoint(
                    config, role, i - config.num_prefill
                ),
            )
        )
    return specs


def _kv_events_endpoint(
    config: ClusterConfig, role: Role, decode_index: int
) -> str | None:
    """Where decode ``decode_index``'s engines send their KV cache events:
    the router's address (None: they send none)."""
    if role != "decode" or not config.publishes_kv_events:
        return None
    port = config.base_kv_events_port + decode_index * config.decode_dp
    return f"tcp://{config.addresses.advertise_host}:{port}"


def gpu_shares(config: ClusterConfig, tps: list[int]) -> list[tuple[int, ...]]:
    """The GPUs of each instance, for instances with ``tps`` ranks, in order:
    on CUDA the next ``tp`` of ``config.gpus`` (default 0, 1, 2, ...), one
    per rank, never shared; on CPU none."""
    if config.platform == Platform.CPU:
        return [() for _ in tps]
    pool = config.gpus or tuple(range(sum(tps)))
    shares, first = [], 0
    for tp in tps:
        shares.append(pool[first : first + tp])
        first += tp
    return shares


def core_shares(cores: tuple[int, ...], tps: list[int]) -> list[tuple[int, ...]]:
    """The cores each instance's ranks may use, for instances with ``tps``
    ranks, in order. Instances never share a core while there are at least
    as many cores as instances (on this machine a rank sharing a core with
    another instance stalled vLLM's NIXL handshake; see
    docs/tensor-parallel-cpu.md): each gets one core, then the spare cores go,
    one at a time, to the instance with the most ranks per core (the
    earliest on a tie) until every rank has its own core; shares are
    contiguous, in instance order, and cores nobody needs stay unused. With
    fewer cores than instances, instance ``i`` gets ``cores[i % len(cores)]``
    alone, as with TP 1."""
    if not cores:
        return [() for _ in tps]
    if len(cores) < len(tps):
        return [(cores[i % len(cores)],) for i in range(len(tps))]
    sizes = [1] * len(tps)
    spare = len(cores) - len(tps)
    while spare and any(n < tp for n, tp in zip(sizes, tps, strict=True)):
        i = max(range(len(tps)), key=lambda j: (tps[j] / sizes[j], -j))
        sizes[i] += 1
        spare -= 1
    shares, first = [], 0
    for n in sizes:
        shares.append(cores[first : first + n])
        first += n
    return shares


def rank_cores(share: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The core of each of an instance's ``tp`` ranks, from its ``share``:
    rank ``r`` gets ``share[r % len(share)]``, so its ranks take distinct
    cores until the share runs out, then wrap around and share (empty
    share: not pinned)."""
    if not share:
        return ()
    return tuple(share[r % len(share)] for r in range(tp))


def check_tp_fits_model(model: Path, tps: dict[str, int]) -> None:
    """Refuse, before anything starts, a TP that ``model``'s heads do not
    allow (``tps``: instance name -> its TP). vLLM needs the attention heads
    divisible by the TP, and the KV heads either divisible by it or, when
    there are fewer KV heads than ranks (they are then replicated),
    dividing it; it reports the second only as a bare assertion in a worker's
    log. A hub id or a config without head counts is left to vLLM."""
    heads = _head_counts(model)
    if heads is None:
        return
    num_heads, num_kv_heads = heads
    for name, tp in tps.items():
        if num_heads % tp:
            raise ValueError(
                f"{name}: TP {tp} does not divide the model's {num_heads} "
                f"attention heads ({model}); choose a TP that divides {num_heads}"
            )
        if num_kv_heads % tp if num_kv_heads >= tp else tp % num_kv_heads:
            raise ValueError(
                f"{name}: TP {tp} and the model's {num_kv_heads} KV heads "
                f"({model}) neither divide each other; vLLM needs one to divide "
                "the other"
            )


def check_dp_fits_model(
    model: Path, platform: Platform, specs: list[InstanceSpec]
) -> None:
    """Refuse, before anything starts, what vLLM cannot run with DP > 1:

    * one DP rank served alone (external load balancing) for a dense model:
      vLLM refuses it ("Non-MoE models do not support external data
      parallel mode"), since a dense model's DP ranks are independent
      engines anyway: each is served as an instance of its own;
    * a MoE model on vLLM's CPU build: its MoE layers exchange tokens
      between the DP ranks with ``all_gatherv``, which the CPU communicator
      lacks, and every engine dies at the first forward
      (``NotImplementedError`` in ``base_device_communicator.py``), with or
      without expert parallelism."""
    if all(s.dp == 1 for s in specs) or text_config(model) is None:
        return  # no DP, or a hub id: vLLM itself judges it
    moe = is_moe(model)
    alone = [s for s in specs if s.dp_rank is not None]
    if alone and not moe:
        raise ValueError(
            f"{alone[0].name}: {model} is a dense model, and vLLM serves one "
            "DP rank alone (--data-parallel-rank) only for mixture-of-experts "
            "models. A dense model's DP ranks are independent engines: serve "
            "each as an instance of its own (kvpush serve without --dp and "
            "--dp-rank) and list each in the router's topology"
        )
    if platform != Platform.CPU or not moe:
        return
    names = ", ".join(f"{s.name} (DP {s.dp})" for s in specs if s.dp > 1)
    raise ValueError(
        f"{names}: {model} is a mixture-of-experts model, and vLLM's CPU build "
        "cannot run its MoE layers across data-parallel ranks (all_gatherv is "
        "not implemented on CPU: the engines die at the first request); run "
        "DP 1 on CPU (--prefill-dp/--decode-dp 1; serve: no --dp)"
    )


def _head_counts(model: Path) -> tuple[int, int] | None:
    text = text_config(model)
    if text is None:
        return None
    num_heads = text.get("num_attention_heads")
    num_kv_heads = text.get("num_key_value_heads", num_heads)
    if not isinstance(num_heads, int) or not isinstance(num_kv_heads, int):
        return None
    if num_heads < 1 or num_kv_heads < 1:
        return None
    return num_heads, num_kv_heads


FAULT_FILE = "faults.json"  # in the run dir, with fault_injection
CONTROL_DIR = "control"  # in the run dir: each decode's, for kvpush forget


def control_dir_of(run_dir: Path, engine_id: str) -> Path:
    """The control directory of decode ``engine_id`` of a run
    (:mod:`kvpush.connector.control`)."""
    return run_dir / CONTROL_DIR / engine_id


_VLLM_POLICY = {"recompute": "recompute", "error": "fail"}


def kv_transfer_config(
    config: InstanceSettings, spec: InstanceSpec
) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of an instance, None when colocated.
    kvpush's connector also gets its side channel, NIXL backend, a trace
    directory (``RUN_DIR/traces``) for per-transfer timelines, any deadlines
    set in the config, and the fault file when asked for; the baselines get
    the NIXL backend when it is not UCX (vLLM's ``backends``). KV stays on
    the platform's device; on CUDA the baselines are vLLM's own connectors."""
    if spec.role == "colocated":
        return None
    if config.mode not in _CONNECTORS:
        raise ValueError(f"mode {config.mode!r} has no connector available yet")
    kv: dict[str, Any] = {"kv_connector": _CONNECTORS[config.mode]}
    if config.platform != Platform.CPU and config.mode in _VLLM_CONNECTORS:
        kv = {"kv_connector": _VLLM_CONNECTORS[config.mode]}
    kv |= {
        "kv_role": "kv_both" if config.kv_both else _KV_ROLES[spec.role],
        "kv_buffer_device": config.platform.kv_buffer_device,
        "engine_id": spec.name,
        "kv_load_failure_policy": _VLLM_POLICY[config.kv_load_failure_policy],
    }
    if config.mode == "kvpush":
        kv["kv_connector_extra_config"] = _kvpush_extra(config, spec)
    elif config.nixl_backend != "UCX":
        kv["kv_connector_extra_config"] = {"backends": [config.nixl_backend]}
    return kv


def _kvpush_extra(config: InstanceSettings, spec: InstanceSpec) -> dict[str, Any]:
    pushes = serves_prefill_legs(config, spec.role)
    receives = serves_decode_legs(config, spec.role)
    extra: dict[str, Any] = {
        "side_channel_host": spec.addresses.side_channel_bind_host,
        "side_channel_port": spec.side_channel_port,
        "nixl_backend": config.nixl_backend,
    }
    addresses = spec.addresses
    if (
        pushes and addresses.side_channel_host != addresses.side_channel_bind_host
    ):  # what prefill tells decodes in its answer to a vLLM P/D prefill leg
        extra["side_channel_advertise_host"] = addresses.side_channel_host
    if spec.run_dir is not None:
        extra["trace_dir"] = str(spec.run_dir / "traces")
        if receives:  # where kvpush forget leaves its proofs
            run_dir = spec.run_dir.absolute()  # the connector needs it absolute
            extra["control_dir"] = str(control_dir_of(run_dir, spec.name))
    for name in ("registration_ttl_s", "ready_ttl_s", "peer_timeout_s"):
        if getattr(config, name) is not None:
            extra[name] = getattr(config, name)
    if config.fault_injection:
        if spec.run_dir is None:
            raise ValueError("fault injection needs a run directory (--run-dir)")
        extra["fault_file"] = str(spec.run_dir / FAULT_FILE)
    if config.insecure_side_channel:
        extra["insecure_side_channel"] = True
    # Decode pushes nothing; a per-layer granularity (the default, auto) in
    # its config would make vLLM run its CUDA graphs PIECEWISE for nothing
    # (requires_piecewise_for_cudagraph sees this dict, not the role).
    extra["push_granularity"] = config.push_granularity if pushes else "request"
    if config.verify_kv != "off":  # both roles: both must select alike
        extra["verify_kv"] = config.verify_kv
        if config.verify_kv_sample is not None:
            extra["verify_kv_sample"] = config.verify_kv_sample
    return extra


def instance_command(
    config: InstanceSettings, spec: InstanceSpec, model: Path
) -> list[str]:
    """The command line that starts one instance's OpenAI API server. On
    CPU: eager, served as the model directory's name, the platform's dtype
    and context length unless given. On CUDA: CUDA graphs, served as the
    ``--model`` value, the model's dtype and context length unless given."""
    platform = config.platform
    max_len = config.max_model_len or platform.default_max_model_len
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model),
        "--served-model-name", model.name if platform == Platform.CPU else str(model),
        "--host", spec.addresses.bind_host,
        "--port", str(spec.http_port),
        "--dtype", config.dtype or platform.default_dtype,
        *(() if max_len is None else ("--max-model-len", str(max_len))),
        "--tensor-parallel-size", str(spec.tp),
        *(("--data-parallel-size", str(spec.dp)) if spec.dp > 1 else ()),
        *(() if spec.dp_rank is None else ("--data-parallel-rank", str(spec.dp_rank))),
        *(("--enforce-eager",) if platform == Platform.CPU else ()),
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if config.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    if config.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(config.max_num_batched_tokens)]
    kv_config = kv_transfer_config(config, spec)
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config)]
    if spec.kv_events_endpoint is not None:
        cmd += ["--kv-events-config", json.dumps(kv_events_config(spec))]
    cmd += scheduler_class_args(config, spec)
    cmd += _attention_backend_args(config, model) + _state_model_args(config, model)
    return cmd + list(config.extra_vllm_args)


def _state_model_args(config: InstanceSettings, model: Path) -> list[str]:
    """A model with Mamba state runs without prefix caching on every
    instance: vLLM's CPU build cannot run it with (its 'align' mode needs
    chunk checkpoints the CPU scan does not return), and kvpush copies the
    one running state, not per-block checkpoints. A choice in
    ``extra_vllm_args`` stays."""
    chosen = any("prefix-caching" in a for a in config.extra_vllm_args)
    return [] if chosen or not has_state(model) else ["--no-enable-prefix-caching"]


SCHEDULER_CLASS = "kvpush.connector.decode.first_token.KvPushScheduler"
ASYNC_SCHEDULER_CLASS = "kvpush.connector.decode.first_token.KvPushAsyncScheduler"


def scheduler_class_args(config: InstanceSettings, spec: InstanceSpec) -> list[str]:
    """``--scheduler-cls`` for a kvpush instance of a P/D pair: kvpush's
    scheduler class, with which a decode continues from prefill's first
    token and a prefill sends that token's logprobs
    (:mod:`kvpush.connector.decode.first_token`), in the flavour of the
    scheduling vLLM runs (synchronous on CPU or with
    ``--no-async-scheduling``, async otherwise). None when the extra vLLM
    arguments choose a scheduler class themselves."""
    extra = config.extra_vllm_args
    if (
        config.mode != "kvpush"
        or spec.role == "colocated"
        or any(a.startswith("--scheduler-cls") for a in extra)
    ):
        return []
    synchronous = config.platform == Platform.CPU or "--no-async-scheduling" in extra
    return [
        "--scheduler-cls",
        SCHEDULER_CLASS if synchronous else ASYNC_SCHEDULER_CLASS,
    ]


def kv_events_config(spec: InstanceSpec) -> dict[str, Any]:
    """vLLM's ``--kv-events-config``: every engine's KV cache events over
    ZMQ to the router's endpoint (a publisher given an address that is not a
    wildcard connects to it; vLLM adds each DP rank to the port)."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": spec.kv_events_endpoint,
    }


def _attention_backend_args(config: InstanceSettings, model: Path) -> list[str]:
    """On CPU, an MLA model in float32 runs vLLM's reference MLA backend.
    Where the CPU has AMX, vLLM prefers its AMX MLA backend, which loads only
    bfloat16 or float16 weights: in float32 the engine dies at start-up
    ("expect weight to be bfloat16, float16, ..."). A backend chosen in
    ``extra_vllm_args`` stays."""
    dtype = config.dtype or config.platform.default_dtype
    chosen = any(
        a.startswith(("--attention-backend", "--attention-config"))
        for a in config.extra_vllm_args
    )
    if config.platform != Platform.CPU or dtype != "float32" or chosen:
        return []
    return ["--attention-backend", "CPU_MLA"] if is_mla(model) else []


def instance_env_vars(
    config: InstanceSettings, spec: InstanceSpec, model: Path | None = None
) -> dict[str, str]:
    """The variables kvpush sets for one instance (over the inherited
    environment): on CPU its ranks' cores and KV cache size, on CUDA its GPUs
    (when planned); vLLM's side-channel address (which the baselines bind
    and advertise: one listener per instance, on its first port, answering
    for every rank), the NIC UCX may use; for a baseline serving a
    ``model`` with Mamba state on CPU, the conv-state layout vLLM's NIXL
    connector needs (:data:`_STATE_LAYOUT_ENV`). Never the secret: see
    :func:`instance_env`."""
    env = {}
    if config.platform == Platform.CPU:
        space = config.kv_cache_space_gb or config.platform.default_kv_cache_space_gb
        env["VLLM_CPU_KVCACHE_SPACE"] = str(space)
        if spec.omp_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = spec.omp_threads_bind
        baseline = config.mode in _VLLM_CONNECTORS
        chosen = _STATE_LAYOUT_ENV in os.environ  # an explicit one stays
        if baseline and not chosen and model is not None and has_state(model):
            env[_STATE_LAYOUT_ENV] = "DS"
    elif spec.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec.gpus)
    env.update(
        VLLM_NIXL_SIDE_CHANNEL_HOST=spec.addresses.side_channel_host,
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(spec.side_channel_port),
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    if config.ucx_net_devices is not None:
        env["UCX_NET_DEVICES"] = config.ucx_net_devices
    return env


def instance_env(
    config: InstanceSettings,
    spec: InstanceSpec,
    secret: str | None = None,
    model: Path | None = None,
) -> dict[str, str]:
    """The whole environment of one instance serving ``model``: this
    process's, plus :func:`instance_env_vars`, plus the side-channel
    ``secret`` when one was read from a file (an inherited
    ``KVPUSH_SIDE_CHANNEL_SECRET`` stays)."""
    env = dict(os.environ)
    env.update(instance_env_vars(config, spec, model))
    plugins = env.get(PLUGINS_ENV)
    if plugins is not None and PLUGIN not in plugins.split(","):
        # vLLM loads only the plugins listed there: ours names the connector
        env[PLUGINS_ENV] = ",".join(p for p in (plugins, PLUGIN) if p)
    if secret is not None:
        env[SECRET_ENV] = secret
    return env
