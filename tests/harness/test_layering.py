"""The packages import one way (conformance -> suites -> impl -> harness) and without loops.

Read from the source, not from running it: a function-local import counts for the direction
(it is still a dependency), module-level imports for the loops (those are what can fail at
import time). ``if TYPE_CHECKING:`` imports count for neither.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP = "distconform"
PACKAGES = ("conformance", "suites", "impl", "harness")  # each may import those after it


def _layer(module: str) -> str | None:
    """Which of PACKAGES ``module`` belongs to (``distconform.impl.api``: ``impl``)."""
    parts = module.split(".")
    if len(parts) > 1 and parts[0] == TOP and parts[1] in PACKAGES:
        return parts[1]
    return None


@functools.cache
def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / TOP / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if path.name.startswith("test_"):
                continue
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, module: str, *, module_level_only: bool) -> set[str]:
    """The project modules (or packages) ``module`` depends on: ``from a import b`` depends
    on ``a.b`` where that is a module, else on ``a``."""
    modules = _modules()
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            inside = top and not isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            if module_level_only and not inside:
                visit(child, inside)
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = module.split(".")
                    package = anchor if path.name == "__init__.py" else anchor[:-1]
                    package = package[: len(package) - (child.level - 1)]
                    base = ".".join([*package, base] if base else package)
                for alias in child.names:
                    submodule = f"{base}.{alias.name}"
                    found.add(submodule if submodule in modules else base)
            visit(child, inside)

    visit(tree, True)
    return {name for name in found if _layer(name) is not None}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_every_import_runs_from_a_package_to_those_below_it():
    modules = _modules()
    upward = []
    for module, path in sorted(modules.items()):
        rank = PACKAGES.index(_layer(module))
        for imported in sorted(_imports(path, module, module_level_only=False)):
            if PACKAGES.index(_layer(imported)) < rank:
                upward.append(f"{module} imports {imported}")
    assert not upward, "imports against conformance -> suites -> impl -> harness:\n" + "\n".join(
        upward
    )


#: Inside ``harness``, the folders by side, each allowed to import only those after it.
SIDES = (
    "distconform.harness.controller",
    "distconform.harness.rank",
    "distconform.harness.comm",
    "distconform.harness.threads",
    "distconform.harness.shared",
)


def _side(module: str) -> str | None:
    return next((s for s in SIDES if module == s or module.startswith(f"{s}.")), None)


def upward_side_imports(imports: dict[str, set[str]]) -> list[str]:
    """``module imports other`` for each import from a side into one before it in SIDES."""
    found = []
    for module, targets in sorted(imports.items()):
        side = _side(module)
        if side is None:
            continue
        for imported in sorted(targets):
            other = _side(imported)
            if other is not None and SIDES.index(other) < SIDES.index(side):
                found.append(f"{module} imports {imported}")
    return found


def test_inside_the_harness_imports_run_from_the_pytest_side_to_the_ranks_to_what_both_share():
    modules = _modules()
    imports = {
        module: _imports(path, module, module_level_only=False) for module, path in modules.items()
    }
    upward = upward_side_imports(imports)
    assert not upward, f"imports against {' -> '.join(SIDES)}:\n" + "\n".join(upward)


def test_the_side_check_finds_a_rank_module_that_imports_the_pytest_side():
    imports = {
        "distconform.harness.rank.worker": {
            "distconform.harness.controller.pools",
            "distconform.harness.shared.task",
        },
        "distconform.harness.controller.pools": {"distconform.harness.rank.worker"},
    }
    assert upward_side_imports(imports) == [
        "distconform.harness.rank.worker imports distconform.harness.controller.pools"
    ]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def test_no_module_level_import_loop():
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        targets = {
            _resolve(name, modules) for name in _imports(path, module, module_level_only=True)
        }
        # Python runs a module's parent packages before it, whatever it imports; a package
        # importing its submodules to export them is not a loop.
        ancestors = {module.rsplit(".", depth)[0] for depth in range(1, module.count(".") + 1)}
        graph[module] = {t for t in targets if t and t != module and t not in ancestors}
    loops = _cycles(graph)
    assert not loops, "module-level import loops:\n" + "\n".join(" <-> ".join(c) for c in loops)


@pytest.mark.parametrize(
    ("graph", "expected"),
    [({"a": {"b"}, "b": {"a"}}, [["a", "b"]]), ({"a": {"b"}, "b": set()}, [])],
)
def test_the_loop_finder_finds_a_loop_and_only_a_loop(graph, expected):
    assert _cycles(graph) == expected


def test_the_import_reader_sees_function_local_and_relative_imports(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import distconform.harness.controller.config\n"
        "if TYPE_CHECKING:\n    import distconform.suites.cases\n"
        "def f():\n    from distconform.conformance import report\n"
    )
    everything = _imports(source, "distconform.harness.mod", module_level_only=False)
    assert {"distconform.harness.controller.config", "distconform.conformance.report"} <= everything
    assert "distconform.suites.cases" not in everything
    assert _imports(source, "distconform.harness.mod", module_level_only=True) == {
        "distconform.harness.controller.config"
    }
