"""Self-contained HTML pages of conformance runs: no network, no scripts, inline CSS and SVG.

Reading order: :mod:`.html` (escaping, the shared stylesheet, the page frame),
:mod:`.svg` (the charts), then one module per page: :mod:`.run` (one run,
``conformance.html``), :mod:`.compare` (runs side by side) and :mod:`.history` (a directory
of runs over time). Pages render the one report model
(:class:`distconform.conformance.report.ConformanceReport`), which a run builds and a saved
``conformance.json`` loads back alike, so a page can be rebuilt from any of them later.
"""
