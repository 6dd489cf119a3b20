"""distconform's entry points, installed or read from a plain copy of the tree.

``pip install`` registers three groups from ``pyproject.toml``: the ``pytest11`` plugins
(``distconform.harness.plugin``, ``distconform.conformance.plugin``,
``distconform.harness.adopt.options``), the ``python -m distconform`` subcommands
(``distconform.commands``) and the implementations ``--impl`` names
(``distconform.implementations``). A machine that cannot install anything (the GPU machine: its own
Python and torch, nothing fetched) runs distconform from a copy of the tree with only ``PYTHONPATH``
set, where no entry point is registered. There the groups are read from the ``pyproject.toml`` next
to this package, and callers that start pytest name the plugins with ``-p``, so both ways run the
same code.
"""

from __future__ import annotations

import sys
import tomllib
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

COMMANDS_GROUP = "distconform.commands"
#: Implementations ``--impl NAME`` finds: distconform's own and installed vendors'.
IMPLEMENTATIONS_GROUP = "distconform.implementations"
#: The console script ``pip install`` puts on the PATH (pyproject.toml ``[project.scripts]``).
SCRIPT = "distconform"
PYTEST_GROUP = "pytest11"
#: The ``pytest11`` names distconform registers (pyproject.toml).
PLUGIN_NAMES = ("distconform", "distconform-conformance", "distconform-adopt")

_TREE_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def installed(group: str) -> dict[str, EntryPoint]:
    """The entry points of ``group`` that installed distributions registered."""
    return _installed(group)


def _installed(group: str) -> dict[str, EntryPoint]:
    return {entry.name: entry for entry in entry_points(group=group)}


def _from_tree(group: str) -> dict[str, EntryPoint]:
    """The group as the tree's ``pyproject.toml`` declares it; empty without that file."""
    try:
        project = tomllib.loads(_TREE_PYPROJECT.read_text())["project"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return {}
    declared = project.get("entry-points", {}).get(group, {})
    return {name: EntryPoint(name, value, group) for name, value in declared.items()}


def is_installed() -> bool:
    """Whether pip registered distconform's pytest plugins in this environment."""
    return any(name in _installed(PYTEST_GROUP) for name in PLUGIN_NAMES)


def program() -> str:
    """How the user started the commands: ``distconform``, or ``python -m distconform``."""
    return SCRIPT if Path(sys.argv[0]).name == SCRIPT else "python -m distconform"


def commands() -> dict[str, EntryPoint]:
    """``python -m distconform`` subcommands: the installed ones, else the tree's."""
    return _installed(COMMANDS_GROUP) or _from_tree(COMMANDS_GROUP)


def implementations() -> dict[str, EntryPoint]:
    """``--impl`` names: the tree's own (so a plain copy has them too), then every installed
    package's, which win on a clash."""
    return {**_from_tree(IMPLEMENTATIONS_GROUP), **_installed(IMPLEMENTATIONS_GROUP)}


def pytest_plugin_args() -> list[str]:
    """``-p MODULE`` for each distconform plugin pytest will not load by itself.

    Empty when distconform is installed: pytest loads the plugins through their entry
    points, and naming them again would register each twice.
    """
    if is_installed():
        return []
    plugins = _from_tree(PYTEST_GROUP)
    args: list[str] = []
    for name in PLUGIN_NAMES:
        if name in plugins:
            args += ["-p", plugins[name].value]
    return args
