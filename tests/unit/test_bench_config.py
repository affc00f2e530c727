"""BenchConfig validation, layering (preset < file < flags) and the CLI."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from kvpush_lab.bench.cli import add_parser, command_line, config_from_args
from kvpush_lab.bench.config import BenchConfig, load_config_file, make_config, preset


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpush")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_defaults_compare_the_three_baselines_on_a_qps_sweep() -> None:
    config = BenchConfig()
    assert config.configs == ("colocated", "vllm-pull", "vllm-push", "kvpush")
    assert config.sweep_axis == "qps" and config.loads == (1.0, 2.0, 4.0, 8.0)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"configs": ()}, "configs must name"),
        ({"configs": ("colocated", "pull")}, "unknown configs"),
        ({"configs": ("colocated", "colocated")}, "twice"),
        ({"arrival": "burst"}, "arrival must be one of"),
        ({"qps": (1.0, 0.0)}, "qps must be > 0"),
        ({"qps": ()}, "at least one value for qps"),
        ({"arrival": "concurrency", "concurrency": (2.5,)}, "whole numbers"),
        ({"prompt_len_sweep": (128,), "qps": (1.0, 2.0)}, "single qps"),
        ({"prompt_len": "4000", "output_len": "200"}, "max_model_len"),
        ({"prompt_len": "lots"}, "is not 'N'"),
        ({"num_requests": 0}, "num_requests"),
        ({"num_warmup": 0}, "handshake"),
        ({"shared_prefix_fraction": 1.0}, r"\[0, 1\)"),
        ({"model": Path("/m"), "model_layers": 4}, "not both"),
    ],
)
def test_bad_settings_say_what_to_change(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BenchConfig(**values)


def test_layers_override_in_order_and_convert_values() -> None:
    config = make_config(
        preset("quick"),
        {"qps": [1, 2], "num_requests": 3},
        {"qps": "5,6", "model": "~/m", "configs": "colocated, vllm-push"},
    )
    assert config.qps == (5.0, 6.0) and config.num_requests == 3
    assert config.prompt_len == "256"  # from the preset
    assert config.model == Path("~/m").expanduser()
    assert config.configs == ("colocated", "vllm-push")


def test_unknown_keys_and_bad_values_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"unknown bench settings.*'qsp'"):
        make_config({"qsp": [1]})
    with pytest.raises(ValueError, match=r"concurrency=.*whole number"):
        make_config({"arrival": "concurrency", "concurrency": "1.5"})
    with pytest.raises(ValueError, match="unknown preset"):
        preset("huge")


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("bench.toml", 'configs = ["colocated"]\nqps = [3.0]\nprompt_len = "64"\n'),
        ("bench.json", '{"configs": ["colocated"], "qps": [3], "prompt_len": 64}'),
    ],
)
def test_config_files_in_toml_or_json(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    config = make_config(load_config_file(path))
    assert config.configs == ("colocated",) and config.qps == (3.0,)
    assert config.prompt_len == "64"


def test_a_config_file_must_be_a_table(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="table/object"):
        load_config_file(path)


def test_flags_win_over_the_file_and_the_preset(tmp_path: Path) -> None:
    path = tmp_path / "bench.toml"
    path.write_text('num_requests = 9\nseed = 4\nprompt_len = "100"\n')
    args = parse(
        ["--quick", "--config", str(path), "--num-requests", "2", "--qps", "1,3"]
    )
    config = config_from_args(args)
    assert config.num_requests == 2 and config.seed == 4  # flag, then file
    assert config.qps == (1.0, 3.0) and config.prompt_len == "100"
    assert config.output_len == "8"  # the quick preset


def test_the_recorded_command_repeats_the_flags_but_not_the_output_dir() -> None:
    args = parse(
        ["--quick", "--configs", "colocated", "--output", "/tmp/x", "--publish"]
    )
    assert command_line(args) == (
        "kvpush bench --preset quick --configs colocated --publish"
    )
