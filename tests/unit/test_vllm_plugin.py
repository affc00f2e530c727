"""kvpush's vLLM plugin: with kvpush installed, vLLM's own server finds
``KvPushConnector`` (and the fair NIXL baselines) by name, without
``kv_connector_module_path``. vLLM calls the plugin in every process, maybe
more than once, and must start even when the plugin cannot register."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
import vllm.plugins
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import (
    KVConnectorFactory,
)

REPO = Path(__file__).resolve().parents[2]
GROUP = "vllm.general_plugins"
FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"
NAMES = {
    "KvPushConnector": "kvpush.connector.connector",
    "FairNixlConnector": "kvpush.baselines.fair_nixl",
    "FairNixlPushConnector": "kvpush.baselines.fair_nixl",
}


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, Callable[[], Any]]:
    """vLLM's connector registry as vLLM starts it (without kvpush's names);
    the real one is put back afterwards."""
    fresh = {k: v for k, v in KVConnectorFactory._registry.items() if k not in NAMES}
    monkeypatch.setattr(KVConnectorFactory, "_registry", fresh)
    return fresh


def _register() -> None:
    from kvpush.vllm_plugin import register

    register()


def test_the_installed_distribution_declares_the_plugin() -> None:
    (ep,) = [e for e in entry_points(group=GROUP) if e.name == "kvpush"]
    assert ep.value == "kvpush.vllm_plugin:register"
    assert ep.dist is not None and ep.dist.name == "kvpush"
    assert callable(ep.load())


def test_the_plugin_registers_each_connector_by_its_class_name(
    registry: dict[str, Callable[[], Any]],
) -> None:
    _register()
    assert NAMES.keys() <= registry.keys()
    for name, module in NAMES.items():
        cls = KVConnectorFactory.get_connector_class_by_name(name)
        assert (cls.__module__, cls.__name__) == (module, name)


def test_a_kv_transfer_config_naming_only_the_connector_finds_it(
    registry: dict[str, Callable[[], Any]],
) -> None:
    config = KVTransferConfig(
        kv_connector="KvPushConnector", kv_role="kv_producer", engine_id="prefill0"
    )
    with pytest.raises(ValueError, match="Unsupported connector type"):
        KVConnectorFactory.get_connector_class(config)
    _register()
    cls = KVConnectorFactory.get_connector_class(config)
    assert f"{cls.__module__}.{cls.__name__}" == (
        "kvpush.connector.connector.KvPushConnector"
    )


def test_calling_the_plugin_again_changes_nothing(
    registry: dict[str, Callable[[], Any]],
) -> None:
    _register()
    first = {name: registry[name] for name in NAMES}
    _register()
    _register()
    assert {name: registry[name] for name in NAMES} == first


def test_a_name_another_plugin_took_is_left_to_it(
    registry: dict[str, Callable[[], Any]],
) -> None:
    KVConnectorFactory.register_connector(
        "KvPushConnector", "someone.else", "KvPushConnector"
    )
    theirs = registry["KvPushConnector"]
    _register()
    assert registry["KvPushConnector"] is theirs
    assert {"FairNixlConnector", "FairNixlPushConnector"} <= registry.keys()


def test_without_vllm_s_connector_factory_the_plugin_does_nothing(
    monkeypatch: pytest.MonkeyPatch, registry: dict[str, Callable[[], Any]]
) -> None:
    """A vLLM whose factory moved: the plugin must not stop vLLM starting."""
    monkeypatch.setitem(sys.modules, FACTORY, None)
    _register()
    assert not NAMES.keys() & registry.keys()


@pytest.mark.parametrize("allowed", [None, "kvpush"])
def test_vllm_s_plugin_loader_finds_and_runs_it(
    monkeypatch: pytest.MonkeyPatch,
    registry: dict[str, Callable[[], Any]],
    allowed: str | None,
) -> None:
    """What every vLLM process does at start-up (``VLLM_PLUGINS`` unset, or
    naming the plugin)."""
    if allowed is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", allowed)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    assert NAMES.keys() <= registry.keys()


def test_registering_imports_nothing_of_the_connector() -> None:
    """Registration is by module path: a vLLM process that never uses
    kvpush's connector does not import it, NIXL or torch. (vLLM's registry is
    a recording stand-in here, so that nothing else imports them either.)"""
    code = (
        "import sys, types\n"
        "calls = []\n"
        "class KVConnectorFactory:\n"
        "    register_connector = staticmethod(lambda *a: calls.append(a))\n"
        "factory = types.ModuleType('factory')\n"
        "factory.KVConnectorFactory = KVConnectorFactory\n"
        f"sys.modules[{FACTORY!r}] = factory\n"
        "from kvpush.vllm_plugin import register\n"
        "register()\n"
        "print('REGISTERED', sorted(name for name, _, _ in calls))\n"
        "heavy = ('kvpush.connector', 'kvpush.baselines', 'nixl', 'torch', 'vllm')\n"
        "print('LOADED', [m for m in heavy if m in sys.modules])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == [
        f"REGISTERED {sorted(NAMES)}",
        "LOADED []",
    ]
