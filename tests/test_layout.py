"""The package layout: no import cycle between dplightning's subpackages, no private module imported across packages.

The graph is built from the source (the AST of every module under ``dplightning/``), not by importing it. Its
nodes are the subpackages and the top-level modules of ``dplightning`` (``strategies``, ``export``, ...); the
package's own ``__init__`` is left out, because every import of a submodule runs it. An edge is drawn for each
``import`` of another node, and kept in one of two graphs: top-level imports (run when the module is imported)
and function-level imports (run when the function is called, which some modules use to break a cycle).

* A cycle among top-level imports fails outright: Python cannot import such modules in every order.
* An edge that lies on a cycle of the two graphs together is a layering fault hidden inside a function. The known
  ones are listed in :data:`KNOWN_CYCLE_EDGES`; a move that removes one must delete its entry (the entry's test is a
  strict xfail, so it fails once the fault is gone).
* A private module (a dotted path with a component ``_name``) may be imported only from inside the package that
  holds it: ``dplightning.tasks._hf_module`` from ``dplightning.tasks``, ``dplightning._state`` from anywhere
  in ``dplightning``. Known faults are listed in :data:`KNOWN_PRIVATE_IMPORTS`, the same way.
* An old path kept for users may import its new home lazily, against the layering: in a module-level
  ``__getattr__`` (PEP 562, run on the first access of a moved name) or under ``if __name__ == "__main__":`` (run
  only as a program, never on import). Such an import is left out of both graphs, and may go only to
  ``dplightning.commands`` (``dplightning.planning.memory.main`` is the command's entry).
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "dplightning"

# (importer node, imported node): function-level edges that close a cycle. Each move of issue 26 shrinks this.
KNOWN_CYCLE_EDGES: list[tuple[str, str]] = []
# (importing module, imported private module).
KNOWN_PRIVATE_IMPORTS: list[tuple[str, str]] = []
# The one package an old path may import lazily (see the module docstring).
COMPAT_TARGET = "dplightning.commands"


@dataclass(frozen=True)
class Import:
    """One import of a dplightning module found in the source."""

    importer: str  # dotted name of the importing module
    imported: str  # dotted name of the imported module
    in_function: bool  # inside a function (or lambda) body, so run only when it is called
    compat: bool = False  # in a module-level ``__getattr__`` or ``if __name__ == "__main__":`` block


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    """Whether ``dotted`` names a module or package of the source tree (not a class or function in one)."""
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Every module that ``node`` imports (``from a import b`` imports ``a``, and ``a.b`` if it is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return [source] + [f"{source}.{alias.name}" for alias in node.names]


def _is_compat_block(node: ast.AST) -> bool:
    """A module-level ``def __getattr__`` or ``if __name__ == "__main__":`` (the lazy entries of an old path)."""
    if isinstance(node, ast.FunctionDef):
        return node.name == "__getattr__"
    if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
        sides = [node.test.left, *node.test.comparators]
        return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and any(
            isinstance(s, ast.Constant) and s.value == "__main__" for s in sides
        )
    return False


def _imports_in(path: Path) -> Iterator[Import]:
    module = _module_name(path)
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST, in_function: bool, compat: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            lazy = compat or (isinstance(node, ast.Module) and _is_compat_block(child))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _targets(child, module, is_package):
                    if target.startswith("dplightning.") and _is_module(target):
                        yield Import(module, target, inside, lazy)
            yield from visit(child, inside, lazy)

    yield from visit(ast.parse(path.read_text(encoding="utf-8")), False, False)


def all_imports() -> list[Import]:
    """Every import of a dplightning module by a module under dplightning/."""
    return [found for path in sorted(PACKAGE_DIR.rglob("*.py")) for found in _imports_in(path)]


def _node(module: str) -> str | None:
    """The subpackage or top-level module of dplightning that ``module`` belongs to (None: the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def import_graphs(imports: list[Import]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(top-level, function-level) edges between nodes; a node's imports of itself are left out."""
    top: dict[str, set[str]] = defaultdict(set)
    function: dict[str, set[str]] = defaultdict(set)
    for found in imports:
        source, target = _node(found.importer), _node(found.imported)
        if source is None or target is None or source == target or found.compat:
            continue
        (function if found.in_function else top)[source].add(target)
    return top, function


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def edges_on_cycles(graph: dict[str, set[str]], among: dict[str, set[str]] | None = None) -> set[tuple[str, str]]:
    """The edges of ``among`` (default ``graph``) that lie on a cycle of ``graph``."""
    return {
        (a, b)
        for a, targets in (among if among is not None else graph).items()
        for b in targets
        if a in _reachable(graph, b)
    }


def _union(*graphs: dict[str, set[str]]) -> dict[str, set[str]]:
    merged: dict[str, set[str]] = defaultdict(set)
    for graph in graphs:
        for source, targets in graph.items():
            merged[source] |= targets
    return merged


def _holder(module: str) -> str | None:
    """The package that holds the first private component of ``module`` (None: it has none)."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def private_imports(imports: list[Import]) -> set[tuple[str, str]]:
    """(importer, imported) for each import of a private module from outside the package that holds it."""
    found = set()
    for imp in imports:
        holder = _holder(imp.imported)
        if holder is not None and not (imp.importer == holder or imp.importer.startswith(holder + ".")):
            found.add((imp.importer, imp.imported))
    return found


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return all_imports()


def test_the_graph_sees_the_package() -> None:
    """Guards the tests below against passing on an empty graph (a wrong root, a parser that finds nothing)."""
    top, function = import_graphs(all_imports())
    assert "privacy" in top["strategies"]
    assert function, "no function-level import found at all"


def test_no_cycle_among_top_level_imports(imports: list[Import]) -> None:
    top, _ = import_graphs(imports)
    assert not edges_on_cycles(top), f"top-level import cycle between subpackages: {sorted(edges_on_cycles(top))}"


def test_no_cycle_through_a_function_level_import_but_the_known_ones(imports: list[Import]) -> None:
    top, function = import_graphs(imports)
    faults = edges_on_cycles(_union(top, function), among=function)
    assert faults <= set(KNOWN_CYCLE_EDGES), (
        f"new cycles through function-level imports: {faults - set(KNOWN_CYCLE_EDGES)}"
    )


@pytest.mark.parametrize("edge", KNOWN_CYCLE_EDGES, ids=lambda e: f"{e[0]}->{e[1]}")
@pytest.mark.xfail(strict=True, reason="known cycle (issue 26 item 1); remove the entry once a move breaks it")
def test_a_known_cycle_is_gone(imports: list[Import], edge: tuple[str, str]) -> None:
    top, function = import_graphs(imports)
    assert edge not in edges_on_cycles(_union(top, function), among=function)


def test_no_private_module_is_imported_across_packages_but_the_known_ones(imports: list[Import]) -> None:
    faults = private_imports(imports)
    new = faults - set(KNOWN_PRIVATE_IMPORTS)
    assert not new, f"private modules imported from outside their package: {sorted(new)}"


@pytest.mark.parametrize("pair", KNOWN_PRIVATE_IMPORTS, ids=lambda p: f"{p[0]}->{p[1]}")
@pytest.mark.xfail(strict=True, reason="known private import (issue 26 item 1); remove the entry once a move ends it")
def test_a_known_private_import_is_gone(imports: list[Import], pair: tuple[str, str]) -> None:
    assert pair not in private_imports(imports)


def test_an_old_path_imports_lazily_only_a_command(imports: list[Import]) -> None:
    """The lazy imports left out of the graphs go to the commands only; they cannot hide another layering fault."""
    lazy = {(imp.importer, imp.imported) for imp in imports if imp.compat}
    assert ("dplightning.planning.memory", "dplightning.commands.memory_plan") in lazy, "the detector found none"
    assert all(imported.startswith(COMPAT_TARGET + ".") for _, imported in lazy), sorted(lazy)


def test_the_checks_find_a_planted_cycle_and_a_planted_private_import() -> None:
    """The detectors themselves: a cycle hidden in a function and a cross-package private import are reported."""
    planted = [
        Import("dplightning.a.x", "dplightning.b.y", in_function=False),
        Import("dplightning.b.y", "dplightning.a.z", in_function=True),
        Import("dplightning.c", "dplightning.a._hidden", in_function=False),
        Import("dplightning.a.w", "dplightning.a._hidden", in_function=False),
        Import("dplightning.a.w", "dplightning._state", in_function=False),
    ]
    top, function = import_graphs(planted)
    assert not edges_on_cycles(top)
    assert edges_on_cycles(_union(top, function), among=function) == {("b", "a")}
    assert private_imports(planted) == {("dplightning.c", "dplightning.a._hidden")}


def _fresh_interpreter(code: str) -> str:
    """What ``code`` prints in a fresh interpreter (nothing of dplightning imported yet)."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.slow
def test_importing_the_package_loads_no_datamodule() -> None:
    """``import dplightning`` (the strategies) needs the sampler, not the data modules (issue 26: it loaded all)."""
    loaded = _fresh_interpreter(
        "import sys, dplightning; print(sorted(m for m in sys.modules if m.startswith('dplightning.data')))"
    )
    assert loaded == "[]"


def test_nothing_under_privacy_imports_lightning(imports: list[Import]) -> None:
    """``privacy/`` is the DP math without a Trainer: no module there imports Lightning, at any level."""
    offenders = []
    for path in sorted((PACKAGE_DIR / "privacy").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in {"lightning", "pytorch_lightning"}]
    assert not offenders


def test_no_module_is_a_shim_of_a_moved_one() -> None:
    """The moved-path re-exports are gone (no users of a 0.1 library to keep them for): one path per name."""
    shims = [
        str(path.relative_to(ROOT))
        for path in PACKAGE_DIR.rglob("*.py")
        if (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "").startswith("Moved to")
    ]
    assert not shims


def test_the_cli_runs_every_command_from_the_commands_package() -> None:
    from dplightning.cli import COMMANDS

    assert all(module.startswith("dplightning.commands.") for module in COMMANDS.values()), COMMANDS
    assert all(callable(importlib.import_module(module).main) for module in COMMANDS.values())


# Every name ``dplightning.planning.memory`` had as one module (issue 26 item 1f split it into a package by concern).
PLANNER_NAMES = """
Component DEFAULT_SIGMAS Dims GB Layer MemoryPlan PHASES Phase Precision Projected ROLES Saved Settings Survey
activation_bytes assemble clipping_transient dims_of dp_defaults engine_store formed_roles forms_slot
grape_projections header hooked_layers layer_tensors load_configs merge_configs meta_model model_config
optimizer_states parse_memory physical_batch plan precision_of settings_of suggestion survey table
trained_roles main
""".split()


def test_the_split_planner_keeps_every_name_and_its_command_entry() -> None:
    from dplightning.commands import memory_plan
    from dplightning.planning import memory

    missing = [name for name in PLANNER_NAMES if not hasattr(memory, name)]
    assert not missing, f"dplightning.planning.memory lost {missing}"
    assert memory.main is memory_plan.main
    assert set(memory.__all__) == set(PLANNER_NAMES) - {"main"}


@pytest.mark.slow
def test_the_memory_plan_still_runs_from_the_planner_s_path() -> None:
    """``python -m dplightning.planning.memory`` (docs/memory_plan.md) runs the moved command line."""
    result = subprocess.run(
        [sys.executable, "-m", "dplightning.planning.memory", "--help"], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr
    assert "--gpu-memory" in result.stdout
