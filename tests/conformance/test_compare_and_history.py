"""``conformance compare`` and ``conformance history`` on reports written by the report's own
writer (``ConformanceReport.to_json``), so they read exactly what a run leaves behind."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from distconform.conformance import cli
from distconform.conformance.compare import KINDS, NEW_FAIL, change_kind, compare
from distconform.conformance.report import ConformanceReport, StaleExpectation
from distconform.conformance.report import TestResult as ResultRow
from distconform.conformance.statuses import STATUSES
from tests.conformance.report_checks import PageElements, check_json

REPO = Path(__file__).resolve().parents[2]
STEP_BENCHMARK = REPO / "benchmarks" / "results" / "impl_step-2026-11-22.json"


def environment(impl: str, date: str) -> dict:
    return {
        "torch_version": "2.13.0+cpu",
        "python": "3.11.7",
        "platform": "Linux",
        "implementation": {"name": impl, "spec": impl, "capabilities": ["hsdp"]},
        "backend_declaration": None,
        "launcher": "process",
        "backend": "gloo",
        "device": "cpu",
        "world_sizes": None,
        "seed": 0,
        "date": date,
        "backend_plugins": [],
        "expectations": None,
        "command": ["python", "-m", "pytest", "suites"],
    }


def write_report(
    path: Path, statuses: dict[str, str], *, impl: str = "reference", date: str, stale=()
) -> Path:
    """A report with one test per entry of ``statuses`` (node id -> status)."""
    tests = []
    for nodeid, status in statuses.items():
        result = ResultRow(nodeid, nodeid.split("::")[0], 2 if "[ws2]" in nodeid else 4)
        result.status = status
        if status in ("FAIL", "XFAIL"):
            result.message = f"AssertionError: {nodeid} broke"
            result.ranks = [{"rank": 0, "outcome": "passed"}, {"rank": 1, "outcome": "failed"}]
            result.reproduce = f"python -m pytest {nodeid}"
        tests.append(result)
    report = ConformanceReport(environment(impl, date), tests)
    data = report.to_json()
    data["stale_expectations"] = [
        {"id": entry, "kind": "xfail", "file": "x.toml", "line": 3} for entry in stale
    ]
    check_json(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def test_every_change_of_status_has_one_kind_and_only_a_fail_gates():
    outcomes = [None, *STATUSES]
    kinds = {
        (before, after): change_kind(before, after)
        for before, after in itertools.product(outcomes, outcomes)
    }
    assert {kind for kind in kinds.values() if kind is not None} <= set(KINDS)
    for (before, after), kind in kinds.items():
        assert (kind is None) == (before == after), (before, after)
        assert (kind == NEW_FAIL) == (after == "FAIL" and before != "FAIL"), (before, after)
    # The semantics spelled out, pair by pair, for the ones a reader acts on.
    assert kinds["PASS", "FAIL"] == kinds["XFAIL", "FAIL"] == kinds[None, "FAIL"] == NEW_FAIL
    assert kinds["FAIL", "PASS"] == kinds["XFAIL", "PASS"] == "fixed"
    assert kinds["PASS", "UNSUPPORTED"] == kinds["FAIL", "UNSUPPORTED"] == "newly UNSUPPORTED"
    assert kinds["UNSUPPORTED", "PASS"] == "newly supported"
    assert kinds["XFAIL", "XPASS"] == kinds["PASS", "XPASS"] == "stale expectation"
    assert kinds["PASS", "XFAIL"] == kinds["FAIL", "XFAIL"] == "newly expected to fail"
    assert kinds["XPASS", "PASS"] == "expectation removed"
    assert kinds["PASS", "SKIP"] == "newly skipped"
    assert kinds["SKIP", "PASS"] == "no longer skipped"
    assert kinds["PASS", None] == "not run" and kinds[None, "PASS"] == "added"


def test_compare_lists_the_differences_and_nothing_else(tmp_path):
    same = {f"s.py::same_{status}[ws2]": status for status in STATUSES}
    before = {
        **same,
        "s.py::regressed[ws2]": "PASS",
        "s.py::fixed[ws4]": "FAIL",
        "s.py::dropped_capability[ws4]": "PASS",
        "s.py::gone[ws2]": "PASS",
    }
    after = {
        **same,
        "s.py::regressed[ws2]": "FAIL",
        "s.py::fixed[ws4]": "PASS",
        "s.py::dropped_capability[ws4]": "UNSUPPORTED",
        "s.py::new_and_failing[ws2]": "FAIL",
    }
    baseline = ConformanceReport.load(
        write_report(tmp_path / "a.json", before, date="2026-11-23T03:17:00Z")
    )
    other = ConformanceReport.load(
        write_report(
            tmp_path / "b.json",
            after,
            date="2026-11-24T03:17:00Z",
            stale=["s.py::old_entry", "s.py::renamed"],
        )
    )
    baseline.stale = [StaleExpectation("s.py::old_entry", "xfail", "x.toml", 3)]  # both nights
    comparison = compare(baseline, other)
    assert [(c.kind, c.nodeid, c.before_status, c.after_status) for c in comparison.changes] == [
        (NEW_FAIL, "s.py::regressed[ws2]", "PASS", "FAIL"),
        (NEW_FAIL, "s.py::new_and_failing[ws2]", "-", "FAIL"),
        ("fixed", "s.py::fixed[ws4]", "FAIL", "PASS"),
        ("newly UNSUPPORTED", "s.py::dropped_capability[ws4]", "PASS", "UNSUPPORTED"),
        ("not run", "s.py::gone[ws2]", "PASS", "-"),
    ]
    assert [entry.id for entry in comparison.new_stale_entries] == ["s.py::renamed"]
    assert [c.nodeid for c in comparison.new_failures] == [
        "s.py::regressed[ws2]",
        "s.py::new_and_failing[ws2]",
    ]


def test_the_command_gates_on_a_new_fail_and_writes_a_page(tmp_path, capsys):
    night_1 = write_report(
        tmp_path / "n1.json",
        {"s.py::a[ws2]": "PASS", "s.py::b[ws2]": "FAIL"},
        date="2026-11-23T03:17:00Z",
    )
    night_2 = write_report(
        tmp_path / "n2.json",
        {"s.py::a[ws2]": "PASS", "s.py::b[ws2]": "PASS"},
        date="2026-11-24T03:17:00Z",
    )
    night_3 = write_report(
        tmp_path / "n3.json",
        {"s.py::a[ws2]": "FAIL", "s.py::b[ws2]": "PASS"},
        date="2026-11-25T03:17:00Z",
    )
    assert cli.main(["compare", str(night_1), str(night_2)]) == 0
    out = capsys.readouterr().out
    assert "fixed" in out and "s.py::b[ws2]" in out and out.rstrip().endswith("no new FAIL")
    assert "s.py::a[ws2]" not in out  # unchanged

    page = tmp_path / "pages" / "compare.html"
    assert cli.main(["compare", str(night_2), str(night_3), "--html", str(page)]) == 1
    out = capsys.readouterr().out
    assert "1 new FAIL: the exit status is 1" in out
    assert "s.py::a[ws2]: AssertionError: s.py::a[ws2] broke" in out
    assert "reproduce with: python -m pytest s.py::a[ws2]" in out
    elements = PageElements(page.read_text())
    changes = [attrs for tag, attrs in elements.elements if tag == "tr" and attrs.get("data-kind")]
    assert [(row["data-kind"], row["data-nodeid"]) for row in changes] == [
        (NEW_FAIL, "s.py::a[ws2]")
    ]
    # The failing side expands to its ranks and command, as on the run's own page.
    assert [row["data-nodeid"] for row in elements.with_class("details", "case")] == [
        "s.py::a[ws2]"
    ]
    assert "python -m pytest s.py::a[ws2]" in page.read_text()


def test_compare_refuses_what_it_cannot_read_in_the_users_words(tmp_path, capsys):
    good = write_report(
        tmp_path / "good.json", {"s.py::a[ws2]": "PASS"}, date="2026-11-24T00:00:00Z"
    )
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({**json.loads(good.read_text()), "schema_version": 99}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": []}))
    for path, message in (
        (newer, "schema version 99; this distconform reads versions 4, 5"),
        (other, "not a conformance report"),
        (tmp_path / "missing.json", "no such file"),
    ):
        assert cli.main(["compare", str(good), str(path)]) == cli.USAGE_ERROR
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["compare", str(good)])


def test_a_report_of_schema_version_4_is_read_without_ranks_or_command(tmp_path):
    path = write_report(tmp_path / "v4.json", {"s.py::a[ws2]": "FAIL"}, date="2026-11-20T00:00:00Z")
    data = json.loads(path.read_text())
    data["schema_version"] = 4
    for test in data["tests"]:
        del test["ranks"], test["reproduce"]
    path.write_text(json.dumps(data))
    (test,) = ConformanceReport.load(path).tests
    assert (test.status, test.ranks, test.reproduce) == ("FAIL", [], "")


def test_history_draws_each_implementation_and_the_step_benchmarks_in_date_order(tmp_path):
    runs = tmp_path / "artifacts"
    # Written out of date order, in nested directories, as CI artifacts arrive.
    write_report(
        runs / "night-2" / "conformance.json",
        {"s.py::a[ws2]": "PASS", "t.py::b[ws4]": "FAIL"},
        date="2026-11-24T03:17:00Z",
    )
    write_report(
        runs / "night-1" / "conformance.json",
        {"s.py::a[ws2]": "PASS", "t.py::b[ws4]": "PASS"},
        date="2026-11-23T03:17:00Z",
    )
    write_report(
        runs / "torch" / "conformance.json",
        {"s.py::a[ws2]": "PASS", "t.py::b[ws4]": "UNSUPPORTED"},
        impl="torch",
        date="2026-11-24T04:00:00Z",
    )
    shutil.copy(STEP_BENCHMARK, runs / STEP_BENCHMARK.name)
    (runs / "unrelated.json").write_text(json.dumps({"hello": "world"}))
    broken = json.loads((runs / "torch" / "conformance.json").read_text())
    (runs / "future.json").write_text(json.dumps({**broken, "schema_version": 99}))

    assert cli.main(["history", str(runs), "--out", str(tmp_path / "history.html")]) == 0
    text = (tmp_path / "history.html").read_text()
    elements = PageElements(text)
    assert [attrs["id"] for tag, attrs in elements.elements if tag == "h2"] == [
        "impl-reference",
        "impl-torch",
        "benchmarks",
    ]
    assert "future.json: schema version 99" in text  # listed, not dropped
    reference_table = text.split('id="impl-reference"')[1].split('id="impl-torch"')[0]
    # One column per run, oldest first: feature t.py went from 100 % to 0 %.
    header = reference_table.split("<thead>")[1].split("</thead>")[0]
    assert header.index("11-23 03:17") < header.index("11-24 03:17")
    row = reference_table.split("<strong>t.py</strong>")[1].split("</tr>")[0]
    assert row.index("100.0 %") < row.index("0.0 %")
    assert 's-PASS">100.0 %' in row and 's-FAIL">0.0 %' in row
    benchmark = json.loads(STEP_BENCHMARK.read_text())
    cases = {f"ws{r['world_size']} {r['model']} raf={r['raf']}" for r in benchmark["rows"]}
    section = text.split('id="benchmarks"')[1]
    assert all(case in section for case in cases)
    first = benchmark["rows"][0]
    assert f"{first['ratio']['median']:.3f}" in section
    # Per world size, one chart of step-time ratios and one of peak-memory ratios.
    assert section.count("<svg") == 2 * len({row["world_size"] for row in benchmark["rows"]})
