"""The report's parts for a run against a running deployment (``--base-url``,
:mod:`kvpush_lab.bench.endpoint`): what was measured, and what was not.
Pure rendering of ``settings["endpoint"]``."""

from __future__ import annotations

from typing import Any

from kvpush_lab.bench.summary import BenchSummary


def endpoint_of(summary: BenchSummary) -> dict[str, Any] | None:
    """The measured endpoint's settings (None: the run started clusters)."""
    endpoint = summary.settings.get("endpoint")
    return endpoint if isinstance(endpoint, dict) else None


def endpoint_lines(endpoint: dict[str, Any]) -> list[str]:
    """The Setup lines that replace the model's and the clusters'."""
    max_len = endpoint.get("max_model_len")
    reported = f", max_model_len {max_len} (as it reports)" if max_len else ""
    return [
        f"- **Endpoint:** {endpoint.get('url')} (configuration "
        f"**{endpoint.get('label')}**), model `{endpoint.get('served_model')}`"
        f"{reported}; /v1/completions, streamed. A deployment already running: "
        "the benchmark started and stopped no cluster",
        f"- **Prompt tokens:** {endpoint.get('prompt_tokens')}",
    ]


def not_measured_section(endpoint: dict[str, Any]) -> str:
    """What a run on owned clusters reports and this one could not."""
    lines = endpoint.get("not_measured") or []
    if not lines:
        return ""
    return "\n".join(
        [
            "## Not measured against an endpoint",
            "",
            "This run measured the endpoint from the client only "
            "(TTFT, TPOT, ITL, E2E, throughput). Left out:",
            "",
            *(f"- {line}" for line in lines),
        ]
    )
