"""Expectations files: id patterns, parsing errors, and tolerance lookup."""

from __future__ import annotations

import pytest

from distconform.conformance.expectations import ExpectationsError, load, matches
from distconform.conformance.tolerance import Tolerance

NODE = "suites/test_training.py::test_mlp[ws2-raf=True]"


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        (NODE, True),
        ("suites/test_training.py::test_mlp", True),  # every parametrization
        ("suites/test_training.py", True),  # the whole file
        ("suites/test_training.py::test_ml", False),  # not at a boundary
        ("suites/test_train", False),
        ("suites/test_training.py::test_mlp[[]ws2-*", True),  # glob, literal [
        ("suites/*::test_mlp*", True),
        ("suites/*::test_mlp[[]ws4*", False),
    ],
)
def test_pattern_matching(pattern, expected):
    assert matches(pattern, NODE) is expected


def test_entries_keep_their_line_and_lookups_follow_file_order(tmp_path):
    path = tmp_path / "impl.toml"
    path.write_text(
        "# known differences\n"
        "[[xfail]]\n"
        'id = "suites/test_training.py::test_mlp"\n'
        'reason = "first"\n'
        'category = "NUMERICS"\n'
        'link = "https://example.invalid/1"\n'
        "\n"
        "[[xfail]]\n"
        'id = "suites/test_training.py"\n'
        'reason = "second"\n'
        "\n"
        "[[tolerance]]\n"
        'id = "suites/test_training.py"\n'
        "rtol = 1e-3\n"
        'reason = "broad"\n'
        "[[tolerance]]\n"
        'id = "suites/test_training.py::test_mlp"\n'
        "atol = 1e-4\n"
        'reason = "narrow, later: wins"\n'
    )
    found = load(path)
    first = found.xfail_for(NODE)
    assert (first.reason, first.category, first.line) == ("first", "NUMERICS", 3)
    assert first.xfail_reason() == "[NUMERICS] first (https://example.invalid/1)"
    assert found.xfail_for("suites/test_training.py::test_other").reason == "second"
    assert found.xfail_for("suites/test_other.py::test_mlp") is None
    assert found.tolerance_for(NODE).atol == 1e-4
    assert found.tolerance_for("suites/test_training.py::test_x").rtol == 1e-3


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[xfail]]\nid = "a"\n', "needs a reason"),
        ('[[xfail]]\nreason = "r"\n', "needs id"),
        ('[[xfail]]\nid = "a"\nreason = "r"\ncategory = "FLAKY"\n', "category 'FLAKY'"),
        ('[[xfail]]\nid = "a"\nreason = "r"\nstrict = true\n', "unknown key(s) ['strict']"),
        ('[[tolerance]]\nid = "a"\nreason = "r"\n', "give rtol, atol or both"),
        ('[[tolerance]]\nid = "a"\nreason = "r"\nrtol = -1\n', "rtol must be a number >= 0"),
        ('[xfail]\nid = "a"\n', "write [[xfail]], not [xfail]"),
        ('[[skip]]\nid = "a"\n', "unknown table(s) ['skip']"),
        ("[[xfail]\n", "expectations file"),
    ],
)
def test_malformed_files_are_refused_with_the_entry_named(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ExpectationsError) as caught:
        load(path)
    assert message in str(caught.value)
    assert str(path) in str(caught.value)


def test_tolerance_override_wins_only_where_set():
    assert Tolerance().resolve(1e-3, 1e-3) == {"rtol": 1e-3, "atol": 1e-3}
    assert Tolerance(rtol=1e-2).resolve(1e-3, None) == {"rtol": 1e-2, "atol": None}
    assert not Tolerance()
    assert Tolerance(atol=0.0)


def test_only_entries_for_collected_or_missing_files_are_stale(tmp_path):
    from types import SimpleNamespace

    from distconform.conformance.expectations import Entry
    from distconform.conformance.plugin import _could_have_matched

    (tmp_path / "suites").mkdir()
    (tmp_path / "suites" / "test_other.py").write_text("")
    config = SimpleNamespace(rootpath=tmp_path)
    collected = {"suites/test_run.py"}

    def stale(pattern: str) -> bool:
        entry = Entry("xfail", pattern, "r", tmp_path / "x.toml", 1)
        return _could_have_matched(entry, collected, config)

    assert stale("suites/test_run.py::test_gone")  # its file ran: the test is gone
    assert stale("suites/test_removed.py::test_x")  # the file itself is gone
    assert stale("suites/*::test_gone")  # a glob could have matched anything
    assert not stale("suites/test_other.py::test_x")  # exists, just not collected this run
