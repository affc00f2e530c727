"""The router's topology file: its format and the errors it is refused with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpush.router.dispatch import _decode_leg
from kvpush.topology import Backend, Topology, dump_topology, load_topology

PREFILL = {
    "role": "prefill",
    "url": "http://10.250.0.1:8100",
    "engine_id": "prefill-a",
    "side_channel_host": "10.250.0.1",
    "side_channel_port": 5600,
}
DECODE = {"role": "decode", "url": "http://10.250.0.2:8100", "engine_id": "decode-b"}


def _write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "topology.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_a_two_host_file_loads_as_written(tmp_path: Path) -> None:
    path = _write(tmp_path, {"mode": "kvpush", "backends": [PREFILL, DECODE]})
    topo = load_topology(path)
    assert topo.prefills == (Backend(**PREFILL),)
    assert topo.decodes[0].url == "http://10.250.0.2:8100"
    again = tmp_path / "again.json"
    dump_topology(topo, again)
    assert load_topology(again) == topo


def test_a_prefills_tp_size_reaches_decodes_leg(tmp_path: Path) -> None:
    prefill = {**PREFILL, "tp_size": 2}
    path = _write(tmp_path, {"mode": "kvpush", "backends": [prefill, DECODE]})
    (backend,) = load_topology(path).prefills
    assert backend.tp_size == 2 and Backend(**DECODE).tp_size == 1
    leg = _decode_leg("t1", backend)  # rank r listens on 5600 + r
    assert (leg.prefill_port, leg.prefill_tp) == (5600, 2)
    assert leg.to_dict()["prefill_tp"] == 2


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("{", "truncated"),
        ({"mode": "kvpush"}, "missing required field `backends`"),
        ({"mode": "push", "backends": [PREFILL, DECODE]}, r"\$.mode"),
        (
            {
                "mode": "kvpush",
                "backends": [{**PREFILL, "sidechannel_port": 1}, DECODE],
            },
            r"unknown field `sidechannel_port`.*\$.backends\[0\]",
        ),
        (
            {"mode": "kvpush", "backends": [PREFILL, {**DECODE, "role": "decoder"}]},
            r"\$.backends\[1\].role",
        ),
        ({"mode": "kvpush", "backends": [DECODE]}, "at least one prefill"),
        (
            {
                "mode": "kvpush",
                "backends": [PREFILL, {**DECODE, "engine_id": "prefill-a"}],
            },
            "unique",
        ),
        (
            {
                "mode": "kvpush",
                "backends": [PREFILL, {**DECODE, "url": "10.250.0.2:8100"}],
            },
            r"backends\[1\] \('decode-b'\): url .* must start with http://",
        ),
        (
            {
                "mode": "kvpush",
                "backends": [PREFILL, {**DECODE, "url": "http://h:port"}],
            },
            "bad port",
        ),
        (
            {
                "mode": "kvpush",
                "backends": [{**PREFILL, "side_channel_host": "0.0.0.0"}, DECODE],
            },
            "bind addresses",
        ),
        (
            {
                "mode": "kvpush",
                "backends": [{**PREFILL, "side_channel_port": 70000}, DECODE],
            },
            "side_channel_port must be in 1..65535",
        ),
        (
            {"mode": "kvpush", "backends": [{**PREFILL, "tp_size": 0}, DECODE]},
            r"\$.backends\[0\].tp_size",
        ),
    ],
)
def test_bad_files_are_refused_naming_the_file_and_field(
    tmp_path: Path, data: Any, message: str
) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(ValueError, match=message) as info:
        load_topology(path)
    assert str(path) in str(info.value)


def test_a_prefill_without_side_channel_warns_where_decode_needs_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prefill = {k: v for k, v in PREFILL.items() if not k.startswith("side")}
    path = _write(tmp_path, {"mode": "vllm-pull", "backends": [prefill, DECODE]})
    assert load_topology(path).prefills[0].side_channel_port == 0
    assert not caplog.records
    path = _write(tmp_path, {"mode": "kvpush", "backends": [prefill, DECODE]})
    load_topology(path)
    assert "prefill(s) prefill-a have no side_channel_port" in caplog.text


def test_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read topology file"):
        load_topology(tmp_path / "none.json")


def test_topology_objects_are_validated_too() -> None:
    with pytest.raises(ValueError, match="unique"):
        Topology(
            mode="vllm-pull",
            backends=(Backend(**PREFILL), Backend(**PREFILL), Backend(**DECODE)),
        ).validate()
