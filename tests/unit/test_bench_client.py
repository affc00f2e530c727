"""The benchmark client and load generator, through the real router in front
of fake vLLM backends: every request ends as exactly one record."""

from __future__ import annotations

import time

import pytest

from kvpush_lab.bench import client, loadgen
from kvpush_lab.bench.lengths import LengthSpec
from kvpush_lab.bench.records import RequestRecord
from kvpush_lab.bench.workload import PointWorkload, RequestSpec, SweepPoint
from tests.fakes import Fault, dead_url, routed


def spec(index: int = 0, prompt_len: int = 12, output_len: int = 5) -> RequestSpec:
    prompt = tuple(100 + (index * 7 + i) % 50 for i in range(prompt_len))
    return RequestSpec(index, f"kvb-0-{index}", prompt, output_len, 0.05 * index)


def blank(s: RequestSpec) -> RequestRecord:
    return RequestRecord(
        config="test",
        point=0,
        index=s.index,
        bench_id=s.bench_id,
        prompt_len=s.prompt_len,
        output_len=s.output_len,
        scheduled_s=s.arrival_s,
    )


async def send_one(url: str, s: RequestSpec, timeout_s: float = 5.0) -> RequestRecord:
    async with client.make_session() as session:
        return await client.send(
            session, url, s, blank(s), timeout_s, time.perf_counter()
        )


def workload(arrival: str, load: float, num: int, delay: float = 0.0) -> PointWorkload:
    point = SweepPoint(0, "qps", load, arrival, load, LengthSpec.parse("12"))
    return PointWorkload(point, tuple(spec(i) for i in range(num)))


@pytest.mark.parametrize("mode", ["colocated", "vllm-pull", "vllm-push"])
async def test_a_streamed_request_is_timed_token_by_token(mode: str) -> None:
    async with routed(mode) as r:  # type: ignore[arg-type]
        rec = await send_one(r.url, spec(output_len=6))
        decode = (r.cluster.colocated or r.cluster.decodes)[0]
    assert rec.is_ok, rec.error_detail
    assert rec.status == 200
    assert len(rec.token_times_s) == 6 and rec.output_tokens == 6
    assert rec.prompt_tokens == 12  # the fake counts the token ids it got
    assert rec.token_times_s == sorted(rec.token_times_s)
    assert 0 < rec.token_times_s[0] <= rec.token_times_s[-1] <= (rec.end_s or 0)
    assert rec.sent_wall > 0
    sent = decode.received[-1]
    assert str(sent.request_id).startswith("kvb-0-0")
    assert sent.body["ignore_eos"] is True and sent.body["max_tokens"] == 6


async def test_an_error_status_is_an_error_record() -> None:
    async with routed("colocated") as r:
        r.cluster.colocated[0].fault = Fault(status=500)
        rec = await send_one(r.url, spec())
    assert rec.error is not None and rec.error.startswith("http_5")
    assert rec.status >= 500 and rec.error_detail
    assert rec.token_times_s == []


async def test_a_hung_backend_is_a_timeout() -> None:
    async with routed("colocated") as r:
        r.cluster.colocated[0].fault = Fault(hang_after_chunks=2)
        rec = await send_one(r.url, spec(output_len=5), timeout_s=0.5)
    assert rec.error == "timeout"
    assert len(rec.token_times_s) == 2  # what arrived is kept, not counted
    assert rec.end_s == pytest.approx(0.5, abs=0.2)


async def test_an_unreachable_router_is_a_connect_error() -> None:
    rec = await send_one(dead_url(), spec())
    assert rec.error == "connect" and rec.status == 0


async def test_poisson_points_send_on_schedule_and_account_for_all() -> None:
    done: list[str] = []
    async with routed("vllm-pull") as r, client.make_session() as session:
        records = await loadgen.run_point(
            session, r.url, workload("poisson", 20, 6), "vllm-pull", 5.0,
            lambda rec: done.append(rec.bench_id),
        )  # fmt: skip
    assert [rec.index for rec in records] == list(range(6))
    assert sorted(done) == sorted(rec.bench_id for rec in records)
    assert all(rec.is_ok for rec in records)
    for rec in records:  # never early, and not far late
        assert rec.scheduled_s - 0.001 <= rec.sent_s <= rec.scheduled_s + 0.1


async def test_concurrency_points_keep_at_most_that_many_in_flight() -> None:
    async with routed("colocated") as r, client.make_session() as session:
        fake = r.cluster.colocated[0]
        fake.fault = Fault(delay_s=0.05)
        records = await loadgen.run_point(
            session, r.url, workload("concurrency", 2, 7), "colocated", 5.0,
            lambda _rec: None,
        )  # fmt: skip
        intervals = [(x.arrived_at, x.answered_at or 0.0) for x in fake.received]
    assert len(records) == 7 and all(rec.is_ok for rec in records)
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    in_flight, peak = 0, 0
    for _, step in edges:
        in_flight += step
        peak = max(peak, in_flight)
    assert peak == 2
