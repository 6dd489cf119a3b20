"""``conformance.html``: the run's self-contained page (:mod:`distconform.conformance.pages.run`).

The page is built from the report's JSON document, as ``python -m distconform conformance
html`` builds it later from a saved file, so the two cannot differ.
"""

from __future__ import annotations

from pathlib import Path

from distconform.conformance.pages.run import render_run
from distconform.conformance.renderers import json_document
from distconform.conformance.renderers.format import Format
from distconform.conformance.report import ConformanceReport
from distconform.conformance.saved import run_from_json


def render(report: ConformanceReport) -> str:
    return render_run(run_from_json(report.to_json(), Path(json_document.FILE_NAME)))


FORMAT = Format("html", "conformance.html", render)
