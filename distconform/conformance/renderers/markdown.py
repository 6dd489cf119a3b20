"""``conformance.md``: the report as a page a vendor can publish (CommonMark)."""

from __future__ import annotations

from distconform.conformance.renderers.format import Format
from distconform.conformance.renderers.text import (
    header_lines,
    headline_lines,
    not_declared_lines,
    notable_lines,
    table_lines,
)
from distconform.conformance.report import ConformanceReport
from distconform.conformance.statuses import PASS_RATE_DEFINITION, percent_text


def render(report: ConformanceReport) -> str:
    percent = percent_text(report.percent())
    headline = headline_lines(report, markdown=True)
    incomplete = report.incomplete_line()
    lines = [
        f"# Conformance report: {report.title}",
        "",
        *([f"**{incomplete}**", ""] if incomplete else []),
        # "Run:" keeps the run's bullets from joining the profiles' list.
        *([*headline, "", "Run:", ""] if headline else []),
        *(f"- {line}" for line in header_lines(report)),
        f"- conformance: **{percent}** = {PASS_RATE_DEFINITION}",
        "",
        *table_lines(report),
        "",
        *notable_lines(report),
        *not_declared_lines(report),
    ]
    return "\n".join(lines).rstrip() + "\n"


FORMAT = Format("markdown", "conformance.md", render)
