"""``kvpush forget ENGINE_ID``: an operator's proof that a prefill is gone.

Decode cannot tell a prefill whose host died from one behind a partition,
so it keeps that prefill's receives, and their destination blocks, until
the prefill answers or is proven gone (docs/design.md, R5 "What proves a prefill gone").
This command is the proof for a host that will not come back: it writes
``forget/ENGINE_ID.json`` into the control directory of every decode of a
run (``RUN_DIR/control/<decode>``, or the one ``--control-dir`` names),
which each decode worker reads at its next step
(:mod:`kvpush.connector.control`).
"""

from __future__ import annotations

from pathlib import Path

from kvpush.connector.control import check_engine_id, write_forget
from kvpush.launcher.instances import control_dir_of
from kvpush.launcher.state import TOPOLOGY_FILE
from kvpush.topology import load_topology


def meaning(engine_id: str) -> str:
    """What a forget of ``engine_id`` does, and when it is safe."""
    return (
        f"decode instances will treat prefill {engine_id} as gone: every "
        "receive from it fails (vLLM recomputes those prompts, or fails them, "
        "by --kv-load-failure-policy) and its quarantined blocks are "
        f"released. Only do this once {engine_id}'s host is confirmed down "
        "(powered off, or its processes killed), or its WRITEs may still "
        "land in blocks that decode reuses."
    )


def control_dirs(engine_id: str, run_dir: Path) -> list[Path]:
    """The control directory of each decode of the cluster in ``run_dir``;
    ValueError unless that cluster is kvpush's and ``engine_id`` one of its
    prefills."""
    path = run_dir / TOPOLOGY_FILE
    if not path.exists():
        raise ValueError(
            f"no cluster in {run_dir} (no {TOPOLOGY_FILE}); for an instance "
            "started another way give its --control-dir"
        )
    topology = load_topology(path)
    if topology.mode != "kvpush":
        raise ValueError(
            f"the cluster in {run_dir} runs {topology.mode}: only kvpush's "
            "decodes read forget files"
        )
    prefills = [b.engine_id for b in topology.prefills]
    if engine_id not in prefills:
        raise ValueError(
            f"{engine_id!r} is not a prefill of the cluster in {run_dir} "
            f"(its prefills: {', '.join(prefills) or 'none'})"
        )
    root = run_dir.absolute()
    # every decode, and any other instance that receives too (--kv-both:
    # its connector made its control directory at start)
    return [
        control_dir_of(root, b.engine_id)
        for b in topology.backends
        if b.role == "decode"
        or (b.engine_id != engine_id and control_dir_of(root, b.engine_id).is_dir())
    ]


def targets(
    engine_id: str, run_dir: Path | None = None, control_dir: Path | None = None
) -> list[Path]:
    """The control directories a forget of prefill ``engine_id`` goes to:
    each decode's of ``run_dir``'s cluster, or ``control_dir`` (which must
    exist: the decode made it at start); ValueError when refused."""
    check_engine_id(engine_id)
    if (run_dir is None) == (control_dir is None):
        raise ValueError("give one of a run directory or a control directory")
    if control_dir is not None:
        if not control_dir.is_dir():
            raise ValueError(
                f"no control directory {control_dir}: give the decode's "
                "kv_connector_extra_config.control_dir (it makes it at start)"
            )
        return [control_dir]
    assert run_dir is not None
    return control_dirs(engine_id, run_dir)


def forget(
    engine_id: str,
    run_dir: Path | None = None,
    control_dir: Path | None = None,
    at: float | None = None,
) -> list[Path]:
    """Write the forget file of prefill ``engine_id`` into each of its
    :func:`targets`; the files written."""
    dirs = targets(engine_id, run_dir, control_dir)
    return [write_forget(d, engine_id, at) for d in dirs]
