"""vLLM's current block tables, as its scheduler offers them to a connector
(``scheduler_output.kv_connector_block_state``), for the scripted scheduler
outputs of the unit tests: each output's allocations applied in order (a
new request's whole table, a cached one's new blocks appended, a resumed
one's table replaced). Cleared before every test (``tests/unit/conftest.py``)."""

from __future__ import annotations

from typing import Any

TABLES: dict[str, list[list[int]]] = {}


class BlockState:
    """What ``KVConnectorBlockState.get_block_ids`` answers: the request's
    current tables (one list per KV-cache group), None for one vLLM has
    not allocated."""

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...] | None:
        table = TABLES.get(req_id)
        return None if table is None else tuple(list(g) for g in table)


def apply(out: Any) -> None:
    """Record one scripted output's allocations."""
    for new in out.scheduled_new_reqs:
        TABLES[new.req_id] = [list(g) for g in new.block_ids]
    cached = out.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        more = cached.new_block_ids[i]
        if more is None:
            continue
        if rid in cached.resumed_req_ids or rid not in TABLES:
            TABLES[rid] = [list(g) for g in more]
        else:
            for ids, extra in zip(TABLES[rid], more, strict=True):
                ids.extend(extra)
