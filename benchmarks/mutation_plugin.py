"""The pytest plugin ``benchmarks/mutation.py`` loads into each run of a mutant (``-p``).

It does two things a plain conformance run does not:

- runs first the tests named in the file ``$MUTATION_BENCH_ORDER`` (one node id a line),
  in that order: the tests that killed earlier mutants of the same function, so that with
  ``-x`` a killed mutant costs one or two tests instead of the whole selection;
- writes ``$MUTATION_BENCH_RECORD`` (JSON) at the end: the first failure (node id, phase,
  the first lines of its report), how many tests passed, what was skipped and each test's
  duration, which the benchmark reads instead of parsing pytest's output.

It is copied beside the private tree, never imported from it, so the tree under test can be
any revision.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

ORDER_ENV = "MUTATION_BENCH_ORDER"
RECORD_ENV = "MUTATION_BENCH_RECORD"
#: Lines of a failure's report kept: the harness puts the rank and the first real error first.
MESSAGE_LINES = 12

_record: dict[str, Any] = {}


def pytest_sessionstart(session: pytest.Session) -> None:
    # Fresh per session: pytester runs several sessions in one process.
    _record.clear()
    _record.update(failure=None, passed=0, skipped={}, durations={})


@pytest.hookimpl(trylast=True)  # after -m and the conformance plugin have deselected
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order_file = os.environ.get(ORDER_ENV)
    if not order_file or not Path(order_file).exists():
        return
    wanted = [line for line in Path(order_file).read_text().splitlines() if line]
    rank = {node_id: index for index, node_id in enumerate(wanted)}
    last = len(rank)
    # Stable: the tests not named keep their order after the named ones.
    items.sort(key=lambda item: rank.get(item.nodeid, last))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Setup and teardown included: a pool started for a test is that test's cost.
    durations = _record["durations"]
    durations[report.nodeid] = durations.get(report.nodeid, 0.0) + report.duration
    if report.failed and _record["failure"] is None and not hasattr(report, "wasxfail"):
        text = report.longreprtext or ""
        _record["failure"] = {
            "nodeid": report.nodeid,
            "when": report.when,
            "message": "\n".join(text.strip().splitlines()[:MESSAGE_LINES]),
        }
    elif report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _record["skipped"][report.nodeid] = reason
    elif report.passed and report.when == "call":
        _record["passed"] += 1


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed and _record["failure"] is None:
        text = report.longreprtext or ""
        _record["failure"] = {
            "nodeid": report.nodeid or "<collection>",
            "when": "collect",
            "message": "\n".join(text.strip().splitlines()[:MESSAGE_LINES]),
        }


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    record_file = os.environ.get(RECORD_ENV)
    if record_file:
        Path(record_file).write_text(json.dumps({**_record, "exitstatus": int(exitstatus)}))
