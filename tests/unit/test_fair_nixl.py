"""The fair-baseline wrapper changes exactly two things around the
construction of vLLM's NIXL worker, and undoes its patch afterwards."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from kvpush.nixl_build import alias_meta_package

alias_meta_package()  # kvpush's vLLM plugin, before vLLM imports its NIXL worker
fair_nixl = pytest.importorskip("kvpush.baselines.fair_nixl")


def _bindings():
    return sys.modules[fair_nixl.base_worker.NixlWrapper.__module__].nixlBind


def test_progress_thread_gets_a_poll_delay() -> None:
    seen = []
    make = fair_nixl._with_progress_delay(lambda name, cfg: seen.append(cfg), 500)
    config = SimpleNamespace(pthrDelay=0)
    make("agent", config)
    assert seen == [config] and config.pthrDelay == fair_nixl.PROGRESS_DELAY_US == 500


def test_affinity_restored_and_binding_unpatched_after_construction() -> None:
    before = os.sched_getaffinity(0)
    original = _bindings().nixlAgent
    with fair_nixl.fair_worker_construction():
        assert _bindings().nixlAgent is not original
        # What vLLM's NIXL worker does while it is constructed.
        os.sched_setaffinity(0, {max(before)})
    assert os.sched_getaffinity(0) == before
    assert _bindings().nixlAgent is original
