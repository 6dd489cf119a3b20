"""The conformance report: one status per test, counted per feature and world size.

Statuses (a test has exactly one):

- ``PASS``: it ran and passed.
- ``FAIL``: it failed, or errored in setup or teardown.
- ``XFAIL``: it failed and the implementation's expectations file lists it.
- ``XPASS``: it is listed there but passed (the entry is out of date; it still counts as
  conformant).
- ``UNSUPPORTED``: it needs a capability the implementation does not declare (a skip whose
  reason starts with ``UNSUPPORTED:``); it never ran, so it is neither PASS nor FAIL.
- ``SKIP``: any other skip, e.g. ``CPU:`` for cases that cannot run on this device.

Conformance = (PASS + XPASS) / (PASS + XPASS + FAIL + XFAIL): the share of the cases that
apply to this implementation on this device and that behave as specified. UNSUPPORTED and
SKIP are reported next to it, never hidden in it.

Profiles (from the ``pytest_distconform_conformance_profiles`` hook) come first: since an
UNSUPPORTED case never lowers that share, a capability left undeclared would otherwise
buy 100 %. A test tied to a case carries its case and the capabilities it needs as user
properties; each profile counts its tests, and a required profile whose capabilities the
implementation does not all declare gets no percentage. The headline opens with the
verdicts (:mod:`distconform.conformance.verdict`): the run's, then each profile's.

There is one report model, :class:`ConformanceReport`, whether the session that runs builds it
(:class:`~distconform.conformance.recorder.Recorder`) or it is read back from a ``conformance.json``
(:meth:`ConformanceReport.load`): every renderer (:mod:`distconform.conformance.renderers`) and
every page (:mod:`distconform.conformance.pages`) takes it, so a report renders the same from
either. The JSON holds what was recorded; every figure (counts, profiles, verdicts) is derived
from it again on reading.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from distconform.conformance.expectations import Entry
from distconform.conformance.statuses import (
    APPLIED_STATUSES,
    PASS_RATE_DEFINITION,
    SCHEMA,
    STATUSES,
    RunState,
    conformance_percent,
    percent_text,
    plural,
)
from distconform.conformance.verdict import Verdict, profile_verdict, run_verdict
from distconform.suites.backend_capabilities import KNOWN_BACKEND_CAPABILITIES
from distconform.suites.cases import (
    BACKEND,
    IMPLEMENTATION,
    MISSING_DEPENDENCY_PREFIX,
    Profile,
)

SCHEMA_VERSION = 7
#: Every schema version :meth:`ConformanceReport.from_json` reads: a nightly job compares
#: tonight's run with last night's, and the two may straddle an upgrade. 4 says whether the
#: run finished, 5 adds per-rank outcomes and a reproduce command, 6 the verdicts, 7 each
#: profile's subject and each test's inherited expectation. Fields a version lacks read as
#: empty; the verdicts are derived again whatever the version.
READABLE_VERSIONS = (4, 5, 6, 7)
#: The end of a failure's text a result keeps (its root cause and the per-rank table).
MAX_DETAIL_CHARS = 4000


class UnreadableReportError(ValueError):
    """A file is not a conformance report this version can read (the message names it)."""


@dataclass
class TestResult:
    """One test's status and what explains it, as a run records it and ``tests`` of
    ``conformance.json`` stores it."""

    nodeid: str
    feature: str
    world_size: int | None
    status: str = "PASS"
    when: str = "call"
    duration_s: float = 0.0
    reason: str = ""
    message: str = ""
    detail: str = ""
    category: str = ""
    link: str = ""
    #: The case-table row this test stands for (None: not a conformance case).
    case: str | None = None
    #: The capabilities it needs (sorted; empty when it needs none or is no case).
    capabilities: list[str] = field(default_factory=list)
    #: Whose capabilities those are: the implementation's or the backend's (None: no case).
    subject: str | None = None
    #: Each rank's outcome (``{"rank": 0, "outcome": "failed"}``), for a distributed test.
    ranks: list[dict[str, Any]] = field(default_factory=list)
    #: The command that reproduces a distributed test that did not pass (else empty).
    reproduce: str = ""
    #: The implementation whose expectations entry gave this XFAIL or XPASS, when the one
    #: under test is built on it (``Implementation.built_on``); None for its own entries.
    inherited_from: str | None = None
    #: Why a first attempt's ranks failed before the test body, when the harness retried
    #: the test on a fresh pool (else empty): the outcome is the retry's.
    infrastructure_retry: str = ""

    @property
    def headline(self) -> str:
        """What a reader sees first: the failure's message, else the skip or xfail reason."""
        return self.message or self.reason

    @property
    def inheritance_note(self) -> str:
        """``XFAIL (inherited from torch: <reason>)`` for a status an inherited expectations
        entry gave; empty otherwise."""
        if self.inherited_from is None or self.status not in ("XFAIL", "XPASS"):
            return ""
        return f"{self.status} (inherited from {self.inherited_from}: {self.reason})"

    def to_json(self) -> dict[str, Any]:
        """Its entry of ``tests`` (every field, by name)."""
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> TestResult:
        """One entry of ``tests``; fields an older schema version lacks read as empty."""
        status = raw["status"]
        if status not in STATUSES:
            raise ValueError(f"status {status!r} of {raw.get('nodeid')!r}")
        return cls(
            nodeid=raw["nodeid"],
            feature=raw["feature"],
            world_size=raw.get("world_size"),
            status=status,
            when=raw.get("when") or "call",
            duration_s=float(raw.get("duration_s") or 0.0),
            reason=raw.get("reason") or "",
            message=raw.get("message") or "",
            detail=raw.get("detail") or "",
            category=raw.get("category") or "",
            link=raw.get("link") or "",
            case=raw.get("case"),
            capabilities=list(raw.get("capabilities") or ()),
            subject=raw.get("subject"),
            ranks=[
                {"rank": int(rank["rank"]), "outcome": str(rank["outcome"])}
                for rank in raw.get("ranks") or ()
            ],
            reproduce=raw.get("reproduce") or "",
            inherited_from=raw.get("inherited_from"),
            infrastructure_retry=raw.get("infrastructure_retry") or "",
        )


@dataclass(frozen=True)
class StaleExpectation:
    """An expectations entry that selected no collected test: out of date or misspelt."""

    #: The entry's test-id pattern.
    id: str
    #: ``xfail`` or ``tolerance``.
    kind: str
    #: The expectations file and the line that writes the entry.
    file: str
    line: int | None

    @classmethod
    def of(cls, entry: Entry) -> StaleExpectation:
        """The record of an entry of a loaded expectations file."""
        return cls(entry.pattern, entry.kind, str(entry.source), entry.line)

    def describe(self) -> str:
        """Where the entry is and what it selects, as :meth:`Entry.describe` says it."""
        return f"{self.file}:{self.line}: {self.kind} entry {self.id!r}"

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "file": self.file, "line": self.line}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> StaleExpectation:
        return cls(
            str(raw["id"]), str(raw.get("kind") or ""), str(raw.get("file") or ""), raw.get("line")
        )


def profiles_of_test(needs: Collection[str], profiles: Sequence[Profile]) -> list[Profile]:
    """The profiles a test needing ``needs`` counts in: every required profile that covers all
    of them, else every other profile that lists one of them."""
    needed = set(needs)
    covering = [p for p in profiles if p.required and needed <= set(p.capabilities)]
    if covering:
        return covering
    return [p for p in profiles if not p.required and needed & set(p.capabilities)]


_NEEDS_CAPABILITY = re.compile(r"needs capabilit(?:y|ies)\s+(.*)$")


def _unsupported_needs(result: TestResult, declared: frozenset[str]) -> tuple[str, ...]:
    missing = tuple(cap for cap in result.capabilities if cap not in declared)
    if missing:
        return missing
    # A suite that skipped at run time for a capability its case row does not list: its reason.
    found = _NEEDS_CAPABILITY.search(result.reason)
    if found:
        return tuple(sorted(cap.strip() for cap in found.group(1).split(",") if cap.strip()))
    return ("?",)


@dataclass
class ProfileResult:
    """One profile's share of a run."""

    profile: Profile
    tests: list[TestResult]
    declared: frozenset[str]

    @property
    def missing_capabilities(self) -> list[str]:
        """The profile's capabilities the implementation does not declare."""
        return sorted(set(self.profile.capabilities) - self.declared)

    @property
    def withheld(self) -> bool:
        """A required profile not fully declared: any percentage would flatter it."""
        return self.profile.required and bool(self.missing_capabilities)

    def counts(self) -> Counter:
        return Counter(result.status for result in self.tests)

    def applied(self) -> int:
        counts = self.counts()
        return sum(counts[status] for status in APPLIED_STATUSES)

    def percent(self) -> float | None:
        return None if self.withheld else conformance_percent(self.counts())

    def unsupported(self) -> list[tuple[tuple[str, ...], list[str]]]:
        """The UNSUPPORTED tests grouped by the capabilities they lack, largest group first."""
        grouped: dict[tuple[str, ...], list[str]] = defaultdict(list)
        for result in self.tests:
            if result.status == "UNSUPPORTED":
                grouped[_unsupported_needs(result, self.declared)].append(result.nodeid)
        return sorted(grouped.items(), key=lambda kv: (-len(kv[1]), kv[0]))

    def to_json(self) -> dict[str, Any]:
        counts = self.counts()
        return {
            "name": self.profile.name,
            "description": self.profile.description,
            "required": self.profile.required,
            "capabilities": list(self.profile.capabilities),
            "subject": self.profile.subject,
            "declared": not self.missing_capabilities,
            "missing_capabilities": self.missing_capabilities,
            "cases": len(self.tests),
            "applied": self.applied(),
            "counts": {status: counts[status] for status in STATUSES},
            "pass_percent": self.percent(),
            "unsupported": [
                {"needs": list(needs), "cases": len(nodeids), "tests": nodeids}
                for needs, nodeids in self.unsupported()
            ],
        }

    def line(self, *, markdown: bool = False) -> str:
        name = f"**{self.profile.name}**" if markdown else self.profile.name
        kind = "required" if self.profile.required else "extension"
        total = len(self.tests)
        applied = f"{self.applied()} of {plural(total, 'case', 'cases')} applied"
        percent = self.percent()
        if self.withheld:
            applied += f", no pass rate (does not declare {', '.join(self.missing_capabilities)})"
        elif percent is not None:
            applied += f", pass rate {percent_text(percent)}"
        parts = [applied]
        skipped = self.counts()["SKIP"]
        if skipped:
            parts.append(f"{skipped} SKIP")
        groups = [
            f"{plural(len(nodeids), 'case needs', 'cases need')} {' + '.join(needs)}"
            for needs, nodeids in self.unsupported()
        ]
        if groups:
            parts.append(f"UNSUPPORTED: {', '.join(groups)}")
        return f"{name} ({kind}): {'; '.join(parts)}"


@dataclass
class ConformanceReport:
    """One conformance run: what ran where (``environment``), one result per test, the
    expectations entries that selected nothing, the profiles the tests count in and whether
    the run finished. Every figure is derived from these."""

    environment: dict[str, Any]
    tests: list[TestResult]
    stale: list[StaleExpectation] = field(default_factory=list)
    profiles: list[Profile] = field(default_factory=list)
    run: RunState = field(default_factory=RunState)
    #: The file it was read from; None for the report of the session that builds it.
    source: Path | None = None

    @property
    def complete(self) -> bool:
        return self.run.complete(len(self.tests))

    def incomplete_line(self) -> str | None:
        return self.run.incomplete_line(len(self.tests))

    def subjects(self) -> list[str]:
        """Whose cases this run holds: the implementation's, the backend's, or both."""
        present = {result.subject for result in self.tests if result.case is not None}
        return [subject for subject in (IMPLEMENTATION, BACKEND) if subject in present]

    def subject_record(self, subject: str) -> dict[str, Any]:
        """The environment's record of the implementation or the backend under test."""
        key = "backend_declaration" if subject == BACKEND else "implementation"
        return self.environment.get(key) or {}

    @property
    def title(self) -> str:
        """What the run assessed: the implementation's name, ``backend <name>``, or both."""
        names = []
        for subject in self.subjects() or [IMPLEMENTATION]:
            name = self.subject_record(subject).get("name") or "?"
            names.append(f"backend {name}" if subject == BACKEND else str(name))
        return " and ".join(names)

    @property
    def date(self) -> str:
        """When the run was made (ISO 8601, UTC); empty when the report does not say."""
        return str(self.environment.get("date") or "")

    @property
    def label(self) -> str:
        """How a page or a table of several runs names this one: title, date and file."""
        where = self.source if self.source is not None else "this session"
        return f"{self.title} {self.date or '(no date)'} ({where})"

    def profile_results(self) -> list[ProfileResult]:
        """For each subject with cases in this run: every required profile, then each other
        profile with tests; none when no test of this run is tied to a case."""
        results = []
        for subject in self.subjects():
            profiles = [p for p in self.profiles if p.subject == subject]
            declared = frozenset(self.subject_record(subject).get("capabilities") or ())
            members: dict[str, list[TestResult]] = {profile.name: [] for profile in profiles}
            for result in self.tests:
                if result.case is not None and result.subject == subject:
                    for profile in profiles_of_test(result.capabilities, profiles):
                        members[profile.name].append(result)
            required = [p for p in profiles if p.required]
            others = sorted(
                (p for p in profiles if not p.required and members[p.name]),
                key=lambda p: p.name,
            )
            results += [ProfileResult(p, members[p.name], declared) for p in [*required, *others]]
        return results

    def not_run(self) -> list[TestResult]:
        """The suite modules skipped for a missing package."""
        return [r for r in self.tests if r.reason.startswith(MISSING_DEPENDENCY_PREFIX)]

    def verdicts(self) -> tuple[Verdict, list[Verdict]]:
        """The run's verdict and one per listed profile (:mod:`distconform.conformance.verdict`)."""
        profiles = [
            profile_verdict(result.to_json(), complete=self.complete)
            for result in self.profile_results()
        ]
        run = run_verdict(
            profiles, self.counts(), complete=self.complete, not_run=len(self.not_run())
        )
        return run, profiles

    def counts(self) -> Counter:
        return Counter(result.status for result in self.tests)

    def rows(self) -> list[tuple[str, int | None, Counter]]:
        grouped: dict[tuple[str, int | None], Counter] = defaultdict(Counter)
        for result in self.tests:
            grouped[(result.feature, result.world_size)][result.status] += 1
        keys = sorted(grouped, key=lambda k: (k[0], -1 if k[1] is None else k[1]))
        return [(feature, ws, grouped[(feature, ws)]) for feature, ws in keys]

    def counts_by_feature(self) -> dict[str, Counter]:
        """Status counts per feature, all world sizes together."""
        grouped: dict[str, Counter] = {}
        for result in self.tests:
            grouped.setdefault(result.feature, Counter())[result.status] += 1
        return grouped

    def by_nodeid(self) -> dict[str, TestResult]:
        """Each test's result by its node id."""
        return {result.nodeid: result for result in self.tests}

    def percent(self) -> float | None:
        return conformance_percent(self.counts())

    # --- JSON --------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The ``conformance.json`` document (``conformance.schema.json`` describes it)."""
        counts = self.counts()
        verdict, profile_verdicts = self.verdicts()
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "complete": self.complete,
            "exit_status": self.run.exit_status,
            "stopped_because": self.run.stopped_because,
            "tests_expected": self.run.tests_expected,
            "tests_cut_short": self.run.tests_cut_short,
            "environment": self.environment,
            "summary": {
                "tests": len(self.tests),
                "counts": {status: counts[status] for status in STATUSES},
                "conformance_percent": self.percent(),
                "definition": PASS_RATE_DEFINITION,
            },
            "features": [
                {
                    "feature": feature,
                    "world_size": ws,
                    "counts": {status: row[status] for status in STATUSES},
                    "conformance_percent": conformance_percent(row),
                }
                for feature, ws, row in self.rows()
            ],
            "verdict": verdict.to_json(),
            "profiles": [
                {**result.to_json(), "verdict": verdict.to_json()}
                for result, verdict in zip(self.profile_results(), profile_verdicts, strict=True)
            ],
            "tests": [result.to_json() for result in self.tests],
            "stale_expectations": [entry.to_json() for entry in self.stale],
        }

    @classmethod
    def from_json(cls, data: Any, source: Path | None = None) -> ConformanceReport:
        """The report a ``conformance.json`` document holds, of any of
        :data:`READABLE_VERSIONS`; anything else is an :class:`UnreadableReportError` that
        names ``source`` and says what it found."""
        where = f"{source}: " if source is not None else ""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            found = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise UnreadableReportError(
                f"{where}not a conformance report (schema {found!r}, expected {SCHEMA!r}): "
                f"give the conformance.json a conformance run wrote"
            )
        version = data.get("schema_version")
        if version not in READABLE_VERSIONS:
            raise UnreadableReportError(
                f"{where}schema version {version!r}; this distconform reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}: upgrade distconform to read "
                f"newer ones"
            )
        try:
            tests = [TestResult.from_json(raw) for raw in data["tests"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise UnreadableReportError(f"{where}a test entry is malformed ({exc!r})") from None
        try:
            stale = [StaleExpectation.from_json(raw) for raw in data["stale_expectations"]]
            profiles = [_profile_from_json(raw, tests) for raw in data["profiles"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise UnreadableReportError(f"{where}malformed ({exc!r})") from None
        run = RunState(
            exit_status=data.get("exit_status"),
            stopped_because=data.get("stopped_because"),
            tests_expected=data.get("tests_expected"),
            tests_cut_short=int(data.get("tests_cut_short") or 0),
        )
        return cls(data.get("environment") or {}, tests, stale, profiles, run, source)

    @classmethod
    def load(cls, path: str | Path) -> ConformanceReport:
        """The report saved at ``path`` (see :meth:`from_json`)."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise UnreadableReportError(f"{path}: no such file") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UnreadableReportError(f"{path}: not a readable JSON file ({exc})") from None
        return cls.from_json(data, path)


def _profile_from_json(raw: dict[str, Any], tests: Sequence[TestResult]) -> Profile:
    """A profile as ``profiles`` lists it; its figures are derived again from the tests."""
    capabilities = tuple(raw["capabilities"])
    subject = raw.get("subject")
    if subject is None:
        # Schema versions before 7 do not say whose profile it is: the one subject with cases
        # in the run, else the backend when every capability is a backend's.
        subjects = {test.subject for test in tests if test.case is not None}
        if len(subjects) == 1:
            (subject,) = subjects
        elif set(capabilities) <= KNOWN_BACKEND_CAPABILITIES:
            subject = BACKEND
        else:
            subject = IMPLEMENTATION
    return Profile(
        str(raw["name"]),
        str(raw.get("description") or ""),
        bool(raw.get("required")),
        capabilities,
        str(subject),
    )
