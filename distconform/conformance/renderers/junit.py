"""``conformance.junit.xml``: the report as JUnit XML, for CI systems that read test results.

One ``testcase`` per test, named as pytest's own JUnit writer names it (``classname`` the
module path and classes, ``name`` the function and its parameters). The conformance status
decides the element: FAIL is a ``failure`` (an ``error`` when setup or teardown failed),
XFAIL, UNSUPPORTED and SKIP are ``skipped``, PASS and XPASS have none (an XPASS still counts
as conformant). Each testcase carries its status, case, capabilities, per-rank outcomes,
reproduce command and the implementation an inherited expectation came from as properties;
the suite carries the run's environment and verdict.
"""

from __future__ import annotations

from xml.etree import ElementTree

from distconform.conformance.renderers.format import Format
from distconform.conformance.report import ConformanceReport, TestResult
from distconform.conformance.statuses import STATUSES

_SKIPPED = {
    "XFAIL": "pytest.xfail",
    "UNSUPPORTED": "conformance.unsupported",
    "SKIP": "pytest.skip",
}
_ENVIRONMENT_KEYS = ("torch_version", "python", "launcher", "backend", "device", "seed", "date")


def render(report: ConformanceReport) -> str:
    counts = report.counts()
    failed = [r for r in report.tests if r.status == "FAIL"]
    errors = sum(1 for r in failed if r.when != "call")
    suite = ElementTree.Element(
        "testsuite",
        name="distconform conformance",
        tests=str(len(report.tests)),
        failures=str(len(failed) - errors),
        errors=str(errors),
        skipped=str(sum(counts[s] for s in _SKIPPED)),
        time=f"{sum(r.duration_s for r in report.tests):.3f}",
        timestamp=str(report.environment.get("date") or ""),
    )
    properties = ElementTree.SubElement(suite, "properties")
    verdict, _ = report.verdicts()
    _property(properties, "verdict", verdict.line())
    implementation = report.environment.get("implementation") or {}
    if implementation.get("name"):
        _property(properties, "implementation", str(implementation["name"]))
    for key in _ENVIRONMENT_KEYS:
        if report.environment.get(key) is not None:
            _property(properties, key, str(report.environment[key]))
    for status in STATUSES:
        _property(properties, f"count.{status}", str(counts[status]))
    for result in report.tests:
        suite.append(_testcase(result))
    root = ElementTree.Element("testsuites")
    root.append(suite)
    ElementTree.indent(root)
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n'
        + ElementTree.tostring(root, encoding="unicode")
        + "\n"
    )


def _testcase(result: TestResult) -> ElementTree.Element:
    classname, name = _names(result.nodeid)
    case = ElementTree.Element(
        "testcase", classname=classname, name=name, time=f"{result.duration_s:.3f}"
    )
    properties = ElementTree.SubElement(case, "properties")
    _property(properties, "status", result.status)
    _property(properties, "feature", result.feature)
    if result.case:
        _property(properties, "case", result.case)
    if result.capabilities:
        _property(properties, "capabilities", " ".join(result.capabilities))
    if result.ranks:
        outcomes = " ".join(f"{r['rank']}:{r['outcome']}" for r in result.ranks)
        _property(properties, "rank_outcomes", outcomes)
    if result.reproduce:
        _property(properties, "reproduce", result.reproduce)
    if result.inherited_from:
        _property(properties, "inherited_from", result.inherited_from)
    if result.infrastructure_retry:
        _property(properties, "infrastructure_retry", result.infrastructure_retry)
    if result.status == "FAIL":
        tag = "failure" if result.when == "call" else "error"
        failure = ElementTree.SubElement(case, tag, message=result.message or result.reason)
        failure.text = result.detail or result.message
    elif result.status in _SKIPPED:
        message = result.inheritance_note or result.reason or result.message
        ElementTree.SubElement(case, "skipped", type=_SKIPPED[result.status], message=message)
    return case


def _names(nodeid: str) -> tuple[str, str]:
    """pytest's JUnit names: ``a/b/test_x.py::TestC::test_d[p]`` gives ``a.b.test_x.TestC``
    and ``test_d[p]``."""
    path, *scopes = nodeid.split("::")
    module = path.removesuffix(".py").replace("/", ".")
    if not scopes:
        return module, path
    return ".".join([module, *scopes[:-1]]), scopes[-1]


def _property(parent: ElementTree.Element, name: str, value: str) -> None:
    ElementTree.SubElement(parent, "property", name=name, value=value)


FORMAT = Format("junit", "conformance.junit.xml", render)
