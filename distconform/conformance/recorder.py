"""The pytest side of the conformance report: the session's test reports in, one
:class:`~distconform.conformance.report.TestResult` per test out (:class:`Recorder`), with what
a test's item and node id say about it (its feature, its world size) and the profiles the
``pytest_distconform_conformance_profiles`` hook returned.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from distconform.conformance.expectations import Entry
from distconform.conformance.report import (
    MAX_DETAIL_CHARS,
    ConformanceReport,
    StaleExpectation,
    TestResult,
)
from distconform.conformance.statuses import (
    RunState,
)
from distconform.extension import (
    INFRASTRUCTURE_RETRY_PROPERTY,
    RANK_OUTCOMES_PROPERTY,
    REPRODUCE_PROPERTY,
    world_size_of,
)
from distconform.suites.cases import (
    CAPABILITIES_PROPERTY,
    CASE_PROPERTY,
    IMPLEMENTATION,
    MISSING_DEPENDENCY_PREFIX,
    SUBJECT_PROPERTY,
    UNSUPPORTED_PREFIX,
    Profile,
)


def feature_of(item: pytest.Item) -> str:
    """The ``feature`` marker, else the module path without its top directory and ``test_``."""
    marker = item.get_closest_marker("feature")
    if marker is not None and marker.args:
        return str(marker.args[0])
    return feature_from_nodeid(item.nodeid)


def feature_from_nodeid(nodeid: str) -> str:
    parts = nodeid.split("::", 1)[0].split("/")
    if len(parts) > 1:
        parts = parts[1:]
    stem = parts[-1].removesuffix(".py")
    parts[-1] = stem.removeprefix("test_")
    return "/".join(parts)


_WORLD_SIZE_ID = re.compile(r"\[(?:[^\]]*-)?ws(\d+)(?:-|\])")


def world_size_from_nodeid(nodeid: str) -> int | None:
    """The ``wsN`` part of a parametrized id (for reports from pytest-xdist workers)."""
    found = _WORLD_SIZE_ID.search(nodeid)
    return int(found.group(1)) if found else None


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        text = str(longrepr[2])
    else:
        text = str(longrepr or "")
    return text.removeprefix("Skipped: ").strip()


def _crash_message(report: pytest.TestReport) -> str:
    """One line: the exception's message (a distributed failure's root-cause line)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = str(getattr(crash, "message", "") or "").strip()
    if not text:  # a plain-text report (e.g. a pool that did not start): its first line
        lines = [line for line in report.longreprtext.splitlines() if line.strip()]
        text = lines[0].strip() if lines else ""
    return text.splitlines()[0] if text else ""


class Recorder:
    """Turns the stream of TestReports into one TestResult per test."""

    def __init__(self, expectation_of: Callable[[str], Entry | None] | None = None) -> None:
        self.results: dict[str, TestResult] = {}
        # Tests set up but with no outcome yet (still running, or cut short by Ctrl-C or a
        # crash), with their set-up time: they are not results.
        self.in_progress: dict[str, float] = {}
        self._items: dict[str, tuple[str, int | None]] = {}
        self._expected: dict[str, Entry] = {}
        # For reports of items collected elsewhere (pytest-xdist workers): their entry.
        self._expectation_of = expectation_of

    def describe_item(self, item: pytest.Item) -> None:
        self._items[item.nodeid] = (feature_of(item), world_size_of(item))

    def expect(self, nodeid: str, entry: Entry) -> None:
        self._expected[nodeid] = entry

    def add(self, report: pytest.TestReport) -> None:
        if report.outcome not in ("passed", "failed", "skipped"):
            return  # e.g. "rerun": only the final attempt counts
        if report.when == "setup" and report.passed:
            self.in_progress[report.nodeid] = report.duration
            return
        result = self.results.get(report.nodeid)
        if result is None:
            # Items collected elsewhere (pytest-xdist workers) are described from their id.
            feature, world_size = self._items.get(
                report.nodeid,
                (feature_from_nodeid(report.nodeid), world_size_from_nodeid(report.nodeid)),
            )
            result = self.results[report.nodeid] = TestResult(report.nodeid, feature, world_size)
        _read_properties(result, report)
        result.duration_s += self.in_progress.pop(report.nodeid, 0.0) + report.duration
        if report.when == "teardown":
            if report.failed and result.status != "FAIL":
                self._fail(result, report)
            return
        result.when = report.when
        entry = self._expected.get(report.nodeid)
        wasxfail = getattr(report, "wasxfail", None)
        if entry is None and wasxfail is not None and self._expectation_of is not None:
            entry = self._expectation_of(report.nodeid)
        if entry is not None:
            result.category, result.link = entry.category, entry.link
            result.inherited_from = entry.inherited_from
            wasxfail = entry.reason if wasxfail is not None else None
        if report.failed:
            self._fail(result, report)
        elif report.passed:
            result.status = "XPASS" if wasxfail is not None else "PASS"
            result.reason = wasxfail or ""
        elif wasxfail is not None:
            result.status = "XFAIL"
            result.reason = wasxfail
            result.message = _crash_message(report)
            result.detail = report.longreprtext[-MAX_DETAIL_CHARS:]
        else:
            result.reason = _skip_reason(report)
            unsupported = result.reason.startswith(UNSUPPORTED_PREFIX)
            result.status = "UNSUPPORTED" if unsupported else "SKIP"

    def add_collect_skip(self, report: pytest.CollectReport) -> None:
        """A module skipped at collection for a missing package: a SKIP result that names it
        (pytest drops such a module from the run without a test to report)."""
        reason = _skip_reason(report)
        if not report.skipped or not reason.startswith(MISSING_DEPENDENCY_PREFIX):
            return
        result = TestResult(report.nodeid, feature_from_nodeid(report.nodeid), None)
        result.status, result.reason, result.when = "SKIP", reason, "setup"
        self.results[report.nodeid] = result

    @staticmethod
    def _fail(result: TestResult, report: pytest.TestReport) -> None:
        result.status = "FAIL"
        result.when = report.when
        result.message = _crash_message(report)
        result.detail = report.longreprtext[-MAX_DETAIL_CHARS:]

    def build(
        self,
        environment: dict[str, Any],
        stale: Sequence[Entry],
        profiles: Sequence[Profile] = (),
        run: RunState | None = None,
    ) -> ConformanceReport:
        """The report of the tests recorded so far."""
        return ConformanceReport(
            environment,
            list(self.results.values()),
            [StaleExpectation.of(entry) for entry in stale],
            list(profiles),
            run or RunState(),
        )


def _read_properties(result: TestResult, report: pytest.TestReport) -> None:
    properties = dict(getattr(report, "user_properties", None) or ())
    if RANK_OUTCOMES_PROPERTY in properties:
        result.ranks = _rank_outcomes(str(properties[RANK_OUTCOMES_PROPERTY]))
    if REPRODUCE_PROPERTY in properties:
        result.reproduce = str(properties[REPRODUCE_PROPERTY])
    if INFRASTRUCTURE_RETRY_PROPERTY in properties:
        result.infrastructure_retry = str(properties[INFRASTRUCTURE_RETRY_PROPERTY])
    if CASE_PROPERTY not in properties:
        return  # "capabilities" alone may be a project's own record_property
    result.case = str(properties[CASE_PROPERTY])
    result.subject = str(properties.get(SUBJECT_PROPERTY, IMPLEMENTATION))
    needs = str(properties.get(CAPABILITIES_PROPERTY, ""))
    result.capabilities = sorted(cap for cap in needs.split(",") if cap)


def _rank_outcomes(text: str) -> list[dict[str, Any]]:
    """``"0:passed 1:failed"`` as ``[{"rank": 0, "outcome": "passed"}, ...]``."""
    ranks = []
    for pair in text.split():
        rank, _, outcome = pair.partition(":")
        if rank.isdigit() and outcome:
            ranks.append({"rank": int(rank), "outcome": outcome})
    return ranks


# --- profiles ------------------------------------------------------------------------------


def profiles_from_hook(raw: Any) -> list[Profile]:
    """The hook's dicts as Profiles; a malformed one is a ValueError naming it."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError(f"conformance profiles must be a list of dicts, got {raw!r}")
    profiles = []
    for entry in raw:
        name = entry.get("name") if isinstance(entry, dict) else None
        capabilities = entry.get("capabilities") if isinstance(entry, dict) else None
        if (
            not isinstance(name, str)
            or not name
            or not isinstance(entry.get("required", False), bool)
            or not isinstance(capabilities, list)
            or not all(isinstance(cap, str) for cap in capabilities)
        ):
            raise ValueError(
                f"conformance profile {entry!r}: needs name (str), required (bool) and "
                f"capabilities (list of str)"
            )
        if any(profile.name == name for profile in profiles):
            raise ValueError(f"conformance profile {name!r} is defined twice")
        profiles.append(
            Profile(
                name,
                str(entry.get("description", "")),
                entry.get("required", False),
                tuple(capabilities),
                str(entry.get("subject", IMPLEMENTATION)),
            )
        )
    return profiles
