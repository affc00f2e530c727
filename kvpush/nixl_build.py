"""Which NIXL build a process uses, and ``nixl`` for vLLM without the meta
package.

NIXL ships one wheel per accelerator stack: ``nixl-cu13`` and ``nixl-cu12``,
each a top-level package (``nixl_cu13``, ``nixl_cu12``) holding the API
(``_api``, ``_bindings``, ``_utils``, ``logging``). The ``nixl`` meta package
installs both and provides a ``nixl`` module that picks one at import time
and answers ``nixl._api`` with it. kvpush's extras install one build and no
meta package, so:

* :func:`nixl_api` is how kvpush imports NIXL: the meta package's
  ``nixl._api`` where ``nixl`` imports, else the installed build's ``_api``.
* :func:`alias_meta_package` (called by kvpush's vLLM plugin) lets ``import
  nixl`` and ``import nixl._api`` load that build where the meta package is
  absent, for vLLM's own NIXL connectors (kvpush's baselines), which import
  ``nixl._api``. It imports nothing itself: the build is chosen and loaded
  when something first imports ``nixl``.

The choice, as the meta package makes it: a torch already imported and
built for CUDA N takes ``nixl_cuN`` (each build is compiled for one CUDA
major; an error names the package when it is missing); otherwise the first
installed of :data:`BUILDS`. torch is read from ``sys.modules``, never
imported here.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

logger = logging.getLogger(__name__)

META_PACKAGE = "nixl"
# NIXL's builds in the meta package's order of choice without a CUDA torch.
BUILDS = ("nixl_cu13", "nixl_cu12")
# What the meta package puts in sys.modules as nixl.<name>.
SUBMODULES = ("_api", "_bindings", "_utils", "logging")


def pip_name(build: str) -> str:
    """The distribution that installs ``build`` (``nixl_cu13`` -> ``nixl-cu13``)."""
    return build.replace("_", "-")


def torch_cuda_major() -> int | None:
    """The CUDA major an already imported torch was built for; None when
    torch is not imported or is not a CUDA build (CPU, ROCm)."""
    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    if not isinstance(cuda, str) or not cuda.split(".")[0].isdigit():
        return None
    return int(cuda.split(".")[0])


def is_installed(name: str) -> bool:
    """Whether ``name`` imports (already imported, or found on the path)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def choose_build() -> str:
    """The build this process uses (see the module docstring); an
    ImportError naming the pip package(s) to install when there is none."""
    major = torch_cuda_major()
    wanted: Sequence[str] = BUILDS if major is None else (f"nixl_cu{major}",)
    for build in wanted:
        if is_installed(build):
            return build
    if major is not None:
        raise ImportError(
            f"torch is built for CUDA {major} and NIXL's build for it is not"
            f" installed: pip install {pip_name(wanted[0])}"
        )
    raise ImportError(
        "no NIXL build is installed: pip install "
        + " or ".join(map(pip_name, BUILDS))
        + " (kvpush[cpu] and kvpush[gpu] install nixl-cu13)"
    )


def nixl_api() -> ModuleType:
    """NIXL's Python API (``nixl_agent``, ``nixl_agent_config``, ...):
    ``nixl._api`` of the meta package where ``nixl`` imports, else the
    chosen build's ``_api``."""
    try:
        return importlib.import_module(f"{META_PACKAGE}._api")
    except ModuleNotFoundError as e:  # no nixl, or a nixl that is not NIXL's
        if e.name not in (META_PACKAGE, f"{META_PACKAGE}._api"):
            raise
    return importlib.import_module(f"{choose_build()}._api")


class MetaPackageAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The last finder on ``sys.meta_path``: answers ``import nixl`` only
    where no other finder does (the meta package is absent) and a build is
    installed. Loading it makes a ``nixl`` module the way the meta package
    does: the chosen build's submodules as ``nixl.<name>`` in
    ``sys.modules`` and as attributes, and the build's public names."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != META_PACKAGE or not any(map(is_installed, BUILDS)):
            return None
        # A package with an empty path: nixl.<name> exists only as injected.
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module

    def exec_module(self, module: ModuleType) -> None:
        build = importlib.import_module(choose_build())
        for name in SUBMODULES:
            try:
                sub = importlib.import_module(f"{build.__name__}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{build.__name__}.{name}":
                    raise
                continue
            sys.modules[f"{META_PACKAGE}.{name}"] = sub
            setattr(module, name, sub)
        for name in getattr(build, "__all__", ()):
            setattr(module, name, getattr(build, name))
        logger.debug("kvpush: nixl is %s", build.__name__)


def alias_meta_package() -> bool:
    """Let ``import nixl`` load the chosen build where the meta package is
    absent (idempotent; imports nothing). True when the alias is in place."""
    if any(isinstance(f, MetaPackageAlias) for f in sys.meta_path):
        return True
    if META_PACKAGE in sys.modules or is_installed(META_PACKAGE):
        return False
    if not any(map(is_installed, BUILDS)):
        return False
    sys.meta_path.append(MetaPackageAlias())
    return True
