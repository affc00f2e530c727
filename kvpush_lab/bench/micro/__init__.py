"""``kvpush bench-micro``: micro-benchmarks of the connector's own work,
run in one process with no vLLM.

* :mod:`.build` — kvpush's descriptor build (runs + descriptors) for an
  80-layer, 1000-block WRITE, contiguous and fragmented, the numpy code
  against the pure-Python code it replaced (kept in :mod:`.baseline`);
* :mod:`.nixl_calls` — NIXL's own calls on the same descriptors, timed one
  by one with two real agents (UCX, host memory) writing to each other;
* :mod:`.writer_cpu` — the writer thread's CPU while 1000 transfers wait in
  the matcher, and while 100 WRITEs are in flight;
* :mod:`.decode_step` — a stand-in engine step with decode's NIXL progress
  thread absent, idle (no receive awaited) and polling;
* :mod:`.report` makes the published ``micro`` section's results and the
  printed tables;
  :mod:`.cli` wires the command.

Timings are repeated rounds reported as median and p10–p90 (see
:mod:`.stats`); they are measurements of this machine, never assertions.
"""
