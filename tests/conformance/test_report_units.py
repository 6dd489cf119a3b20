"""The report's classification and arithmetic, from hand-made TestReports (no ranks)."""

from __future__ import annotations

from collections import Counter

import pytest

from distconform.conformance.recorder import Recorder, feature_from_nodeid, world_size_from_nodeid
from distconform.conformance.renderers import text
from distconform.conformance.report import (
    ConformanceReport,
    conformance_percent,
)


def report(nodeid: str, when: str, outcome: str, longrepr=None, **extra) -> pytest.TestReport:
    made = pytest.TestReport(nodeid, ("x.py", 1, "t"), {}, outcome, longrepr, when, duration=0.5)
    for name, value in extra.items():
        setattr(made, name, value)
    return made


def run_of(*reports: pytest.TestReport) -> dict[str, str]:
    recorder = Recorder()
    for made in reports:
        recorder.add(made)
    return {nodeid: result.status for nodeid, result in recorder.results.items()}


def test_statuses_from_report_streams():
    skip = ("x.py", 3, "Skipped: UNSUPPORTED: needs capability hsdp")
    statuses = run_of(
        report("a::ok", "setup", "passed"),
        report("a::ok", "call", "passed"),
        report("a::ok", "teardown", "passed"),
        report("a::teardown_error", "call", "passed"),
        report("a::teardown_error", "teardown", "failed", "boom in teardown"),
        report("a::setup_error", "setup", "failed", "boom in setup"),
        report("a::unsupported", "setup", "skipped", skip),
        report("a::cpu", "setup", "skipped", ("x.py", 3, "CPU: needs events")),
        report("a::xfail", "call", "skipped", "AssertionError: off", wasxfail="[NUMERICS] r"),
        report("a::xpass", "call", "passed", wasxfail="[NUMERICS] r"),
        report("a::rerun", "call", "rerun", "first attempt"),
        report("a::rerun", "call", "passed"),
    )
    assert statuses == {
        "a::ok": "PASS",
        "a::teardown_error": "FAIL",
        "a::setup_error": "FAIL",
        "a::unsupported": "UNSUPPORTED",
        "a::cpu": "SKIP",
        "a::xfail": "XFAIL",
        "a::xpass": "XPASS",
        "a::rerun": "PASS",
    }


def test_conformance_counts_xpass_as_conformant_and_leaves_skips_out():
    assert conformance_percent(Counter(PASS=3, XPASS=1, FAIL=1, XFAIL=1, SKIP=9)) == (
        pytest.approx(100 * 4 / 6)
    )
    assert conformance_percent(Counter(UNSUPPORTED=2, SKIP=1)) is None


def test_one_failure_in_many_never_shows_as_100_percent():
    recorder = Recorder()
    for index in range(2000):
        recorder.add(report(f"a::t{index}", "call", "passed"))
    recorder.add(report("a::bad", "call", "failed", "boom"))
    table = "\n".join(text.table_lines(recorder.build({}, [])))
    assert "99.9 %" in table and "100.0 %" not in table


def test_items_described_only_by_their_id():
    assert world_size_from_nodeid("s/test_a.py::t[ws4-raf=2]") == 4
    assert world_size_from_nodeid("s/test_a.py::t[lr=0.1-ws2]") == 2
    assert world_size_from_nodeid("s/test_a.py::t[lows2]") is None
    assert feature_from_nodeid("suites/properties/test_training.py::t") == "properties/training"
    recorder = Recorder()  # as on a pytest-xdist controller: no item was described here
    recorder.add(report("suites/test_prefetch.py::t[ws2-x]", "call", "passed"))
    rows = ConformanceReport({}, list(recorder.results.values())).rows()
    assert [(feature, ws, dict(counts)) for feature, ws, counts in rows] == [
        ("prefetch", 2, {"PASS": 1})
    ]


def test_a_test_retried_after_an_infrastructure_failure_says_so_in_the_report():
    recorder = Recorder()
    made = report("suites/test_x.py::t[ws2]", "call", "passed")
    made.user_properties = [("infrastructure_retry", "could not start 2 rank processes")]
    recorder.add(made)
    recorder.add(report("suites/test_y.py::t[ws2]", "call", "passed"))
    built = recorder.build({}, [])
    retried = {t.nodeid: t.infrastructure_retry for t in built.tests}
    assert retried == {
        "suites/test_x.py::t[ws2]": "could not start 2 rank processes",
        "suites/test_y.py::t[ws2]": "",
    }
    lines = text.notable_lines(built)
    assert "retried once on a fresh pool after an infrastructure failure:" in lines
    assert "- `suites/test_x.py::t[ws2]` (PASS): could not start 2 rank processes" in lines
    again = type(built).from_json(built.to_json())
    assert again.tests[0].infrastructure_retry == "could not start 2 rank processes"
