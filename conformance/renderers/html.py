"""``conformance.html``: the run's self-contained page (:mod:`conformance.pages.run`).

The page is built from the report's JSON document, as ``python -m harness conformance
html`` builds it later from a saved file, so the two cannot differ.
"""

from __future__ import annotations

from pathlib import Path

from conformance.pages.run import render_run
from conformance.renderers import json_document
from conformance.renderers.format import Format
from conformance.report import ConformanceReport
from conformance.saved import run_from_json


def render(report: ConformanceReport) -> str:
    return render_run(run_from_json(report.to_json(), Path(json_document.FILE_NAME)))


FORMAT = Format("html", "conformance.html", render)
