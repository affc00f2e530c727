"""``kvpush soak``: one cluster for minutes, the client aborting some
requests; nothing may be lost or leak.

Module map. Pure: ``config`` (SoakConfig), ``plan`` (schedule, aborts,
prompts), ``outcome`` (completed / aborted / failed / lost), ``leaks`` (KV
blocks left after drain), ``report`` (soak.json, soak.md), ``export``
(the published section's results.json).
I/O: ``driver`` (sending, aborting, settling), ``counters`` (the
connector's counters), ``cli`` (the command, also ``python -m
kvpush_lab.soak``). It reuses the benchmark's cluster set-up, client and
publishing (the soak depends on ``kvpush_lab.bench``, never the reverse),
and reads ``/metrics`` with ``kvpush.telemetry``.
"""
