"""OpenAI-shaped error replies.

Every error the router answers with, whether its own (bad input, timeout,
unreachable backend) or a backend's passed through, is a :class:`RouterError`.
Request parsing and the dispatch flows raise it; ``app.py`` and
``dispatch.py`` turn it into a response with :meth:`RouterError.to_response`.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from aiohttp import web

from kvpush.topology import Backend

JSON_CONTENT_TYPE = "application/json"

# What kind of failure an error is: the ``cause`` label of
# ``kvpush_router_failures_total`` and what the retry policy (``retry.py``)
# decides on. ``cause`` stays the finer label of ``kvpush_router_errors_total``.
FailureKind = Literal[
    "unreachable",  # connection refused, dropped or reset before any answer
    "upstream_error",  # a backend's 5xx, or an answer the router cannot use
    "timeout",  # a deadline passed
    "client_error",  # a backend's 4xx: the request itself is at fault
    "bad_request",  # refused by the router before any backend was asked
    "no_healthy_instance",  # no healthy backend of a needed role
    "internal",  # anything else
]


def error_payload(
    message: str, err_type: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """The OpenAI error object: ``{"error": {message, type, param, code}}``."""
    return {
        "error": {"message": message, "type": err_type, "param": param, "code": code}
    }


class RouterError(Exception):
    """An error reply: HTTP status, JSON body bytes, a metrics cause label, the
    failure's kind and, for a leg's failure, the backend that failed."""

    def __init__(
        self,
        status: int,
        body: bytes,
        cause: str,
        message: str,
        *,
        kind: FailureKind = "internal",
        backend: Backend | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.cause = cause
        self.kind: FailureKind = kind
        self.backend = backend

    @classmethod
    def openai(
        cls,
        status: int,
        message: str,
        err_type: str,
        code: str,
        param: str | None = None,
        *,
        kind: FailureKind = "internal",
        backend: Backend | None = None,
    ) -> RouterError:
        """An error the router itself raises; ``code`` doubles as metrics cause."""
        body = msgspec.json.encode(error_payload(message, err_type, code, param))
        return cls(status, body, code, message, kind=kind, backend=backend)

    @classmethod
    def from_backend(
        cls, status: int, body: bytes, leg: str, backend: Backend
    ) -> RouterError:
        """A backend's 4xx/5xx: its status and body kept; non-JSON is wrapped."""
        message = f"{leg} backend {backend.engine_id!r} answered HTTP {status}"
        if not _is_json(body):
            text = body.decode("utf-8", errors="replace").strip()[:2000]
            detail = f"{message}: {text}" if text else message
            body = msgspec.json.encode(
                error_payload(detail, "upstream_error", f"{leg}_http_error")
            )
        kind: FailureKind = "upstream_error" if status >= 500 else "client_error"
        return cls(
            status, body, f"{leg}_http_error", message, kind=kind, backend=backend
        )

    def to_response(self) -> web.Response:
        """A fresh, unprepared response carrying this error."""
        return web.Response(
            status=self.status,
            body=self.body,
            headers={"Content-Type": JSON_CONTENT_TYPE},
        )

    def to_sse_event(self) -> bytes:
        """The error as one SSE event, for failures after a stream has begun."""
        return b"data: " + self.body + b"\n\n"


def bad_request(message: str, param: str | None = None) -> RouterError:
    """400 for a request the router refuses before contacting any backend."""
    return RouterError.openai(
        400, message, "invalid_request_error", "bad_request", param, kind="bad_request"
    )


def not_found(message: str) -> RouterError:
    return RouterError.openai(
        404, message, "invalid_request_error", "not_found", kind="bad_request"
    )


def no_healthy_instance(role: str, num_instances: int) -> RouterError:
    """503: every ``role`` backend is marked unhealthy (or already failed)."""
    message = (
        f"no healthy {role} instance: none of the {num_instances} configured "
        "is usable (marked down by health checks or failed this request); "
        "retry later"
    )
    return RouterError.openai(
        503,
        message,
        "service_unavailable_error",
        "no_healthy_instance",
        role,
        kind="no_healthy_instance",
    )


def unreachable(leg: str, backend: Backend, detail: str) -> RouterError:
    """502: the backend refused or dropped the connection."""
    message = (
        f"cannot reach {leg} backend {backend.engine_id!r} at {backend.url}: {detail}"
    )
    return RouterError.openai(
        502,
        message,
        "upstream_error",
        f"{leg}_unreachable",
        kind="unreachable",
        backend=backend,
    )


def bad_gateway(leg: str, backend: Backend, detail: str) -> RouterError:
    """502: the backend answered something the router cannot use."""
    message = f"{leg} backend {backend.engine_id!r} at {backend.url}: {detail}"
    return RouterError.openai(
        502,
        message,
        "upstream_error",
        f"{leg}_bad_response",
        kind="upstream_error",
        backend=backend,
    )


def upstream_timeout(what: str, backend: Backend | None = None) -> RouterError:
    """504: a deadline passed while waiting on ``what`` (on ``backend``'s leg)."""
    return RouterError.openai(
        504,
        f"timed out: {what}",
        "timeout_error",
        "timeout",
        kind="timeout",
        backend=backend,
    )


def _is_json(body: bytes) -> bool:
    try:
        msgspec.json.decode(body)
    except msgspec.DecodeError:
        return False
    return True
