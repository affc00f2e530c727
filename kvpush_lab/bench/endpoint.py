"""``kvpush bench --base-url URL``: measure a deployment that is already running.

No cluster is started or stopped and no model is made: the one
configuration, named by ``label`` (default: the URL's host and port), is
whatever answers at ``URL/v1/completions`` (kvpush's router, a vLLM P/D
proxy, any OpenAI-compatible server). Its requests carry ``model`` (given,
or the first id of ``URL/v1/models``); their prompts are token ids, so their
lengths stay exact, drawn from a local tokenizer's vocabulary where one is
known (``tokenizer``, or the served model's id where it is a local model
directory) and else from ids 1000-1999, normal tokens of every common
vocabulary (and of kvpush's tiny model). The same workload, warm-up,
statistics and report as a run on owned clusters; what needs the clusters'
processes, run directories or a reference configuration beside it is left
out, and the report lists it (:data:`NOT_MEASURED`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console

from kvpush_lab.bench import client, conversation, loadgen, scenario
from kvpush_lab.bench.config import BenchConfig, check_base_url
from kvpush_lab.bench.goodput import Slo, goodput
from kvpush_lab.bench.inputs import load_traces, normal_token_ids
from kvpush_lab.bench.progress import advance, make_progress
from kvpush_lab.bench.records import REQUESTS_FILE, RequestRecord, write_records
from kvpush_lab.bench.resources import machine_info, versions
from kvpush_lab.bench.stats import summarize_point
from kvpush_lab.bench.summary import (
    SUMMARY_FILE,
    BenchSummary,
    ConfigResult,
    PointResult,
    WarmupResult,
    save_summary,
)
from kvpush_lab.bench.workload import (
    PointWorkload,
    build_point,
    build_warmup,
    check_fits,
    sweep_points,
)

FALLBACK_VOCAB = tuple(range(1000, 2000))
MODELS_TIMEOUT_S = 10.0
# What a run on owned clusters reports and one against an endpoint cannot.
NOT_MEASURED = (
    "Per-instance CPU and memory, and the machine's background load: the "
    "serving processes are not this benchmark's (they may be on other "
    "machines).",
    "Server-side handover timelines, KV transfer bandwidth, WRITE descriptors "
    "and the router's legs: read from the run directories and the instances' "
    "/metrics of clusters the benchmark starts.",
    "KV-cache checks on the instances (blocks in use and freed, "
    "fragmentation): the skewed and fragmented workloads are refused with "
    "--base-url.",
    "Ratios to colocated and vllm-pull: no reference configuration ran "
    "beside this one. Run kvpush bench without --base-url for the side-by-side "
    "comparison.",
    "Several configurations and rounds (--configs, --repeat): each needs fresh "
    "clusters of its own. Run the command again against another URL, or at "
    "another time, and compare the reports.",
)


@dataclass(frozen=True)
class EndpointPlan:
    """Everything decided before the first request."""

    config: BenchConfig
    url: str  # the server's root: requests go to url/v1/completions
    served_model: str
    out_dir: Path
    points: tuple[PointWorkload, ...]
    warmup: PointWorkload
    vocab_source: str
    conversations: tuple[conversation.Conversation, ...] = ()
    max_model_len: int | None = None  # as the endpoint reports it

    @property
    def label(self) -> str:
        return self.config.endpoint_label


def server_root(url: str) -> str:
    """``url`` checked, without a trailing ``/`` or ``/v1`` (the client adds
    ``/v1/completions``)."""
    root = check_base_url(url).rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def prepare_endpoint(config: BenchConfig, console: Console) -> EndpointPlan:
    """Check the settings, ask the endpoint for its model, build the workload;
    ValueError before any request if something is wrong."""
    from kvpush_lab.bench.runner import default_output_dir

    out_dir = config.output_dir or default_output_dir()
    for name in (SUMMARY_FILE, REQUESTS_FILE):
        if (out_dir / name).exists():
            raise ValueError(f"{out_dir} already holds results; choose a new --output")
    url = server_root(config.base_url or "")
    listed, max_len = asyncio.run(list_models(url))
    model = config.served_model or (listed[0] if listed else None)
    if model is None:
        raise ValueError(
            f"{url}/v1/models lists no model; give --model NAME (the model field "
            "the server expects)"
        )
    vocab, source = vocabulary(config, model)
    traces = load_traces(config)
    conversations: tuple[conversation.Conversation, ...] = ()
    if config.workload == "multi-turn":
        points: tuple[PointWorkload, ...] = conversation.turn_points(config)
        warmup = conversation.build_warmup(config, vocab)
        conversations = conversation.build_conversations(config, vocab, "")
    else:
        points = tuple(
            build_point(config, p, vocab, traces) for p in sweep_points(config)
        )
        warmup = build_warmup(config, points, vocab)
    limit = min(config.max_model_len, max_len or config.max_model_len)
    check_fits([*points, warmup], limit)
    out_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"  model {model}; prompt tokens from {source}")
    return EndpointPlan(
        config, url, model, out_dir, points, warmup, source, conversations, max_len
    )


async def list_models(url: str) -> tuple[list[str], int | None]:
    """The model ids ``url/v1/models`` lists, and the first one's
    ``max_model_len`` where it says (vLLM does); ``([], None)`` when it
    cannot be read."""
    timeout = aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(f"{url}/v1/models") as resp,
        ):
            resp.raise_for_status()
            body = await resp.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return [], None
    return models_of(body)


def models_of(body: Any) -> tuple[list[str], int | None]:
    """Ids and the first one's ``max_model_len`` of a /v1/models answer."""
    data = body.get("data") if isinstance(body, dict) else None
    entries = [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []
    ids = [e["id"] for e in entries if isinstance(e.get("id"), str) and e["id"]]
    first_len = entries[0].get("max_model_len") if entries else None
    if isinstance(first_len, bool) or not isinstance(first_len, int):
        return ids, None
    return ids, first_len if first_len > 0 else None


def vocabulary(config: BenchConfig, model: str) -> tuple[Sequence[int], str]:
    """The token ids prompts are drawn from, and where they come from."""
    if config.tokenizer is not None:
        return normal_token_ids(config.tokenizer), f"the tokenizer {config.tokenizer}"
    local = Path(model).expanduser()
    if (local / "config.json").is_file():
        return normal_token_ids(local), f"the tokenizer of {local}"
    first, last = FALLBACK_VOCAB[0], FALLBACK_VOCAB[-1]
    return FALLBACK_VOCAB, (
        f"ids {first}-{last} (no local tokenizer: give --tokenizer DIR for the "
        "model's own vocabulary)"
    )


def run_endpoint(plan: EndpointPlan, console: Console, command: str) -> BenchSummary:
    """Warm up, run every point against the endpoint; saves summary.json."""
    from kvpush_lab.bench.runner import point_info

    started = time.monotonic()
    summary = BenchSummary(
        command=command,
        started_at=_now(),
        machine=machine_info(),
        versions=versions(),
        settings={**plan.config.to_dict(), "endpoint": endpoint_settings(plan)},
        points=[point_info(w) for w in plan.points],
    )
    console.rule(f"[bold]{plan.label}")
    try:
        result = asyncio.run(_measure(plan, console))
    except RuntimeError as e:
        console.print(f"[bold red]{plan.label} failed:[/] {e}")
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        result = ConfigResult(name=plan.label, status="failed", reason=reason)
    summary.configs.append(result)
    summary.duration_s = time.monotonic() - started
    summary.finished_at = _now()
    save_summary(summary, plan.out_dir)
    return summary


def endpoint_settings(plan: EndpointPlan) -> dict[str, Any]:
    """What the report says of the endpoint (``settings["endpoint"]``)."""
    return {
        "url": plan.url,
        "label": plan.label,
        "served_model": plan.served_model,
        "max_model_len": plan.max_model_len,
        "prompt_tokens": plan.vocab_source,
        "not_measured": list(NOT_MEASURED),
    }


def _now() -> str:
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


async def _measure(plan: EndpointPlan, console: Console) -> ConfigResult:
    config = plan.config
    async with client.make_session() as session:
        warmup = await _warm_up(plan, session, console)
        with make_progress(console) as progress:
            if config.workload == "multi-turn":
                measured = await _converse(plan, session, progress)
            else:
                measured = [
                    await _point(plan, session, progress, w) for w in plan.points
                ]
    for records in measured:
        write_records(plan.out_dir / REQUESTS_FILE, records)
    points = [
        PointResult(
            point=w.point.index,
            stats=summarize_point(records),
            bindings=scenario.point_bindings(records),  # kvpush's router: headers
            goodput=_goodput(config, records),
        )
        for w, records in zip(plan.points, measured, strict=True)
    ]
    return ConfigResult(name=plan.label, status="ok", points=points, warmup=warmup)


async def _point(
    plan: EndpointPlan,
    session: aiohttp.ClientSession,
    progress: Any,
    workload: PointWorkload,
) -> list[RequestRecord]:
    task = progress.add_task(
        f"{plan.label} {workload.point.label}",
        total=len(workload.requests),
        errors=0,
    )
    return await loadgen.run_point(
        session, plan.url, workload, plan.label, plan.config.request_timeout_s,
        advance(progress, task), plan.config.max_concurrency, plan.served_model,
    )  # fmt: skip


async def _converse(
    plan: EndpointPlan, session: aiohttp.ClientSession, progress: Any
) -> list[list[RequestRecord]]:
    config = plan.config
    task = progress.add_task(
        f"{plan.label} {len(plan.conversations)} conversations",
        total=sum(c.num_turns for c in plan.conversations),
        errors=0,
    )
    return await loadgen.run_conversations(
        session, plan.url, plan.conversations, config.conversation_concurrency,
        plan.label, config.request_timeout_s, advance(progress, task),
        plan.served_model,
    )  # fmt: skip


async def _warm_up(
    plan: EndpointPlan, session: aiohttp.ClientSession, console: Console
) -> WarmupResult:
    """The warm-up requests, one at a time (kept out of the results);
    RuntimeError when every one fails."""
    with console.status(f"{plan.label}: {len(plan.warmup.requests)} warm-up requests"):
        records = await loadgen.run_point(
            session, plan.url, plan.warmup, plan.label,
            plan.config.request_timeout_s, lambda _r: None, None, plan.served_model,
        )  # fmt: skip
    ok = [r for r in records if r.is_ok]
    latencies = [round(1000 * (r.end_s or 0.0), 1) for r in records]
    console.print(f"  warm-up: {len(ok)}/{len(records)} ok, ms {latencies}")
    if not ok:
        first = records[0]
        detail = first.error_message or first.error_detail
        raise RuntimeError(
            f"every warm-up request to {plan.url} failed (first: {first.error} "
            f"{detail})"
        )
    return WarmupResult(
        num_requests=len(records), num_ok=len(ok), latencies_ms=latencies
    )


def _goodput(config: BenchConfig, records: list[RequestRecord]) -> Any:
    if config.workload != "saturation":
        return None
    slo = Slo(config.slo_ttft_ms, config.slo_tpot_ms)
    return goodput(records, slo, summarize_point(records).duration_s)
