"""The end-of-run table of every distributed test's per-rank outcomes (``--dist-summary``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from harness.outcomes import RunResult

_ROWS_KEY = pytest.StashKey[list["SummaryRow"]]()


@dataclass(frozen=True)
class SummaryRow:
    nodeid: str
    verdict: str
    seconds: float
    rank_outcomes: tuple[str, ...]


def configure(config: pytest.Config) -> None:
    config.stash[_ROWS_KEY] = []
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
