"""Server timelines: reading the trace files a configuration writes, joining
them with the client's requests, and splitting the handover into phases."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpush_lab.bench.timeline import (
    TRACE_DIR,
    TimelineSet,
    bench_id_of,
    match_by_time,
    phase_durations,
    read_timelines,
    summarize_handover,
)

T0 = 1_800_000_000.0
US = 1e-6  # epoch timestamps as doubles resolve about 0.24 microseconds
WHOLE_RUN = (T0 - 10, T0 + 100)


def write_lines(run_dir: Path, name: str, rows: list[dict[str, Any]]) -> None:
    folder = run_dir / TRACE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / name, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def push_events(start: float) -> dict[str, list[tuple[str, float]]]:
    """A push handover as kvpush's processes log it, per process: the
    registration arrives during prefill; KV ready at +50 ms; first decode
    step at +62 ms."""
    return {
        "decode0-1.jsonl": [("reg_sent", start + 0.008)],
        "prefill0-2.jsonl": [
            ("reg_received", start + 0.010),
            ("kv_ready", start + 0.050),
            ("write_posted", start + 0.052),
            ("write_done", start + 0.058),
        ],
        "decode0-3.jsonl": [
            ("notif_received", start + 0.059),
            ("first_decode_step", start + 0.062),
        ],
    }


def write_transfer(
    run_dir: Path, transfer_id: str, start: float, request_id: str | None = None
) -> None:
    """One transfer in the connector's one-event-per-line form; the decode's
    reg_sent line names the request when ``request_id`` is given."""
    for name, events in push_events(start).items():
        rows = []
        for event, t in events:
            row = {"transfer_id": transfer_id, "event": event, "t": t, "engine_id": "x"}
            if request_id and event == "reg_sent":
                row["request_id"] = request_id
            rows.append(row)
        write_lines(run_dir, name, rows)


def test_bench_ids_are_found_inside_server_ids() -> None:
    assert bench_id_of("kvb-3-17.5f0c2a") == "kvb-3-17"
    assert bench_id_of("cmpl-kvb-0-4.a1b2-0-9f") == "kvb-0-4"
    assert bench_id_of("chatcmpl-kvb-w-1.ff") == "kvb-w-1"
    assert bench_id_of("kvb-1-23") == "kvb-1-23"
    assert bench_id_of("xkvb-1-2") is None
    assert bench_id_of("9b5871352cfc4cf6905598deb2f33b00") is None


def test_event_lines_from_every_process_join_into_one_timeline(tmp_path: Path) -> None:
    for i in range(3):
        write_transfer(tmp_path, f"t{i}", T0 + i, request_id=f"cmpl-kvb-0-{i}.ab-0")
    timelines = read_timelines(tmp_path)
    assert sorted(timelines.by_request) == ["kvb-0-0", "kvb-0-1", "kvb-0-2"]
    assert timelines.unjoined == []
    assert timelines.by_request["kvb-0-1"] == pytest.approx(
        {
            "reg_sent": T0 + 1.008,
            "reg_received": T0 + 1.010,
            "kv_ready": T0 + 1.050,
            "write_posted": T0 + 1.052,
            "write_done": T0 + 1.058,
            "notif_received": T0 + 1.059,
            "first_decode_step": T0 + 1.062,
        }
    )


def test_a_transfer_id_that_embeds_the_request_id_joins_too(tmp_path: Path) -> None:
    write_transfer(tmp_path, "kvb-2-5.4f1c9e", T0)
    assert list(read_timelines(tmp_path).by_request) == ["kvb-2-5"]


def test_lines_holding_several_events_are_read_too(tmp_path: Path) -> None:
    write_lines(tmp_path, "a.jsonl", [{"request_id": "kvb-0-0", "kv_ready": T0 + 2}])
    write_lines(tmp_path, "b.jsonl", [{"request_id": "kvb-0-0", "kv_ready": T0 + 1}])
    assert read_timelines(tmp_path).by_request == {"kvb-0-0": {"kv_ready": T0 + 1}}


def test_transfers_naming_no_request_are_kept_apart(tmp_path: Path) -> None:
    write_transfer(tmp_path, "9b58", T0)
    timelines = read_timelines(tmp_path)
    assert timelines.by_request == {} and len(timelines.unjoined) == 1


def test_no_trace_folder_means_client_view_only(tmp_path: Path) -> None:
    timelines = read_timelines(tmp_path)
    assert not timelines
    assert summarize_handover(timelines, ["kvb-0-0"], WHOLE_RUN) is None


def test_malformed_lines_name_file_and_line(tmp_path: Path) -> None:
    write_lines(tmp_path, "decode0.jsonl", [{"transfer_id": "t", "event": "kv_ready"}])
    with open(tmp_path / TRACE_DIR / "decode0.jsonl", "a") as f:
        f.write('{"event": "kv_ready", "t": 1.0}\n')
    with pytest.raises(ValueError, match=r"decode0.jsonl:2: .*transfer_id"):
        read_timelines(tmp_path)


def test_phases_of_a_push_where_registration_came_first() -> None:
    events = {e: t for rows in push_events(T0).values() for e, t in rows}
    assert phase_durations(events) == pytest.approx(
        {
            "registration": 0.002,
            "await registration": 0.0,  # it was there before the KV
            "write setup": 0.002,
            "transfer": 0.006,
            "notify": 0.001,
            "schedule decode": 0.003,
            "handover total": 0.012,
        },
        abs=US,
    )


def test_a_late_registration_is_time_spent_waiting_for_it() -> None:
    events = {"kv_ready": T0, "reg_received": T0 + 0.030, "write_posted": T0 + 0.031}
    phases = phase_durations(events)
    assert phases["await registration"] == pytest.approx(0.030, abs=US)
    assert phases["write setup"] == pytest.approx(0.001, abs=US)
    assert "transfer" not in phases  # write_done unknown


def test_handover_statistics_over_a_points_joined_requests(tmp_path: Path) -> None:
    for i in range(4):
        write_transfer(tmp_path, f"t{i}", T0 + i, request_id=f"kvb-0-{i}.x")
    write_transfer(tmp_path, "t9", T0 + 9, request_id="kvb-1-0.x")  # another point
    bench_ids = [f"kvb-0-{i}" for i in range(6)]
    stats = summarize_handover(read_timelines(tmp_path), bench_ids, WHOLE_RUN)
    assert stats is not None and stats.joined_by == "request id"
    assert stats.num_requests == 4 and stats.num_measured == 6
    assert stats.phases_ms["handover total"].p50 == pytest.approx(12.0, abs=1000 * US)
    assert next(iter(stats.phases_ms)) == "registration"  # in phase order


def test_unjoined_transfers_are_attributed_to_a_point_by_time() -> None:
    def transfer(start: float) -> dict[str, float]:
        return {e: t for rows in push_events(start).values() for e, t in rows}

    timelines = TimelineSet(unjoined=[transfer(T0 + s) for s in (1, 2, 7, 30)])
    bench_ids = ["kvb-0-0", "kvb-0-1"]
    stats = summarize_handover(timelines, bench_ids, (T0, T0 + 10))
    assert stats is not None and stats.joined_by == "time window"
    assert stats.num_requests == 3  # the transfer at +30 s is another point's
    assert summarize_handover(timelines, bench_ids, (T0 + 40, T0 + 50)) is None


def test_drawing_pairs_transfers_with_requests_only_when_time_is_clear() -> None:
    def starting(at: float) -> dict[str, float]:
        return {"reg_sent": at, "kv_ready": at + 0.05}

    spans = {
        "kvb-0-0": (T0, T0 + 0.1),
        "kvb-0-1": (T0 + 1.0, T0 + 1.1),
        "kvb-0-2": (T0 + 1.05, T0 + 1.2),  # overlaps kvb-0-1
        "kvb-0-3": (T0 + 3.0, T0 + 3.1),
    }
    unjoined = [
        starting(T0 + 0.01),  # only in kvb-0-0's span
        starting(T0 + 1.07),  # in two spans: ambiguous
        starting(T0 + 3.01),  # kvb-0-3 has two candidates: ambiguous
        starting(T0 + 3.02),
        starting(T0 + 9.0),  # in no span
    ]
    assert match_by_time(unjoined, spans) == {"kvb-0-0": unjoined[0]}
