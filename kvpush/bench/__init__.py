"""``kvpush bench``: configurations side by side on one workload.

Module map. Pure core: ``config`` (BenchConfig, presets), ``lengths``
(length distributions), ``workload`` (requests and arrivals from the seed),
``records`` (the raw per-request record), ``stats`` (TTFT, TPOT, ITL,
percentiles), ``timeline`` (server timelines and the handover phases),
``summary`` (the typed summary.json), ``report`` (markdown). I/O shells:
``inputs`` (model, tokenizer, traces), ``client`` (streaming HTTP),
``loadgen`` (Poisson or fixed-concurrency sending), ``resources`` (machine,
versions, per-instance CPU and memory), ``runner`` (clusters in turn),
``plots``, ``outputs`` (report, plots, BENCHMARKS.md), ``screen`` (the
final table), ``cli`` (the ``bench`` subcommand).

The soak (``python -m kvpush.bench.soak``: one cluster for minutes, the
client aborting some requests; nothing may be lost or leak). Pure:
``soak_config``, ``soak_plan`` (schedule, aborts, prompts), ``soak_outcome``
(completed / aborted / failed / lost), ``prometheus`` (metrics text),
``soak_leaks`` (KV blocks left after drain), ``soak_report`` (soak.json, the
markdown section), ``sections`` (marked sections of BENCHMARKS.md). I/O:
``soak_driver`` (sending, aborting, settling), ``soak_counters`` (the
connector's counter files), ``soak`` (the command).
"""

from kvpush.bench.config import BenchConfig, make_config

__all__ = ["BenchConfig", "make_config"]
