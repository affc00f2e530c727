"""The markdown report: pure rendering of a :class:`BenchSummary`.

One table per sweep point with every configuration's figures, then the
ratios to ``colocated`` and to ``vllm-pull`` from the same run, the handover
decomposition where a configuration wrote server timelines, and each
instance's CPU and memory: a run's ``report.md``, and its section's
``docs/bench/<section>/README.md`` once published. A multi-host rehearsal's run
repeats the point sections per link rate and adds the parts of
:mod:`kvpush_lab.bench.report_net` (overhead, bytes over the links, bandwidth
per transfer).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvpush_lab.bench.report_endpoint import (
    endpoint_lines,
    endpoint_of,
    not_measured_section,
)
from kvpush_lab.bench.report_fragment import fragment_sections
from kvpush_lab.bench.report_net import hosts_line, rehearsal_sections
from kvpush_lab.bench.report_rounds import rounds_section
from kvpush_lab.bench.report_saturation import saturation_sections
from kvpush_lab.bench.report_scenario import scenario_sections, workload_line
from kvpush_lab.bench.report_sweep import sweep_sections
from kvpush_lab.bench.stats import Dist, PointStats, ratio
from kvpush_lab.bench.summary import BenchSummary, PointInfo, rate
from kvpush_lab.bench.timeline import HandoverStats
from kvpush_lab.bench.writes import descriptor_line

REFERENCES = ("colocated", "vllm-pull")
AXIS_NAMES = {
    "qps": "QPS",
    "concurrency": "concurrency",
    "prompt_len": "prompt length",
    "link_gbit": "link rate (Gbit/s)",
    "turn": "turn (1, 2+)",
    "cache": "KV cache (fresh, after churn)",
}


def plot_axis(summary: BenchSummary) -> str:
    """What the plots put on their x axis: the sweep axis, or the link rate
    for a rehearsal swept over rates at a single point."""
    rates = summary.link_rates
    if len(summary.points) == 1 and len(rates) > 1 and None not in rates:
        return "link_gbit"
    return summary.axis


def plot_files(axis: str, workload: str = "sweep") -> dict[str, str]:
    """Plot name -> file name, for a sweep over ``axis`` (a prompt-length
    sweep also draws the handover overhead, the saturation workload its
    goodput)."""
    files = {
        "ttft": f"ttft_vs_{axis}.png",
        "tpot": f"tpot_vs_{axis}.png",
        "cdf": "ttft_cdf.png",
        "timeline": "timeline.png",
    }
    if axis == "prompt_len":
        files["overhead"] = "overhead_vs_prompt_len.png"
    if workload == "saturation":
        files["goodput"] = f"goodput_vs_{axis}.png"
    return files


def render_report(
    summary: BenchSummary,
    title: str = "kvpush bench report",
    preamble: str = "",
    image_dir: str = "",
) -> str:
    """The whole report as markdown; images are linked under ``image_dir``.
    A repeated run opens with the ratios' spread over rounds, then gives
    each round's own report under a heading of its own."""
    parts = [f"# {title}", preamble, _run_line(summary)]
    if summary.is_repeated:
        parts += [rounds_section(summary, table), _setup(summary)]
        parts.append(_config_status(summary))
        for r in summary.rounds:
            of_round = summary.in_round(r)
            body = [_headline(of_round), *_measured(of_round)]
            parts.append(f"## Round {r}\n\n" + demote_headings(_joined(body)))
    else:
        parts += [_headline(summary), _setup(summary), _config_status(summary)]
        parts += _measured(summary)
    endpoint = endpoint_of(summary)
    if endpoint is not None:
        parts.append(not_measured_section(endpoint))
    parts += [_plots(summary, image_dir), _DEFINITIONS]
    return _joined(parts) + "\n"


def demote_headings(markdown: str) -> str:
    """Every markdown heading one level down (``#`` -> ``##``), outside
    fenced code blocks: a whole report as a part of another."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,5} ", line):
            line = "#" + line
        out.append(line)
    return "\n".join(out) + ("\n" if markdown.endswith("\n") else "")


def _joined(parts: Sequence[str]) -> str:
    return "\n\n".join(p.strip() for p in parts if p.strip())


def _measured(summary: BenchSummary) -> list[str]:
    """Everything measured, section by section (one round's, when repeated)."""
    parts = scenario_sections(summary, table)
    parts += fragment_sections(summary, table)
    parts += saturation_sections(summary, table)
    parts += rehearsal_sections(summary, table)
    parts += sweep_sections(summary, table)
    for link in summary.link_rates:
        at_link = summary.at_link(link)
        prefix = "" if link is None else f"{rate(link)}, "
        parts += [_point_section(at_link, info, prefix) for info in summary.points]
    return [*parts, _descriptors(summary), _resources(summary)]


def _run_line(summary: BenchSummary) -> str:
    return (
        f"Run started {summary.started_at}, took {summary.duration_s / 60:.1f} min. "
        f"Command:\n\n```\n{summary.command}\n```"
    )


def _headline(summary: BenchSummary) -> str:
    """TTFT p50/p99 and TPOT p50 per configuration and point, in one table."""
    names = list(dict.fromkeys(_ran(summary)))
    if not names or not summary.points:
        return ""
    header = ["point", *names]
    rows = []
    for link in summary.link_rates:
        at_link = summary.at_link(link)
        for info in summary.points:
            cells = [info.label if link is None else f"{rate(link)}, {info.label}"]
            for name in names:
                st = at_link.stats(name, info.index)
                ttft, tpot = (st.ttft_ms, st.tpot_ms) if st else (None, None)
                p50, p99 = _ms(ttft, "p50"), _ms(ttft, "p99")
                cells.append(f"{p50} / {p99}, {_ms(tpot, 'p50')}")
            rows.append(cells)
    return (
        "## Headline\n\nTTFT p50 / TTFT p99, TPOT p50 in ms, per configuration "
        "and sweep point.\n\n" + table(header, rows)
    )


def setup_fields(summary: BenchSummary) -> dict[str, str]:
    """The Setup lines' texts, by :class:`kvpush_lab.bench.results.Setup`
    field: machine, versions, model and clusters (or the endpoint measured),
    workload, and the rehearsal's hosts."""
    m, s, v = summary.machine, summary.settings, summary.versions
    fields = {
        "machine": f"{m.get('cpu_model', '?')}, {m.get('cores', '?')} cores "
        f"({m.get('usable_cores', '?')} usable), {m.get('memory_gb', '?')} GB "
        f"memory; {m.get('os', '?')}; Python {m.get('python', '?')}",
        "versions": ", ".join(f"{k} {val}" for k, val in v.items()),
    }
    endpoint = endpoint_of(summary)
    if endpoint is not None:
        fields["endpoint"] = (
            f"{endpoint.get('url')} (configuration {endpoint.get('label')}), "
            f"model {endpoint.get('served_model')}"
        )
    else:
        fields["model"] = (
            f"{s.get('model_description', s.get('model'))}, dtype "
            f"{s.get('dtype')}, max_model_len {s.get('max_model_len')}" + _chunk_note(s)
        )
        fields["clusters"] = (
            f"colocated = 1 instance; P/D = {s.get('num_prefill')} prefill + "
            f"{s.get('num_decode')} decode; {_cores_line(s)}, the kvpush router "
            "in front of each"
        )
    fields["workload"] = _workload_line(s)
    hosts = hosts_line(summary)
    if hosts:
        fields["hosts"] = hosts
    return fields


def _setup(summary: BenchSummary) -> str:
    f = setup_fields(summary)
    lines = [
        "## Setup",
        "",
        f"- **{_machine_name(summary)}:** {f['machine']}",
        f"- **Versions:** {f['versions']}",
    ]
    endpoint = endpoint_of(summary)
    if endpoint is not None:
        lines += endpoint_lines(endpoint)
    else:
        lines += [f"- **Model:** {f['model']}", f"- **Clusters:** {f['clusters']}"]
    lines.append(f"- **Workload:** {f['workload']}")
    if "hosts" in f:
        lines.append(f"- **Hosts:** {f['hosts']}")
    return "\n".join(lines)


def _machine_name(summary: BenchSummary) -> str:
    """Whose machine Setup describes: the run's, or (measuring an endpoint)
    only the benchmark client's."""
    return "Machine" if endpoint_of(summary) is None else "Client machine"


def _cores_line(s: dict[str, object]) -> str:
    """How the instances ran: one core each at TP 1 and DP 1, else their TP
    and DP (on CUDA: one GPU per rank)."""
    tps = {k: s.get(f"{k}_tp") or 1 for k in ("prefill", "decode", "colocated")}
    dps = {k: s.get(f"{k}_dp") or 1 for k in ("prefill", "decode")}
    dp = (
        ""
        if set(dps.values()) == {1}
        else (
            f" (data parallel: prefill DP {dps['prefill']}, decode DP {dps['decode']})"
        )
    )
    if s.get("platform") == "cuda":
        return (
            f"CUDA, one GPU per rank: prefill TP {tps['prefill']}, decode TP "
            f"{tps['decode']}, colocated TP {tps['colocated']}{dp}"
        )
    if set(tps.values()) == {1} and not dp:
        return "one core per instance"
    return (
        f"tensor parallel: prefill TP {tps['prefill']}, decode TP "
        f"{tps['decode']} in every P/D configuration, colocated TP "
        f"{tps['colocated']}{dp}; each instance on its own cores, its ranks "
        "sharing them where it has fewer cores than ranks "
        "(docs/tensor-parallel-cpu.md)"
    )


def _chunk_note(s: dict[str, object]) -> str:
    """The prefill chunk and KV space, where the run set them."""
    notes = []
    if s.get("max_num_batched_tokens"):
        notes.append(
            f"max_num_batched_tokens {s['max_num_batched_tokens']} (the prefill chunk)"
        )
    if s.get("model_preset"):
        notes.append(
            f"model preset {s['model_preset']}, KV space "
            f"{s.get('kv_cache_space_gb')} GB per instance"
        )
    return "".join(f"; {n}" for n in notes)


def _workload_line(s: dict[str, object]) -> str:
    scenario = workload_line(s)
    if scenario is not None:
        return scenario
    arrival = (
        "Poisson arrivals" if s.get("arrival") == "poisson" else "fixed concurrency"
    )
    prefix = s.get("shared_prefix_fraction") or 0
    swept = s.get("prompt_len_sweep")
    prompts = (
        f"{', '.join(str(n) for n in swept)} tokens, one point each"
        if isinstance(swept, list) and swept
        else f"{s.get('prompt_len')} tokens"
    )
    cap = s.get("max_concurrency")
    if cap:
        arrival += f", at most {cap} in flight"
    return (
        f"{s.get('num_requests')} requests per point, {arrival}; prompt lengths "
        f"{prompts} (random token ids, exact), output lengths "
        f"{s.get('output_len')} tokens (ignore_eos); shared prefix {prefix}; seed "
        f"{s.get('seed')}; {s.get('num_warmup')} warm-up requests per "
        "configuration, excluded from the results"
    )


def _config_status(summary: BenchSummary) -> str:
    notes = [c for c in summary.configs if c.status != "ok"]
    if not notes:
        return ""
    lines = ["## Configurations not measured", ""]
    lines += [f"- **{c.label}** {c.status}: {c.reason}" for c in notes]
    return "\n".join(lines)


def _point_section(summary: BenchSummary, info: PointInfo, prefix: str = "") -> str:
    names = _ran(summary)
    arrival = (
        f"Poisson {info.load:g} req/s"
        if info.arrival == "poisson"
        else (f"concurrency {info.load:g}")
    )
    head = (
        f"## {prefix}{info.label}\n\n{info.num_requests} requests, {arrival}, "
        f"prompt {info.prompt_len} tokens."
    )
    stats = {n: summary.stats(n, info.index) for n in names}
    parts = [head, point_table(stats), _burst_note(stats), ratio_table(stats)]
    parts.append(_handover_section(summary, info.index))
    parts.append(_kv_bytes_section(summary, info.index))
    parts.append(_background_note(summary, info.index))
    return "\n\n".join(p for p in parts if p)


def _background_note(summary: BenchSummary, point: int) -> str:
    """CPU that other processes took while each configuration ran this point."""
    loads = []
    for config in summary.configs:
        result = config.point(point)
        if result is not None and result.load is not None:
            loads.append(f"{config.name} {result.load.background_cores:.2f}")
    if not loads:
        return ""
    cores = summary.machine.get("cores", "?")
    return (
        f"Background CPU (other processes on the machine, mean cores of {cores}): "
        + ", ".join(loads)
        + "."
    )


def point_table(stats: dict[str, PointStats | None]) -> str:
    header = [
        "config", "ok / sent", "errors", "TTFT p50", "TTFT p90", "TTFT p99",
        "TTFT mean", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99", "E2E p50",
        "E2E p99", "req/s", "out tok/s",
    ]  # fmt: skip
    rows = []
    for name, st in stats.items():
        if st is None:
            continue
        rows.append([
            name, f"{st.num_ok} / {st.num_requests}", _errors(st),
            _ms(st.ttft_ms, "p50"), _ms(st.ttft_ms, "p90"), _ms(st.ttft_ms, "p99"),
            _ms(st.ttft_ms, "mean"), _ms(st.tpot_ms, "p50"), _ms(st.tpot_ms, "p99"),
            _ms(st.itl_ms, "p50"), _ms(st.itl_ms, "p99"), _ms(st.e2e_ms, "p50"),
            _ms(st.e2e_ms, "p99"), f"{st.request_throughput:.2f}",
            f"{st.output_throughput:.1f}",
        ])  # fmt: skip
    return "Latencies in ms.\n\n" + table(header, rows)


def _burst_note(stats: dict[str, PointStats | None]) -> str:
    bursts = [
        f"{name} {st.num_one_burst} of {st.num_ok}"
        for name, st in stats.items()
        if st is not None and st.num_one_burst
    ]
    if not bursts:
        return ""
    return (
        f"Requests whose tokens all reached the client in one burst: "
        f"{', '.join(bursts)}. The serving processes fell behind (CPU-starved) "
        "and flushed those streams at once: their TTFT includes decoding and "
        "their TPOT is about 0."
    )


def ratio_table(stats: dict[str, PointStats | None]) -> str:
    """Each configuration's TTFT p50/p99 and TPOT p50 over each reference's."""
    refs = [r for r in REFERENCES if stats.get(r) is not None]
    if not refs:
        return ""
    header = ["config"]
    for ref in refs:
        header += [f"TTFT p50 ÷ {ref}", f"TTFT p99 ÷ {ref}", f"TPOT p50 ÷ {ref}"]
    rows = []
    for name, st in stats.items():
        if st is None:
            continue
        cells = [name]
        for ref in refs:
            base = stats[ref]
            for field, pct in (
                ("ttft_ms", "p50"),
                ("ttft_ms", "p99"),
                ("tpot_ms", "p50"),
            ):
                cells.append(_ratio(_get(st, field, pct), _get(base, field, pct)))
        rows.append(cells)
    return "Ratios (below 1 = faster than the reference):\n\n" + table(header, rows)


def _handover_section(summary: BenchSummary, point: int) -> str:
    """Server-side phases where a configuration wrote timelines."""
    parts, client_only = [], []
    for config in summary.configs:
        if config.status != "ok":
            continue
        result = config.point(point)
        if result is None or result.handover is None:
            client_only.append(config.name)
        else:
            table_text = handover_table(result.handover)
            parts.append(f"Handover phases of **{config.name}**:\n\n{table_text}")
    if client_only:
        parts.append(
            f"{', '.join(client_only)}: client view only (no server timelines)."
        )
    return "\n\n".join(parts)


def _kv_bytes_section(summary: BenchSummary, point: int) -> str:
    """KV bytes each P/D configuration moved per request (kv_bytes)."""
    rows = []
    for config in summary.configs:
        result = config.point(point) if config.status == "ok" else None
        kv = result.kv_bytes if result is not None else None
        if kv is None:
            continue
        need = "–" if kv.needed is None else f"{kv.needed / 2**20:.3f}"
        of = "–" if kv.of_needed is None else f"{kv.of_needed:.2f}"
        moved = f"{kv.written / 2**20:.3f}"
        rows.append([config.label, str(kv.num_requests), moved, need, of])
    if not rows:
        return ""
    header = ["config", "requests", "MiB moved / request", "MiB decode needs", "÷ need"]
    return (
        "KV bytes per answered request: what the connector moved (kvpush's "
        "`vllm:kvpush_write_bytes`, vLLM's `vllm:nixl_bytes_transferred`, "
        "read around the point) against what decode needs "
        "(`kvpush.model.kv_size.pushed_bytes`: whole blocks of full layers, a "
        "window's blocks of windowed ones; MLA once per decode rank).\n\n"
        + table(header, rows)
    )


def handover_table(handover: HandoverStats) -> str:
    header = ["phase", "p50 ms", "p99 ms", "mean ms", "n"]
    rows = [
        [phase, _ms(d, "p50"), _ms(d, "p99"), _ms(d, "mean"), str(d.n)]
        for phase, d in handover.phases_ms.items()
    ]
    if handover.joined_by == "request id":
        note = (
            f"{handover.num_requests} of {handover.num_measured} requests had "
            "timelines."
        )
    else:
        note = (
            f"{handover.num_requests} transfers for {handover.num_measured} "
            "requests, attributed to this point by time (the traces name no "
            "request)."
        )
    return table(header, rows) + f"\n\n{note}"


def _descriptors(summary: BenchSummary) -> str:
    """WRITE descriptor counts of the configurations that trace them."""
    lines = [
        descriptor_line(c.label, c.descriptors)
        for c in summary.configs
        if c.descriptors is not None
    ]
    return "## Descriptors per WRITE\n\n" + "\n\n".join(lines) if lines else ""


def _resources(summary: BenchSummary) -> str:
    rows = []
    for config in summary.configs:
        for u in config.usage:
            rows.append([
                config.label, u.name, u.role, f"{u.cpu_cores:.2f}",
                f"{u.cpu_s:.1f}", f"{u.peak_rss_mb:.0f}",
            ])  # fmt: skip
    if not rows:
        return ""
    header = ["config", "process group", "role", "CPU (cores)", "CPU s", "peak RSS MB"]
    return (
        "## Resources\n\nOver each configuration's measured run (warm-up "
        "excluded); RSS sums the group's processes (API server, EngineCore, "
        "Worker).\n\n" + table(header, rows) + _load_table(summary)
    )


def _load_table(summary: BenchSummary) -> str:
    header = ["config", "machine busy", "cluster", "bench client", "background"]
    rows = []
    for c in summary.configs:
        if c.load is None:
            continue
        loads = (c.load.machine_cores, c.load.cluster_cores, c.load.client_cores)
        cells = (*loads, c.load.background_cores)
        rows.append([c.label, *(f"{v:.2f}" for v in cells)])
    if not rows:
        return ""
    return (
        "\n\nMean cores busy over each configuration's measured run. Background "
        "is everything else on the machine: where it is high, that "
        "configuration's figures are disturbed.\n\n" + table(header, rows)
    )


def plot_list(summary: BenchSummary) -> list[tuple[str, str]]:
    """(file, caption) of every plot the run draws, the telling one first."""
    axis = AXIS_NAMES.get(plot_axis(summary), plot_axis(summary))
    files = plot_files(plot_axis(summary), summary.settings.get("workload", "sweep"))
    first = []
    if "overhead" in files:
        first.append((files["overhead"], f"Handover overhead against {axis}"))
    if "goodput" in files:
        first.append((files["goodput"], f"Goodput against {axis}"))
    return [
        *first,
        (files["ttft"], f"TTFT p50 and p99 against {axis}"),
        (files["tpot"], f"TPOT p50 and p99 against {axis}"),
        (files["cdf"], "TTFT CDF per point"),
        (files["timeline"], "Timeline of sample requests"),
    ]


def _plots(summary: BenchSummary, image_dir: str) -> str:
    prefix = f"{image_dir.rstrip('/')}/" if image_dir else ""
    images = [f"![{caption}]({prefix}{file})" for file, caption in plot_list(summary)]
    return "\n\n".join(["## Plots", *images])


_DEFINITIONS = """## Definitions

Client-side, as `vllm bench serve` defines them: **TTFT** = first streamed
token − send; **TPOT** = (E2E − TTFT) / (output tokens − 1); **ITL** = gaps
between streamed tokens; **E2E** = last token − send. Throughputs divide
successful requests (or their output tokens) by the point's duration, first
send to last response. Errors and timeouts are counted, never dropped."""


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _ran(summary: BenchSummary) -> list[str]:
    return [c.name for c in summary.configs if c.status == "ok"]


def _get(st: PointStats | None, field: str, pct: str) -> float | None:
    dist: Dist | None = getattr(st, field) if st is not None else None
    return getattr(dist, pct) if dist is not None else None


def _ms(dist: Dist | None, pct: str) -> str:
    if dist is None:
        return "–"
    value: float = getattr(dist, pct)
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _ratio(value: float | None, reference: float | None) -> str:
    r = ratio(value, reference)
    return "–" if r is None else f"{r:.2f}"


def _errors(st: PointStats) -> str:
    parts = [f"{kind} {n}" for kind, n in sorted(st.errors.items())]
    if st.num_short_output:
        parts.append(f"short output {st.num_short_output}")
    return ", ".join(parts) or "0"
