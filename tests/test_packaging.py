"""The wheel: it ships every file of dplightning/, imports and runs from a plain install, declares its imports.

The editable install of the development venv hides all three faults: its finder serves any module
of the source tree, whether the wheel would ship it or not, and the venv already holds every
package the dev tools pull in. So the wheel is built from a copy of the project, installed
non-editable into a folder of its own, and imported from there with the editable finder removed.
"""

from __future__ import annotations

import ast
import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "dplightning"
# Never part of a build; a virtualenv is recognised by its pyvenv.cfg, whatever its name.
_NOT_COPIED = {".git", "build", "dist", "__pycache__", ".pytest_cache", "lightning_logs"}

# Run in the installed copy's interpreter before anything of the package is imported.
_ISOLATE = """
import sys
from pathlib import Path
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != Path({root!r})]
"""
_IMPORT_ALL = """
import importlib, json, pkgutil

def _raise(name):
    raise

import dplightning
names = ["dplightning"] + [m.name for m in pkgutil.walk_packages(dplightning.__path__, "dplightning.", onerror=_raise)]
print(json.dumps({name: importlib.import_module(name).__file__ for name in names}))
"""
_RUN_ENTRY_POINT = """
import importlib
module = importlib.import_module({module!r})
assert Path(module.__file__).resolve().is_relative_to(Path({target!r})), module.__file__
func = module
for attr in {attrs!r}:
    func = getattr(func, attr)
sys.argv = [{name!r}, "--help"]
sys.exit(func())
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the working tree (the build writes build/ and egg-info)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=_ignore_for_build)
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", str(source), "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(work)])
    (built,) = work.glob(f"{PACKAGE}-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path) -> Path:
    """A plain (non-editable) install of the wheel into a folder of its own."""
    target = wheel.parent / "site"
    _run([sys.executable, "-m", "pip", "install", str(wheel), "--no-deps", "--no-index", "-q", "--target", str(target)])
    return target


@pytest.mark.slow
def test_the_wheel_ships_every_file_of_the_package_and_nothing_else(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        shipped = {n for n in archive.namelist() if not n.split("/")[0].endswith((".dist-info", ".data"))}
    files = (p for p in (ROOT / PACKAGE).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    source = {p.relative_to(ROOT).as_posix() for p in files}
    assert shipped == source, (
        f"missing from the wheel: {sorted(source - shipped)}; in the wheel but not in {PACKAGE}/: "
        f"{sorted(shipped - source)}"
    )


@pytest.mark.slow
def test_every_module_imports_from_the_plain_install(installed: Path) -> None:
    output = _run_isolated(_IMPORT_ALL, installed)
    files = json.loads(output.splitlines()[-1])
    outside = {name: f for name, f in files.items() if not Path(f).resolve().is_relative_to(installed.resolve())}
    assert not outside, f"imported from outside the plain install: {outside}"
    missing = _source_modules(ROOT / PACKAGE) - set(files)
    assert not missing, f"modules of {PACKAGE}/ the plain install does not have: {sorted(missing)}"


@pytest.mark.slow
def test_every_console_entry_point_answers_help(wheel: Path, installed: Path) -> None:
    scripts = _console_scripts(wheel)
    assert scripts, "the wheel declares no console script"
    for name, value in scripts.items():
        module, _, attrs = value.partition(":")
        assert (installed / "bin" / name).is_file(), f"pip installed no script {name!r}"
        code = _RUN_ENTRY_POINT.format(module=module, attrs=attrs.split("."), name=name, target=str(installed))
        assert "usage" in _run_isolated(code, installed).lower()


_QUICKSTART = """
import sys
import dplightning.cli
assert Path(dplightning.cli.__file__).resolve().is_relative_to(Path({target!r})), dplightning.cli.__file__
sys.argv = ["dplightning", "fit", "--config", "quickstart", "--trainer.max_steps", "2", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false"]
dplightning.cli.main()
"""


@pytest.mark.slow
def test_the_quickstart_runs_by_name_from_the_plain_install_outside_the_repository(installed: Path) -> None:
    """The configs ship in the wheel: ``--config quickstart`` needs no clone (issue 42, item 1)."""
    output = _run_isolated(_QUICKSTART.format(target=str(installed)), installed)
    assert "test_acc" in output  # trained and tested (the privacy lines go to stderr)


@pytest.mark.slow
def test_every_third_party_import_is_a_declared_dependency(wheel: Path) -> None:
    """A module imports only core dependencies when it loads; an extra's package only inside a function."""
    core = {_normalise(r) for r in _requires_dist(wheel) if "extra ==" not in r}
    extras = {_normalise(r) for r in _requires_dist(wheel) if "extra ==" in r}
    distributions = packages_distributions()
    undeclared = {}
    for module, (where, at_load) in sorted(_third_party_imports(ROOT / PACKAGE).items()):
        candidates = {_normalise(d) for d in distributions.get(module, [])}
        if not candidates & (core if at_load else core | extras):
            kind = "at load" if at_load else "in a function"
            undeclared[module] = f"{sorted(candidates) or 'no installed distribution'} ({kind}, {sorted(where)[0]})"
    assert not undeclared, f"imported by {PACKAGE}/ but not in project.dependencies (or an extra): {undeclared}"


def test_the_hugging_face_and_plot_packages_are_extras(wheel: Path) -> None:
    """The core install stays small: a user training a CNN does not pull transformers, peft or matplotlib."""
    core = {_normalise(r) for r in _requires_dist(wheel) if "extra ==" not in r}
    assert not core & {"transformers", "peft", "tokenizers", "huggingface-hub", "matplotlib"}


def _ignore_for_build(folder: str, names: list[str]) -> set[str]:
    return {n for n in names if n in _NOT_COPIED or n.endswith(".egg-info") or Path(folder, n, "pyvenv.cfg").is_file()}


def _run(command: list[str], **kwargs: object) -> str:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command} exited with {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _run_isolated(code: str, target: Path) -> str:
    """Runs ``code`` with only the plain install of the package importable (third-party packages stay)."""
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    return _run([sys.executable, "-c", _ISOLATE.format(root=str(ROOT)) + code], env=env, cwd=target.parent)


def _source_modules(package: Path) -> set[str]:
    names = set()
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _wheel_text(wheel: Path, file_name: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        (path,) = (n for n in archive.namelist() if n.endswith(f".dist-info/{file_name}"))
        return archive.read(path).decode()


def _console_scripts(wheel: Path) -> dict[str, str]:
    parser = configparser.ConfigParser()
    parser.optionxform = str  # script names keep their case
    parser.read_string(_wheel_text(wheel, "entry_points.txt"))
    return dict(parser["console_scripts"]) if parser.has_section("console_scripts") else {}


def _requires_dist(wheel: Path) -> list[str]:
    lines = _wheel_text(wheel, "METADATA").splitlines()
    return [line.partition(":")[2].strip() for line in lines if line.startswith("Requires-Dist:")]


def _normalise(requirement: str) -> str:
    """The distribution name of a requirement, normalised as in PEP 503."""
    name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
    assert name, f"cannot read a distribution name in {requirement!r}"
    return re.sub(r"[-_.]+", "-", name.group()).lower()


def _third_party_imports(package: Path) -> dict[str, tuple[set[str], bool]]:
    """Top-level module -> (files, whether some file imports it when it loads), lazy imports included."""
    found: dict[str, tuple[set[str], bool]] = {}
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        at_load = {id(node) for node in _load_time_nodes(tree)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for top in {m.split(".")[0] for m in modules} - set(sys.stdlib_module_names) - {package.name}:
                files, loads = found.get(top, (set(), False))
                files.add(path.relative_to(package.parent).as_posix())
                found[top] = (files, loads or id(node) in at_load)
    return found


def _load_time_nodes(tree: ast.AST) -> list[ast.AST]:
    """The statements that run when the module loads: outside every function (class bodies run, too)."""
    nodes: list[ast.AST] = []
    pending = list(ast.iter_child_nodes(tree))
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        nodes.append(node)
        pending.extend(ast.iter_child_nodes(node))
    return nodes
