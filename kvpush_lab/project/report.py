"""What the command prints, as plain data: the assumptions list, the
quantities derived per prompt length, and the JSON document (``--json``).
:mod:`kvpush_lab.project.render` draws the same data with rich."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpush_lab.project.compare import Comparison, explanations
from kvpush_lab.project.estimate import CONFIGS, Derived, Scenario, derive
from kvpush_lab.project.inputs import DERIVED, PARAMS, PUBLISHED, Inputs

LABEL = (
    "MODEL, NOT A MEASUREMENT: a projection from per-phase costs measured on a "
    "CPU machine and published hardware figures; nothing here ran on an H200"
)
SCHEMA = 1


@dataclass(frozen=True)
class Assumption:
    name: str
    value: str
    source: str
    basis: str


def assumptions(inputs: Inputs) -> list[Assumption]:
    """Every input with its value and basis, the model's shape first."""
    m = inputs.model
    kv = (
        f"2 x {m.num_layers} layers x {m.num_kv_heads} KV heads x {m.head_dim} "
        f"x {m.element_bytes} B ({m.dtype})"
    )
    rows = [
        Assumption("model", m.name, PUBLISHED, "its Hugging Face config.json"),
        Assumption("kv_bytes_per_token", f"{m.kv_bytes_per_token:,} B", DERIVED, kv),
        Assumption(
            "weights",
            f"{m.num_params / 1e9:.1f} B params, {m.weight_bytes / 1e9:.1f} GB",
            DERIVED,
            "attention + gated MLP per layer + embeddings, from the config",
        ),
    ]
    overridden = set(inputs.overridden())
    for p in PARAMS:
        value = getattr(inputs, p.name)
        if p.source == DERIVED and not value:
            continue  # listed with the derived quantities
        source = "set on the command line" if p.name in overridden else p.source
        rows.append(Assumption(p.name, f"{value:g} {p.unit}", source, p.basis))
    return rows


def derived_rows(inputs_by_prompt: list[Inputs]) -> list[dict[str, Any]]:
    """The quantities that follow from the inputs, one row per prompt length."""
    rows = []
    for inputs in inputs_by_prompt:
        d = derive(inputs)
        rows.append({"prompt_tokens": inputs.prompt_tokens, **_derived_dict(d)})
    return rows


def _derived_dict(d: Derived) -> dict[str, Any]:
    return {
        "kv_mib": d.kv_bytes / 2**20,
        "kv_mib_per_rank": d.kv_bytes_per_rank / 2**20,
        "blocks": d.num_blocks,
        "wire_ms": d.wire_ms,
        "prefill_ms": d.prefill_ms,
        "decode_step_ms": d.decode_step_ms,
        "descriptors_contiguous": d.descriptors_contiguous,
        "descriptors_fragmented": d.descriptors_fragmented,
        "transfers_per_step": d.transfers_per_step,
    }


def to_json(
    inputs: Inputs,
    prompts: list[int],
    scenarios: list[Scenario],
    comparisons: list[Comparison],
) -> dict[str, Any]:
    """The whole projection as one JSON-ready document."""
    return {
        "schema": SCHEMA,
        "label": LABEL,
        "model": inputs.model.name,
        "prompt_tokens": prompts,
        "assumptions": [a.__dict__ for a in assumptions(inputs)],
        "derived": derived_rows([inputs.with_prompt(n) for n in prompts]),
        "scenarios": [_scenario_json(s) for s in scenarios],
        "comparisons": [_comparison_json(c) for c in comparisons],
        "explanations": explanations(comparisons),
    }


def _scenario_json(s: Scenario) -> dict[str, Any]:
    configs = {}
    for e in s.estimates:
        configs[e.config] = {
            "ttft_ms": e.ttft_ms,
            "handover_ms": e.handover_ms,
            "tpot_ms": e.tpot_ms,
            "stall_ms_per_step": e.stall_ms,
            "phases": [
                {"label": p.label, "ms": p.ms, "on_decode_loop": p.on_decode_loop}
                for p in e.phases
            ],
        }
        if e.first_from_prefill is not None:
            configs[e.config]["first_token_from_prefill"] = {
                "ttft_ms": e.first_from_prefill_ms,
                "second_token_ms": e.second_token_ms,
            }
    return {
        "scenario": s.name,
        "prompt_tokens": s.prompt_tokens,
        "descriptors": s.descriptors,
        "joining_per_step": s.joining_per_step,
        "configs": configs,
        "ttft_pull_over": {c: s.ttft_ratio(c) for c in CONFIGS},
        "tpot_pull_over": {c: s.tpot_ratio(c) for c in CONFIGS},
    }


def _comparison_json(c: Comparison) -> dict[str, Any]:
    return {
        "claim": c.claim.name,
        "source": c.claim.source,
        "scenario": c.claim.scenario,
        "metric": c.claim.metric,
        "published": c.claim.range_text,
        "prompt_tokens": c.prompt_tokens,
        "model_vllm_push": c.push_ratio,
        "model_kvpush": c.kvpush_ratio,
        "verdict": c.verdict,
        "why": c.why,
    }
