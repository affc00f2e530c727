"""Results as data: a section's results.json round-trips through its typed
schema; a run becomes measurements and ratio spreads; the renderer writes a
short BENCHMARKS.md (kvpush's figures, its ratios to vLLM's connectors with
their spread, a link per section) and each section's details page; and the
published docs/bench set renders within the length the docs promise."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvpush_lab.bench.export import results_of_run
from kvpush_lab.bench.render import (
    headline_table,
    load_all,
    main,
    ordered,
    render_benchmarks,
    render_section,
    spread_text,
)
from kvpush_lab.bench.results import (
    Measurement,
    Metrics,
    Plot,
    Ratio,
    SectionResults,
    Setup,
    Table,
    check_section_name,
    decode_results,
    encode_results,
    load_results,
    save_results,
)
from kvpush_lab.bench.rounds import Spread
from tests.unit.test_bench_report import summary as bench_summary

REPO = Path(__file__).resolve().parents[2]
MAX_BENCHMARKS_LINES = 170  # a headline per section (14 sections): short enough to read


def metrics(ttft: float, tpot: float, itl: float = 5.0) -> Metrics:
    return Metrics(
        num_requests=4, num_ok=4, errors={}, ttft_p50_ms=ttft, ttft_p99_ms=2 * ttft,
        tpot_p50_ms=tpot, tpot_p99_ms=2 * tpot, itl_p50_ms=itl, itl_p99_ms=3 * itl,
        output_throughput=30.0,
    )  # fmt: skip


def ratio(point: str, config: str, figure: str, ref: str, *values: float) -> Ratio:
    spread = Spread(
        n=len(values), median=sorted(values)[len(values) // 2],
        min=min(values), max=max(values),
    )  # fmt: skip
    side = -1 if max(values) < 1 else 1 if min(values) > 1 else 0
    return Ratio(point=point, config=config, figure=figure, reference=ref,
                 spread=spread, side=side if len(values) > 1 else 0)  # fmt: skip


def section(name: str = "qps-sweep", kind: str = "bench") -> SectionResults:
    """Two rounds of one point: kvpush, vllm-pull and vllm-push."""
    measured = [
        Measurement(round=r, point="qps 1", config=c, metrics=metrics(t + r, 8.0))
        for r in (1, 2)
        for c, t in (("vllm-pull", 100.0), ("vllm-push", 90.0), ("kvpush", 70.0))
    ]
    return SectionResults(
        section=name, title=f"Title of {name}", kind=kind,  # type: ignore[arg-type]
        source="a test", command="kvpush bench --qps 1", started_at="2026-01-01",
        commit="abc1234", setup=Setup(machine="2 cores", model="tiny"),
        configs=["vllm-pull", "vllm-push", "kvpush"], points=["qps 1"],
        num_rounds=2, measurements=measured,
        ratios=[
            ratio("qps 1", "kvpush", "TTFT p50", "vllm-pull", 0.70, 0.71),
            ratio("qps 1", "kvpush", "TPOT p50", "vllm-pull", 0.9, 1.1),
            ratio("qps 1", "kvpush", "TTFT p50", "vllm-push", 0.78, 0.79),
        ],
        tables=[Table(title="Handover", columns=["phase", "p50 ms"],
                      rows=[["transfer", "1.0"]], note="Phases.", after="n 4.")],
        plots=[Plot(file="ttft_vs_qps.png", caption="TTFT against QPS")],
        notes=["A note."],
    )  # fmt: skip


# -- the schema ---------------------------------------------------------------


def test_results_round_trip_through_json(tmp_path: Path) -> None:
    s = section()
    assert decode_results(encode_results(s)) == s
    path = save_results(s, tmp_path / "qps-sweep")
    assert path.name == "results.json" and load_results(path.parent) == s


def test_a_run_round_trips_with_its_whole_summary(tmp_path: Path) -> None:
    s = results_of_run(bench_summary(), "qps-sweep", "Sweep")
    save_results(s, tmp_path)
    assert load_results(tmp_path) == s and s.run == bench_summary()


def test_unreadable_or_missing_results_say_where(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no results at"):
        load_results(tmp_path)
    (tmp_path / "results.json").write_text('{"section": 1}')
    with pytest.raises(ValueError, match="unreadable"):
        load_results(tmp_path)


def test_a_section_name_is_a_folder_name() -> None:
    assert check_section_name("stream-sweep") == "stream-sweep"
    with pytest.raises(ValueError, match="section name"):
        check_section_name("Bad Name")
    with pytest.raises(ValueError, match="section name"):
        save_results(msgspec.structs.replace(section(), section="../x"), Path("."))


# -- a run as results -----------------------------------------------------------


def test_a_run_becomes_measurements_and_ratios_to_each_reference() -> None:
    s = results_of_run(bench_summary(), "qps-sweep", "Sweep")
    assert s.points == ["qps 1.0", "qps 2.0"] and s.num_rounds == 1
    # kvpush was skipped: it has no measurement, and a note says why
    assert {m.config for m in s.measurements} == {"colocated", "vllm-pull", "vllm-push"}
    assert s.notes == ["kvpush skipped: not available yet"]
    pull = s.measured("qps 1.0", "vllm-pull")[0]
    assert (pull.ttft_p50_ms, pull.tpot_p50_ms, pull.num_ok) == (100.0, 4.0, 4)
    r = s.ratio("qps 1.0", "vllm-push", "TTFT p50", "vllm-pull")
    assert r is not None and r.spread.median == pytest.approx(0.75)
    assert r.spread.n == 1 and r.side == 0  # one round: no side claimed
    assert s.ratio("qps 1.0", "vllm-pull", "TTFT p50", "vllm-pull") is None
    assert s.setup.machine is not None and "cores" in s.setup.machine
    assert s.plots[0].file == "ttft_vs_qps.png"


# -- the renderer ---------------------------------------------------------------


def test_spreads_are_median_min_max_bold_when_every_round_agrees() -> None:
    assert spread_text(Spread(n=3, median=0.8, min=0.7, max=0.9), -1) == (
        "**0.80 [0.70–0.90]**"
    )
    assert spread_text(Spread(n=3, median=0.98, min=0.9, max=1.1), 0) == (
        "0.98 [0.90–1.10]"
    )
    assert spread_text(Spread(n=1, median=0.5, min=0.5, max=0.5), 0) == "0.50"


def test_the_headline_shows_kvpush_figures_and_its_ratios_to_vllm() -> None:
    text = render_benchmarks([section()])
    assert text.startswith("# kvpush benchmarks\n")
    header = next(line for line in text.splitlines() if line.startswith("| point"))
    assert header == (
        "| point | config | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p50 "
        "| ITL p99 | out tok/s | TTFT p50 ÷ vllm-pull | TPOT p50 ÷ vllm-pull "
        "| TTFT p50 ÷ vllm-push |"
    )
    # medians over the two rounds (71, 72 -> 71.5); only kvpush has a row
    assert (
        "| qps 1 | kvpush | 71.5 | 143 | 8.0 | 16.0 | 5.0 | 15.0 | 30.0 "
        "| **0.71 [0.70–0.71]** | 1.10 [0.90–1.10] | **0.79 [0.78–0.79]** |"
    ) in text
    assert "| qps 1 | vllm-pull |" not in text
    assert "[results.json](docs/bench/qps-sweep/results.json)" in text
    assert "[details](docs/bench/qps-sweep/README.md)" in text
    assert "![Title of qps-sweep: TTFT against QPS]" in text
    assert "target" not in text.lower()


def test_the_time_to_second_token_shows_where_a_section_measured_it() -> None:
    old = section()
    new = msgspec.structs.replace(
        old,
        measurements=[
            msgspec.structs.replace(
                m,
                metrics=msgspec.structs.replace(
                    m.metrics, ttst_p50_ms=80.0 + i, ttst_p99_ms=150.0
                ),
            )
            for i, m in enumerate(old.measurements)
        ],
    )
    assert "TTST" not in headline_table(old)
    header = headline_table(new).splitlines()[0]
    assert "| TTFT p99 | TTST p50 | TTST p99 | TPOT p50 |" in header


def test_sections_are_ordered_prompt_sweep_first_then_others_listed() -> None:
    sweep = msgspec.structs.replace(
        section("stream-sweep"),
        plots=[Plot(file="overhead_vs_prompt_len.png", caption="Overhead")],
    )
    soak = msgspec.structs.replace(
        section("soak", "soak"), notes=["**Passed:** 0 requests lost."]
    )
    names = [s.section for s in ordered([soak, section("a-load"), sweep])]
    assert names == ["stream-sweep", "a-load", "soak"]
    text = render_benchmarks([soak, section("a-load"), sweep])
    assert text.index("overhead_vs_prompt_len.png") < text.index("ttft_vs_qps.png")
    assert "- **Title of soak** (2026-01-01, commit `abc1234`). **Passed:**" in text


def test_a_details_page_keeps_every_table_and_note() -> None:
    text = render_section(section())
    assert text.startswith("# Title of qps-sweep\n")
    assert "Source: a test." in text and "kvpush bench --qps 1" in text
    assert "## Handover\n\nPhases.\n\n| phase | p50 ms |" in text
    assert "| transfer | 1.0 |\n\nn 4." in text
    assert (
        "- **Model:** tiny" in text and "![TTFT against QPS](ttft_vs_qps.png)" in text
    )


def test_a_run_s_details_page_is_its_full_report() -> None:
    text = render_section(results_of_run(bench_summary(), "qps-sweep", "Sweep"))
    assert text.startswith("# Sweep\n") and "| vllm-pull | 4 / 4 | 0 | 100 |" in text


def test_a_run_s_details_page_shows_the_notes_added_to_its_results() -> None:
    results = results_of_run(bench_summary(), "qps-sweep", "Sweep")
    noted = msgspec.structs.replace(results, notes=["Its commit label: why."])
    assert "Its commit label: why." not in render_section(results)
    assert "Its commit label: why." in render_section(noted)


def test_the_command_renders_every_section_found(tmp_path: Path) -> None:
    save_results(section("one"), tmp_path / "docs" / "bench" / "one")
    save_results(section("two"), tmp_path / "docs" / "bench" / "two")
    assert main([str(tmp_path)]) == 0
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert (
        "docs/bench/one/results.json" in text and "docs/bench/two/results.json" in text
    )
    assert (tmp_path / "docs" / "bench" / "two" / "README.md").exists()
    assert main(["--bad"]) == 2


# -- the published set ------------------------------------------------------------


def test_the_published_sections_render_within_the_promised_length() -> None:
    sections = load_all(REPO)
    assert len(sections) >= 10
    text = render_benchmarks(sections)
    assert len(text.splitlines()) <= MAX_BENCHMARKS_LINES
    for s in sections:
        assert f"(docs/bench/{s.section}/results.json)" in text
        assert s.section == (REPO / "docs" / "bench" / s.section).name
        for plot in s.plots:
            assert (REPO / "docs" / "bench" / s.section / plot.file).exists()
    assert (REPO / "BENCHMARKS.md").read_text() == text  # rendered, not edited
