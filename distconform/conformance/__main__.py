"""``python -m distconform.conformance``: the same as ``python -m distconform conformance``."""

from __future__ import annotations

import sys

from distconform.conformance.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
