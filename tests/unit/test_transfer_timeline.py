"""Per-transfer timelines: named events only, first mark wins, durations
derive from the marks, and JSONL round-trips and merges both sides' records."""

from __future__ import annotations

import pytest

from kvpush.transfer.timeline import (
    DURATIONS,
    EVENTS,
    Timeline,
    dumps_jsonl,
    loads_jsonl,
    merge,
)


def _full() -> Timeline:
    t = Timeline("t1")
    for i, event in enumerate(EVENTS):
        t.mark(event, 100.0 + i * 0.5)
    return t


def test_the_events_in_order() -> None:
    assert EVENTS == (
        "reg_sent",
        "recv_expected",
        "reg_received",
        "kv_ready",
        "write_posted",
        "write_done",
        "notif_received",
        "first_decode_step",
        "write_ended",
    )


def test_mark_refuses_unknown_names_and_keeps_the_first_time() -> None:
    t = Timeline("t1")
    with pytest.raises(ValueError, match="unknown timeline event 'kv_readdy'"):
        t.mark("kv_readdy", 1.0)
    assert t.mark("kv_ready", 1.0) is True
    assert t.mark("kv_ready", 2.0) is False
    assert t.kv_ready == 1.0


def test_durations_derive_from_the_marks() -> None:
    t = Timeline("t1")
    assert t.duration("handover") is None and t.durations() == {}
    t.mark("kv_ready", 10.0)
    t.mark("notif_received", 10.25)
    assert t.duration("handover") == 0.25
    assert t.durations() == {"handover": 0.25}
    full = _full().durations()
    assert set(full) == set(DURATIONS)
    assert full["reg_lead"] == 0.5 and full["handover"] == 1.5
    with pytest.raises(ValueError, match="unknown duration"):
        t.duration("ttft")


def test_dict_round_trip_keeps_only_set_events() -> None:
    t = Timeline("t1", kv_ready=3.0)
    assert t.to_dict() == {"transfer_id": "t1", "kv_ready": 3.0}
    assert Timeline.from_dict(t.to_dict()) == t
    assert Timeline.from_dict(_full().to_dict()) == _full()


@pytest.mark.parametrize(
    "record",
    [
        {"transfer_id": "t", "kv_ready": "soon"},
        {"transfer_id": "t", "kv_ready": True},
        {"transfer_id": "t", "bogus": 1.0},
        {"kv_ready": 1.0},
        ["t", 1.0],
    ],
)
def test_from_dict_rejects_what_is_not_a_timeline(record: object) -> None:
    with pytest.raises(ValueError):
        Timeline.from_dict(record)  # type: ignore[arg-type]


def test_jsonl_merges_the_decode_and_prefill_records() -> None:
    decode_side = Timeline("t1", reg_sent=1.0, notif_received=4.0)
    prefill_side = Timeline("t1", reg_received=1.5, kv_ready=2.0, write_done=3.5)
    other = Timeline("t2", kv_ready=9.0)
    text = dumps_jsonl([decode_side, other]) + "\n" + dumps_jsonl([prefill_side])
    assert text.count("\n") == 4
    merged = {t.transfer_id: t for t in loads_jsonl(text)}
    assert merged["t1"] == merge(decode_side, prefill_side)
    assert merged["t1"].duration("handover") == 2.0
    assert merged["t2"] == other


def test_merge_refuses_conflicts() -> None:
    with pytest.raises(ValueError, match="cannot merge"):
        merge(Timeline("a"), Timeline("b"))
    with pytest.raises(ValueError, match="kv_ready differs"):
        merge(Timeline("a", kv_ready=1.0), Timeline("a", kv_ready=2.0))


def test_loads_names_the_bad_line() -> None:
    good = dumps_jsonl([Timeline("t1")])
    with pytest.raises(ValueError, match="line 2"):
        loads_jsonl(good + "{not json\n")
    with pytest.raises(ValueError, match="line 2"):
        loads_jsonl(good + '{"transfer_id": "t1", "x": 1}\n')
