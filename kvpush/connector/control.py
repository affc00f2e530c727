"""Decode's control directory: proofs only an operator can give.

A prefill that dies off loopback cannot be told from a partition: its
receives wait (quarantined past their deadline) for its final word or a
proof that it is gone (:mod:`kvpush.connector.decode.receiver`). When its
host never comes back, the proof has to come from whoever can see that
host is down: an operator or an orchestrator, with ``kvpush forget
ENGINE_ID``. That command writes ``forget/<engine_id>.json`` into the
control directory of each decode instance (``control_dir`` of the
connector's extra config; ``kvpush up`` and ``kvpush serve --run-dir`` set
``RUN_DIR/control/<decode engine id>``; empty: no control directory, the
feature is off)::

    {"engine_id": "prefill0", "at": 1718000000.0}

(``at``: when it was written, wall-clock seconds). It is written to a
temporary name then renamed, so a reader never sees half a file.

Decode's worker looks at ``forget/`` from its step (:meth:`ControlDir.poll`:
one ``stat`` of the directory at most every :data:`RECHECK_S`, a listing
only when its mtime changed or was too recent to trust) and treats each
new file as the proof that every rank of that prefill engine is gone.
A file is *spent* once read: it applies to the receives pending at that
moment, never to receives registered later (those of the prefill's next
boot once it is back), and it is never read again unless it is written
again. Nothing here runs on a timer; the files stay (each TP rank of decode
reads them on its own) and are only a record afterwards.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

FORGET_DIR = "forget"
RECHECK_S = 0.5  # how often the forget directory's mtime is looked at
# A directory changed this recently may change again within the same mtime
# tick (coarse on some file systems): list it again at the next look.
RACY_NS = 2_000_000_000
MAX_ENGINE_ID = 64
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:@-]+$")


@dataclass(frozen=True)
class Forget:
    """An operator's proof that prefill ``engine_id`` is gone, written at
    ``at`` (wall-clock seconds)."""

    engine_id: str
    at: float


def check_engine_id(engine_id: str) -> None:
    """Raise ValueError unless ``engine_id`` can name a forget file."""
    if (
        not engine_id
        or len(engine_id) > MAX_ENGINE_ID
        or not _SAFE_ID.match(engine_id)
        or engine_id in (".", "..")
    ):
        raise ValueError(
            f"engine id {engine_id!r} cannot name a forget file (1..{MAX_ENGINE_ID} "
            "characters of letters, digits and ._:@-)"
        )


def forget_path(control_dir: Path, engine_id: str) -> Path:
    check_engine_id(engine_id)
    return control_dir / FORGET_DIR / f"{engine_id}.json"


def write_forget(control_dir: Path, engine_id: str, at: float | None = None) -> Path:
    """Write the forget file of ``engine_id`` into ``control_dir``
    atomically (a temporary file, then a rename); its path."""
    path = forget_path(control_dir, engine_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"engine_id": engine_id, "at": time.time() if at is None else at}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(body) + "\n")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_forget(path: Path) -> Forget:
    """The forget in ``path``; ValueError (or OSError) when it is not one."""
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError("a forget file holds a JSON object")
    engine_id, at = raw.get("engine_id"), raw.get("at")
    if not isinstance(engine_id, str) or f"{engine_id}.json" != path.name:
        raise ValueError(f"engine_id {engine_id!r} does not match the file's name")
    if isinstance(at, bool) or not isinstance(at, int | float):
        raise ValueError(f"at must be a number, not {at!r}")
    return Forget(engine_id, float(at))


class ControlDir:
    """Reads new forget files of one control directory (``path`` empty:
    none, and :meth:`poll` always answers nothing)."""

    def __init__(self, path: str) -> None:
        self._dir = Path(path) / FORGET_DIR if path else None
        self._checked: float | None = None  # monotonic time of the last look
        self._mtime_ns: int | None = None  # the directory's, at the last listing
        self._racy = False  # that listing may have missed a change in its tick
        self._seen: dict[str, int] = {}  # file name -> its mtime_ns when read

    @property
    def enabled(self) -> bool:
        return self._dir is not None

    def prepare(self) -> None:
        """Create the forget directory (so ``kvpush forget --control-dir``
        finds it); a failure is logged, and polling still works once an
        operator creates it."""
        if self._dir is None:
            return
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            logger.warning(
                "kvpush: cannot create control directory %s: %s", self._dir, e
            )

    def poll(self, now: float) -> list[Forget]:
        """The forgets written since the last call (``now``: monotonic
        seconds; the directory is looked at most every :data:`RECHECK_S`)."""
        if self._dir is None:
            return []
        if self._checked is not None and now - self._checked < RECHECK_S:
            return []
        self._checked = now
        try:
            mtime_ns = self._dir.stat().st_mtime_ns
        except OSError:
            return []  # not there (yet): nothing to read
        if mtime_ns == self._mtime_ns and not self._racy:
            return []
        self._mtime_ns = mtime_ns
        self._racy = time.time_ns() - mtime_ns < RACY_NS
        return self._read_new()

    def _read_new(self) -> list[Forget]:
        assert self._dir is not None
        try:
            entries = list(os.scandir(self._dir))
        except OSError as e:
            logger.warning("kvpush: cannot list %s: %s", self._dir, e)
            return []
        out = []
        for entry in entries:
            if entry.name.startswith(".") or not entry.name.endswith(".json"):
                continue
            try:
                mtime_ns = entry.stat().st_mtime_ns
            except OSError:
                continue
            if self._seen.get(entry.name) == mtime_ns:
                continue
            self._seen[entry.name] = mtime_ns
            try:
                out.append(read_forget(Path(entry.path)))
            except (OSError, ValueError) as e:
                logger.warning("kvpush: ignoring control file %s: %s", entry.path, e)
        return sorted(out, key=lambda f: (f.at, f.engine_id))
