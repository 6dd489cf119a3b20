"""``@pytest.mark.world_size(*sizes, slow=...)``: the slow sizes run only with ``-m slow``."""

from __future__ import annotations

import textwrap

import pytest

MARKED_MODULE = textwrap.dedent(
    """
    import pytest

    @pytest.mark.world_size(2, 4, slow=(4,))
    def test_twin(rank_ctx):
        pass

    @pytest.mark.world_size(1, 2, 4, slow=4)
    @pytest.mark.parametrize("raf", [True, False])
    def test_grid(rank_ctx, raf):
        pass

    @pytest.mark.world_size(2)
    def test_plain(rank_ctx):
        pass

    @pytest.mark.world_size(4, slow=[4])
    def test_only_slow(rank_ctx):
        pass
    """
)

# Prints every item's marks before `-m` deselects anything, so one collection shows both
# what the plugin marked and what the default `-m "not slow"` keeps.
MARK_PRINTER = textwrap.dedent(
    """
    import pytest

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(items):
        for item in items:
            marks = sorted({mark.name for mark in item.iter_markers()} - {"parametrize"})
            print(f"MARKS {item.name} {','.join(marks)}")
    """
)


BAD_MODULES = {
    "test_missing": """
        import pytest

        @pytest.mark.world_size(2, slow=(4,))
        def test_twin(rank_ctx):
            pass
        """,
    "test_keyword": """
        import pytest

        @pytest.mark.world_size(2, 4, slwo=(4,))
        def test_typo(rank_ctx):
            pass
        """,
}


def test_slow_sizes_are_marked_slow_and_bad_ones_are_refused(pytester):
    # One inner session for both halves: each costs a Python start-up that imports torch.
    pytester.makepyfile(test_sizes=MARKED_MODULE, **BAD_MODULES)
    pytester.makeconftest(MARK_PRINTER)
    # --strict-markers in a project that never declared `slow`: the plugin declares it.
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--strict-markers",
        "-m",
        "not slow",
        "--collect-only",
        "-q",
        "--continue-on-collection-errors",
    )
    output = result.stdout.str()

    marks = dict(line.split()[1:] for line in result.outlines if line.startswith("MARKS "))
    assert marks == {
        "test_twin[ws2]": "world_size",
        "test_twin[ws4]": "slow,world_size",
        "test_grid[ws1-True]": "world_size",
        "test_grid[ws1-False]": "world_size",
        "test_grid[ws2-True]": "world_size",
        "test_grid[ws2-False]": "world_size",
        "test_grid[ws4-True]": "slow,world_size",
        "test_grid[ws4-False]": "slow,world_size",
        "test_plain[ws2]": "world_size",
        "test_only_slow[ws4]": "slow,world_size",
    }, output
    # The default `-m "not slow"` keeps exactly the items without the mark.
    selected = {
        line.split("::")[1] for line in result.outlines if line.startswith("test_sizes.py::")
    }
    assert selected == {name for name, mark in marks.items() if "slow" not in mark}
    result.stdout.fnmatch_lines(["6/10 tests collected (4 deselected), 2 errors*"])

    assert result.ret == pytest.ExitCode.TESTS_FAILED, output
    assert (
        "test_missing.py::test_twin: @pytest.mark.world_size(2, slow=...): slow world size 4 is "
        "not one of the test's world sizes; list it among them too, e.g. "
        "@pytest.mark.world_size(2, 4, slow=(4,))"
    ) in output
    assert (
        "test_keyword.py::test_typo: @pytest.mark.world_size takes only the keyword slow=, got slwo"
    ) in output
