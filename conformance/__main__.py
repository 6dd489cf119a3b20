"""``python -m conformance``: the same command as ``python -m harness conformance``."""

from __future__ import annotations

import sys

from conformance.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
