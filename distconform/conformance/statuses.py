"""What a conformance report's figures mean: the statuses a test can end with, the pass
rate computed from them, and whether the figures cover the whole run.

Shared by the report (:mod:`distconform.conformance.report`) and by everything that reads
saved reports afterwards (:mod:`distconform.conformance.compare`,
:mod:`distconform.conformance.history`, :mod:`distconform.conformance.pages`), so each says
PASS, 99.9 % and INCOMPLETE alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

#: The ``schema`` field of every ``conformance.json``.
SCHEMA = "distconform-conformance"

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


def plural(count: int, singular: str, plural_form: str) -> str:
    """``"1 case"``, ``"3 cases"``: the count with the word that agrees with it."""
    return f"{count} {singular if count == 1 else plural_form}"


def worst_status(counts: Mapping[str, int]) -> str | None:
    """The most telling status among ``counts`` (see :data:`SEVERITY`); None when empty."""
    return next((status for status in SEVERITY if counts.get(status, 0)), None)


@dataclass
class RunState:
    """Whether the figures cover the whole run, and if not, why they stop where they do."""

    #: pytest's exit status by name (``OK``, ``TESTS_FAILED``, ``INTERRUPTED``...); None
    #: while the run is still going (a report written during the run, or left by a killed one).
    exit_status: str | None = "OK"
    #: Why the run ended before its last test (``-x``, Ctrl-C, a broken pool, still running).
    stopped_because: str | None = None
    #: Tests selected to run (None when unknown).
    tests_expected: int | None = None
    #: Tests that started but never finished (interrupted in the middle).
    tests_cut_short: int = 0

    def complete(self, reported: int) -> bool:
        return (
            self.exit_status in ("OK", "TESTS_FAILED", "NO_TESTS_COLLECTED")
            and self.stopped_because is None
            and self.tests_cut_short == 0
            and (self.tests_expected is None or reported >= self.tests_expected)
        )

    def incomplete_line(self, reported: int) -> str | None:
        """The headline of a run whose figures do not cover every selected test."""
        if self.complete(reported):
            return None
        why = self.stopped_because or f"pytest exited with {self.exit_status}"
        of = f" of {self.tests_expected}" if self.tests_expected is not None else ""
        return (
            f"INCOMPLETE: {why}; {reported}{of} tests reported, and every figure below covers "
            f"only those"
        )
