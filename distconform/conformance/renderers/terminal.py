"""The report at the end of pytest's terminal output: the verdict on its last line."""

from __future__ import annotations

from distconform.conformance.renderers.format import Format
from distconform.conformance.renderers.text import (
    header_lines,
    headline_lines,
    notable_lines,
    table_lines,
)
from distconform.conformance.report import ConformanceReport
from distconform.conformance.statuses import PASS_RATE_DEFINITION, percent_text


def lines(report: ConformanceReport) -> list[str]:
    notable = notable_lines(report)
    headline = headline_lines(report)
    verdict, profiles = report.verdicts()
    return [
        *([*headline, ""] if headline else []),
        *header_lines(report),
        "",
        *table_lines(report),
        *(["", *notable] if notable else []),
        "",
        # The last line is the one people quote: the verdict first, the rate after it.
        (f"{verdict.line()}; " if profiles or report.not_run() else "")
        + f"conformance {percent_text(report.percent())} ({PASS_RATE_DEFINITION})",
        *([incomplete] if (incomplete := report.incomplete_line()) else []),
    ]


def render(report: ConformanceReport) -> str:
    return "\n".join(lines(report)) + "\n"


FORMAT = Format("terminal", None, render)
