"""``conformance.json``: the report as data, the form every other tool reads back
(:meth:`distconform.conformance.report.ConformanceReport.load`; ``conformance.schema.json``
describes it)."""

from __future__ import annotations

import json

from distconform.conformance.renderers.format import Format
from distconform.conformance.report import ConformanceReport

FILE_NAME = "conformance.json"


def render(report: ConformanceReport) -> str:
    return json.dumps(report.to_json(), indent=2) + "\n"


FORMAT = Format("json", FILE_NAME, render)
