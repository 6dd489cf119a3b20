"""Checks every conformance report in the tests passes: its JSON against the shipped JSON
Schema, its Markdown through a CommonMark renderer, its HTML page through an HTML parser
(the structure a reader sees) and its JUnit XML against the JSON's statuses."""

from __future__ import annotations

import json
import re
from collections import Counter
from functools import cache
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import jsonschema
from markdown_it import MarkdownIt

from distconform import conformance
from distconform.conformance.renderers import FILE_FORMATS, terminal
from distconform.conformance.report import ConformanceReport

SCHEMA_FILE = Path(conformance.__file__).parent / "conformance.schema.json"

# Paragraphs that open a section of the Markdown report: each must stand on its own at the
# top level, never swallowed into the list above it.
_SECTION = re.compile(
    r"^(\*\*INCOMPLETE|verdict: |profiles \(|Run:|FAIL —|XPASS —|XFAIL —|"
    r"UNSUPPORTED:|Not declared by the backend:|stale expectation:)"
)


@cache
def _validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def check_json(report: dict[str, Any]) -> None:
    errors = sorted(_validator().iter_errors(report), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors[:10]
    )


def check_markdown(text: str) -> None:
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    misplaced = []
    for index, token in enumerate(tokens):
        if token.type != "inline":
            continue
        opener = tokens[index - 1]
        on_its_own = opener.type == "paragraph_open" and opener.level == 0
        for number, line in enumerate(token.content.splitlines()):
            # A heading must open a top-level paragraph; one on a later line was folded
            # into the block above it (a lazy continuation of a list item, say).
            if _SECTION.match(line.strip()) and (number > 0 or not on_its_own):
                misplaced.append(line)
    assert not misplaced, f"section headings rendered inside another block: {misplaced}"
    tables = [t for t in tokens if t.type == "table_open"]
    assert len(tables) == 1, f"expected the one feature table, rendered {len(tables)}"
    heading = [t for t in tokens if t.type == "heading_open"]
    assert heading and heading[0].tag == "h1", "the report starts with its title"


class PageElements(HTMLParser):
    """Every start tag of a page with its attributes, in document order."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str | None]]] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, dict(attrs)))

    def with_class(self, tag: str, cls: str) -> list[dict[str, str | None]]:
        return [
            attrs
            for name, attrs in self.elements
            if name == tag and cls in (attrs.get("class") or "").split()
        ]


def check_html(text: str, report: dict[str, Any]) -> PageElements:
    """The page of ``report``: self-contained, one matrix cell per feature and world size,
    one expandable row per test."""
    page = PageElements(text)
    tags = Counter(tag for tag, _ in page.elements)
    assert tags["script"] == 0, "the page needs no script"
    external = [
        (tag, attrs)
        for tag, attrs in page.elements
        if tag in ("link", "img", "iframe") or (attrs.get("src") or "").startswith("http")
    ]
    assert not external, f"the page loads something from outside the file: {external}"
    features = {test["feature"] for test in report["tests"]}
    sizes = {test["world_size"] for test in report["tests"]}
    cells = page.with_class("td", "cell")
    assert len(cells) == len(features) * len(sizes), (len(cells), features, sizes)
    assert {(c["data-feature"], c["data-ws"]) for c in cells} == {
        (f, "" if ws is None else str(ws)) for f in features for ws in sizes
    }
    rows = page.with_class("details", "case")
    assert Counter(row["data-nodeid"] for row in rows) == Counter(
        test["nodeid"] for test in report["tests"]
    )
    assert {row["data-nodeid"]: row["data-status"] for row in rows} == {
        test["nodeid"]: test["status"] for test in report["tests"]
    }
    return page


def check_report_dir(out: Path) -> dict[str, Any]:
    """The report in ``out``, after the three checks."""
    report = json.loads((out / "conformance.json").read_text())
    check_json(report)
    check_markdown((out / "conformance.md").read_text())
    check_html((out / "conformance.html").read_text(), report)
    check_junit((out / "conformance.junit.xml").read_text(), report)
    return report


def check_saved_renders_as_the_run(out: Path, stdout: str) -> ConformanceReport:
    """The report in ``out``, read back from its ``conformance.json``: it renders every file
    the run wrote, and the terminal summary the run printed, to the same text."""
    loaded = ConformanceReport.load(out / "conformance.json")
    for fmt in FILE_FORMATS:
        assert fmt.render(loaded) == (out / fmt.file_name).read_text(), fmt.name
    # The summary: the lines after pytest's "=== conformance ===" up to the plugin's note.
    printed = stdout.split("= conformance =", 1)[1].split("\n", 1)[1]
    printed = printed.split("\nreport written to ", 1)[0]
    assert terminal.FORMAT.render(loaded) == printed + "\n"
    return loaded


#: The JUnit element each status must give (None: a testcase with no result element).
_JUNIT_ELEMENT = {
    "PASS": None,
    "XPASS": None,
    "FAIL": "failure",
    "XFAIL": "skipped",
    "UNSUPPORTED": "skipped",
    "SKIP": "skipped",
}


def check_junit(text: str, report: dict[str, Any]) -> None:
    """One testcase per test of the JSON, in its order, with its status and the element
    that status gives; the suite's counts add up."""
    (suite,) = ElementTree.fromstring(text).iter("testsuite")
    cases = list(suite.iter("testcase"))
    assert len(cases) == len(report["tests"]) == int(suite.get("tests"))
    for case, test in zip(cases, report["tests"], strict=True):
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        assert properties["status"] == test["status"], test["nodeid"]
        name = case.get("name")
        assert test["nodeid"].endswith(name), (test["nodeid"], name)
        results = [child.tag for child in case if child.tag != "properties"]
        expected = _JUNIT_ELEMENT[test["status"]]
        if expected == "failure" and test["when"] != "call":
            expected = "error"
        assert results == ([expected] if expected else []), (test["nodeid"], results)
    statuses = Counter(test["status"] for test in report["tests"])
    failed = sum(1 for case in cases if case.find("failure") is not None)
    errors = sum(1 for case in cases if case.find("error") is not None)
    assert failed + errors == statuses["FAIL"]
    assert (int(suite.get("failures")), int(suite.get("errors"))) == (failed, errors)
    skipped = statuses["XFAIL"] + statuses["UNSUPPORTED"] + statuses["SKIP"]
    assert int(suite.get("skipped")) == skipped
