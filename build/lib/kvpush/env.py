"""Every environment variable kvpush reads, in one place.

Settings that a user may change without flags live here; everything else is
a flag or a config-file value.
"""

from __future__ import annotations

import os
from pathlib import Path


def kvpush_home() -> Path:
    """Root for kvpush's own files: models and the default run directory.

    ``KVPUSH_HOME``, default ``~/.cache/kvpush``.
    """
    return Path(os.environ.get("KVPUSH_HOME", "~/.cache/kvpush")).expanduser()


def default_run_dir() -> Path:
    """Where ``kvpush up`` keeps state and logs: ``KVPUSH_RUN_DIR``, default
    ``$KVPUSH_HOME/run``."""
    value = os.environ.get("KVPUSH_RUN_DIR")
    return Path(value).expanduser() if value else kvpush_home() / "run"
