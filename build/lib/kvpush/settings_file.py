"""Reading one settings file (JSON, or TOML by its ``.toml`` suffix) into a
dict, shared by the launcher's and the benchmark's configs; each config
checks the keys and values itself."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any


def read_settings_file(path: Path) -> dict[str, Any]:
    """The file's top-level table; ValueError saying what is wrong."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read config file {path}: {e}") from e
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise ValueError(f"config file {path} is not valid {kind}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a table/object of settings")
    return data
