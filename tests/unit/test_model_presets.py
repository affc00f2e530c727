"""Model presets: the kv-heavy shape the streaming push is measured with."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpush.model.presets import PRESETS, preset, preset_dir
from kvpush.model.spec import default_model_dir


def test_kv_heavy_keeps_64_kib_of_kv_per_token_32x_the_tiny_model():
    heavy, tiny = preset("kv-heavy"), preset("tiny")
    assert heavy.kv_bytes_per_token == 64 * 1024
    assert heavy.kv_bytes_per_token == 32 * tiny.kv_bytes_per_token
    assert heavy.spec.num_layers >= 8


def test_kv_heavy_kv_space_holds_several_8k_token_prompts():
    heavy = preset("kv-heavy")
    prompt_bytes = 8192 * heavy.kv_bytes_per_token
    assert heavy.kv_cache_space_gb * 2**30 // prompt_bytes >= 8
    assert heavy.max_model_len <= heavy.spec.max_position_embeddings


def test_the_tiny_preset_is_the_default_model(tmp_path: Path):
    assert preset_dir(tmp_path, "tiny") == default_model_dir(tmp_path)
    assert PRESETS["tiny"].kv_bytes_per_token == 2048


def test_an_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="kv-heavy"):
        preset("huge")


def test_up_with_the_kv_heavy_preset_sizes_its_kv_space(monkeypatch, tmp_path: Path):
    import kvpush.model.presets as presets
    from kvpush.cli import _parser, up_config

    made: list[str] = []

    def fake_ensure(home: Path, name: str) -> Path:
        made.append(name)
        return tmp_path

    monkeypatch.setattr(presets, "ensure_preset", fake_ensure)
    args = _parser().parse_args(
        ["up", "--mode", "kvpush", "--model-preset", "kv-heavy"]
    )
    config = up_config(args)
    assert made == ["kv-heavy"]
    assert (config.model, config.kv_cache_space_gb, config.max_model_len) == (
        tmp_path,
        4,
        8192,
    )
    args = _parser().parse_args(
        ["up", "--model-preset", "kv-heavy", "--kv-cache-space-gb", "2"]
    )
    assert up_config(args).kv_cache_space_gb == 2, "a flag wins over the preset"


def test_up_with_the_gdn_preset_serves_it_in_bfloat16(monkeypatch, tmp_path: Path):
    """vLLM's CPU build runs gated delta net in bfloat16 only."""
    import kvpush.model.presets as presets
    from kvpush.cli import _parser, up_config

    monkeypatch.setattr(presets, "ensure_preset", lambda home, name: tmp_path)
    argv = ["up", "--mode", "kvpush", "--model-preset", "gdn", "--platform", "cpu"]
    assert up_config(_parser().parse_args(argv)).dtype == "bfloat16"
    tiny = ["up", "--model-preset", "tiny", "--platform", "cpu"]
    assert up_config(_parser().parse_args(tiny)).dtype == "float32"
    given = [*argv, "--dtype", "float32"]
    assert up_config(_parser().parse_args(given)).dtype == "float32", "a flag wins"
