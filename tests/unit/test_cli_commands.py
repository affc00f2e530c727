"""The product and the lab apart: ``kvpush`` never imports ``kvpush_lab``,
finds the lab's commands through the ``kvpush.commands`` entry points, says
how to install them when they cannot load, and starts without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from kvpush import commands
from kvpush.cli import _parser, main

REPO = Path(__file__).resolve().parents[2]
INSTALL = "pip install 'kvpush[bench]'"


def _imported_modules(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_the_product_never_imports_the_lab() -> None:
    files = sorted((REPO / "kvpush").rglob("*.py"))
    assert len(files) > 50
    bad = [
        f"{path.relative_to(REPO)}: {name}"
        for path in files
        for name in _imported_modules(path)
        if name.split(".")[0] == "kvpush_lab"
    ]
    assert bad == []


def test_the_entry_points_are_the_lab_commands_kvpush_lists() -> None:
    found = commands.optional_commands()
    assert sorted(found) == sorted(commands.LAB_COMMANDS)
    for ep in found.values():
        assert ep.value.startswith("kvpush_lab.")
        assert callable(ep.load())


class _Unloadable:
    value = "kvpush_lab.bench.cli:main"

    def load(self) -> object:
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")


@pytest.mark.parametrize("installed", [{"bench": _Unloadable()}, {}])
def test_bench_without_the_lab_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    installed: dict[str, object],
) -> None:
    monkeypatch.setattr(commands, "optional_commands", lambda: installed)
    assert main(["bench", "--quick"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("kvpush bench: ")
    assert INSTALL in err


def test_the_lab_without_matplotlib_does_not_load() -> None:
    """The real entry point, in a Python where matplotlib cannot be found."""
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from kvpush.cli import main\n"
        "sys.exit(main(['soak', '--help']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert "matplotlib" in done.stderr
    assert INSTALL in done.stderr


def test_kvpush_help_imports_no_torch_nor_the_lab() -> None:
    code = (
        "import sys\n"
        "from kvpush.cli import _parser, main\n"
        "_parser(['--help'])\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "heavy = ('torch', 'vllm', 'transformers', 'matplotlib', 'kvpush_lab')\n"
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
    assert "bench" in done.stdout  # the lab's commands are listed
    assert done.stdout.splitlines()[-1] == "LOADED []"


def test_the_chosen_product_command_gets_its_options() -> None:
    listing = _parser([]).format_help()
    assert "make-model" in listing and "soak" in listing
    argv = ["up", "--prefill", "2", "--model-preset", "kv-heavy"]
    args = _parser(argv[:1]).parse_args(argv)
    assert (args.num_prefill, args.model_preset) == (2, "kv-heavy")


def test_kvpush_version_names_the_installed_distribution() -> None:
    from importlib.metadata import version

    out = subprocess.run(
        [sys.executable, "-m", "kvpush", "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert out.stdout.strip() == f"kvpush {version('kvpush')}"
