"""The named workloads' own defaults and checks (``--workload``).

- ``sweep`` (default): the load sweep as given;
- ``skewed``: the sweep with one decode kept busy by long plain requests;
- ``multi-turn``: conversations whose turns extend each other;
- ``fragmented``: two points of long prompts, on a fresh KV cache and again
  after a churn that scatters decode's free blocks (many concurrent
  requests of mixed lengths, some aborted by the client mid-decode), while
  plain requests decode on decode meanwhile (:mod:`kvpush_lab.bench.churn`);
- ``saturation``: decode-bound load to past saturation: 1k-token prompts,
  256 output tokens, Poisson arrivals at rising rates, with goodput against
  a TTFT and TPOT SLO (:mod:`kvpush_lab.bench.goodput`).

:func:`workload_defaults` gives what a workload sets unless a layer (preset,
file, flag) gave it; the checks raise ``ValueError`` saying what to change.
Pure.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvpush_lab.bench.lengths import LengthSpec

WORKLOADS = ("sweep", "skewed", "multi-turn", "fragmented", "saturation")
BACKGROUND_WORKLOADS = ("skewed", "fragmented")  # with plain requests on a decode
SHARED_CLUSTER_WORKLOADS = ("skewed", "multi-turn")  # kvpush configs share one
CPU_MIN_BLOCK = 32  # the CPU attention backend's block sizes are multiples of 32

# Applied before the layers (explicit values win). fragmented: the smallest
# block the CPU backend takes, the KV-heavy model and 4k-token prompts one at
# a time (KV space 2 GB: 1024 blocks of 32 tokens of kv-heavy, so the fresh
# point never wraps the free list while the churn wraps it about twice).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "fragmented": {
        "block_size": CPU_MIN_BLOCK,
        "model_preset": "kv-heavy",
        "kv_cache_space_gb": 2,
        "prompt_len": "4000",
        "output_len": "32",
        "arrival": "concurrency",
        "concurrency": (1,),
        "num_requests": 4,
        "num_warmup": 2,
    },
    # decode-bound: long outputs; the rates go past where decode saturates
    "saturation": {
        "prompt_len": "1000",
        "output_len": "256",
        "arrival": "poisson",
        "qps": (2.0, 4.0, 8.0, 12.0, 16.0),
        "num_requests": 40,
    },
}
_MODEL_KEYS = ("model", "model_layers", "model_hidden_size", "model_kv_heads")


class WorkloadSettings(Protocol):
    """What the checks read of the settings: a ``BenchConfig`` (``config.py``
    calls them and imports this module, not the reverse)."""

    @property
    def workload(self) -> str: ...
    @property
    def block_size(self) -> int | None: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def num_decode(self) -> int: ...
    @property
    def output_spec(self) -> LengthSpec: ...
    @property
    def prompt_len_sweep(self) -> tuple[int, ...]: ...
    @property
    def arrival_key(self) -> str: ...
    @property
    def loads(self) -> tuple[float, ...]: ...
    @property
    def slo_ttft_ms(self) -> float: ...
    @property
    def slo_tpot_ms(self) -> float: ...
    @property
    def background_decode(self) -> int: ...
    @property
    def background_concurrency(self) -> int: ...
    @property
    def background_prompt_len(self) -> int: ...
    @property
    def background_output_len(self) -> int: ...
    @property
    def num_conversations(self) -> int: ...
    @property
    def conversation_concurrency(self) -> int: ...
    @property
    def history_len(self) -> int: ...
    @property
    def num_turns(self) -> int: ...
    @property
    def turn_len(self) -> int: ...
    @property
    def churn_requests(self) -> int: ...
    @property
    def churn_concurrency(self) -> int: ...
    @property
    def churn_abort_fraction(self) -> float: ...
    @property
    def churn_prompt_len(self) -> str: ...
    @property
    def churn_output_len(self) -> str: ...


def workload_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """What the chosen workload sets beneath ``values`` (the merged layers):
    its defaults that no layer gave (no model preset where a model or model
    size was given)."""
    defaults = dict(_DEFAULTS.get(str(values.get("workload", "sweep")), {}))
    if any(values.get(k) is not None for k in _MODEL_KEYS):
        defaults.pop("model_preset", None)
    return {k: v for k, v in defaults.items() if k not in values}


def check_workload(c: WorkloadSettings) -> None:
    """The chosen workload's own settings."""
    _require(
        c.workload in WORKLOADS,
        f"workload must be one of {', '.join(WORKLOADS)}, not {c.workload!r}",
    )
    _require(
        c.block_size is None or c.block_size >= 1,
        "block_size must be >= 1 (the CPU backend: a multiple of 32), or unset",
    )
    if c.workload in BACKGROUND_WORKLOADS:
        check_background(c)
    if c.workload == "multi-turn":
        check_conversations(c)
    if c.workload == "fragmented":
        check_churn(c)
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        _require(getattr(c, name) > 0, f"{name} must be positive")


def check_background(c: WorkloadSettings) -> None:
    """The plain requests kept in flight on one decode."""
    _require(
        c.workload != "skewed" or c.num_decode >= 2,
        "the skewed workload keeps one decode busy and needs another: "
        "give --decode 2 or more",
    )
    _require(
        0 <= c.background_decode < c.num_decode,
        f"background_decode must name a decode, 0..{c.num_decode - 1}",
    )
    for name in ("background_concurrency", "background_prompt_len"):
        _require(getattr(c, name) >= 1, f"{name} must be at least 1")
    _require(c.background_output_len >= 2, "background_output_len must be >= 2")
    _require(
        c.background_prompt_len + c.background_output_len <= c.max_model_len,
        "background_prompt_len + background_output_len exceed max_model_len",
    )


def check_conversations(c: WorkloadSettings) -> None:
    """The multi-turn workload's conversations fit the model length."""
    for name in ("num_conversations", "conversation_concurrency", "history_len"):
        _require(getattr(c, name) >= 1, f"{name} must be at least 1")
    _require(c.num_turns >= 2, "num_turns must be at least 2 (turn 2+)")
    _require(c.turn_len >= 1, "turn_len must be at least 1")
    _require(
        c.output_spec.max_value is not None,
        "the multi-turn workload needs output_len N or A-B, not a trace",
    )
    longest_answer = c.output_spec.max_value or 0
    longest = c.history_len + (c.num_turns - 1) * (longest_answer + c.turn_len)
    _require(
        longest + longest_answer <= c.max_model_len,
        f"the last turn's prompt ({longest} tokens) + output exceed "
        f"max_model_len {c.max_model_len}; lower history_len, turn_len "
        "or num_turns, or raise max_model_len",
    )


def check_churn(c: WorkloadSettings) -> None:
    """The fragmented workload's churn and measured points."""
    for name in ("churn_requests", "churn_concurrency"):
        _require(getattr(c, name) >= 1, f"{name} must be at least 1")
    _require(
        0.0 <= c.churn_abort_fraction <= 1.0, "churn_abort_fraction must be in 0..1"
    )
    prompt, output = _spec(c.churn_prompt_len), _spec(c.churn_output_len)
    for name, spec in (("churn_prompt_len", prompt), ("churn_output_len", output)):
        _require(
            spec.max_value is not None,
            f"{name} must be N or A-B, not a trace",
        )
    longest = (prompt.max_value or 0) + (output.max_value or 0)
    _require(
        longest <= c.max_model_len,
        f"churn_prompt_len + churn_output_len ({longest}) exceed max_model_len "
        f"{c.max_model_len}",
    )
    _require(not c.prompt_len_sweep, "the fragmented workload has its own two points")
    _require(len(c.loads) == 1, f"the fragmented workload runs at one {c.arrival_key}")


def _spec(text: str) -> LengthSpec:
    return LengthSpec.parse(text)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
