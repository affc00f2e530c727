"""Whether a side channel may run without its shared secret.

kvpush's side channel authenticates every message with an HMAC-SHA256 when
a secret is set (``KVPUSH_SIDE_CHANNEL_SECRET``). A side channel that
listens on anything but loopback (127.0.0.0/8, ::1, ``localhost``) must have
one, unless the operator says ``--insecure-side-channel``. The launcher and
``kvpush serve`` check this before starting anything; the prefill connector
checks it again when it starts, where its listener binds. Pure: no I/O.
"""

from __future__ import annotations

import ipaddress

SECRET_ENV = "KVPUSH_SIDE_CHANNEL_SECRET"
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "", "*"})


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``; any other name or
    address (wildcards included) is not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """True for a bind-everything address, which cannot be advertised."""
    return host in WILDCARD_HOSTS


def check_side_channel_auth(host: str, has_secret: bool, is_insecure: bool) -> None:
    """Raise ValueError (one line, naming the fixes) when a side channel
    bound to ``host`` would run unauthenticated off loopback."""
    if has_secret or is_insecure or is_loopback(host):
        return
    raise ValueError(
        f"the kvpush side channel would listen on {host!r}, not loopback, "
        f"without a secret: set {SECRET_ENV} (or --side-channel-secret-file FILE) "
        "on every kvpush instance, or pass --insecure-side-channel"
    )


def read_secret_file(path: str) -> str:
    """The secret in ``path`` (surrounding whitespace stripped), read once;
    ValueError when it cannot be read or is empty."""
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
    except OSError as e:
        raise ValueError(f"cannot read side-channel secret file {path}: {e}") from e
    if not secret:
        raise ValueError(f"side-channel secret file {path} is empty")
    return secret
