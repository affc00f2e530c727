"""The soak run's one frozen config, validated at construction.

A soak drives one cluster (``mode``) with Poisson arrivals at ``qps`` for
``duration_s`` seconds. Prompts are ``prompt_len`` tokens (``N`` or ``A-B``)
and every request asks for exactly ``max_tokens`` tokens. A fraction
``abort_fraction`` of the requests is aborted by the client (it closes the
connection) after a random time within ``abort_window_s`` (None: the
median duration of the warm-up requests). A request that has not ended
after ``request_timeout_s`` is lost. After the load, the soak waits up to
``settle_s`` for every instance to be idle with no KV blocks in use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpush.topology import MODES
from kvpush.transfer.digest import (
    DEFAULT_VERIFY_KV,
    DEFAULT_VERIFY_SAMPLE,
    check_verify_kv,
)
from kvpush_lab.bench.config import BenchConfig, require
from kvpush_lab.bench.lengths import LengthSpec

# A soak checks that nothing is lost or leaked under sustained load, so it
# runs below the pair's capacity: past it, prefill's queue grows without
# bound and requests time out as "lost" by construction, whatever the code.
# Measured (2026-12-03, 2-core machine, quiet, kvpush 1P1D, default
# granularity, prompts 256-1024, 32 tokens, a fifth aborted):
# - at 32 req/s, digests off (`kvpush soak --duration-s 60 --qps 32`),
#   prefill computes 10.0-10.6k prompt tokens/s (vLLM's log, 10 s windows)
#   and its queue grows: with a fifth aborted, mostly before prefill, about
#   20 req/s offered. 24 req/s, the default until then, lost requests from
#   minute 7 of a 600 s run;
# - at 16 req/s with `--verify-kv all` (`make soak`; both sides hash every
#   byte, prefill on the core it computes on), prefill's throughput fell
#   to 7.4-9.5k tokens/s against about 8.3k needed: the run passed, but its
#   queue rose to 156 requests in minutes 7-8 (TTFT p50 9 s there) before
#   draining: at capacity.
# 12 req/s offers about 75% of that.
DEFAULT_QPS = 12.0


@dataclass(frozen=True)
class SoakConfig:
    """Everything ``python -m kvpush_lab.soak`` needs."""

    mode: str = "kvpush"
    num_prefill: int = 1
    num_decode: int = 1
    duration_s: float = 600.0
    qps: float = DEFAULT_QPS
    prompt_len: str = "256-1024"
    max_tokens: int = 32
    abort_fraction: float = 0.2
    abort_window_s: float | None = None
    request_timeout_s: float = 60.0
    settle_s: float = 30.0
    num_warmup: int = 4
    seed: int = 0
    out_dir: Path | None = None
    model: Path | None = None
    max_model_len: int = 4096
    kv_cache_space_gb: int = 1
    port: int = 27000
    base_http_port: int = 27100
    base_side_channel_port: int = 27200
    startup_timeout_s: float = 300.0
    verify_kv: str = DEFAULT_VERIFY_KV  # kvpush's KV digests: off, sample, all

    def __post_init__(self) -> None:
        require(self.mode in MODES, f"mode must be one of {MODES}, not {self.mode!r}")
        require(self.duration_s > 0, "duration_s must be positive")
        require(self.qps > 0, "qps must be positive")
        require(self.max_tokens >= 1, "max_tokens must be at least 1")
        require(0.0 <= self.abort_fraction <= 1.0, "abort_fraction must be within 0..1")
        require(
            self.abort_window_s is None or self.abort_window_s > 0,
            "abort_window_s must be positive (or unset: measured in the warm-up)",
        )
        require(self.request_timeout_s > 0, "request_timeout_s must be positive")
        require(self.settle_s >= 0, "settle_s must be >= 0")
        require(self.num_warmup >= 1, "num_warmup must be at least 1 (handshake)")
        require(self.seed >= 0, "seed must be >= 0")
        check_verify_kv(self.verify_kv, DEFAULT_VERIFY_SAMPLE)
        spec = self.prompt_spec
        require(spec.kind != "trace", "prompt_len must be 'N' or 'A-B' (no traces)")
        self.bench_config()  # lengths against max_model_len, ports, counts

    @property
    def prompt_spec(self) -> LengthSpec:
        return LengthSpec.parse(self.prompt_len)

    @property
    def is_pd(self) -> bool:
        return self.mode != "colocated"

    def bench_config(self) -> BenchConfig:
        """The same settings as a benchmark config, to reuse the benchmark's
        model and cluster set-up."""
        return BenchConfig(
            configs=(self.mode,),
            num_prefill=self.num_prefill,
            num_decode=self.num_decode,
            model=self.model,
            max_model_len=self.max_model_len,
            kv_cache_space_gb=self.kv_cache_space_gb,
            qps=(self.qps,),
            prompt_len=self.prompt_len,
            output_len=str(self.max_tokens),
            num_warmup=self.num_warmup,
            seed=self.seed,
            request_timeout_s=self.request_timeout_s,
            port=self.port,
            base_http_port=self.base_http_port,
            base_side_channel_port=self.base_side_channel_port,
            startup_timeout_s=self.startup_timeout_s,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values (paths as strings)."""
        return {
            f.name: str(v) if isinstance(v, Path) else v
            for f in dataclasses.fields(self)
            for v in (getattr(self, f.name),)
        }
