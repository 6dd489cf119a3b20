"""``conformance.html``: the run's self-contained page (:mod:`distconform.conformance.pages.run`).

The page renders the report model itself, as it renders one read back from a saved
``conformance.json``, so the two cannot differ.
"""

from __future__ import annotations

from distconform.conformance.pages.run import render_run
from distconform.conformance.renderers.format import Format

FORMAT = Format("html", "conformance.html", render_run)
