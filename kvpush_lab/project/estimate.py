"""The model itself: TTFT as a sum of phases, TPOT as a decode step plus
the stall that pull's posts put into it. Pure arithmetic over
:class:`~kvpush_lab.project.inputs.Inputs`; see the package docstring for the
model and ``docs/projection.md`` for where each phase comes from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpush_lab.project.inputs import Inputs

CONFIGS = ("vllm-pull", "vllm-push", "kvpush")
SCENARIOS = ("contiguous", "fragmented", "decode-prefix-hit")


@dataclass(frozen=True)
class Derived:
    """What follows from the inputs before any configuration is looked at."""

    kv_bytes_per_token: int
    num_blocks: int
    kv_bytes: int  # one transfer, all TP ranks
    kv_bytes_per_rank: int
    wire_ms: float  # one rank's shard over its share of the link; ranks in parallel
    prefill_ms: float
    decode_step_ms: float
    descriptors_contiguous: int  # per rank, the blocks in one run
    descriptors_fragmented: int  # per rank, every block its own run
    transfers_per_step: float  # new requests joining decode per step

    def post_ms(self, descriptors: int, inputs: Inputs) -> float:
        return descriptors * inputs.post_us_per_desc / 1000.0


@dataclass(frozen=True)
class Phase:
    """One stretch of the critical path between prefill's start and the
    first token; ``on_decode_loop`` if it runs inside decode's engine step
    (and so stalls every running request)."""

    label: str
    ms: float
    on_decode_loop: bool = False


@dataclass(frozen=True)
class Estimate:
    """One configuration in one scenario."""

    config: str
    phases: tuple[Phase, ...]
    decode_step_ms: float  # the step, without the stall
    stall_ms: float  # added to each decode step by posts on decode's loop
    # kvpush's router streaming prefill's first token (its default): what
    # the client waits for that token, when the request has a prefill leg
    first_from_prefill: tuple[Phase, ...] | None = None

    @property
    def ttft_ms(self) -> float:
        return sum(p.ms for p in self.phases)

    @property
    def handover_ms(self) -> float:
        """TTFT minus the prefill's compute."""
        return sum(p.ms for p in self.phases if p.label != PREFILL)

    @property
    def tpot_ms(self) -> float:
        return self.decode_step_ms + self.stall_ms

    @property
    def first_from_prefill_ms(self) -> float | None:
        """TTFT with prefill's first token, or None (no prefill leg)."""
        if self.first_from_prefill is None:
            return None
        return sum(p.ms for p in self.first_from_prefill)

    @property
    def second_token_ms(self) -> float | None:
        """With prefill's first token, early-bound: decode's first step
        computes that token again, its second samples the second token."""
        if self.first_from_prefill is None:
            return None
        return self.ttft_ms + self.decode_step_ms


@dataclass(frozen=True)
class Scenario:
    name: str
    prompt_tokens: int
    descriptors: int  # per transfer and rank
    joining_per_step: float  # requests joining decode per step (each a transfer)
    estimates: tuple[Estimate, ...]

    def get(self, config: str) -> Estimate:
        return next(e for e in self.estimates if e.config == config)

    def ttft_ratio(self, config: str) -> float:
        """Pull's TTFT over ``config``'s: above 1 means faster than pull."""
        return self.get("vllm-pull").ttft_ms / self.get(config).ttft_ms

    def tpot_ratio(self, config: str) -> float:
        return self.get("vllm-pull").tpot_ms / self.get(config).tpot_ms


PREFILL = "prefill compute"


def derive(inputs: Inputs) -> Derived:
    model = inputs.model
    num_blocks = math.ceil(inputs.prompt_tokens / inputs.block_size)
    kv_bytes = inputs.prompt_tokens * model.kv_bytes_per_token
    per_rank = kv_bytes // min(inputs.tp, model.num_kv_heads)
    bytes_per_ms = inputs.link_gbit_per_gpu * 1e9 / 8 * inputs.link_efficiency / 1e3
    return Derived(
        kv_bytes_per_token=model.kv_bytes_per_token,
        num_blocks=num_blocks,
        kv_bytes=kv_bytes,
        kv_bytes_per_rank=per_rank,
        wire_ms=per_rank / bytes_per_ms,
        prefill_ms=inputs.prefill_ms or _prefill_ms(inputs),
        decode_step_ms=inputs.decode_step_ms or _decode_step_ms(inputs),
        descriptors_contiguous=model.descriptors(1),
        descriptors_fragmented=model.descriptors(num_blocks),
        transfers_per_step=inputs.decode_batch / inputs.output_tokens,
    )


def _prefill_ms(inputs: Inputs) -> float:
    flops = inputs.model.prefill_flops(inputs.prompt_tokens)
    rate = inputs.tp * inputs.peak_tflops * 1e12 * inputs.prefill_mfu
    return flops / rate * 1e3


def _decode_step_ms(inputs: Inputs) -> float:
    """A memory-bound step: every weight and every running request's KV
    read once from HBM, split over the TP ranks, at the mean context."""
    model = inputs.model
    context = inputs.prompt_tokens + inputs.output_tokens / 2
    kv_read = inputs.decode_batch * context * model.kv_bytes_per_token
    hbm_bytes_per_ms = inputs.hbm_tb_per_s * 1e12 * inputs.hbm_efficiency / 1e3
    read_ms = (model.weight_bytes + kv_read) / inputs.tp / hbm_bytes_per_ms
    return inputs.step_overhead_ms + read_ms


def project(inputs: Inputs) -> list[Scenario]:
    """The three scenarios at ``inputs.prompt_tokens``."""
    d = derive(inputs)
    return [
        _transfer_scenario(inputs, d, "contiguous", d.descriptors_contiguous),
        _transfer_scenario(inputs, d, "fragmented", d.descriptors_fragmented),
        _prefix_hit_scenario(inputs, d),
    ]


def _transfer_scenario(inputs: Inputs, d: Derived, name: str, descs: int) -> Scenario:
    post = d.post_ms(descs, inputs)
    step = d.decode_step_ms
    stall = post * d.transfers_per_step  # pull: posts of the requests joining
    pull_step = step + stall
    prefill = Phase(PREFILL, d.prefill_ms)
    pull = Estimate(
        "vllm-pull",
        (
            prefill,
            Phase("answer -> router -> decode (second leg)", inputs.hop_ms),
            Phase("wait for decode's next step", pull_step / 2),
            Phase(f"READ post, {descs:,} descriptors", post, on_decode_loop=True),
            Phase("READ in flight, seen at a step's end", _seen(d.wire_ms, pull_step)),
            Phase("first decode step", pull_step),
        ),
        step,
        stall,
    )
    push = Estimate(
        "vllm-push",
        (
            prefill,
            Phase("finished blocks -> writer (next step's metadata)",
                  inputs.push_turn_ms),
            Phase(f"WRITE post on prefill's thread, {descs:,} descriptors", post),
            Phase("WRITE on the wire", d.wire_ms),
            # only its writer thread reads notifications, woken at a decode
            # step's end; the step after takes what it read
            Phase("notification: writer woken at a step's end, taken at the next",
                  step / 2 + step),
            Phase("first decode step", step),
        ),
        step,
        0.0,
    )  # fmt: skip
    kvpush = Estimate(
        "kvpush",
        (
            prefill,
            Phase("KV ready -> WRITE posted (measured, few descriptors)",
                  inputs.kvpush_setup_ms),
            Phase(f"WRITE post on prefill's thread, {descs:,} descriptors", post),
            Phase("WRITE on the wire", d.wire_ms),
            Phase("notification (progress thread) while decode's step runs",
                  max(inputs.kvpush_notify_ms, step / 2)),
            Phase("first decode step", step),
        ),
        step,
        0.0,
        first_from_prefill=(
            prefill,
            Phase("answer (its first token) -> router -> client", inputs.hop_ms),
        ),
    )  # fmt: skip
    estimates = (pull, push, kvpush)
    joining = d.transfers_per_step
    return Scenario(name, inputs.prompt_tokens, descs, joining, estimates)


def _prefix_hit_scenario(inputs: Inputs, d: Derived) -> Scenario:
    """Decode holds the whole prompt in its prefix cache, prefill does not:
    pull still runs the prefill leg first; vLLM push decodes at once (the
    published >= 3x case); kvpush's router skips the prefill leg
    (``--binding auto``) after one ``/tokenize`` hop."""
    step = d.decode_step_ms
    wait = Phase("wait for decode's next step", step / 2)
    first = Phase("first decode step (last prompt token)", step)
    pull = (
        Phase(PREFILL, d.prefill_ms),
        Phase("answer -> router -> decode (second leg)", inputs.hop_ms),
    )
    estimates = (
        Estimate("vllm-pull", (*pull, wait, first), step, 0.0),
        Estimate("vllm-push", (wait, first), step, 0.0),
        Estimate(
            "kvpush",
            (Phase("router -> /tokenize (binding skip)", inputs.hop_ms), wait, first),
            step,
            0.0,
        ),
    )
    joining = d.transfers_per_step
    return Scenario("decode-prefix-hit", inputs.prompt_tokens, 0, joining, estimates)


def _seen(wire_ms: float, step_ms: float) -> float:
    """A READ posted before a step's forward is seen at that step's end if
    it is done by then, else on average half a step after it is done."""
    return step_ms if wire_ms <= step_ms else wire_ms + step_ms / 2
