"""The case catalogue (``docs/cases.md``, ``python -m distconform.suites.catalogue``) and the
descriptions of the case table it is rendered from.

The committed catalogue must be what the table renders to now; a stale copy, and a table row
without a description, make ``--check`` fail (shown on copies in a temporary directory).
"""

from __future__ import annotations

import re

import pytest

from distconform.suites.cases import (
    BACKEND,
    BACKEND_CASES_FILE,
    CASES_FILE,
    load_cases,
    parse_cases,
)
from distconform.suites.catalogue import (
    BACKEND_CATALOGUE_FILE,
    CATALOGUE_FILE,
    COMMAND,
    case_areas,
    main,
    render_file,
)

DESCRIPTION = re.compile(r'^description = """.*?"""\n', re.MULTILINE | re.DOTALL)
FIRST_CASE = "fsdp.forward_inputs.move_to_device"


def replace_description(text: str, case_id: str, replacement: str) -> str:
    """``text`` with the description of ``case_id``'s row replaced (the profiles have some
    too, above the cases)."""
    start = text.index(f'[case."{case_id}"]')
    changed = DESCRIPTION.sub(replacement, text[start:], count=1)
    assert changed != text[start:], f"no description in {case_id}'s row"
    return text[:start] + changed


@pytest.mark.parametrize(
    ("cases_file", "subject", "catalogue"),
    [
        (CASES_FILE, "implementation", CATALOGUE_FILE),
        (BACKEND_CASES_FILE, BACKEND, BACKEND_CATALOGUE_FILE),
    ],
)
def test_committed_catalogue_is_current(cases_file, subject, catalogue):
    rendered, _ = render_file(cases_file, subject)
    assert catalogue.is_file(), f"{catalogue} is missing: run `{COMMAND}`"
    assert catalogue.read_text() == rendered, (
        f"{catalogue.name} is out of date with {cases_file.name}: run `{COMMAND}` and commit it"
    )


def test_every_case_has_a_description_and_a_row_in_the_catalogue():
    cases = load_cases()
    text = CATALOGUE_FILE.read_text() + BACKEND_CATALOGUE_FILE.read_text()
    for case_id, row in cases.items():
        assert row.description, case_id
        assert "cases.md" not in row.upstream and "§" not in row.upstream, case_id
        description = row.description.replace("|", "\\|")
        assert f"| `{case_id}` | {description} |" in text, case_id


def test_every_case_belongs_to_an_area():
    areas = case_areas(CASES_FILE.read_text())
    areas.update(case_areas(BACKEND_CASES_FILE.read_text()))
    assert set(areas) == set(load_cases())
    assert "other cases" not in areas.values()


def test_check_passes_on_a_fresh_catalogue_and_fails_on_a_stale_one(tmp_path, capsys):
    output = tmp_path / "cases.md"
    assert main(["--check", "--output", str(output)]) == 1
    assert f"run `{COMMAND}`" in capsys.readouterr().err

    assert main(["--output", str(output)]) == 0
    assert main(["--check", "--output", str(output)]) == 0
    capsys.readouterr()

    output.write_text(output.read_text().replace("Conformance case catalogue", "Old catalogue"))
    assert main(["--check", "--output", str(output)]) == 1
    err = capsys.readouterr().err
    assert "out of date" in err and f"run `{COMMAND}`" in err, err


def test_a_row_without_a_description_is_refused(tmp_path, capsys):
    text = CASES_FILE.read_text()
    broken = tmp_path / "cases.toml"
    broken.write_text(replace_description(text, FIRST_CASE, ""))
    output = tmp_path / "cases.md"
    output.write_text(CATALOGUE_FILE.read_text())
    assert main(["--check", "--cases", str(broken), "--output", str(output)]) != 0
    err = capsys.readouterr().err
    assert f"case {FIRST_CASE!r}: no description" in err, err

    broken.write_text(replace_description(text, FIRST_CASE, 'description = "  "\n'))
    assert main(["--cases", str(broken), "--output", str(output)]) != 0
    assert "description must be a non-empty string" in capsys.readouterr().err
    assert output.read_text() == CATALOGUE_FILE.read_text(), "a broken table wrote a catalogue"


def test_descriptions_are_validated_by_the_parser():
    row = '[case."c"]\nworld_sizes = [2]\n'
    assert parse_cases(row)["c"].description == ""
    with pytest.raises(ValueError, match="no description"):
        parse_cases(row, require_description=True)
    with pytest.raises(ValueError, match="non-empty string"):
        parse_cases(row + "description = 3\n")
    described = parse_cases(row + 'description = """Two \\\n  lines."""\n')
    assert described["c"].description == "Two lines."
    with pytest.raises(ValueError, match="unknown keys"):
        parse_cases(row + 'sections = ["2.1"]\n')
