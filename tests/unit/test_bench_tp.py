"""``kvpush bench --prefill-tp/--decode-tp/--colocated-tp``: every P/D
configuration (kvpush and both of vLLM's baselines) gets the same TP, the
colocated one its own, bad values are refused, the report says so."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from kvpush_lab.bench.cli import add_parser, config_from_args
from kvpush_lab.bench.config import make_config
from kvpush_lab.bench.report import render_report
from kvpush_lab.bench.runner import cluster_config
from tests.unit.test_bench_report import summary


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpush")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_every_pd_configuration_runs_the_same_tp(tmp_path: Path) -> None:
    names = ("colocated", "vllm-pull", "vllm-push", "kvpush")
    argv = ["--configs", ",".join(names), "--prefill-tp", "2", "--decode-tp", "1"]
    config = config_from_args(parse(argv))
    made = {n: cluster_config(config, n, tmp_path, tmp_path / n) for n in names}
    for name in ("vllm-pull", "vllm-push", "kvpush"):
        assert (made[name].prefill_tp, made[name].decode_tp) == (2, 1), name
        assert made[name].colocated_tp == 1
    colocated = made["colocated"]
    assert (colocated.prefill_tp, colocated.decode_tp, colocated.colocated_tp) == (
        1, 1, 1,
    )  # fmt: skip


def test_the_colocated_reference_takes_its_own_tp(tmp_path: Path) -> None:
    config = make_config({"configs": ["colocated", "kvpush"], "colocated_tp": 2})
    assert (
        cluster_config(config, "colocated", tmp_path, tmp_path / "c").colocated_tp == 2
    )
    kvpush = cluster_config(config, "kvpush", tmp_path, tmp_path / "k")
    assert (kvpush.prefill_tp, kvpush.decode_tp) == (1, 1)


@pytest.mark.parametrize("name", ["prefill_tp", "decode_tp", "colocated_tp"])
@pytest.mark.parametrize("value", [0, 65])
def test_a_tp_out_of_range_is_refused_by_name(name: str, value: int) -> None:
    with pytest.raises(
        ValueError, match=rf"{name} must be between 1 and 64, not {value}"
    ):
        make_config({name: value})


def test_the_report_says_the_tp_of_every_side() -> None:
    base = summary()
    at_tp1 = render_report(base)
    assert "one core per instance" in at_tp1 and "prefill TP" not in at_tp1
    settings = {**base.settings, "prefill_tp": 2, "decode_tp": 1}
    report = render_report(msgspec.structs.replace(base, settings=settings))
    assert "prefill TP 2, decode TP 1 in every P/D configuration" in report
    assert "colocated TP 1" in report and "one core per instance" not in report


def test_every_pd_configuration_runs_the_same_dp_and_the_report_says_so(
    tmp_path: Path,
) -> None:
    names = ("colocated", "vllm-pull", "kvpush")
    config = config_from_args(parse(["--configs", ",".join(names), "--decode-dp", "2"]))
    made = {n: cluster_config(config, n, tmp_path, tmp_path / n) for n in names}
    assert [(made[n].prefill_dp, made[n].decode_dp) for n in names] == [
        (1, 1), (1, 2), (1, 2),
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"decode_dp must be in 1\.\.8, not 9"):
        make_config({"decode_dp": 9})
    base = summary()
    settings = {**base.settings, "decode_dp": 2}
    report = render_report(msgspec.structs.replace(base, settings=settings))
    assert "data parallel: prefill DP 1, decode DP 2" in report
