"""The fault file reaches the writer thread: its post delay, read from the
file while the writer runs, holds a matched transfer past its deadline.
Every fault itself (cancels, a new boot, silence, delays) is tested on the
pure pipeline in ``test_prefill_pipeline.py``. Ends with nothing held
(``Rig.close``)."""

from __future__ import annotations

import json
from pathlib import Path

from kvpush.transfer.messages import Cause, Failure
from tests.fakes.fake_nixl import wait_for
from tests.unit.test_connector_writer import DECODE_ROUTE, Rig


def failures(rig: Rig, route: bytes = DECODE_ROUTE) -> list[Failure]:
    return rig.replies_to(route, Failure)  # type: ignore[return-value]


def test_fault_file_delay_past_the_deadline_expires_the_transfer(tmp_path: Path):
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"delay_post_s": 1.5}))
    rig = Rig(fault_file=str(faults))
    try:
        rig.hello()
        rig.register(ttl_s=2.0)  # post deadline: arrival + 1 s
        rig.ready()

        assert rig.wait_finished("req-1", timeout_s=3.0)
        assert wait_for(lambda: failures(rig))
        assert failures(rig)[0].cause is Cause.EXPIRED
        assert rig.io.writes_snapshot() == []
        assert rig.counters.get("expired.matched") == 1
    finally:
        rig.close()
