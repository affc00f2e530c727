"""The Prometheus metrics kvpush exports and reads.

Module map: ``names`` (every family kvpush exports or reads: its name,
type and labels, the one place they are spelled) and ``reader`` (one
``/metrics`` text, parsed by ``prometheus_client``'s parser, looked up by
name and labels). Pure: no I/O, no vLLM; the connector's and the router's
exporters, the router's scrapes, the bench, the soak and the tests all use
both.
"""
