"""``kvpush bench``: configurations side by side on one workload.

Module map. Pure core: ``config`` (BenchConfig, presets), ``lengths``
(length distributions), ``workload`` (requests and arrivals from the seed),
``records`` (the raw per-request record), ``stats`` (TTFT, TPOT, ITL,
percentiles), ``timeline`` (server timelines and the handover phases),
``summary`` (the typed summary.json), ``report`` (markdown) and
``report_net`` (its multi-host rehearsal parts), ``links`` (bytes over the
rehearsal links, CPU per GiB), ``bandwidth`` (achieved MiB/s per KV
transfer, from kvpush's traces or vLLM's NIXL histograms; ``/metrics``
read with ``kvpush.telemetry``), ``results`` (a published section's typed
results.json; the soak and the micro-benchmarks write one too), ``export``
(a run's summary as those results), ``render`` (BENCHMARKS.md and each
section's README.md from every results.json). I/O shells:
``inputs`` (model, tokenizer, traces), ``client`` (streaming HTTP),
``loadgen`` (Poisson or fixed-concurrency sending), ``resources`` (machine,
versions, per-instance CPU and memory), ``runner`` (clusters in turn),
``plots``, ``outputs`` (report, plots, results.json; publishing a
section), ``screen`` (the
final table), ``cli`` (the ``bench`` subcommand).
"""

from kvpush_lab.bench.config import BenchConfig, make_config

__all__ = ["BenchConfig", "make_config"]
