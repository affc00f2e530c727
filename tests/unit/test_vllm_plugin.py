"""kvpush's vLLM plugin: with kvpush installed, vLLM's own server finds
``KvPushConnector`` (and the fair NIXL baselines) by name, without
``kv_connector_module_path``, and vLLM's own NIXL connectors find the one
NIXL build kvpush's extras install. vLLM calls the plugin in every process,
maybe more than once, and must start even when the plugin cannot register."""

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

from kvpush.nixl_build import BUILDS
from tests.unit.test_nixl_build import run_isolated, write_fake_nixl

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
    the real one, and the import system's finders, are put back afterwards."""
    fresh = {k: v for k, v in KVConnectorFactory._registry.items() if k not in NAMES}
    monkeypatch.setattr(KVConnectorFactory, "_registry", fresh)
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path])
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


# vLLM's registry as a recording stand-in, then the plugin's call.
REGISTER_WITH_A_STAND_IN = (
    "import sys, types\n"
    "calls = []\n"
    "class KVConnectorFactory:\n"
    "    register_connector = staticmethod(lambda *a: calls.append(a))\n"
    "factory = types.ModuleType('factory')\n"
    "factory.KVConnectorFactory = KVConnectorFactory\n"
    f"sys.modules[{FACTORY!r}] = factory\n"
    "from kvpush.vllm_plugin import register\n"
    "register()\n"
)


def test_registering_imports_nothing_of_the_connector() -> None:
    """Registration is by module path: a vLLM process that never uses
    kvpush's connector does not import it, NIXL or torch. (vLLM's registry is
    a recording stand-in here, so that nothing else imports them either.)"""
    code = (
        REGISTER_WITH_A_STAND_IN
        + "print('REGISTERED', sorted(name for name, _, _ in calls))\n"
        "heavy = ('kvpush.connector', 'kvpush.baselines', 'nixl', 'nixl_cu13',"
        " 'nixl_cu12', 'torch', 'vllm')\n"
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


def test_with_one_nixl_build_and_no_meta_package_import_nixl_loads_it(
    tmp_path: Path,
) -> None:
    """kvpush's extras install one NIXL build (nixl-cu13), not NIXL's ``nixl``
    meta package that provides ``import nixl``; vLLM's NIXL connectors (the
    baselines) import ``nixl._api`` and ``nixl._bindings``. After the
    plugin ran they load the build, which is imported only then (a Python
    seeing only kvpush and fake NIXL packages)."""
    fakes = write_fake_nixl(tmp_path, meta=False, builds=("nixl_cu13",))
    code = REGISTER_WITH_A_STAND_IN + (
        "import importlib\n"
        "print('BEFORE', [m for m in sys.modules if m.startswith('nixl')])\n"
        "api = importlib.import_module('nixl._api')\n"
        "bindings = importlib.import_module('nixl._bindings')\n"
        "print('NIXL', api.__name__, bindings.__name__)\n"
    )
    assert run_isolated(code, fakes)[-2:] == [
        "BEFORE []",
        "NIXL nixl_cu13._api nixl_cu13._bindings",
    ]


def test_the_plugin_never_stops_vllm_over_nixl(tmp_path: Path) -> None:
    """No NIXL at all, or a broken build: the plugin still registers, and
    vLLM's own import of NIXL is what fails (vLLM reports it)."""
    broken = write_fake_nixl(tmp_path / "broken", meta=False, builds=("nixl_cu13",))
    (broken / "nixl_cu13" / "_api.py").write_text("raise OSError('libucp.so')\n")
    code = REGISTER_WITH_A_STAND_IN + (
        "print('REGISTERED', len(calls))\n"
        "try:\n"
        "    import nixl._api\n"
        "except (ImportError, OSError) as e:\n"
        "    print('NIXL', type(e).__name__, e)\n"
    )
    assert run_isolated(code, tmp_path)[-2:] == [  # nothing NIXL's at all
        "REGISTERED 3",
        "NIXL ModuleNotFoundError No module named 'nixl'",
    ]
    assert run_isolated(code, broken)[-2:] == ["REGISTERED 3", "NIXL OSError libucp.so"]


def test_vllm_s_nixl_wrapper_is_nixl_s_agent_after_the_plugin_ran(
    monkeypatch: pytest.MonkeyPatch, registry: dict[str, Callable[[], Any]]
) -> None:
    """Here, with whichever NIXL this environment installed (the meta
    package, or one build alone): vLLM's NIXL connectors get NIXL's agent
    from a ``nixl`` imported after the plugin ran, as in a vLLM process."""
    nixl_utils = pytest.importorskip("vllm.distributed.nixl_utils")
    for name in [m for m in sys.modules if m == "nixl" or m.startswith("nixl.")]:
        monkeypatch.delitem(sys.modules, name)  # the build stays imported
    for name in ("NixlWrapper", "nixl_agent_config"):  # vLLM's cached lookups
        monkeypatch.delitem(vars(nixl_utils), name, raising=False)
    monkeypatch.setenv("UCX_RCACHE_MAX_UNRELEASED", "1024")  # vLLM sets it
    _register()
    assert nixl_utils.is_nixl_available()
    wrapper, config = nixl_utils.NixlWrapper, nixl_utils.nixl_agent_config
    assert wrapper.__name__ == "nixl_agent"
    assert wrapper.__module__ in {f"{build}._api" for build in BUILDS}
    assert config.__module__ == wrapper.__module__
