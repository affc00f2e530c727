"""Which NIXL build kvpush uses: the meta package's ``nixl._api`` where it is
installed, else the one build kvpush's extras install (``nixl-cu13``), chosen
as NIXL chooses (torch's CUDA major, else cu13 before cu12), with an error
naming what to pip install when there is none; and ``import nixl`` for vLLM's
own connectors where only a build is installed.

The choice is tested on fake modules in ``sys.modules`` (``None`` there is a
package that is not installed); the alias on fake builds on disk, in a
Python that sees nothing else of this environment's packages."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kvpush.nixl_build import (
    BUILDS,
    SUBMODULES,
    MetaPackageAlias,
    choose_build,
    nixl_api,
)

REPO = Path(__file__).resolve().parents[2]


def _fake_torch(cuda: str | None) -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.version = types.SimpleNamespace(cuda=cuda)  # type: ignore[attr-defined]
    return torch


@pytest.fixture
def modules(monkeypatch: pytest.MonkeyPatch):
    """Puts fake NIXL packages in ``sys.modules`` (the real ones come back
    afterwards): ``modules(meta=..., builds=..., torch_cuda=...)``. Each
    fake ``_api`` module has ``who``, the package it stands for."""

    def install(
        *, meta: bool, builds: tuple[str, ...], torch_cuda: str | None = "absent"
    ) -> None:
        monkeypatch.setitem(sys.modules, "nixl", None)  # the meta: not installed
        for sub in SUBMODULES:  # not imported (and put back afterwards)
            monkeypatch.setitem(sys.modules, f"nixl.{sub}", None)
            monkeypatch.delitem(sys.modules, f"nixl.{sub}")
        if meta:
            monkeypatch.setitem(sys.modules, "nixl", types.ModuleType("nixl"))
            api = types.ModuleType("nixl._api")
            api.who = "nixl"  # type: ignore[attr-defined]
            monkeypatch.setitem(sys.modules, "nixl._api", api)
        for build in BUILDS:
            if build not in builds:
                monkeypatch.setitem(sys.modules, build, None)
                continue
            package = types.ModuleType(build)
            package.__all__ = ["nixl_agent"]  # type: ignore[attr-defined]
            package.nixl_agent = f"{build}.nixl_agent"  # type: ignore[attr-defined]
            monkeypatch.setitem(sys.modules, build, package)
            for sub in SUBMODULES:
                module = types.ModuleType(f"{build}.{sub}")
                module.who = build  # type: ignore[attr-defined]
                monkeypatch.setitem(sys.modules, f"{build}.{sub}", module)
        if torch_cuda == "absent":
            monkeypatch.delitem(sys.modules, "torch", raising=False)
        else:
            monkeypatch.setitem(sys.modules, "torch", _fake_torch(torch_cuda))

    return install


def test_the_meta_package_s_api_is_used_where_it_is_installed(modules) -> None:
    modules(meta=True, builds=BUILDS)
    assert nixl_api().who == "nixl"


@pytest.mark.parametrize("build", BUILDS)
def test_without_the_meta_package_the_one_installed_build_is_used(
    modules, build: str
) -> None:
    modules(meta=False, builds=(build,))
    assert choose_build() == build
    assert nixl_api().who == build


@pytest.mark.parametrize("torch_cuda", ["absent", None])
def test_without_a_cuda_torch_nixl_cu13_comes_first(
    modules, torch_cuda: str | None
) -> None:
    """No torch imported, or a CPU torch: NIXL's own first choice."""
    modules(meta=False, builds=("nixl_cu12", "nixl_cu13"), torch_cuda=torch_cuda)
    assert nixl_api().who == "nixl_cu13"


@pytest.mark.parametrize(
    ("cuda", "build"), [("12.9", "nixl_cu12"), ("13.0", "nixl_cu13")]
)
def test_a_cuda_torch_takes_the_build_of_its_cuda_major(
    modules, cuda: str, build: str
) -> None:
    modules(meta=False, builds=BUILDS, torch_cuda=cuda)
    assert nixl_api().who == build


def test_a_cuda_torch_without_its_build_names_the_package_to_install(
    modules,
) -> None:
    modules(meta=False, builds=("nixl_cu13",), torch_cuda="12.8")
    with pytest.raises(ImportError, match=r"CUDA 12 .*pip install nixl-cu12$"):
        nixl_api()


def test_without_any_build_the_error_names_the_packages(modules) -> None:
    modules(meta=False, builds=())
    with pytest.raises(ImportError, match=r"pip install nixl-cu13 or nixl-cu12"):
        nixl_api()


def test_the_alias_makes_nixl_of_the_chosen_build_as_the_meta_package_does(
    modules,
) -> None:
    modules(meta=False, builds=BUILDS, torch_cuda="12.4")
    spec = MetaPackageAlias().find_spec("nixl")
    assert spec is not None and spec.loader is not None
    nixl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nixl)
    for sub in SUBMODULES:
        assert sys.modules[f"nixl.{sub}"] is sys.modules[f"nixl_cu12.{sub}"]
        assert getattr(nixl, sub) is sys.modules[f"nixl_cu12.{sub}"]
    assert nixl.nixl_agent == "nixl_cu12.nixl_agent"


@pytest.mark.parametrize("name", ["nixl._api", "nixl_cu13", "numpy"])
def test_the_alias_answers_only_for_the_nixl_package(modules, name: str) -> None:
    modules(meta=False, builds=BUILDS)
    assert MetaPackageAlias().find_spec(name) is None


def test_the_alias_is_not_offered_without_a_build(modules) -> None:
    modules(meta=False, builds=())
    assert MetaPackageAlias().find_spec("nixl") is None


# --- On disk: the real import system, in a Python that sees only REPO and
# the fake packages (``-S``: no site-packages, so no real NIXL either).

FAKE_API = """\
who = {who!r}


def nixl_agent(name, config):
    return (who, name, config)


def nixl_agent_config(**kwargs):
    return kwargs
"""


def write_fake_nixl(root: Path, *, meta: bool, builds: tuple[str, ...]) -> Path:
    """Fake NIXL packages under ``root`` (the meta package ``nixl`` and/or
    builds); each ``_api`` says who it is in ``who``. Returns ``root``."""
    for package in (*builds, *(["nixl"] if meta else [])):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text(
            "from ._api import nixl_agent, nixl_agent_config\n"
            "__all__ = ['nixl_agent', 'nixl_agent_config']\n"
        )
        (root / package / "_api.py").write_text(FAKE_API.format(who=package))
        for sub in set(SUBMODULES) - {"_api"}:
            (root / package / f"{sub}.py").write_text(f"who = {package!r}\n")
    return root


def run_isolated(code: str, fakes: Path) -> list[str]:
    """Run ``code`` in a Python that imports only the stdlib, kvpush (from
    REPO) and the packages under ``fakes``; its stdout's lines."""
    done = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            f"import sys; sys.path[:0] = {[str(fakes), str(REPO)]!r}\n{code}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


ALIAS_THEN_IMPORT = """\
import importlib, importlib.util
from kvpush.nixl_build import alias_meta_package, nixl_api
print("ALIASED", alias_meta_package(), alias_meta_package())
print("IMPORTED", sorted(m for m in sys.modules if m.startswith("nixl")))
print("FOUND", importlib.util.find_spec("nixl") is not None)
from nixl._api import nixl_agent
bindings = importlib.import_module("nixl._bindings")
print("NIXL", nixl_agent("a", {})[0], bindings.who, nixl_api().who)
print("TORCH", "torch" in sys.modules)
"""


def test_the_alias_lets_import_nixl_load_the_one_installed_build(
    tmp_path: Path,
) -> None:
    """What vLLM's NIXL connectors do (``nixl._api``, ``nixl._bindings``)
    finds the build, which is imported only then."""
    fakes = write_fake_nixl(tmp_path, meta=False, builds=("nixl_cu13",))
    assert run_isolated(ALIAS_THEN_IMPORT, fakes) == [
        "ALIASED True True",
        "IMPORTED []",
        "FOUND True",
        "NIXL nixl_cu13 nixl_cu13 nixl_cu13",
        "TORCH False",
    ]


def test_the_meta_package_is_left_alone(tmp_path: Path) -> None:
    fakes = write_fake_nixl(tmp_path, meta=True, builds=("nixl_cu13",))
    assert run_isolated(ALIAS_THEN_IMPORT, fakes)[0::3] == [
        "ALIASED False False",
        "NIXL nixl nixl nixl",
    ]


def test_without_a_build_nothing_is_aliased(tmp_path: Path) -> None:
    code = (
        "from kvpush.nixl_build import alias_meta_package, nixl_api\n"
        "print('ALIASED', alias_meta_package())\n"
        "try:\n"
        "    import nixl\n"
        "except ModuleNotFoundError as e:\n"
        "    print('MISSING', e.name)\n"
        "try:\n"
        "    nixl_api()\n"
        "except ImportError as e:\n"
        "    print('ERROR', e)\n"
    )
    lines = run_isolated(code, tmp_path)
    assert lines[:2] == ["ALIASED False", "MISSING nixl"]
    assert lines[2].startswith("ERROR no NIXL build is installed: pip install")
