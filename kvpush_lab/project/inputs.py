"""Every number the projection starts from, with where it came from.

Each one is a :class:`Param`: its default, unit, kind of source (measured
here, published, assumed) and basis, which the command prints next to the
result. :class:`Inputs` holds the values of one projection (defaults, or
the command line's overrides) and validates them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvpush_lab.project.shape import ModelShape, load_shape

MEASURED = "measured here"
PUBLISHED = "published"
ASSUMED = "assumed"
DERIVED = "derived"


@dataclass(frozen=True)
class Param:
    """One input of the model: ``name`` is its :class:`Inputs` field and,
    with dashes, its command-line option."""

    name: str
    default: float
    unit: str
    source: str
    basis: str

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


PARAMS: tuple[Param, ...] = (
    Param("output_tokens", 128, "tokens", ASSUMED,
          "output length; vLLM PR 45211's Qwen3-32B runs used 2048 in / 128 out"),
    Param("decode_batch", 32, "requests", ASSUMED,
          "requests running on decode at once (the load)"),
    Param("tp", 4, "GPUs", ASSUMED,
          "tensor parallel size of each instance; the published table lists it "
          "per row, not readable here"),
    Param("block_size", 16, "tokens", PUBLISHED, "vLLM's default block size on GPU"),
    Param("link_gbit_per_gpu", 400, "Gbit/s", PUBLISHED,
          "EC2 p5en: 3200 Gbit/s of EFA per node of 8 H200s; each TP rank moves "
          "its own KV shard over its own share"),
    Param("link_efficiency", 0.8, "of nominal", ASSUMED,
          "achieved fraction of the EFA rate; measured here 0.96/0.98 of a shaped "
          "1/4 Gbit/s TCP link (docs/bench/rehearsal-bandwidth), a different "
          "regime from a 400 Gbit/s RDMA NIC"),
    Param("hbm_tb_per_s", 4.8, "TB/s", PUBLISHED, "H200 HBM3e bandwidth per GPU"),
    Param("hbm_efficiency", 0.8, "of nominal", ASSUMED,
          "achieved fraction of HBM bandwidth by a decode step"),
    Param("peak_tflops", 989, "TFLOP/s", PUBLISHED, "H200 dense BF16 tensor peak"),
    Param("prefill_mfu", 0.4, "of peak", ASSUMED, "model FLOPs utilisation of prefill"),
    Param("step_overhead_ms", 2.0, "ms", ASSUMED,
          "per decode step beyond HBM reads: scheduling, sampling, TP all-reduces"),
    Param("post_us_per_desc", 1.73, "us", MEASURED,
          "NIXL post per descriptor: (280 - 2.68 ms) / (160,000 - 160) descriptors, "
          "docs/bench/micro, NIXL's own calls (UCX, 5b663b8); the "
          "published Llama-3.3-70B figure is (46 - 0.46 ms) / (18,880 - 118) = 2.43"),
    Param("hop_ms", 8.0, "ms", MEASURED,
          "pull's second leg: prefill's answer -> router -> decode's API server "
          "taking the 1000-token body -> decode allocating, median of 12 idle "
          "requests here (docs/critical-path.md; a CPU API server: likely less "
          "on a GPU host's faster cores)"),
    Param("push_turn_ms", 3.0, "ms", MEASURED,
          "vLLM push: the finished blocks reach its writer thread only after the "
          "next prefill step's forward (push_worker.start_load_kv runs after it); "
          "3 ms idle here (docs/critical-path.md), a whole prefill forward when "
          "another prompt is waiting"),
    Param("kvpush_setup_ms", 1.1, "ms", MEASURED,
          "kvpush: KV ready -> WRITE posted, p50 of the traces (docs/performance.md, "
          "'Where the time goes on the critical path')"),
    Param("kvpush_notify_ms", 1.4, "ms", MEASURED,
          "kvpush: WRITE done -> decode's get_finished has it, p50 of the traces "
          "(progress thread, 1 ms polls)"),
    Param("decode_step_ms", 0, "ms", DERIVED,
          "0: step_overhead + (weights + batch x context x KV per token) / TP / "
          "(HBM x efficiency); set it to override"),
    Param("prefill_ms", 0, "ms", DERIVED,
          "0: prefill FLOPs / (TP x peak x MFU); set it to override"),
)  # fmt: skip

INT_PARAMS = frozenset({"output_tokens", "decode_batch", "tp", "block_size"})
PARAMS_BY_NAME = {p.name: p for p in PARAMS}


@dataclass(frozen=True)
class Inputs:
    """One projection's inputs: a model, a prompt length, and every
    :data:`PARAMS` value (``decode_step_ms`` and ``prefill_ms`` 0 mean
    "derive it")."""

    model: ModelShape
    prompt_tokens: int
    output_tokens: int = 128
    decode_batch: int = 32
    tp: int = 4
    block_size: int = 16
    link_gbit_per_gpu: float = 400.0
    link_efficiency: float = 0.8
    hbm_tb_per_s: float = 4.8
    hbm_efficiency: float = 0.8
    peak_tflops: float = 989.0
    prefill_mfu: float = 0.4
    step_overhead_ms: float = 2.0
    post_us_per_desc: float = 1.73
    hop_ms: float = 8.0
    push_turn_ms: float = 3.0
    kvpush_setup_ms: float = 1.1
    kvpush_notify_ms: float = 1.4
    decode_step_ms: float = 0.0
    prefill_ms: float = 0.0

    def __post_init__(self) -> None:
        positive = ["prompt_tokens", "output_tokens", "decode_batch", "tp"]
        positive += ["block_size", "link_gbit_per_gpu", "hbm_tb_per_s", "peak_tflops"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{_option(name)} must be > 0")
        for name in ("link_efficiency", "hbm_efficiency", "prefill_mfu"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{_option(name)} must be in (0, 1]")
        for p in PARAMS:
            if getattr(self, p.name) < 0:
                raise ValueError(f"{p.option} must be >= 0")
        if self.model.num_kv_heads % self.tp and self.tp % self.model.num_kv_heads:
            raise ValueError(
                f"--tp {self.tp} does not divide {self.model.name}'s "
                f"{self.model.num_kv_heads} KV heads (nor they it)"
            )

    def with_prompt(self, prompt_tokens: int) -> Inputs:
        return dataclasses.replace(self, prompt_tokens=prompt_tokens)

    def overridden(self) -> list[str]:
        """Names of the parameters whose value is not the default."""
        return [p.name for p in PARAMS if getattr(self, p.name) != p.default]


def default_inputs(model: str = "qwen3-32b", prompt_tokens: int = 2048) -> Inputs:
    return Inputs(model=load_shape(model), prompt_tokens=prompt_tokens)


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")
