"""The end-of-run table of every distributed test's per-rank outcomes (``--dist-summary``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from distconform.harness.controller.option_group import option_group
from distconform.harness.controller.session import INFRASTRUCTURE_RETRY_PROPERTY
from distconform.harness.shared.outcomes import RunResult

_ROWS_KEY = pytest.StashKey[list["SummaryRow"]]()
_RERUNS_KEY = pytest.StashKey[list[tuple[str, str]]]()
_RETRIES_KEY = pytest.StashKey[list[tuple[str, str]]]()


@dataclass(frozen=True)
class SummaryRow:
    nodeid: str
    verdict: str
    seconds: float
    rank_outcomes: tuple[str, ...]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = option_group(parser)
    group.addoption(
        "--dist-summary",
        action="store_true",
        default=False,
        help="print a per-rank outcome table of every distributed test at the end",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_ROWS_KEY] = []
    config.stash[_RERUNS_KEY] = []
    config.stash[_RETRIES_KEY] = []
    config.pluginmanager.register(_RerunReporter(config), "distconform-reruns")
    config.pluginmanager.register(_RetryReporter(config), "distconform-infrastructure-retries")
    if config.getoption("dist_summary"):
        config.pluginmanager.register(_SummaryReporter(config), "distconform-summary")


def record(config: pytest.Config, nodeid: str, verdict: str, run: RunResult) -> None:
    config.stash[_ROWS_KEY].append(
        SummaryRow(
            nodeid=nodeid,
            verdict=verdict,
            seconds=run.finished_at - run.started_at,
            rank_outcomes=tuple(r.outcome.value for r in run.results),
        )
    )


def format_table(rows: list[SummaryRow]) -> list[str]:
    header = ("test", "verdict", "time", "per-rank outcome (rank 0, 1, ...)")
    body = [
        (row.nodeid, row.verdict, f"{row.seconds:.2f} s", " ".join(row.rank_outcomes))
        for row in rows
    ]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(3)]
    return [
        f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}"
        for r in [header, *body]
    ]


class _SummaryReporter:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_terminal_summary(self, terminalreporter) -> None:
        rows = self.config.stash[_ROWS_KEY]
        if not rows:
            return
        terminalreporter.write_sep("=", "distributed tests: outcome of every rank")
        for line in format_table(rows):
            terminalreporter.write_line(line)


class _RerunReporter:
    """A failed attempt that pytest-rerunfailures retries keeps its per-rank report.

    The harness never retries by itself; when that plugin does, the failed attempt's
    report goes into the JUnit properties of the rerun entry and into a terminal
    section, so a pass on the next attempt cannot hide what happened before.
    """

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport):
        result = yield
        text = getattr(report, "distconform_failure_text", None)
        if report.outcome == "rerun" and text is not None:
            self.config.stash[_RERUNS_KEY].append((report.nodeid, text))
            self._mark_junit_rerun(report, text)
        return result

    def _mark_junit_rerun(self, report: pytest.TestReport, text: str) -> None:
        # A rerun attempt never gets a teardown report, which is where JUnit takes a
        # test case's properties from: add them to its test case directly.
        from _pytest.junitxml import xml_key

        xml = self.config.stash.get(xml_key, None)
        if xml is None:
            return
        reporter = xml.node_reporter(report)
        reporter.add_property("rerun", "this attempt failed and was rerun")
        reporter.add_property("rerun_rank_report", text)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        reruns = self.config.stash[_RERUNS_KEY]
        if not reruns:
            return
        terminalreporter.write_sep("=", "distributed tests rerun: the failed attempts")
        for nodeid, text in reruns:
            terminalreporter.write_sep("_", f"{nodeid} (rerun)")
            terminalreporter.write_line(text)


class _RetryReporter:
    """Every test the harness retried after an infrastructure failure, at the end of the
    run, whatever its outcome: a retry is never silent, even when the retry passed."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # From the report's properties: under pytest-xdist the controller sees only those.
        if report.when != "call":
            return
        for name, value in report.user_properties:
            if name == INFRASTRUCTURE_RETRY_PROPERTY:
                self.config.stash[_RETRIES_KEY].append((report.nodeid, str(value)))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        retries = self.config.stash[_RETRIES_KEY]
        if not retries:
            return
        terminalreporter.write_sep(
            "=", f"{len(retries)} distributed test(s) retried after an infrastructure failure"
        )
        for nodeid, failure in retries:
            terminalreporter.write_line(f"{nodeid}: first attempt: {failure}")
