"""The verdict of a conformance run: one line per profile, and one for the whole run.

A pass rate alone reads as a grade: 44.9 % of a broken implementation still looks like
progress under a green banner. The verdict says what a vendor may claim. It is computed from
a profile's figures as ``conformance.json`` stores them, by the report model
(:meth:`distconform.conformance.report.ConformanceReport.verdicts`) that every format renders,
so each says the same words, and a report saved before verdicts existed still gets one when
it is read back.

A profile is

- ``NOT CONFORMANT`` when any of its applied cases fails, or when it is required and the
  subject does not declare every capability it needs (UNSUPPORTED must not hide a bug);
- ``INCOMPLETE`` when nothing failed but the run stopped before its end;
- ``NOT ASSESSED`` when no case of it applied: a required one leaves the run NOT ASSESSED, a
  declared extension whose cases all skipped here (device events on a CPU) does not;
- ``NOT CLAIMED`` when it is an extension the subject does not declare (no case applied);
- ``CONFORMANT`` otherwise, "with N recorded deviations" for its expected failures.

The run is NOT CONFORMANT when a profile is, or when any test failed; INCOMPLETE when it
stopped early or a suite module could not be imported for a missing package; NOT ASSESSED
when no test was a conformance case or a required profile was not assessed; CONFORMANT
otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from distconform.conformance.statuses import plural

CONFORMANT = "CONFORMANT"
NOT_CONFORMANT = "NOT CONFORMANT"
INCOMPLETE = "INCOMPLETE"
NOT_ASSESSED = "NOT ASSESSED"
NOT_CLAIMED = "NOT CLAIMED"
VERDICTS = (CONFORMANT, NOT_CONFORMANT, INCOMPLETE, NOT_ASSESSED, NOT_CLAIMED)


@dataclass(frozen=True)
class Verdict:
    """What may be claimed about one profile, or about the whole run."""

    #: The profile's name, or ``"verdict"`` for the whole run.
    name: str
    #: One of :data:`VERDICTS`.
    status: str
    #: Why, in a few words ("31 of 51 cases fail"); empty for a clean CONFORMANT.
    detail: str = ""
    #: False for an extension profile: one left unassessed does not leave the run so.
    required: bool = True

    @property
    def conformant(self) -> bool:
        return self.status == CONFORMANT

    @property
    def tone(self) -> str:
        """How a page colours it: good, bad or neutral (an extension not claimed)."""
        if self.status == CONFORMANT:
            return "good"
        skipped_extension = self.status == NOT_ASSESSED and not self.required
        return "neutral" if self.status == NOT_CLAIMED or skipped_extension else "bad"

    def line(self, *, markdown: bool = False) -> str:
        status = f"**{self.status}**" if markdown else self.status
        if not self.detail:
            return f"{self.name}: {status}"
        if self.status == CONFORMANT:
            return f"{self.name}: {status} {self.detail}"
        return f"{self.name}: {status} ({self.detail})"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "conformant": self.conformant,
            "line": self.line(),
        }


def profile_verdict(profile: Mapping[str, Any], *, complete: bool) -> Verdict:
    """The verdict on one profile, from its ``conformance.json`` entry."""
    name = str(profile["name"])
    counts = profile.get("counts") or {}
    applied = int(profile.get("applied") or 0)
    failed = int(counts.get("FAIL", 0))
    missing = list(profile.get("missing_capabilities") or ())
    required = bool(profile.get("required"))
    if failed:
        return Verdict(name, NOT_CONFORMANT, f"{failed} of {applied} cases fail")
    if required and missing:
        return Verdict(name, NOT_CONFORMANT, f"does not declare {', '.join(missing)}")
    if not complete:
        return Verdict(name, INCOMPLETE, "the run stopped before its end")
    if applied == 0:
        if required:
            return Verdict(name, NOT_ASSESSED, "no case of it applied")
        if missing:
            unsupported = int(counts.get("UNSUPPORTED", 0))
            cases = plural(unsupported, "case", "cases")
            return Verdict(name, NOT_CLAIMED, f"{cases} UNSUPPORTED", required=False)
        # Declared, but every case skipped here (a CPU run of a device-only feature).
        skipped = plural(int(counts.get("SKIP", 0)), "case", "cases")
        return Verdict(name, NOT_ASSESSED, f"{skipped} skipped here", required=False)
    deviations = int(counts.get("XFAIL", 0))
    detail = f"with {plural(deviations, 'recorded deviation', 'recorded deviations')}"
    return Verdict(name, CONFORMANT, detail if deviations else "")


def run_verdict(
    profiles: Sequence[Verdict], counts: Mapping[str, int], *, complete: bool, not_run: int = 0
) -> Verdict:
    """The verdict on the whole run, from its profiles' verdicts and its status counts;
    ``not_run`` suite modules were skipped for a missing package."""
    failing = [v.name for v in profiles if v.status == NOT_CONFORMANT]
    if failing:
        return Verdict("verdict", NOT_CONFORMANT, f"to {', '.join(failing)}")
    failed = int(counts.get("FAIL", 0))
    if failed:
        return Verdict("verdict", NOT_CONFORMANT, f"{plural(failed, 'test fails', 'tests fail')}")
    if not complete:
        return Verdict("verdict", INCOMPLETE, "the run stopped before its end")
    if not_run:
        modules = plural(not_run, "suite module", "suite modules")
        return Verdict("verdict", INCOMPLETE, f"{modules} not run: a package is missing")
    if not profiles:
        return Verdict("verdict", NOT_ASSESSED, "no test of this run is a conformance case")
    unassessed = [v.name for v in profiles if v.status == NOT_ASSESSED and v.required]
    if unassessed:
        return Verdict("verdict", NOT_ASSESSED, f"no case of {', '.join(unassessed)} applied")
    if all(v.status in (NOT_CLAIMED, NOT_ASSESSED) for v in profiles):
        return Verdict("verdict", NOT_ASSESSED, "no case applied")
    deviations = int(counts.get("XFAIL", 0))
    detail = f"with {plural(deviations, 'recorded deviation', 'recorded deviations')}"
    return Verdict("verdict", CONFORMANT, detail if deviations else "")
