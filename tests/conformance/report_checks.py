"""Checks every conformance report in the tests passes: its JSON against the shipped JSON
Schema, and its Markdown through a CommonMark renderer (the structure a reader sees)."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
from markdown_it import MarkdownIt

import conformance

SCHEMA_FILE = Path(conformance.__file__).parent / "conformance.schema.json"

# Paragraphs that open a section of the Markdown report: each must stand on its own at the
# top level, never swallowed into the list above it.
_SECTION = re.compile(
    r"^(\*\*INCOMPLETE|\*\*NOT CONFORMANT|profiles \(|Run:|FAIL —|XPASS —|XFAIL —|"
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


def check_report_dir(out: Path) -> dict[str, Any]:
    """The report in ``out``, after both checks."""
    report = json.loads((out / "conformance.json").read_text())
    check_json(report)
    check_markdown((out / "conformance.md").read_text())
    return report
