"""``kvpush drain``: ask a running router to drain (or undrain) an instance
and, optionally, wait until nothing is in flight on it. Plain blocking HTTP
(the router's admin endpoints, ``admin.py``), for an operator's shell."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

POLL_S = 0.5
_HTTP_TIMEOUT_S = 5.0


def call(router_url: str, method: str, path: str) -> Any:
    """One admin request; its JSON answer. RuntimeError saying why not."""
    url = router_url.rstrip("/") + path
    request = urllib.request.Request(
        url, method=method, data=b"" if method == "POST" else None
    )
    try:
        with urllib.request.urlopen(request, timeout=_HTTP_TIMEOUT_S) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{method} {url}: HTTP {e.code}: {_message(e)}") from e
    except (urllib.error.URLError, OSError) as e:
        raise RuntimeError(f"cannot reach the router at {router_url}: {e}") from e


def _message(e: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(e.read())["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return str(e.reason)


def instance(router_url: str, name: str) -> dict[str, Any]:
    """``name``'s entry of ``GET /admin/instances``."""
    for entry in call(router_url, "GET", "/admin/instances")["instances"]:
        if entry["engine_id"] == name:
            return dict(entry)
    raise RuntimeError(f"the router at {router_url} has no instance {name!r}")


def drain(
    router_url: str,
    name: str,
    *,
    undrain: bool = False,
    wait_s: float | None = None,
    report: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Drain (or undrain) ``name``; with ``wait_s``, wait at most that long
    until it has no request in flight (RuntimeError past the deadline)."""
    action = "undrain" if undrain else "drain"
    entry: dict[str, Any] = call(router_url, "POST", f"/admin/{action}/{name}")
    report(f"{name} {action}ed; {entry['in_flight']} request(s) in flight")
    if undrain or wait_s is None:
        return entry
    deadline = time.monotonic() + wait_s
    while entry["in_flight"] > 0:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{name} still has {entry['in_flight']} request(s) in flight "
                f"after {wait_s:.0f} s; it stays drained"
            )
        time.sleep(POLL_S)
        entry = instance(router_url, name)
    report(f"{name} has no request in flight; it can be stopped")
    return entry
