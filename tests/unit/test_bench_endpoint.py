"""``kvpush bench --base-url``: a running deployment measured, nothing started.

The endpoint is the fake vLLM server the router tests use (or, to count the
requests in flight, a minimal server of the test's own), served from a
thread of its own since ``kvpush bench`` runs its own event loop. The
launcher and the model maker are replaced by stubs that fail the test if
anything calls them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvpush.cli import main
from kvpush_lab.bench import clusters, endpoint, loadgen, runner
from kvpush_lab.bench.cli import add_parser, command_line, config_from_args
from kvpush_lab.bench.config import make_config
from kvpush_lab.bench.lengths import LengthSpec
from kvpush_lab.bench.records import read_records
from kvpush_lab.bench.summary import load_summary
from kvpush_lab.bench.workload import PointWorkload, RequestSpec, SweepPoint
from tests.fakes import FakeVllm

NUM_PROMPTS = 5
SMALL = [
    "--num-prompts", str(NUM_PROMPTS), "--request-rate", "200", "--prompt-len",
    "16", "--output-len", "4", "--num-warmup", "1", "--request-timeout-s", "10",
]  # fmt: skip


class Threaded:
    """An aiohttp server (started by ``start``, returning its URL) served
    from a background thread until :meth:`stop`."""

    def __init__(
        self,
        start: Callable[[], Awaitable[str]],
        close: Callable[[], Awaitable[None]],
    ) -> None:
        self.url = ""
        self._start, self._close = start, close
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()))
        self._thread.start()
        assert self._ready.wait(10), "the fake endpoint did not start"

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self.url = await self._start()
        self._ready.set()
        await self._stop.wait()
        await self._close()

    def stop(self) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


class InFlight:
    """A minimal streaming /v1/completions that records the most requests it
    had in flight at once. The measured requests (``kvb-0-*``) are held
    until ``hold`` of them are in flight together, so the peak reaches the
    cap for certain while every other request piles up behind them unless
    the client caps them."""

    def __init__(self, hold: int) -> None:
        self.hold, self.now, self.peak, self.seen = hold, 0, 0, 0
        self._runner: web.AppRunner | None = None
        self._gate: asyncio.Event | None = None

    async def start(self) -> str:
        self._gate = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 512}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        assert self._gate is not None
        body = await request.json()
        measured = request.headers.get("X-Request-Id", "").startswith("kvb-0-")
        self.now += 1
        self.peak = max(self.peak, self.now) if measured else self.peak
        self.seen += measured
        try:
            if measured:
                if self.now >= self.hold:
                    self._gate.set()
                async with asyncio.timeout(5):  # a broken cap fails, not hangs
                    await self._gate.wait()
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for i in range(int(body["max_tokens"])):
                chunk = {"choices": [{"index": 0, "text": f" t{i}"}]}
                await out.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out
        finally:
            self.now -= 1


@pytest.fixture
def nothing_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to start or stop a cluster, or to make a model, fails."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("--base-url must not start clusters or make a model")

    for module, name in (
        (clusters, "up"), (clusters, "down"), (runner, "resolve_model"),
        (runner, "prepare"), (runner, "run_bench"), (endpoint, "normal_token_ids"),
    ):  # fmt: skip
        monkeypatch.setattr(module, name, refuse)


@pytest.fixture
def fake_vllm() -> Any:
    fake = FakeVllm(engine_id="served")

    async def start() -> str:
        await fake.start()
        return fake.url

    served = Threaded(start, fake.close)
    yield served.url, fake
    served.stop()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvpush")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_base_url_measures_every_request_and_starts_nothing(
    nothing_started: None, fake_vllm: tuple[str, FakeVllm], tmp_path: Path
) -> None:
    url, fake = fake_vllm
    out = tmp_path / "out"
    assert main(["bench", "--base-url", url, *SMALL, "--output", str(out)]) == 0

    label = url.removeprefix("http://")
    summary = load_summary(out)
    assert [(c.name, c.status) for c in summary.configs] == [(label, "ok")]
    stats = summary.stats(label, 0)
    assert stats is not None and stats.num_ok == stats.num_requests == NUM_PROMPTS
    assert stats.ttft_ms is not None and stats.itl_ms is not None
    assert stats.output_throughput > 0
    records = read_records(out / "requests.jsonl")
    assert sorted(r.index for r in records) == list(range(NUM_PROMPTS))
    assert all(r.config == label for r in records)
    # the warm-up request too, each with the model /v1/models listed
    assert len(fake.received) == NUM_PROMPTS + 1
    assert {r.body.get("model") for r in fake.received} == {"fake-model"}
    assert all(r.path == "/v1/completions" for r in fake.received)

    report = (out / "report.md").read_text()
    assert f"- **Endpoint:** {url} (configuration **{label}**)" in report
    assert "model `fake-model`" in report and "started and stopped no cluster" in report
    assert "## Not measured against an endpoint" in report
    assert "Ratios to colocated and vllm-pull" in report
    assert f"| {label} | {NUM_PROMPTS} / {NUM_PROMPTS} |" in report
    for column in ("TTFT p50", "TTFT p99", "TPOT p50", "ITL p50", "ITL p99", "req/s"):
        assert column in report
    assert "--base-url" in summary.command and "--request-rate 200" in summary.command
    (out / "report.md").unlink()  # --render redoes it from the files alone
    assert main(["bench", "--render", str(out)]) == 0
    assert "## Not measured against an endpoint" in (out / "report.md").read_text()


def test_label_and_model_name_the_endpoint(
    nothing_started: None, fake_vllm: tuple[str, FakeVllm], tmp_path: Path
) -> None:
    url, fake = fake_vllm
    out = tmp_path / "out"
    argv = [
        "bench", "--base-url", url + "/v1/", "--label", "prod-pd", "--model",
        "served-name", *SMALL, "--output", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    summary = load_summary(out)
    assert [c.name for c in summary.configs] == ["prod-pd"]
    assert {r.body.get("model") for r in fake.received} == {"served-name"}
    assert summary.settings["endpoint"]["url"] == url  # /v1/ taken off
    assert "**prod-pd**" in (out / "report.md").read_text()


def test_max_concurrency_bounds_the_requests_in_flight(
    nothing_started: None, tmp_path: Path
) -> None:
    server = InFlight(hold=2)
    served = Threaded(server.start, server.close)
    try:
        argv = [
            "bench", "--base-url", served.url, *SMALL, "--num-prompts", "6",
            "--request-rate", "1000", "--max-concurrency", "2",
            "--output", str(tmp_path / "out"),
        ]  # fmt: skip
        assert main(argv) == 0
    finally:
        served.stop()
    assert server.seen == 6
    assert server.peak == 2  # reached the cap, never past it (the load
    # generator's own test shows it holds what comes past the cap)
    summary = load_summary(tmp_path / "out")
    assert summary.stats(summary.configs[0].name, 0).num_ok == 6  # type: ignore[union-attr]
    assert "at most 2 in flight" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.parametrize(("cap", "peak"), [(2, 2), (None, 6)])
def test_the_load_generator_holds_arrivals_past_the_cap(
    monkeypatch: pytest.MonkeyPatch, cap: int | None, peak: int
) -> None:
    """Six requests due at once: with a cap of 2, two are sent and four
    wait for a slot until the test lets the first ones finish; without a
    cap all six are in flight (deterministic: no clock involved)."""
    state = {"now": 0, "peak": 0}
    release = asyncio.Event()

    async def send(*args: Any, **kwargs: Any) -> Any:
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await release.wait()
        state["now"] -= 1
        return args[3]

    monkeypatch.setattr(loadgen.client, "send", send)
    point = SweepPoint(0, "qps", 1000.0, "poisson", 1000.0, LengthSpec.parse("3"))
    workload = PointWorkload(
        point, tuple(RequestSpec(i, f"kvb-0-{i}", (1, 2, 3), 2) for i in range(6))
    )

    async def run() -> int:
        task = asyncio.create_task(
            loadgen.run_point(None, "u", workload, "c", 1.0, lambda r: None, cap)  # type: ignore[arg-type]
        )
        for _ in range(50):  # every request gets to run as far as it can
            await asyncio.sleep(0)
        in_flight = state["now"]
        release.set()
        assert len(await task) == 6
        return in_flight

    assert asyncio.run(run()) == peak
    assert state["peak"] == peak


def test_an_unreachable_endpoint_without_a_model_is_refused(
    nothing_started: None, tmp_path: Path
) -> None:
    argv = ["bench", "--base-url", "http://127.0.0.1:9", *SMALL]
    assert main([*argv, "--output", str(tmp_path / "out")]) == 2


def test_the_vllm_names_and_the_old_ones_set_the_same_config() -> None:
    new = ["--request-rate", "1,3", "--num-prompts", "7", "--max-concurrency", "4"]
    old = ["--qps", "1,3", "--num-requests", "7", "--max-concurrency", "4"]
    config = config_from_args(parse(new))
    assert config == config_from_args(parse(old))
    assert config.qps == (1.0, 3.0) and config.num_requests == 7
    assert config.max_concurrency == 4
    # the same value under both names is fine; the record uses the new name
    both = parse([*new, "--qps", "1,3"])
    assert config_from_args(both) == config
    assert command_line(parse(old)) == (
        "kvpush bench --request-rate 1,3 --max-concurrency 4 --num-prompts 7"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--request-rate", "2", "--qps", "4"],
        ["--num-prompts", "5", "--num-requests", "6"],
    ],
)
def test_an_old_and_a_new_name_with_different_values_are_refused(
    argv: list[str],
) -> None:
    with pytest.raises(ValueError, match=r"alias .* differ"):
        config_from_args(parse(argv))


def test_config_files_take_both_names(tmp_path: Path) -> None:
    path = tmp_path / "bench.toml"
    path.write_text("request_rate = [2, 5]\nnum_prompts = 3\nmax_concurrency = 2\n")
    config = config_from_args(parse(["--config", str(path)]))
    assert (config.qps, config.num_requests, config.max_concurrency) == (
        (2.0, 5.0), 3, 2,
    )  # fmt: skip
    assert make_config({"qps": [2, 5], "request_rate": "2,5"}).qps == (2.0, 5.0)
    with pytest.raises(ValueError, match=r"request_rate .* older name qps"):
        make_config({"qps": [2], "request_rate": [3]})
    with pytest.raises(ValueError, match=r"num_prompts .* older name num_requests"):
        make_config({"num_requests": 2, "num_prompts": 3})
    # a later layer's new name overrides an earlier layer's old one
    assert make_config({"num_requests": 2}, {"num_prompts": 3}).num_requests == 3


def test_help_shows_the_vllm_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--help"])
    usage = capsys.readouterr().out
    for flag in ("--request-rate", "--num-prompts", "--max-concurrency", "--base-url"):
        assert flag in usage
    assert "alias --qps" in usage and "alias --num-requests" in usage
    assert "--qps LIST" not in usage  # the aliases are not listed as flags


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"configs": "colocated,kvpush"}, "configs cannot be used with --base-url"),
        ({"repeat": 2}, "repeat cannot be used with --base-url"),
        ({"hosts": "netns"}, "hosts cannot be used with --base-url"),
        ({"num_prefill": 2}, "num_prefill cannot be used"),
        ({"model_preset": "kv-heavy"}, "model_preset cannot be used"),
        ({"workload": "fragmented"}, "workload 'fragmented' cannot be used"),
        ({"workload": "skewed"}, "workload 'skewed' cannot be used"),
    ],
)
def test_what_needs_owned_clusters_is_refused_with_base_url(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_config({"base_url": "http://localhost:8000", **values})


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("localhost:8000", "http:// or https://"),
        ("ftp://host/x", "http:// or https://"),
        ("http://", "names no host"),
        ("http://host:notaport", "bad port"),
        ("http://host:8000/?x=1", "without"),
    ],
)
def test_a_bad_base_url_is_refused(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_config({"base_url": url})


def test_endpoint_settings_need_base_url() -> None:
    with pytest.raises(ValueError, match="label names what --base-url measures"):
        make_config({"label": "x"})


def test_base_url_takes_model_as_the_served_name_and_publish_no_rounds() -> None:
    args = parse(["--base-url", "https://h:1", "--model", "org/m", "--publish"])
    config = config_from_args(args)
    assert config.served_model == "org/m" and config.model is None
    assert config.repeat == 1 and config.run_names == ("h:1",)


def test_an_infinite_rate_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="inf is not supported"):
        config_from_args(parse(["--request-rate", "inf"]))


def test_max_concurrency_checks() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        make_config({"max_concurrency": 0})
    with pytest.raises(ValueError, match="below concurrency"):
        make_config(
            {"arrival": "concurrency", "concurrency": [4], "max_concurrency": 2}
        )
    with pytest.raises(ValueError, match="multi-turn"):
        make_config({"workload": "multi-turn", "max_concurrency": 2})


def test_models_of_reads_vllms_answer() -> None:
    body = {"data": [{"id": "a", "max_model_len": 2048}, {"id": "b"}]}
    assert endpoint.models_of(body) == (["a", "b"], 2048)
    assert endpoint.models_of({"data": "x"}) == ([], None)
    assert endpoint.server_root("http://h:1/v1/") == "http://h:1"
