"""The plugin each mutant run loads: it runs the likely killers first and records the first
failure (benchmarks/mutation_plugin.py). Its hooks are called directly: an inner pytest
session would cost seconds for what these check in milliseconds."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import mutation_plugin  # scripts beside each other, not a package


def report(nodeid: str, outcome: str, when: str = "call", longrepr=None) -> pytest.TestReport:
    return pytest.TestReport(nodeid, ("f.py", 1, nodeid), {}, outcome, longrepr, when, duration=0.5)


def test_the_named_tests_run_first_in_their_order_and_the_rest_keep_theirs(tmp_path, monkeypatch):
    order = tmp_path / "order.txt"
    order.write_text("f.py::test_d\nf.py::test_b\nf.py::gone\n")
    monkeypatch.setenv(mutation_plugin.ORDER_ENV, str(order))
    items = [SimpleNamespace(nodeid=f"f.py::test_{name}") for name in "abcd"]
    mutation_plugin.pytest_collection_modifyitems(items)
    assert [i.nodeid for i in items] == [
        "f.py::test_d",
        "f.py::test_b",
        "f.py::test_a",
        "f.py::test_c",
    ]


def test_without_an_order_file_nothing_moves(monkeypatch):
    monkeypatch.delenv(mutation_plugin.ORDER_ENV, raising=False)
    items = [SimpleNamespace(nodeid=f"f.py::test_{name}") for name in "ba"]
    mutation_plugin.pytest_collection_modifyitems(items)
    assert [i.nodeid for i in items] == ["f.py::test_b", "f.py::test_a"]


def test_the_first_failure_skips_passes_and_durations_are_recorded(tmp_path, monkeypatch):
    record = tmp_path / "record.json"
    monkeypatch.setenv(mutation_plugin.RECORD_ENV, str(record))
    mutation_plugin.pytest_sessionstart(None)
    mutation_plugin.pytest_runtest_logreport(report("f.py::test_a", "passed", "setup"))
    mutation_plugin.pytest_runtest_logreport(report("f.py::test_a", "passed"))
    mutation_plugin.pytest_runtest_logreport(
        report("f.py::test_c", "skipped", "setup", ("f.py", 3, "Skipped: not here"))
    )
    failure = "rank 1 failed: AssertionError: b is broken    [ws 2]\n\nmore detail"
    mutation_plugin.pytest_runtest_logreport(report("f.py::test_b", "failed", longrepr=failure))
    mutation_plugin.pytest_runtest_logreport(report("f.py::test_e", "failed", longrepr="later"))
    mutation_plugin.pytest_sessionfinish(None, 1)
    data = json.loads(record.read_text())
    assert data["failure"] == {"nodeid": "f.py::test_b", "when": "call", "message": failure}
    assert data["passed"] == 1 and data["exitstatus"] == 1
    assert data["skipped"] == {"f.py::test_c": "Skipped: not here"}
    assert data["durations"]["f.py::test_a"] == 1.0  # setup and call


def test_a_collection_error_is_the_failure(tmp_path, monkeypatch):
    record = tmp_path / "record.json"
    monkeypatch.setenv(mutation_plugin.RECORD_ENV, str(record))
    mutation_plugin.pytest_sessionstart(None)
    broken = pytest.CollectReport("suites/test_x.py", "failed", "ImportError: cannot import", [])
    mutation_plugin.pytest_collectreport(broken)
    mutation_plugin.pytest_sessionfinish(None, 2)
    failure = json.loads(record.read_text())["failure"]
    assert failure["nodeid"] == "suites/test_x.py" and "ImportError" in failure["message"]
