"""The router's one frozen configuration.

Built by the CLI (or a test) and handed to :func:`kvpush.router.app.build_app`;
nothing in the router reads the environment or mutates this object.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.topology import Topology

# Modes the router has a flow for (see ``kvpush.router.dispatch.FLOWS``).
SUPPORTED_MODES: tuple[str, ...] = ("colocated", "vllm-pull", "vllm-push", "kvpush")

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router needs to serve one cluster.

    ``request_timeout_s`` bounds a whole client request, every leg included;
    ``connect_timeout_s`` bounds opening a TCP connection to a backend;
    ``health_timeout_s`` bounds each probe of a backend's ``/health`` (the
    background checks and the router's own ``GET /health``);
    ``health_interval_s`` is the pause between two background probes of one
    backend; an instance is routed around after ``unhealthy_after``
    consecutive failed probes (or at once when a request cannot connect to
    it) until one probe succeeds;
    ``max_attempts`` bounds the attempts of one request: a failed attempt is
    retried on other instances while nothing has reached the client (1: never);
    ``shutdown_timeout_s`` is how long in-flight requests may finish on stop;
    ``max_body_bytes`` caps the size of an incoming request body (413 above).
    ``port`` 0 asks the OS for a free port (tests use it).
    """

    topology: Topology
    host: str = "127.0.0.1"
    port: int = 8000
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    health_timeout_s: float = 2.0
    health_interval_s: float = 1.0
    unhealthy_after: int = 2
    max_attempts: int = 2
    shutdown_timeout_s: float = 10.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        self.topology.validate()
        if self.topology.mode not in SUPPORTED_MODES:
            raise ValueError(
                f"unknown router mode {self.topology.mode!r}; use one of "
                f"{', '.join(SUPPORTED_MODES)}"
            )
        if not self.host:
            raise ValueError("host must be a non-empty address, e.g. '127.0.0.1'")
        if not 0 <= self.port <= 65535:
            raise ValueError(
                f"port must be in 0..65535 (0 = any free), not {self.port}"
            )
        _check_positive("request_timeout_s", self.request_timeout_s)
        _check_positive("connect_timeout_s", self.connect_timeout_s)
        _check_positive("health_timeout_s", self.health_timeout_s)
        _check_positive("health_interval_s", self.health_interval_s)
        _check_count("unhealthy_after", self.unhealthy_after, "failed probes")
        _check_count("max_attempts", self.max_attempts, "attempts (1: no retry)")
        _check_positive("shutdown_timeout_s", self.shutdown_timeout_s)
        if self.connect_timeout_s > self.request_timeout_s:
            raise ValueError(
                f"connect_timeout_s ({self.connect_timeout_s}) must not exceed "
                f"request_timeout_s ({self.request_timeout_s}); lower it"
            )
        if self.max_body_bytes < 1024:
            raise ValueError(
                f"max_body_bytes must be at least 1024, not {self.max_body_bytes}"
            )

    @property
    def mode(self) -> str:
        """The topology's mode: which flow every generation request takes."""
        return self.topology.mode


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, not {value}")


def _check_count(name: str, value: int, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1 of {unit}, not {value!r}")
