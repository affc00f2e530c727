"""Part b: NIXL's own calls for one large WRITE, timed one by one.

Two real agents in this process (UCX backend, host memory, NIXL's progress
thread off as in :class:`kvpush.connector.nixl_io.NixlIO`) write to each
other. Each registers 80 layers x 2 regions x 2000 blocks of 256 B of numpy
memory (82 MB an agent): the block count and descriptor shapes of
:mod:`.build`, with small blocks so memory stays modest. Per round and case:

* ``get_xfer_descs`` of both sides from kvpush's numpy arrays (now), and
  from lists of tuples (before: what the old ``NixlIO.write`` handed over);
* ``initialize_xfer`` (NIXL checks and prepares both lists);
* ``transfer`` (the post);
* ``check_xfer_state`` per poll after the post (here the first poll already
  finds it DONE: UCX copied host memory inside the post), and the time from
  the post until DONE (the target agent is progressed in between, as
  decode's polling does);
* ``release_xfer_handle``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from kvpush.transfer.coalesce import Descs, descriptors, runs
from kvpush.transfer.layout import KvLayout
from kvpush_lab.bench.micro.build import CASES, NUM_LAYERS, REGIONS_PER_LAYER, workload
from kvpush_lab.bench.micro.stats import Spread

BLOCK_BYTES = 256
NUM_BLOCKS = 2000
DONE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class CallTiming:
    case: str
    call: str
    seconds: Spread
    num_descs: int  # per side


class _Agent:
    """One NIXL agent with one numpy buffer registered as a KV layout."""

    def __init__(self, name: str) -> None:
        from kvpush.nixl_build import nixl_api

        api = nixl_api()
        nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.agent: Any = nixl_agent(name, config)
        span = NUM_BLOCKS * BLOCK_BYTES
        count = NUM_LAYERS * REGIONS_PER_LAYER
        self.buffer = np.zeros(count * span, dtype=np.uint8)  # owned until close
        base = int(self.buffer.ctypes.data)
        self.layout = KvLayout(
            num_blocks=NUM_BLOCKS,
            block_bytes=BLOCK_BYTES,
            block_size=16,
            base_addrs=tuple(base + r * span for r in range(count)),
            regions_per_layer=REGIONS_PER_LAYER,
        )
        regions = [(a, span, 0, "") for a in self.layout.base_addrs]
        self.reg = self.agent.get_reg_descs(regions, "DRAM")
        self.agent.register_memory(self.reg)

    def close(self) -> None:
        self.agent.deregister_memory(self.reg)


def measure_nixl(rounds: int) -> list[CallTiming]:
    """Every call of :func:`_one_write` over ``rounds`` rounds per case (one
    untimed warm-up round first: it opens the UCX connection)."""
    src, dst = _Agent("kvpush-bench-src"), _Agent("kvpush-bench-dst")
    try:
        peer = src.agent.add_remote_agent(dst.agent.get_agent_metadata())
        peer = peer.decode() if isinstance(peer, bytes) else peer
        out = []
        for case in CASES:
            w = workload(case, src.layout, dst.layout)
            descs = descriptors(runs(w.src, w.dst), src.layout, dst.layout, w.layers)
            samples: dict[str, list[float]] = defaultdict(list)
            for i in range(rounds + 1):
                timed = _one_write(src.agent, dst.agent, peer, *descs)
                for call, seconds in timed.items():
                    if i > 0:
                        samples[call] += seconds
            out += [
                CallTiming(case, call, Spread.of(s), len(descs[0]))
                for call, s in samples.items()
            ]
        src.agent.remove_remote_agent(peer)
        return out
    finally:
        src.close()
        dst.close()


def _one_write(
    agent: Any, target: Any, peer: str, src: Descs, dst: Descs
) -> dict[str, list[float]]:
    """Seconds per NIXL call for one WRITE of ``src`` into ``peer``'s ``dst``."""
    out: dict[str, list[float]] = defaultdict(list)

    def timed(call: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = fn()
        out[call].append(time.perf_counter() - start)
        return result

    src_tuples = [tuple(row) for row in src.tolist()]
    dst_tuples = [tuple(row) for row in dst.tolist()]
    timed(
        "get_xfer_descs x2, tuple lists (before)",
        lambda: (
            agent.get_xfer_descs(src_tuples, "DRAM"),
            agent.get_xfer_descs(dst_tuples, "DRAM"),
        ),
    )
    src_d, dst_d = timed(
        "get_xfer_descs x2, numpy (now)",
        lambda: (agent.get_xfer_descs(src, "DRAM"), agent.get_xfer_descs(dst, "DRAM")),
    )
    handle = timed(
        "initialize_xfer",
        lambda: agent.initialize_xfer("WRITE", src_d, dst_d, peer, b"done"),
    )
    posted = time.perf_counter()
    state = timed("transfer (post)", lambda: agent.transfer(handle))
    deadline = posted + DONE_TIMEOUT_S
    poll = partial(agent.check_xfer_state, handle)
    while state == "PROC" and time.perf_counter() < deadline:
        target.get_new_notifs()  # the target progresses too (decode polls it)
        state = timed("check_xfer_state (a poll)", poll)
    if state != "DONE":
        raise RuntimeError(f"NIXL WRITE ended {state} in the benchmark")
    out["post until DONE"].append(time.perf_counter() - posted)
    timed("release_xfer_handle", lambda: agent.release_xfer_handle(handle))
    target.get_new_notifs()
    return out
