"""``kvpush up``, ``down`` and ``status``: the cluster's whole life.

``up`` starts every vLLM instance and the router in the background, saves
what it started in the run directory, and returns once every instance
answers ``/health`` and the router ``/ready``. ``down`` stops exactly what
the saved state names.
"""

from __future__ import annotations

import http.client
import os
import secrets
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
from rich.console import Console

from kvpush import env
from kvpush.launcher import netns, process
from kvpush.launcher.config import ClusterConfig, InstanceSettings, check_secret
from kvpush.launcher.instances import (
    InstanceSpec,
    check_dp_fits_model,
    check_tp_fits_model,
    instance_command,
    instance_env,
    instance_names,
    plan_instances,
)
from kvpush.launcher.state import (
    TOPOLOGY_FILE,
    ProcessRecord,
    RunState,
    clear_state,
    load_state,
    save_state,
)
from kvpush.model.kv_size import has_state
from kvpush.side_channel_auth import SECRET_ENV, read_secret_file
from kvpush.topology import Topology, dump_topology

_POLL_S = 0.5
ROUTER_LOG = "router.log"


class LaunchError(RuntimeError):
    """A cluster could not be started; everything it started is stopped."""


def run_dir_of(config: ClusterConfig) -> Path:
    return config.run_dir or env.default_run_dir()


def up(config: ClusterConfig, console: Console | None = None) -> RunState:
    """Start the cluster described by ``config`` and wait until it serves."""
    console = console or Console(stderr=True)
    run_dir = run_dir_of(config)
    check_run_dir_free(run_dir)
    network = _plan_network(config, run_dir)
    if network is None:
        check_secret(config, config.addresses.side_channel_bind_host)
    secret = cluster_secret(config, run_dir)
    model = _resolve_model(config, console)
    specs = plan_instances(config, run_dir, network)
    check_tp_fits_model(model, {s.name: s.tp for s in specs})
    check_dp_fits_model(model, config.platform, specs)
    _check_ports_free(config, [] if network else specs)
    run_dir.mkdir(parents=True, exist_ok=True)
    backends = tuple(b for s in specs for b in s.backends(config.mode))
    topology = Topology(mode=config.mode, backends=backends)  # type: ignore[arg-type]
    dump_topology(topology, run_dir / TOPOLOGY_FILE)
    state = RunState(
        mode=config.mode,
        model=str(model),
        router_url=f"http://{config.addresses.advertise_host}:{config.port}",
        processes=(),
        network=network,
    )
    try:
        if network is not None:
            save_state(state, run_dir)  # before anything exists: down finds it
            netns.create(network)
        state = _start_all(config, specs, model, run_dir, state, secret)
        _wait_ready(state, config.startup_timeout_s, console)
    except BaseException:
        _stop_processes(state.processes)
        if network is not None:
            netns.destroy(network)
        clear_state(run_dir)
        raise
    return state


def _plan_network(config: ClusterConfig, run_dir: Path) -> netns.NetPlan | None:
    """The rehearsal hosts of ``--hosts netns`` (None for local), after
    removing whatever a crashed cluster of this run directory left."""
    if config.hosts != "netns":
        return None
    reason = netns.unavailable_reason()
    if reason is not None:
        raise LaunchError(reason)
    netns.cleanup_tag(netns.run_dir_tag(run_dir))
    names = [name for _, name in instance_names(config)]
    return netns.plan_network(
        run_dir, names, netns.free_subnet_index(), config.link_gbit
    )


REHEARSAL_SECRET = "side-channel.secret"  # in the run dir, --hosts netns only


def cluster_secret(config: ClusterConfig, run_dir: Path) -> str | None:
    """The side-channel secret the instances get (None: none, or an
    inherited ``KVPUSH_SIDE_CHANNEL_SECRET``): the secret file's, else, for
    a kvpush rehearsal off loopback (``--hosts netns``), one made for this
    run directory (``RUN_DIR/side-channel.secret``, mode 0600), so that the
    rehearsal runs authenticated like a real deployment."""
    secret = read_secret(config)
    if (
        secret is not None
        or config.hosts != "netns"
        or config.mode != "kvpush"
        or config.insecure_side_channel
        or os.environ.get(SECRET_ENV)
    ):
        return secret
    path = run_dir / REHEARSAL_SECRET
    if not path.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return read_secret_file(str(path))


def _start_all(
    config: ClusterConfig,
    specs: list[InstanceSpec],
    model: Path,
    run_dir: Path,
    state: RunState,
    secret: str | None,
) -> RunState:
    """Spawn every instance, then the router, saving state after each."""
    records: list[ProcessRecord] = []
    for spec in specs:
        host = _host_of(state, spec.name)
        pid = _spawn_instance(config, spec, model, secret, host)
        records.append(
            ProcessRecord(
                name=spec.name,
                role=spec.role,
                pid=pid,
                url=spec.url,
                log_path=str(spec.log_path),
                side_channel_port=spec.side_channel_port,
                cores=spec.cores,
                tp=spec.tp,
                dp=spec.dp,
                host=host.namespace if host else None,
            )
        )
        state = _with(state, records)
        save_state(state, run_dir)
    pid = _spawn_router(config, run_dir, model)
    records.append(
        ProcessRecord(
            name="router",
            role="router",
            pid=pid,
            url=state.router_url,
            log_path=str(run_dir / ROUTER_LOG),
        )
    )
    state = _with(state, records)
    save_state(state, run_dir)
    return state


def _host_of(state: RunState, name: str) -> netns.HostNet | None:
    return None if state.network is None else state.network.host(name)


def _spawn_instance(
    config: ClusterConfig,
    spec: InstanceSpec,
    model: Path,
    secret: str | None,
    host: netns.HostNet | None,
) -> int:
    """Start one instance, pinned to its ranks' cores (on its rehearsal
    ``host`` when there is one); its process-group id."""
    cmd = instance_command(config, spec, model)
    if host is not None:
        cmd = netns.exec_prefix(host) + cmd
    # The whole instance (API server, EngineCore, every rank's worker), not
    # just its OMP threads, which vLLM binds rank by rank.
    env = instance_env(config, spec, secret, model)
    return process.spawn(cmd, env, spec.log_path, spec.cpus)


def read_secret(settings: InstanceSettings) -> str | None:
    """The side-channel secret from ``side_channel_secret_file``, read once
    (None without one: an exported ``KVPUSH_SIDE_CHANNEL_SECRET`` is
    inherited)."""
    path = settings.side_channel_secret_file
    return None if path is None else read_secret_file(str(path))


def _spawn_router(config: ClusterConfig, run_dir: Path, model: Path) -> int:
    """Start the router, logging to ``RUN_DIR/router.log``; its group id."""
    cmd = router_command(config, run_dir, state_model=has_state(model))
    return process.spawn(cmd, _router_env(), run_dir / ROUTER_LOG)


def router_command(
    config: ClusterConfig, run_dir: Path, state_model: bool = False
) -> list[str]:
    """The router's command line (``state_model``: the model keeps
    per-request state, which kvpush mode's routing weighs)."""
    return (
        [
            sys.executable,
            "-m",
            "kvpush",
            "router",
            "--topology",
            str(run_dir / TOPOLOGY_FILE),
            "--host",
            config.host,
            "--port",
            str(config.port),
        ]
        + (["--binding", config.binding] if config.binding else [])
        + (
            ["--first-token-from", config.first_token_from]
            if config.first_token_from
            else []
        )
        + (["--state-model"] if state_model and config.mode == "kvpush" else [])
    )


def _router_env() -> dict[str, str]:
    """The router's environment: this process's, unbuffered output."""
    return dict(os.environ, PYTHONUNBUFFERED="1")


def _with(state: RunState, records: list[ProcessRecord]) -> RunState:
    return msgspec.structs.replace(state, processes=tuple(records))


def _wait_ready(state: RunState, timeout_s: float, console: Console) -> None:
    """Block until every instance answers /health and the router /ready,
    showing progress; raise
    LaunchError with the log tail if one dies or the deadline passes."""
    start = time.monotonic()
    pending = {p.name: p for p in state.processes}
    with console.status("") as status:
        while pending:
            elapsed = time.monotonic() - start
            for name, rec in list(pending.items()):
                if not process.is_alive(rec.pid):
                    raise LaunchError(_failure(rec, "exited during start-up"))
                if _healthy(rec.url, "/ready" if rec.role == "router" else "/health"):
                    del pending[name]
                    console.print(f"  {name} ready at {rec.url} ({elapsed:.0f} s)")
            if not pending:
                break
            if elapsed > timeout_s:
                rec = next(iter(pending.values()))
                raise LaunchError(_failure(rec, f"not ready after {timeout_s:.0f} s"))
            waiting = ", ".join(pending)
            status.update(
                f"starting {state.mode}: waiting for {waiting} ({elapsed:.0f} s)"
            )
            time.sleep(_POLL_S)


def _failure(rec: ProcessRecord, what: str) -> str:
    return (
        f"{rec.name} {what}; its log is {rec.log_path}. Last lines:\n"
        f"{process.tail(Path(rec.log_path))}"
    )


def _healthy(url: str, path: str) -> bool:
    """Whether ``url`` answers 200 on ``path`` (an instance's ``/health``,
    the router's readiness, ``/ready``: it routes every role). Anything that
    is not an HTTP answer is "not yet": before the server listens, a poll of
    a port in the kernel's ephemeral range can connect to itself and read
    back its own request."""
    try:
        with urllib.request.urlopen(f"{url}{path}", timeout=2.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError):
        return False


def check_run_dir_free(run_dir: Path) -> None:
    """Refuse while a cluster runs from ``run_dir``; clear what a dead one
    left (its state, its rehearsal hosts)."""
    state = load_state(run_dir)
    if state is None:
        return
    if any(process.group_members(p.pid) for p in state.processes):
        raise ValueError(
            f"a cluster is already running from {run_dir}; stop it with "
            f"'kvpush down --run-dir {run_dir}' or choose another --run-dir"
        )
    if state.network is not None:
        netns.destroy(state.network)
    clear_state(run_dir)


def _resolve_model(config: ClusterConfig, console: Console) -> Path:
    if config.model is not None:
        if not (config.model / "config.json").is_file():
            raise ValueError(
                f"--model {config.model} is not a model directory (no config.json)"
            )
        return config.model
    return tiny_model(console)


def tiny_model(console: Console | None = None) -> Path:
    """The tiny model under ``$KVPUSH_HOME``, made on first use."""
    from kvpush.model import ModelSpec, default_model_dir, ensure_model

    console = console or Console(stderr=True)
    target = default_model_dir(env.kvpush_home())
    with console.status(f"making the tiny model in {target} (first use only)"):
        return ensure_model(target, ModelSpec())


def _check_ports_free(config: ClusterConfig, specs: list[InstanceSpec]) -> None:
    ports = [("router", config.host, config.port)]
    for s in specs:
        ports.append((f"{s.name} HTTP", s.addresses.bind_host, s.http_port))
        ports += [
            (f"{s.name} side channel", s.addresses.side_channel_bind_host, port)
            for port in s.side_channel_ports
        ]
        ports += [  # the router listens for them
            (f"{s.name} KV events", config.host, port) for port in s.kv_events_ports
        ]
    for what, host, port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # As the servers themselves do: a port whose old connections
            # linger in TIME_WAIT is free to listen on.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as e:
                raise ValueError(
                    f"port {port} ({what}) on {host} is in use ({e.strerror}); "
                    "choose other ports with --port / --base-http-port / "
                    "--base-side-channel-port / --base-kv-events-port"
                ) from e


def _stop_processes(records: tuple[ProcessRecord, ...]) -> list[str]:
    """Stop the router first, then instances; names of any that survived."""
    survivors = []
    for rec in sorted(records, key=lambda r: r.role != "router"):
        if not process.stop_group(rec.pid):
            survivors.append(rec.name)
    return survivors


def down(run_dir: Path) -> list[str]:
    """Stop everything started from ``run_dir``; names of what was stopped."""
    state = load_state(run_dir)
    if state is None:
        return []
    survivors = _stop_processes(state.processes)
    if survivors:
        raise RuntimeError(f"could not stop {', '.join(survivors)}; see {run_dir}")
    if state.network is not None:
        netns.destroy(state.network)
    clear_state(run_dir)
    return [p.name for p in state.processes]


def status(run_dir: Path) -> dict[str, object] | None:
    """The running cluster as plain data (None when nothing runs here)."""
    state = load_state(run_dir)
    if state is None:
        return None
    return {
        "mode": state.mode,
        "model": state.model,
        "router_url": state.router_url,
        "run_dir": str(run_dir),
        "processes": [
            {
                "name": p.name,
                "role": p.role,
                "url": p.url,
                "side_channel_port": p.side_channel_port,
                "tp": p.tp,
                "dp": p.dp,
                "cores": list(p.cores),
                "host": p.host or "local",
                "pid": p.pid,
                "alive": process.is_alive(p.pid),
                "log_path": p.log_path,
            }
            for p in state.processes
        ],
    }


def restart(
    config: ClusterConfig, name: str, console: Console | None = None
) -> RunState:
    """Start process ``name`` of the running cluster (an instance, or
    ``router``) again, stopping it first if it still runs, with the command it
    was started with, and wait until it serves. For fault tests and for
    operators replacing a dead one."""
    console = console or Console(stderr=True)
    run_dir = run_dir_of(config)
    state = load_state(run_dir)
    if state is None:
        raise ValueError(f"no cluster runs from {run_dir}")
    specs = {s.name: s for s in plan_instances(config, run_dir, state.network)}
    old = next((p for p in state.processes if p.name == name), None)
    if old is None or (name not in specs and name != "router"):
        raise ValueError(f"{name!r} is not a process of the cluster in {run_dir}")
    if not process.stop_group(old.pid):
        raise RuntimeError(f"could not stop {name} (pid {old.pid})")
    if name == "router":
        pid = _spawn_router(config, run_dir, Path(state.model))
    else:
        secret = cluster_secret(config, run_dir)
        host = _host_of(state, name)
        pid = _spawn_instance(config, specs[name], Path(state.model), secret, host)
    new = msgspec.structs.replace(old, pid=pid)
    records = [new if p.name == name else p for p in state.processes]
    state = _with(state, records)
    save_state(state, run_dir)
    _wait_ready(_with(state, [new]), config.startup_timeout_s, console)
    return state
