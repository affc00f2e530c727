"""Cancelling a group of the router's asyncio tasks, with a deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any


async def cancel_all(tasks: Sequence[asyncio.Task[Any]], timeout_s: float) -> None:
    """Cancel ``tasks`` and wait at most ``timeout_s`` for them to unwind."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)
