"""What ``kvpush up`` started, saved in the run directory for ``down`` and
``status``."""

from __future__ import annotations

from pathlib import Path

import msgspec

from kvpush.launcher.netns import NetPlan

STATE_FILE = "state.json"
TOPOLOGY_FILE = "topology.json"


class ProcessRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One process started by the launcher (its PID is its group id)."""

    name: str
    role: str
    pid: int
    url: str
    log_path: str
    side_channel_port: int | None = None  # the first of its tp ports
    cores: tuple[int, ...] = ()  # each rank's core (empty: not pinned)
    tp: int = 1
    dp: int = 1  # its data-parallel engines
    host: str | None = None  # its network namespace (None: this host's)


class RunState(msgspec.Struct, frozen=True, kw_only=True):
    """The cluster in one run directory."""

    mode: str
    model: str
    router_url: str
    processes: tuple[ProcessRecord, ...]
    network: NetPlan | None = None  # the rehearsal hosts (--hosts netns)


def state_path(run_dir: Path) -> Path:
    return run_dir / STATE_FILE


def save_state(state: RunState, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_path(run_dir).with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(state)))
    tmp.replace(state_path(run_dir))


def load_state(run_dir: Path) -> RunState | None:
    """The saved state, or None when nothing was started here."""
    path = state_path(run_dir)
    if not path.exists():
        return None
    try:
        return msgspec.json.decode(path.read_bytes(), type=RunState)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"run state {path} is unreadable ({e}); remove it") from e


def clear_state(run_dir: Path) -> None:
    state_path(run_dir).unlink(missing_ok=True)
