"""Every Prometheus family kvpush exports or reads: name, type and labels.

Three exporters, each of them serving one ``/metrics``:

- **vLLM** itself (read by the router, the bench, the soak and the tests):
  the queues, the KV-cache usage, the cache config, finished requests and
  the NIXL connectors' transfer histograms. vLLM labels each sample with
  ``model_name`` and ``engine`` and serves one sample per engine; readers
  sum them, or take the fullest, over the engines.
- **kvpush's connector**, inside vLLM (``KvPushPromMetrics`` in
  ``kvpush/connector/stats.py``): the ``vllm:kvpush_*`` families, with
  vLLM's labels first (vLLM hands them over) and then their own.
- **kvpush's router** (``kvpush/router/metrics.py``): the
  ``kvpush_router_*`` families, ``mode`` first; and the connector events it
  scrapes from the instances (``kvpush/router/connector_stats.py``).

A :class:`Family` is named as ``prometheus_client`` registers it, so a
counter without its ``_total``: the exporters pass :attr:`Family.name`, the
readers (:mod:`kvpush.telemetry.reader`) look a family up by it and find its
samples (:attr:`Family.total` of a counter, :attr:`Family.count`,
:attr:`Family.sum` and :attr:`Family.bucket` of a histogram).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Kind(StrEnum):
    """A family's type, as ``# TYPE`` spells it."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class Family:
    """One metric family: its name, type and label names.

    ``base`` are the exporter's labels, first on every sample (vLLM's
    ``model_name`` and ``engine``, the router's ``mode``), ``labels`` the
    family's own after them; a histogram's bucket samples add ``le``.
    """

    name: str
    kind: Kind
    labels: tuple[str, ...] = ()
    base: tuple[str, ...] = ()

    @property
    def label_names(self) -> tuple[str, ...]:
        """Every label of its samples, the exporter's first (``le`` aside)."""
        return (*self.base, *self.labels)

    @property
    def total(self) -> str:
        """A counter's sample (``<name>_total``)."""
        return self._suffixed(Kind.COUNTER, "_total")

    @property
    def count(self) -> str:
        """A histogram's observation count (``<name>_count``)."""
        return self._suffixed(Kind.HISTOGRAM, "_count")

    @property
    def sum(self) -> str:
        """A histogram's sum of observations (``<name>_sum``)."""
        return self._suffixed(Kind.HISTOGRAM, "_sum")

    @property
    def bucket(self) -> str:
        """A histogram's cumulative buckets (``<name>_bucket``, label ``le``)."""
        return self._suffixed(Kind.HISTOGRAM, "_bucket")

    @property
    def sample(self) -> str:
        """The sample holding a counter's or a gauge's value (a histogram has
        three: :attr:`count`, :attr:`sum`, :attr:`bucket`)."""
        if self.kind is Kind.HISTOGRAM:
            raise ValueError(
                f"{self.name} is a histogram: read its .count, .sum or .bucket"
            )
        return self.total if self.kind is Kind.COUNTER else self.name

    def _suffixed(self, kind: Kind, suffix: str) -> str:
        if self.kind is not kind:
            raise ValueError(f"{self.name} is a {self.kind}, it has no {suffix}")
        return self.name + suffix


VLLM_LABELS = ("model_name", "engine")  # vLLM's, on each of its samples
ROUTER_LABELS = ("mode",)  # the router's, on each of its own samples


def _vllm(name: str, kind: Kind, *labels: str) -> Family:
    return Family(name, kind, labels, VLLM_LABELS)


def _router(name: str, kind: Kind, *labels: str) -> Family:
    return Family(name, kind, labels, ROUTER_LABELS)


# -- vLLM's own families (read) ---------------------------------------------------

NUM_REQUESTS_WAITING = _vllm("vllm:num_requests_waiting", Kind.GAUGE)
NUM_REQUESTS_RUNNING = _vllm("vllm:num_requests_running", Kind.GAUGE)
KV_CACHE_USAGE = _vllm("vllm:kv_cache_usage_perc", Kind.GAUGE)  # a fraction
# An info gauge (always 1) with the cache config in its labels, among them
# ``num_gpu_blocks``: the usable blocks plus vLLM's null block (the labels
# kvpush reads are listed; vLLM's model_name is not among its labels).
CACHE_CONFIG_INFO = Family(
    "vllm:cache_config_info", Kind.GAUGE, ("num_gpu_blocks", "block_size"), ("engine",)
)
REQUEST_SUCCESS = _vllm("vllm:request_success", Kind.COUNTER, "finished_reason")
NIXL_XFER_TIME = _vllm("vllm:nixl_xfer_time_seconds", Kind.HISTOGRAM)
NIXL_BYTES_TRANSFERRED = _vllm("vllm:nixl_bytes_transferred", Kind.HISTOGRAM)
NIXL_NUM_DESCRIPTORS = _vllm("vllm:nixl_num_descriptors", Kind.HISTOGRAM)
NIXL_POST_TIME = _vllm("vllm:nixl_post_time_seconds", Kind.HISTOGRAM)

VLLM_FAMILIES = (
    NUM_REQUESTS_WAITING, NUM_REQUESTS_RUNNING, KV_CACHE_USAGE, CACHE_CONFIG_INFO,
    REQUEST_SUCCESS, NIXL_XFER_TIME, NIXL_BYTES_TRANSFERRED, NIXL_NUM_DESCRIPTORS,
    NIXL_POST_TIME,
)  # fmt: skip

# -- kvpush's connector, on vLLM's /metrics (exported and read) ---------------------

KVPUSH_EVENTS = _vllm("vllm:kvpush_events", Kind.COUNTER, "event")
KVPUSH_PHASE_SECONDS = _vllm("vllm:kvpush_phase_seconds", Kind.HISTOGRAM, "phase")
KVPUSH_WRITE_BYTES = _vllm("vllm:kvpush_write_bytes", Kind.HISTOGRAM)
KVPUSH_WRITE_DESCRIPTORS = _vllm("vllm:kvpush_write_descriptors", Kind.HISTOGRAM)
KVPUSH_PEER_HANDOVER_SECONDS = _vllm(
    "vllm:kvpush_peer_handover_seconds", Kind.HISTOGRAM, "peer"
)
KVPUSH_PEER_BYTES_IN_FLIGHT = _vllm(
    "vllm:kvpush_peer_bytes_in_flight", Kind.GAUGE, "peer"
)
KVPUSH_QUARANTINED_BLOCKS = _vllm("vllm:kvpush_quarantined_blocks", Kind.GAUGE, "peer")

CONNECTOR_FAMILIES = (
    KVPUSH_EVENTS, KVPUSH_PHASE_SECONDS, KVPUSH_WRITE_BYTES, KVPUSH_WRITE_DESCRIPTORS,
    KVPUSH_PEER_HANDOVER_SECONDS, KVPUSH_PEER_BYTES_IN_FLIGHT,
    KVPUSH_QUARANTINED_BLOCKS,
)  # fmt: skip

# -- the router's /metrics (exported and read) -------------------------------------

ROUTER_BINDING = _router("kvpush_router_binding", Kind.COUNTER, "binding", "reason")
ROUTER_DECODE_CHOICE = _router("kvpush_router_decode_choice", Kind.COUNTER, "reason")
ROUTER_REQUESTS = _router("kvpush_router_requests", Kind.COUNTER, "endpoint", "status")
ROUTER_ERRORS = _router("kvpush_router_errors", Kind.COUNTER, "cause")
ROUTER_FAILURES = _router("kvpush_router_failures", Kind.COUNTER, "cause")
ROUTER_RETRIES = _router("kvpush_router_retries", Kind.COUNTER)
ROUTER_HEALTH_TRANSITIONS = _router(
    "kvpush_router_health_transitions", Kind.COUNTER, "instance", "role", "to"
)
ROUTER_INSTANCE_HEALTHY = _router(
    "kvpush_router_instance_healthy", Kind.GAUGE, "instance", "role"
)
ROUTER_REQUESTS_IN_FLIGHT = _router("kvpush_router_requests_in_flight", Kind.GAUGE)
ROUTER_REQUEST_LATENCY = _router(
    "kvpush_router_request_latency_seconds", Kind.HISTOGRAM, "endpoint"
)
ROUTER_TTFT = _router("kvpush_router_ttft_seconds", Kind.HISTOGRAM, "endpoint")
ROUTER_PREFILL_LEG = _router(
    "kvpush_router_prefill_leg_seconds", Kind.HISTOGRAM, "outcome"
)
ROUTER_HANDOVER = _router("kvpush_router_handover_seconds", Kind.HISTOGRAM)
ROUTER_FIRST_TOKEN = _router("kvpush_router_first_token", Kind.COUNTER, "outcome")
ROUTER_KV_EVENTS = _router(
    "kvpush_router_kv_events", Kind.COUNTER, "instance", "outcome"
)
# The connector events of every instance (KVPUSH_EVENTS summed over each
# instance's engines), served by the router without its ``mode``.
CONNECTOR_EVENTS = Family(
    "kvpush_connector_events", Kind.COUNTER, ("engine_id", "role", "event")
)

ROUTER_FAMILIES = (
    ROUTER_BINDING, ROUTER_DECODE_CHOICE, ROUTER_REQUESTS, ROUTER_ERRORS,
    ROUTER_FAILURES, ROUTER_RETRIES, ROUTER_HEALTH_TRANSITIONS,
    ROUTER_INSTANCE_HEALTHY, ROUTER_REQUESTS_IN_FLIGHT, ROUTER_REQUEST_LATENCY,
    ROUTER_TTFT, ROUTER_PREFILL_LEG, ROUTER_HANDOVER, ROUTER_KV_EVENTS,
    ROUTER_FIRST_TOKEN,
    CONNECTOR_EVENTS,
)  # fmt: skip
