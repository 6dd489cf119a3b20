"""The verdict: one line per profile and one for the run, the same words in the terminal,
the Markdown, the page and the JSON field a CI gate reads.

The rules come from the documented semantics (``conformance/verdict.py``): a failing case
or an undeclared required capability makes a profile NOT CONFORMANT whatever its pass
rate; an expected failure is a recorded deviation; an extension nobody declared is NOT
CLAIMED, never a failure.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest

from distconform.conformance.pages.run import render_run
from distconform.conformance.renderers import FILE_FORMATS, terminal
from distconform.conformance.renderers.format import write_files
from distconform.conformance.report import ConformanceReport
from distconform.conformance.verdict import (
    CONFORMANT,
    INCOMPLETE,
    NOT_ASSESSED,
    NOT_CLAIMED,
    NOT_CONFORMANT,
    Verdict,
    profile_verdict,
    run_verdict,
)
from tests.conformance.report_checks import PageElements, check_report_dir
from tests.conformance.test_profiles import build, case_report
from tests.suites.child_session import ROOT


def figures(*, required=True, missing=(), applied=0, cases=None, **counts) -> dict:
    return {
        "name": "p",
        "required": required,
        "missing_capabilities": list(missing),
        "applied": applied,
        "cases": applied if cases is None else cases,
        "counts": counts,
    }


@pytest.mark.parametrize(
    ("profile", "complete", "expected"),
    [
        (figures(applied=51, PASS=20, FAIL=31), True, "p: NOT CONFORMANT (31 of 51 cases fail)"),
        # A failure is a failure even in a run cut short.
        (figures(applied=3, PASS=2, FAIL=1), False, "p: NOT CONFORMANT (1 of 3 cases fail)"),
        (figures(applied=2, PASS=2, missing=["prefetch"]), True,
         "p: NOT CONFORMANT (does not declare prefetch)"),
        (figures(applied=2, PASS=2), False, "p: INCOMPLETE (the run stopped before its end)"),
        (figures(applied=0, cases=4, UNSUPPORTED=4), True,
         "p: NOT ASSESSED (no case of it applied)"),
        (figures(required=False, missing=["hsdp"], applied=0, cases=3, UNSUPPORTED=3), True,
         "p: NOT CLAIMED (3 cases UNSUPPORTED)"),
        # Declared, every case skipped on this device: not assessed, and not "unsupported".
        (figures(required=False, applied=0, cases=2, SKIP=2), True,
         "p: NOT ASSESSED (2 cases skipped here)"),
        # An extension is judged on the cases it applied: a missing capability is not a bug.
        (figures(required=False, missing=["hsdp"], applied=2, cases=3, PASS=2), True,
         "p: CONFORMANT"),
        (figures(applied=10, PASS=7, XFAIL=3), True, "p: CONFORMANT with 3 recorded deviations"),
        (figures(applied=2, PASS=1, XFAIL=1), True, "p: CONFORMANT with 1 recorded deviation"),
        (figures(applied=2, PASS=1, XPASS=1), True, "p: CONFORMANT"),
    ],
)  # fmt: skip
def test_a_profiles_verdict_follows_the_documented_rules(profile, complete, expected):
    assert profile_verdict(profile, complete=complete).line() == expected


def test_the_runs_verdict_names_the_profiles_that_fail_it():
    ok = Verdict("core", CONFORMANT)
    bad = Verdict("core", NOT_CONFORMANT, "1 of 2 cases fail")
    unclaimed = Verdict("hsdp", NOT_CLAIMED, "2 cases UNSUPPORTED")

    def line(profiles, complete=True, **counts):
        return run_verdict(profiles, counts, complete=complete).line()

    assert line([bad, Verdict("x", NOT_CONFORMANT, "")], FAIL=1) == (
        "verdict: NOT CONFORMANT (to core, x)"
    )
    # A failing test outside every profile still fails the run.
    assert line([ok], FAIL=2) == "verdict: NOT CONFORMANT (2 tests fail)"
    assert line([ok], complete=False) == "verdict: INCOMPLETE (the run stopped before its end)"
    assert line([]) == "verdict: NOT ASSESSED (no test of this run is a conformance case)"
    assert line([Verdict("core", NOT_ASSESSED, "x"), unclaimed]) == (
        "verdict: NOT ASSESSED (no case of core applied)"
    )
    assert line([unclaimed]) == "verdict: NOT ASSESSED (no case applied)"
    # An extension whose cases all skipped here leaves the run assessed by the others.
    skipped_here = Verdict("post_optim_event", NOT_ASSESSED, "2 cases skipped here", required=False)
    assert line([ok, skipped_here], PASS=3) == "verdict: CONFORMANT"
    assert (
        line([ok, unclaimed], PASS=5, XFAIL=2) == "verdict: CONFORMANT with 2 recorded deviations"
    )
    assert run_verdict([ok, unclaimed], {"PASS": 1}, complete=True).conformant
    assert not run_verdict([ok], {}, complete=False).conformant
    assert {v.tone for v in (ok, bad, unclaimed)} == {"good", "bad", "neutral"}
    assert Verdict("p", INCOMPLETE).tone == "bad"


def written(built, out):
    """``built`` written to ``out`` with a whole environment, as a real run has."""
    built.environment = {
        "implementation": {**built.environment["implementation"], "spec": "acme"},
        "torch_version": "2.13.0", "python": "3.11.7", "platform": "Linux",
        "backend_declaration": None, "launcher": "process", "backend": "gloo",
        "device": "cpu", "world_sizes": [2], "seed": 0, "date": "2026-11-26T00:00:00Z",
        "backend_plugins": [], "expectations": None, "command": ["pytest"],
        "junit_xml": None,
    }  # fmt: skip
    write_files(built, out, FILE_FORMATS)
    return check_report_dir(out)


def page_verdicts(html: str) -> tuple[dict, list[tuple[str, str]]]:
    """The page's verdict banner attributes and its profile verdicts (class, text)."""
    page = PageElements(html)
    (banner,) = [attrs for tag, attrs in page.elements if attrs.get("id") == "verdict"]
    return banner, [attrs["class"] for attrs in page.with_class("li", "verdict")]


def test_a_failing_core_case_is_not_conformant_in_terminal_markdown_page_and_json(tmp_path):
    built = build(
        case_report("a::core_ok", "passed", ""),
        case_report("a::core_failed", "failed", "prefetch", "wrong gradient"),
        case_report("a::hsdp", "passed", "hsdp"),
    )
    data = written(built, tmp_path)
    expected = "verdict: NOT CONFORMANT (to fsdp2-core)"
    assert terminal.lines(built)[0] == expected
    assert terminal.lines(built)[-1].startswith(f"{expected}; conformance 66.7 %")
    markdown = (tmp_path / "conformance.md").read_text()
    assert "verdict: **NOT CONFORMANT** (to fsdp2-core)" in markdown
    assert "- fsdp2-core: **NOT CONFORMANT** (1 of 2 cases fail)" in markdown
    assert data["verdict"] == {
        "name": "verdict",
        "status": "NOT CONFORMANT",
        "conformant": False,
        "line": expected,
    }
    assert [(p["name"], p["verdict"]["status"]) for p in data["profiles"]] == [
        ("fsdp2-core", "NOT CONFORMANT"),
        ("hsdp", "CONFORMANT"),
    ]
    html = (tmp_path / "conformance.html").read_text()
    banner, profile_classes = page_verdicts(html)
    assert banner["class"] == "banner bad"
    assert profile_classes == ["verdict bad", "verdict good"]
    assert expected in html
    # Completeness is a fact about the run, not a grade: never the green of a verdict.
    assert 'class="banner good"' not in html


def test_a_clean_run_with_deviations_is_conformant_everywhere(tmp_path):
    built = build(
        case_report("a::core_ok", "passed", ""),
        case_report("a::core_known", "failed", "prefetch", "known"),
    )
    built.tests[1].status = "XFAIL"  # as an expectations entry would make it
    data = written(built, tmp_path)
    line = "verdict: CONFORMANT with 1 recorded deviation"
    assert terminal.lines(built)[0] == line
    assert (data["verdict"]["conformant"], data["verdict"]["line"]) == (True, line)
    banner, _ = page_verdicts((tmp_path / "conformance.html").read_text())
    assert banner["class"] == "banner good"


def test_a_report_saved_before_verdicts_gets_the_same_verdict_on_its_page(tmp_path):
    built = build(case_report("a::core_failed", "failed", "", "boom"))
    data = built.to_json()
    old = {**copy.deepcopy(data), "schema_version": 5}
    del old["verdict"]
    for profile in old["profiles"]:
        del profile["verdict"]
    loaded = ConformanceReport.from_json(old, tmp_path / "old.json")
    run, profiles = loaded.verdicts()
    assert run.line() == data["verdict"]["line"]
    assert [v.line() for v in profiles] == [p["verdict"]["line"] for p in data["profiles"]]
    banner, _ = page_verdicts(render_run(loaded))
    assert banner["class"] == "banner bad"


@pytest.mark.slow  # an end-to-end session of tens of seconds; nightly (tox -e slow) keeps it
def test_a_broken_implementation_run_reports_not_conformant(tmp_path):
    """Through the vendor command: a reference that skips the gradient average."""
    out = tmp_path / "report"
    command = [
        sys.executable, "-m", "distconform", "conformance",
        "--impl", "tests.suites.broken:skip_grad_average", "--quick", "--out", str(out),
        "suites/test_training_parity.py::test_train_parity_single_group_shard_dim0"
        "[ws2-lin_shapes=7x15_15x3]",
        "-p", "no:cacheprovider",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((out / "conformance.json").read_text())
    assert data["summary"]["counts"]["FAIL"] == 1, done.stdout[-3000:]
    assert data["verdict"]["status"] == "NOT CONFORMANT"
    assert not data["verdict"]["conformant"]
    summary = done.stdout.split("= conformance =", 1)[1].splitlines()
    assert summary[1] == "verdict: NOT CONFORMANT (to fsdp2-core)", done.stdout[-3000:]
    assert "  fsdp2-core: NOT CONFORMANT (1 of 1 cases fail)" in summary
    assert "verdict: **NOT CONFORMANT**" in (out / "conformance.md").read_text()
    banner, _ = page_verdicts((out / "conformance.html").read_text())
    assert banner["class"] == "banner bad"


def test_a_suite_module_missing_a_package_is_named_and_leaves_the_run_incomplete(tmp_path):
    """hypothesis made unimportable: the property cases' module is skipped at collection,
    which pytest reports with no test; the report names it and the verdict is INCOMPLETE."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "hypothesis.py").write_text(
        "raise ModuleNotFoundError('hidden by the test', name='hypothesis')\n"
    )
    out = tmp_path / "report"
    command = [
        sys.executable, "-m", "distconform", "conformance", "--impl", "reference",
        "--out", str(out),
        "suites/properties/test_training_properties.py", "-p", "no:cacheprovider",
        "-p", "no:hypothesispytest",  # hypothesis's own pytest plugin needs hypothesis
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    data = json.loads((out / "conformance.json").read_text())
    (module,) = data["tests"]
    assert module["nodeid"] == "suites/properties/test_training_properties.py"
    assert (module["status"], module["reason"].split(";")[0]) == (
        "SKIP",
        "MISSING DEPENDENCY: hypothesis is not installed",
    )
    assert data["verdict"]["line"] == (
        "verdict: INCOMPLETE (1 suite module not run: a package is missing)"
    ), done.stdout[-2000:]
    assert "verdict: INCOMPLETE" in done.stdout, done.stdout[-2000:]
