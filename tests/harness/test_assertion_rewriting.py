"""A failed ``assert`` on a rank reads as it would in plain pytest, on every launcher: the
compared values, pytest's comparison explanation, and helpers registered for rewriting."""

from __future__ import annotations

import pytest

TEST_FILE = """
import pytest
from helpers import check_same

@pytest.mark.world_size(2)
def test_list_differs_on_rank_1(rank_ctx):
    values = [1, 2, 3]
    assert values == [1, 2, rank_ctx.rank + 3]

@pytest.mark.world_size(2)
def test_helper_fails_on_rank_1(rank_ctx):
    check_same(rank_ctx.rank, 0)
"""

HELPERS = """
def check_same(got, expected):
    assert got == expected
"""


@pytest.fixture
def project(pytester):
    pytester.makeconftest("import pytest\npytest.register_assert_rewrite('helpers')\n")
    pytester.makepyfile(test_asserts=TEST_FILE, helpers=HELPERS)
    return pytester


@pytest.mark.parametrize(
    "options",
    [("--launcher", "process"), ("--launcher", "thread", "--import-mode=importlib")],
    ids=["process", "thread-importlib"],
)
def test_rank_assertions_are_rewritten(project, options):
    result = project.runpytest_subprocess("-p", "no:cacheprovider", *options)
    output = result.stdout.str()
    result.assert_outcomes(failed=2)
    assert "rank 1 failed: AssertionError: assert [1, 2, 3] == [1, 2, 4]" in output
    assert "At index 2 diff: 3 != 4" in output
    assert "rank 1 failed: AssertionError: assert 1 == 0" in output
