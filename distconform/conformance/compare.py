"""What changed between conformance runs: last night against tonight, or one implementation
against another on the same suites.

Tests are matched by node id. Only differences are listed: a test whose status is the same
in both runs is not, however long it took. Each difference gets one kind (:func:`change_kind`);
``new FAIL`` is the one a nightly job gates on (:attr:`Comparison.new_failures`). Expectation
entries that select no test and did not in the baseline are listed as well: they are the
other way an expectations file goes out of date.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from distconform.conformance.report import ConformanceReport, StaleExpectation, TestResult
from distconform.conformance.statuses import percent_text

NEW_FAIL = "new FAIL"
#: Display order: what needs action first.
KINDS = (
    NEW_FAIL,
    "fixed",
    "newly UNSUPPORTED",
    "stale expectation",
    "newly expected to fail",
    "expectation removed",
    "newly supported",
    "newly skipped",
    "no longer skipped",
    "added",
    "not run",
)


def change_kind(before: str | None, after: str | None) -> str | None:
    """The kind of change from status ``before`` to ``after`` (None: absent from that run);
    None when nothing changed."""
    if before == after:
        return None
    if after is None:
        return "not run"
    if after == "FAIL":
        return NEW_FAIL
    if before is None:
        return "added"
    if after == "XPASS":
        return "stale expectation"  # listed as failing, and passed
    if before in ("FAIL", "XFAIL") and after == "PASS":
        return "fixed"
    if after == "UNSUPPORTED":
        return "newly UNSUPPORTED"
    if before == "UNSUPPORTED":
        return "newly supported"
    if after == "XFAIL":
        return "newly expected to fail"
    if before == "XPASS":
        return "expectation removed"
    if after == "SKIP":
        return "newly skipped"
    return "no longer skipped"  # before SKIP: every other pair is handled above


@dataclass(frozen=True)
class Change:
    kind: str
    nodeid: str
    before: TestResult | None
    after: TestResult | None

    @property
    def before_status(self) -> str:
        return self.before.status if self.before is not None else "-"

    @property
    def after_status(self) -> str:
        return self.after.status if self.after is not None else "-"


@dataclass
class Comparison:
    baseline: ConformanceReport
    other: ConformanceReport
    changes: list[Change] = field(default_factory=list)
    #: Expectation entries of ``other`` that select no test, and did select one (or did not
    #: exist) in the baseline.
    new_stale_entries: list[StaleExpectation] = field(default_factory=list)

    @property
    def new_failures(self) -> list[Change]:
        return [change for change in self.changes if change.kind == NEW_FAIL]

    def environment_changes(self) -> list[str]:
        """What differs in how the two runs were made (context for the test changes)."""
        lines = []
        before, after = self.baseline.environment, self.other.environment
        if self.baseline.title != self.other.title:
            lines.append(f"implementation {self.baseline.title} -> {self.other.title}")
        for key, label in (
            ("torch_version", "torch"),
            ("launcher", "launcher"),
            ("backend", "backend"),
            ("device", "device"),
            ("world_sizes", "world sizes"),
            ("seed", "seed"),
        ):
            if before.get(key) != after.get(key):
                lines.append(f"{label} {before.get(key)} -> {after.get(key)}")
        for run in (self.baseline, self.other):
            if not run.complete:
                lines.append(
                    f"{run.source}: the run is INCOMPLETE, so its missing tests show as 'not run' "
                    f"or 'added'"
                )
        return lines


def compare(baseline: ConformanceReport, other: ConformanceReport) -> Comparison:
    """The changes from ``baseline`` to ``other``, what needs action first."""
    before, after = baseline.by_nodeid(), other.by_nodeid()
    order = {kind: index for index, kind in enumerate(KINDS)}
    changes = []
    for nodeid in [*before, *(n for n in after if n not in before)]:
        old, new = before.get(nodeid), after.get(nodeid)
        kind = change_kind(old.status if old else None, new.status if new else None)
        if kind is not None:
            changes.append(Change(kind, nodeid, old, new))
    changes.sort(key=lambda change: order[change.kind])
    already_stale = {entry.id for entry in baseline.stale}
    new_stale = [entry for entry in other.stale if entry.id not in already_stale]
    return Comparison(baseline, other, changes, new_stale)


def compare_all(runs: list[ConformanceReport]) -> list[Comparison]:
    """The first run is the baseline; every other run is compared with it."""
    baseline, *others = runs
    return [compare(baseline, other) for other in others]


# --- the terminal table ----------------------------------------------------------------


def terminal_lines(comparisons: list[Comparison]) -> list[str]:
    lines: list[str] = []
    for comparison in comparisons:
        baseline, other = comparison.baseline, comparison.other
        lines += [
            f"baseline: {baseline.label}, pass rate {percent_text(baseline.percent())}",
            f"this run: {other.label}, pass rate {percent_text(other.percent())}",
            *(f"  {line}" for line in comparison.environment_changes()),
        ]
        count = len(comparison.changes) + len(comparison.new_stale_entries)
        if not count:
            lines += ["no test changed its outcome", ""]
            continue
        rows = [("change", "baseline", "this run", "test")]
        rows += [(c.kind, c.before_status, c.after_status, c.nodeid) for c in comparison.changes]
        rows += [
            ("stale expectation", "-", "-", f"{e.id} ({e.file}:{e.line})")
            for e in comparison.new_stale_entries
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines.append(f"{count} {'difference' if count == 1 else 'differences'}:")
        lines += [
            f"  {row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]}"
            for row in rows
        ]
        for change in comparison.new_failures:
            if change.after is not None and change.after.headline:
                lines.append(f"  {change.nodeid}: {change.after.headline.splitlines()[0]}")
            if change.after is not None and change.after.reproduce:
                lines.append(f"    reproduce with: {change.after.reproduce}")
        lines.append("")
    failures = sum(len(c.new_failures) for c in comparisons)
    lines.append(
        f"{failures} new {'FAIL' if failures == 1 else 'FAILs'}: the exit status is 1"
        if failures
        else "no new FAIL"
    )
    return lines


def exit_status(comparisons: list[Comparison]) -> int:
    """1 when any run has a FAIL its baseline did not have, else 0."""
    return 1 if any(comparison.new_failures for comparison in comparisons) else 0


def command_line(paths: list[str]) -> str:
    return shlex.join(["python", "-m", "distconform", "conformance", "compare", *paths])
