"""``distconform COMMAND`` (or ``python -m distconform COMMAND``): the command-line entry points
installed with distconform.

Commands are found through the ``distconform.commands`` entry points (``conformance`` is
the conformance package's ``distconform.conformance.cli:main``), so the harness imports none of the
packages built on it. In a plain copy of the tree (``PYTHONPATH`` only, nothing installed)
the same entry points are read from its ``pyproject.toml``
(:mod:`distconform.harness.entry_points`).
"""

from __future__ import annotations

import sys

from distconform.harness.entry_points import commands as _commands
from distconform.harness.entry_points import program


def _usage(commands: dict[str, object]) -> str:
    names = " | ".join(sorted(commands)) or "(none installed)"
    return f"usage: {program()} {{{names}}} [options]  (COMMAND --help for its options)"


def main(argv: list[str]) -> int:
    commands = _commands()
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(commands))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    entry = commands.get(name)
    if entry is None:
        hint = (
            " (no command is installed: reinstall distconform with "
            "`pip install -c constraints.txt -e .`)"
            if not commands
            else ""
        )
        print(f"unknown command {name!r}{hint}\n{_usage(commands)}", file=sys.stderr)
        return 2
    return int(entry.load()(rest))


def console() -> int:
    """The ``distconform`` console script."""
    return main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
