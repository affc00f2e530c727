"""``kvpush bench --hosts netns --link-gbit ...``: settings, validation
errors that say what to change, config-file keys, and the clusters the
benchmark plans (one set per link rate, the rate passed to the launcher)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kvpush.model import ModelSpec
from kvpush_lab.bench import runner
from kvpush_lab.bench.cli import add_parser, command_line, config_from_args
from kvpush_lab.bench.config import BenchConfig, load_config_file, make_config
from kvpush_lab.bench.inputs import model_dir_name, model_spec


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpush")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_link_rates_are_a_list_on_the_rehearsal_only() -> None:
    config = config_from_args(parse(["--hosts", "netns", "--link-gbit", "1,4,10"]))
    assert config.hosts == "netns" and config.link_gbit == (1.0, 4.0, 10.0)
    assert config.link_rates == (1.0, 4.0, 10.0)
    assert BenchConfig(hosts="netns").link_rates == (None,)  # unshaped links
    assert BenchConfig().link_rates == (None,)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"link_gbit": (4.0,)}, "add --hosts netns"),
        ({"hosts": "vm"}, "hosts must be one of local, netns"),
        ({"hosts": "netns", "link_gbit": (0.0,)}, r"in \(0, 100\] Gbit/s"),
        ({"hosts": "netns", "link_gbit": (400.0,)}, r"in \(0, 100\] Gbit/s"),
        ({"hosts": "netns", "link_gbit": (4.0, 4.0)}, "a rate twice"),
        ({"model": Path("/m"), "model_head_dim": 128}, "not both"),
        ({"model_head_dim": 0}, "model_head_dim must be >= 1"),
    ],
)
def test_bad_rehearsal_settings_say_what_to_change(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        BenchConfig(**values)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("bench.toml", 'hosts = "netns"\nlink_gbit = [1, 4]\n'),
        ("bench.json", '{"hosts": "netns", "link_gbit": [1, 4]}'),
    ],
)
def test_config_files_name_hosts_and_link_rates(
    tmp_path: Path, name: str, text: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    config = make_config(load_config_file(path))
    assert config.hosts == "netns" and config.link_gbit == (1.0, 4.0)


def test_one_rate_may_be_a_plain_number() -> None:
    assert make_config({"hosts": "netns", "link_gbit": 4}).link_gbit == (4.0,)


def test_the_recorded_command_repeats_the_rehearsal_flags() -> None:
    args = parse(["--hosts", "netns", "--link-gbit", "1,4", "--model-head-dim", "128"])
    assert command_line(args) == (
        "kvpush bench --model-head-dim 128 --hosts netns --link-gbit 1,4"
    )


def test_a_kv_heavy_model_is_named_by_its_head_size_too() -> None:
    config = BenchConfig(model_layers=8, model_kv_heads=8, model_head_dim=128)
    spec = model_spec(config)
    assert spec is not None
    assert (spec.num_layers, spec.num_kv_heads, spec.num_heads, spec.head_dim) == (
        8, 8, 8, 128,
    )  # fmt: skip
    assert model_dir_name(spec) == "tiny-qwen3-l8-h256-kv8-d128"
    # sizes made before head_dim was an option keep their directory
    assert model_dir_name(ModelSpec(num_layers=4)) == "tiny-qwen3-l4-h256-kv2"


def test_each_link_rate_gets_a_fresh_set_of_clusters(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({
            "num_hidden_layers": 8, "num_attention_heads": 8,
            "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 256,
        })
    )  # fmt: skip
    monkeypatch.setattr(runner, "resolve_model", lambda config, console: model)
    monkeypatch.setattr(runner, "normal_token_ids", lambda path: list(range(3, 500)))
    config = BenchConfig(
        configs=("colocated", "kvpush"),
        hosts="netns",
        link_gbit=(1.0, 4.0),
        qps=(1.0,),
        output_dir=tmp_path / "out",
    )
    plan = runner.prepare(config, Console(quiet=True))
    assert [(r.name, r.link_gbit) for r in plan.runs] == [
        ("colocated", 1.0), ("kvpush", 1.0), ("colocated", 4.0), ("kvpush", 4.0),
    ]  # fmt: skip
    assert len({r.run_dir for r in plan.runs}) == 4
    assert plan.runs[1].run_dir == tmp_path / "out" / "clusters" / "kvpush-1gbit"
    for run in plan.runs:
        assert run.cluster.hosts == "netns" and run.cluster.link_gbit == run.link_gbit
        assert run.cluster.mode == run.name
    assert plan.kv_bytes_per_token == 64 * 1024  # 2 x 8 layers x 8 x 128 x 4 B
