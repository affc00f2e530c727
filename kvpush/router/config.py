"""The router's one frozen configuration.

Built by the CLI (or a test) and handed to :func:`kvpush.router.app.build_app`;
nothing in the router reads the environment or mutates this object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvpush.router.binding import (
    DEFAULT_LATE_MIN_BUSY,
    DEFAULT_SKIP_MAX_NEW_TOKENS,
    BindingPolicy,
    check_policy,
)
from kvpush.router.scoring import ScoreWeights
from kvpush.topology import Topology

# Modes the router has a flow for (see ``kvpush.router.dispatch.FLOWS``).
SUPPORTED_MODES: tuple[str, ...] = ("colocated", "vllm-pull", "vllm-push", "kvpush")

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


class FirstTokenFrom(Enum):
    """Which leg's first token a streamed kvpush request reads first
    (``first_token.py``): prefill's, as soon as it answers, or decode's."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class RoutingConfig:
    """How kvpush mode chooses instances and binding (``planner.py``).

    ``binding``: ``auto`` (the default) decides per request, ``early``,
    ``late`` or ``skip`` force one (outside kvpush mode every request is
    bound early: ``auto`` and ``early`` are accepted there, nothing else);
    ``skip_max_new_tokens``: ``auto`` sends no prefill leg when the chosen
    decode would compute at most this many tokens itself;
    ``late_min_busy``: ``auto`` binds late when even the chosen decode's
    busy score (``scoring.busy_score``, request equivalents) is above this;
    ``block_size``: tokens per block of the prefix index, vLLM's
    ``--block-size`` of the decodes (128 on the CPU backend);
    ``prefix_index_entries`` bounds the index ((decode, block) pairs);
    ``session_header`` names the affinity header (the ``user`` field is the
    fallback); ``affinity_slack``: a session's decode is kept while its score
    is at most this much worse than the best one;
    ``signal_interval_s`` is the pause between two scrapes of an instance's
    ``/metrics``, ``signal_max_age_s`` the age past which a read is unknown;
    ``tokenize_timeout_s`` bounds counting a prompt (``/tokenize``);
    ``full_scan_max``: up to this many candidates all are scored, above it
    two random ones (power of two choices);
    ``first_token_from``: a streamed request with a prefill leg gets its
    first token from prefill's answer (``first_token.py`` says which
    requests cannot) or from decode; ``state_model``: the model keeps
    per-request state (Mamba, gated delta net, short conv), so a request
    decode would not continue from prefill's first token skips the prefill
    leg (``binding.py``).
    """

    binding: BindingPolicy = "auto"
    skip_max_new_tokens: int = DEFAULT_SKIP_MAX_NEW_TOKENS
    late_min_busy: float = DEFAULT_LATE_MIN_BUSY
    block_size: int = 128
    prefix_index_entries: int = 65536
    session_header: str = "x-session-id"
    affinity_slack: float = 4.0
    signal_interval_s: float = 1.0
    signal_max_age_s: float = 3.0
    tokenize_timeout_s: float = 1.0
    full_scan_max: int = 4
    weights: ScoreWeights = field(default_factory=ScoreWeights)
    first_token_from: FirstTokenFrom = FirstTokenFrom.PREFILL
    state_model: bool = False

    def __post_init__(self) -> None:
        check_policy(self.binding)
        if not isinstance(self.first_token_from, FirstTokenFrom):
            raise ValueError(
                f"first_token_from must be one of "
                f"{', '.join(f.value for f in FirstTokenFrom)}, "
                f"not {self.first_token_from!r}"
            )
        if self.skip_max_new_tokens < 0:
            raise ValueError(
                f"skip_max_new_tokens must be >= 0 (0: skip only full hits), "
                f"not {self.skip_max_new_tokens}"
            )
        if self.late_min_busy < 0:
            raise ValueError(
                f"late_min_busy must be >= 0 (request equivalents), "
                f"not {self.late_min_busy}"
            )
        _check_count("block_size", self.block_size, "tokens (vLLM's --block-size)")
        _check_count("prefix_index_entries", self.prefix_index_entries, "entries")
        _check_count("full_scan_max", self.full_scan_max, "candidates")
        if not self.session_header:
            raise ValueError("session_header must name a header, e.g. x-session-id")
        if self.affinity_slack < 0:
            raise ValueError(f"affinity_slack must be >= 0, not {self.affinity_slack}")
        _check_positive("signal_interval_s", self.signal_interval_s)
        _check_positive("signal_max_age_s", self.signal_max_age_s)
        _check_positive("tokenize_timeout_s", self.tokenize_timeout_s)
        if self.signal_max_age_s < self.signal_interval_s:
            raise ValueError(
                f"signal_max_age_s ({self.signal_max_age_s}) must be at least "
                f"signal_interval_s ({self.signal_interval_s}), or every read "
                "is stale before the next"
            )


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
    ``port`` 0 asks the OS for a free port (tests use it);
    ``routing``: kvpush mode's choice of instances and binding.
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
    routing: RoutingConfig = field(default_factory=RoutingConfig)

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
        if self.routing.binding not in ("auto", "early") and self.mode != "kvpush":
            raise ValueError(
                f"binding {self.routing.binding!r} needs kvpush mode (this "
                f"topology is {self.mode!r}, where every request binds early); "
                "leave --binding unset"
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
