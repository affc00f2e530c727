"""Start and stop background processes, each in its own process group.

Each process starts a new session, so it and every child it forks (vLLM's
EngineCore and Worker) share one process group that ``stop_group`` ends
without touching anything this launcher did not start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

_POLL_S = 0.1


def spawn(
    cmd: list[str],
    env: dict[str, str],
    log_path: Path,
    cpus: frozenset[int] = frozenset(),
) -> int:
    """Start ``cmd`` detached in a new session, stdout and stderr appended
    to ``log_path``, restricted to ``cpus`` (every process it forks inherits
    that) unless empty; returns its PID (also its process-group id)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)

    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            preexec_fn=pin,
        )
    return proc.pid


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def group_members(pgid: int) -> list[int]:
    """Live PIDs in process group ``pgid`` (zombies excluded)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) == pgid and is_alive(int(entry)):
                members.append(int(entry))
        except (ProcessLookupError, PermissionError):
            continue
    return members


def stop_group(pgid: int, grace_s: float = 20.0) -> bool:
    """SIGTERM process group ``pgid``; SIGKILL whatever is left after
    ``grace_s``. Returns True when nothing of the group is left."""
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while group_members(pgid) and time.monotonic() < deadline:
        _reap(pgid)
        time.sleep(_POLL_S)
    if group_members(pgid):
        _signal_group(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while group_members(pgid) and time.monotonic() < deadline:
            _reap(pgid)
            time.sleep(_POLL_S)
    _reap(pgid)
    return not group_members(pgid)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _reap(pid: int) -> None:
    """Collect the exit status of ``pid`` if it is our child."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def tail(path: Path, num_lines: int = 40) -> str:
    """The last lines of a log file ('' when missing)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-num_lines:])
