"""Unit tests see a CPU host: ``--platform auto`` (the CLI's default) does
not depend on what vLLM build or GPU the machine running them has. Tests of
detection itself call its probes directly."""

from __future__ import annotations

import pytest

from kvpush.launcher import platform
from tests.fakes import fake_block_tables


@pytest.fixture(autouse=True)
def _cpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "detect_platform", lambda: platform.Platform.CPU)


@pytest.fixture(autouse=True)
def _no_block_tables() -> None:
    """Scripted scheduler outputs start from no allocation in every test."""
    fake_block_tables.TABLES.clear()
