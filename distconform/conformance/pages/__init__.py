"""Self-contained HTML pages of conformance runs: no network, no scripts, inline CSS and SVG.

Reading order: :mod:`.html` (escaping, the shared stylesheet, the page frame),
:mod:`.svg` (the charts), then one module per page: :mod:`.run` (one run,
``conformance.html``), :mod:`.compare` (runs side by side) and :mod:`.history` (a directory
of runs over time). Pages read saved reports (:mod:`distconform.conformance.saved`), never a live
session, so a page can be rebuilt from any ``conformance.json`` later.
"""
