"""kvpush's vLLM plugin: its connectors by name in vLLM's connector registry,
and ``nixl`` where one NIXL build is installed without NIXL's meta package.

Installing kvpush declares :func:`register` in vLLM's ``vllm.general_plugins``
entry-point group (name ``kvpush``; list it in ``VLLM_PLUGINS`` where that
allowlist is set). vLLM calls it at start-up in every process (API server,
EngineCore, each Worker), so a plain ``vllm serve`` takes::

    --kv-transfer-config '{"kv_connector": "KvPushConnector", ...}'

with no ``kv_connector_module_path``. ``FairNixlConnector`` and
``FairNixlPushConnector`` (vLLM's NIXL pull and push connectors with the two
CPU-host fixes of :mod:`kvpush.baselines.fair_nixl`) are registered alike,
so the fair baselines start the same way.

It also lets ``import nixl`` work where kvpush's extras installed one NIXL
build (``nixl-cu13``) and not NIXL's ``nixl`` meta package, which is what
provides that module: vLLM's own NIXL connectors (the baselines) import
``nixl._api``. :func:`kvpush.nixl_build.alias_meta_package` puts a finder
last on ``sys.meta_path`` that loads the build when something first imports
``nixl``; where the meta package is installed it is left alone.

The contract vLLM sets for general plugins, and how this one keeps it:

* **Called more than once per process**: a name already registered is left
  as it is (kvpush's own from an earlier call, or another plugin's).
* **Cheap**: vLLM's registry takes a module path and a class name and imports
  the module only when a kv-transfer config names that connector; nothing of
  kvpush's connector, torch or NIXL is imported here. Importing vLLM's
  registry itself costs about 30 ms in the API server (every other vLLM
  process imports it anyway). The NIXL alias only looks NIXL's packages up
  on the path (under 1 ms): importing a build costs about 50 ms beyond
  numpy, and a NIXL imported before vLLM's connector would keep vLLM from
  setting ``UCX_RCACHE_MAX_UNRELEASED`` first.
* **Never stops vLLM**: vLLM runs plugins without catching their errors; a
  vLLM whose registry moved or changed makes this a logged no-op, and so
  does an alias that cannot be put in place. A kvpush installed without its
  connector's dependencies fails only when its connector is chosen, with
  vLLM's import error naming what is missing; a NIXL build that does not
  load fails vLLM's own import of ``nixl``, which vLLM reports.
"""

from __future__ import annotations

import logging

from kvpush.nixl_build import alias_meta_package

logger = logging.getLogger(__name__)

# (name in kv_connector, module, class): vLLM imports the module lazily.
CONNECTORS: tuple[tuple[str, str, str], ...] = (
    ("KvPushConnector", "kvpush.connector.connector", "KvPushConnector"),
    ("FairNixlConnector", "kvpush.baselines.fair_nixl", "FairNixlConnector"),
    ("FairNixlPushConnector", "kvpush.baselines.fair_nixl", "FairNixlPushConnector"),
)


def register() -> None:
    """Register kvpush's connectors with vLLM's ``KVConnectorFactory`` and
    alias ``nixl`` to the installed NIXL build where the meta package is
    absent (vLLM's ``vllm.general_plugins`` entry point; idempotent)."""
    try:
        alias_meta_package()
    except Exception as e:  # vLLM's own NIXL import then says what is wrong
        logger.warning("kvpush: cannot alias nixl to a NIXL build (%s)", e)
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import (
            KVConnectorFactory,
        )

        add = KVConnectorFactory.register_connector
    except (ImportError, AttributeError) as e:
        logger.warning("kvpush: vLLM's connector registry not found (%s)", e)
        return
    for name, module, class_name in CONNECTORS:
        try:
            add(name, module, class_name)
        except ValueError:  # vLLM's answer to a name already registered
            logger.debug("kvpush: connector %s already registered", name)
