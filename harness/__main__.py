"""``python -m harness COMMAND``: command-line entry points of the harness.

- ``conformance``: run the conformance suites and write the report
  (``python -m harness conformance --help``).
"""

from __future__ import annotations

import sys

_USAGE = "usage: python -m harness conformance [options] [pytest args]  (--help for options)"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "conformance":
        from harness.conformance.cli import main as conformance_main

        return conformance_main(rest)
    print(f"unknown command {command!r}\n{_USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
