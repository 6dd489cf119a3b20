"""Mutant ids survive unrelated edits, the sample is stable, the equivalents file is checked,
and the benchmark's report and test order do what they say (benchmarks/mutation*.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

# Scripts beside each other, not a package.
import mutation_report  # noqa: E402
from mutation_ids import (  # noqa: E402
    ID_PATTERN,
    EquivalentsError,
    catalogue,
    identify,
    load_equivalents,
    sample,
    stale_equivalents,
)
from mutation_operators import mutations_of  # noqa: E402
from mutation_runner import kill_order  # noqa: E402

SOURCE = """\
def f(a, b):
    if a < b:
        return a
    return b


def g(x):
    x.flush()
    x.flush()
    return x[0]
"""


def ids_of(source: str, path: str = "impl/reference/m.py") -> list[str]:
    return [m.id for m in identify(path, source.encode(), mutations_of(source))]


def test_ids_are_well_formed_and_unique():
    ids = ids_of(SOURCE)
    assert len(ids) == len(set(ids))
    assert all(ID_PATTERN.match(i) for i in ids), ids


def test_ids_survive_lines_added_above_and_reindentation():
    moved = "import os\n\n\n" + SOURCE.replace("def g(x):", "# a comment\ndef g(x):")
    assert set(ids_of(moved)) == set(ids_of(SOURCE))
    wrapped = "class C:\n" + "".join(
        f"    {line}\n" if line else "\n" for line in SOURCE.splitlines()
    )
    # Re-indented into a class: the qualname changes, the digests do not.
    digests = {i.split("::", 2)[2] for i in ids_of(SOURCE)}
    assert {i.split("::", 2)[2] for i in ids_of(wrapped)} == digests


def test_an_edited_line_gets_new_ids_and_the_rest_keep_theirs():
    edited = SOURCE.replace("if a < b:", "if a < b + 0:")
    before, after = set(ids_of(SOURCE)), set(ids_of(edited))
    gone = before - after
    assert gone and all("::f::" in i for i in gone)
    assert {i for i in before if "::g::" in i} <= after


def test_identical_lines_are_told_apart_by_occurrence():
    flushes = [i for i in ids_of(SOURCE) if "::g::drop-call::" in i]
    assert sorted(i.rsplit("::", 1)[1] for i in flushes) == ["0", "1"]


def test_the_sample_does_not_reshuffle_when_a_mutant_is_added_elsewhere():
    mutants = identify("impl/reference/m.py", SOURCE.encode(), mutations_of(SOURCE))
    more = mutants + identify(
        "impl/reference/n.py", b"def h(y):\n    y.go()\n", mutations_of("def h(y):\n    y.go()\n")
    )
    drawn = [m.id for m in sample(mutants, None, seed=7)]
    drawn_more = [m.id for m in sample(more, None, seed=7) if m.id in set(drawn)]
    assert drawn_more == drawn
    assert [m.id for m in sample(mutants, 3, seed=7)] == drawn[:3]
    assert [m.id for m in sample(mutants, None, seed=8)] != drawn


@pytest.fixture(scope="module")
def reference_mutants():
    return catalogue(ROOT)


def test_the_reference_catalogue_is_large_and_its_ids_unique(reference_mutants):
    mutants = reference_mutants
    assert len(mutants) >= 400, "the sample of 200 the issue asks for needs a larger pool"
    assert len({m.id for m in mutants}) == len(mutants)


# --- the equivalents file --------------------------------------------------------------------

GOOD_ID = "impl/reference/m.py::f::flip-compare::0123abcd::0"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "equivalents.toml"
    path.write_text(text)
    return path


def test_a_valid_equivalents_file_loads(tmp_path):
    path = write(
        tmp_path,
        f'[[equivalent]]\nid = "{GOOD_ID}"\nreason = "both branches return the same value here"\n',
    )
    assert load_equivalents(path) == {GOOD_ID: "both branches return the same value here"}
    assert load_equivalents(tmp_path / "missing.toml") == {}


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        (
            '[[equivalent]]\nid = "f.py:3"\nreason = "long enough to say something real"\n',
            "not a mutant id",
        ),
        (f'[[equivalent]]\nid = "{GOOD_ID}"\nreason = "same"\n', "argue"),
        (f'[[equivalent]]\nid = "{GOOD_ID}"\n', "exactly the keys"),
        (
            f'[[equivalent]]\nid = "{GOOD_ID}"\nreason = "long enough to say so"\nline = 3\n',
            "exactly the keys",
        ),
        (
            f'[[equivalent]]\nid = "{GOOD_ID}"\nreason = "long enough to say something"\n' * 2,
            "listed twice",
        ),
        ('[[equivalents]]\nid = "x"\n', "unknown top-level"),
        ("equivalent = 3\n", "array of tables"),
        ("[[equivalent]\n", "equivalents.toml"),
    ],
)
def test_a_malformed_equivalents_file_is_refused(tmp_path, text, complaint):
    with pytest.raises(EquivalentsError, match=complaint):
        load_equivalents(write(tmp_path, text))


def test_the_bundled_equivalents_are_valid_and_name_current_mutants(reference_mutants):
    equivalents = load_equivalents(ROOT / "benchmarks" / "mutation_equivalents.toml")
    stale = stale_equivalents(equivalents, reference_mutants)
    assert not stale, (
        f"benchmarks/mutation_equivalents.toml names mutants whose lines changed: {stale}; "
        "triage them again (python benchmarks/mutation.py --mutant ID) and update the file"
    )


# --- the report and the kill order -----------------------------------------------------------


def record(mutant_id: str, status: str, stage: str = "quick", **extra) -> dict:
    operator = mutant_id.split("::")[2]
    return {
        "id": mutant_id,
        "operator": operator,
        "status": status,
        "stage": stage,
        "line": 1,
        "description": "`a | b` -> `a`",
        **extra,
    }


def test_the_report_scores_caught_mutants_out_of_the_non_equivalent_ones():
    a, b, c, d, e = (
        f"impl/reference/m.py::f::{op}::0123abcd::0"
        for op in ("drop-call", "flip-bool", "flip-bool", "off-by-one", "off-by-one")
    )
    results = {
        "sampled": [a, b, c, d, e, "impl/reference/m.py::g::drop-call::0123abcd::0"],
        "mutants": [
            record(a, "killed"),
            record(b, "timeout", "full"),
            record(c, "survived", "full"),
            record(d, "equivalent", reason="the padding rows are never read back"),
            record(e, "killed", "full"),
        ],
    }
    total = mutation_report.tally(results["mutants"], 6)
    assert (total.quick, total.full_only, total.survived, total.pending) == (1, 2, 1, 1)
    assert total.quick_score == pytest.approx(1 / 4) and total.full_score == pytest.approx(3 / 4)
    table = mutation_report.format_table(results)
    assert "| **all** | 6 | 1 | 1 | 2 | 1 | 1 | 1 | 25 % | 75 % |" in table
    assert f"| `{c}` | 1 | `a \\| b` -> `a` |" in table  # survivors listed, pipes escaped
    assert "the padding rows are never read back" in table
    json.dumps(results)


def test_tests_that_killed_the_same_function_run_first():
    mutant = identify("impl/reference/m.py", SOURCE.encode(), mutations_of(SOURCE))[0]
    history = [
        {"killed_by": "t::anywhere", "file": "impl/reference/x.py", "qualname": "h"},
        {"killed_by": "t::anywhere", "file": "impl/reference/x.py", "qualname": "h"},
        {"killed_by": "t::same_file", "file": mutant.path, "qualname": "other"},
        {"killed_by": "t::same_function", "file": mutant.path, "qualname": mutant.qualname},
        {"killed_by": None, "file": mutant.path, "qualname": mutant.qualname},
    ]
    assert kill_order(history, mutant) == ["t::same_function", "t::same_file", "t::anywhere"]
