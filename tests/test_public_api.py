"""The declared public surface: ``distconform.api`` (users) and ``distconform.extension``
(launchers, devices, backends, implementations, report formats), and who may import what.

Everything else is private: the suites, the conformance package, the implementation
adapters and the bundled plug-ins reach the harness only through the two public modules,
so an extension written against them sees what distconform's own code sees.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.test_layering import ROOT, _imports, _modules

PUBLIC = ("distconform.api", "distconform.extension")
#: Whose imports of the harness must go through PUBLIC.
CLIENTS = (
    "distconform.suites",
    "distconform.conformance",
    "distconform.impl",
    # the plug-ins bundled in the harness, loaded as a vendor's would be
    "distconform.harness.backends",
    "distconform.harness.devices.fakeaccel",
)
PLUGINS = CLIENTS[3:]
#: What the torch-private audits share: each package's one audited module uses it.
AUDIT_MACHINERY = "distconform.harness.torch_window"
#: Generates docs/options.md from every plugin's pytest_addoption.
OPTIONS_PAGE = "distconform.conformance.options_reference"


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(f"{prefix}.")


def allowed(module: str, imported: str) -> bool:
    """Whether ``module`` (a client) may import the harness module ``imported``."""
    if not _within(imported, "distconform.harness"):
        return True
    if module.endswith("._torch_private") and _within(imported, AUDIT_MACHINERY):
        return True
    if module == OPTIONS_PAGE:
        return True
    if any(_within(module, plugin) for plugin in PLUGINS):
        # a plug-in's own folder, the other bundled plug-ins, its package's audited module
        return imported == "distconform.harness._torch_private" or any(
            _within(imported, plugin) for plugin in PLUGINS
        )
    return False


def private_imports(imports: dict[str, set[str]]) -> list[str]:
    """``module imports private`` for each client import of the harness not through PUBLIC."""
    return [
        f"{module} imports {imported}"
        for module, targets in sorted(imports.items())
        if any(_within(module, client) for client in CLIENTS)
        for imported in sorted(targets)
        if not allowed(module, imported)
    ]


def test_suites_conformance_adapters_and_plugins_use_only_the_public_modules():
    imports = {
        module: _imports(path, module, module_level_only=False)
        for module, path in _modules().items()
    }
    found = private_imports(imports)
    assert not found, "private harness imports (use distconform.api / .extension):\n" + "\n".join(
        found
    )


def test_the_check_finds_a_suite_that_imports_a_private_module():
    imports = {
        "distconform.suites.test_x": {"distconform.harness.parity", "distconform.api"},
        "distconform.harness.backends.acme": {"distconform.harness.controller.pools"},
        "distconform.impl._torch_private": {"distconform.harness.torch_window"},
    }
    assert private_imports(imports) == [
        "distconform.harness.backends.acme imports distconform.harness.controller.pools",
        "distconform.suites.test_x imports distconform.harness.parity",
    ]


@pytest.mark.parametrize("name", PUBLIC)
def test_every_declared_name_resolves_and_is_imported_for_readers(name):
    """``__all__`` is the table of homes, each name resolves, and the ``TYPE_CHECKING``
    block (what type checkers and the API reference read) imports exactly those names."""
    module = importlib.import_module(name)
    assert sorted(module.__all__) == sorted(module._HOMES)
    for public in module.__all__:
        assert getattr(module, public) is not None, public
    tree = ast.parse(Path(module.__file__).read_text())
    (block,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    ]
    bound = {alias.asname or alias.name for node in block.body for alias in node.names}
    assert bound == set(module.__all__)
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018


def _documented(value: object) -> bool:
    """A docstring of its own: not empty, not the signature a dataclass makes up."""
    doc = (inspect.getdoc(value) or "").strip()
    return bool(doc) and not doc.startswith(f"{getattr(value, '__name__', '')}(")


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_callable_and_class_has_a_docstring(name):
    module = importlib.import_module(name)
    undocumented = [
        public
        for public in module.__all__
        if (inspect.isclass(value := getattr(module, public)) or inspect.isroutine(value))
        and not _documented(value)
    ]
    assert not undocumented, f"{name}: no docstring on {undocumented}"
    assert len((module.__doc__ or "").split()) > 50  # the module says what is where


def test_importing_the_public_modules_loads_neither_torch_nor_pytest():
    """A device plug-in imports ``distconform.extension`` in every rank; a user's script
    imports ``distconform.api`` before it knows whether it needs ranks."""
    code = (
        "import sys, distconform.api, distconform.extension; "
        "print(sorted(m for m in ('torch', 'pytest', 'distconform.harness.plugin') "
        "if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]", done.stderr
