"""The projection's model says what docs/projection.md says it does: KV
bytes from a config, pull alone stalls decode's steps by its posts (more
descriptors, more stall; none for either push), every input is printed
with its source, and the JSON has the documented shape."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvpush.cli import main
from kvpush.model.kv_size import kv_bytes_per_token
from kvpush_lab.project.compare import CLAIMS, compare
from kvpush_lab.project.estimate import (
    CONFIGS,
    PREFILL,
    SCENARIOS,
    Scenario,
    derive,
    project,
)
from kvpush_lab.project.inputs import PARAMS, Inputs, default_inputs
from kvpush_lab.project.report import LABEL, assumptions, to_json
from kvpush_lab.project.shape import BUILTIN_CONFIGS, ModelShape, load_shape


def test_kv_bytes_per_token_of_both_published_models() -> None:
    assert load_shape("qwen3-32b").kv_bytes_per_token == 2 * 64 * 8 * 128 * 2
    assert load_shape("qwen3-32b").kv_bytes_per_token == 256 * 1024
    assert load_shape("llama-3.3-70b").kv_bytes_per_token == 2 * 80 * 8 * 128 * 2


@pytest.mark.parametrize("name", sorted(BUILTIN_CONFIGS))
def test_kv_bytes_agree_with_the_launcher_s_reading_of_config_json(
    name: str, tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(BUILTIN_CONFIGS[name]))
    from_dir = load_shape(str(tmp_path))
    assert from_dir.kv_bytes_per_token == load_shape(name).kv_bytes_per_token
    assert from_dir.kv_bytes_per_token == kv_bytes_per_token(tmp_path, "bfloat16")


def test_parameter_counts_match_the_published_model_sizes() -> None:
    assert load_shape("qwen3-32b").num_params == pytest.approx(32.8e9, rel=0.01)
    assert load_shape("llama-3.3-70b").num_params == pytest.approx(70.6e9, rel=0.01)


def test_fragmented_descriptors_reproduce_the_published_llama_count() -> None:
    llama = load_shape("llama-3.3-70b")
    assert llama.descriptors(118) == 18_880  # 118 blocks x 80 layers x K and V
    d = derive(default_inputs("llama-3.3-70b", prompt_tokens=118 * 16))
    assert d.descriptors_fragmented == 18_880
    assert d.descriptors_contiguous == 160


def test_head_dim_and_kv_heads_default_like_hugging_face() -> None:
    config = {
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "vocab_size": 1000,
        "torch_dtype": "float32",
    }
    shape = ModelShape.from_hf_config("tiny", config)
    assert (shape.num_kv_heads, shape.head_dim) == (4, 64)
    assert shape.kv_bytes_per_token == 2 * 2 * 4 * 64 * 4


def test_bad_inputs_say_which_option_to_change() -> None:
    with pytest.raises(ValueError, match="--link-efficiency"):
        dataclasses.replace(default_inputs(), link_efficiency=1.5)
    with pytest.raises(ValueError, match="--tp 3"):
        dataclasses.replace(default_inputs(), tp=3)
    with pytest.raises(ValueError, match="not a built-in model"):
        load_shape("/nonexistent/model")


def test_inputs_defaults_are_the_params_defaults() -> None:
    inputs = default_inputs()
    for p in PARAMS:
        assert getattr(inputs, p.name) == p.default, p.name
    assert inputs.overridden() == []


def _fragmented(inputs: Inputs) -> Scenario:
    return next(s for s in project(inputs) if s.name == "fragmented")


@pytest.mark.parametrize("prompt_tokens", [512, 2048, 8192])
def test_more_descriptors_stall_pull_s_decode_more_and_push_s_not_at_all(
    prompt_tokens: int,
) -> None:
    short = _fragmented(default_inputs(prompt_tokens=prompt_tokens))
    long = _fragmented(default_inputs(prompt_tokens=prompt_tokens * 2))
    assert long.descriptors > short.descriptors
    assert long.get("vllm-pull").stall_ms > short.get("vllm-pull").stall_ms > 0
    for s in (short, long):
        for config in ("vllm-push", "kvpush"):
            assert s.get(config).stall_ms == 0
            assert s.get(config).tpot_ms == s.get(config).decode_step_ms


def test_a_slower_post_raises_pull_s_tpot_only() -> None:
    base = default_inputs()
    slow = dataclasses.replace(base, post_us_per_desc=base.post_us_per_desc * 2)
    before, after = _fragmented(base), _fragmented(slow)
    assert after.get("vllm-pull").tpot_ms > before.get("vllm-pull").tpot_ms
    assert after.get("kvpush").tpot_ms == before.get("kvpush").tpot_ms
    assert after.tpot_ratio("kvpush") > before.tpot_ratio("kvpush") > 1


def test_stall_is_post_times_requests_joining_per_step() -> None:
    inputs = default_inputs()
    s = _fragmented(inputs)
    post_ms = s.descriptors * inputs.post_us_per_desc / 1000
    joining = inputs.decode_batch / inputs.output_tokens
    assert s.get("vllm-pull").stall_ms == pytest.approx(post_ms * joining)


def test_ttft_is_the_sum_of_its_phases_and_prefill_is_common() -> None:
    for s in project(default_inputs()):
        for e in s.estimates:
            assert e.ttft_ms == pytest.approx(sum(p.ms for p in e.phases))
        pull = s.get("vllm-pull")
        assert pull.ttft_ms - pull.handover_ms == pytest.approx(
            derive(default_inputs()).prefill_ms
        )
        assert s.ttft_ratio("vllm-pull") == 1


def test_only_pull_posts_inside_decode_s_loop() -> None:
    for s in project(default_inputs()):
        for e in s.estimates:
            on_loop = [p for p in e.phases if p.on_decode_loop]
            assert bool(on_loop) == (e.config == "vllm-pull" and s.descriptors > 0)


def test_decode_holding_the_prompt_removes_the_prefill_from_push_only() -> None:
    s = next(s for s in project(default_inputs()) if s.name == "decode-prefix-hit")
    assert s.get("vllm-push").ttft_ms < derive(default_inputs()).prefill_ms
    assert s.ttft_ratio("vllm-push") > 3


def test_vllm_push_waits_a_step_more_than_kvpush_for_its_notification() -> None:
    # docs/critical-path.md: vLLM push's notification is read by its writer
    # thread, woken at a decode step's end, and taken at the next step's end
    # (1.5 steps on average); kvpush's progress thread has it within the step
    # decode is running (half a step), so a longer step widens the gap by
    # exactly one step.
    def gap(step_ms: float) -> float:
        inputs = dataclasses.replace(default_inputs(), decode_step_ms=step_ms)
        s = next(s for s in project(inputs) if s.name == "contiguous")
        return s.get("vllm-push").ttft_ms - s.get("kvpush").ttft_ms

    assert gap(30.0) - gap(20.0) == pytest.approx(10.0)


def test_prefills_first_token_waits_for_prefill_and_one_hop_only() -> None:
    for s in project(default_inputs()):
        kvpush = s.get("kvpush")
        if s.name == "decode-prefix-hit":  # skipped: no prefill leg
            assert kvpush.first_from_prefill_ms is None
            continue
        prefill = next(p.ms for p in kvpush.phases if p.label == PREFILL)
        assert kvpush.first_from_prefill_ms == prefill + default_inputs().hop_ms
        assert kvpush.second_token_ms == kvpush.ttft_ms + kvpush.decode_step_ms
        assert kvpush.first_from_prefill_ms < s.get("vllm-pull").ttft_ms


def test_overrides_replace_the_derived_step_and_prefill() -> None:
    inputs = dataclasses.replace(default_inputs(), decode_step_ms=20, prefill_ms=300)
    d = derive(inputs)
    assert (d.decode_step_ms, d.prefill_ms) == (20, 300)
    assert set(inputs.overridden()) == {"decode_step_ms", "prefill_ms"}


def test_every_input_is_printed_with_its_source() -> None:
    inputs = dataclasses.replace(default_inputs(), tp=8)
    rows = {a.name: a for a in assumptions(inputs)}
    for p in PARAMS:
        if p.name not in ("decode_step_ms", "prefill_ms"):  # derived when 0
            assert p.name in rows
    assert rows["tp"].source == "set on the command line"
    assert rows["post_us_per_desc"].source == "measured here"
    assert rows["kv_bytes_per_token"].value == "262,144 B"


def test_every_claim_is_compared_at_every_prompt_length() -> None:
    scenarios = [
        s for n in (1024, 4096) for s in project(default_inputs(prompt_tokens=n))
    ]
    comparisons = compare(scenarios)
    assert len(comparisons) == len(CLAIMS) * 2
    assert {c.verdict for c in comparisons} <= {"inside", "below", "above"}


def test_json_output_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["project", "--json", "--prompt-tokens", "1024,8192", "--tp", "8"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["label"] == LABEL and "NOT A MEASUREMENT" in doc["label"]
    assert doc["prompt_tokens"] == [1024, 8192]
    assert [r["prompt_tokens"] for r in doc["derived"]] == [1024, 8192]
    assert {(s["scenario"], s["prompt_tokens"]) for s in doc["scenarios"]} == {
        (name, n) for name in SCENARIOS for n in (1024, 8192)
    }
    for s in doc["scenarios"]:
        assert set(s["configs"]) == set(CONFIGS)
        for c in s["configs"].values():
            assert {
                "ttft_ms",
                "handover_ms",
                "tpot_ms",
                "stall_ms_per_step",
                "phases",
            } <= set(c)
        assert s["ttft_pull_over"]["vllm-pull"] == 1
    tp = next(a for a in doc["assumptions"] if a["name"] == "tp")
    assert tp == {**tp, "value": "8 GPUs", "source": "set on the command line"}
    assert len(doc["comparisons"]) == len(CLAIMS) * 2
    assert doc["comparisons"][0].keys() >= {"claim", "published", "verdict", "why"}
    assert (
        to_json(default_inputs(), [2048], project(default_inputs()), [])["schema"] == 1
    )


def test_rich_output_carries_the_label_the_table_and_the_assumptions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["project", "--breakdown"]) == 0
    out = capsys.readouterr().out
    for text in ("NOT A MEASUREMENT", "Projected TTFT and TPOT", "Assumptions",
                 "post_us_per_desc", "measured here", "Against the published",
                 "Critical path, fragmented"):  # fmt: skip
        assert text in out


def test_bad_prompt_lengths_are_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["project", "--prompt-tokens", "2k"]) == 2
    assert "--prompt-tokens" in capsys.readouterr().err
