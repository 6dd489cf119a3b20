"""The statuses a conformance test can end with, and the pass rate computed from them.

Shared by the report that is written during a run (:mod:`conformance.report`) and by
everything that reads saved reports afterwards (:mod:`conformance.compare`,
:mod:`conformance.history`, :mod:`conformance.pages`), so each says PASS and 99.9 % alike.
"""

from __future__ import annotations

from collections.abc import Mapping

STATUSES = ("PASS", "FAIL", "XFAIL", "XPASS", "UNSUPPORTED", "SKIP")
#: The statuses of tests that apply to the subject and ran: the pass rate's denominator.
APPLIED_STATUSES = ("PASS", "FAIL", "XFAIL", "XPASS")
#: Most telling first: a group of tests shows the first status any of them has.
SEVERITY = ("FAIL", "XFAIL", "XPASS", "PASS", "UNSUPPORTED", "SKIP")
PASS_RATE_DEFINITION = "(PASS + XPASS) / (PASS + XPASS + FAIL + XFAIL)"


def conformance_percent(counts: Mapping[str, int]) -> float | None:
    """(PASS + XPASS) / (PASS + XPASS + FAIL + XFAIL) in percent; None when nothing applied."""
    good = counts.get("PASS", 0) + counts.get("XPASS", 0)
    applicable = good + counts.get("FAIL", 0) + counts.get("XFAIL", 0)
    return None if applicable == 0 else 100.0 * good / applicable


def percent_text(value: float | None) -> str:
    if value is None:
        return "n/a"
    # Never round a run with a failure up to 100 %.
    text = f"{value:.1f} %"
    return "99.9 %" if text == "100.0 %" and value < 100.0 else text


def worst_status(counts: Mapping[str, int]) -> str | None:
    """The most telling status among ``counts`` (see :data:`SEVERITY`); None when empty."""
    return next((status for status in SEVERITY if counts.get(status, 0)), None)
