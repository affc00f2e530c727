"""Shutdown of the writer thread (issue 9 item 9): ``close`` never cancels
a WRITE in flight, and reports one still running so that memory stays
registered. The rest of issue 9's defects (preemption, NIXL errors,
duplicate ids, fences, a forgotten decode) are tested on the pure
pipeline in ``test_prefill_pipeline.py``. ``end_write`` serves the other
thread-rig tests: a WRITE scripted ``FOREVER`` (the pipeline rig's) ends
when the test says.
"""

from __future__ import annotations

from collections import deque

from tests.fakes.fake_nixl import WriteRecord, wait_for
from tests.unit.prefill_pipeline_rig import FOREVER
from tests.unit.test_connector_writer import Rig


def end_write(rig: Rig, write: WriteRecord, state: str = "DONE") -> None:
    """A WRITE scripted to run for ever (:data:`FOREVER`) ends at its next
    poll, as ``state`` says."""
    with rig.io._lock:
        write.states = deque([state])


# -- item 9: shutdown ------------------------------------------------------------


def test_close_never_cancels_a_write_and_reports_one_still_running():
    # (the side channel closes only after the WRITEs ended:
    # test_connector_prefill_close.py)
    rig = Rig()
    rig.io.script_polls(*FOREVER)
    rig.hello()
    rig.register()
    rig.ready()
    assert wait_for(lambda: rig.io.writes_snapshot())

    assert not rig.writer.close(drain_s=0.05), "the memory must stay registered"
    (write,) = rig.io.writes_snapshot()
    assert not write.cancelled and not write.released
